package kafka

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// DefaultMaxMessageBytes is the record-batch size limit trajflow uses for the
// embedded broker and for topics it creates: one Kafka message carries one
// Arrow IPC stream, and long multi-turn trajectories are large (DESIGN "Wire
// format and topics": topics get an explicit max.message.bytes large enough
// for long trajectories).
const DefaultMaxMessageBytes = 64 << 20

// DefaultRetentionCheckInterval is how often the embedded broker enforces
// its retention policy when RetentionPolicy.CheckInterval is zero.
const DefaultRetentionCheckInterval = 30 * time.Second

// MinGroupSessionTimeout is the smallest consumer-group session timeout the
// embedded broker accepts (kfake's default, equal to Kafka's default
// group.min.session.timeout.ms). A kafka.ReaderConfig.SessionTimeout below
// it makes every JoinGroup fail with INVALID_SESSION_TIMEOUT, which kafka-go
// only logs through ReaderConfig.ErrorLogger while FetchMessage blocks until
// its context ends. The largest accepted is 5 minutes.
const MinGroupSessionTimeout = 6 * time.Second

// ErrBrokerClosed is returned by Broker methods called after Close.
var ErrBrokerClosed = errors.New("kafka: embedded broker closed")

// ErrDataDirInUse is wrapped by StartBroker's error when another broker
// (in this or another process) holds the DataDir.
var ErrDataDirInUse = errors.New("kafka: embedded broker data dir in use")

// dataDirLockName is the lock file StartBroker holds inside a DataDir.
const dataDirLockName = "trajflow-broker.lock"

// RetentionPolicy bounds what the embedded broker keeps per partition.
// Kafka semantics apply: a partition's oldest record batches are deleted
// (its log start offset advances) once they are older than Age, or while
// the partition holds more than Bytes. Deletion is by whole record batch;
// storage (memory for an in-memory broker, files with a DataDir) is freed by
// whole segment, so a partition holds at most about Bytes+SegmentBytes.
//
// The values become the broker-wide defaults log.retention.ms and
// log.retention.bytes; a topic's own retention.ms / retention.bytes (see
// TopicSpec.RetentionMs) overrides them. kfake does apply these configs, but
// its own cleaner only runs for topics with explicit retention configs (or
// compaction) and by default once an hour, so Broker runs the retention pass
// itself every CheckInterval over every topic.
type RetentionPolicy struct {
	// Bytes is the per-partition size bound; 0 means unbounded.
	Bytes int64
	// Age is the time bound, measured on record batch max timestamps
	// (producer CreateTime); 0 means Kafka's default of 7 days, negative
	// means unbounded.
	Age time.Duration
	// CheckInterval is how often retention (and compaction of compacted
	// topics) runs; 0 means DefaultRetentionCheckInterval.
	CheckInterval time.Duration
	// SegmentBytes is the log segment size, the unit in which storage is
	// freed. 0 means a quarter of Bytes clamped to [4 KiB, 100 MiB] when
	// Bytes is set, else kfake's default of 100 MiB.
	SegmentBytes int64
}

func (r RetentionPolicy) interval() time.Duration {
	if r.CheckInterval > 0 {
		return r.CheckInterval
	}
	return DefaultRetentionCheckInterval
}

func (r RetentionPolicy) retentionMs() int64 {
	switch {
	case r.Age < 0:
		return -1
	case r.Age == 0:
		return int64(7 * 24 * time.Hour / time.Millisecond)
	}
	return max(1, r.Age.Milliseconds())
}

func (r RetentionPolicy) retentionBytes() int64 {
	if r.Bytes <= 0 {
		return -1
	}
	return r.Bytes
}

func (r RetentionPolicy) segmentBytes() int64 {
	if r.SegmentBytes > 0 {
		return r.SegmentBytes
	}
	if r.Bytes > 0 {
		return min(max(r.Bytes/4, 4<<10), 100<<20)
	}
	return 100 << 20
}

// BrokerUser is a SASL user of the embedded broker.
type BrokerUser struct {
	Mechanism SASLMechanism
	Username  string
	Password  Secret
}

