package dashboard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline"
)

// errNoTopics says the cluster has none of the run's topics.
var errNoTopics = errors.New("dashboard: no topics")

// live follows a run's topics on a cluster: every poll reads what each
// partition gained since the previous one (from the first offset at the
// first poll), without a consumer group, committing nothing. A poll that
// fails keeps what it read; the next one resumes at the next unread
// offset of every partition.
type live struct {
	brokers  []string
	cc       kafka.ClientConfig
	topics   pipeline.Topics
	run      string
	maxBytes int
	next     map[string]map[int]int64 // topic -> partition -> next offset
	recs     *Records
}

func newLive(brokers []string, cc kafka.ClientConfig, run string, maxBytes int) (*live, error) {
	topics, err := pipeline.TopicsFor(run)
	if err != nil {
		return nil, fmt.Errorf("dashboard: %w", err)
	}
	return &live{brokers: brokers, cc: cc, topics: topics, run: run, maxBytes: maxBytes,
		next: map[string]map[int]int64{}, recs: NewRecords()}, nil
}

// client is a kafka-go client bootstrapped from the first broker that
// answers.
func (l *live) client(ctx context.Context) (*kafkago.Client, *kafkago.Dialer, error) {
	d, err := l.cc.Dialer()
	if err != nil {
		return nil, nil, err
	}
	conn, addr, err := kafka.DialFirst(ctx, d, l.brokers)
	if err != nil {
		return nil, nil, fmt.Errorf("dashboard: brokers %s: %w", strings.Join(l.brokers, ","), err)
	}
	conn.Close()
	tr, err := l.cc.Transport()
	if err != nil {
		return nil, nil, err
	}
	return &kafkago.Client{Addr: kafkago.TCP(addr), Transport: tr, Timeout: 10 * time.Second}, d, nil
}

// partitions returns the first and end offsets of every partition of the
// run's topics that exist.
func (l *live) partitions(ctx context.Context, c *kafkago.Client) (map[string]map[int][2]int64, error) {
	md, err := c.Metadata(ctx, &kafkago.MetadataRequest{Topics: l.topics.All()})
	if err != nil {
		return nil, fmt.Errorf("dashboard: metadata of run %s: %w", l.run, err)
	}
	req := map[string][]kafkago.OffsetRequest{}
	for _, t := range md.Topics {
		if t.Error != nil {
			continue // not created (yet)
		}
		for _, p := range t.Partitions {
			req[t.Name] = append(req[t.Name], kafkago.FirstOffsetOf(p.ID), kafkago.LastOffsetOf(p.ID))
		}
	}
	if len(req) == 0 {
		return nil, fmt.Errorf("%w: run %s has no topics on %s (yet: `trajflow topics create` makes them)", errNoTopics, l.run, strings.Join(l.brokers, ","))
	}
	lo, err := c.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: req})
	if err != nil {
		return nil, fmt.Errorf("dashboard: offsets of run %s: %w", l.run, err)
	}
	out := map[string]map[int][2]int64{}
	for topic, ps := range lo.Topics {
		out[topic] = map[int][2]int64{}
		for _, p := range ps {
			if p.Error != nil {
				return nil, fmt.Errorf("dashboard: offsets of %s/%d: %w", topic, p.Partition, p.Error)
			}
			out[topic][p.Partition] = [2]int64{p.FirstOffset, p.LastOffset}
		}
	}
	return out, nil
}

// pendingMsg is a message read by a poll, not yet added to the records.
type pendingMsg struct {
	short string
	msg   parquet.Message
}

// poll reads every new record of the run's topics and returns them, in
// offset order per partition; on error it returns what it read before.
func (l *live) poll(ctx context.Context) ([]pendingMsg, error) {
	c, d, err := l.client(ctx)
	if err != nil {
		return nil, err
	}
	defer closeIdle(c)
	parts, err := l.partitions(ctx, c)
	if err != nil {
		return nil, err
	}
	var out []pendingMsg
	for _, topic := range l.topics.All() {
		ids := make([]int, 0, len(parts[topic]))
		for p := range parts[topic] {
			ids = append(ids, p)
		}
		slices.Sort(ids)
		for _, p := range ids {
			if err := l.readPartition(ctx, d, topic, p, parts[topic][p], &out); err != nil {
				return out, err
			}
		}
	}
	return out, nil
}

