package model

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync"

	"github.com/trajflow/trajflow/gpu/objective"
)

// Settings are the resolved sampler settings of one request (docs/PIPELINE.md §5):
// the behavior distribution and the generation limits.
type Settings struct {
	Behavior
	MaxTokens int     `json:"max_tokens"` // > 0: tokens generated at most
	Stop      []int32 `json:"stop"`       // generation ends after sampling one of these (it is kept)
}

// Validate reports whether s is usable (ErrConfig).
func (s Settings) Validate() error {
	if err := s.Behavior.Validate(); err != nil {
		return err
	}
	if s.MaxTokens <= 0 {
		return fmt.Errorf("%w: max_tokens %d must be positive", ErrConfig, s.MaxTokens)
	}
	return nil
}

// ID is "sha256:<hex>" of the resolved settings: the sampler id recorded
// with every trajectory (docs/PIPELINE.md §5 "Record the resolved sampler").
func (s Settings) ID() string {
	parts := []string{"sampler/v1", s.Behavior.ID(), strconv.Itoa(s.MaxTokens)}
	for _, t := range s.Stop {
		parts = append(parts, strconv.Itoa(int(t)))
	}
	return hashStrings(parts...)
}

// Request asks for one generation: the segment so far (the whole token
// stream of the episode, whose first token has position 0), the settings,
// and the seed of this generation's random stream (derive it with
// schemas.SeedFor from the contract seed and the turn id, so the same turn
// samples the same tokens in every process).
type Request struct {
	Context  []int32
	Settings Settings
	Seed     uint64
	// ID names the request (the turn id): a policy server's request id and
	// logs. The built-in policy ignores it.
	ID string
	// Affinity groups requests that share a prefix (the group id): a
	// gateway over several replicas sends them to one replica, so its prefix
	// cache serves them. The built-in policy ignores it.
	Affinity string
}

// Finish reasons of a Sample.
const (
	FinishStop   = "stop"   // a stop token was sampled (and is the last token)
	FinishLength = "length" // MaxTokens tokens were sampled
)

// Sample is the answer to one Request: the sampled token ids and, for each,
// its log-probability under the actual sampling distribution (Behavior,
// rounded to float32), and the policy version that produced them.
type Sample struct {
	Tokens        []int32
	Logprobs      []float32
	Finish        string
	PolicyVersion int64
}

// Policy is an immutable snapshot of a model at a policy version: the
// built-in policy server. It is safe for concurrent use.
type Policy struct {
	m       *Model
	version int64
}

// NewPolicy snapshots m (its parameters are copied) as version.
func NewPolicy(m *Model, version int64) *Policy {
	return &Policy{m: m.Clone(), version: version}
}

// Version is the policy version of the snapshot.
func (p *Policy) Version() int64 { return p.version }

// Config is the architecture of the snapshot.
func (p *Policy) Config() Config { return p.m.Config }

// Generate samples every request of a batch. Each request is computed on
// its own (own random stream from its Seed, own context), so a request's
// result does not depend on the other requests of the batch nor on their
// order; requests are spread over up to GOMAXPROCS goroutines. Sampling is
// by inversion: u from PCG(Seed) in [0, 1), and the first token (in id
// order) whose cumulative behavior probability exceeds u. The returned
// log-prob of a token is objective.LogSoftmaxGather of the behavior logits,
// as the trainer recomputes it. The error of the first failing request (in
// batch order), or ctx's error, fails the whole call.
func (p *Policy) Generate(ctx context.Context, reqs []Request) ([]Sample, error) {
	out := make([]Sample, len(reqs))
	errs := make([]error, len(reqs))
	workers := min(runtime.GOMAXPROCS(0), len(reqs))
	var wg sync.WaitGroup
	next := make(chan int)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var g generator
			for i := range next {
				if err := ctx.Err(); err != nil {
					errs[i] = err
					continue
				}
				out[i], errs[i] = p.generate(ctx, &g, reqs[i])
			}
		}()
	}
	for i := range reqs {
		next <- i
	}
	close(next)
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("model: generate: %w", err)
	}
	for i, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("model: generate request %d: %w", i, err)
		}
	}
	return out, nil
}

// generator holds one worker's scratch buffers.
type generator struct {
	t        transformer
	win      []int32
	x, h     []float32
	raw, beh []float32
	prob     []float64
	lp       [1]float32
}

// generate samples one request; it stops with ctx's error between two
// tokens once ctx is done, so an abandoned request stops costing CPU.
func (p *Policy) generate(ctx context.Context, g *generator, r Request) (Sample, error) {
	if err := r.Settings.Validate(); err != nil {
		return Sample{}, err
	}
	c := p.m.Config
	V := c.Vocab
	if len(r.Context) == 0 {
		return Sample{}, fmt.Errorf("%w: empty context", ErrShape)
	}
	for i, t := range r.Context {
		if t < 0 || int(t) >= V {
			return Sample{}, fmt.Errorf("%w: context token %d at %d, vocab %d", ErrToken, t, i, V)
		}
	}
	g.win = grow(g.win, c.Window)
	g.x = grow(g.x, c.In())
	g.h = grow(g.h, c.Hidden)
	g.raw = grow(g.raw, V)
	g.beh = grow(g.beh, V)
	g.prob = grow(g.prob, V)
	rng := rand.New(rand.NewPCG(r.Seed, 0x73616d706c6572)) // "sampler"
	// MaxTokens is a bound, not a forecast: most samples stop long before
	// it, so the buffers grow as tokens come.
	seq := append(make([]int32, 0, len(r.Context)+min(r.Settings.MaxTokens, 1024)), r.Context...)
	s := Sample{PolicyVersion: p.version, Finish: FinishLength}
	v := p.m.Views()
	target := []int32{0}
	for n := 0; n < r.Settings.MaxTokens; n++ {
		if err := ctx.Err(); err != nil {
			return Sample{}, err
		}
		i := len(seq) - 1
		windowAt(seq, i, int32(i), g.win)
		p.m.positionLogits(v, g.win, g.x, g.h, g.raw)
		if err := r.Settings.Behavior.transform(&g.t, g.raw, seq, g.beh); err != nil {
			return Sample{}, err
		}
		// Behavior probabilities, float64 in id order.
		m := math.Inf(-1)
		for _, z := range g.beh {
			if float64(z) > m {
				m = float64(z)
			}
		}
		var sum float64
		for k, z := range g.beh {
			e := math.Exp(float64(z) - m)
			g.prob[k] = e
			sum += e
		}
		u := rng.Float64() * sum
		tok := int32(-1)
		var cum float64
		for k, e := range g.prob {
			if e == 0 {
				continue
			}
			cum += e
			tok = int32(k) // the last token with mass is the fallback for rounding
			if u < cum {
				break
			}
		}
		target[0] = tok
		if err := objective.LogSoftmaxGather(g.beh, 1, V, target, g.lp[:]); err != nil {
			return Sample{}, fmt.Errorf("model: %w", err)
		}
		seq = append(seq, tok)
		s.Tokens = append(s.Tokens, tok)
		s.Logprobs = append(s.Logprobs, g.lp[0])
		if isStop(tok, r.Settings.Stop) {
			s.Finish = FinishStop
			break
		}
	}
	return s, nil
}

func isStop(t int32, stop []int32) bool {
	for _, s := range stop {
		if s == t {
			return true
		}
	}
	return false
}
