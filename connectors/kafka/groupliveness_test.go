package kafka

import (
	"context"
	"crypto/tls"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// member is one consumer-group member speaking the classic group protocol
// by hand (JoinGroup, SyncGroup, Heartbeat), so a test can stop it at any
// step as a killed process stops.
type member struct {
	t     *testing.T
	cl    *kgo.Client
	group string
	topic string
	id    string
	gen   int32
}

func newMember(t *testing.T, addr, group, topic string, opts ...kgo.Opt) *member {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(addr), kgo.RetryTimeout(2 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &member{t: t, cl: cl, group: group, topic: topic}
}

// joinRequest is the member's JoinGroup request (session timeout 6 s,
// rebalance timeout 3 s, one "range" protocol on its topic).
func (m *member) joinRequest() *kmsg.JoinGroupRequest {
	meta := kmsg.NewConsumerMemberMetadata()
	meta.Topics = []string{m.topic}
	p := kmsg.NewJoinGroupRequestProtocol()
	p.Name, p.Metadata = "range", meta.AppendTo(nil)
	req := kmsg.NewPtrJoinGroupRequest()
	req.Group, req.MemberID, req.ProtocolType = m.group, m.id, "consumer"
	req.SessionTimeoutMillis, req.RebalanceTimeoutMillis = 6000, 3000
	req.Protocols = []kmsg.JoinGroupRequestProtocol{p}
	return req
}

// memberID gets the member its id (JoinGroup answers MEMBER_ID_REQUIRED to
// a new member, KIP-394).
func (m *member) memberID(ctx context.Context) {
	m.t.Helper()
	resp, err := m.joinRequest().RequestWith(ctx, m.cl)
	if err != nil {
		m.t.Fatal(err)
	}
	if resp.ErrorCode != kerr.MemberIDRequired.Code || resp.MemberID == "" {
		m.t.Fatalf("first join: error %v, member %q; want MEMBER_ID_REQUIRED with an id", kerr.ErrorForCode(resp.ErrorCode), resp.MemberID)
	}
	m.id = resp.MemberID
}

// join joins the group's next generation and returns the members the
// coordinator listed (to the leader) and the leader's id.
func (m *member) join(ctx context.Context) (members []string, leader string, err error) {
	resp, err := m.joinRequest().RequestWith(ctx, m.cl)
	if err != nil {
		return nil, "", err
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return nil, "", err
	}
	m.gen = resp.Generation
	for _, x := range resp.Members {
		members = append(members, x.MemberID)
	}
	return members, resp.LeaderID, nil
}

// sync sends the member's SyncGroup; the leader gives partition 0 of the
// topic to owner.
func (m *member) sync(ctx context.Context, owner string) {
	m.t.Helper()
	req := kmsg.NewPtrSyncGroupRequest()
	req.Group, req.MemberID, req.Generation = m.group, m.id, m.gen
	req.ProtocolType, req.Protocol = kmsg.StringPtr("consumer"), kmsg.StringPtr("range")
	if owner != "" {
		a := kmsg.NewConsumerMemberAssignment()
		at := kmsg.NewConsumerMemberAssignmentTopic()
		at.Topic, at.Partitions = m.topic, []int32{0}
		a.Topics = []kmsg.ConsumerMemberAssignmentTopic{at}
		ga := kmsg.NewSyncGroupRequestGroupAssignment()
		ga.MemberID, ga.MemberAssignment = owner, a.AppendTo(nil)
		req.GroupAssignment = []kmsg.SyncGroupRequestGroupAssignment{ga}
	}
	resp, err := req.RequestWith(ctx, m.cl)
	if err != nil {
		m.t.Fatal(err)
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		m.t.Fatalf("sync of %s: %v", m.id, err)
	}
}

// heartbeat sends one Heartbeat and returns its error code's error.
func (m *member) heartbeat(ctx context.Context) error {
	req := kmsg.NewPtrHeartbeatRequest()
	req.Group, req.MemberID, req.Generation = m.group, m.id, m.gen
	resp, err := req.RequestWith(ctx, m.cl)
	if err != nil {
		return err
	}
	return kerr.ErrorForCode(resp.ErrorCode)
}

// TestGroupMemberKilledWhileJoining is a member that dies while it waits
// in JoinGroup (a process killed seconds after it started, as a restarted
// operator can be). The rebalance completes with it still listed, and the
// surviving leader, which cannot know, gives it a partition. Kafka expires
// the dead member one session timeout after the join (it never
// heartbeats), so the survivor is told to rejoin and gets the partition.
// The embedded broker must too: without it the partition would stay with
// the dead member for good and nothing would consume it. On a listener
// that requires client certificates the broker cannot send itself the
// LeaveGroup and makes the leader rejoin instead. A live member that
// keeps heartbeating is never removed.
func TestGroupMemberKilledWhileJoining(t *testing.T) {
	p := newTestPKI(t)
	secure := BrokerConfig{
		TLS:   &tls.Config{Certificates: []tls.Certificate{p.server}, ClientCAs: p.pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12},
		Users: []BrokerUser{{Mechanism: SASLScramSHA512, Username: "u", Password: "pw"}},
	}
	cc := ClientConfig{
		TLS:  TLSConfig{Enable: true, CAFile: p.caFile, CertFile: p.certFile, KeyFile: p.keyFile, ServerName: "broker.test"},
		SASL: SASLConfig{Mechanism: SASLScramSHA512, Username: "u", Password: "pw"},
	}
	for _, tc := range []struct {
		name string
		cfg  BrokerConfig
		cc   ClientConfig
		opts func(t *testing.T) []kgo.Opt
	}{
		{"plaintext", BrokerConfig{}, ClientConfig{}, func(*testing.T) []kgo.Opt { return nil }},
		{"mutual TLS and SASL", secure, cc, func(t *testing.T) []kgo.Opt {
			tc, err := cc.TLSClientConfig()
			if err != nil {
				t.Fatal(err)
			}
			return []kgo.Opt{kgo.DialTLSConfig(tc), kgo.SASL(scram.Auth{User: "u", Pass: "pw"}.AsSha512Mechanism())}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			memberKilledWhileJoining(t, tc.cfg, tc.cc, tc.opts(t))
		})
	}
}

func memberKilledWhileJoining(t *testing.T, cfg BrokerConfig, cc ClientConfig, opts []kgo.Opt) {
	ctx := testCtx(t, 90*time.Second)
	b := startTestBroker(t, cfg)
	if err := CreateTopics(ctx, cc, []string{b.Addr()}, []TopicSpec{{Name: "t", Partitions: 1}}); err != nil {
		t.Fatal(err)
	}
	const group = "g"

	a := newMember(t, b.Addr(), group, "t", opts...)
	a.memberID(ctx)
	if _, leader, err := a.join(ctx); err != nil || leader != a.id {
		t.Fatalf("first join: leader %q, err %v", leader, err)
	}
	a.sync(ctx, a.id)

	// The second member joins, which starts a rebalance that waits for a,
	// and dies while it waits.
	d := newMember(t, b.Addr(), group, "t", opts...)
	d.memberID(ctx)
	joined := make(chan error, 1)
	go func() { // ends when d's client is closed below
		_, _, err := d.join(ctx)
		joined <- err
	}()
	for {
		if err := a.heartbeat(ctx); errors.Is(err, kerr.RebalanceInProgress) {
			break
		} else if err != nil {
			t.Fatalf("heartbeat before the rebalance: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.cl.Close()
	<-joined
	time.Sleep(500 * time.Millisecond) // the broker sees the connection closed

	// a rejoins: the generation lists the dead member, and the leader
	// hands it the partition.
	members, leader, err := a.join(ctx)
	if err != nil || leader != a.id || len(members) != 2 {
		t.Fatalf("rejoin: members %v, leader %q, err %v; want both members, a leading", members, leader, err)
	}
	a.sync(ctx, d.id)
	synced := time.Now()

	// Within a session timeout and a margin, a is told to rejoin, and the
	// next generation has a alone.
	for {
		err := a.heartbeat(ctx)
		if errors.Is(err, kerr.RebalanceInProgress) {
			break
		}
		if err != nil {
			t.Fatalf("heartbeat: %v", err)
		}
		if time.Since(synced) > 25*time.Second {
			t.Fatalf("the dead member %s still holds the group's only partition 25 s after the rebalance (session timeout 6 s)", d.id)
		}
		time.Sleep(time.Second)
	}
	t.Logf("told to rejoin %s after the rebalance", time.Since(synced).Round(100*time.Millisecond))
	members, leader, err = a.join(ctx)
	if err != nil || len(members) != 1 || members[0] != a.id || leader != a.id {
		t.Fatalf("join after the expiry: members %v, leader %q, err %v; want a alone", members, leader, err)
	}
	a.sync(ctx, a.id)

	// a keeps heartbeating for longer than its session timeout: it stays.
	for range 8 {
		if err := a.heartbeat(ctx); err != nil {
			t.Fatalf("a live member's heartbeat: %v", err)
		}
		time.Sleep(time.Second)
	}
}
