package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// badCase is one malformed record and the quarantine reason it must get
// ("" = any reason).
type badCase struct {
	name   string
	value  []byte
	reason string
}

// decodeCorpus is the malformed-bytes corpus for a topic whose consumer
// decodes kind: garbage, truncated IPC, a wrong schema version, a wrong
// kind, an empty stream. good is a valid encoding of the topic's kind.
func decodeCorpus(t *testing.T, kind schemas.Kind, good []byte, otherKind []byte, wrongVersion []byte) []badCase {
	t.Helper()
	return []badCase{
		{"garbage bytes", []byte("\x00\x01this is not arrow\xff\xfe"), "undecodable"},
		{"truncated IPC", good[:len(good)/2], "undecodable"},
		{"IPC header only", good[:min(len(good), 64)], "undecodable"},
		{"wrong schema version", wrongVersion, "unknown_version"},
		{"wrong kind", otherKind, "wrong_kind"},
		{"empty value", nil, ""},
	}
}

// semanticCorpus corrupts copies of a valid trajectory row: each must be
// refused by the validate stage with the given reason.
func semanticCorpus(base schemas.Trajectory, maxEpisodeTokens int) []struct {
	name, reason string
	row          schemas.Trajectory
} {
	clone := func(f func(*schemas.Trajectory)) schemas.Trajectory {
		r := base
		r.Turns = make([]schemas.Turn, len(base.Turns))
		for i, tu := range base.Turns {
			tu.PromptIDs = append([]int32(nil), tu.PromptIDs...)
			tu.ActionIDs = append([]int32(nil), tu.ActionIDs...)
			tu.ActionLogprobs = append([]float32(nil), tu.ActionLogprobs...)
			tu.ObservationIDs = append([]int32(nil), tu.ObservationIDs...)
			r.Turns[i] = tu
		}
		f(&r)
		return r
	}
	return []struct {
		name, reason string
		row          schemas.Trajectory
	}{
		{"token/log-prob length mismatch", "logprob_length_mismatch", clone(func(r *schemas.Trajectory) {
			r.Turns[0].ActionLogprobs = r.Turns[0].ActionLogprobs[:len(r.Turns[0].ActionLogprobs)-1]
		})},
		{"NaN log-prob", "nonfinite_logprob", clone(func(r *schemas.Trajectory) { r.Turns[0].ActionLogprobs[0] = float32(math.NaN()) })},
		{"+Inf log-prob", "nonfinite_logprob", clone(func(r *schemas.Trajectory) { r.Turns[0].ActionLogprobs[0] = float32(math.Inf(1)) })},
		{"-Inf log-prob", "nonfinite_logprob", clone(func(r *schemas.Trajectory) { r.Turns[0].ActionLogprobs[0] = float32(math.Inf(-1)) })},
		{"negative token id", "token_id_range", clone(func(r *schemas.Trajectory) { r.Turns[0].ActionIDs[0] = -5 })},
		{"token id beyond vocabulary", "token_id_range", clone(func(r *schemas.Trajectory) { r.Turns[0].PromptIDs[0] = 1 << 30 })},
		{"duplicated turn", "duplicate_turn", clone(func(r *schemas.Trajectory) { r.Turns = append(r.Turns, r.Turns[len(r.Turns)-1]) })},
		{"out-of-order turns", "turn_order", clone(func(r *schemas.Trajectory) {
			if len(r.Turns) < 2 {
				r.Turns = append(r.Turns, r.Turns[0])
				r.Turns[1].Index = r.Turns[0].Index + 1
			}
			r.Turns[0], r.Turns[1] = r.Turns[1], r.Turns[0]
		})},
		{"oversize episode", "over_budget", clone(func(r *schemas.Trajectory) {
			n := maxEpisodeTokens + 1
			r.Turns[0].ActionIDs = make([]int32, n)
			r.Turns[0].ActionLogprobs = make([]float32, n)
			for i := range r.Turns[0].ActionLogprobs {
				r.Turns[0].ActionLogprobs[i] = -0.5
				r.Turns[0].ActionIDs[i] = 7
			}
		})},
	}
}

