package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/trace"

	tfkafka "github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/schemas"
)

// headerValue is the value of the last header named key ("" if none).
func headerValue(hs []Header, key string) string {
	v := ""
	for _, h := range hs {
		if h.Key == key {
			v = string(h.Value)
		}
	}
	return v
}

// Config configures one operator process.
type Config struct {
	Brokers []string
	// GroupID is the consumer group; instances of one stage share it.
	GroupID string
	// QuarantineTopic receives every refused record.
	QuarantineTopic string
	// Dialer and Transport carry TLS/SASL settings; nil means plaintext.
	Dialer    *kafka.Dialer
	Transport *kafka.Transport
	// MaxInFlightRecords and MaxInFlightBytes bound the outputs produced but
	// not yet acknowledged; the stage blocks when either is reached.
	MaxInFlightRecords int
	MaxInFlightBytes   int64
	// MaxMessageBytes is the largest record the topics accept; a larger
	// output sends its input to quarantine with reason "output_oversize".
	MaxMessageBytes int
	// Compression is the producer codec of topics (full name -> codec);
	// records of other topics go uncompressed. Each codec gets its own
	// writer, so a topic's records keep their order.
	Compression    map[string]kafka.Compression
	CommitInterval time.Duration
	BatchTimeout   time.Duration
	TickInterval   time.Duration
	// DrainTimeout bounds a graceful shutdown (the stage's Flush included).
	DrainTimeout time.Duration
	// ProduceRetryWindow is how long the producer retries a transient
	// write failure (a partition leader moving, a broker restarting) in
	// place, in order, before the operator stops (default 60 s).
	ProduceRetryWindow time.Duration
	// StateDir is where the stage's local state store lives (Env.State);
	// "" keeps it in memory.
	StateDir string
	// Releases is the stage's release store (Env.Releases); nil: none.
	Releases ReleaseStore
	// Now is the stage's clock (Env.Now); nil: time.Now.
	Now    func() time.Time
	Logger *slog.Logger
	// Metrics receives the operator's collectors; nil: a private registry.
	Metrics *Metrics
	// TracerProvider makes the span of every record's processing (nil:
	// the global provider, a no-op unless the program installs one).
	TracerProvider trace.TracerProvider
	// Hooks observe the operator: each is called through the hook
	// interfaces it implements (ProcessHook).
	Hooks []Hook
	// Instance names this process in logs and metrics.
	Instance string
}

func (c *Config) defaults() {
	if c.MaxInFlightRecords <= 0 {
		c.MaxInFlightRecords = 1024
	}
	if c.MaxInFlightBytes <= 0 {
		c.MaxInFlightBytes = 256 << 20
	}
	if c.MaxMessageBytes <= 0 {
		c.MaxMessageBytes = 64 << 20
	}
	if c.CommitInterval <= 0 {
		c.CommitInterval = 200 * time.Millisecond
	}
	if c.BatchTimeout <= 0 {
		c.BatchTimeout = 2 * time.Millisecond
	}
	if c.TickInterval <= 0 {
		c.TickInterval = 250 * time.Millisecond
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = 30 * time.Second
	}
	if c.ProduceRetryWindow <= 0 {
		c.ProduceRetryWindow = 60 * time.Second
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
	}
}

// dialer is the configured Dialer, or a plaintext one that fails a dial
// to a broker that accepts connections but does not answer
// (tfkafka.ProbingDial).
func (c *Config) dialer() *kafka.Dialer {
	if c.Dialer != nil {
		return c.Dialer
	}
	return &kafka.Dialer{Timeout: 10 * time.Second, DialFunc: tfkafka.ProbingDial}
}

// Hook observes an operator. The runtime calls the methods of the hook
// interfaces a Hook implements; metrics, tracing and benchmarks attach here
// instead of wrapping stages.
type Hook any

// ProcessHook observes every call of the stage: Process (m is the input),
// and Tick and Flush (m is nil). res and err are what the stage returned;
// took is the time it spent. The hook must not modify them.
type ProcessHook interface {
	OnProcess(stage string, m *Message, res *Result, err error, took time.Duration)
}

