// Package pipeline is the operator runtime: it consumes input topics as a
// member of a Kafka consumer group, drives a stage's pure function,
// produces the outputs with acks=all, and commits an input offset only after
// every output derived from it is acknowledged (at-least-once delivery,
// docs/SYSTEMS.md §14).
//
// A stage never touches Kafka, the disk or the network itself: the runtime
// owns commits, retries, backpressure, quarantine and shutdown, and gives
// the stage everything else through its Env (topic tails, the local state
// store, the release files, side inputs, a clock, a logger). The lifecycle
// of a stage is
//
//	Start(ctx, env)              once, before anything else (Starter)
//	Side(ctx, m)                 side-topic records, from their own goroutine (SideInputs)
//	Process(ctx, m) / Tick / ...  one at a time, in fetch order
//	Flush(ctx)                   on a graceful stop (Flusher)
//	Close()                      once, after everything else (io.Closer)
//
// and the same lifecycle drives a stage offline over captured messages
// (Drive), so `trajflow stage NAME` and `trajflow run NAME` decide alike.
package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/trajflow/trajflow/schemas"
)

// Ref identifies one input message.
type Ref struct {
	Topic     string
	Partition int
	Offset    int64
}

func (r Ref) String() string {
	return r.Topic + "/" + strconv.Itoa(r.Partition) + "@" + strconv.FormatInt(r.Offset, 10)
}

// Header is a Kafka record header.
type Header struct {
	Key   string
	Value []byte
}

// Message is one input record handed to a stage. Value is owned by the
// stage for the duration of Process and may be retained.
type Message struct {
	Ref
	Key           []byte
	Value         []byte
	Headers       []Header
	HighWaterMark int64
	Time          time.Time
}

// Header returns the value of the first header named key, or nil.
func (m *Message) Header(key string) []byte {
	for _, h := range m.Headers {
		if h.Key == key {
			return h.Value
		}
	}
	return nil
}

// Output is one record a stage wants produced.
type Output struct {
	Topic   string
	Key     []byte
	Value   []byte
	Headers []Header
	// Pinned writes the record to partition Partition modulo the topic's
	// partition count instead of the one its key hashes to: dispatch deals
	// groups out to the tasks topic's partitions in turn (Partition the
	// group's index), one rollout worker each. Partition must be >= 0.
	Pinned    bool
	Partition int
	// Release, when set, is called once the broker has acknowledged the
	// record: nothing references Value any more (it lets a stage recycle
	// the buffer, e.g. schemas.Codec.EncodePooled). It is not called for
	// a record whose write failed or that was never written.
	Release func()
	// After makes the runtime write this output only once every output
	// before it in the Result is acknowledged: a crash can leave the
	// earlier outputs without this one, never this one without them (pack
	// writes a window's lineage record before its batch, so a restarted
	// pack never finds a batch whose window it cannot account for). Each
	// such barrier costs the stage one produce round trip.
	After bool
}

// Result is what a stage returns for one input (or one tick).
//
// The input message is complete once every output of the Result is
// acknowledged, unless Hold is set: then the stage keeps the message in its
// state and the runtime will not commit its offset (nor any later offset of
// its partition) until a later Result lists it in Release. This is how a
// stateful stage (group assembly, pack window) stays rebuildable: after a
// crash, everything it still needed is redelivered.
type Result struct {
	Outputs []Output
	Hold    bool
	Release []Ref
}

// Stage is the pure part of an operator. Process is called from one
// goroutine at a time, in fetch order (which is offset order within a
// partition). It must be deterministic in its input so that redelivery
// reproduces identical outputs.
//
// Process returns a *Refusal to send the input to quarantine; the operator
// goes on with the next record. Any other error stops the operator without
// committing the input (it will be redelivered after a restart).
type Stage interface {
	Name() string
	Topics() []string
	Process(ctx context.Context, m Message) (Result, error)
}

// Starter is implemented by stages that rebuild state before the first
// Process call (for example a deduplication set read back from the stage's
// output topic). The Env stays valid until Close returns.
type Starter interface {
	Start(ctx context.Context, env *Env) error
}

// SideInputs is implemented by stages that follow topics besides their
// inputs (the policy topic, for rollout workers that switch versions). The
// runtime tails every side topic from its first offset, without a consumer
// group and without committing, and calls Side with each record in offset
// order per partition. Side runs on the runtime's side-input goroutine,
// concurrently with Process, Tick and Flush: the stage synchronizes the
// state they share. A record Side cannot use is the stage's to log and
// skip; an error it returns stops the operator.
type SideInputs interface {
	SideTopics() []string
	Side(ctx context.Context, m Message) error
}

// Ticker is implemented by stages that act on time as well as on input
// (partial-group timeouts, window deadlines). Tick is never concurrent with
// Process.
type Ticker interface {
	Tick(ctx context.Context, now time.Time) (Result, error)
}

// Flusher is implemented by stages that hold state which should be emitted
// on a graceful shutdown rather than rebuilt on the next start. Flush's ctx
// ends with the operator's drain timeout.
type Flusher interface {
	Flush(ctx context.Context) (Result, error)
}

// A stage that implements io.Closer is closed by the runtime once, after
// its last call (graceful stop or not); then the runtime closes the stage's
// state store. Close must be idempotent.

// Refusal is a per-record rejection: the input goes to the quarantine topic
// with Reason (a short machine-readable code) and Detail.
type Refusal struct {
	Reason string
	Detail string
	// Extra outputs to produce along with the quarantine record (for
	// example a census event, or a notice that a group member failed).
	Also []Output
}

func (r *Refusal) Error() string {
	if r.Detail == "" {
		return "refused: " + r.Reason
	}
	return "refused: " + r.Reason + ": " + r.Detail
}

// Refuse builds a *Refusal.
func Refuse(reason, format string, args ...any) *Refusal {
	return &Refusal{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// AsRefusal reports whether err is a *Refusal.
func AsRefusal(err error) (*Refusal, bool) {
	var r *Refusal
	ok := errors.As(err, &r)
	return r, ok
}

// QuarantineRecord builds the quarantine output for m: the original key and
// bytes, the original headers, and the reason and source coordinates.
func QuarantineRecord(topic, stage string, m Message, reason, detail string) Output {
	hs := make([]Header, 0, len(m.Headers)+6)
	hs = append(hs, m.Headers...)
	hs = append(hs,
		Header{schemas.HeaderReason, []byte(reason)},
		Header{schemas.HeaderDetail, []byte(detail)},
		Header{schemas.HeaderStage, []byte(stage)},
		Header{schemas.HeaderSourceTopic, []byte(m.Topic)},
		Header{schemas.HeaderSourcePartition, []byte(strconv.Itoa(m.Partition))},
		Header{schemas.HeaderSourceOffset, []byte(strconv.FormatInt(m.Offset, 10))},
	)
	return Output{Topic: topic, Key: m.Key, Value: m.Value, Headers: hs}
}
