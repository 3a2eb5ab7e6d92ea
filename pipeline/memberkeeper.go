package pipeline

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"slices"
	"time"

	"github.com/segmentio/kafka-go"
)

// Stale membership after a coordinator failover.
//
// When the broker coordinating a consumer group dies, kafka-go's reader
// cannot reach it, drops its member id and joins the group again as a new
// member once another broker coordinates it. The new coordinator loads the
// group with the old member in it and, as Kafka's rebalance protocol says,
// waits for every known member to rejoin — for the old id, which nobody
// will ever send again, the whole rebalance timeout. Every coordinator
// loss would cost that wait on top of Kafka's own failover.
//
// The member keeper removes that dead membership. The reader's client id
// is unique to it (memberClientID), so the keeper can tell its own
// members from the group's others: while the group is stable it notes the
// member id that carries its client id; once the group lists a second
// member with that client id (the reader's new join) beside the noted one,
// the noted one is the dropped id, and the keeper sends a LeaveGroup for
// it. The coordinator then has every member it waits for and completes the
// rebalance at once. It never removes a member it did not see as its own,
// nor its own while it is the only one: a plain rebalance (another member
// joining or leaving) keeps the reader's id and is left alone.

// keeperEvery is how often the member keeper reads its group.
const keeperEvery = 500 * time.Millisecond

// memberClientID is the client id of a consumer-group reader: base (the
// configured client id, "trajflow" when none) with the group and a token
// unique to this reader appended.
func memberClientID(base, group string) string {
	if base == "" {
		base = "trajflow"
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	return base + "/" + group + "/" + hex.EncodeToString(b[:])
}

// groupView is what the keeper reads of its group: its state and the
// member ids that carry the keeper's client id.
type groupView struct {
	state string
	ours  []string
}

// keepDecision decides, from what the keeper noted before (mine: the
// reader's member id while the group was last stable, "" when unknown) and
// the group as read now, what it notes next and which member id it removes
// ("": none).
func keepDecision(mine string, v groupView) (next, remove string) {
	switch {
	case v.state == "Stable" && len(v.ours) == 1:
		return v.ours[0], ""
	case len(v.ours) > 1 && mine != "" && slices.Contains(v.ours, mine):
		return "", mine
	}
	return mine, ""
}

// memberKeeper removes its reader's stale membership (see above).
type memberKeeper struct {
	client   *kafka.Client
	group    string
	clientID string
	log      *slog.Logger
	mine     string
}

// run checks the group every keeperEvery until ctx ends.
func (k *memberKeeper) run(ctx context.Context) {
	t := time.NewTicker(keeperEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		k.check(ctx)
	}
}

// check reads the group once and removes a stale member of the reader's.
// Errors (the coordinator moving, a broker down) are left to the next
// check.
func (k *memberKeeper) check(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, 4*keeperEvery)
	defer cancel()
	resp, err := k.client.DescribeGroups(cctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{k.group}})
	if err != nil || len(resp.Groups) != 1 || resp.Groups[0].Error != nil {
		return
	}
	g := resp.Groups[0]
	v := groupView{state: g.GroupState}
	for _, m := range g.Members {
		if m.ClientID == k.clientID {
			v.ours = append(v.ours, m.MemberID)
		}
	}
	next, remove := keepDecision(k.mine, v)
	if remove == "" {
		k.mine = next
		return
	}
	lr, err := k.client.LeaveGroup(cctx, &kafka.LeaveGroupRequest{GroupID: k.group, Members: []kafka.LeaveGroupRequestMember{{ID: remove}}})
	if err == nil && lr.Error != nil {
		err = lr.Error
	}
	if err != nil {
		k.log.Warn("stale group member not removed", "group", k.group, "member", remove, "err", err)
		return
	}
	k.mine = next
	k.log.Info("removed the reader's stale group member (dropped after a coordinator failover)", "group", k.group, "member", remove)
}
