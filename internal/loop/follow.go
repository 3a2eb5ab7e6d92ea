package loop

import (
	"context"
	"fmt"
	"sync"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// progress is what the loop has seen of the run: pack's window records
// (its decisions) and the trainer's releases.
type progress struct {
	decided, batches         int
	byBatch                  map[string]schemas.WindowRecord
	packTokens, packCapacity int64
	lastVersion              int64
	lastAt                   time.Time
	evaluated                map[int64]bool
	lastRel                  schemas.PolicyRelease
	queued                   []queuedUpdate // releases waiting for pack's record of their batch
}

type queuedUpdate struct {
	rel schemas.PolicyRelease
	u   gpu.UpdateRecord
}

// follow tails the windows and policy topics until every group of every
// round is decided and every batch is trained, printing one line per
// update, then evaluates the last release.
func (r *runner) follow(ctx context.Context, errs <-chan error) error {
	tctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		stop()
		wg.Wait()
	}()
	windows := make(chan kafkago.Message, 64)
	policy := make(chan kafkago.Message, 64)
	for topic, ch := range map[string]chan kafkago.Message{r.topics.Windows: windows, r.topics.Policy: policy} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tail(tctx, r.brokers, topic, ch)
		}()
	}
	p := &progress{byBatch: map[string]schemas.WindowRecord{}, lastAt: time.Now(), evaluated: map[int64]bool{0: true}}
	want := r.o.Updates * r.c.Dispatch.GroupsPerUpdate
	// Without a trainer (NoTrain) the run ends once every group is decided.
	for p.decided < want || (!r.o.NoTrain && (p.lastVersion < int64(p.batches) || len(p.queued) > 0)) {
		var err error
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err = <-errs:
		case km := <-windows:
			err = r.onWindow(p, km.Value)
		case km := <-policy:
			err = r.onRelease(p, km.Value)
		}
		if err == nil {
			err = r.report(ctx, p)
		}
		if err != nil {
			return err
		}
	}
	return r.finalEval(ctx, p)
}

// tail reads partition 0 of topic from the start and sends every record
// until ctx ends.
func tail(ctx context.Context, brokers []string, topic string, out chan<- kafkago.Message) {
	for ctx.Err() == nil {
		r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokers, Topic: topic, Partition: 0, MinBytes: 1, MaxBytes: 64 << 20, MaxWait: kafka.FetchMaxWait})
		for {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				break
			}
			select {
			case out <- m:
			case <-ctx.Done():
			}
		}
		r.Close()
		if ctx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// onWindow counts one of pack's window records.
func (r *runner) onWindow(p *progress, v []byte) error {
	w, err := schemas.DecodeWindow(v)
	if err != nil {
		return fmt.Errorf("demo: window record: %w", err)
	}
	p.decided += len(w.Groups)
	p.packTokens += w.Tokens
	p.packCapacity += int64(w.Rows) * int64(r.c.Packing.TokenBudget)
	r.sum.MaxLagSeen = max(r.sum.MaxLagSeen, w.MaxLag)
	if w.BatchID == "" {
		if !r.o.Quiet {
			fmt.Fprintf(r.stdout, "     -  %7.3f  %6.3f  (every group of the round filtered: no batch, no update)\n", w.SuccessRate, w.RewardMean)
		}
		return nil
	}
	p.batches++
	p.byBatch[w.BatchID] = w
	if r.o.NoTrain && !r.o.Quiet {
		fmt.Fprintf(r.stdout, "     -  %7.3f  %6.3f  (batch %d: %d rows, %d tokens, packing %.3f; not trained: --no-train)\n",
			w.SuccessRate, w.RewardMean, w.BatchIndex, w.Rows, w.Tokens, w.Efficiency)
	}
	return nil
}

// onRelease queues a new release with its update record.
func (r *runner) onRelease(p *progress, v []byte) error {
	rel, err := schemas.DecodeRelease(v)
	if err != nil || !rel.Ready || rel.PolicyVersion <= p.lastVersion {
		return nil
	}
	p.lastRel = rel
	p.lastVersion = rel.PolicyVersion
	u, err := gpu.ReadUpdate(r.files, rel.PolicyVersion)
	if err != nil {
		return err
	}
	p.queued = append(p.queued, queuedUpdate{rel, u})
	return nil
}

// report prints the queued releases in order once pack's record of their
// batch is in, evaluating every evalEvery-th.
func (r *runner) report(ctx context.Context, p *progress) error {
	for len(p.queued) > 0 {
		rel, u := p.queued[0].rel, p.queued[0].u
		w, ok := p.byBatch[u.BatchID]
		if !ok {
			return nil
		}
		p.queued = p.queued[1:]
		now := time.Now()
		line := Update{
			Update: rel.PolicyVersion, BatchID: u.BatchID, Success: w.SuccessRate, Reward: w.RewardMean,
			KL: u.Last.ApproxKLOld, ClipFrac: clipFrac(u.Last), Entropy: u.Metrics.Entropy, Lag: w.MaxLag,
			Tokens: w.Tokens, TokensPerS: float64(w.Tokens) / now.Sub(p.lastAt).Seconds(), Packing: w.Efficiency,
		}
		for _, l := range u.Metrics.Lag {
			line.Lag = max(line.Lag, l.Lag)
		}
		r.sum.MaxLagSeen = max(r.sum.MaxLagSeen, line.Lag)
		p.lastAt = now
		evalNote := ""
		if r.ev != nil && rel.PolicyVersion%int64(r.evalEvery) == 0 { // no hidden eval of a served language model
			s, err := r.ev.Release(ctx, rel)
			if err != nil {
				return err
			}
			p.evaluated[rel.PolicyVersion] = true
			r.sum.Evals = append(r.sum.Evals, Eval{rel.PolicyVersion, s})
			line.EvalSuccess = &s
			evalNote = fmt.Sprintf("%.3f", s)
		}
		r.sum.PerUpdate = append(r.sum.PerUpdate, line)
		if !r.o.Quiet {
			fmt.Fprintf(r.stdout, "%6d  %7.3f  %6.3f  %6.4f  %6.3f  %7.3f  %3d  %8.0f  %7.3f  %s\n",
				line.Update, line.Success, line.Reward, line.KL, line.ClipFrac, line.Entropy, line.Lag,
				line.TokensPerS, line.Packing, evalNote)
		}
	}
	return nil
}

// finalEval evaluates the last release unless it was evaluated, and
// completes the summary's update and packing fields.
func (r *runner) finalEval(ctx context.Context, p *progress) error {
	r.sum.Updates = int(p.lastVersion)
	r.sum.EvalSuccessFinal = r.sum.EvalSuccessInitial
	if p.lastVersion > 0 && r.ev != nil {
		if !p.evaluated[p.lastVersion] {
			s, err := r.ev.Release(ctx, p.lastRel)
			if err != nil {
				return err
			}
			r.sum.Evals = append(r.sum.Evals, Eval{p.lastVersion, s})
		}
		r.sum.EvalSuccessFinal = r.sum.Evals[len(r.sum.Evals)-1].Success
	}
	if p.packCapacity > 0 {
		r.sum.PackingEfficiency = float64(p.packTokens) / float64(p.packCapacity)
	}
	return nil
}

// clipFrac is the fraction of trained tokens whose clipped branch was
// taken.
func clipFrac(s objective.Stats) float64 {
	if s.Tokens == 0 {
		return 0
	}
	return float64(s.ClippedPos+s.ClippedNeg) / float64(s.Tokens)
}