// badInputScenario injects the corpus on every data-plane input topic
// (trajectories -> validate, valid -> reward, rewarded -> advantage, scored
// -> pack, batches -> train) while the four operators run, then good groups: every bad
// record lands in quarantine with a reason and its source topic in the
// headers, exactly once; the good groups flow (lost = duplicated = 0).
func badInputScenario(t *testing.T, addr, broker string) {
	start := time.Now()
	_, c := runContract(t, uniqueRun("bad"), "")
	run := startRun(t, c, addr)
	s := synthFor(run, 100)
	good := s.Group(0)
	goodTraj, err := schemas.Trajectories.Encode(nil, good[:1])
	if err != nil {
		t.Fatal(err)
	}
	rew := []schemas.Rewarded{{Trajectory: good[0]}}
	goodRew, err := schemas.RewardedTrajectories.Encode(nil, rew)
	if err != nil {
		t.Fatal(err)
	}
	goodScored, err := schemas.ScoredTrajectories.Encode(nil, []schemas.Scored{{Rewarded: rew[0]}})
	if err != nil {
		t.Fatal(err)
	}
	// A wrong schema version: the version string in the stream's schema
	// metadata (a flatbuffers string: length 1, the digit, NUL) patched to "9";
	// the decoder must report a *schemas.VersionError.
	wrongVersion := func(good []byte, decode func([]byte) error) []byte {
		b := bytes.Clone(good)
		i := bytes.Index(b, []byte(schemas.MetaVersion))
		j := -1
		for v := byte('1'); v <= '8' && j < 0; v++ { // the kind's version, a single digit
			j = bytes.Index(b, []byte{1, 0, 0, 0, v, 0})
		}
		if i < 0 || j < 0 {
			t.Fatal("no version metadata found in the encoded stream")
		}
		b[j+4] = '9'
		var ve *schemas.VersionError
		if err := decode(b); !errors.As(err, &ve) {
			t.Fatalf("patched stream decodes with %v, want a version error", err)
		}
		return b
	}
	wvTraj := wrongVersion(goodTraj, func(b []byte) error { _, err := schemas.Trajectories.Decode(nil, b); return err })
	wvRew := wrongVersion(goodRew, func(b []byte) error { _, err := schemas.RewardedTrajectories.Decode(nil, b); return err })
	wvScored := wrongVersion(goodScored, func(b []byte) error { _, err := schemas.ScoredTrajectories.Decode(nil, b); return err })
	corpus := map[string][]badCase{
		run.Topics.Trajectories: decodeCorpus(t, schemas.Trajectories.Kind(), goodTraj, goodScored, wvTraj),
		run.Topics.Valid:        decodeCorpus(t, schemas.Trajectories.Kind(), goodTraj, goodRew, wvTraj),
		run.Topics.Rewarded:     decodeCorpus(t, schemas.RewardedTrajectories.Kind(), goodRew, goodTraj, wvRew),
		run.Topics.Scored:       decodeCorpus(t, schemas.ScoredTrajectories.Kind(), goodScored, goodRew, wvScored),
	}
	for i, sc := range semanticCorpus(s.Group(1)[0], c.Sampler.MaxTokensPerEpisode) {
		row := sc.row
		row.RecordID = fmt.Sprintf("%032x", 0xbad0+i)
		b, err := schemas.Trajectories.Encode(nil, []schemas.Trajectory{row})
		if err != nil {
			t.Fatalf("%s: %v", sc.name, err)
		}
		corpus[run.Topics.Trajectories] = append(corpus[run.Topics.Trajectories], badCase{sc.name, b, sc.reason})
	}
	want := map[string]badCase{} // key -> case
	injected := 0
	for topic, cases := range corpus {
		var msgs []rawMsg
		for _, bc := range cases {
			key := "bad/" + topic + "/" + bc.name
			want[key] = bc
			msgs = append(msgs, rawMsg{key: key, value: bc.value})
		}
		produceRaw(t, run, topic, msgs)
		injected += len(msgs)
	}
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		startOp(t, run, name, operators.Deps{VocabSize: rollout.VocabSize})
	}
	// Good groups after the bad records: the operators keep running.
	ids := run.Produce(t, s, 10, 30)
	counts, rep := settle(t, run, ids, 60*time.Second)

	// The batches topic, consumed by the train stage, in a run of its own
	// (the trainer would train on this run's synthetic batches): the corpus
	// built from a real batch of this run.
	_, c2 := runContract(t, uniqueRun("badtrain"), "")
	run2 := startRun(t, c2, run.Addr)
	want2 := map[string]badCase{}
	injected += injectBatchCorpus(t, run, run2, goodScored, want2)
	startOp(t, run2, "train", operators.Deps{ReleaseDir: t.TempDir()})
	got := quarantinedByKey(t, run, want)
	for k, v := range waitQuarantined(t, run2, want2, 60*time.Second) {
		got[k] = v
	}
	for k, v := range want2 {
		want[k] = v
	}
	var missing []string
	seen := map[string]int{}
	for key, bc := range want {
		hs := got[key]
		for _, h := range hs {
			seen[h[schemas.HeaderReason]]++
		}
		switch {
		case len(hs) == 0:
			missing = append(missing, key)
		case len(hs) > 1:
			t.Errorf("%s quarantined %d times", key, len(hs))
		default:
			h := hs[0]
			topic := strings.Split(key, "/")[1]
			if h[schemas.HeaderReason] == "" || h[schemas.HeaderStage] == "" || h[schemas.HeaderSourceTopic] != topic {
				t.Errorf("%s: quarantine headers %v", key, h)
			}
			if bc.reason != "" && h[schemas.HeaderReason] != bc.reason {
				t.Errorf("%s: reason %q (%s), want %q", key, h[schemas.HeaderReason], h[schemas.HeaderDetail], bc.reason)
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("not quarantined: %v", missing)
	}
	counts.Quarantined += len(want) - len(missing)
	counts.Launched += injected
	record(t, scenarioResult{Name: fmt.Sprintf("bad input: %d malformed records on 5 topics + good groups", injected), Broker: broker,
		Counts: counts, Reasons: seen, Elapsed: time.Since(start)})
	checkCounts(t, run, rep.Account(ids), rep)
}

// quarantinedByKey reads the quarantine topic and returns the headers of
// every record whose key is in want.
func quarantinedByKey(t *testing.T, run *testkit.Run, want map[string]badCase) map[string][]map[string]string {
	t.Helper()
	cfg := run.Config("quarantine-read", "")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := map[string][]map[string]string{}
	err := pipeline.ScanTail(ctx, &cfg, run.Topics.Quarantine, 0, func(m pipeline.Message) error {
		if _, ok := want[string(m.Key)]; !ok {
			return nil
		}
		h := map[string]string{}
		for _, x := range m.Headers {
			h[x.Key] = string(x.Value)
		}
		out[string(m.Key)] = append(out[string(m.Key)], h)
		return nil
	})
	if err != nil {
		t.Fatalf("quarantine: %v", err)
	}
	return out
}

func TestBadInputEmbedded(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end")
	}
	badInputScenario(t, "", "embedded (in process)")
}

