"""Kafka plumbing over confluent-kafka (librdkafka): acknowledged produces,
tail scans without a consumer group (pipeline.ScanTail), and a
manually-committing consumer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

MAX_MESSAGE_BYTES = 64 << 20


class DeliveryError(RuntimeError):
    """A record the broker did not acknowledge within the producer's
    retries and timeout."""


@dataclass
class Message:
    topic: str
    partition: int
    offset: int
    key: Optional[bytes]
    value: bytes
    headers: list

    @property
    def ref(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}"


def _msg(m) -> Message:
    return Message(m.topic(), m.partition(), m.offset(), m.key(), m.value() or b"", list(m.headers() or []))


def base_config(brokers: str, extra: Optional[dict] = None) -> dict:
    # No client telemetry push (KIP-714): it only logs noise against brokers
    # that do not take it.
    c = {"bootstrap.servers": brokers, "socket.keepalive.enable": True, "enable.metrics.push": False}
    c.update(extra or {})
    return c


# The producer compression codecs (Kafka's compression.type names), as
# connectors/kafka CompressionCodecs.
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


class AckProducer:
    """Producer whose send waits for the broker's acknowledgement (acks=all);
    librdkafka retries transient failures until message.timeout.ms.

    compression maps full topic names to a codec (none, gzip, snappy, lz4,
    zstd: the contract's topics.compression); other topics go uncompressed.
    librdkafka compresses per producer, so each codec gets its own."""

    def __init__(self, brokers: str, extra: Optional[dict] = None, timeout_s: float = 60.0,
                 compression: Optional[dict] = None):
        self.cfg = base_config(brokers, extra)
        self.cfg.update({"acks": "all", "linger.ms": 1, "message.max.bytes": MAX_MESSAGE_BYTES,
                         "message.timeout.ms": int(timeout_s * 1000), "enable.idempotence": False})
        self.compression = dict(compression or {})
        for topic, codec in self.compression.items():
            if codec not in CODECS:
                raise ValueError(f"compression of {topic}: {codec!r} is not one of {', '.join(CODECS)}")
        self.producers: dict = {}
        self.p = self._producer(self.cfg.get("compression.type", "none"))
        self.timeout_s = timeout_s

    def _producer(self, codec: str) -> Producer:
        if codec not in self.producers:
            self.producers[codec] = Producer(dict(self.cfg, **{"compression.type": codec}))
        return self.producers[codec]

    def _of(self, topic: str) -> Producer:
        codec = self.compression.get(topic)
        return self.p if codec is None else self._producer(codec)

    def send(self, records: Iterable[tuple[str, Optional[bytes], bytes, list]]) -> None:
        """Produces every (topic, key, value, headers) and returns once all
        are acknowledged; raises DeliveryError otherwise."""
        errors: list = []
        pending = [0]

        def done(err, msg):
            pending[0] -= 1
            if err is not None:
                errors.append(f"{msg.topic()}: {err}")

        used = []
        for topic, key, value, hdrs in records:
            p = self._of(topic)
            if p not in used:
                used.append(p)
            while True:
                try:
                    p.produce(topic, value=value, key=key, headers=hdrs, on_delivery=done)
                    pending[0] += 1
                    break
                except BufferError:
                    p.poll(0.1)
        deadline = time.monotonic() + self.timeout_s + 5
        while pending[0] > 0:
            if time.monotonic() > deadline:
                raise DeliveryError(f"{pending[0]} records not acknowledged")
            for p in used:
                p.flush(0.5 / len(used))
        if errors:
            raise DeliveryError("; ".join(errors))

    def close(self) -> None:
        for p in self.producers.values():
            p.flush(10)


def scan(brokers: str, topic: str, fn: Callable[[Message], None], extra: Optional[dict] = None,
         last: int = 0, timeout_s: float = 60.0) -> int:
    """Calls fn for every record of every partition of topic up to the end
    offset at the start of the scan (the last `last` records per partition
    when last > 0), partition by partition in offset order. No consumer
    group, nothing committed. Returns the number of records read."""
    cfg = base_config(brokers, extra)
    cfg.update({"group.id": "trajflow-scan", "enable.auto.commit": False, "auto.offset.reset": "earliest",
                "fetch.max.bytes": MAX_MESSAGE_BYTES + (1 << 20),
                "max.partition.fetch.bytes": MAX_MESSAGE_BYTES + (1 << 20)})
    c = Consumer(cfg)
    n = 0
    try:
        md = c.list_topics(topic, timeout=timeout_s)
        t = md.topics.get(topic)
        if t is None or t.error is not None:
            raise KafkaException(t.error if t is not None else KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
        for p in sorted(t.partitions):
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            start = lo if last <= 0 else max(lo, hi - last)
            if start >= hi:
                continue
            c.assign([TopicPartition(topic, p, start)])
            deadline = time.monotonic() + timeout_s
            nxt = start
            while nxt < hi:
                m = c.poll(0.5)
                if m is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"scan {topic}/{p}: no record at {nxt} (end {hi})")
                    continue
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(m.error())
                deadline = time.monotonic() + timeout_s
                nxt = m.offset() + 1
                fn(_msg(m))
                n += 1
            c.unassign()
    finally:
        c.close()
    return n


class AssignedConsumer:
    """Reads every partition of a topic by direct assignment, starting at
    the offsets committed for group_id, and commits to that group manually
    and synchronously (enable.auto.commit false).

    No group membership: a restarted process (after kill -9) resumes at
    once, instead of waiting for the dead member's session and the group's
    rebalance timeout. The cost is that nothing fences a second instance;
    run one trainer per run. (A Go train operator active in the same group
    makes this consumer's commits fail: the coordinator rejects commits
    without a generation while the group has members.)"""

    def __init__(self, brokers: str, group_id: str, topic: str, extra: Optional[dict] = None, timeout_s: float = 60.0):
        cfg = base_config(brokers, extra)
        cfg.update({"group.id": group_id, "enable.auto.commit": False, "enable.auto.offset.store": False,
                    "auto.offset.reset": "earliest",
                    "fetch.max.bytes": MAX_MESSAGE_BYTES + (1 << 20),
                    "max.partition.fetch.bytes": MAX_MESSAGE_BYTES + (1 << 20)})
        self.c = Consumer(cfg)
        md = self.c.list_topics(topic, timeout=timeout_s)
        t = md.topics.get(topic)
        if t is None or t.error is not None:
            raise KafkaException(t.error if t is not None else KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
        parts = [TopicPartition(topic, p) for p in sorted(t.partitions)]
        try:
            committed = self.c.committed(parts, timeout=timeout_s)
        except KafkaException as e:
            # A group that never committed does not exist yet (some brokers
            # say so instead of returning no offset).
            if e.args[0].code() != KafkaError.GROUP_ID_NOT_FOUND:
                raise
            committed = [TopicPartition(tp.topic, tp.partition, -1001) for tp in parts]
        start = []
        for tp in committed:
            if tp.error is not None:
                raise KafkaException(tp.error)
            lo, _ = self.c.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=timeout_s)
            start.append(TopicPartition(topic, tp.partition, tp.offset if tp.offset >= 0 else lo))
        self.start_offsets = {tp.partition: tp.offset for tp in start}
        self.c.assign(start)

    def poll(self, timeout_s: float) -> Optional[Message]:
        m = self.c.poll(timeout_s)
        if m is None:
            return None
        if m.error():
            if m.error().code() == KafkaError._PARTITION_EOF or not m.error().fatal():
                return None
            raise KafkaException(m.error())
        return _msg(m)

    def commit(self, m: Message) -> None:
        """Commits the offset after m, synchronously (retried)."""
        for attempt in range(10):
            try:
                self.c.commit(offsets=[TopicPartition(m.topic, m.partition, m.offset + 1)], asynchronous=False)
                return
            except KafkaException as e:
                if attempt == 9 or not e.args[0].retriable():
                    raise
                time.sleep(0.2 * (attempt + 1))

    def close(self) -> None:
        self.c.close()
