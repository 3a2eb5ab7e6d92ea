package bench

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// BenchmarkStageChain runs validate → reward → advantage → pack in one
// goroutine with no broker in between: each iteration is one synthetic
// group of the bench distribution (synth.Bench, one message of 8
// trajectories) handed from stage to stage by topic. It reports each
// stage's Process time per input message (the "proc µs" column of
// `trajflow bench` without the broker sharing the cores) and the
// pipeline's tokens per second of Process time. The group's generation and
// encoding, and the copy of each record standing in for the broker, are not
// timed.
func BenchmarkStageChain(b *testing.B) {
	c := testkit.LoadContract(b, "../testdata/contracts/bench.yaml")
	run := testkit.StartRun(b, c, "")
	s := synth.Bench()
	s.RunID, s.ContractHash, s.GroupSize, s.MaxTurns = c.RunID, c.Hash(), c.Sampler.GroupSize, c.Sampler.MaxTurns
	gen := s.NewGenerator(0)
	ctx := context.Background()

	deps := operators.Deps{Contract: c, Topics: run.Topics, VocabSize: s.Vocab}
	byTopic := map[string]int{}
	stages := make([]pipeline.Stage, len(Stages))
	for i, name := range Stages {
		st, err := operators.New(name, deps)
		if err != nil {
			b.Fatal(err)
		}
		if sr, ok := st.(pipeline.Starter); ok {
			cfg := run.Config(name, b.TempDir())
			env := pipeline.NewEnv(pipeline.EnvConfig{Logger: cfg.Logger, Scanner: pipeline.KafkaScanner(&cfg), StateDir: cfg.StateDir})
			if err := sr.Start(ctx, env); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { env.Close() })
		}
		for _, t := range st.Topics() {
			byTopic[t] = i
		}
		stages[i] = st
	}
	rel, err := schemas.EncodeRelease(schemas.PolicyRelease{
		PolicyVersion: s.PolicyVersion, TrainingStep: s.PolicyVersion, ContractHash: c.Hash(),
		CreatedAt: time.Now().UTC().Format(time.RFC3339), Ready: true,
	})
	if err != nil {
		b.Fatal(err)
	}
	pack := stages[len(stages)-1]
	if _, err := pack.Process(ctx, pipeline.Message{Ref: pipeline.Ref{Topic: run.Topics.Policy}, Key: []byte("policy"), Value: rel}); err != nil {
		b.Fatal(err)
	}

	var nanos [8]time.Duration
	var msgs [8]int64
	var tokens, offset int64
	var deliver func(i int, m pipeline.Message)
	deliver = func(i int, m pipeline.Message) {
		t0 := time.Now()
		res, err := stages[i].Process(ctx, m)
		nanos[i] += time.Since(t0)
		msgs[i]++
		if err != nil {
			b.Fatalf("%s: %v", Stages[i], err)
		}
		for _, o := range res.Outputs {
			if j, ok := byTopic[o.Topic]; ok && j > i {
				offset++
				// A consumer reads its own copy of the record (as through
				// the broker); the producer's buffer is then released, as
				// the runtime does on the broker's acknowledgment.
				v := bytes.Clone(o.Value)
				if o.Release != nil {
					o.Release()
				}
				deliver(j, pipeline.Message{Ref: pipeline.Ref{Topic: o.Topic, Offset: offset}, Key: o.Key, Value: v, Headers: o.Headers})
			} else if o.Release != nil {
				o.Release()
			}
		}
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		rows := gen.Group(int64(i))
		v, err := schemas.Trajectories.Encode(nil, rows)
		if err != nil {
			b.Fatal(err)
		}
		for k := range rows {
			all, _ := synth.Tokens(&rows[k])
			tokens += int64(all)
		}
		offset++
		deliver(0, pipeline.Message{Ref: pipeline.Ref{Topic: run.Topics.Trajectories, Offset: offset}, Key: []byte(rows[0].GroupID), Value: v})
	}
	var total time.Duration
	for i, name := range Stages {
		if msgs[i] > 0 {
			b.ReportMetric(float64(nanos[i].Microseconds())/float64(msgs[i]), name+"-µs/msg")
		}
		total += nanos[i]
	}
	b.ReportMetric(float64(tokens)/total.Seconds(), "tokens/proc-s")
}
