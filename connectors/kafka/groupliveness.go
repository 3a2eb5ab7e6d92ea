package kafka

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// Group liveness on the embedded broker.
//
// Kafka expires a consumer-group member that sends nothing for its session
// timeout, counted from the end of the rebalance that admitted it. kfake
// starts that clock only when it has delivered the member's JoinGroup
// response. A member that dies while it waits in JoinGroup (a process
// killed seconds after it started, before the rebalance it triggered
// completed) is still listed in the generation, the surviving leader
// hands it partitions, the response to it cannot be delivered, and no
// clock is ever started for it: its partitions stay assigned to a dead
// member and nothing consumes them (TestGroupMemberKilledWhileJoining).
//
// groupWatch restores Kafka's rule. Control hooks (which let every request
// through) note when each member last sent a group request (JoinGroup,
// SyncGroup, Heartbeat, OffsetCommit) and its session timeout; once a
// second the watch reads every group it saw, and in a Stable group removes
// a member silent for longer than its session timeout, counted from the
// later of its last request and the moment the generation became stable,
// with a LeaveGroup sent on its behalf through the broker's own listener.
// The coordinator then rebalances, as Kafka's own expiry does. Where that
// request cannot be made (a listener that requires client certificates),
// the group's next heartbeats of that generation are answered
// REBALANCE_IN_PROGRESS instead: the leader (alive: a generation is
// stable only once its leader synced) rejoins, and the rebalance that
// starts drops the member that does not rejoin, one rebalance timeout
// later.

// groupWatchEvery is how often groupWatch checks the groups.
const groupWatchEvery = time.Second

// defaultSessionTimeout is the session timeout assumed for a member whose
// JoinGroup the watch did not see (Kafka's default session.timeout.ms).
const defaultSessionTimeout = 45 * time.Second

type memberSeen struct {
	last    time.Time
	session time.Duration
}

type groupSeen struct {
	members     map[string]*memberSeen
	session     time.Duration // the longest session timeout of a join seen
	epoch       int32
	stableSince time.Time // zero: not stable when last checked
	// kick is set when a member of generation epoch expired and could not
	// be removed by a LeaveGroup: heartbeats of that generation are
	// answered REBALANCE_IN_PROGRESS.
	kick bool
	// classic: a JoinGroup was seen (groups of the KIP-848 protocol,
	// whose members heartbeat with ConsumerGroupHeartbeat, are kfake's own
	// to expire and are not watched).
	classic bool
}

// groupWatch tracks the liveness of consumer-group members (see above).
type groupWatch struct {
	cluster *kfake.Cluster
	addr    string
	tls     *tls.Config // the broker's listener TLS; nil without TLS
	user    *BrokerUser // a SASL user of the broker; nil without SASL
	log     *slog.Logger
	now     func() time.Time

	mu     sync.Mutex
	groups map[string]*groupSeen
	client *kgo.Client // created at the first removal
}

func newGroupWatch(c *kfake.Cluster, addr string, cfg BrokerConfig, log *slog.Logger) *groupWatch {
	w := &groupWatch{cluster: c, addr: addr, tls: cfg.TLS, log: log, now: time.Now, groups: map[string]*groupSeen{}}
	if len(cfg.Users) > 0 {
		w.user = &cfg.Users[0]
	}
	observe := func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if resp := w.saw(req); resp != nil {
			return resp, nil, true
		}
		return nil, nil, false
	}
	for _, k := range []kmsg.Key{kmsg.JoinGroup, kmsg.SyncGroup, kmsg.Heartbeat, kmsg.OffsetCommit, kmsg.LeaveGroup} {
		c.ControlKey(int16(k), observe)
	}
	return w
}

// saw notes a group request; a non-nil response answers it in the
// coordinator's place (a heartbeat of a generation to rebalance).
func (w *groupWatch) saw(req kmsg.Request) kmsg.Response {
	var group, member string
	var session time.Duration
	switch r := req.(type) {
	case *kmsg.JoinGroupRequest:
		group, member, session = r.Group, r.MemberID, time.Duration(r.SessionTimeoutMillis)*time.Millisecond
	case *kmsg.SyncGroupRequest:
		group, member = r.Group, r.MemberID
	case *kmsg.HeartbeatRequest:
		group, member = r.Group, r.MemberID
		w.mu.Lock()
		g := w.groups[group]
		kick := g != nil && g.kick && g.epoch == r.Generation
		w.mu.Unlock()
		if kick {
			resp := r.ResponseKind().(*kmsg.HeartbeatResponse)
			resp.ErrorCode = kerr.RebalanceInProgress.Code
			return resp
		}
	case *kmsg.OffsetCommitRequest:
		group, member = r.Group, r.MemberID
	case *kmsg.LeaveGroupRequest:
		w.mu.Lock()
		if g := w.groups[r.Group]; g != nil {
			delete(g.members, r.MemberID)
			for _, m := range r.Members {
				delete(g.members, m.MemberID)
			}
		}
		w.mu.Unlock()
		return nil
	default:
		return nil
	}
	if group == "" {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	g := w.groups[group]
	if g == nil {
		g = &groupSeen{members: map[string]*memberSeen{}}
		w.groups[group] = g
	}
	g.session = max(g.session, session)
	if _, join := req.(*kmsg.JoinGroupRequest); join {
		g.classic = true
	}
	if member == "" {
		return nil
	}
	m := g.members[member]
	if m == nil {
		m = &memberSeen{}
		g.members[member] = m
	}
	m.last = w.now()
	if session > 0 {
		m.session = session
	}
	return nil
}

// run checks the groups every groupWatchEvery until stop is closed.
func (w *groupWatch) run(stop <-chan struct{}) {
	t := time.NewTicker(groupWatchEvery)
	defer t.Stop()
	defer w.close()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			w.check(stop)
		}
	}
}

