package model

import (
	"bytes"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu/objective"
)

func testModel(t testing.TB, cfg Config, seed uint64) *Model {
	t.Helper()
	m, err := New(cfg, seed)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// lossOf is a fixed scalar of the logits: Σ_i Σ_v c_iv · logits_iv with
// pseudo-random coefficients, so every logit gets a distinct gradient.
func lossOf(m *Model, tokens, positions []int32, coef []float32) float64 {
	logits := make([]float32, len(tokens)*m.Config.Vocab)
	if err := m.Forward(tokens, positions, nil, nil, logits); err != nil {
		panic(err)
	}
	var s float64
	for i, z := range logits {
		s += float64(coef[i]) * float64(z)
	}
	return s
}

// TestGradientFiniteDifference checks Backward against central finite
// differences (docs/PIPELINE.md §18 Gate A) on every parameter tensor, on a row of
// two segments.
func TestGradientFiniteDifference(t *testing.T) {
	cfg := Config{Vocab: 7, Window: 3, Embed: 4, Hidden: 5}
	m := testModel(t, cfg, 11)
	// Make the output weights large enough that every path matters.
	r := rand.New(rand.NewPCG(3, 4))
	for i := range m.Params {
		m.Params[i] = float32(r.NormFloat64() * 0.5)
	}
	tokens := []int32{1, 2, 3, 4, 5, 6, 1, 2}
	positions := []int32{0, 1, 2, 3, 4, 0, 1, 2}
	coef := make([]float32, len(tokens)*cfg.Vocab)
	for i := range coef {
		coef[i] = float32(r.NormFloat64())
	}
	var tape Tape
	logits := make([]float32, len(coef))
	if err := m.Forward(tokens, positions, nil, &tape, logits); err != nil {
		t.Fatal(err)
	}
	grad := make([]float32, cfg.NumParams())
	if err := m.Backward(&tape, coef, grad); err != nil {
		t.Fatal(err)
	}
	const eps = 1e-2
	maxRel := 0.0
	for i := range m.Params {
		orig := m.Params[i]
		m.Params[i] = orig + eps
		up := lossOf(m, tokens, positions, coef)
		m.Params[i] = orig - eps
		down := lossOf(m, tokens, positions, coef)
		m.Params[i] = orig
		fd := (up - down) / (2 * eps)
		diff := math.Abs(fd - float64(grad[i]))
		rel := diff / math.Max(1, math.Abs(fd))
		if rel > maxRel {
			maxRel = rel
		}
		if rel > 2e-2 {
			t.Errorf("param %d: backward %g, finite difference %g", i, grad[i], fd)
		}
	}
	t.Logf("max relative gradient error %.2e over %d parameters", maxRel, len(m.Params))
}

// TestSegmentIsolation: the logits of a segment do not depend on the
// tokens of the segment before it in the row.
func TestSegmentIsolation(t *testing.T) {
	cfg := Config{Vocab: 9, Window: 4, Embed: 3, Hidden: 6}
	m := testModel(t, cfg, 5)
	a := []int32{1, 2, 3, 4, 5, 6, 7}
	b := []int32{8, 8, 8, 8, 8, 8, 7}
	pos := []int32{0, 1, 2, 0, 1, 2, 3}
	la := make([]float32, len(a)*cfg.Vocab)
	lb := make([]float32, len(b)*cfg.Vocab)
	if err := m.Forward(a, pos, nil, nil, la); err != nil {
		t.Fatal(err)
	}
	copy(b[3:], a[3:])
	if err := m.Forward(b, pos, nil, nil, lb); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(la[3*cfg.Vocab:], lb[3*cfg.Vocab:]) {
		t.Fatal("second segment's logits depend on the first segment's tokens")
	}
	if slices.Equal(la[:3*cfg.Vocab], lb[:3*cfg.Vocab]) {
		t.Fatal("first segments differ but their logits are equal")
	}
}

func TestForwardErrors(t *testing.T) {
	cfg := Config{Vocab: 5, Window: 2, Embed: 2, Hidden: 2}
	m := testModel(t, cfg, 1)
	for _, tc := range []struct {
		name      string
		tokens    []int32
		positions []int32
		nLogits   int
		want      error
	}{
		{"short logits", []int32{1, 2}, nil, 9, ErrShape},
		{"token out of range", []int32{1, 5}, nil, 10, ErrToken},
		{"negative token", []int32{-1, 2}, nil, 10, ErrToken},
		{"positions length", []int32{1, 2}, []int32{0}, 10, ErrShape},
		{"positions not from 0", []int32{1, 2}, []int32{1, 2}, 10, ErrShape},
		{"positions skip", []int32{1, 2, 3}, []int32{0, 2, 3}, 15, ErrShape},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := m.Forward(tc.tokens, tc.positions, nil, nil, make([]float32, tc.nLogits))
			if !errors.Is(err, tc.want) {
				t.Fatalf("err %v, want %v", err, tc.want)
			}
		})
	}
}