// readPartition reads [next, end) of one partition.
func (l *live) readPartition(ctx context.Context, d *kafkago.Dialer, topic string, p int, span [2]int64, out *[]pendingMsg) error {
	if l.next[topic] == nil {
		l.next[topic] = map[int]int64{}
	}
	next := max(l.next[topic][p], span[0])
	end := span[1]
	if next >= end {
		return nil
	}
	r := kafkago.NewReader(kafkago.ReaderConfig{
		Brokers: l.brokers, Topic: topic, Partition: p, Dialer: d,
		MinBytes: 1, MaxBytes: l.maxBytes + 1<<20, MaxWait: 500 * time.Millisecond, MaxAttempts: 3,
	})
	defer r.Close()
	if err := r.SetOffset(next); err != nil {
		return fmt.Errorf("dashboard: %s/%d: seek %d: %w", topic, p, next, err)
	}
	short := l.topics.Short(topic)
	for next < end {
		fctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		km, err := r.FetchMessage(fctx)
		cancel()
		if err != nil {
			return fmt.Errorf("dashboard: read %s/%d at %d: %w", topic, p, next, err)
		}
		if km.Offset < next {
			continue
		}
		m := parquet.Message{Partition: p, Offset: km.Offset, Key: km.Key, Value: km.Value, Time: km.Time}
		for _, h := range km.Headers {
			m.Headers = append(m.Headers, pipeline.Header{Key: h.Key, Value: h.Value})
		}
		*out = append(*out, pendingMsg{short, m})
		next = km.Offset + 1
		l.next[topic][p] = next
	}
	return nil
}

// GroupLag is a consumer group's lag on one topic: the records of the
// topic its committed offsets have not passed.
type GroupLag struct {
	Group     string `json:"group"`
	Stage     string `json:"stage"`
	Topic     string `json:"topic"`
	End       int64  `json:"end"`
	Committed int64  `json:"committed"` // sum over partitions of the committed offsets (uncommitted: the first offset)
	Lag       int64  `json:"lag"`
	Uncommit  int    `json:"uncommitted_partitions"`
}

// lags reads the committed offsets of every stage's consumer group
// ("<run>.<stage>") on the topics it consumes.
func (l *live) lags(ctx context.Context) ([]GroupLag, error) {
	c, _, err := l.client(ctx)
	if err != nil {
		return nil, err
	}
	defer closeIdle(c)
	parts, err := l.partitions(ctx, c)
	if err != nil {
		return nil, err
	}
	var out []GroupLag
	for _, stage := range append(slices.Clone(loop.Stages), pipeline.SnapshotStage) {
		group := l.run + "." + stage
		req := map[string][]int{}
		for _, short := range pipeline.InputsOf(stage) {
			topic := l.topics.Name(short)
			for p := range parts[topic] {
				req[topic] = append(req[topic], p)
			}
		}
		of, err := c.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: req})
		if err == nil && of.Error != nil {
			err = of.Error
		}
		if err != nil {
			return out, fmt.Errorf("dashboard: committed offsets of group %s: %w", group, err)
		}
		for _, short := range pipeline.InputsOf(stage) {
			topic := l.topics.Name(short)
			g := GroupLag{Group: group, Stage: stage, Topic: short}
			for _, po := range of.Topics[topic] {
				span := parts[topic][po.Partition]
				committed := po.CommittedOffset
				if po.Error != nil || committed < 0 {
					committed = span[0]
					g.Uncommit++
				}
				g.End += span[1]
				g.Committed += committed
				g.Lag += max(0, span[1]-committed)
			}
			if g.Uncommit < len(of.Topics[topic]) || stage != pipeline.SnapshotStage {
				out = append(out, g)
			}
		}
	}
	return out, nil
}

func closeIdle(c *kafkago.Client) {
	if tr, ok := c.Transport.(interface{ CloseIdleConnections() }); ok {
		tr.CloseIdleConnections()
	}
}
