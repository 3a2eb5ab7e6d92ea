"""The trainer's delivery protocol against a real broker: dedup by batch
and trajectory id, the lag rule at the update, quarantine with the Go
runtime's headers, and state rebuilt at start."""

import json
import os
import subprocess

import time

import numpy as np
import pyarrow as pa
import pytest

from conftest import PARITY, ROOT
from trajflow import batches as B
from trajflow import contract as C
from trajflow.ids import batch_id
from trajflow.kafka import AckProducer, scan
from trajflow.release import decode_release, update_name
from trajflow.train import config_from_contract
from trajflow.trainer import TrainStage

RUN = "unit"
GO_BATCH = (PARITY / "demo-token-mean" / "batch.arrows").read_bytes()
GO_INIT = (PARITY / "demo-token-mean" / "init.ckpt").read_bytes()
HDRS = [("trajflow-kind", b"packed_batch"), ("trajflow-version", b"1"), ("trajflow-id", b"id")]


@pytest.fixture
def run(broker, tf_bin, tmp_path):
    src = (ROOT / "testdata" / "contracts" / "demo.yaml").read_text().replace("run_id: demo", f"run_id: {RUN}")
    cp = tmp_path / "c.yaml"
    cp.write_text(src)
    subprocess.run([tf_bin, "topics", "create", "--brokers", broker, "--contract", str(cp)], check=True,
                   capture_output=True, timeout=60)
    text = subprocess.run([tf_bin, "contract", "validate", str(cp)], check=True, capture_output=True, text=True).stdout
    c = C.parse(text)
    return broker, c, tmp_path


def stage_for(run, state=None, stale="drop", max_lag=0):
    broker, c, tmp = run
    cfg = config_from_contract(c, broker, str(tmp / "releases"), state)
    cfg.init_checkpoint = GO_INIT
    cfg.stale_policy, cfg.max_lag = stale, max_lag
    s = TrainStage(cfg)
    s.start()
    return s


def variant(c, index, rename=(), versions=None, contract=None, value=GO_BATCH):
    """The Go batch as batch `index` of this run, with the trajectory ids of
    the given rows renamed and the behavior versions of trained tokens set."""
    t = pa.ipc.open_stream(value).read_all()
    n = t.num_rows

    def put(name, vals):
        i = t.schema.get_field_index(name)
        return t.set_column(i, t.schema.field(i), pa.array(vals, type=t.schema.field(i).type))

    t = put("batch_index", [index] * n)
    t = put("batch_id", [batch_id(RUN, index)] * n)
    t = put("run_id", [RUN] * n)
    t = put("contract_hash", [contract or c.hash] * n)
    ids = t.column("segment_trajectory_ids").to_pylist()
    for r in rename:
        ids[r] = [f"{x}-b{index}" for x in ids[r]]
    t = put("segment_trajectory_ids", ids)
    if versions is not None:
        pv, mask = t.column("policy_versions").to_pylist(), t.column("action_mask").to_pylist()
        pv = [[versions[ri] if m else v for v, m in zip(row, mr)] for ri, (row, mr) in enumerate(zip(pv, mask))]
        t = put("policy_versions", pv)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


def produce(broker, values):
    p = AckProducer(broker)
    p.send([(f"{RUN}.batches", b"k", v, HDRS) for v in values])
    msgs = []
    scan(broker, f"{RUN}.batches", msgs.append)
    return msgs


def topic(broker, name):
    out = []
    scan(broker, f"{RUN}.{name}", out.append)
    return out


