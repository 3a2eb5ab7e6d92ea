"""Kill -9 of `python -m trajflow.train --model gguf:PATH` (the language-model
trainer; a tiny llama GGUF of the same code path as SmolLM2, so the test
runs in seconds per life) at random moments, with and without its local
state directory, over batches of the Kafka batches topic of the embedded
broker.

Checked afterwards: every batch trained exactly once, in index order (the
update records), every trajectory's census "trained" event once, nothing
quarantined; versions 0..N released, every manifest's GGUF verifying
against its hash whenever a concurrent reader looked (atomic releases);
only the newest optimizer state kept; and the final GGUF byte-identical to
that of an uninterrupted trainer over the same batches (training resumed
at the right version with the right weights and Adam moments)."""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import torch

from conftest import ROOT
from fleet import Procs, python
from llmfix import random_segments, tiny_gguf
from trajflow import contract as C
from trajflow import gguf_io as G
from trajflow.batches import PackedBatch, decode_packed_batch, encode_packed_batch, pack_segments
from trajflow.ids import batch_id
from trajflow.kafka import AckProducer, scan
from trajflow.llm import LLMPolicy, LLMTrainer
from trajflow.release import checkpoint_path, decode_release, manifest_name, optim_name, update_name
from trajflow.train import llm_config_from_contract

RUN = "llmkill"
BATCHES = 24
KILLS = 10


class Watcher(threading.Thread):
    def __init__(self, d):
        super().__init__(daemon=True)
        self.d, self.stop, self.failures, self.checks = d, threading.Event(), [], 0

    def run(self):
        while not self.stop.is_set():
            for mf in glob.glob(os.path.join(self.d, "policy-v*[0-9].json")):
                try:
                    with open(mf, "rb") as f:
                        rel = json.loads(f.read())
                    if G.file_hash(checkpoint_path(rel)) != rel["checkpoint_hash"]:
                        self.failures.append(f"{mf}: checkpoint does not match its hash")
                    self.checks += 1
                except Exception as e:  # noqa: BLE001 - every failure is a finding
                    self.failures.append(f"{mf}: {e!r}")
            time.sleep(0.005)


