// Package kafka connects trajflow to Kafka through github.com/segmentio/kafka-go:
// client configuration (brokers, client id, TLS, SASL) for kafka.Reader,
// kafka.Writer and kafka.Client; idempotent topic administration with
// explicit max.message.bytes; and an embedded single-node Kafka-protocol
// broker (github.com/twmb/franz-go/pkg/kfake) for `trajflow demo` and tests.
//
// Using kafka-go with trajflow topics: set kafka.Writer.BatchBytes to the
// topic's max.message.bytes (kafka-go's default of 1 MiB rejects larger
// messages locally with kafka.MessageTooLargeError), and RequiredAcks to
// kafka.RequireAll; outputs are acknowledged before input offsets are
// committed (DESIGN "Guarantees"). WriterBatchBytes gives a safe value.
package kafka
