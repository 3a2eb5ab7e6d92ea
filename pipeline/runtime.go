package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	tfkafka "github.com/trajflow/trajflow/connectors/kafka"
)

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
	CommitInterval  time.Duration
	BatchTimeout    time.Duration
	TickInterval    time.Duration
	// DrainTimeout bounds a graceful shutdown.
	DrainTimeout time.Duration
	// StateDir is where the stage may keep local state (Badger).
	StateDir string
	Logger   *slog.Logger
	Metrics  *Metrics
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
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
	}
}

// dialer is the configured Dialer, or a plaintext one.
func (c *Config) dialer() *kafka.Dialer {
	if c.Dialer != nil {
		return c.Dialer
	}
	return &kafka.Dialer{Timeout: 10 * time.Second}
}

// Env is what a Starter may use to rebuild its state.
type Env struct {
	Config *Config
	Logger *slog.Logger
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
	release   []func() // the outputs' Release, called when all are acknowledged
}

// Operator runs one stage.
type Operator struct {
	cfg    Config
	stage  Stage
	reader *kafka.Reader
	writer *kafka.Writer
	track  *tracker
	flow   *flowControl
	m      *stageMetrics

	stageMu sync.Mutex // Process, Tick and Flush never run concurrently

	errOnce sync.Once
	fatal   chan error
	ready   chan struct{}
	readyOK sync.Once
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
	return o, nil
}

// Ready is closed once the operator has joined its group and rebuilt its
// state.
func (o *Operator) Ready() <-chan struct{} { return o.ready }

func (o *Operator) fail(err error) {
	o.errOnce.Do(func() { o.fatal <- err })
}

