package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	kafkago "github.com/segmentio/kafka-go"
)

// ErrUnsafeReplication is wrapped by the error PlanReplication returns for
// settings a cluster of several brokers cannot keep through the loss of
// one broker; ReplicationRequest.AllowUnsafe accepts them.
var ErrUnsafeReplication = errors.New("kafka: replication cannot survive the loss of one broker")

// Replication is the replica count and min.insync.replicas of topics.
type Replication struct {
	Factor    int
	MinInsync int
}

// Apply sets the replication of every spec.
func (r Replication) Apply(specs []TopicSpec) {
	for i := range specs {
		specs[i].ReplicationFactor, specs[i].MinInsyncReplicas = r.Factor, r.MinInsync
	}
}

// ReplicationRequest is what PlanReplication decides from.
type ReplicationRequest struct {
	// Brokers is the number of live brokers of the cluster (ListBrokers).
	Brokers int
	// Factor is the requested replication factor; 0 chooses from Brokers.
	Factor int
	// FactorFrom names where Factor comes from in messages (a flag, a
	// contract key); empty means "requested".
	FactorFrom string
	// MinInsync is the requested min.insync.replicas; 0 chooses from the
	// replication factor.
	MinInsync int
	// AllowUnsafe accepts settings that cannot survive the loss of one
	// broker (ErrUnsafeReplication).
	AllowUnsafe bool
}

// PlanReplication decides the replication of new topics and says in a
// sentence what was chosen and why.
//
// Defaults: on a cluster of 3 or more brokers, replication factor 3 and
// min.insync.replicas 2 (a partition keeps every acknowledged write and
// keeps accepting writes when any one broker is lost); on 2 brokers, 2 and
// 1; on 1 broker, 1 and 1. A requested min.insync.replicas without a
// factor takes the default factor, a requested factor without
// min.insync.replicas takes 2 (1 below a factor of 3).
//
// Always refused: a factor or min.insync.replicas below 0, a factor above
// the number of brokers (Kafka would refuse it), min.insync.replicas above
// the factor (no acks=all write could succeed). On 2 or more brokers,
// refused unless AllowUnsafe (wrapping ErrUnsafeReplication): a factor
// below 3 (the loss of one broker then either stops acks=all writes or
// leaves acknowledged writes on one copy), and with 3 or more replicas
// min.insync.replicas equal to the factor (the loss of one replica stops
// acks=all writes) or below 2 (an acknowledged write may live on one broker
// only). A single broker keeps no copy
// anywhere else and is accepted as the development setup it is.
func PlanReplication(req ReplicationRequest) (Replication, string, error) {
	n := req.Brokers
	if n < 1 {
		return Replication{}, "", fmt.Errorf("replication: the cluster lists %d live brokers", n)
	}
	if req.Factor < 0 || req.MinInsync < 0 {
		return Replication{}, "", fmt.Errorf("replication: negative replication factor %d or min.insync.replicas %d", req.Factor, req.MinInsync)
	}
	from := req.FactorFrom
	if from == "" {
		from = "requested"
	}
	r := Replication{Factor: req.Factor, MinInsync: req.MinInsync}
	var why string
	switch {
	case r.Factor > 0:
		why = fmt.Sprintf("replication factor %d (%s)", r.Factor, from)
	case n >= 3:
		r.Factor = 3
		why = fmt.Sprintf("replication factor 3 (default on %d brokers)", n)
	default:
		r.Factor = n
		why = fmt.Sprintf("replication factor %d (default on %d broker%s)", n, n, plural(n))
	}
	switch {
	case r.MinInsync > 0:
		why += fmt.Sprintf(", min.insync.replicas %d (requested)", r.MinInsync)
	case r.Factor >= 3:
		r.MinInsync = 2
		why += ", min.insync.replicas 2 (default for 3 or more replicas)"
	default:
		r.MinInsync = 1
		why += fmt.Sprintf(", min.insync.replicas 1 (default for %d replica%s)", r.Factor, plural(r.Factor))
	}
	if r.Factor > n {
		return r, why, fmt.Errorf("replication factor %d (%s) exceeds the %d live broker%s of the cluster", r.Factor, from, n, plural(n))
	}
	if r.MinInsync > r.Factor {
		return r, why, fmt.Errorf("min.insync.replicas %d exceeds the replication factor %d: no acks=all write could succeed", r.MinInsync, r.Factor)
	}
	if n == 1 {
		return r, why + ": a single broker keeps no copy elsewhere, so losing it loses the topics", nil
	}
	var unsafe []string
	switch {
	case r.Factor < 3 && n < 3:
		unsafe = append(unsafe, fmt.Sprintf("a cluster of %d live brokers cannot both keep every acknowledged write and accept writes through the loss of one broker; run 3 or more brokers", n))
	case r.Factor < 3:
		unsafe = append(unsafe, fmt.Sprintf("replication factor %d (%s): with fewer than 3 replicas, the loss of one broker either stops acks=all writes or leaves acknowledged writes on a single copy; use 3", r.Factor, from))
	}
	// Below 3 replicas the factor's message covers min.insync.replicas.
	if r.Factor >= 3 && r.MinInsync == r.Factor {
		unsafe = append(unsafe, fmt.Sprintf("min.insync.replicas %d equals the replication factor: the loss of one replica stops every acks=all write until it returns; use at most %d", r.MinInsync, r.Factor-1))
	}
	if r.Factor >= 3 && r.MinInsync < 2 {
		unsafe = append(unsafe, fmt.Sprintf("min.insync.replicas %d: an acknowledged write may exist on one broker only, and losing that broker loses it; use 2", r.MinInsync))
	}
	if len(unsafe) == 0 {
		return r, why + fmt.Sprintf(": every partition keeps its acknowledged writes and accepts writes when one of the %d brokers is lost", n), nil
	}
	if req.AllowUnsafe {
		return r, why + " (unsafe, allowed: " + strings.Join(unsafe, "; ") + ")", nil
	}
	return r, why, fmt.Errorf("%w: %s (pass --allow-unsafe-replication to accept)", ErrUnsafeReplication, strings.Join(unsafe, "; "))
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// BrokerInfo is one live broker as the cluster's metadata lists it.
type BrokerInfo struct {
	ID   int
	Addr string // host:port
}

// ListBrokers returns the live brokers of the cluster, sorted by id, from
// a metadata request to the first of brokers that answers (dial.Brokers
// when brokers is empty).
func ListBrokers(ctx context.Context, dial ClientConfig, brokers []string) ([]BrokerInfo, error) {
	var md *kafkago.MetadataResponse
	err := withAdminClient(ctx, dial, brokers, func(client *kafkago.Client) (err error) {
		md, err = client.Metadata(ctx, &kafkago.MetadataRequest{})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list brokers: metadata: %w", err)
	}
	out := make([]BrokerInfo, 0, len(md.Brokers))
	for _, b := range md.Brokers {
		out = append(out, BrokerInfo{ID: b.ID, Addr: fmt.Sprintf("%s:%d", b.Host, b.Port)})
	}
	slices.SortFunc(out, func(a, b BrokerInfo) int { return a.ID - b.ID })
	return out, nil
}
