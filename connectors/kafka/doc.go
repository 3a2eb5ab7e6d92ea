// Package kafka connects trajflow to Kafka through github.com/segmentio/kafka-go:
// client configuration (brokers, client id, TLS, SASL) for kafka.Reader,
// kafka.Writer and kafka.Client; idempotent topic administration with an
// explicit max.message.bytes; a check for records deleted before a consumer
// group read them; and an embedded single-node Kafka-protocol broker
// (github.com/twmb/franz-go/pkg/kfake) for `trajflow demo` and tests.
//
// # Using kafka-go with trajflow topics
//
// These rules follow from how kafka-go v0.4.51 behaves; the package tests
// pin each of them against the embedded broker.
//
//   - Writers: RequiredAcks kafka.RequireAll, and BatchBytes =
//     WriterBatchBytes(max.message.bytes). kafka-go's default BatchBytes of
//     1 MiB rejects larger messages before any I/O with
//     kafka.MessageTooLargeError; a BatchBytes above the topic limit lets
//     kafka-go build a batch the broker rejects with MESSAGE_TOO_LARGE,
//     which fails every message of that batch. Use IsMessageTooLarge on
//     each element of the returned kafka.WriteErrors (which does not unwrap)
//     to route an over-size record to quarantine.
//   - Readers: consumer-group readers (GroupID) with CommitInterval 0 and
//     explicit CommitMessages. SessionTimeout must be at least
//     MinGroupSessionTimeout, or the group never forms and FetchMessage
//     blocks. Delivery is at-least-once: a rebalance or a broker restart can
//     deliver a message again (also to the same reader), so consumers
//     deduplicate by record id (DESIGN "Guarantees").
//   - CommitMessages is not retried by kafka-go when its connection breaks
//     (for example across a broker restart); retry it.
//   - A reader whose committed offset lies below the log start offset
//     (retention deleted unread records) silently continues at the log start;
//     GroupGaps detects this.
//   - A message larger than ReaderConfig.MaxBytes is still delivered (the
//     broker returns at least one whole batch).
//   - A kafka.Client or Transport that outlives a broker restart can fail its
//     next few requests with io.ErrUnexpectedEOF while its pooled
//     connections are replaced (seen for OffsetFetch); retry. The admin
//     functions of this package use a fresh Transport per call.
package kafka
