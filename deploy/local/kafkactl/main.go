// Command kafkactl answers the questions deploy/local/cluster.sh asks a
// Kafka cluster, over the Kafka protocol (the broker jars carry no admin
// tools, and a JVM per question would take seconds):
//
//	kafkactl ready N ADDR...               exit 0 when every ADDR lists N live brokers
//	kafkactl leader ADDRS TOPIC PARTITION  the node id leading the partition (-1: none)
//	kafkactl describe ADDRS TOPIC          leader, replicas and ISR of every partition
//	kafkactl controller ADDRS              the node id of the active KRaft controller
//
// ADDRS is a comma-separated list, asked in order until one answers; each
// address gets 2 s to connect and 5 s per request.
package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
)

const (
	dialTimeout    = 2 * time.Second
	requestTimeout = 5 * time.Second
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kafkactl:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	if len(args) == 0 {
		return errors.New("usage: kafkactl ready|leader|describe|controller ...")
	}
	ctx := context.Background()
	switch cmd, rest := args[0], args[1:]; {
	case cmd == "ready" && len(rest) >= 2:
		n, err := strconv.Atoi(rest[0])
		if err != nil {
			return fmt.Errorf("ready: broker count %q: %w", rest[0], err)
		}
		return ready(ctx, n, rest[1:])
	case cmd == "leader" && len(rest) == 3:
		p, err := strconv.Atoi(rest[2])
		if err != nil {
			return fmt.Errorf("leader: partition %q: %w", rest[2], err)
		}
		parts, err := describe(ctx, split(rest[0]), rest[1])
		if err != nil {
			return err
		}
		for _, pt := range parts {
			if int(pt.Partition) == p {
				fmt.Fprintln(out, pt.Leader)
				return nil
			}
		}
		return fmt.Errorf("leader: topic %q has no partition %d", rest[1], p)
	case cmd == "describe" && len(rest) == 2:
		parts, err := describe(ctx, split(rest[0]), rest[1])
		if err != nil {
			return err
		}
		for _, pt := range parts {
			fmt.Fprintf(out, "%s partition %d leader %d replicas %s isr %s\n", rest[1], pt.Partition, pt.Leader, ids(pt.Replicas), ids(pt.ISR))
		}
		return nil
	case cmd == "controller" && len(rest) == 1:
		id, err := controller(ctx, split(rest[0]))
		if err != nil {
			return err
		}
		fmt.Fprintln(out, id)
		return nil
	}
	return fmt.Errorf("bad arguments %q", args)
}

func split(s string) []string { return strings.Split(s, ",") }

func ids(v []int32) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(int(x))
	}
	return strings.Join(s, ",")
}

// ready checks that every address answers a metadata request listing n
// brokers (brokers appear in metadata once registered and unfenced).
func ready(ctx context.Context, n int, addrs []string) error {
	var errs []error
	for _, a := range addrs {
		md, err := metadata(ctx, []string{a}, nil)
		switch {
		case err != nil:
			errs = append(errs, err)
		case len(md.Brokers) != n:
			errs = append(errs, fmt.Errorf("%s: %d live brokers, want %d", a, len(md.Brokers), n))
		}
	}
	return errors.Join(errs...)
}

type partition struct {
	Partition     int32
	Leader        int32
	Replicas, ISR []int32
}

func describe(ctx context.Context, addrs []string, topic string) ([]partition, error) {
	md, err := metadata(ctx, addrs, []string{topic})
	if err != nil {
		return nil, err
	}
	if len(md.Topics) != 1 {
		return nil, fmt.Errorf("metadata: %d topics in the answer, want 1", len(md.Topics))
	}
	t := md.Topics[0]
	if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
		return nil, fmt.Errorf("topic %q: %w", topic, err)
	}
	var out []partition
	for _, p := range t.Partitions {
		out = append(out, partition{p.Partition, p.Leader, p.Replicas, p.ISR})
	}
	slices.SortFunc(out, func(a, b partition) int { return int(a.Partition - b.Partition) })
	return out, nil
}

func metadata(ctx context.Context, addrs, topics []string) (*kmsg.MetadataResponse, error) {
	req := kmsg.NewPtrMetadataRequest()
	if topics != nil {
		for _, t := range topics {
			rt := kmsg.NewMetadataRequestTopic()
			rt.Topic = kmsg.StringPtr(t)
			req.Topics = append(req.Topics, rt)
		}
	} else {
		req.Topics = []kmsg.MetadataRequestTopic{} // brokers only
	}
	resp := new(kmsg.MetadataResponse)
	if err := ask(ctx, addrs, req, resp); err != nil {
		return nil, err
	}
	return resp, nil
}

