"""Decoding of batches-topic messages: Go-encoded batches decode with
zero-copy views; every malformed message is refused with the reason code
of the Go runtime."""

import json
import numpy as np
import pyarrow as pa
import pytest

from conftest import PARITY
from trajflow import batches as B
from trajflow.ids import batch_id

GO = (PARITY / "seq-mean-token-sum-k3-loss" / "batch.arrows").read_bytes()
HDRS = [("trajflow-kind", b"packed_batch"), ("trajflow-version", b"1"), ("trajflow-id", b"x")]


def table(value=GO):
    return pa.ipc.open_stream(value).read_all()


def stream(t: pa.Table, metadata=None, batches=1) -> bytes:
    schema = t.schema.with_metadata(metadata if metadata is not None else t.schema.metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        for _ in range(batches):
            if t.num_rows:
                w.write_table(t.cast(schema))
            else:  # one record batch of zero rows
                w.write_batch(pa.record_batch([pa.array([], type=f.type) for f in schema], schema=schema))
    return sink.getvalue().to_pybytes()


def refused(value, headers=HDRS):
    with pytest.raises(B.Refusal) as e:
        b = B.decode_packed_batch(value, headers)
        B.check_rows(b)
    return e.value.reason


def test_row_over_token_budget_refused():
    b = B.decode_packed_batch(GO, HDRS)
    longest = max(len(r.input_ids) for r in b.rows)
    at = [len(r.input_ids) for r in b.rows].index(longest)
    B.check_rows(b, longest)  # at the budget: trainable
    with pytest.raises(B.Refusal) as e:
        B.check_rows(b, longest - 1)
    assert e.value.reason == B.REASON_UNTRAINABLE
    assert f"row {at}: {longest} tokens, over packing.token_budget {longest - 1}" in e.value.detail


def test_go_batch_decodes_with_views():
    b = B.decode_packed_batch(GO, HDRS)
    assert len(b.rows) == 3 and b.batch_index == 0
    assert b.batch_id == batch_id(b.run_id, b.batch_index)
    B.check_rows(b)
    msg = np.frombuffer(GO, dtype=np.uint8)
    for name in ("input_ids", "position_ids", "segment_ids", "old_logprobs", "ref_logprobs", "advantages",
                 "policy_versions", "segment_lengths"):
        assert np.shares_memory(b.columns[name], msg), name
        assert np.shares_memory(b.rows[1].__dict__[name] if name != "segment_lengths" else b.rows[1].segment_lengths, msg)
    assert not np.shares_memory(b.columns["action_mask"], msg)  # copied: masked in place
    assert b.view_copies == 0
    t = b.tensor("input_ids")
    assert t.data_ptr() == b.columns["input_ids"].ctypes.data
    # Rows are slices of the column values, in order.
    n = [len(r.input_ids) for r in b.rows]
    assert list(b.row_offsets) == list(np.cumsum([0] + n))
    assert all(r.ref_logprobs is not None for r in b.rows)


def test_headers_must_agree():
    assert refused(GO, []) == B.REASON_WRONG_KIND
    assert refused(GO, [("trajflow-kind", b"scored_trajectory"), ("trajflow-version", b"1")]) == B.REASON_WRONG_KIND
    assert refused(GO, [("trajflow-kind", b"packed_batch"), ("trajflow-version", b"2")]) == B.REASON_UNKNOWN_VERSION
    assert refused(GO, [("trajflow-kind", b"packed_batch")]) == B.REASON_UNKNOWN_VERSION


def test_schema_metadata_checked():
    t = table()
    md = dict(t.schema.metadata)
    assert refused(stream(t, {**md, b"trajflow.kind": b"scored_trajectory"})) == B.REASON_WRONG_KIND
    assert refused(stream(t, {**md, b"trajflow.version": b"2"})) == B.REASON_UNKNOWN_VERSION
    assert refused(stream(t, {})) == B.REASON_WRONG_KIND
    # Re-encoded by pyarrow with the right metadata it decodes again.
    b = B.decode_packed_batch(stream(t), HDRS)
    assert len(b.rows) == 3


def test_framing():
    assert refused(b"") == B.REASON_UNDECODABLE
    assert refused(GO[: len(GO) // 2]) == B.REASON_UNDECODABLE
    assert refused(GO[:40]) == B.REASON_UNDECODABLE
    assert refused(GO + b"\x00" * 8) == B.REASON_UNDECODABLE
    assert refused(b"garbage" * 20) == B.REASON_UNDECODABLE
    assert refused(stream(table(), batches=2)) == B.REASON_UNDECODABLE


def test_empty_batch():
    t = table()
    assert refused(stream(t.slice(0, 0))) == B.REASON_EMPTY


def replace(t: pa.Table, name: str, values) -> pa.Table:
    i = t.schema.get_field_index(name)
    f = t.schema.field(i)
    if any(v is None for v in values):
        f = f.with_nullable(True)
    return t.set_column(i, f, pa.array(values, type=f.type))


def test_lengths_disagree_is_untrainable():
    t = table()
    pos = t.column("position_ids").to_pylist()
    pos[1] = pos[1][:-1]
    assert refused(stream(replace(t, "position_ids", pos))) == B.REASON_UNTRAINABLE
    old = t.column("old_logprobs").to_pylist()
    old[0] = old[0] + [0.0]
    assert refused(stream(replace(t, "old_logprobs", old))) == B.REASON_UNTRAINABLE
    ids = t.column("segment_trajectory_ids").to_pylist()
    ids[2] = ids[2][:-1]
    assert refused(stream(replace(t, "segment_trajectory_ids", ids))) == B.REASON_UNTRAINABLE


def test_position_restart_is_checked():
    t = table()
    pos = t.column("position_ids").to_pylist()
    pos[0][3] += 1
    assert refused(stream(replace(t, "position_ids", pos))) == B.REASON_UNTRAINABLE


def test_nulls_and_types():
    t = table()
    adv = t.column("advantages").to_pylist()
    adv[0] = None
    assert refused(stream(replace(t, "advantages", adv))) == B.REASON_UNDECODABLE
    # ref_logprobs is nullable: a null row decodes as None.
    ref = t.column("ref_logprobs").to_pylist()
    ref[1] = None
    b = B.decode_packed_batch(stream(replace(t, "ref_logprobs", ref)), HDRS)
    assert b.rows[1].ref_logprobs is None and b.rows[0].ref_logprobs is not None
    i = t.schema.get_field_index("input_ids")
    wrong = t.set_column(i, pa.field("input_ids", pa.list_(pa.int64())), t.column("input_ids").cast(pa.list_(pa.int64())))
    assert refused(stream(wrong)) == B.REASON_UNDECODABLE
    assert refused(stream(t.drop_columns(["advantages"]))) == B.REASON_UNDECODABLE


def test_batch_columns_constant():
    t = table()
    idx = t.column("batch_index").to_pylist()
    idx[2] = 7
    assert refused(stream(replace(t, "batch_index", idx))) == B.REASON_UNDECODABLE


def test_window_cost_header():
    good = {"windows": 2, "admitted": {"episodes": 3, "rollout_tokens": 40, "generation_hours": 0.5, "environment_hours": 0.25},
            "filtered": {"episodes": 1, "rollout_tokens": 7, "generation_hours": 0, "environment_hours": 0.125}}
    hdrs = [(B.HEADER_WINDOW_COST, json.dumps(good).encode())]
    zero = {"episodes": 0, "rollout_tokens": 0, "generation_hours": 0.0, "environment_hours": 0.0}
    assert B.window_cost(hdrs) == {"windows": 2, "admitted": good["admitted"],
                                   "filtered": {**good["filtered"], "generation_hours": 0.0}, "failed": zero}
    assert B.window_cost([]) is None
    u = B.update_cost(B.window_cost(hdrs), 300, 7.2)
    assert u == {"windows": 2, "rollout": good["admitted"], "rejected": {**good["filtered"], "generation_hours": 0.0},
                 "failed": zero, "training": {"optimizer_tokens": 300, "accelerator_hours": 0.002}}
    # A batch refused whole: what it admitted becomes failed, beside its own failed.
    failed = {"episodes": 1, "rollout_tokens": 5, "generation_hours": 0.0, "environment_hours": 0.5}
    w = B.window_cost([(B.HEADER_WINDOW_COST, json.dumps({**good, "failed": failed}).encode())])
    r = B.refused_cost(w)
    assert r["admitted"] == zero and r["filtered"] == w["filtered"] and r["windows"] == 2
    assert r["failed"] == {"episodes": 4, "rollout_tokens": 45, "generation_hours": 0.5, "environment_hours": 0.75}
    both = B.add_window_cost(r, w)
    assert both["windows"] == 4 and both["failed"]["episodes"] == 5 and both["admitted"] == good["admitted"]
    assert B.add_window_cost(None, w) is w and B.add_window_cost(None, None) is None
    assert B.update_cost(None, 10, 0)["rollout"] == {"episodes": 0, "rollout_tokens": 0, "generation_hours": 0.0,
                                                     "environment_hours": 0.0}
    for raw, want in [(b"{", "Expecting"), (b"[1]", "not a JSON object"), (b'{"bogus":1}', "unknown field 'bogus'"),
                      (b'{"windows":-1}', "windows -1"), (b'{"admitted":{"rollout_tokens":-4}}', "admitted.rollout_tokens -4"),
                      (b'{"filtered":{"episodes":1.5}}', "filtered.episodes 1.5"),
                      (b'{"failed":{"rollout_tokens":-1}}', "failed.rollout_tokens -1"),
                      (b'{"admitted":{"environment_hours":"x"}}', "admitted.environment_hours 'x'")]:
        with pytest.raises(B.Refusal) as e:
            B.window_cost([(B.HEADER_WINDOW_COST, raw)])
        assert e.value.reason == B.REASON_HEADER_MISMATCH
        assert B.HEADER_WINDOW_COST in e.value.detail and want in e.value.detail, e.value.detail


def test_corrupted_bytes_are_refused_or_decoded():
    """Byte flips and cuts anywhere in a Go-encoded batch (a seeded sample
    of 3000): decoding and the row checks either accept the batch, with
    rows the trainer can index (every per-token column as long as
    input_ids, segment ids naming a segment), or raise Refusal with one of
    the runtime's reasons; never another exception."""
    rng = np.random.default_rng(7)
    reasons = {B.REASON_UNDECODABLE, B.REASON_WRONG_KIND, B.REASON_UNKNOWN_VERSION, B.REASON_EMPTY,
               B.REASON_UNTRAINABLE}
    accepted = refusals = 0
    for _ in range(3000):
        v = bytearray(GO)
        for _ in range(int(rng.integers(1, 4))):
            v[int(rng.integers(len(v)))] ^= int(rng.integers(1, 256))
        if rng.random() < 0.1:
            v = v[:int(rng.integers(len(v)))]
        try:
            b = B.decode_packed_batch(bytes(v), HDRS)
            B.check_rows(b)
        except B.Refusal as e:
            assert e.reason in reasons, e.reason
            refusals += 1
            continue
        for r in b.rows:
            n = len(r.input_ids)
            assert all(len(x) == n for x in (r.position_ids, r.segment_ids, r.action_mask, r.old_logprobs,
                                               r.advantages, r.policy_versions))
            assert 0 <= int(r.segment_ids.min()) and int(r.segment_ids.max()) < len(r.segment_trajectory_ids)
        accepted += 1
    assert accepted > 0 and refusals > 0, (accepted, refusals)