func TestConfigValidateAndHash(t *testing.T) {
	for _, c := range []Config{{}, {Vocab: 1, Window: 0, Embed: 1, Hidden: 1}, {Vocab: -3, Window: 1, Embed: 1, Hidden: 1}, {Vocab: 1 << 20, Window: 1, Embed: 1, Hidden: 1}} {
		if err := c.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: err %v, want ErrConfig", c, err)
		}
	}
	a, b := DefaultConfig(), DefaultConfig()
	b.Hidden++
	if a.Hash() == b.Hash() || a.Hash() != DefaultConfig().Hash() {
		t.Fatal("config hash is not a function of the config")
	}
}

func TestCheckpointRoundTrip(t *testing.T) {
	m := testModel(t, DefaultConfig(), 42)
	var buf bytes.Buffer
	if err := m.Save(&buf); err != nil {
		t.Fatal(err)
	}
	raw := buf.Bytes()
	if len(raw) != headerLen+4*m.Config.NumParams() {
		t.Fatalf("checkpoint of %d bytes", len(raw))
	}
	h, _ := m.Hash()
	got, err := LoadVerified(raw, h)
	if err != nil {
		t.Fatal(err)
	}
	if got.Config != m.Config || !slices.Equal(got.Params, m.Params) {
		t.Fatal("round trip changed the model")
	}
	// Same seed, same bytes; another seed, another hash.
	h2, _ := testModel(t, DefaultConfig(), 42).Hash()
	h3, _ := testModel(t, DefaultConfig(), 43).Hash()
	if h2 != h || h3 == h {
		t.Fatalf("hashes %s %s %s", h, h2, h3)
	}
	bad := append([]byte(nil), raw...)
	bad[len(bad)-1] ^= 1
	if _, err := LoadVerified(bad, h); !errors.Is(err, ErrCheckpoint) {
		t.Fatalf("corrupted checkpoint: err %v", err)
	}
	for _, tc := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"bad magic", append([]byte("XXXXXXXX"), raw[8:]...)},
		{"short", raw[:len(raw)-2]},
		{"trailing", append(append([]byte(nil), raw...), 0)},
		{"nan", func() []byte {
			b := append([]byte(nil), raw...)
			copy(b[headerLen:], []byte{0, 0, 0xc0, 0x7f})
			return b
		}()},
	} {
		if _, err := Load(bytes.NewReader(tc.b)); !errors.Is(err, ErrCheckpoint) {
			t.Errorf("%s: err %v, want ErrCheckpoint", tc.name, err)
		}
	}
}

func FuzzLoad(f *testing.F) {
	m, _ := New(Config{Vocab: 3, Window: 2, Embed: 2, Hidden: 2}, 1)
	b, _ := m.Bytes()
	f.Add(b)
	f.Add([]byte("TFMLP\x00\x00\x01"))
	f.Add(append(append([]byte(nil), magic[:]...), 0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := Load(bytes.NewReader(data))
		if err != nil {
			if !errors.Is(err, ErrCheckpoint) {
				t.Fatalf("error %v does not wrap ErrCheckpoint", err)
			}
			return
		}
		out, err := m.Bytes()
		if err != nil || !bytes.Equal(out, data) {
			t.Fatalf("accepted checkpoint does not round-trip: %v", err)
		}
	})
}

// evenOdd is a test grammar: after token 1 only even tokens, after token 2
// only {3}; elsewhere everything.
type evenOdd struct{}

func (evenOdd) ID() string { return "even-odd/1" }
func (evenOdd) Allow(prefix []int32, allowed []bool) {
	last := prefix[len(prefix)-1]
	for v := range allowed {
		switch last {
		case 1:
			allowed[v] = v%2 == 0
		case 2:
			allowed[v] = v == 3
		default:
			allowed[v] = true
		}
	}
}

