//go:build integration

package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Cluster questions the fault scenarios ask between faults, over a
// franz-go admin client (adminClient).

// underReplicated lists the partitions of every topic (internal ones
// included) whose ISR is short of their replicas or that have no leader.
func underReplicated(ctx context.Context, adm *kgo.Client) ([]string, error) {
	req := kmsg.NewPtrMetadataRequest() // nil Topics: every topic
	resp, err := req.RequestWith(ctx, adm)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, t := range resp.Topics {
		name := ""
		if t.Topic != nil {
			name = *t.Topic
		}
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			out = append(out, fmt.Sprintf("%s: %v", name, err))
			continue
		}
		for _, p := range t.Partitions {
			if p.Leader < 0 || len(p.ISR) < len(p.Replicas) {
				out = append(out, fmt.Sprintf("%s/%d leader %d isr %v replicas %v", name, p.Partition, p.Leader, p.ISR, p.Replicas))
			}
		}
	}
	return out, nil
}

// waitFullISR waits until every partition of the cluster has its full ISR
// again (a restarted broker caught up): only then may the next broker be
// lost without a partition falling below min.insync.replicas.
func waitFullISR(ctx context.Context, adm *kgo.Client, timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last []string
	var lastErr error
	for {
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		under, err := underReplicated(rctx, adm)
		rcancel()
		if err == nil && len(under) == 0 {
			return time.Since(start), nil
		}
		last, lastErr = under, err
		select {
		case <-ctx.Done():
			return time.Since(start), fmt.Errorf("ISR not full after %s (error %v): %s", timeout, lastErr, strings.Join(last[:min(len(last), 8)], "; "))
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// runTopicNames lists the cluster's topics named "<run>.*".
func runTopicNames(ctx context.Context, adm *kgo.Client, run string) ([]string, error) {
	req := kmsg.NewPtrMetadataRequest()
	resp, err := req.RequestWith(ctx, adm)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, t := range resp.Topics {
		if t.Topic != nil && strings.HasPrefix(*t.Topic, run+".") {
			out = append(out, *t.Topic)
		}
	}
	return out, nil
}

// deleteRun deletes the run's topics and consumer groups and waits until
// the metadata lists none of its topics, so that the run id can be used
// again from scratch (the fault scenarios share one run id with the clean
// reference run: ids, and so batch hashes, depend on it).
func deleteRun(ctx context.Context, adm *kgo.Client, run string, stages []string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for {
		names, err := runTopicNames(ctx, adm, run)
		if err == nil && len(names) == 0 {
			break
		}
		if err == nil {
			req := kmsg.NewPtrDeleteTopicsRequest()
			req.TimeoutMillis = 30000
			for _, n := range names {
				rt := kmsg.NewDeleteTopicsRequestTopic()
				rt.Topic = kmsg.StringPtr(n)
				req.Topics = append(req.Topics, rt)
				req.TopicNames = append(req.TopicNames, n)
			}
			var resp *kmsg.DeleteTopicsResponse
			if resp, err = req.RequestWith(ctx, adm); err == nil {
				for _, t := range resp.Topics {
					if e := kerr.ErrorForCode(t.ErrorCode); e != nil && !errors.Is(e, kerr.UnknownTopicOrPartition) {
						err = fmt.Errorf("delete %v: %w", t.Topic, e)
					}
				}
			}
		}
		if ctx.Err() != nil {
			return fmt.Errorf("delete topics of run %s: %w", run, err)
		}
		time.Sleep(300 * time.Millisecond)
	}
	// A cluster just started may not have its group coordinators yet
	// (COORDINATOR_NOT_AVAILABLE, COORDINATOR_LOAD_IN_PROGRESS): retried
	// as long as ctx lasts.
	for {
		err := deleteGroups(ctx, adm, run, stages)
		if err == nil || !(errors.Is(err, kerr.CoordinatorNotAvailable) || errors.Is(err, kerr.CoordinatorLoadInProgress) || errors.Is(err, kerr.NotCoordinator)) {
			return err
		}
		if ctx.Err() != nil {
			return err
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// deleteGroups deletes the consumer groups of the stages of run (a group
// that does not exist is not an error).
func deleteGroups(ctx context.Context, adm *kgo.Client, run string, stages []string) error {
	req := kmsg.NewPtrDeleteGroupsRequest()
	for _, s := range stages {
		req.Groups = append(req.Groups, run+"."+s)
	}
	for _, sh := range adm.RequestSharded(ctx, req) {
		if sh.Err != nil {
			return fmt.Errorf("delete groups of run %s: %w", run, sh.Err)
		}
		for _, g := range sh.Resp.(*kmsg.DeleteGroupsResponse).Groups {
			if e := kerr.ErrorForCode(g.ErrorCode); e != nil && !errors.Is(e, kerr.GroupIDNotFound) {
				return fmt.Errorf("delete group %s: %w", g.Group, e)
			}
		}
	}
	return nil
}

// topicsServed waits until every topic has a leader for every partition.
func topicsServed(ctx context.Context, adm *kgo.Client, topics []string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for {
		req := kmsg.NewPtrMetadataRequest()
		for _, n := range topics {
			rt := kmsg.NewMetadataRequestTopic()
			rt.Topic = kmsg.StringPtr(n)
			req.Topics = append(req.Topics, rt)
		}
		resp, err := req.RequestWith(ctx, adm)
		ok := err == nil && len(resp.Topics) == len(topics)
		if ok {
			for _, t := range resp.Topics {
				if t.ErrorCode != 0 || len(t.Partitions) == 0 {
					ok = false
				}
				for _, p := range t.Partitions {
					if p.Leader < 0 {
						ok = false
					}
				}
			}
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("topics %v not served (last error %v)", topics, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
