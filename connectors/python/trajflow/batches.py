"""Packed batches from the batches topic: decoding and the Kafka reader.

One Kafka message is one Arrow IPC stream (schema, one record batch, end of
stream) of kind ``packed_batch`` (schemas/packed.go): one Arrow row per
packed row, the batch-level columns repeated on every row. The kind and
version travel twice, in the Arrow schema metadata (``trajflow.kind``,
``trajflow.version``) and in the Kafka headers (``trajflow-kind``,
``trajflow-version``); :func:`decode_packed_batch` requires both to name
``packed_batch`` version 1.

Refusals carry the reason codes of the Go runtime (operators/stagekit and
the train stage, gpu/stage.go): ``undecodable``, ``wrong_kind``,
``unknown_version``, ``empty_message``, ``untrainable_batch``. A refused
message goes to the quarantine topic with the original key, value and
headers plus ``trajflow-reason``, ``trajflow-detail``, ``trajflow-stage``,
``trajflow-source-topic``/``-partition``/``-offset`` (pipeline/stage.go
QuarantineRecord), and its offset is committed only after the quarantine
record is acknowledged.

Copies. The per-token columns of a decoded batch are numpy views of the
message bytes (``np.frombuffer`` over the Arrow values buffer: no copy) —
``input_ids``, ``position_ids``, ``segment_ids``, ``old_logprobs``,
``ref_logprobs``, ``advantages``, ``value_targets``, ``turn_ids``,
``policy_versions`` and the segment-level numeric lists — and
:meth:`PackedBatch.tensor` wraps such a view with ``torch.from_numpy``
(no copy either; the tensor is read-only in spirit: the bytes are the
message's). Exactly these are copied: ``action_mask`` (uint8, one byte per
token), because the trainer masks duplicate and stale segments in place;
``segment_truncated`` (Arrow packs booleans as bits, numpy needs bytes); the
string lists (trajectory and group ids, Python ``str``); a values buffer
whose address is not aligned to its element size (Arrow IPC aligns buffers
to 8 bytes within the message, so this happens only if the message itself
is misaligned) — ``view_copies`` counts them. ``ref_logprobs`` of a null
row is ``None``.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import pyarrow as pa

KIND = "packed_batch"
VERSION = 1
META_KIND = b"trajflow.kind"
META_VERSION = b"trajflow.version"
HEADER_KIND = "trajflow-kind"
HEADER_VERSION = "trajflow-version"
HEADER_ID = "trajflow-id"
HEADER_WINDOW_COST = "trajflow-window-cost"

REASON_UNDECODABLE = "undecodable"
REASON_WRONG_KIND = "wrong_kind"
REASON_UNKNOWN_VERSION = "unknown_version"
REASON_EMPTY = "empty_message"
REASON_UNTRAINABLE = "untrainable_batch"
REASON_CONTRACT_MISMATCH = "contract_mismatch"
REASON_DUPLICATE_BATCH = "duplicate_batch"
REASON_HEADER_MISMATCH = "header_mismatch"
REASON_STALE_BATCH = "stale_batch"


class Refusal(Exception):
    """A message the trainer refuses: it goes to quarantine with reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"refused: {reason}: {detail}")
        self.reason, self.detail = reason, detail


_BATCH_COLS = [("batch_id", pa.string()), ("batch_index", pa.int64()), ("run_id", pa.string()),
               ("contract_hash", pa.string()), ("trainer_version", pa.int64()), ("token_budget", pa.int32())]
_TOKEN_COLS = [("input_ids", pa.int32()), ("position_ids", pa.int32()), ("segment_ids", pa.int32()),
               ("action_mask", pa.uint8()), ("old_logprobs", pa.float32()), ("ref_logprobs", pa.float32()),
               ("advantages", pa.float32()), ("value_targets", pa.float32()), ("turn_ids", pa.int32()),
               ("policy_versions", pa.int32())]
_SEG_COLS = [("segment_trajectory_ids", pa.string()), ("segment_group_ids", pa.string()),
             ("segment_policy_versions", pa.int64()), ("segment_lengths", pa.int32()),
             ("segment_weights", pa.float32()), ("segment_truncated", pa.bool_())]
_NULLABLE = {"ref_logprobs"}
# Columns the trainer modifies in place, or that numpy cannot view.
_COPIED = {"action_mask", "segment_truncated"}


