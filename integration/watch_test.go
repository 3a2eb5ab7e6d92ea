//go:build integration

package integration

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// loopWatch follows a loop run from the outside, with its own Kafka client
// (franz-go, independent of the operators' kafka-go, so that what it sees
// of a fault is the cluster's and not the operators' client's): the tasks
// topic (rounds from the trajflow-round header, attempt ids), the windows
// topic (the groups each window decided, its batch), the policy topic
// (released versions) and, when asked, the scored topic (offsets of each
// round's records), every one from its first offset; and the committed
// offsets of every consumer group of the run, polled every pollEvery.
// Times are the records' timestamps (the producers' clock: every process
// runs on this machine) and, for commits, the time of the poll that saw
// the offset move.
type loopWatch struct {
	topics    pipeline.Topics
	groups    []string // consumer groups, "<run>.<stage>"
	roundSize int      // groups dispatched per round
	pollEvery time.Duration

	cons, adm *kgo.Client
	cancel    context.CancelFunc
	wg        sync.WaitGroup

	mu          sync.Mutex
	roundOf     map[string]int64              // group id -> round
	roundGroups map[int64]map[string]bool     // round -> its group ids
	dispatched  map[int64]time.Time           // round -> first tasks record
	attempts    map[string]bool               // launched attempt ids
	decided     map[string]time.Time          // group id -> window that decided it
	batches     map[string]bool               // batch ids named by windows
	windows     []time.Time                   // window record times
	version     int64                         // highest released policy version
	released    map[int64]time.Time           // version -> first release record
	perRound    map[string]map[int64]*onTopic // followed data topic -> round -> its records there
	ends        map[string]int64              // followed data topic -> offset after the last record seen
	commits     map[string][]time.Time        // consumer group -> polls that saw its offsets move
	polls       map[string][]time.Time        // consumer group -> polls it answered
	offsets     map[string]map[string]int64   // consumer group -> "topic/partition" -> committed
	pollErrors  int
	consumeErrs int
	lastErr     error
}

// watchLoop starts following the run of topics on brokers; stages are the
// stages whose consumer groups are polled; data are the data-plane topics
// (keyed by group id) whose records are located by round.
func watchLoop(brokers []string, topics pipeline.Topics, runID string, stages []string, perRound int, data []string) (*loopWatch, error) {
	w := &loopWatch{
		topics: topics, roundSize: perRound, pollEvery: 300 * time.Millisecond,
		roundOf: map[string]int64{}, roundGroups: map[int64]map[string]bool{}, dispatched: map[int64]time.Time{},
		attempts: map[string]bool{}, decided: map[string]time.Time{}, batches: map[string]bool{},
		version: -1, released: map[int64]time.Time{}, perRound: map[string]map[int64]*onTopic{}, ends: map[string]int64{},
		commits: map[string][]time.Time{}, polls: map[string][]time.Time{}, offsets: map[string]map[string]int64{},
	}
	seen := map[string]bool{}
	for _, s := range stages {
		if g := runID + "." + s; !seen[g] {
			seen[g] = true
			w.groups = append(w.groups, g)
		}
	}
	follow := []string{topics.Tasks, topics.Windows, topics.Policy}
	for _, d := range data {
		w.perRound[d] = map[int64]*onTopic{}
		follow = append(follow, d)
	}
	var err error
	w.cons, err = kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(follow...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(500*time.Millisecond),
		kgo.DialTimeout(2*time.Second), kgo.MetadataMinAge(250*time.Millisecond),
		kgo.FetchMaxBytes(64<<20), kgo.FetchMaxPartitionBytes(32<<20), kgo.BrokerMaxReadBytes(128<<20))
	if err != nil {
		return nil, err
	}
	if w.adm, err = adminClient(brokers); err != nil {
		w.cons.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	w.wg.Add(2)
	go func() { defer w.wg.Done(); w.consume(ctx) }()
	go func() { defer w.wg.Done(); w.poll(ctx) }()
	return w, nil
}

// adminClient is a franz-go client for admin requests: short timeouts, a
// fresh metadata view after any failure.
func adminClient(brokers []string) (*kgo.Client, error) {
	return kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DialTimeout(2*time.Second),
		kgo.RequestTimeoutOverhead(2*time.Second), kgo.RetryTimeout(3*time.Second),
		kgo.MetadataMinAge(250*time.Millisecond))
}

func (w *loopWatch) close() {
	w.cancel()
	w.wg.Wait()
	w.cons.Close()
	w.adm.Close()
}

