//go:build llama

// The text tool task on a real llama-server serving SmolLM2-135M-Instruct,
// end to end: dispatch -> rollout -> validate -> reward -> advantage ->
// pack. They need TRAJFLOW_LLAMA_SERVER and TRAJFLOW_LLAMA_MODEL
// (deploy/local/llama.sh env) and fail without them:
//
//	eval "$(deploy/local/llama.sh env)"
//	go test -tags llama -run Llama -v ./internal/loop/
package loop_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/llamacpp"
	"github.com/trajflow/trajflow/internal/llamatest"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// completionLog records every raw /completion call of the policy clients:
// the request and the server's answer, bytes as they were.
type completionLog struct {
	mu    sync.Mutex
	calls []rawCall
}

type rawCall struct{ req, resp []byte }

func (l *completionLog) record(method, path string, req []byte, status int, resp []byte) {
	if !strings.HasPrefix(path, "/completion") || status != 200 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, rawCall{append([]byte(nil), req...), append([]byte(nil), resp...)})
}

type sentCompletion struct {
	Prompt       []int32 `json:"prompt"`
	Seed         uint32  `json:"seed"`
	TrajflowSeed *uint64 `json:"trajflow_seed"`
	Model        string  `json:"model"`
}

type answeredCompletion struct {
	Tokens []int32 `json:"tokens"`
	Model  string  `json:"model"`
	Probs  []struct {
		ID   int32   `json:"id"`
		Prob float64 `json:"prob"`
	} `json:"completion_probabilities"`
}

// bySeed indexes the logged calls by their 32-bit seed.
func (l *completionLog) bySeed(t *testing.T) map[uint32][]rawCall {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[uint32][]rawCall{}
	for _, c := range l.calls {
		var q sentCompletion
		if err := json.Unmarshal(c.req, &q); err != nil {
			t.Fatal(err)
		}
		out[q.Seed] = append(out[q.Seed], c)
	}
	return out
}

// smallText makes the text run of a test small: 2 tasks x 1 group x 2
// attempts, at most 2 turns of 24 tokens.
func smallText(c *contract.Contract) {
	c.Sampler.GroupSize = 2
	c.Sampler.MaxTurns = 2
	c.Sampler.MaxTokensPerAction = 24
	c.Dispatch.TasksPerUpdate, c.Dispatch.GroupsPerUpdate = 2, 2
	c.Packing.BatchGroups = 2
	c.Estimator.MinGroupSize = 2
}

type textRun struct {
	sum    *loop.Summary
	trajs  []schemas.Trajectory
	groups [][]schemas.PackedRow
	log    *completionLog
	c      *contract.Contract
}