// TestSamplerLogprobsMatchTraining: the log-probs the sampler returns
// equal, bit for bit, those the trainer recomputes on the stored tokens of
// a packed row (docs/PIPELINE.md §21 "Ratio is not one before first update"),
// under temperature, grammar, top-k, top-p and min-p.
func TestSamplerLogprobsMatchTraining(t *testing.T) {
	cfg := Config{Vocab: 10, Window: 5, Embed: 4, Hidden: 8}
	m := testModel(t, cfg, 9)
	for i := range m.Params { // a peaked policy, so top-p matters
		m.Params[i] *= 3
	}
	pol := NewPolicy(m, 3)
	for _, b := range []Behavior{
		{Temperature: 1},
		{Temperature: 0.7, Grammar: evenOdd{}},
		{Temperature: 1.3, TopK: 4, Grammar: evenOdd{}},
		{Temperature: 1, TopP: 0.8},
		{Temperature: 0.9, TopK: 6, TopP: 0.9, Grammar: evenOdd{}},
		{Temperature: 0.8, MinP: 0.2},
		{Temperature: 1.1, TopK: 7, TopP: 0.95, MinP: 0.05, Grammar: evenOdd{}},
	} {
		s := Settings{Behavior: b, MaxTokens: 12, Stop: []int32{9}}
		reqs := []Request{
			{Context: []int32{1}, Settings: s, Seed: 1},
			{Context: []int32{3, 4, 2}, Settings: s, Seed: 2},
			{Context: []int32{5, 6, 7, 8, 1, 1}, Settings: s, Seed: 3},
		}
		out, err := pol.Generate(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		for k := range out {
			if out[k].PolicyVersion != 3 || len(out[k].Tokens) != len(out[k].Logprobs) {
				t.Fatalf("sample %+v", out[k])
			}
		}
		checkTrainerMatchesSampler(t, m, b, reqs, out)
	}
}

// checkTrainerMatchesSampler packs the sampled sequences (context and
// generated tokens) into one row and requires the trainer's recomputed
// log-probs (LogprobsForTraining) to equal the sampler's bit for bit.
func checkTrainerMatchesSampler(t *testing.T, m *Model, b Behavior, reqs []Request, out []Sample) {
	t.Helper()
	var ids, pos, seg []int32
	var want []float32
	var trained []bool
	for k, r := range reqs {
		full := append(append([]int32(nil), r.Context...), out[k].Tokens...)
		for j, tok := range full {
			ids = append(ids, tok)
			pos = append(pos, int32(j))
			seg = append(seg, int32(k))
		}
		// target-aligned: entry of position j predicts full[j+1]
		for j := range full {
			if j+1 >= len(r.Context) && j+1 < len(full) {
				want = append(want, out[k].Logprobs[j+1-len(r.Context)])
				trained = append(trained, true)
			} else {
				want = append(want, 0)
				trained = append(trained, false)
			}
		}
	}
	got, err := m.LogprobsForTraining(b, ids, pos, seg)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if trained[i] && math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("behavior %+v position %d: trainer %v, sampler %v", b, i, got[i], want[i])
		}
	}
	// LogprobsAt with the trained positions as the mask (the reference's
	// call): the same bits there, exactly 0 elsewhere.
	mask := make([]uint8, len(trained))
	for i, tr := range trained {
		if tr {
			mask[i] = 1
		}
	}
	at, err := m.LogprobsAt(b, ids, pos, seg, mask)
	if err != nil {
		t.Fatal(err)
	}
	for i := range at {
		want := float32(0)
		if trained[i] {
			want = got[i]
		}
		if math.Float32bits(at[i]) != math.Float32bits(want) {
			t.Fatalf("behavior %+v position %d: LogprobsAt %v, want %v", b, i, at[i], want)
		}
	}
	if _, err := m.LogprobsAt(b, ids, pos, seg, mask[1:]); !errors.Is(err, ErrShape) {
		t.Fatalf("a short mask: %v, want ErrShape", err)
	}
}