func (w *loopWatch) consume(ctx context.Context) {
	for ctx.Err() == nil {
		fs := w.cons.PollFetches(ctx)
		fs.EachError(func(_ string, _ int32, err error) {
			if !errors.Is(err, context.Canceled) {
				w.mu.Lock()
				w.consumeErrs++
				w.lastErr = err
				w.mu.Unlock()
			}
		})
		w.mu.Lock()
		fs.EachRecord(w.record)
		w.mu.Unlock()
	}
}

// record takes one record (w.mu held).
func (w *loopWatch) record(r *kgo.Record) {
	switch r.Topic {
	case w.topics.Tasks:
		round := int64(-1)
		for _, h := range r.Headers {
			if h.Key == schemas.HeaderRound {
				round, _ = strconv.ParseInt(string(h.Value), 10, 64)
			}
		}
		g := string(r.Key)
		if round < 0 || g == "" {
			return
		}
		w.roundOf[g] = round
		if w.roundGroups[round] == nil {
			w.roundGroups[round] = map[string]bool{}
		}
		w.roundGroups[round][g] = true
		if t, ok := w.dispatched[round]; !ok || r.Timestamp.Before(t) {
			w.dispatched[round] = r.Timestamp
		}
		if atts, err := schemas.TaskAttempts.Decode(nil, r.Value); err == nil {
			for _, a := range atts {
				w.attempts[a.AttemptID] = true
			}
		}
	case w.topics.Windows:
		win, err := schemas.DecodeWindow(r.Value)
		if err != nil {
			return
		}
		w.windows = append(w.windows, r.Timestamp)
		for _, g := range win.Groups {
			if _, ok := w.decided[g]; !ok {
				w.decided[g] = r.Timestamp
			}
		}
		if win.BatchID != "" {
			w.batches[win.BatchID] = true
		}
	case w.topics.Policy:
		rel, err := schemas.DecodeRelease(r.Value)
		if err != nil {
			return
		}
		w.version = max(w.version, rel.PolicyVersion)
		if _, ok := w.released[rel.PolicyVersion]; !ok {
			w.released[rel.PolicyVersion] = r.Timestamp
		}
	default:
		if m := w.perRound[r.Topic]; m != nil {
			if round, ok := w.roundOf[string(r.Key)]; ok {
				if m[round] == nil {
					m[round] = &onTopic{groups: map[string]bool{}}
				}
				m[round].offsets = append(m[round].offsets, r.Offset)
				m[round].groups[string(r.Key)] = true
			}
			w.ends[r.Topic] = max(w.ends[r.Topic], r.Offset+1)
		}
	}
}

// poll asks the committed offsets of every group each pollEvery.
func (w *loopWatch) poll(ctx context.Context) {
	t := time.NewTicker(w.pollEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		got, err := fetchCommitted(ctx, w.adm, w.groups)
		w.mu.Lock()
		if err != nil && ctx.Err() == nil {
			w.pollErrors++
			w.lastErr = err
		}
		for g, offs := range got {
			prev := w.offsets[g]
			moved := false
			for tp, o := range offs {
				if p, ok := prev[tp]; (!ok && o >= 0) || (ok && o > p) {
					moved = true
				}
			}
			if moved {
				w.commits[g] = append(w.commits[g], now)
			}
			w.polls[g] = append(w.polls[g], now)
			merged := map[string]int64{}
			for tp, o := range prev {
				merged[tp] = o
			}
			for tp, o := range offs {
				merged[tp] = max(merged[tp], o)
			}
			w.offsets[g] = merged
		}
		w.mu.Unlock()
	}
}

// fetchCommitted returns the committed offsets of the groups that
// answered ("topic/partition" -> offset); err joins the failures of the
// others.
//
// It asks every broker which node coordinates each group, then each
// coordinator for its groups, all at once and within 2 s, so that a hung
// broker (SIGSTOP: its connections stay open and nothing answers) delays
// only the groups it coordinates, and the answer of the first broker that
// replies names the new coordinators as soon as the cluster moved them.
// franz-go's sharded request routes FindCoordinator to one broker and
// keeps a coordinator cached until a broker denies it: with one broker
// hung, whole polls failed for the length of the hang while the loop
// went on, and every group's recovery read as the length of the pause.
func fetchCommitted(ctx context.Context, adm *kgo.Client, groups []string) (map[string]map[string]int64, error) {
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	coord, err := findCoordinators(rctx, adm, groups)
	if err != nil {
		return nil, err
	}
	type answer struct {
		group string
		offs  map[string]int64
		err   error
	}
	answers := make(chan answer, len(groups))
	var errs []error
	asked := 0
	for _, g := range groups {
		node, ok := coord[g]
		if !ok {
			errs = append(errs, fmt.Errorf("group %s: no coordinator named", g))
			continue
		}
		asked++
		go func() {
			offs, err := fetchGroup(rctx, adm.Broker(int(node)), g)
			answers <- answer{g, offs, err}
		}()
	}
	out := map[string]map[string]int64{}
	for range asked {
		a := <-answers
		if a.err != nil {
			errs = append(errs, fmt.Errorf("group %s (coordinator %d): %w", a.group, coord[a.group], a.err))
			continue
		}
		out[a.group] = a.offs
	}
	return out, errors.Join(errs...)
}