// ErrStopped is returned by Run after a graceful shutdown.
var ErrStopped = errors.New("pipeline: operator stopped")

// ackGroup is the set of outputs derived from some inputs; when all are
// acknowledged the inputs are complete.
type ackGroup struct {
	mu        sync.Mutex
	remaining int
	refs      []Ref
	bytes     int64
	release   []func()      // the outputs' Release, called when all are acknowledged
	done      chan struct{} // when not nil, closed once all are acknowledged
}

// Operator runs one stage. Run may be called once.
type Operator struct {
	cfg     Config
	stage   Stage
	env     *Env
	reader  groupReader
	writer  producers
	track   *tracker
	flow    *flowControl
	m       *stageMetrics
	process []ProcessHook

	stageMu sync.Mutex // Process, Tick and Flush never run concurrently

	errOnce sync.Once
	fatal   chan error
	failed  chan struct{} // closed with the first fatal error
	ready   chan struct{}
	readyOK sync.Once
	// degraded counts the consecutive transient fetch failures (0: healthy).
	degraded atomic.Int64

	// newReader builds the consumer-group reader (kafka-go's; tests
	// substitute one); transport carries the writer's requests under
	// produceRetry (cfg.Transport; nil: a plaintext one per Run).
	newReader func(kafka.ReaderConfig) groupReader
	transport kafka.RoundTripper
}

// NewOperator builds an operator for stage; Run starts it.
func NewOperator(cfg Config, stage Stage) (*Operator, error) {
	cfg.defaults()
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("pipeline: no brokers configured")
	}
	if cfg.GroupID == "" {
		cfg.GroupID = "trajflow-" + stage.Name()
	}
	if cfg.QuarantineTopic == "" {
		return nil, errors.New("pipeline: no quarantine topic configured")
	}
	if len(stage.Topics()) == 0 {
		return nil, fmt.Errorf("pipeline: stage %s consumes no topic", stage.Name())
	}
	o := &Operator{
		cfg:   cfg,
		stage: stage,
		track: newTracker(),
		flow:  newFlowControl(cfg.MaxInFlightRecords, cfg.MaxInFlightBytes),
		m:     cfg.Metrics.forStage(stage.Name(), cfg.Instance),
		fatal: make(chan error, 1),
		ready: make(chan struct{}),
	}
	o.failed = make(chan struct{})
	o.newReader = func(c kafka.ReaderConfig) groupReader { return kafka.NewReader(c) }
	if cfg.Transport != nil {
		o.transport = cfg.Transport
	}
	for _, h := range cfg.Hooks {
		if p, ok := h.(ProcessHook); ok {
			o.process = append(o.process, p)
		}
	}
	return o, nil
}

// Ready is closed once the operator has rebuilt its state and joined its
// group.
func (o *Operator) Ready() <-chan struct{} { return o.ready }

// Stage is the stage the operator runs.
func (o *Operator) Stage() Stage { return o.stage }

// Degraded reports whether the operator's last fetches failed with
// transient broker errors (it keeps retrying in place).
func (o *Operator) Degraded() bool { return o.degraded.Load() > 0 }

func (o *Operator) fail(err error) {
	o.errOnce.Do(func() { o.fatal <- err; close(o.failed) })
}

// inputTopics are the topics the operator needs before it starts: its
// inputs, its side inputs and, for a stage of the topology, the topics it
// reads back when it starts (Scanned: its own outputs, to rebuild lost
// state), so that a stateful stage waits for them instead of failing.
func (o *Operator) inputTopics() []string {
	ts := append([]string(nil), o.stage.Topics()...)
	if si, ok := o.stage.(SideInputs); ok {
		ts = append(ts, si.SideTopics()...)
	}
	name := o.stage.Name()
	prefix, found := "", false
	for _, short := range InputsOf(name) {
		for _, t := range o.stage.Topics() {
			if strings.HasSuffix(t, "."+short) {
				prefix, found = strings.TrimSuffix(t, short), true
			}
		}
	}
	if found {
		for _, short := range shortsWhere(func(t TopicInfo) []string { return t.Scanned }, name) {
			if full := prefix + short; !slices.Contains(ts, full) {
				ts = append(ts, full)
			}
		}
	}
	return ts
}