// Run consumes until ctx is cancelled (graceful: in-flight outputs are
// drained and offsets committed, then ErrStopped is returned) or a fatal
// error occurs (nothing more is committed; redelivery after restart
// recovers).
func (o *Operator) Run(ctx context.Context) error {
	cfg := &o.cfg
	log := cfg.Logger.With("stage", o.stage.Name(), "instance", cfg.Instance)
	if s, ok := o.stage.(Starter); ok {
		if err := s.Start(ctx, &Env{Config: cfg, Logger: log}); err != nil {
			return fmt.Errorf("pipeline: start %s: %w", o.stage.Name(), err)
		}
	}
	if err := o.waitTopics(ctx, log); err != nil {
		return err
	}
	o.reader = kafka.NewReader(kafka.ReaderConfig{
		Brokers:           cfg.Brokers,
		GroupID:           cfg.GroupID,
		GroupTopics:       o.stage.Topics(),
		Dialer:            cfg.Dialer,
		MinBytes:          1,
		MaxBytes:          cfg.MaxMessageBytes + (1 << 20),
		MaxWait:           tfkafka.FetchMaxWait,
		StartOffset:       kafka.FirstOffset,
		CommitInterval:    0, // commits are explicit and synchronous
		HeartbeatInterval: time.Second,
		SessionTimeout:    10 * time.Second,
		RebalanceTimeout:  10 * time.Second,
		JoinGroupBackoff:  500 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    200 * time.Millisecond,
		MaxAttempts:       3,
	})
	o.writer = &kafka.Writer{
		Addr:         kafka.TCP(cfg.Brokers...),
		Balancer:     &kafka.Murmur2Balancer{},
		RequiredAcks: kafka.RequireAll,
		Async:        true,
		BatchSize:    256,
		BatchBytes:   tfkafka.WriterBatchBytes(cfg.MaxMessageBytes),
		BatchTimeout: cfg.BatchTimeout,
		MaxAttempts:  10,
		Transport:    cfg.Transport,
		Completion:   o.completion,
	}
	if cfg.Transport == nil {
		o.writer.Transport = &kafka.Transport{}
	}

	fetchCtx, stopFetch := context.WithCancel(context.Background())
	defer stopFetch()
	var wg sync.WaitGroup
	commitDone := make(chan struct{})
	wg.Add(1)
	go func() { defer wg.Done(); o.commitLoop(commitDone) }()
	if tk, ok := o.stage.(Ticker); ok {
		wg.Add(1)
		go func() { defer wg.Done(); o.tickLoop(fetchCtx, tk) }()
	}
	// Cancelling ctx stops fetching; the loop below then drains.
	go func() {
		select {
		case <-ctx.Done():
		case <-fetchCtx.Done():
		}
		stopFetch()
	}()

	o.readyOK.Do(func() { close(o.ready) })
	loopErr := o.fetchLoop(fetchCtx, log)
	stopFetch()
	graceful := loopErr == nil
	if graceful {
		if f, ok := o.stage.(Flusher); ok {
			o.stageMu.Lock()
			res, err := f.Flush(context.Background())
			o.stageMu.Unlock()
			if err == nil {
				err = o.submit(context.Background(), res, nil)
			}
			if err != nil {
				loopErr = fmt.Errorf("pipeline: flush %s: %w", o.stage.Name(), err)
				graceful = false
			}
		}
	}
	// Close flushes the async writer and waits for every Completion call.
	werr := o.writer.Close()
	close(commitDone)
	wg.Wait()
	if graceful && werr == nil {
		select {
		case err := <-o.fatal:
			loopErr = err
		default:
			cctx, cancel := context.WithTimeout(context.Background(), cfg.DrainTimeout)
			if err := o.commit(cctx); err != nil {
				loopErr = err
			}
			cancel()
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

// fetchLoop returns nil when fetchCtx is cancelled, or the first fatal error.
func (o *Operator) fetchLoop(fetchCtx context.Context, log *slog.Logger) error {
	for {
		select {
		case err := <-o.fatal:
			return err
		default:
		}
		km, err := o.reader.FetchMessage(fetchCtx)
		if err != nil {
			if fetchCtx.Err() != nil {
				return nil
			}
			return fmt.Errorf("pipeline: fetch: %w", err)
		}
		m := Message{
			Ref:           Ref{km.Topic, km.Partition, km.Offset},
			Key:           km.Key,
			Value:         km.Value,
			HighWaterMark: km.HighWaterMark,
			Time:          km.Time,
		}
		if len(km.Headers) > 0 {
			m.Headers = make([]Header, len(km.Headers))
			for i, h := range km.Headers {
				m.Headers[i] = Header{h.Key, h.Value}
			}
		}
		o.track.seen(m.Ref)
		o.m.in.Inc()
		o.m.inBytes.Add(float64(len(m.Value)))
		if m.HighWaterMark > 0 {
			o.m.lag.WithLabelValues(m.Topic, itoa(m.Partition)).Set(float64(m.HighWaterMark - m.Offset - 1))
		}
		o.stageMu.Lock()
		res, err := o.stage.Process(fetchCtx, m)
		o.stageMu.Unlock()
		if err != nil {
			ref, ok := AsRefusal(err)
			if !ok {
				return fmt.Errorf("pipeline: %s at %s: %w", o.stage.Name(), m.Ref, err)
			}
			o.m.quarantined.WithLabelValues(ref.Reason).Inc()
			log.Warn("record quarantined", "source", m.Ref.String(), "reason", ref.Reason, "detail", ref.Detail)
			res = Result{Outputs: append([]Output{QuarantineRecord(o.cfg.QuarantineTopic, o.stage.Name(), m, ref.Reason, ref.Detail)}, ref.Also...)}
		}
		var self []Ref
		if !res.Hold {
			self = []Ref{m.Ref}
		}
		if err := o.submitFor(fetchCtx, res, self, &m); err != nil {
			if fetchCtx.Err() != nil {
				return nil
			}
			return err
		}
	}
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
			res, err := tk.Tick(ctx, now)
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

// submitFor produces res's outputs; the refs in self and res.Release
// complete when all are acknowledged. src, when not nil, is the input the
// outputs derive from: an output too large for the topics sends src to
// quarantine instead.
func (o *Operator) submitFor(ctx context.Context, res Result, self []Ref, src *Message) error {
	refs := append(self, res.Release...)
	outs := res.Outputs
	limit := int(tfkafka.WriterBatchBytes(o.cfg.MaxMessageBytes)) - 512 // record framing and headers
	for i := range outs {
		if len(outs[i].Value)+len(outs[i].Key) > limit {
			if src == nil {
				return fmt.Errorf("pipeline: %s output of %d bytes to %s exceeds max message bytes %d",
					o.stage.Name(), len(outs[i].Value), outs[i].Topic, o.cfg.MaxMessageBytes)
			}
			detail := fmt.Sprintf("output to %s is %d bytes, limit %d", outs[i].Topic, len(outs[i].Value), o.cfg.MaxMessageBytes)
			o.m.quarantined.WithLabelValues("output_oversize").Inc()
			outs = []Output{QuarantineRecord(o.cfg.QuarantineTopic, o.stage.Name(), *src, "output_oversize", detail)}
			break
		}
	}
	if len(outs) == 0 {
		for _, r := range refs {
			o.track.complete(r)
		}
		return nil
	}
	g := &ackGroup{remaining: len(outs), refs: refs}
	msgs := make([]kafka.Message, len(outs))
	for i, out := range outs {
		n := int64(len(out.Value) + len(out.Key))
		g.bytes += n
		if out.Release != nil {
			g.release = append(g.release, out.Release)
		}
		msgs[i] = kafka.Message{Topic: out.Topic, Key: out.Key, Value: out.Value, WriterData: g}
		if len(out.Headers) > 0 {
			msgs[i].Headers = make([]kafka.Header, len(out.Headers))
			for j, h := range out.Headers {
				msgs[i].Headers[j] = kafka.Header{Key: h.Key, Value: h.Value}
			}
		}
	}
	if err := o.flow.acquire(ctx, len(outs), g.bytes); err != nil {
		return err
	}
	o.m.inFlight.Add(float64(len(outs)))
	if err := o.writer.WriteMessages(ctx, msgs...); err != nil {
		o.flow.release(len(outs), g.bytes)
		o.m.inFlight.Sub(float64(len(outs)))
		return fmt.Errorf("pipeline: produce: %w", err)
	}
	return nil
}

// completion is the async writer's callback.
func (o *Operator) completion(msgs []kafka.Message, err error) {
	if err != nil {
		o.fail(fmt.Errorf("pipeline: %s: produce %d records: %w", o.stage.Name(), len(msgs), err))
	}
	var n int
	var nb int64
	for i := range msgs {
		g, _ := msgs[i].WriterData.(*ackGroup)
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
		}
	}
	o.flow.release(n, nb)
	o.m.inFlight.Sub(float64(n))
}

func (o *Operator) commitLoop(done <-chan struct{}) {
	t := time.NewTicker(o.cfg.CommitInterval)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := o.commit(ctx)
			cancel()
			if err != nil {
				// A failed commit is retried on the next tick; the records
				// are redelivered after a crash in the meantime.
				o.cfg.Logger.Warn("commit failed", "stage", o.stage.Name(), "err", err)
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
	o.track.markCommitted(cs)
	return nil
}

// waitTopics returns once every input topic exists. A consumer group
// member that joins while its topic is missing keeps the empty assignment
// after the topic is created (kafka-go computes it once per generation),
// so an operator started before `trajflow topics create` would never
// consume; it waits here instead, polling the metadata without creating
// anything. A broker that cannot be reached is an error (the operator is
// restarted).
func (o *Operator) waitTopics(ctx context.Context, log *slog.Logger) error {
	dialer := o.cfg.dialer()
	logged := false
	for {
		missing, err := missingTopics(ctx, dialer, o.cfg.Brokers[0], o.stage.Topics())
		if err != nil {
			return fmt.Errorf("pipeline: %s: input topics: %w", o.stage.Name(), err)
		}
		if len(missing) == 0 {
			return nil
		}
		if !logged {
			log.Warn("waiting for input topics to be created", "missing", missing)
			logged = true
		}
		select {
		case <-ctx.Done():
			return ErrStopped
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// missingTopics lists the topics the broker at addr does not have.
func missingTopics(ctx context.Context, dialer *kafka.Dialer, addr string, topics []string) ([]string, error) {
	conn, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	defer conn.Close()
	var missing []string
	for _, t := range topics {
		parts, err := conn.ReadPartitions(t)
		switch {
		case errors.Is(err, kafka.UnknownTopicOrPartition), err == nil && len(parts) == 0:
			missing = append(missing, t)
		case err != nil:
			return nil, fmt.Errorf("partitions of %s: %w", t, err)
		}
	}
	return missing, nil
}
