package kafka

import "time"

// FetchMaxWait is the MaxWait of every kafka-go reader of the project: the
// longest a fetch waits on the broker when no new record is there. Records
// still come back as soon as they exist (MinBytes 1); MaxWait only bounds
// an empty fetch.
//
// Why not shorter: kafka-go's reader sets its connection's read deadline
// MaxWait after the fetch request and asks the broker to wait a quarter
// less (below one second of MaxWait). The broker's empty reply therefore
// arrives within a quarter of MaxWait of the deadline, and a broker that is
// busy for longer (building a large fetch response, a collector pause)
// makes the read time out; the reader then closes the connection, dials
// again and backs off for 100 ms to 1 s. 500 ms leaves a 125 ms margin; the
// reconnects shorter waits caused under load are measured in
// bench/RESULTS.md ("Readers wait up to 500 ms for an empty fetch").
// The price is a slower Close: a reader waits for its fetch in flight.
const FetchMaxWait = 500 * time.Millisecond

// MetadataTTL is how often a kafka-go Transport of the project refreshes
// its cached cluster metadata (kafka-go's default is 6 s; each refresh
// comes after a random fraction of it). A writer routes every produce by
// that cache, so after a partition leader moves its writes fail (the
// runtime retries them in place) until the next refresh names the new
// leader: the TTL bounds that time, at the cost of one metadata request
// per TTL on average.
const MetadataTTL = time.Second

// ProduceTimeout is the WriteTimeout (and ReadTimeout) of the runtime's
// kafka-go writer: how long one produce request may wait for the broker's
// answer before the writer gives up on it and retries the batch in place
// (kafka-go's default is 10 s; Kafka's Java producer waits 30 s).
//
// Why it matters: a broker that hangs without closing its connections (a
// stopped JVM, a frozen VM) answers nothing, and a produce sent to it waits
// out the whole timeout even after the cluster has fenced the broker
// (broker.session.timeout.ms, 5 s in deploy/local/cluster.sh, 9 s by
// default) and moved its leaderships, so the loop's stall after a hang is
// about the fence plus this timeout: 15 s with kafka-go's 10 s, 7-10 s with
// 4 s (TestFaultsPauseBroker, integration/REPORT.md). Why not shorter: a produce with acks=all waits for
// the in-sync replicas, and on a loaded machine a large batch (a packed
// batch is tens of MB) can take seconds; a request timed out after the
// broker took it is written twice, which the stages absorb (records are
// deduplicated by id), but each retry sends the batch again.
const ProduceTimeout = 4 * time.Second
