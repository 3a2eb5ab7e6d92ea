package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/trajflow/trajflow/connectors/kafka"
)

// Baseline clients (Config.Baselines).
const (
	ClientKafkaGo = "kafka-go"
	ClientFranzGo = "franz-go"
)

// franzProducerOpts are the franz-go baseline producer's options: acks=all,
// linger 2 ms and no compression, as the operators' kafka-go writer
// (franz-go compresses with snappy unless told otherwise, which made its
// row measure snappy's CPU beside the clients' and the broker's).
func franzProducerOpts(addr []string, topic string, maxBytes int32) []kgo.Opt {
	return []kgo.Opt{kgo.SeedBrokers(addr...), kgo.Dialer(kafka.Dial), kgo.DefaultProduceTopic(topic),
		kgo.RequiredAcks(kgo.AllISRAcks()), kgo.ProducerLinger(2 * time.Millisecond), kgo.ProducerBatchMaxBytes(maxBytes),
		kgo.BrokerMaxWriteBytes(2 * maxBytes), kgo.ProducerBatchCompression(kgo.NoCompression())}
}

// baselineFranz measures franz-go produce→consume of the same pre-encoded
// messages as the kafka-go baseline, on topic for d: one producing client
// (franzProducerOpts), one consumer-group
// client (auto-commit every 200 ms, as the kafka-go baseline's commit
// loop), the same bound on produced-but-unconsumed bytes, no operator work.
func (r *run) baselineFranz(ctx context.Context, topic string, d time.Duration) (*Baseline, error) {
	if r.cfg.Client.TLS.Enable || r.cfg.Client.SASL.Mechanism != "" {
		return nil, errors.New("bench: the franz-go baseline supports plaintext brokers only (no TLS/SASL client settings)")
	}
	msgs, mean, err := r.baselineMessages()
	if err != nil {
		return nil, err
	}
	maxBytes := int32(kafka.WriterBatchBytes(r.cfg.Contract.Topics.MaxMessageBytes))
	fetchBytes := int32(r.cfg.Contract.Topics.MaxMessageBytes + (1 << 20))
	prod, err := kgo.NewClient(franzProducerOpts(r.addr, topic, maxBytes)...)
	if err != nil {
		return nil, fmt.Errorf("bench: franz-go producer: %w", err)
	}
	defer prod.Close()
	cons, err := kgo.NewClient(kgo.SeedBrokers(r.addr...), kgo.Dialer(kafka.Dial), kgo.ConsumerGroup(topic+".franz"), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(kafka.FetchMaxWait),
		kgo.FetchMaxBytes(fetchBytes), kgo.FetchMaxPartitionBytes(fetchBytes), kgo.BrokerMaxReadBytes(2*fetchBytes),
		kgo.AutoCommitInterval(200*time.Millisecond))
	if err != nil {
		return nil, fmt.Errorf("bench: franz-go consumer: %w", err)
	}
	defer cons.Close()

	slots := make(chan struct{}, max(int((32<<20)/mean), 8))
	tokOf := map[string]int64{}
	for _, m := range msgs {
		tokOf[string(m.key)] = m.tokens
	}
	var consumed, consumedMsgs, consumedTok atomic.Int64
	var perr atomic.Value
	cctx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // producer
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-cctx.Done():
				return
			case slots <- struct{}{}:
			}
			m := msgs[i%len(msgs)]
			prod.Produce(cctx, &kgo.Record{Key: m.key, Value: m.value}, func(_ *kgo.Record, err error) {
				if err != nil && cctx.Err() == nil {
					perr.Store(err)
				}
			})
		}
	}()
	go func() { // consumer
		defer wg.Done()
		for cctx.Err() == nil {
			fs := cons.PollFetches(cctx)
			if err := fs.Err0(); err != nil && !errors.Is(err, context.Canceled) {
				perr.Store(err)
				return
			}
			fs.EachRecord(func(rec *kgo.Record) {
				consumed.Add(int64(len(rec.Value) + len(rec.Key)))
				consumedMsgs.Add(1)
				consumedTok.Add(tokOf[string(rec.Key)])
				select {
				case <-slots:
				case <-cctx.Done():
				}
			})
		}
	}()
	wait := func(total time.Duration) error {
		start := time.Now()
		for time.Since(start) < total {
			if err, _ := perr.Load().(error); err != nil {
				return fmt.Errorf("bench: franz-go baseline: %w", err)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(250 * time.Millisecond):
			}
			if r.cfg.Progress != nil {
				r.cfg.Progress(Progress{Phase: "baseline", Elapsed: time.Since(start), Total: total})
			}
		}
		return nil
	}
	finish := func(err error) (*Baseline, error) {
		stop()
		wg.Wait()
		return nil, err
	}
	if err := wait(min(d/4, 2*time.Second)); err != nil {
		return finish(err)
	}
	for deadline := time.Now().Add(30 * time.Second); consumedMsgs.Load() == 0 && time.Now().Before(deadline); {
		if err := wait(250 * time.Millisecond); err != nil {
			return finish(err)
		}
	}
	prof, err := startWindowProfile(r.cfg.CPURoles)
	if err != nil {
		return finish(err)
	}
	b0, m0, k0, t0, c0 := consumed.Load(), consumedMsgs.Load(), consumedTok.Load(), time.Now(), r.cpu()
	err = wait(d)
	b1, m1, k1, secs, cpu := consumed.Load(), consumedMsgs.Load(), consumedTok.Load(), time.Since(t0).Seconds(), (r.cpu() - c0).Seconds()
	roles, profErr := prof.stop()
	stop()
	wg.Wait()
	if err = errors.Join(err, profErr); err != nil {
		return nil, err
	}
	if m1 == m0 {
		return nil, fmt.Errorf("bench: franz-go baseline consumed nothing in %v", d)
	}
	return &Baseline{
		Seconds: secs, Messages: m1 - m0, Bytes: b1 - b0,
		MBPerS: float64(b1-b0) / secs / 1e6, RecordsPerS: float64(m1-m0) / secs,
		MeanMsgBytes: mean, TokensPerS: float64(k1-k0) / secs,
		CPUCores: cpu / secs, MBPerCPUS: float64(b1-b0) / max(cpu, 1e-9) / 1e6, Client: ClientFranzGo,
		CPUByRole: roleTable(roles, b1-b0),
	}, nil
}