// Run consumes until ctx is cancelled (graceful: in-flight outputs are
// drained and offsets committed, then ErrStopped is returned) or a fatal
// error occurs (nothing more is committed; redelivery after restart
// recovers). Transient broker errors — a partition leader or the group
// coordinator moving, a broker restarting — are retried in place, keeping
// the stage's state and group membership. Whatever the outcome, the stage
// is closed (io.Closer) and then its state store.
func (o *Operator) Run(ctx context.Context) (err error) {
	cfg := &o.cfg
	log := cfg.Logger.With("stage", o.stage.Name(), "instance", cfg.Instance)
	o.env = NewEnv(EnvConfig{Logger: log, Now: cfg.Now, Scanner: kafkaScanner{cfg}, StateDir: cfg.StateDir, Releases: cfg.Releases,
		Duplicates: func(string) { o.m.duplicates.Inc() }, Domain: o.m.domain,
		Emit: func(ctx context.Context, outs []Output) error {
			outs, err := o.oversize(outs, nil)
			if err != nil {
				return err
			}
			return o.write(ctx, outs, nil, false)
		}})
	defer func() {
		if cerr := closeStage(o.stage, o.env); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if err := waitTopics(ctx, cfg, o.inputTopics(), log); err != nil {
		return err
	}
	if s, ok := o.stage.(Starter); ok {
		if err := s.Start(ctx, o.env); err != nil {
			if ctx.Err() != nil {
				return ErrStopped
			}
			return fmt.Errorf("pipeline: start %s: %w", o.stage.Name(), err)
		}
	}
	// A member that died (an operator killed, the group's coordinator
	// lost with its connections) is dropped after the session timeout,
	// and a join waits at most the rebalance timeout for the members
	// the coordinator still knows (kafka-go forgets its member id after
	// a coordinator failure and joins as a new member: the member keeper
	// removes the old id so that the new coordinator does not wait for
	// it; memberkeeper.go). 6 s is the brokers' smallest session timeout
	// by default (group.min.session.timeout.ms); 4 s to rejoin leaves
	// kafka-go's members (heartbeat every second) time to leave a
	// generation. The reader's own client id is how the keeper finds its
	// membership.
	readerDialer := *cfg.dialer()
	readerDialer.ClientID = memberClientID(readerDialer.ClientID, cfg.GroupID)
	o.reader = o.newReader(kafka.ReaderConfig{
		Brokers:           cfg.Brokers,
		GroupID:           cfg.GroupID,
		GroupTopics:       o.stage.Topics(),
		Dialer:            &readerDialer,
		MinBytes:          1,
		MaxBytes:          cfg.MaxMessageBytes + (1 << 20),
		MaxWait:           tfkafka.FetchMaxWait,
		StartOffset:       kafka.FirstOffset,
		CommitInterval:    0, // commits are explicit and synchronous
		HeartbeatInterval: time.Second,
		SessionTimeout:    6 * time.Second,
		RebalanceTimeout:  4 * time.Second,
		JoinGroupBackoff:  500 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    200 * time.Millisecond,
		MaxAttempts:       3,
	})
	base := o.transport
	if base == nil {
		own := &kafka.Transport{MetadataTTL: tfkafka.MetadataTTL, Dial: tfkafka.ProbingDial}
		defer own.CloseIdleConnections()
		base = own
	}
	// The produce requests carry the profiler labels of the context the
	// operator runs in (tfkafka.LabelRequests says why).
	labelled := tfkafka.LabelRequests(ctx, base)
	o.writer = newProducers(cfg.Compression, func(codec kafka.Compression) *kafka.Writer {
		return o.newWriter(codec, produceRetry{labelled})
	})

	fetchCtx, stopFetch := context.WithCancel(context.Background())
	defer stopFetch()
	var wg sync.WaitGroup
	commitDone := make(chan struct{})
	wg.Add(1)
	go func() { defer wg.Done(); o.commitLoop(commitDone, log) }()
	keeper := &memberKeeper{client: &kafka.Client{Addr: kafka.TCP(cfg.Brokers...), Transport: base}, group: cfg.GroupID,
		clientID: readerDialer.ClientID, log: log}
	wg.Add(1)
	go func() { defer wg.Done(); keeper.run(fetchCtx) }()
	if tk, ok := o.stage.(Ticker); ok {
		wg.Add(1)
		go func() { defer wg.Done(); o.tickLoop(fetchCtx, tk) }()
	}
	if si, ok := o.stage.(SideInputs); ok {
		for _, topic := range si.SideTopics() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := followSide(fetchCtx, cfg, topic, log, func(m Message) error { return si.Side(fetchCtx, m) }); err != nil {
					o.fail(fmt.Errorf("pipeline: %s side input %s: %w", o.stage.Name(), topic, err))
				}
			}()
		}
	}
	// Cancelling ctx stops fetching; the loop below then drains. A fatal
	// error (a produce that failed for good, a side input, a tick) stops it
	// too: a fetch waiting for records that may never come must not keep
	// the operator from stopping and restarting.
	go func() {
		select {
		case <-ctx.Done():
		case <-fetchCtx.Done():
		case <-o.failed:
		}
		stopFetch()
	}()

	o.readyOK.Do(func() { close(o.ready) })
	loopErr := o.fetchLoop(fetchCtx, log)
	stopFetch()
	graceful := loopErr == nil
	drainCtx, cancelDrain := context.WithTimeout(context.Background(), cfg.DrainTimeout)
	defer cancelDrain()
	if graceful {
		if f, ok := o.stage.(Flusher); ok {
			o.stageMu.Lock()
			t0 := time.Now()
			res, err := f.Flush(drainCtx)
			o.observe(nil, &res, err, time.Since(t0))
			o.stageMu.Unlock()
			if err == nil {
				err = o.submit(drainCtx, res, nil)
			}
			if err != nil {
				loopErr = fmt.Errorf("pipeline: flush %s: %w", o.stage.Name(), err)
				graceful = false
			}
		}
	}
	// Close flushes the async writers and waits for every Completion call.
	werr := o.writer.close()
	close(commitDone)
	wg.Wait()
	if graceful && werr == nil {
		select {
		case err := <-o.fatal:
			loopErr = err
		default:
			if err := o.commit(drainCtx); err != nil {
				loopErr = err
			}
		}
	}
	rerr := o.reader.Close()
	if loopErr != nil {
		log.Error("operator stopped", "err", loopErr)
		return loopErr
	}
	if werr != nil {
		return fmt.Errorf("pipeline: close writer: %w", werr)
	}
	if rerr != nil {
		return fmt.Errorf("pipeline: close reader: %w", rerr)
	}
	log.Info("operator stopped", "pending", o.track.pending())
	return ErrStopped
}