// TestSamplerDeterminism: same seed, same tokens, whatever the batch it is
// in and its place there; another seed differs.
func TestSamplerDeterminism(t *testing.T) {
	m := testModel(t, DefaultConfig(), 7)
	pol := NewPolicy(m, 0)
	s := Settings{Behavior: Behavior{Temperature: 1, Grammar: evenOdd{}}, MaxTokens: 20}
	target := Request{Context: []int32{1, 2, 3}, Settings: s, Seed: 99}
	alone, err := pol.Generate(context.Background(), []Request{target})
	if err != nil {
		t.Fatal(err)
	}
	var batch []Request
	for k := 0; k < 9; k++ {
		batch = append(batch, Request{Context: []int32{int32(k + 1)}, Settings: s, Seed: uint64(k)})
	}
	batch = append(batch[:4], append([]Request{target}, batch[4:]...)...)
	inBatch, err := pol.Generate(context.Background(), batch)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := pol.Generate(context.Background(), []Request{target})
	for _, o := range []Sample{inBatch[4], again[0]} {
		if !slices.Equal(o.Tokens, alone[0].Tokens) || !slices.Equal(o.Logprobs, alone[0].Logprobs) {
			t.Fatalf("tokens %v / %v differ from %v", o.Tokens, o.Logprobs, alone[0].Tokens)
		}
	}
	other := target
	other.Seed = 100
	o, _ := pol.Generate(context.Background(), []Request{other})
	if slices.Equal(o[0].Tokens, alone[0].Tokens) {
		t.Fatal("another seed sampled the same 20 tokens")
	}
}

// TestSamplerDistribution: empirical frequencies of the first token follow
// the behavior probabilities (grammar respected, masked tokens never drawn).
func TestSamplerDistribution(t *testing.T) {
	cfg := Config{Vocab: 6, Window: 2, Embed: 3, Hidden: 4}
	m := testModel(t, cfg, 2)
	for i := range m.Params {
		m.Params[i] *= 4
	}
	b := Behavior{Temperature: 1, Grammar: evenOdd{}}
	raw := make([]float32, cfg.Vocab)
	beh := make([]float32, cfg.Vocab)
	if err := m.Forward([]int32{1}, nil, nil, nil, raw); err != nil {
		t.Fatal(err)
	}
	if err := b.Transform(raw, []int32{1}, beh); err != nil {
		t.Fatal(err)
	}
	want := make([]float64, cfg.Vocab)
	lp := make([]float32, cfg.Vocab)
	tg := []int32{0, 1, 2, 3, 4, 5}
	rows := make([]float32, 0, 36)
	for range tg {
		rows = append(rows, beh...)
	}
	if err := objective.LogSoftmaxGather(rows, 6, 6, tg, lp); err != nil {
		t.Fatal(err)
	}
	for v := range want {
		want[v] = math.Exp(float64(lp[v]))
	}
	const n = 20000
	var reqs []Request
	for k := 0; k < n; k++ {
		reqs = append(reqs, Request{Context: []int32{1}, Settings: Settings{Behavior: b, MaxTokens: 1}, Seed: uint64(k)})
	}
	out, err := NewPolicy(m, 0).Generate(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	count := make([]float64, cfg.Vocab)
	for _, o := range out {
		count[o.Tokens[0]]++
	}
	for v := range want {
		f := count[v] / n
		if v%2 == 1 && count[v] > 0 {
			t.Fatalf("token %d forbidden by the grammar was sampled %v times", v, count[v])
		}
		if sd := math.Sqrt(want[v] * (1 - want[v]) / n); math.Abs(f-want[v]) > 5*sd+1e-9 {
			t.Errorf("token %d: frequency %.4f, probability %.4f", v, f, want[v])
		}
	}
}

func TestSettingsValidate(t *testing.T) {
	for _, s := range []Settings{
		{MaxTokens: 1},
		{Behavior: Behavior{Temperature: 1}},
		{Behavior: Behavior{Temperature: 1, TopK: -1}, MaxTokens: 1},
		{Behavior: Behavior{Temperature: 1, TopP: 1.5}, MaxTokens: 1},
		{Behavior: Behavior{Temperature: math.Inf(1)}, MaxTokens: 1},
		{Behavior: Behavior{Temperature: 1e-40}, MaxTokens: 1}, // overflows float32 logits
	} {
		if err := s.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: err %v", s, err)
		}
	}
	a := Settings{Behavior: Behavior{Temperature: 1}, MaxTokens: 3}
	b := a
	b.Temperature = 0.5
	if a.ID() == b.ID() {
		t.Fatal("sampler id ignores temperature")
	}
}