// findCoordinators asks every known broker at once which node coordinates
// each group and takes, per group, the first answer without an error.
func findCoordinators(ctx context.Context, adm *kgo.Client, groups []string) (map[string]int32, error) {
	brokers := adm.DiscoveredBrokers()
	if len(brokers) == 0 {
		if _, err := adm.Request(ctx, kmsg.NewPtrMetadataRequest()); err != nil {
			return nil, fmt.Errorf("metadata: %w", err)
		}
		brokers = adm.DiscoveredBrokers()
	}
	type answer struct {
		resp *kmsg.FindCoordinatorResponse
		err  error
	}
	answers := make(chan answer, len(brokers))
	for _, b := range brokers {
		go func() {
			req := kmsg.NewPtrFindCoordinatorRequest()
			req.CoordinatorKeys = groups
			resp, err := req.RequestWith(ctx, b)
			answers <- answer{resp, err}
		}()
	}
	coord := map[string]int32{}
	var errs []error
	for range brokers {
		a := <-answers
		if a.err != nil {
			errs = append(errs, a.err)
			continue
		}
		for _, c := range a.resp.Coordinators {
			if _, ok := coord[c.Key]; !ok && c.ErrorCode == 0 {
				coord[c.Key] = c.NodeID
			}
		}
		if len(coord) == len(groups) {
			break // the others answer into the buffered channel
		}
	}
	if len(coord) == 0 {
		return nil, fmt.Errorf("find coordinators: %w", errors.Join(errs...))
	}
	return coord, nil
}

// offsetFetchV9 caps OffsetFetch at version 9, whose answer names topics
// (version 10 names them by id); every broker the suite runs against
// (Apache Kafka 4.1, kfake) serves versions 8 and 9, which carry groups.
type offsetFetchV9 struct{ *kmsg.OffsetFetchRequest }

func (offsetFetchV9) MaxVersion() int16 { return 9 }

// fetchGroup asks coordinator b for every committed offset of group g.
func fetchGroup(ctx context.Context, b *kgo.Broker, g string) (map[string]int64, error) {
	req := kmsg.NewPtrOffsetFetchRequest()
	rg := kmsg.NewOffsetFetchRequestGroup()
	rg.Group = g
	req.Groups = append(req.Groups, rg)
	r, err := b.Request(ctx, offsetFetchV9{req})
	if err != nil {
		return nil, err
	}
	offs := map[string]int64{}
	for _, rg := range r.(*kmsg.OffsetFetchResponse).Groups {
		if err := kerr.ErrorForCode(rg.ErrorCode); err != nil {
			return nil, err
		}
		for _, t := range rg.Topics {
			for _, p := range t.Partitions {
				if p.ErrorCode == 0 && p.Offset >= 0 {
					offs[fmt.Sprintf("%s/%d", t.Topic, p.Partition)] = p.Offset
				}
			}
		}
	}
	return offs, nil
}

// roundDone returns when every group of round r was decided (w.mu held).
func (w *loopWatch) roundDone(r int64) (time.Time, bool) {
	gs := w.roundGroups[r]
	if len(gs) < w.roundSize {
		return time.Time{}, false
	}
	var last time.Time
	for g := range gs {
		t, ok := w.decided[g]
		if !ok {
			return time.Time{}, false
		}
		if t.After(last) {
			last = t
		}
	}
	return last, true
}

// progress is a snapshot of the run.
type progress struct {
	dispatched, done int   // rounds
	batches          int   // batch ids named by window records
	version          int64 // highest released policy version
	attempts         int
}

func (w *loopWatch) progress() progress {
	w.mu.Lock()
	defer w.mu.Unlock()
	p := progress{dispatched: len(w.dispatched), batches: len(w.batches), version: w.version, attempts: len(w.attempts)}
	for r := range w.dispatched {
		if _, ok := w.roundDone(r); ok {
			p.done++
		}
	}
	return p
}

// complete reports whether rounds rounds were dispatched and decided and
// every batch was trained (the trainer released one version per batch).
func (p progress) complete(rounds int) bool {
	return p.dispatched == rounds && p.done == rounds && p.version == int64(p.batches)
}