// closeStage closes the stage (once) and then its state store.
func closeStage(st Stage, env *Env) error {
	var errs []error
	if c, ok := st.(io.Closer); ok {
		if err := c.Close(); err != nil {
			errs = append(errs, fmt.Errorf("pipeline: close %s: %w", st.Name(), err))
		}
	}
	if env != nil {
		if err := env.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// observe records took, the time of one call of the stage's code (m nil
// for Tick and Flush), and hands the call to the process hooks.
func (o *Operator) observe(m *Message, res *Result, err error, took time.Duration) {
	o.m.busy.Add(took.Seconds())
	for _, h := range o.process {
		h.OnProcess(o.stage.Name(), m, res, err, took)
	}
}

// fetchLoop returns nil when fetchCtx is cancelled, or the first fatal error.
func (o *Operator) fetchLoop(fetchCtx context.Context, log *slog.Logger) error {
	// stopped is what to return once fetchCtx is done: the fatal error that
	// cancelled it, if any.
	stopped := func() error {
		select {
		case err := <-o.fatal:
			return err
		default:
			return nil
		}
	}
	lim := logLimiter{every: 10 * time.Second}
	tr := o.tracer()
	for {
		select {
		case err := <-o.fatal:
			return err
		default:
		}
		km, err := o.reader.FetchMessage(fetchCtx)
		if err != nil {
			if fetchCtx.Err() != nil {
				return stopped()
			}
			if !transient(err) {
				return fmt.Errorf("pipeline: fetch: %w", err)
			}
			// kafka-go's group reader heals by itself: it rejoins the group
			// and re-dials partition leaders, each with its own backoff, and
			// queues every failure among the records (up to its queue
			// capacity), so a failure read here may be long past. A backoff
			// per failure would turn a queue of stale ones into minutes of
			// crawl after the cluster healed: fetch again at once (the
			// reader's own pacing bounds this loop).
			n := o.degraded.Add(1)
			o.m.retries.WithLabelValues("fetch").Inc()
			if ok, held := lim.allow(time.Now()); ok {
				log.Warn("fetch failed; retrying in place", "err", err, "failures", n, "not_logged", held)
			}
			if !sleepCtx(fetchCtx, fetchRetryPause) {
				return stopped()
			}
			continue
		}
		if o.degraded.Swap(0) > 0 {
			log.Info("fetching again")
		}
		m := fromKafka(&km)
		o.track.seen(m.Ref)
		o.m.in.Inc()
		o.m.inBytes.Add(float64(len(m.Value)))
		if m.HighWaterMark > 0 {
			o.m.lag.WithLabelValues(m.Topic, itoa(m.Partition)).Set(float64(m.HighWaterMark - m.Offset - 1))
		}
		o.stageMu.Lock()
		t0 := time.Now()
		sctx, span := o.startSpan(fetchCtx, tr, &m)
		res, err := o.stage.Process(sctx, m)
		endSpan(span, &res, err)
		o.observe(&m, &res, err, time.Since(t0))
		o.stageMu.Unlock()
		res, self, err := o.outcome(&m, res, err, log)
		if err != nil {
			if fetchCtx.Err() != nil {
				return stopped() // the input is redelivered later
			}
			return err
		}
		if err := o.submitFor(fetchCtx, res, self, &m); err != nil {
			if fetchCtx.Err() != nil {
				return stopped()
			}
			return err
		}
	}
}

// outcome turns what Process returned for m into what the runtime
// produces and completes: a refusal becomes the quarantine record (with
// the refusal's extra outputs); an input that is not held completes with
// its outputs. Any other error is fatal.
func (o *Operator) outcome(m *Message, res Result, err error, log *slog.Logger) (Result, []Ref, error) {
	if err != nil {
		ref, ok := AsRefusal(err)
		if !ok {
			return Result{}, nil, fmt.Errorf("pipeline: %s at %s: %w", o.stage.Name(), m.Ref, err)
		}
		if log != nil {
			log.Warn("record quarantined", "source", m.Ref.String(), "reason", ref.Reason, "detail", ref.Detail)
		}
		res = Result{Outputs: append([]Output{QuarantineRecord(o.cfg.QuarantineTopic, o.stage.Name(), *m, ref.Reason, ref.Detail)}, ref.Also...)}
	}
	var self []Ref
	if !res.Hold {
		self = []Ref{m.Ref}
	}
	return res, self, nil
}

func (o *Operator) tickLoop(ctx context.Context, tk Ticker) {
	t := time.NewTicker(o.cfg.TickInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			o.stageMu.Lock()
			t0 := time.Now()
			res, err := tk.Tick(o.withProvider(ctx), now)
			o.observe(nil, &res, err, time.Since(t0))
			o.stageMu.Unlock()
			if err == nil {
				err = o.submit(ctx, res, nil)
			}
			if err != nil && ctx.Err() == nil {
				o.fail(fmt.Errorf("pipeline: tick %s: %w", o.stage.Name(), err))
				return
			}
		}
	}
}

func (o *Operator) submit(ctx context.Context, res Result, self []Ref) error {
	return o.submitFor(ctx, res, self, nil)
}

// oversize checks outs against the topics' size limit: an output too large
// sends src to quarantine instead (the outputs are replaced); without a
// source it is an error.
func (o *Operator) oversize(outs []Output, src *Message) ([]Output, error) {
	limit := int(tfkafka.WriterBatchBytes(o.cfg.MaxMessageBytes)) - 512 // record framing and headers
	for i := range outs {
		if len(outs[i].Value)+len(outs[i].Key) <= limit {
			continue
		}
		if src == nil {
			return nil, fmt.Errorf("pipeline: %s output of %d bytes to %s exceeds max message bytes %d",
				o.stage.Name(), len(outs[i].Value), outs[i].Topic, o.cfg.MaxMessageBytes)
		}
		detail := fmt.Sprintf("output to %s is %d bytes, limit %d", outs[i].Topic, len(outs[i].Value), o.cfg.MaxMessageBytes)
		return []Output{QuarantineRecord(o.cfg.QuarantineTopic, o.stage.Name(), *src, "output_oversize", detail)}, nil
	}
	return outs, nil
}

// submitFor produces res's outputs; the refs in self and res.Release
// complete when all are acknowledged. src, when not nil, is the input the
// outputs derive from: an output too large for the topics sends src to
// quarantine instead.
func (o *Operator) submitFor(ctx context.Context, res Result, self []Ref, src *Message) error {
	refs := append(self, res.Release...)
	outs, err := o.oversize(res.Outputs, src)
	if err != nil {
		return err
	}
	if len(outs) == 0 {
		for _, r := range refs {
			o.track.complete(r)
		}
		return nil
	}
	// Outputs marked After wait for every output before them.
	for {
		cut := slices.IndexFunc(outs[1:], func(out Output) bool { return out.After }) + 1
		if cut == 0 {
			break
		}
		if err := o.write(ctx, outs[:cut], nil, true); err != nil {
			return err
		}
		outs = outs[cut:]
	}
	return o.write(ctx, outs, refs, false)
}

// write produces outs; refs complete when all are acknowledged. With wait,
// write returns only once they are (or the operator failed).
func (o *Operator) write(ctx context.Context, outs []Output, refs []Ref, wait bool) error {
	g := &ackGroup{remaining: len(outs), refs: refs}
	if wait {
		g.done = make(chan struct{})
	}
	msgs := make([]kafka.Message, len(outs))
	for i, out := range outs {
		if out.Topic == o.cfg.QuarantineTopic {
			// Every quarantine record counts, a refused message's and a
			// refused row's alike, by its reason.
			o.m.quarantined.WithLabelValues(headerValue(out.Headers, schemas.HeaderReason)).Inc()
		}
		n := int64(len(out.Value) + len(out.Key))
		g.bytes += n
		if out.Release != nil {
			g.release = append(g.release, out.Release)
		}
		msgs[i] = kafka.Message{Topic: out.Topic, Key: out.Key, Value: out.Value, WriterData: g}
		if out.Pinned {
			msgs[i].WriterData = &pinned{ackGroup: g, partition: out.Partition}
		}
		if len(out.Headers) > 0 {
			msgs[i].Headers = make([]kafka.Header, len(out.Headers))
			for j, h := range out.Headers {
				msgs[i].Headers[j] = kafka.Header{Key: h.Key, Value: h.Value}
			}
		}
	}
	waited, err := o.flow.acquire(ctx, len(outs), g.bytes)
	if waited > 0 {
		o.m.backpressure.Add(waited.Seconds())
	}
	if err != nil {
		return err
	}
	o.m.inFlight.Add(float64(len(outs)))
	if unsent, err := o.writer.write(ctx, msgs); err != nil {
		var n int64
		for _, m := range unsent {
			n += int64(len(m.Value) + len(m.Key))
		}
		o.flow.release(len(unsent), n)
		o.m.inFlight.Sub(float64(len(unsent)))
		return fmt.Errorf("pipeline: produce: %w", err)
	}
	if !wait {
		return nil
	}
	select {
	case <-g.done:
		return nil
	case <-o.failed:
		return fmt.Errorf("pipeline: %s: produce of %d records before a barrier failed", o.stage.Name(), len(outs))
	case <-ctx.Done():
		return ctx.Err()
	}
}

// pinned is the writer data of a record written to a chosen partition
// (Output.Pinned).
type pinned struct {
	*ackGroup
	partition int
}

// ackGroupOf is the acknowledgement group of a record's writer data.
func ackGroupOf(d any) *ackGroup {
	switch d := d.(type) {
	case *ackGroup:
		return d
	case *pinned:
		return d.ackGroup
	}
	return nil
}

// pinnedBalancer places a pinned record (Output.Pinned) on its partition,
// modulo the topic's partitions, and every other record where its key's
// murmur2 hash does, as Kafka's Java client would.
type pinnedBalancer struct{ hash kafka.Murmur2Balancer }

func (b pinnedBalancer) Balance(m kafka.Message, partitions ...int) int {
	if p, ok := m.WriterData.(*pinned); ok && len(partitions) > 0 && p.partition >= 0 {
		return partitions[p.partition%len(partitions)]
	}
	return b.hash.Balance(m, partitions...)
}

// completion is the async writer's callback.
func (o *Operator) completion(msgs []kafka.Message, err error) {
	if err != nil {
		o.fail(fmt.Errorf("pipeline: %s: produce %d records: %w", o.stage.Name(), len(msgs), err))
	}
	var n int
	var nb int64
	for i := range msgs {
		g := ackGroupOf(msgs[i].WriterData)
		size := int64(len(msgs[i].Value) + len(msgs[i].Key))
		n++
		nb += size
		if err == nil {
			o.m.out.WithLabelValues(msgs[i].Topic).Inc()
			o.m.outBytes.Add(float64(size))
		}
		if g == nil || err != nil {
			continue
		}
		g.mu.Lock()
		g.remaining--
		finished := g.remaining == 0
		g.mu.Unlock()
		if finished {
			for _, r := range g.refs {
				o.track.complete(r)
			}
			// The writer is done with every value of the group.
			for _, f := range g.release {
				f()
			}
			if g.done != nil {
				close(g.done)
			}
		}
	}
	o.flow.release(n, nb)
	o.m.inFlight.Sub(float64(n))
}

func (o *Operator) commitLoop(done <-chan struct{}, log *slog.Logger) {
	t := time.NewTicker(o.cfg.CommitInterval)
	defer t.Stop()
	lim := logLimiter{every: 10 * time.Second}
	for {
		select {
		case <-done:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := o.commit(ctx)
			cancel()
			if err != nil {
				// A failed commit is retried on the next tick (a coordinator
				// moving, a rebalance); the records are redelivered after a
				// crash in the meantime.
				o.m.retries.WithLabelValues("commit").Inc()
				if ok, held := lim.allow(time.Now()); ok {
					log.Warn("commit failed; retrying", "err", err, "not_logged", held)
				}
			}
		}
	}
}

func (o *Operator) commit(ctx context.Context) error {
	cs := o.track.committable()
	if len(cs) == 0 {
		return nil
	}
	msgs := make([]kafka.Message, len(cs))
	for i, c := range cs {
		// CommitMessages commits Offset+1.
		msgs[i] = kafka.Message{Topic: c.Topic, Partition: c.Partition, Offset: c.Offset - 1}
	}
	start := time.Now()
	if err := o.reader.CommitMessages(ctx, msgs...); err != nil {
		return fmt.Errorf("pipeline: commit: %w", err)
	}
	o.m.commitLatency.Observe(time.Since(start).Seconds())
	o.m.commits.Inc()
	o.track.markCommitted(cs)
	return nil
}
