package operators

import (
	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// TopicSpecs lists every topic of the topology (pipeline.Topology) with
// the contract's partitions, replication, retention and max.message.bytes.
// Topics that must keep a single order (batches, windows, the policy log)
// have one partition; the policy topic is compacted (docs/SYSTEMS.md §8: the
// latest release per key). `trajflow topics create` then sets the
// replication it plans with ReplicationRequest.
//
// The scored topic has one partition too: the pack window is one logical
// window per run (batch indexes are a single sequence), so the pack stage
// runs as one active instance; further instances in its consumer group get
// no partition and stand by, taking over on a rebalance. Validate, reward
// and advantage scale out over the partitions of their input topics.
func TopicSpecs(c *contract.Contract, t pipeline.Topics) []kafka.TopicSpec {
	var specs []kafka.TopicSpec
	for _, info := range pipeline.Topology() {
		s := kafka.TopicSpec{
			Name: t.Name(info.Short), Partitions: info.Partitions, ReplicationFactor: c.Topics.Replication,
			RetentionMs: c.Topics.RetentionMS, MaxMessageBytes: c.Topics.MaxMessageBytes, Compacted: info.Compacted,
		}
		if s.Partitions == 0 {
			s.Partitions = c.Topics.Partitions
		}
		if s.Compacted {
			s.RetentionMs = 0
		}
		specs = append(specs, s)
	}
	return specs
}

// ReplicationRequest is the replication `trajflow topics create` asks
// kafka.PlanReplication for on a cluster of brokers: factor and minInsync
// are the command-line values (0: not given). A factor given on the
// command line wins; otherwise the contract's topics.replication when the
// document writes it; otherwise the cluster's size decides.
func ReplicationRequest(c *contract.Contract, brokers, factor, minInsync int, allowUnsafe bool) kafka.ReplicationRequest {
	r := kafka.ReplicationRequest{Brokers: brokers, MinInsync: minInsync, AllowUnsafe: allowUnsafe}
	switch {
	case factor > 0:
		r.Factor, r.FactorFrom = factor, "--replication-factor"
	case c.Written("topics.replication"):
		r.Factor, r.FactorFrom = c.Topics.Replication, "contract topics.replication"
	}
	return r
}

// SnapshotLayout is what a complete snapshot of a run of c holds per
// topic (short name): its partition count, and whether every partition
// starts at offset 0 (every topic that is not compacted: the snapshot
// stage reads from the beginning). parquet.Holes checks a snapshot
// against it.
func SnapshotLayout(c *contract.Contract) (partitions map[string]int, fromStart map[string]bool) {
	partitions, fromStart = map[string]int{}, map[string]bool{}
	for _, info := range pipeline.Topology() {
		n := info.Partitions
		if n == 0 {
			n = c.Topics.Partitions
		}
		partitions[info.Short] = n
		fromStart[info.Short] = !info.Compacted
	}
	return partitions, fromStart
}