// expired is a member to remove.
type expired struct {
	group, member, host string
	silent, session     time.Duration
}

// check removes the expired members of every Stable group seen.
func (w *groupWatch) check(stop <-chan struct{}) {
	w.mu.Lock()
	names := make([]string, 0, len(w.groups))
	for name := range w.groups {
		names = append(names, name)
	}
	w.mu.Unlock()
	var gone []expired
	for _, name := range names {
		info := w.cluster.GroupInfo(name) // outside mu: it waits for the cluster's loop, which runs the hooks
		now := w.now()
		w.mu.Lock()
		g := w.groups[name]
		switch {
		case info == nil || g == nil:
			delete(w.groups, name)
		case !g.classic:
		case info.State != "Stable" || info.Epoch != g.epoch || g.stableSince.IsZero():
			// A new generation (or none yet): every member's clock starts
			// when it is first seen stable.
			if info.Epoch != g.epoch {
				g.kick = false
			}
			g.epoch, g.stableSince = info.Epoch, time.Time{}
			if info.State == "Stable" {
				g.stableSince = now
			}
		default:
			listed := map[string]bool{}
			for _, m := range info.Members {
				listed[m.MemberID] = true
				seen := g.members[m.MemberID]
				last, session := g.stableSince, g.session
				if seen != nil {
					last = later(last, seen.last)
					if seen.session > 0 {
						session = seen.session
					}
				}
				if session <= 0 {
					session = defaultSessionTimeout
				}
				if silent := now.Sub(last); silent > session && !g.kick {
					gone = append(gone, expired{group: name, member: m.MemberID, host: m.ClientHost, silent: silent, session: session})
				}
			}
			for id := range g.members {
				if !listed[id] {
					delete(g.members, id)
				}
			}
		}
		w.mu.Unlock()
	}
	for _, e := range gone {
		select {
		case <-stop:
			return
		default:
		}
		if err := w.remove(e); err != nil {
			w.log.Warn("embedded broker: a consumer-group member sent nothing for its session timeout and a LeaveGroup for it failed; "+
				"the group's heartbeats are answered REBALANCE_IN_PROGRESS until it rebalances without it",
				"group", e.group, "member", e.member, "client_host", e.host, "silent", e.silent.Round(time.Millisecond), "err", err)
			w.mu.Lock()
			if g := w.groups[e.group]; g != nil {
				g.kick = true
			}
			w.mu.Unlock()
			continue
		}
		w.log.Warn("embedded broker: removed a consumer-group member that sent nothing for its session timeout",
			"group", e.group, "member", e.member, "client_host", e.host, "silent", e.silent.Round(time.Millisecond), "session_timeout", e.session)
		w.mu.Lock()
		if g := w.groups[e.group]; g != nil {
			delete(g.members, e.member)
		}
		w.mu.Unlock()
	}
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// remove sends a LeaveGroup for e's member (version 3 and later name the
// members to remove, as an administrator's removal does).
func (w *groupWatch) remove(e expired) error {
	cl, err := w.clientOnce()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req := kmsg.NewPtrLeaveGroupRequest()
	req.Group = e.group
	m := kmsg.NewLeaveGroupRequestMember()
	m.MemberID = e.member
	m.Reason = kmsg.StringPtr(fmt.Sprintf("no request for %s, past the session timeout of %s", e.silent.Round(time.Millisecond), e.session))
	req.Members = []kmsg.LeaveGroupRequestMember{m}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("leave group %s at %s: %w", e.group, w.addr, err)
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return fmt.Errorf("leave group %s: %w", e.group, err)
	}
	for _, r := range resp.Members {
		if err := kerr.ErrorForCode(r.ErrorCode); err != nil && err != kerr.UnknownMemberID {
			return fmt.Errorf("leave group %s, member %s: %w", e.group, r.MemberID, err)
		}
	}
	return nil
}

// clientOnce returns the watch's client of the broker's own listener,
// created on first use.
func (w *groupWatch) clientOnce() (*kgo.Client, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.client != nil {
		return w.client, nil
	}
	opts := []kgo.Opt{kgo.SeedBrokers(w.addr), kgo.RequestRetries(2), kgo.RetryTimeout(5 * time.Second)}
	if w.tls != nil {
		// The broker's own listener, from its own process: the
		// certificate is the one it serves.
		opts = append(opts, kgo.DialTLSConfig(&tls.Config{InsecureSkipVerify: true}))
	} else {
		opts = append(opts, kgo.Dialer(Dial))
	}
	if u := w.user; u != nil {
		switch u.Mechanism {
		case SASLPlain:
			opts = append(opts, kgo.SASL(plain.Auth{User: u.Username, Pass: u.Password.Reveal()}.AsMechanism()))
		case SASLScramSHA256:
			opts = append(opts, kgo.SASL(scram.Auth{User: u.Username, Pass: u.Password.Reveal()}.AsSha256Mechanism()))
		case SASLScramSHA512:
			opts = append(opts, kgo.SASL(scram.Auth{User: u.Username, Pass: u.Password.Reveal()}.AsSha512Mechanism()))
		}
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("client of %s: %w", w.addr, err)
	}
	w.client = cl
	return cl, nil
}

func (w *groupWatch) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.client != nil {
		w.client.Close()
		w.client = nil
	}
}