// runText runs the text task on the server at url through the demo loop
// (no training) on a broker of its own, and reads the run's trajectories
// and batches back.
func runText(t *testing.T, url string) textRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	b, err := kafka.StartBroker(ctx, kafka.BrokerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	lg := &completionLog{}
	p, err := loop.ParsePolicy("llamacpp://"+strings.TrimPrefix(url, "http://"), "")
	if err != nil {
		t.Fatal(err)
	}
	o := loop.Options{Updates: 1, Seed: 5, Out: t.TempDir(), EvalSamples: 1, Quiet: true, Brokers: []string{b.Addr()},
		Policy: p, Tasks: loop.TasksText, NoTrain: true, PolicyTrace: lg.record, Edit: smallText}
	s, err := loop.Run(ctx, o, io.Discard)
	if err != nil {
		t.Fatalf("text run: %v", err)
	}
	c, err := loop.Contract(o)
	if err != nil {
		t.Fatal(err)
	}
	topics, err := pipeline.TopicsFor(c.RunID)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &pipeline.Config{Brokers: []string{b.Addr()}, MaxMessageBytes: c.Topics.MaxMessageBytes}
	r := textRun{sum: s, log: lg, c: c}
	err = pipeline.ScanTail(ctx, cfg, topics.Trajectories, 0, func(m pipeline.Message) error {
		rows, err := schemas.Trajectories.Decode(nil, m.Value)
		r.trajs = append(r.trajs, rows...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	err = pipeline.ScanTail(ctx, cfg, topics.Batches, 0, func(m pipeline.Message) error {
		bt, err := schemas.PackedBatches.Decode(nil, m.Value)
		r.groups = append(r.groups, bt.Rows)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(r.trajs, func(a, b schemas.Trajectory) int { return strings.Compare(a.RecordID, b.RecordID) })
	return r
}

// TestLlamaTextRun: SmolLM2 on llama-server runs the text tool task
// through dispatch -> rollout -> validate -> reward -> advantage -> pack
// into Arrow batches, and
//   - the ids sent to the server are the ids the trajectory records,
//     turn by turn (prompt ++ action ++ observation of the earlier turns,
//     then the turn's prompt): the conformance of the text path;
//   - every action token and log-prob, in the trajectories and at every
//     trained position of the batches, is what the server returned (the
//     raw responses are logged by the clients' trace): the ids cut after
//     the first stop id, log-probs float32(log(prob)) bit for bit;
//   - validate accepts the model's vocabulary (49152 ids), and the
//     trajectories record the server's tokenizer and chat template hashes
//     and its sampler id;
//   - the same seed twice gives the same tokens and the same batches.
func TestLlamaTextRun(t *testing.T) {
	srv := llamatest.Start(t, llamatest.Options{Slots: 1, Ctx: 1024})
	first := runText(t, srv.URL)
	s := first.sum
	t.Logf("launched %d, admitted %d, filtered %d, quarantined %d, retries %v; %d completion calls; %d batches",
		s.AttemptsLaunched, s.TrajectoriesAdmitted, s.TrajectoriesFiltered, s.Quarantined, s.InfraRetries, len(first.log.calls), len(s.BatchHashes))
	if s.AttemptsLaunched != 4 || s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.Quarantined != 0 || s.TrajectoriesAdmitted != 4 || len(s.BatchHashes) != 1 {
		t.Fatalf("summary %+v", s)
	}
	calls := first.log.bySeed(t)
	maxID := int32(0)
	for _, tr := range first.trajs {
		if tr.TokenizerHash == "" || !strings.HasPrefix(tr.ChatTemplateHash, "sha256:") || tr.SamplerID == "" {
			t.Fatalf("trajectory %s: tokenizer %q, template %q, sampler %q", tr.RecordID, tr.TokenizerHash, tr.ChatTemplateHash, tr.SamplerID)
		}
		var stream []int32
		for _, turn := range tr.Turns {
			want := append(append([]int32(nil), stream...), turn.PromptIDs...)
			seed := llamacpp.Seed32(schemas.SeedFor(first.c.Seed, schemas.TurnID(tr.RecordID, turn.Index), "sample"))
			cs := calls[seed]
			if len(cs) != 1 {
				t.Fatalf("trajectory %s turn %d: %d calls with seed %d", tr.RecordID, turn.Index, len(cs), seed)
			}
			var q sentCompletion
			var a answeredCompletion
			if err := json.Unmarshal(cs[0].req, &q); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(cs[0].resp, &a); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(q.Prompt, want) {
				t.Fatalf("trajectory %s turn %d: sent %d ids, the trajectory records %d: sent != recorded", tr.RecordID, turn.Index, len(q.Prompt), len(want))
			}
			if q.TrajflowSeed != nil {
				t.Fatalf("trajflow_seed sent to llama-server, which does not announce it")
			}
			n := len(turn.ActionIDs)
			if n == 0 || n > len(a.Tokens) || !slices.Equal(a.Tokens[:n], turn.ActionIDs) || len(a.Probs) < n {
				t.Fatalf("trajectory %s turn %d: actions %v, the server returned %v", tr.RecordID, turn.Index, turn.ActionIDs, a.Tokens)
			}
			if n < len(a.Tokens) && !slices.Contains(first.c.Sampler.StopTokenIDs, turn.ActionIDs[n-1]) {
				t.Fatalf("trajectory %s turn %d: cut at %d of %d ids without a stop id", tr.RecordID, turn.Index, n, len(a.Tokens))
			}
			for i := range n {
				lp := float32(math.Log(a.Probs[i].Prob))
				if a.Probs[i].ID != turn.ActionIDs[i] || math.Float32bits(lp) != math.Float32bits(turn.ActionLogprobs[i]) {
					t.Fatalf("trajectory %s turn %d id %d: log-prob %v, the server's prob %v (log %v)", tr.RecordID, turn.Index, i, turn.ActionLogprobs[i], a.Probs[i].Prob, lp)
				}
				maxID = max(maxID, turn.ActionIDs[i])
			}
			stream = append(append(want, turn.ActionIDs...), turn.ObservationIDs...)
		}
	}
	if maxID < 64 {
		t.Fatalf("the model sampled no id beyond the built-in vocabulary (max %d): the vocabulary check shows nothing", maxID)
	}
	checkBatches(t, first)
	t.Logf("%d trajectories, every turn's ids and log-probs are the server's; largest sampled id %d", len(first.trajs), maxID)

	second := runText(t, srv.URL)
	if !reflect.DeepEqual(second.sum.BatchHashes, s.BatchHashes) {
		t.Fatalf("the same seed twice gave other batches: %v vs %v", second.sum.BatchHashes, s.BatchHashes)
	}
	for i := range first.trajs {
		a, b := first.trajs[i], second.trajs[i]
		for k := range a.Turns {
			if !slices.Equal(a.Turns[k].ActionIDs, b.Turns[k].ActionIDs) {
				t.Fatalf("trajectory %s turn %d: %v then %v", a.RecordID, k, a.Turns[k].ActionIDs, b.Turns[k].ActionIDs)
			}
		}
	}
}

// checkBatches: every trained position of the batches (action mask 1)
// targets the next action id of its segment's trajectory, with that id's
// log-prob as old_logprobs, in order; every action token is trained.
func checkBatches(t *testing.T, r textRun) {
	t.Helper()
	byID := map[string]schemas.Trajectory{}
	for _, tr := range r.trajs {
		byID[tr.RecordID] = tr
	}
	trained := 0
	for _, rows := range r.groups {
		for _, row := range rows {
			next := map[int32]int{} // segment -> actions consumed
			for i := 0; i+1 < len(row.InputIDs); i++ {
				if row.ActionMask[i] == 0 {
					continue
				}
				seg := row.SegmentIDs[i+1]
				tr := byID[row.SegTrajectoryIDs[seg]]
				var ids []int32
				var lps []float32
				for _, turn := range tr.Turns {
					ids = append(ids, turn.ActionIDs...)
					lps = append(lps, turn.ActionLogprobs...)
				}
				k := next[seg]
				if k >= len(ids) || row.InputIDs[i+1] != ids[k] || math.Float32bits(row.OldLogprobs[i]) != math.Float32bits(lps[k]) {
					t.Fatalf("batch position %d: target %d log-prob %v, trajectory %s action %d", i, row.InputIDs[i+1], row.OldLogprobs[i], tr.RecordID, k)
				}
				next[seg]++
				trained++
			}
			for seg, id := range row.SegTrajectoryIDs {
				n := 0
				for _, turn := range byID[id].Turns {
					n += len(turn.ActionIDs)
				}
				if next[int32(seg)] != n {
					t.Fatalf("trajectory %s: %d of %d action tokens trained", id, next[int32(seg)], n)
				}
			}
		}
	}
	if trained == 0 {
		t.Fatal("no trained position in the batches")
	}
}

// TestLlamaRouterSwitch: a llama-server router over a models directory
// holding the model as policy-v00000000.gguf and policy-v00000001.gguf
// (the release -> model file mapping), with the weightsync and rollout
// operators of a run over Kafka. Release 0 is loaded and acknowledged, a
// group wanting version 0 runs; release 1 is loaded (version 0 stays for
// requests in flight), a group wanting version 1 runs. Every turn records
// the version that served it, every request named that version's model
// and was answered by it: no sample comes from a mixture.
func TestLlamaRouterSwitch(t *testing.T) {
	model := os.Getenv("TRAJFLOW_LLAMA_MODEL")
	dir := t.TempDir()
	for v := int64(0); v <= 1; v++ {
		if err := os.Symlink(model, filepath.Join(dir, policy.ModelName(v)+".gguf")); err != nil {
			t.Fatal(err)
		}
	}
	srv := llamatest.Start(t, llamatest.Options{ModelsDir: dir, ModelsMax: 2, Slots: 1, Ctx: 1024, Args: []string{"--no-models-autoload"}})
	p, err := loop.ParsePolicy("llamacpp://"+strings.TrimPrefix(srv.URL, "http://"), "")
	if err != nil {
		t.Fatal(err)
	}
	p.Router = true
	c, err := loop.Contract(loop.Options{Seed: 3, Policy: p, Tasks: loop.TasksText, StopTokenIDs: []int32{2, 0}, Edit: smallText})
	if err != nil {
		t.Fatal(err)
	}
	run := testkit.StartRun(t, c, "")
	deps, err := operators.BuiltinDeps(c)
	if err != nil {
		t.Fatal(err)
	}
	lg := &completionLog{}
	deps.PolicyTrace, deps.VocabSize = lg.record, 49152
	for _, name := range []string{"weightsync", "rollout"} {
		op, err := operators.NewOperator(name, deps, run.Config(name, t.TempDir()))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- op.Run(ctx) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, pipeline.ErrStopped) {
				t.Errorf("operator %s: %v", name, err)
			}
		})
	}
	release := func(v int64) {
		path := filepath.Join(dir, policy.ModelName(v)+".gguf")
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b)
		rel := schemas.PolicyRelease{PolicyVersion: v, CheckpointHash: "sha256:" + hex.EncodeToString(sum[:]), CheckpointURI: "file://" + path, Ready: true}
		doc, err := schemas.EncodeRelease(rel)
		if err != nil {
			t.Fatal(err)
		}
		run.ProduceRaw(t, run.Topics.Policy, map[string][]byte{c.RunID: doc})
	}
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(4 * time.Minute)
		for !ok() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(300 * time.Millisecond)
		}
	}
	acked := func(v int64) func() bool {
		return func() bool {
			for _, m := range run.ReadAll(t, run.Topics.Weights) {
				if a, err := schemas.DecodeWeightAck(m.Value); err == nil && a.Loaded && a.Version == v {
					if !strings.HasPrefix(a.Checksum, "sha256:") {
						t.Fatalf("acknowledgement without the file's checksum: %+v", a)
					}
					return true
				}
			}
			return false
		}
	}
	planner, err := operators.Planner(deps)
	if err != nil {
		t.Fatal(err)
	}
	group := func(round, version int64) string {
		g := planner.Plan(round)[0]
		atts := planner.Attempts(g, version, 0)
		b, err := schemas.TaskAttempts.Encode(nil, atts)
		if err != nil {
			t.Fatal(err)
		}
		run.ProduceRaw(t, run.Topics.Tasks, map[string][]byte{atts[0].GroupID: b})
		return atts[0].GroupID
	}
	trajsOf := func(gid string) []schemas.Trajectory {
		var out []schemas.Trajectory
		for _, m := range run.ReadAll(t, run.Topics.Trajectories) {
			if rows, err := schemas.Trajectories.Decode(nil, m.Value); err == nil && rows[0].GroupID == gid {
				out = append(out, rows...)
			}
		}
		return out
	}
	release(0)
	waitFor("the acknowledgement of version 0", acked(0))
	g0 := group(0, 0)
	waitFor("the group on version 0", func() bool { return len(trajsOf(g0)) > 0 })
	release(1)
	waitFor("the acknowledgement of version 1", acked(1))
	g1 := group(1, 1)
	waitFor("the group on version 1", func() bool { return len(trajsOf(g1)) > 0 })

	for gid, v := range map[string]int64{g0: 0, g1: 1} {
		for _, tr := range trajsOf(gid) {
			for _, turn := range tr.Turns {
				if turn.PolicyVersion != v {
					t.Fatalf("group wanting version %d: turn %d of %s recorded version %d", v, turn.Index, tr.RecordID, turn.PolicyVersion)
				}
			}
		}
	}
	lg.mu.Lock()
	defer lg.mu.Unlock()
	names := map[string]int{}
	for _, cl := range lg.calls {
		var q sentCompletion
		var a answeredCompletion
		if json.Unmarshal(cl.req, &q) != nil || json.Unmarshal(cl.resp, &a) != nil {
			t.Fatal("undecodable logged call")
		}
		if q.Model == "" || a.Model != q.Model {
			t.Fatalf("a request for model %q was answered by %q", q.Model, a.Model)
		}
		names[q.Model]++
	}
	if names[policy.ModelName(0)] == 0 || names[policy.ModelName(1)] == 0 || len(names) != 2 {
		t.Fatalf("requests by model %v", names)
	}
	t.Logf("requests by model %v; every answer came from the model its request named", names)
}