def test_protocol(run):
    broker, c, tmp = run
    b0 = variant(c, 0)
    segs0 = [len(r) for r in pa.ipc.open_stream(b0).read_all().column("segment_trajectory_ids").to_pylist()]
    b1 = variant(c, 1, rename=[1], versions=[1, 1])            # row 0's trajectories were trained in b0
    b2 = variant(c, 2, versions=[2, 2])                        # all trained already
    b3 = variant(c, 3, rename=[0, 1], contract="sha256:other")
    b4 = variant(c, 4, rename=[0, 1], versions=[2, 1])         # row 1 is one version behind: stale
    b5 = variant(c, 5, rename=[0, 1], versions=[0, 0])         # all stale
    msgs = produce(broker, [b0, b0, b1, b2, b3, b4, b5, b"not arrow"])
    s = stage_for(run)
    assert s.trainer.version == 0
    got = [s.process(m) for m in msgs]
    assert got == ["trained", "skipped", "trained", "duplicate_batch", "contract_mismatch", "trained",
                   "stale_batch", "undecodable"]
    assert s.trainer.version == 3
    rd = str(tmp / "releases")
    u1 = json.load(open(os.path.join(rd, update_name(1))))["data"]
    assert u1["batch_index"] == 0 and u1["metrics"]["ratio_min"] == 1.0 and u1["metrics"]["ratio_max"] == 1.0
    assert u1["duplicates"] == 0 and u1["metrics"]["from_version"] == 0 and u1["version"] == 1
    # No trajflow-window-cost header on these batches: the ledger holds the
    # optimizer work only.
    cost = u1["cost"]
    assert cost["windows"] == 0 and cost["rollout"]["rollout_tokens"] == 0 and cost["rejected"]["episodes"] == 0
    assert cost["training"]["optimizer_tokens"] == u1["metrics"]["tokens"] * s.cfg.epochs > 0
    assert cost["training"]["accelerator_hours"] == u1["step_seconds"] / 3600
    rel1 = json.load(open(os.path.join(rd, "policy-v00000001.json")))
    assert rel1["curriculum_version"] == c.curriculum_version and rel1["reward_version"] == c.reward_version
    assert c.curriculum_version.startswith("sha256:") and c.reward_version != c.curriculum_version
    u2 = json.load(open(os.path.join(rd, update_name(2))))["data"]
    assert u2["duplicates"] == segs0[0]
    u3 = json.load(open(os.path.join(rd, update_name(3))))["data"]
    assert u3["batch_index"] == 4 and u3["stale_segments"] == segs0[1] and len(u3["not_trained"]) == segs0[1]
    assert u3["stale_tokens"] > 0 and u3["max_lag"] == 0 and u3["stale_policy"] == "drop"
    assert [l["lag"] for l in u3["stale_lag"]] == [1] and u3["stale_lag"][0]["tokens"] == u3["stale_tokens"]
    assert [l["lag"] for l in u3["lag_tokens"]] == [0] and u3["lag_tokens"][0]["tokens"] == u3["metrics"]["tokens"]
    assert u3["metrics"]["sequences"] == segs0[0]
    sel = u3["selection"]
    assert sel["segments"] == segs0[0] + segs0[1] and sel["trained_segments"] == segs0[0]
    assert sel["stale_share"] == u3["stale_tokens"] / (u3["stale_tokens"] + u3["metrics"]["tokens"])
    # Quarantine: the original message plus reason, detail, stage, source.
    q = topic(broker, "quarantine")
    reasons = [dict(m.headers)["trajflow-reason"] for m in q]
    assert reasons == [b"duplicate_batch", b"contract_mismatch", b"stale_batch", b"undecodable"]
    for m, src in zip(q, [msgs[3], msgs[4], msgs[6], msgs[7]]):
        h = dict(m.headers)
        assert m.value == src.value and h["trajflow-stage"] == b"train"
        assert h["trajflow-source-topic"] == f"{RUN}.batches".encode()
        assert h["trajflow-source-partition"] == b"0" and h["trajflow-source-offset"] == str(src.offset).encode()
        assert h["trajflow-kind"] == b"packed_batch" and h["trajflow-detail"]
    # Census: one trained event per newly trained trajectory.
    ev = [json.loads(m.value)["data"] for m in topic(broker, "census")]
    trained = [e for e in ev if e["kind"] == "trained"]
    # b0: all; b1: row 1 (renamed); b4: row 0 (row 1 dropped as stale).
    assert len(trained) == len({e["attempt_id"] for e in trained}) == (segs0[0] + segs0[1]) + segs0[1] + segs0[0]
    assert all(e["tokens"] > 0 for e in trained)
    # Excluded at the update, with the reason and the excluded tokens: b4's
    # row 1, and both rows of b5 (refused as stale_batch).
    filtered = [e for e in ev if e["kind"] == "filtered"]
    assert len(filtered) == segs0[1] + segs0[0] + segs0[1]
    assert all(e["reason"] == "stale_at_update" and e["stage"] == "train" and e["stale_tokens"] > 0 for e in filtered)
    assert sum(e["stale_tokens"] for e in filtered if e["batch_id"] == batch_id(RUN, 4)) == u3["stale_tokens"]
    inc = [json.loads(m.value)["data"]["reason"] for m in topic(broker, "incidents")]
    assert sorted(inc) == ["duplicate_trajectory"]
    # The manifest of the latest version is on the policy topic.
    rel = [decode_release(m.value) for m in topic(broker, "policy")]
    assert rel[-1]["policy_version"] == 3 and rel[-1]["contract_hash"] == c.hash

    # Restart without local state: rebuilt from the topics and the update record.
    s2 = stage_for(run)
    assert (s2.trainer.version, s2.last_index, s2.trainer.steps) == (3, 4, s.trainer.steps)
    assert s2.trained == s.trained and s2.batches == s.batches
    assert np.array_equal(s2.trainer.m1.numpy(), s.trainer.m1.numpy())
    assert [s2.process(m) for m in msgs[:3]] == ["skipped"] * 3