// BrokerConfig configures StartBroker. The zero value is an in-memory broker
// on a random port of 127.0.0.1 with DefaultMaxMessageBytes, no TLS and no
// SASL.
type BrokerConfig struct {
	// Addr is the listen address host:port. Empty means "127.0.0.1:0";
	// port 0 picks a free port. The host must be a concrete IP address
	// (it is what the broker advertises in metadata), not 0.0.0.0 or ::.
	Addr string
	// DataDir persists all state (topics, record batches, committed
	// offsets, group state) across restarts via kfake.DataDir. Empty
	// keeps everything in memory (lost on Close). Only one broker may
	// use a directory at a time: StartBroker holds an advisory lock
	// (flock on unix) on a file in it and fails with ErrDataDirInUse.
	DataDir string
	// SyncWrites fsyncs every record batch (kfake.SyncWrites); without
	// it data is synced on segment roll and on Close, like Kafka's
	// default, and a crash can lose the newest batches.
	SyncWrites bool
	// Retention bounds per-partition storage; see RetentionPolicy.
	Retention RetentionPolicy
	// MaxMessageBytes is the broker's message.max.bytes, the largest
	// record batch a produce may carry for topics without their own
	// max.message.bytes. 0 means DefaultMaxMessageBytes.
	MaxMessageBytes int
	// TLS, when set, makes the listener TLS-only (and TCP only).
	TLS *tls.Config
	// TCPOnly listens on TCP alone. By default a broker on a loopback
	// address also listens on its local socket (LocalSocketName), where
	// Dial and ProbingDial connect the clients of this host.
	TCPOnly bool
	// Users, when non-empty, enables SASL: every connection must
	// authenticate as one of them (all are superusers).
	Users []BrokerUser
	// Logger receives the broker's log lines (kfake levels map to slog
	// levels); nil discards them.
	Logger *slog.Logger
}

// Broker is an in-process single-node Kafka-protocol broker
// (github.com/twmb/franz-go/pkg/kfake) that kafka-go, franz-go and
// librdkafka clients talk to over TCP, and this module's clients on the
// same host over its local socket (see TCPOnly). Topics are not
// auto-created. A consumer-group member that sends nothing for its
// session timeout is removed from its group, as Kafka does, also when it
// died in the middle of a rebalance (see groupliveness.go).
type Broker struct {
	cluster   *kfake.Cluster
	addr      string
	tcpOnly   bool
	retention RetentionPolicy
	log       *slog.Logger
	unlock    func()

	stop      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once
	mu        sync.Mutex // serialises retention passes with Close
	closed    bool
}

// StartBroker starts a broker. ctx bounds start-up only (loading a DataDir
// can take a while); the broker runs until Close. The broker is listening
// when StartBroker returns.
func StartBroker(ctx context.Context, cfg BrokerConfig) (*Broker, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("starting embedded broker: %w", err)
	}
	addr := cfg.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("embedded broker address %q: %w", addr, err)
	}
	ip := net.ParseIP(host)
	if ip == nil || ip.IsUnspecified() {
		return nil, fmt.Errorf("embedded broker address %q: host must be a concrete IP address (it is advertised to clients)", addr)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return nil, fmt.Errorf("embedded broker address %q: bad port", addr)
	}
	maxMsg := cfg.MaxMessageBytes
	if maxMsg == 0 {
		maxMsg = DefaultMaxMessageBytes
	}
	if maxMsg < 0 {
		return nil, fmt.Errorf("embedded broker: negative MaxMessageBytes %d", maxMsg)
	}
	if cfg.Retention.Bytes < 0 || cfg.Retention.CheckInterval < 0 || cfg.Retention.SegmentBytes < 0 {
		return nil, fmt.Errorf("embedded broker: negative retention setting %+v", cfg.Retention)
	}

	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ret := cfg.Retention
	opts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.Ports(port),
		kfake.DefaultNumPartitions(1),
		kfake.WithLogger(slogAdapter{log}),
		kfake.BrokerConfigs(map[string]string{
			"message.max.bytes":   strconv.Itoa(maxMsg),
			"log.retention.ms":    strconv.FormatInt(ret.retentionMs(), 10),
			"log.retention.bytes": strconv.FormatInt(ret.retentionBytes(), 10),
			"log.segment.bytes":   strconv.FormatInt(ret.segmentBytes(), 10),
			// kfake's own cleaner (compaction, and retention for topics
			// with explicit retention configs) runs at this interval.
			"log.cleaner.backoff.ms": strconv.FormatInt(max(1, ret.interval().Milliseconds()), 10),
			// A single node: topics created with replication factor -1
			// get 1, like default.replication.factor on a one-node cluster.
			"default.replication.factor": "1",
		}),
	}
	// A TLS client dials TCP (ConnectDial): TLS is for traffic that
	// leaves the host.
	tcpOnly := cfg.TCPOnly || cfg.TLS != nil
	listen := listenLocal
	if tcpOnly {
		listen = net.Listen
	}
	opts = append(opts, kfake.ListenFn(func(network, a string) (net.Listener, error) {
		_, p, err := net.SplitHostPort(a)
		if err != nil {
			return nil, err
		}
		return listen(network, net.JoinHostPort(host, p))
	}))
	if cfg.DataDir != "" {
		opts = append(opts, kfake.DataDir(cfg.DataDir))
		if cfg.SyncWrites {
			opts = append(opts, kfake.SyncWrites())
		}
	}
	if cfg.TLS != nil {
		opts = append(opts, kfake.TLS(cfg.TLS))
	}
	if len(cfg.Users) > 0 {
		opts = append(opts, kfake.EnableSASL())
		for _, u := range cfg.Users {
			m, err := ParseSASLMechanism(string(u.Mechanism))
			if err != nil || m == SASLNone || u.Username == "" {
				return nil, fmt.Errorf("embedded broker user %q: need a username and a mechanism of plain, scram-sha-256, scram-sha-512: %w", u.Username, ErrInvalidConfig)
			}
			opts = append(opts, kfake.Superuser(m.wireName(), u.Username, u.Password.Reveal()))
		}
	}

	unlock := func() {}
	if cfg.DataDir != "" {
		if unlock, err = lockDataDir(cfg.DataDir); err != nil {
			return nil, fmt.Errorf("embedded broker data dir %q: %w", cfg.DataDir, err)
		}
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		unlock()
		return nil, fmt.Errorf("starting embedded broker on %s (data dir %q): %w", addr, cfg.DataDir, err)
	}
	addrs := c.ListenAddrs()
	if len(addrs) != 1 {
		c.Close()
		unlock()
		return nil, fmt.Errorf("embedded broker: expected one listener, got %v", addrs)
	}
	b := &Broker{
		cluster:   c,
		addr:      addrs[0],
		tcpOnly:   tcpOnly,
		retention: ret,
		log:       log,
		unlock:    unlock,
		stop:      make(chan struct{}),
	}
	b.wg.Add(2)
	go b.retentionLoop()
	watch := newGroupWatch(c, b.addr, cfg, log)
	go func() { // owned by the broker: Close stops it and waits
		defer b.wg.Done()
		watch.run(b.stop)
	}()
	log.Info("embedded kafka broker started", "addr", b.addr, "local_socket", b.LocalSocket(), "data_dir", cfg.DataDir,
		"max_message_bytes", maxMsg, "retention_bytes", ret.retentionBytes(),
		"retention_ms", ret.retentionMs(), "segment_bytes", ret.segmentBytes())
	return b, nil
}