@dataclass
class PackedRow:
    """One packed row (schemas.PackedRow); see the module docstring for
    which arrays are views."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    action_mask: np.ndarray
    old_logprobs: np.ndarray
    ref_logprobs: Optional[np.ndarray]
    advantages: np.ndarray
    value_targets: np.ndarray
    turn_ids: np.ndarray
    policy_versions: np.ndarray
    segment_trajectory_ids: list[str]
    segment_group_ids: list[str]
    segment_policy_versions: np.ndarray
    segment_lengths: np.ndarray
    segment_weights: np.ndarray
    segment_truncated: np.ndarray


@dataclass
class PackedBatch:
    batch_id: str
    batch_index: int
    run_id: str
    contract_hash: str
    trainer_version: int
    token_budget: int
    rows: list[PackedRow]
    # Per-token column values of all rows back to back (views, or the
    # copies named in the module docstring) and the row offsets into them.
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    row_offsets: Optional[np.ndarray] = None
    view_copies: int = 0

    def tensor(self, name: str):
        """torch.from_numpy of a per-token column over all rows (a view of
        the same memory; no copy)."""
        import torch
        with warnings.catch_warnings():
            # The message bytes are immutable: torch warns that the view is
            # not writable. Callers must not write into it.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.columns[name])


def _values_view(values: pa.Array, dtype) -> tuple[np.ndarray, bool]:
    """numpy view of a primitive Arrow array's values (no copy when the
    buffer is aligned); returns (array, copied)."""
    buf = values.buffers()[1]
    itemsize = np.dtype(dtype).itemsize
    n = len(values)
    if buf is None or n == 0:
        return np.zeros(0, dtype=dtype), False
    start = values.offset * itemsize
    if buf.size < start + n * itemsize:
        raise Refusal(REASON_UNDECODABLE, "values buffer shorter than its length")
    if (buf.address + start) % itemsize:
        return np.frombuffer(buf.to_pybytes()[start:start + n * itemsize], dtype=dtype).copy(), True
    return np.frombuffer(buf, dtype=dtype, count=n, offset=start), False


def _header(headers: Optional[Iterable], key: str) -> Optional[bytes]:
    for k, v in headers or ():
        if k == key:
            return v if isinstance(v, bytes) else (v.encode() if v is not None else b"")
    return None


_EPISODE_COST = (("episodes", int), ("rollout_tokens", int), ("generation_hours", float), ("environment_hours", float))
_COST_PARTS = ("admitted", "filtered", "failed")


def _zero_cost() -> dict:
    return {k: typ(0) for k, typ in _EPISODE_COST}


def _add_episodes(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k, _ in _EPISODE_COST}


def add_window_cost(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """The sum of two window costs (schemas.WindowCost.Add); None when both are."""
    if a is None or b is None:
        return a if b is None else b
    return {"windows": a["windows"] + b["windows"], **{p: _add_episodes(a[p], b[p]) for p in _COST_PARTS}}


def refused_cost(w: dict) -> dict:
    """The cost of a batch the trainer refused whole
    (schemas.WindowCost.Refused): what it admitted joins its failed
    generation, what it filtered stays rejected."""
    return {"windows": w["windows"], "admitted": _zero_cost(), "filtered": dict(w["filtered"]),
            "failed": _add_episodes(w["failed"], w["admitted"])}


def window_cost(headers) -> Optional[dict]:
    """The batch's ``trajflow-window-cost`` header (schemas.WindowCost: the
    cost of the episodes decided in the pack windows of its index,
    admitted, filtered and failed), or None without one. A malformed value raises
    Refusal(header_mismatch) naming the header and the field, as the Go
    trainer refuses it (schemas.DecodeWindowCost)."""
    raw = _header(headers, HEADER_WINDOW_COST)
    if raw is None:
        return None

    def bad(what: str):
        return Refusal(REASON_HEADER_MISMATCH, f"header {HEADER_WINDOW_COST}: {what}")

    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(str(e)) from None
    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    unknown = set(doc) - {"windows", *_COST_PARTS}
    if unknown:
        raise bad(f"unknown field {sorted(unknown)[0]!r}")
    windows = doc.get("windows", 0)
    if not isinstance(windows, int) or isinstance(windows, bool) or windows < 0:
        raise bad(f"windows {windows!r} not a non-negative integer")
    out = {"windows": windows}
    for part in _COST_PARTS:
        src = doc.get(part, {})
        if not isinstance(src, dict):
            raise bad(f"{part} not a JSON object")
        unknown = set(src) - {k for k, _ in _EPISODE_COST}
        if unknown:
            raise bad(f"{part}: unknown field {sorted(unknown)[0]!r}")
        cost = {}
        for key, typ in _EPISODE_COST:
            v = src.get(key, 0)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (typ is float or isinstance(v, int))
            if not ok or v < 0 or not math.isfinite(v):
                raise bad(f"{part}.{key} {v!r} not a finite non-negative {'integer' if typ is int else 'number'}")
            cost[key] = typ(v)
        out[part] = cost
    return out


def update_cost(wcost: Optional[dict], optimizer_tokens: int, step_seconds: float) -> dict:
    """An update record's cost ledger (schemas.UpdateCost): the rollout,
    rejected and failed generation of the batch's windows (with the
    batches refused since the last update: add_window_cost, refused_cost),
    and the update's optimizer work in the contract's units."""
    zero = _zero_cost()
    w = wcost or {"windows": 0, "admitted": zero, "filtered": zero, "failed": zero}
    return {"windows": w["windows"], "rollout": dict(w["admitted"]), "rejected": dict(w["filtered"]),
            "failed": dict(w["failed"]), "training": {"optimizer_tokens": int(optimizer_tokens), "accelerator_hours": step_seconds / 3600}}


def check_headers(headers) -> None:
    """The Kafka headers must name packed_batch version 1."""
    k, v = _header(headers, HEADER_KIND), _header(headers, HEADER_VERSION)
    if k is None:
        raise Refusal(REASON_WRONG_KIND, f"no {HEADER_KIND} header (want {KIND!r})")
    if k.decode(errors="replace") != KIND:
        raise Refusal(REASON_WRONG_KIND, f"header {HEADER_KIND} {k.decode(errors='replace')!r}, want {KIND!r}")
    if v is None or v.decode(errors="replace") != str(VERSION):
        got = None if v is None else v.decode(errors="replace")
        raise Refusal(REASON_UNKNOWN_VERSION, f"header {HEADER_VERSION} {got!r}, this reader knows version {VERSION}")


def decode_packed_batch(value: bytes, headers=None, check_header: bool = True) -> PackedBatch:
    """Decodes one batches-topic message; raises Refusal with the Go
    reason codes (see the module docstring). check_header=False decodes a
    stream without Kafka headers (a file)."""
    if check_header:
        check_headers(headers)
    if not value:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: empty message value")
    src = pa.BufferReader(pa.py_buffer(value))
    try:
        reader = pa.ipc.open_stream(src)
        schema = reader.schema
    except (pa.ArrowException, OSError, ValueError) as e:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: schema: {e}") from None
    md = schema.metadata or {}
    kind = md.get(META_KIND, b"").decode(errors="replace")
    ver = md.get(META_VERSION, b"").decode(errors="replace")
    if kind != KIND:
        raise Refusal(REASON_WRONG_KIND, f"schemas: message kind {kind!r}, want {KIND!r}")
    if ver != str(VERSION):
        raise Refusal(REASON_UNKNOWN_VERSION, f"schemas: {KIND} version {ver!r} unknown (this build reads version {VERSION})")
    if check_header:
        hv = _header(headers, HEADER_VERSION).decode()
        if hv != ver:
            raise Refusal(REASON_UNKNOWN_VERSION, f"header version {hv!r} and schema version {ver!r} disagree")
    try:
        rb = reader.read_next_batch()
    except StopIteration:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: stream has no record batch") from None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: record batch: {e}") from None
    try:
        reader.read_next_batch()
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: stream has more than one record batch")
    except StopIteration:
        pass
    except (pa.ArrowException, OSError, ValueError) as e:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: after the record batch: {e}") from None
    if src.tell() != len(value):
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: {len(value) - src.tell()} trailing bytes after the stream")
    try:
        rb.validate(full=True)
    except (pa.ArrowException, ValueError) as e:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: invalid record batch: {e}") from None
    return _from_record(rb)


def _column(rb: pa.RecordBatch, name: str, typ) -> pa.Array:
    idx = rb.schema.get_all_field_indices(name)
    if len(idx) != 1:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: column {name!r} found {len(idx)} times")
    col = rb.column(idx[0])
    if pa.types.is_list(typ):
        ok = pa.types.is_list(col.type) and col.type.value_type == typ.value_type
    else:
        ok = col.type == typ
    if not ok:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: column {name!r} has type {col.type}, want {typ}")
    if col.null_count and name not in _NULLABLE:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: column {name!r} has {col.null_count} nulls")
    if pa.types.is_list(typ) and col.values.null_count:
        raise Refusal(REASON_UNDECODABLE, f"{KIND}: column {name!r} has null list items")
    return col


def _from_record(rb: pa.RecordBatch) -> PackedBatch:
    n = rb.num_rows
    hdr = {}
    for name, typ in _BATCH_COLS:
        vals = _column(rb, name, typ).to_pylist()
        if n and any(v != vals[0] for v in vals):
            raise Refusal(REASON_UNDECODABLE, f"{KIND}: batch-level column {name!r} is not constant over the rows")
        hdr[name] = vals[0] if n else None
    lists = {}
    for name, typ in _TOKEN_COLS + _SEG_COLS:
        lists[name] = _column(rb, name, pa.list_(typ))
    if n == 0:
        raise Refusal(REASON_EMPTY, f"{KIND} message with no rows")
    copies = 0
    columns: dict[str, np.ndarray] = {}
    offsets: dict[str, np.ndarray] = {}
    for name, typ in _TOKEN_COLS + _SEG_COLS:
        col = lists[name]
        offs = np.asarray(col.offsets)  # n+1 offsets into the flattened values
        offsets[name] = offs
        if typ == pa.string():
            continue
        if typ == pa.bool_():
            columns[name] = np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=bool)
            continue
        vals = col.values
        arr, copied = _values_view(vals, typ.to_pandas_dtype())
        copies += copied
        if name in _COPIED:
            arr = arr.copy()
        columns[name] = arr
    rows = []
    ref_valid = lists["ref_logprobs"].is_valid().to_numpy(zero_copy_only=False)
    strs = {name: lists[name].to_pylist() for name, typ in _SEG_COLS if typ == pa.string()}
    base = offsets["input_ids"][0]
    for i in range(n):
        def seg(name):
            o = offsets[name]
            b0 = offsets[name][0]
            return columns[name][o[i] - b0:o[i + 1] - b0]
        rows.append(PackedRow(
            input_ids=seg("input_ids"), position_ids=seg("position_ids"), segment_ids=seg("segment_ids"),
            action_mask=seg("action_mask"), old_logprobs=seg("old_logprobs"),
            ref_logprobs=seg("ref_logprobs") if ref_valid[i] else None,
            advantages=seg("advantages"), value_targets=seg("value_targets"), turn_ids=seg("turn_ids"),
            policy_versions=seg("policy_versions"),
            segment_trajectory_ids=strs["segment_trajectory_ids"][i], segment_group_ids=strs["segment_group_ids"][i],
            segment_policy_versions=seg("segment_policy_versions"), segment_lengths=seg("segment_lengths"),
            segment_weights=seg("segment_weights"), segment_truncated=seg("segment_truncated"),
        ))
    b = PackedBatch(rows=rows, columns=columns, row_offsets=offsets["input_ids"] - base, view_copies=copies, **hdr)
    return b


def check_rows(batch: PackedBatch, token_budget: int = 0) -> None:
    """The shape rules of the Go trainer (gpu/trainer.go checkRow, model
    CheckPositions, the train stage's token budget) plus the segment-level
    lists: every per-token column the update reads has the length of
    input_ids, a row holds at most token_budget tokens (the contract's
    packing.token_budget; 0: unchecked), positions restart at 0 at every
    segment, and there is one trajectory id per segment. Raises
    Refusal(untrainable_batch)."""
    from .model import check_positions, ShapeError
    for ri, r in enumerate(batch.rows):
        n = len(r.input_ids)
        if n == 0:
            raise Refusal(REASON_UNTRAINABLE, f"batch {batch.batch_id} row {ri}: empty row")
        if 0 < token_budget < n:
            raise Refusal(REASON_UNTRAINABLE,
                          f"batch {batch.batch_id} row {ri}: {n} tokens, over packing.token_budget {token_budget}")
        for name in ("position_ids", "segment_ids", "action_mask", "old_logprobs", "advantages", "policy_versions"):
            if len(getattr(r, name)) != n:
                raise Refusal(REASON_UNTRAINABLE, f"batch {batch.batch_id} row {ri}: {len(getattr(r, name))} {name} for {n} input ids")
        if r.ref_logprobs is not None and len(r.ref_logprobs) != n:
            raise Refusal(REASON_UNTRAINABLE, f"batch {batch.batch_id} row {ri}: {len(r.ref_logprobs)} ref_logprobs for {n} input ids")
        try:
            check_positions(r.position_ids, r.segment_ids)
        except ShapeError as e:
            raise Refusal(REASON_UNTRAINABLE, f"batch {batch.batch_id} row {ri}: {e}") from None
        nseg = int(r.segment_ids.max()) + 1
        if r.segment_ids.min() < 0 or nseg > n:
            raise Refusal(REASON_UNTRAINABLE, f"batch {batch.batch_id} row {ri}: segment ids outside [0, {n})")
        if len(r.segment_trajectory_ids) != nseg:
            raise Refusal(REASON_UNTRAINABLE, f"batch {batch.batch_id} row {ri}: {len(r.segment_trajectory_ids)} segment trajectory ids for {nseg} segments")


def quarantine_record(topic: str, stage: str, m, reason: str, detail: str):
    """pipeline.QuarantineRecord for a kafka.Message m: original key, value
    and headers, then trajflow-reason, -detail, -stage and the source topic,
    partition and offset. Returns (topic, key, value, headers)."""
    hs = list(m.headers) + [
        ("trajflow-reason", reason.encode()), ("trajflow-detail", detail.encode()),
        ("trajflow-stage", stage.encode()), ("trajflow-source-topic", m.topic.encode()),
        ("trajflow-source-partition", str(m.partition).encode()),
        ("trajflow-source-offset", str(m.offset).encode()),
    ]
    return (topic, m.key, m.value, hs)


class BatchReader:
    """Reads decoded packed batches from a batches topic with confluent-kafka
    and manual offset commits.

        r = BatchReader("127.0.0.1:9092", "demo.batches", "demo.quarantine", group="demo.train")
        while (got := r.next(timeout_s=1.0)) is not None or True:
            if got is None: continue
            msg, batch = got
            ...train, make the result durable...
            r.commit(msg)

    A message that does not decode (see decode_packed_batch) never reaches
    the caller: it goes to the quarantine topic with the Go runtime's
    headers, and its offset is committed once the quarantine record is
    acknowledged (acks=all). Offsets of delivered batches are committed
    only by the caller (commit), after its own outputs are durable; the
    reader hands out one batch at a time (next raises until the previous
    one is committed), so a quarantine commit never moves the group's offset
    past a batch the caller has not finished.

    compression, when given, maps full topic names to the producer codec of
    the contract's topics.compression (the quarantine records follow it);
    the batches themselves are decompressed by confluent-kafka, whatever
    codec pack used."""

    def __init__(self, brokers: str, topic: str, quarantine_topic: str, group: str, stage: str = "train",
                 extra: Optional[dict] = None, compression: Optional[dict] = None):
        from .kafka import AckProducer, AssignedConsumer
        self.consumer = AssignedConsumer(brokers, group, topic, extra)
        self.producer = AckProducer(brokers, extra, compression=compression)
        self.quarantine_topic, self.stage = quarantine_topic, stage
        self.refused: list = []
        self.pending = None

    def next(self, timeout_s: float = 1.0):
        """(message, PackedBatch) of the next decodable batch, or None when
        none arrived within timeout_s."""
        if self.pending is not None:
            raise RuntimeError(f"commit the batch at {self.pending.ref} before reading the next one")
        m = self.consumer.poll(timeout_s)
        if m is None:
            return None
        try:
            b = decode_packed_batch(m.value, m.headers)
            self.pending = m
            return m, b
        except Refusal as r:
            self.quarantine(m, r.reason, r.detail)
            return None

    def quarantine(self, m, reason: str, detail: str) -> None:
        """Quarantines m (acknowledged), then commits its offset."""
        self.producer.send([quarantine_record(self.quarantine_topic, self.stage, m, reason, detail)])
        self.refused.append((m.offset, reason))
        self.consumer.commit(m)

    def commit(self, m) -> None:
        """Commits the delivered batch m (the offset after it)."""
        if self.pending is None or (m.partition, m.offset) != (self.pending.partition, self.pending.offset):
            raise RuntimeError(f"commit of {m.ref}, which is not the batch handed out")
        self.consumer.commit(m)
        self.pending = None

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


def encode_packed_batch(b: PackedBatch) -> tuple[bytes, list]:
    """The batches-topic message (value, headers) of a PackedBatch: one
    Arrow IPC stream of kind packed_batch version 1, the columns of
    schemas/packed.go (batch-level columns repeated on every row). For
    tests and tools that put batches on a topic without the Go packer;
    decode_packed_batch reads it back."""
    from .ids import headers as _headers
    n = len(b.rows)
    cols, fields = [], []
    for name, typ in _BATCH_COLS:
        cols.append(pa.array([getattr(b, name)] * n, type=typ))
        fields.append(pa.field(name, typ, nullable=False))
    for name, typ in _TOKEN_COLS + _SEG_COLS:
        vals = []
        for r in b.rows:
            v = getattr(r, name)
            if v is None:
                vals.append(None)
            elif typ == pa.string():
                vals.append([str(x) for x in v])
            elif typ == pa.bool_():
                vals.append([bool(x) for x in v])
            else:
                vals.append(np.asarray(v, dtype=typ.to_pandas_dtype()).tolist())
        lt = pa.list_(pa.field("item", typ, nullable=False))
        cols.append(pa.array(vals, type=lt))
        fields.append(pa.field(name, lt, nullable=name in _NULLABLE))
    schema = pa.schema(fields, metadata={META_KIND: KIND.encode(), META_VERSION: str(VERSION).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(pa.record_batch(cols, schema=schema))
    return sink.getvalue().to_pybytes(), _headers(KIND, b.batch_id)


def pack_segments(segments: list[dict], budget: int) -> list[PackedRow]:
    """Packs segments into rows of at most budget tokens, first fit in the
    given order (the Go packer sorts first; callers that want its exact
    layout pass segments in that order). Each segment is a dict with
    ``tokens`` (the whole stream), ``trained`` (input positions p whose token
    the policy sampled), ``logprobs`` (the behavior log-prob of each of
    them), ``advantage``, ``version`` (behavior version), ``trajectory_id``
    and ``group_id``. Columns are target-aligned: the token at position p is
    the target of entry p-1 (action_mask[p-1] = 1, old_logprobs[p-1] its
    log-prob)."""
    rows: list[list[dict]] = []
    for s in segments:
        if len(s["tokens"]) > budget:
            raise ValueError(f"segment {s['trajectory_id']} of {len(s['tokens'])} tokens exceeds the budget {budget}")
        for r in rows:
            if sum(len(x["tokens"]) for x in r) + len(s["tokens"]) <= budget:
                r.append(s)
                break
        else:
            rows.append([s])
    out = []
    for r in rows:
        T = sum(len(x["tokens"]) for x in r)
        ids, pos, seg = (np.zeros(T, np.int32) for _ in range(3))
        mask = np.zeros(T, np.uint8)
        old, adv, val = (np.zeros(T, np.float32) for _ in range(3))
        turn = np.full(T, -1, np.int32)
        ver = np.full(T, -1, np.int32)
        o = 0
        for k, s in enumerate(r):
            n = len(s["tokens"])
            ids[o:o + n] = s["tokens"]
            pos[o:o + n] = np.arange(n)
            seg[o:o + n] = k
            for p, lp in zip(s["trained"], s["logprobs"]):
                if not 1 <= p < n:
                    raise ValueError(f"segment {s['trajectory_id']}: trained position {p} outside [1, {n})")
                mask[o + p - 1] = 1
                old[o + p - 1] = lp
                adv[o + p - 1] = s["advantage"]
                turn[o + p - 1] = 0
                ver[o + p - 1] = s["version"]
            o += n
        out.append(PackedRow(
            input_ids=ids, position_ids=pos, segment_ids=seg, action_mask=mask, old_logprobs=old, ref_logprobs=None,
            advantages=adv, value_targets=val, turn_ids=turn, policy_versions=ver,
            segment_trajectory_ids=[s["trajectory_id"] for s in r], segment_group_ids=[s["group_id"] for s in r],
            segment_policy_versions=np.array([s["version"] for s in r], np.int64),
            segment_lengths=np.array([len(s["tokens"]) for s in r], np.int32),
            segment_weights=np.ones(len(r), np.float32), segment_truncated=np.zeros(len(r), bool)))
    return out
