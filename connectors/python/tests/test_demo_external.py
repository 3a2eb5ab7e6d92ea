"""`trajflow demo --trainer external` with the Python trainer of the
built-in window-MLP (`python -m trajflow.train`, the default model): the
loop runs every stage but train on its embedded broker, the Python trainer
consumes the batches topic and publishes every release (release 0
included), starting from the Go trainer's initial weights (OUT/initial.ckpt,
its --init-checkpoint: the policy the hidden eval measured at version 0).
It learns as the Go trainer does: the hidden-eval success at
the end is at least 0.9 (the Go trainer's demo: 0.020 -> 0.992 in 60
rounds), with nothing lost or trained twice, and at the first optimizer
step the ratio is exactly 1 and the KL to the behavior policy exactly 0
(the trainer recomputes, bit for bit, the log-probs the Go rollout
sampled with)."""

from __future__ import annotations

import json
import os
import time

from conftest import ROOT
from fleet import Procs, python


def test_demo_external_python_trainer_learns(tf_bin, tmp_path):
    out = tmp_path / "demo"
    procs = Procs(str(tmp_path))
    rounds = 60
    try:
        demo = procs.start("demo", [tf_bin, "demo", "--trainer", "external", "--updates", str(rounds), "--out", str(out)])
        info_path = out / "trainer.json"
        deadline = time.monotonic() + 120
        while not info_path.exists():
            assert demo.poll() is None, procs.log("demo", "out") + procs.log("demo")
            assert time.monotonic() < deadline, "no trainer.json from the demo"
            time.sleep(0.1)
        info = json.loads(info_path.read_text())
        assert info["updates"] == rounds and info["group"] == info["run_id"] + ".train"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "connectors" / "python"))
        trainer = procs.start("trainer", [python(), "-m", "trajflow.train", "--brokers", ",".join(info["brokers"]),
                                          "--run", info["run_id"], "--releases", info["releases"],
                                          "--contract", info["contract"], "--state", str(tmp_path / "tstate"),
                                          "--init-checkpoint", info["init_checkpoint"]], env=env)
        deadline = time.monotonic() + 900
        while demo.poll() is None:
            assert trainer.poll() is None, procs.log("trainer")
            assert time.monotonic() < deadline, "the demo did not end in 15 min: " + procs.log("demo", "out")[-2000:]
            time.sleep(0.5)
        assert demo.returncode == 0, procs.log("demo", "out") + procs.log("demo")
    finally:
        procs.stop()
    s = json.loads((out / "summary.json").read_text())
    print("\n" + procs.log("demo", "out")[-600:])
    assert s["lost"] == 0 and s["duplicates_admitted"] == 0, s
    assert s["attempts_launched"] == rounds * 16 * 16
    assert s["updates"] >= rounds - 5 and len(s["per_update"]) == s["updates"] == len(s["batch_hashes"])
    assert s["eval_success_initial"] < 0.1
    assert s["eval_success_final"] >= 0.9, (s["eval_success_initial"], s["eval_success_final"], s["evals"])
    # Release 0 is the initial checkpoint the loop wrote (the policy of the
    # initial hidden eval).
    import hashlib
    r0 = json.loads((out / "releases" / "policy-v00000000.json").read_text())
    assert r0["checkpoint_hash"] == "sha256:" + hashlib.sha256((out / "initial.ckpt").read_bytes()).hexdigest()
    # The releases are the Python trainer's (its update records name it).
    u1 = json.loads((out / "releases" / "policy-v00000001.update.json").read_text())["data"]
    assert u1["trainer"]["trainer"] == "trajflow.train (PyTorch)"
    m = u1["metrics"]
    assert m["from_version"] == 0 and m["tokens"] > 0
    assert m["ratio_mean"] == 1.0 and m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0, m
    assert m["approx_kl_old"] == 0.0 and m["kl"] == 0.0, m
    for lag in m["lag"]:
        assert lag["lag"] == 0 and lag["approx_kl"] == 0.0 and lag["k3"] == 0.0, lag
