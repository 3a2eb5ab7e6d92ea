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
	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/schemas"
)

// progress is what the loop has seen of the run: pack's window records
// (its decisions) and the trainer's releases.
type progress struct {
	decided, batches         int
	refused                  int // batches the trainer refused
	byBatch                  map[string]schemas.WindowRecord
	packTokens, packCapacity int64
	lastVersion              int64
	lastAt                   time.Time
	evaluated                map[int64]bool
	lastRel                  schemas.PolicyRelease
	queued                   []queuedUpdate // releases waiting for pack's record of their batch
	// want is the groups the run will decide: every round's, or after a
	// stop the groups of the rounds dispatch launched (its halted record).
	want int
	// census feeds the budgets; completed counts its completed events.
	census    <-chan kafkago.Message
	completed int
	// restored counts the releases of a rollback (no batch trained).
	restored int
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
	decisions := make(chan kafkago.Message, 64)
	incidents := make(chan kafkago.Message, 64)
	census := make(chan kafkago.Message, 256)
	tails := map[string]chan kafkago.Message{r.topics.Windows: windows, r.topics.Policy: policy}
	if r.g != nil {
		tails[r.topics.Decisions], tails[r.topics.Incidents] = decisions, incidents
	}
	for topic, ch := range tails {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tail(tctx, r.dialer, r.brokers, topic, 0, ch)
		}()
	}
	// Batches the trainer refuses (stale_batch, untrainable_batch) make no
	// release: the quarantine tells the loop not to wait for them.
	refusedCh := make(chan kafkago.Message, 64)
	for part := range max(1, r.c.Topics.Partitions) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tail(tctx, r.dialer, r.brokers, r.topics.Quarantine, part, refusedCh)
		}()
	}
	if r.g != nil { // the census counts toward the budgets: every partition
		for part := range r.c.Topics.Partitions {
			wg.Add(1)
			go func() {
				defer wg.Done()
				tail(tctx, r.dialer, r.brokers, r.topics.Census, part, census)
			}()
		}
	}
	p := &progress{byBatch: map[string]schemas.WindowRecord{}, lastAt: time.Now(), evaluated: map[int64]bool{0: true},
		want: r.o.Updates * r.c.Dispatch.GroupsPerUpdate, census: census}
	// Without a trainer (NoTrain) the run ends once every group is decided.
	for p.decided < p.want || (!r.o.NoTrain && (p.lastVersion+int64(p.refused) < int64(p.batches+p.restored) || len(p.queued) > 0)) {
		var err error
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err = <-errs:
		case km := <-windows:
			err = r.onWindow(p, km.Value)
		case km := <-policy:
			err = r.onRelease(p, km.Value)
		case km := <-decisions:
			r.onDecision(p, km.Value)
		case km := <-incidents:
			r.g.onIncident(km.Value)
		case km := <-census:
			p.completed += r.g.onCensus(km.Value)
		case km := <-refusedCh:
			r.onRefused(p, km)
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

// tail reads a partition of topic from the start and sends every record
// until ctx ends (d nil: kafka-go's default dialer).
func tail(ctx context.Context, d *kafkago.Dialer, brokers []string, topic string, partition int, out chan<- kafkago.Message) {
	for ctx.Err() == nil {
		r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokers, Dialer: d, Topic: topic, Partition: partition, MinBytes: 1, MaxBytes: 64 << 20, MaxWait: kafka.FetchMaxWait})
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

// onRefused counts a batch the trainer refused (its quarantine record).
func (r *runner) onRefused(p *progress, km kafkago.Message) {
	source := headerOf(km, schemas.HeaderSourceTopic)
	if headerOf(km, schemas.HeaderStage) == "train" && source == r.topics.Batches {
		p.refused++
		if !r.o.Quiet {
			fmt.Fprintf(r.stdout, "     -  (batch at %s@%d refused by the trainer: %s)\n", source, km.Offset, headerOf(km, schemas.HeaderReason))
		}
	}
}

func headerOf(km kafkago.Message, key string) string {
	for _, h := range km.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
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
	if u.RolledBackTo != nil {
		p.restored++
	}
	r.sum.ReleaseSeconds = append(r.sum.ReleaseSeconds, time.Since(r.opsStart).Seconds())
	r.sum.TrainedTokens += u.Metrics.Tokens
	r.sum.ReleaseTokens = append(r.sum.ReleaseTokens, r.sum.TrainedTokens)
	r.sum.LagTokens = addLag(r.sum.LagTokens, u.Lag)
	if u.Cost != nil {
		r.sum.Cost.Add(*u.Cost)
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
		if !ok && u.RolledBackTo == nil {
			return nil
		}
		p.queued = p.queued[1:]
		now := time.Now()
		line := Update{
			Update: rel.PolicyVersion, BatchID: u.BatchID, Success: w.SuccessRate, Reward: w.RewardMean,
			KL: u.Last.ApproxKLOld, ClipFrac: clipFrac(u.Last), Entropy: r.c.Loss.PerToken(u.Metrics.Entropy, u.Metrics.Tokens), Lag: w.MaxLag,
			Tokens: w.Tokens, TokensPerS: float64(w.Tokens) / now.Sub(p.lastAt).Seconds(), Packing: w.Efficiency,
		}
		for _, l := range u.Metrics.Lag {
			line.Lag = max(line.Lag, l.Lag)
		}
		r.sum.MaxLagSeen = max(r.sum.MaxLagSeen, line.Lag)
		p.lastAt = now
		evalNote := ""
		var d *gate.Decision
		if r.g != nil && !r.g.st.Stopped {
			r.awaitCensus(ctx, p)
			// A restored release holds the promoted parameters: no evaluation.
			ev, dd, kl, err := r.judge(ctx, rel, u, u.RolledBackTo == nil && rel.PolicyVersion%int64(r.evalEvery) == 0)
			if err != nil {
				return err
			}
			d, line.KLRef, line.Decision = dd, kl, dd.Action
			if ev != nil {
				p.evaluated[rel.PolicyVersion] = true
				r.sum.Evals = append(r.sum.Evals, Eval{rel.PolicyVersion, *ev})
				line.EvalSuccess = ev
				evalNote = fmt.Sprintf("%.3f", *ev)
			}
		}
		r.sum.PerUpdate = append(r.sum.PerUpdate, line)
		if !r.o.Quiet && u.RolledBackTo != nil {
			fmt.Fprintf(r.stdout, "%6d  rollback: the parameters and optimizer state of release %d (releases %d..%d kept)\n",
				line.Update, *u.RolledBackTo, *u.RolledBackTo+1, line.Update-1)
		} else if !r.o.Quiet {
			fmt.Fprintf(r.stdout, "%6d  %7.3f  %6.3f  %6.4f  %6.3f  %7.3f  %3d  %8.0f  %7.3f  %6.4f  %s\n",
				line.Update, line.Success, line.Reward, line.KL, line.ClipFrac, line.Entropy, line.Lag,
				line.TokensPerS, line.Packing, line.KLRef, evalNote)
			if d != nil && (d.Evaluated || d.Action == gate.Stop) {
				fmt.Fprintln(r.stdout, decisionLine(d))
			}
		}
	}
	return nil
}

// awaitCensus reads the census until it holds a completed episode for
// every attempt of the groups pack decided (the budgets then count every
// round the release was trained on), or for at most 5 s: an attempt that
// failed or was quarantined never completes.
func (r *runner) awaitCensus(ctx context.Context, p *progress) {
	need := p.decided * r.c.Sampler.GroupSize
	deadline := time.NewTimer(5 * time.Second)
	defer deadline.Stop()
	for p.completed < need {
		select {
		case <-ctx.Done():
			return
		case <-deadline.C:
			return
		case km := <-p.census:
			p.completed += r.g.onCensus(km.Value)
		}
	}
}

// onDecision reads the decisions topic for dispatch's halted record: the
// run then decides the groups of the rounds dispatch launched, no more.
func (r *runner) onDecision(p *progress, v []byte) {
	d, err := schemas.DecodeGateDecision(v)
	if err != nil || d.Action != schemas.GateHalted || r.g.sum.Halted != nil {
		return
	}
	r.g.sum.Halted = &d
	r.sum.Rounds, r.sum.StoppedBy = int(d.RoundsDispatched), d.StopRule
	p.want = min(p.want, int(d.RoundsDispatched)*r.c.Dispatch.GroupsPerUpdate)
	if !r.o.Quiet {
		fmt.Fprintln(r.stdout, d.Reason)
	}
}

// finalEval evaluates the last release unless it was evaluated, and
// completes the summary's update and packing fields.
func (r *runner) finalEval(ctx context.Context, p *progress) error {
	r.sum.Updates = int(p.lastVersion)
	r.sum.EvalSuccessFinal = r.sum.EvalSuccessInitial
	if p.lastVersion > 0 && r.g != nil {
		if !p.evaluated[p.lastVersion] {
			if err := r.evalFinal(ctx, p.lastRel); err != nil {
				return err
			}
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

// addLag adds the lag counts of b to a, in increasing lag order.
func addLag(a, b []schemas.LagCount) []schemas.LagCount {
	for _, x := range b {
		i := 0
		for i < len(a) && a[i].Lag < x.Lag {
			i++
		}
		if i < len(a) && a[i].Lag == x.Lag {
			a[i].Tokens += x.Tokens
			continue
		}
		a = append(a[:i], append([]schemas.LagCount{x}, a[i:]...)...)
	}
	return a
}