def test_mask_stale_keeps_in_window_tokens(run):
    broker, c, tmp = run
    # Row 0 at version 1 (in window after the first update), row 1 at 0.
    b0, b1 = variant(c, 0), variant(c, 1, rename=[0, 1], versions=[1, 0])
    msgs = produce(broker, [b0, b1])
    s = stage_for(run, stale="mask_stale", state=str(tmp / "state"))
    assert [s.process(m) for m in msgs] == ["trained", "trained"]
    u = json.load(open(os.path.join(str(tmp / "releases"), update_name(2))))["data"]
    # Every token of row 1 is stale: masked, and its segments, left with no
    # trained token, count as dropped (census stale_at_update).
    segs = [len(r) for r in pa.ipc.open_stream(b1).read_all().column("segment_trajectory_ids").to_pylist()]
    assert u["stale_segments"] == segs[1] and u["stale_tokens"] > 0 and u["stale_policy"] == "mask_stale"
    # With local state the restart reads it instead of the batches topic.
    s2 = stage_for(run, state=str(tmp / "state"))
    assert s2.trained == s.trained and s2.last_index == 1


def test_refused_batch_cost(run):
    """A batch refused whole (stale_batch) is in no update of its own: the
    next update record's ledger carries its cost, what it admitted as
    failed and what it filtered as rejected, beside the next batch's own;
    a redelivered refused batch is carried once, and a restart between
    the refusal and the next update reads it back (refused_name)."""
    broker, c, tmp = run

    def cost(windows, admitted, filtered, failed):
        ep = lambda e, t, g, h: {"episodes": e, "rollout_tokens": t, "generation_hours": g, "environment_hours": h}
        return json.dumps({"windows": windows, "admitted": ep(*admitted), "filtered": ep(*filtered),
                           "failed": ep(*failed)}).encode()

    stale_cost = cost(1, (6, 600, 0.5, 0.25), (2, 50, 0.0, 0.0), (1, 10, 0.0, 0.125))
    next_cost = cost(1, (8, 800, 1.0, 0.5), (0, 0, 0.0, 0.0), (0, 0, 0.0, 0.25))
    b0 = variant(c, 0)
    stale = variant(c, 1, rename=[0, 1], versions=[0, 0])  # version 0 at trainer version 1, max_lag 0: all stale
    nxt = variant(c, 2, rename=[0, 1], versions=[1, 1])
    p = AckProducer(broker)
    p.send([(f"{RUN}.batches", b"k", b0, HDRS), (f"{RUN}.batches", b"k", stale, HDRS + [(B.HEADER_WINDOW_COST, stale_cost)]),
            (f"{RUN}.batches", b"k", nxt, HDRS + [(B.HEADER_WINDOW_COST, next_cost)])])
    msgs = []
    scan(broker, f"{RUN}.batches", msgs.append)
    want = {"windows": 2,
            "rollout": {"episodes": 8, "rollout_tokens": 800, "generation_hours": 1.0, "environment_hours": 0.5},
            "rejected": {"episodes": 2, "rollout_tokens": 50, "generation_hours": 0.0, "environment_hours": 0.0},
            "failed": {"episodes": 7, "rollout_tokens": 610, "generation_hours": 0.5, "environment_hours": 0.625}}
    rd = str(tmp / "releases")

    def ledger():
        u = json.load(open(os.path.join(rd, update_name(2))))["data"]
        assert u["batch_index"] == 2
        return {k: v for k, v in u["cost"].items() if k != "training"}

    s = stage_for(run)
    assert [s.process(m) for m in (msgs[0], msgs[1])] == ["trained", "stale_batch"]
    # A restart after the refusal was committed: the refused cost is read back.
    s2 = stage_for(run)
    assert s2.refused["batches"] == [batch_id(RUN, 1)]
    assert [s2.process(m) for m in (msgs[1], msgs[2])] == ["stale_batch", "trained"]  # redelivered: carried once
    assert ledger() == want
    assert s2.refused == {"batches": [], "cost": None}