func BenchmarkGenerate(b *testing.B) {
	m, _ := New(DefaultConfig(), 1)
	pol := NewPolicy(m, 0)
	s := Settings{Behavior: Behavior{Temperature: 1}, MaxTokens: 8}
	reqs := make([]Request, 64)
	for i := range reqs {
		reqs[i] = Request{Context: []int32{1, 2, 3, 4}, Settings: s, Seed: uint64(i)}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := pol.Generate(context.Background(), reqs); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*len(reqs)*8)/b.Elapsed().Seconds(), "tokens/s")
}

func BenchmarkForwardBackward(b *testing.B) {
	m, _ := New(DefaultConfig(), 1)
	n := 256
	tokens := make([]int32, n)
	for i := range tokens {
		tokens[i] = int32(i % m.Config.Vocab)
	}
	logits := make([]float32, n*m.Config.Vocab)
	grad := make([]float32, m.Config.NumParams())
	var tape Tape
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := m.Forward(tokens, nil, nil, &tape, logits); err != nil {
			b.Fatal(err)
		}
		if err := m.Backward(&tape, logits, grad); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*n)/b.Elapsed().Seconds(), "positions/s")
}

// TestGenerateStopsWhenCancelled: a request whose caller gave up (a client
// that disconnected from a policy server) stops between two tokens with
// the context's error, instead of sampling to its MaxTokens. The request
// here has no stop id and a bound it would take hours to reach.
func TestGenerateStopsWhenCancelled(t *testing.T) {
	m := testModel(t, DefaultConfig(), 7)
	pol := NewPolicy(m, 0)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := Settings{Behavior: Behavior{Temperature: 1}, MaxTokens: math.MaxInt32}
	done := make(chan error, 1)
	go func() {
		_, err := pol.Generate(ctx, []Request{{Context: []int32{1, 2, 3}, Settings: s, Seed: 1}})
		done <- err
	}()
	time.Sleep(50 * time.Millisecond) // let it sample a while first
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled generation returned %v, want context.Canceled", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("generation went on 30 s after its context was cancelled")
	}
}

// TestNextLogitsMatchesBehaviorLogits: the one-row computation a server
// reports top lists with equals, bit for bit, the row of the whole
// sequence's BehaviorLogits at every position after the prompt, grammar
// and truncation included.
func TestNextLogitsMatchesBehaviorLogits(t *testing.T) {
	m := testModel(t, DefaultConfig(), 7)
	b := Behavior{Temperature: 0.7, TopK: 5, TopP: 0.9, Grammar: evenOdd{}}
	out, err := NewPolicy(m, 0).Generate(context.Background(), []Request{{Context: []int32{1, 2, 3}, Settings: Settings{Behavior: b, MaxTokens: 12}, Seed: 5}})
	if err != nil {
		t.Fatal(err)
	}
	seq := append([]int32{1, 2, 3}, out[0].Tokens...)
	V := m.Config.Vocab
	raw, beh := make([]float32, len(seq)*V), make([]float32, len(seq)*V)
	if err := m.BehaviorLogits(b, seq, nil, nil, nil, raw, beh); err != nil {
		t.Fatal(err)
	}
	r, o := make([]float32, V), make([]float32, V)
	for i := 2; i < len(seq); i++ {
		if err := m.NextLogits(b, seq[:i+1], r, o); err != nil {
			t.Fatal(err)
		}
		for v := range V {
			if math.Float32bits(r[v]) != math.Float32bits(raw[i*V+v]) || math.Float32bits(o[v]) != math.Float32bits(beh[i*V+v]) {
				t.Fatalf("position %d id %d: next %v/%v, whole sequence %v/%v", i, v, r[v], o[v], raw[i*V+v], beh[i*V+v])
			}
		}
	}
	if err := m.NextLogits(b, nil, r, o); !errors.Is(err, ErrShape) {
		t.Fatalf("empty sequence: %v", err)
	}
	if err := m.NextLogits(b, []int32{1, int32(V)}, r, o); !errors.Is(err, ErrToken) {
		t.Fatalf("a token past the vocabulary: %v", err)
	}
}
