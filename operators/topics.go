package operators

import (
	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// TopicSpecs lists every topic of a run with the contract's partitions,
// replication, retention and max.message.bytes (`trajflow topics create`
// then sets the replication it plans with ReplicationRequest). Topics that must keep a
// single order (batches, windows, the policy log) have one partition; the
// policy topic is compacted (systems §8: the latest release per key).
//
// The scored topic has one partition too: the pack window is one logical
// window per run (batch indexes are a single sequence), so the pack stage
// runs as one active instance; further instances in its consumer group get
// no partition and stand by, taking over on a rebalance. Validate, reward
// and advantage scale out over the partitions of their input topics.
func TopicSpecs(c *contract.Contract, t pipeline.Topics) []kafka.TopicSpec {
	spec := func(name string, parts int) kafka.TopicSpec {
		return kafka.TopicSpec{
			Name: name, Partitions: parts, ReplicationFactor: c.Topics.Replication,
			RetentionMs: c.Topics.RetentionMS, MaxMessageBytes: c.Topics.MaxMessageBytes,
		}
	}
	p := c.Topics.Partitions
	policy := spec(t.Policy, 1)
	policy.Compacted = true
	policy.RetentionMs = 0
	return []kafka.TopicSpec{
		spec(t.Tasks, p), spec(t.Trajectories, p), spec(t.Valid, p), spec(t.Rewarded, p),
		spec(t.Scored, 1), spec(t.Batches, 1), spec(t.Quarantine, p), spec(t.Census, p),
		spec(t.Incidents, 1), policy, spec(t.Windows, 1),
	}
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