def test_batch_reader_quarantines_and_commits(run):
    broker, c, tmp = run
    from trajflow.batches import BatchReader
    good = variant(c, 0)
    AckProducer(broker).send([(f"{RUN}.batches", b"k", good, HDRS), (f"{RUN}.batches", b"k", good[:100], HDRS),
                              (f"{RUN}.batches", b"k", good, [("trajflow-kind", b"scored_trajectory")])])
    r = BatchReader(broker, f"{RUN}.batches", f"{RUN}.quarantine", group="reader-test")
    got = []
    deadline = time.monotonic() + 30
    while len(got) + len(r.refused) < 3 and time.monotonic() < deadline:
        x = r.next(0.5)
        if x is not None:
            got.append(x)
            with pytest.raises(RuntimeError):
                r.next(0.1)  # one batch at a time
            r.commit(x[0])
    assert [b.batch_index for _, b in got] == [0]
    assert r.refused == [(1, "undecodable"), (2, "wrong_kind")]
    r.close()
    q = topic(broker, "quarantine")
    assert [dict(m.headers)["trajflow-reason"] for m in q] == [b"undecodable", b"wrong_kind"]
    # Everything was committed: a new reader in the group starts at the end.
    r2 = BatchReader(broker, f"{RUN}.batches", f"{RUN}.quarantine", group="reader-test")
    assert r2.consumer.start_offsets == {0: 3}
    r2.close()


def test_corrupted_batches_never_stop_the_trainer(run):
    """Seeded byte flips in 60 batches (fresh ids each) reach the stage
    over the real broker: each one trains or is refused with one of the
    runtime's reasons, never an exception that would stop the trainer and
    bring the batch back at every restart; the version counts the trained
    ones, and a clean batch still trains after them. Flips into the column
    values make batches that decode with NaN, huge or out-of-range numbers
    (a behavior log-prob of -1e30 trains: the loss clamps the log ratio
    and the lag statistics saturate)."""
    broker, c, tmp = run
    rng = np.random.default_rng(11)
    values = []
    for i in range(60):
        v = bytearray(variant(c, i, rename=[0, 1]))
        body = len(v) // 3  # past the schema message: the flips land in the record batch
        for _ in range(int(rng.integers(1, 3))):
            v[int(rng.integers(body, len(v)))] ^= int(rng.integers(1, 256))
        values.append(bytes(v))
    t = pa.ipc.open_stream(variant(c, 60, rename=[0, 1])).read_all()
    old = t.column("old_logprobs").to_pylist()
    mask = t.column("action_mask").to_pylist()
    old[0][mask[0].index(1)] = -1e30
    i = t.schema.get_field_index("old_logprobs")
    t = t.set_column(i, t.schema.field(i), pa.array(old, type=t.schema.field(i).type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    values.append(sink.getvalue().to_pybytes())
    values.append(variant(c, 61, rename=[0, 1]))
    msgs = produce(broker, values)
    s = stage_for(run, max_lag=1000)
    allowed = {"trained", "skipped"} | {getattr(B, n) for n in dir(B) if n.startswith("REASON_")}
    got = [s.process(m) for m in msgs]
    assert set(got) <= allowed, set(got) - allowed
    assert got[-2:] == ["trained", "trained"], got[-2:]
    assert s.trainer.version == got.count("trained")
    assert 0 < got[:-2].count("trained") < 60, got
