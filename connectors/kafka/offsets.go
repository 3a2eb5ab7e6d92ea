package kafka

import (
	"context"
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