// injectBatchCorpus builds the decode corpus from the first batch on run's
// batches topic, writes it to dst's batches topic and adds its keys to
// want.
func injectBatchCorpus(t *testing.T, run, dst *testkit.Run, otherKind []byte, want map[string]badCase) int {
	t.Helper()
	cfg := run.Config("batch-read", "")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var good []byte
	err := pipeline.ScanTail(ctx, &cfg, run.Topics.Batches, 1, func(m pipeline.Message) error {
		if good == nil {
			good = m.Value
		}
		return nil
	})
	if err != nil || good == nil {
		t.Fatalf("no batch to build the corpus from (%v)", err)
	}
	b := bytes.Clone(good)
	j := bytes.Index(b, []byte("\x01\x00\x00\x001\x00"))
	if j < 0 {
		t.Fatal("no version metadata in the batch stream")
	}
	b[j+4] = '9'
	var ve *schemas.VersionError
	if _, err := schemas.PackedBatches.Decode(nil, b); !errors.As(err, &ve) {
		t.Fatalf("patched batch decodes with %v, want a version error", err)
	}
	var msgs []rawMsg
	for _, bc := range decodeCorpus(t, schemas.PackedBatches.Kind(), good, otherKind, b) {
		key := "bad/" + dst.Topics.Batches + "/" + bc.name
		want[key] = bc
		msgs = append(msgs, rawMsg{key: key, value: bc.value})
	}
	// In two halves: the second is quarantined only if the trainer kept
	// running after the first.
	produceRaw(t, dst, dst.Topics.Batches, msgs[:len(msgs)/2])
	produceRaw(t, dst, dst.Topics.Batches, msgs[len(msgs)/2:])
	return len(msgs)
}

// waitQuarantined polls the quarantine topic until every key of want is
// there (or timeout) and returns what it found.
func waitQuarantined(t *testing.T, run *testkit.Run, want map[string]badCase, timeout time.Duration) map[string][]map[string]string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got := quarantinedByKey(t, run, want)
		if len(got) == len(want) || time.Now().After(deadline) {
			return got
		}
		time.Sleep(500 * time.Millisecond)
	}
}