// stall is the liveness measure at now: the age of the oldest round
// dispatched and not yet decided, or, with no round open, the time since
// the last record of the loop (a decided round waiting for its training
// and the next dispatch). Zero once the run is complete.
func (w *loopWatch) stall(now time.Time, rounds int) (time.Duration, string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var worst time.Duration
	what := ""
	var last time.Time
	open := false
	for r, t := range w.dispatched {
		if t.After(last) {
			last = t
		}
		done, ok := w.roundDone(r)
		if !ok {
			open = true
			if age := now.Sub(t); age > worst {
				worst, what = age, fmt.Sprintf("round %d dispatched %s ago has no window record deciding all of it", r, age.Round(time.Second))
			}
		} else if done.After(last) {
			last = done
		}
	}
	for _, t := range w.released {
		if t.After(last) {
			last = t
		}
	}
	if open || last.IsZero() {
		return worst, what
	}
	if len(w.dispatched) == rounds && w.version == int64(len(w.batches)) {
		return 0, ""
	}
	idle := now.Sub(last)
	return idle, fmt.Sprintf("no dispatch, window or release for %s (%d rounds dispatched, version %d, %d batches)",
		idle.Round(time.Second), len(w.dispatched), w.version, len(w.batches))
}

// roundTimes returns, for every decided round in order, its dispatch and
// decision times.
func (w *loopWatch) roundTimes() (dispatched, done []time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	rs := make([]int64, 0, len(w.dispatched))
	for r := range w.dispatched {
		rs = append(rs, r)
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i] < rs[j] })
	for _, r := range rs {
		if d, ok := w.roundDone(r); ok {
			dispatched = append(dispatched, w.dispatched[r])
			done = append(done, d)
		}
	}
	return dispatched, done
}

// roundsDoneIn counts the rounds decided in [from, to).
func (w *loopWatch) roundsDoneIn(from, to time.Time) int {
	_, done := w.roundTimes()
	n := 0
	for _, t := range done {
		if !t.Before(from) && t.Before(to) {
			n++
		}
	}
	return n
}

// firstCommitAfter returns, per consumer group, the time from t to the
// first poll that saw the group's committed offsets move past what the
// first poll after t saw (absent: none yet). Commits made before t are
// never counted; one made between t and that first poll is (by at most
// one poll interval, 300 ms) counted late.
func (w *loopWatch) firstCommitAfter(t time.Time) map[string]time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string]time.Duration{}
	for g, ts := range w.commits {
		var base time.Time
		for _, p := range w.polls[g] {
			if !p.Before(t) {
				base = p
				break
			}
		}
		if base.IsZero() {
			continue
		}
		for _, c := range ts {
			if c.After(base) {
				out[g] = c.Sub(t)
				break
			}
		}
	}
	return out
}

// commitGaps returns, per consumer group, the longest time between two
// polls that saw its offsets move within [from, to): how often the group
// commits when nothing is wrong.
func (w *loopWatch) commitGaps(from, to time.Time) map[string]time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string]time.Duration{}
	for g, ts := range w.commits {
		var prev time.Time
		for _, c := range ts {
			if c.Before(from) || !c.Before(to) {
				continue
			}
			if !prev.IsZero() && c.Sub(prev) > out[g] {
				out[g] = c.Sub(prev)
			}
			prev = c
		}
	}
	return out
}

// onTopic is where a round's records are on a data topic.
type onTopic struct {
	offsets []int64
	groups  map[string]bool
}

// located returns the offsets of round's records on a followed data
// topic, how many distinct groups they belong to, and the offset after the
// last record seen there (one partition: the scored topic's).
func (w *loopWatch) located(topic string, round int64) (offsets []int64, groups int, end int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if on := w.perRound[topic][round]; on != nil {
		offsets, groups = append(offsets, on.offsets...), len(on.groups)
	}
	return offsets, groups, w.ends[topic]
}

// committed returns a group's committed offset of topic/partition (-1:
// none).
func (w *loopWatch) committed(group, topic string, partition int) int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if o, ok := w.offsets[group][fmt.Sprintf("%s/%d", topic, partition)]; ok {
		return o
	}
	return -1
}

// launched returns the distinct attempt ids dispatched.
func (w *loopWatch) launched() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]string, 0, len(w.attempts))
	for id := range w.attempts {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// errorsSeen describes the watch's own failures (polls and fetches that
// failed during faults; they delay what it sees, never what it counts).
func (w *loopWatch) errorsSeen() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pollErrors == 0 && w.consumeErrs == 0 {
		return "none"
	}
	return fmt.Sprintf("%d offset polls and %d fetches failed (last: %v)", w.pollErrors, w.consumeErrs, w.lastErr)
}

// stageOf is the stage of a consumer group "<run>.<stage>".
func stageOf(group string) string {
	if i := strings.LastIndexByte(group, '.'); i >= 0 {
		return group[i+1:]
	}
	return group
}