// Addr is the broker's host:port, for ClientConfig.Brokers.
func (b *Broker) Addr() string { return b.addr }

// LocalSocket is the name of the local socket the broker listens on
// beside Addr, or "" when it listens on TCP alone (TCPOnly, TLS, not a
// loopback address, not Linux).
func (b *Broker) LocalSocket() string {
	if b.tcpOnly {
		return ""
	}
	name, _ := LocalSocketName(b.addr)
	return name
}

// ApplyRetention runs one retention pass over every partition now (the
// background pass runs every RetentionPolicy.CheckInterval). It returns
// ErrBrokerClosed after Close.
func (b *Broker) ApplyRetention() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return ErrBrokerClosed
	}
	b.cluster.ApplyRetention()
	return nil
}

func (b *Broker) retentionLoop() {
	defer b.wg.Done()
	t := time.NewTicker(b.retention.interval())
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
			if err := b.ApplyRetention(); err != nil {
				return
			}
		}
	}
}

// Close stops the broker: the listener closes, open client connections are
// dropped, and with a DataDir all state is flushed so a broker started on
// the same directory resumes it. Close is idempotent and safe to call
// concurrently; later calls return nil.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		close(b.stop)
		b.wg.Wait()
		b.mu.Lock()
		b.closed = true
		b.mu.Unlock()
		// kfake.Cluster.Close has no error; persistence failures are
		// logged at error level through the configured logger.
		b.cluster.Close()
		b.unlock()
		b.log.Info("embedded kafka broker stopped", "addr", b.addr)
	})
	return nil
}

// slogAdapter forwards kfake log lines to slog.
type slogAdapter struct{ l *slog.Logger }

func (a slogAdapter) Logf(level kfake.LogLevel, msg string, args ...any) {
	var sl slog.Level
	switch level {
	case kfake.LogLevelNone:
		return
	case kfake.LogLevelError:
		sl = slog.LevelError
	case kfake.LogLevelWarn:
		sl = slog.LevelWarn
	case kfake.LogLevelInfo:
		sl = slog.LevelInfo
	default:
		sl = slog.LevelDebug
	}
	ctx := context.Background()
	if !a.l.Enabled(ctx, sl) {
		return
	}
	a.l.Log(ctx, sl, fmt.Sprintf(msg, args...), "component", "kfake")
}
