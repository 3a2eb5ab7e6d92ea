package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"

	kafkago "github.com/segmentio/kafka-go"
)

// OffsetGap is a partition whose committed group offset lies below the log
// start offset: records [Committed, LogStart) were deleted by retention
// before the group consumed them.
type OffsetGap struct {
	Partition int
	Committed int64
	LogStart  int64
}

// Lost is the number of records deleted unconsumed.
func (g OffsetGap) Lost() int64 { return g.LogStart - g.Committed }

// GroupGaps reports, sorted by partition, the partitions of topic where the
// consumer group's committed offset is below the log start offset.
//
// Call it before starting a group reader (and periodically): kafka-go's
// Reader does not report this case. When it (re)initialises a partition at
// an offset below the log start, it silently moves to the log start and
// FetchMessage returns the next available record without an error, so
// records deleted by retention would otherwise vanish unnoticed. Partitions
// the group never committed are not reported.
func GroupGaps(ctx context.Context, dial ClientConfig, brokers []string, group, topic string) ([]OffsetGap, error) {
	var gaps []OffsetGap
	err := withAdminClient(ctx, dial, brokers, func(client *kafkago.Client) (err error) {
		gaps, err = groupGaps(ctx, client, group, topic)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("group gaps: %w", err)
	}
	return gaps, nil
}

func groupGaps(ctx context.Context, client *kafkago.Client, group, topic string) ([]OffsetGap, error) {
	md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, fmt.Errorf("metadata of %q: %w", topic, err)
	}
	if len(md.Topics) != 1 || md.Topics[0].Error != nil {
		return nil, fmt.Errorf("topic %q not found: %v", topic, md.Topics)
	}
	parts := make([]int, 0, len(md.Topics[0].Partitions))
	reqs := make([]kafkago.OffsetRequest, 0, len(parts))
	for _, p := range md.Topics[0].Partitions {
		parts = append(parts, p.ID)
		reqs = append(reqs, kafkago.FirstOffsetOf(p.ID))
	}
	of, err := client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: parts}})
	if err != nil {
		return nil, fmt.Errorf("committed offsets of %q on %q: %w", group, topic, err)
	}
	if of.Error != nil {
		return nil, fmt.Errorf("committed offsets of %q on %q: %w", group, topic, of.Error)
	}
	lo, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("log start offsets of %q: %w", topic, err)
	}
	start := make(map[int]int64, len(parts))
	for _, po := range lo.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("log start of %s/%d: %w", topic, po.Partition, po.Error)
		}
		start[po.Partition] = po.FirstOffset
	}
	var gaps []OffsetGap
	for _, p := range of.Topics[topic] {
		if p.Error != nil {
			return nil, fmt.Errorf("committed offset of %s/%d: %w", topic, p.Partition, p.Error)
		}
		ls, ok := start[p.Partition]
		if !ok {
			return nil, fmt.Errorf("no log start for %s/%d", topic, p.Partition)
		}
		if p.CommittedOffset >= 0 && p.CommittedOffset < ls {
			gaps = append(gaps, OffsetGap{Partition: p.Partition, Committed: p.CommittedOffset, LogStart: ls})
		}
	}
	slices.SortFunc(gaps, func(a, b OffsetGap) int { return a.Partition - b.Partition })
	return gaps, nil
}

// PartitionLag is a consumer group's position on one partition.
type PartitionLag struct {
	Topic     string
	Partition int
	// Committed is the group's committed offset (-1: none); Start and End
	// the partition's log start and high-water mark.
	Committed, Start, End int64
}

// Lag is the number of records of the partition the group has not
// committed: End minus the committed offset (or the log start when the
// group never committed).
func (p PartitionLag) Lag() int64 {
	from := p.Committed
	if from < p.Start {
		from = p.Start
	}
	return max(0, p.End-from)
}

// GroupLag reports the group's committed offset, the log start and the
// high-water mark of every partition of topics, sorted by topic and
// partition.
func GroupLag(ctx context.Context, dial ClientConfig, brokers []string, group string, topics []string) ([]PartitionLag, error) {
	var out []PartitionLag
	err := withAdminClient(ctx, dial, brokers, func(client *kafkago.Client) error {
		out = out[:0]
		md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: topics})
		if err != nil {
			return fmt.Errorf("metadata: %w", err)
		}
		parts := map[string][]int{}
		firsts := map[string][]kafkago.OffsetRequest{}
		lasts := map[string][]kafkago.OffsetRequest{}
		for _, t := range md.Topics {
			if t.Error != nil {
				return fmt.Errorf("topic %q: %w", t.Name, t.Error)
			}
			for _, p := range t.Partitions {
				parts[t.Name] = append(parts[t.Name], p.ID)
				firsts[t.Name] = append(firsts[t.Name], kafkago.FirstOffsetOf(p.ID))
				lasts[t.Name] = append(lasts[t.Name], kafkago.LastOffsetOf(p.ID))
			}
		}
		of, err := client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: parts})
		if err != nil {
			return fmt.Errorf("committed offsets of group %q: %w", group, err)
		}
		if of.Error != nil && !errors.Is(of.Error, kafkago.GroupIdNotFound) {
			return fmt.Errorf("committed offsets of group %q: %w", group, of.Error)
		}
		lo, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: firsts})
		if err != nil {
			return fmt.Errorf("log start offsets: %w", err)
		}
		hi, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: lasts})
		if err != nil {
			return fmt.Errorf("end offsets: %w", err)
		}
		at := map[string]map[int]*PartitionLag{}
		for t, ps := range parts {
			at[t] = map[int]*PartitionLag{}
			for _, p := range ps {
				out = append(out, PartitionLag{Topic: t, Partition: p, Committed: -1})
			}
		}
		for i := range out {
			at[out[i].Topic][out[i].Partition] = &out[i]
		}
		for t, ps := range of.Topics {
			for _, p := range ps {
				if p.Error != nil && errors.Is(p.Error, kafkago.GroupIdNotFound) {
					continue // a group that never committed: Committed stays -1
				}
				if p.Error != nil {
					return fmt.Errorf("committed offset of %s/%d: %w", t, p.Partition, p.Error)
				}
				if pl := at[t][p.Partition]; pl != nil {
					pl.Committed = p.CommittedOffset
				}
			}
		}
		for t, ps := range lo.Topics {
			for _, p := range ps {
				if p.Error != nil {
					return fmt.Errorf("log start of %s/%d: %w", t, p.Partition, p.Error)
				}
				if pl := at[t][p.Partition]; pl != nil {
					pl.Start = p.FirstOffset
				}
			}
		}
		for t, ps := range hi.Topics {
			for _, p := range ps {
				if p.Error != nil {
					return fmt.Errorf("end offset of %s/%d: %w", t, p.Partition, p.Error)
				}
				if pl := at[t][p.Partition]; pl != nil {
					pl.End = p.LastOffset
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("group lag of %q: %w", group, err)
	}
	slices.SortFunc(out, func(a, b PartitionLag) int {
		if a.Topic != b.Topic {
			if a.Topic < b.Topic {
				return -1
			}
			return 1
		}
		return a.Partition - b.Partition
	})
	return out, nil
}