// controller asks a broker for the KRaft quorum (the broker forwards
// DescribeQuorum to the active controller) and returns its leader.
func controller(ctx context.Context, addrs []string) (int32, error) {
	req := kmsg.NewPtrDescribeQuorumRequest()
	rt := kmsg.NewDescribeQuorumRequestTopic()
	rt.Topic = "__cluster_metadata"
	rp := kmsg.NewDescribeQuorumRequestTopicPartition()
	rt.Partitions = append(rt.Partitions, rp)
	req.Topics = append(req.Topics, rt)
	resp := new(kmsg.DescribeQuorumResponse)
	if err := ask(ctx, addrs, req, resp); err != nil {
		return 0, err
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return 0, fmt.Errorf("describe quorum: %w", err)
	}
	if len(resp.Topics) != 1 || len(resp.Topics[0].Partitions) != 1 {
		return 0, errors.New("describe quorum: no partition in the answer")
	}
	p := resp.Topics[0].Partitions[0]
	if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
		return 0, fmt.Errorf("describe quorum: %w", err)
	}
	return p.LeaderID, nil
}

// ask sends req to the first address that answers, at the highest version
// both sides support, and decodes the answer into resp.
func ask(ctx context.Context, addrs []string, req kmsg.Request, resp kmsg.Response) error {
	var errs []error
	for _, a := range addrs {
		err := askOne(ctx, a, req, resp)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", a, err))
	}
	return errors.Join(errs...)
}

func askOne(ctx context.Context, addr string, req kmsg.Request, resp kmsg.Response) error {
	d := net.Dialer{Timeout: dialTimeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(requestTimeout)); err != nil {
		return err
	}
	versions := kmsg.NewPtrApiVersionsRequest()
	versions.SetVersion(0)
	vr := new(kmsg.ApiVersionsResponse)
	if err := roundTrip(c, 1, versions, vr); err != nil {
		return fmt.Errorf("api versions: %w", err)
	}
	if err := kerr.ErrorForCode(vr.ErrorCode); err != nil {
		return fmt.Errorf("api versions: %w", err)
	}
	v := int16(-1)
	for _, k := range vr.ApiKeys {
		if k.ApiKey == req.Key() {
			v = min(k.MaxVersion, req.MaxVersion())
			if v < k.MinVersion {
				v = -1
			}
		}
	}
	if v < 0 {
		return fmt.Errorf("broker does not serve api key %d", req.Key())
	}
	req.SetVersion(v)
	resp.SetVersion(v)
	return roundTrip(c, 2, req, resp)
}

func roundTrip(c net.Conn, corr int32, req kmsg.Request, resp kmsg.Response) error {
	msg := kmsg.NewRequestFormatter(kmsg.FormatterClientID("kafkactl")).AppendRequest(nil, req, corr)
	if _, err := c.Write(msg); err != nil {
		return err
	}
	var size [4]byte
	if _, err := io.ReadFull(c, size[:]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(size[:])
	if n < 4 || n > 64<<20 {
		return fmt.Errorf("answer of %d bytes", n)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(c, body); err != nil {
		return err
	}
	if got := int32(binary.BigEndian.Uint32(body)); got != corr {
		return fmt.Errorf("correlation id %d, want %d", got, corr)
	}
	body = body[4:]
	// Flexible responses carry tagged fields in their header, except
	// ApiVersions (key 18), whose header stays v0.
	if resp.IsFlexible() && resp.Key() != 18 {
		var err error
		if body, err = skipTags(body); err != nil {
			return fmt.Errorf("response header: %w", err)
		}
	}
	return resp.ReadFrom(body)
}

// skipTags skips a tagged-field section (KIP-482): a count, then per field
// a tag and a length-prefixed value, all unsigned varints.
func skipTags(b []byte) ([]byte, error) {
	n, k := binary.Uvarint(b)
	if k <= 0 {
		return nil, errors.New("bad tag count")
	}
	b = b[k:]
	for range n {
		if _, k = binary.Uvarint(b); k <= 0 {
			return nil, errors.New("bad tag")
		}
		b = b[k:]
		size, k := binary.Uvarint(b)
		if k <= 0 || uint64(len(b)-k) < size {
			return nil, errors.New("bad tag size")
		}
		b = b[k+int(size):]
	}
	return b, nil
}