def test_kill9_llm_trainer(tf_bin, broker, tmp_path):
    tmp = str(tmp_path)
    model = tiny_gguf(os.path.join(tmp, "tiny.gguf"))
    src = (ROOT / "testdata" / "contracts" / "demo.yaml").read_text().replace("run_id: demo", f"run_id: {RUN}")
    cp = os.path.join(tmp, "c.yaml")
    with open(cp, "w") as f:
        f.write(src)
    subprocess.run([tf_bin, "topics", "create", "--brokers", broker, "--contract", cp], check=True,
                   capture_output=True, timeout=60)
    resolved = os.path.join(tmp, "resolved.yaml")
    with open(resolved, "wb") as f:
        f.write(subprocess.run([tf_bin, "contract", "validate", cp], check=True, capture_output=True).stdout)
    c = C.load(resolved)
    rng = np.random.default_rng(11)
    batches = []
    for i in range(BATCHES):
        segs = random_segments(rng, 8, 64, f"b{i}", version=i, lo=20, hi=40)
        batches.append(PackedBatch(batch_id=batch_id(RUN, i), batch_index=i, run_id=RUN, contract_hash=c.hash,
                                   trainer_version=i, token_budget=128, rows=pack_segments(segs, 128)))
    AckProducer(broker).send([(f"{RUN}.batches", RUN.encode()) + encode_packed_batch(b) for b in batches])

    rel_dir, state = os.path.join(tmp, "releases"), os.path.join(tmp, "state")
    os.makedirs(rel_dir)
    procs = Procs(tmp)
    watcher = Watcher(rel_dir)
    watcher.start()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "connectors" / "python"), HF_HUB_OFFLINE="1")

    def trainer(life, with_state):
        args = [python(), "-m", "trajflow.train", "--brokers", broker, "--run", RUN, "--releases", rel_dir,
                "--contract", resolved, "--model", f"gguf:{model}"]
        if with_state:
            args += ["--state", state]
        return procs.start(f"train-{life:02d}", args, env=env)

    def ready(life, p):
        deadline = time.monotonic() + 120
        while "trainer ready" not in procs.log(f"train-{life:02d}", "out"):
            assert p.poll() is None, procs.log(f"train-{life:02d}")
            assert time.monotonic() < deadline, "trainer did not become ready"
            time.sleep(0.01)

    def trained_count():
        return len(glob.glob(os.path.join(rel_dir, "policy-v*.update.json")))

    try:
        r = random.Random(20261201)
        trained_per_life = []
        for life in range(KILLS):
            with_state = life % 3 != 2
            if not with_state:
                shutil.rmtree(state, ignore_errors=True)
            before = trained_count()
            p = trainer(life, with_state)
            ready(life, p)
            # Kill at a random moment after this life trained its first
            # batch (or at once, for a life killed before any update).
            if life % 4 != 3:
                done = trained_count()
                deadline = time.monotonic() + 60
                while trained_count() == done and time.monotonic() < deadline and done < BATCHES:
                    time.sleep(0.002)
            # Then a random moment of at most 0.25 s, cut short when the
            # next batch is trained too (a fast machine trains several in
            # 0.25 s): each life trains at most two batches, so the kills
            # land before the last batch however fast the trainer is.
            end, now = time.monotonic() + r.uniform(0.0, 0.25), trained_count()
            while time.monotonic() < end and trained_count() <= now:
                time.sleep(0.002)
            assert p.poll() is None, f"life {life} exited: " + procs.log(f"train-{life:02d}")
            p.send_signal(signal.SIGKILL)
            p.wait()
            trained_per_life.append(trained_count() - before)  # update records this life wrote
        assert trained_count() < BATCHES, "every batch was trained before the last kill: the kills tested little"
        p = trainer(KILLS, True)
        ready(KILLS, p)
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(rel_dir, update_name(BATCHES))):
            assert p.poll() is None, procs.log(f"train-{KILLS:02d}")
            assert time.monotonic() < deadline, "not every batch was trained in time"
            time.sleep(0.05)
        p.terminate()
        assert p.wait(60) == 0
    finally:
        watcher.stop.set()
        watcher.join()
        procs.stop()

    rels = []
    for v in range(BATCHES + 1):
        with open(os.path.join(rel_dir, manifest_name(v)), "rb") as f:
            rels.append(json.loads(f.read()))
        assert rels[-1]["policy_version"] == v and rels[-1]["ready"]
        assert rels[-1]["checkpoint_uri"].endswith(f"policy-v{v:08d}.gguf")
        assert G.file_hash(checkpoint_path(rels[-1])) == rels[-1]["checkpoint_hash"]
    assert rels[0]["checkpoint_hash"] == G.file_hash(model)  # version 0 is the source GGUF
    on_topic = []
    scan(broker, f"{RUN}.policy", lambda m: on_topic.append(decode_release(m.value)))
    assert on_topic[-1] == rels[-1]
    # Only the newest optimizer state is kept.
    assert sorted(glob.glob(os.path.join(rel_dir, "*.optim"))) == [os.path.join(rel_dir, optim_name(BATCHES))]

    ups = [json.load(open(os.path.join(rel_dir, update_name(v))))["data"] for v in range(1, BATCHES + 1)]
    assert [u["batch_index"] for u in ups] == list(range(BATCHES))
    assert [u["batch_id"] for u in ups] == [b.batch_id for b in batches]
    assert all(u["duplicates"] == 0 and u["metrics"]["from_version"] == u["version"] - 1 for u in ups)
    assert all(u["trainer"]["mismatch"]["tokens"] == u["metrics"]["tokens"] for u in ups)
    quarantined = []
    scan(broker, f"{RUN}.quarantine", lambda m: quarantined.append(dict(m.headers)))
    assert not quarantined
    trained: dict = {}

    def on_census(m):
        d = json.loads(m.value)["data"]
        if d["kind"] == "trained":
            trained.setdefault(d["attempt_id"], set()).add(d["batch_id"])

    scan(broker, f"{RUN}.census", on_census)
    tids = [t for b in batches for r in b.rows for t in r.segment_trajectory_ids]
    assert set(trained) == set(tids) and all(len(v) == 1 for v in trained.values())
    assert not watcher.failures, watcher.failures[:5]
    assert watcher.checks > 0

    # An uninterrupted trainer over the same batches ends on the same bytes.
    torch.set_num_threads(1)
    cfg = llm_config_from_contract(c, broker, rel_dir, None, model)
    ref = LLMTrainer(LLMPolicy.load(model), cfg.behavior, 0)
    for b in batches:
        d = decode_packed_batch(*encode_packed_batch(b))
        ref.update(d, cfg.objective, cfg.adam, cfg.epochs)
    out = os.path.join(tmp, "ref.gguf")
    ref.checkpoint_payload()(out)
    assert G.file_hash(out) == rels[-1]["checkpoint_hash"]
    lives = [procs.log(f"train-{k:02d}") for k in range(KILLS + 1)]
    from_state = sum("restored from local state" in t for t in lives)
    rebuilt = sum("restored from the topics" in t for t in lives)
    print(f"\nllm kill test: {KILLS} SIGKILLs, {BATCHES} batches trained once each, {len(tids)} trajectories, "
          f"versions 0..{BATCHES}, {watcher.checks} manifest reads verified; batches per killed life {trained_per_life}; "
          f"restarts from local state {from_state}, rebuilt from the topics {rebuilt}")
    assert from_state >= 1 and rebuilt >= 1
    assert sum(1 for n in trained_per_life if n > 0) >= KILLS // 3
