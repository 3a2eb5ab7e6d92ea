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
    rounds = 60
    procs = Procs(str(tmp_path))
    try:
        info = _external_demo(procs, tf_bin, tmp_path, out, rounds, [], 900)
    finally:
        procs.stop()
    assert info["updates"] == rounds and info["group"] == info["run_id"] + ".train"
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


def _external_demo(procs, tf_bin, tmp_path, out, rounds, extra, limit_s):
    """Runs `trajflow demo --trainer external` (with extra flags) into out
    and the Python trainer beside it, until the demo ends (within limit_s
    seconds); returns the demo's trainer.json. The caller stops procs."""
    demo = procs.start("demo", [tf_bin, "demo", *extra, "--trainer", "external", "--updates", str(rounds), "--out", str(out)])
    deadline = time.monotonic() + 120
    while not (out / "trainer.json").exists():
        assert demo.poll() is None, procs.log("demo", "out") + procs.log("demo")
        assert time.monotonic() < deadline, "no trainer.json from the demo"
        time.sleep(0.1)
    info = json.loads((out / "trainer.json").read_text())
    env = dict(os.environ, PYTHONPATH=str(ROOT / "connectors" / "python"))
    trainer = procs.start("trainer", [python(), "-m", "trajflow.train", "--brokers", ",".join(info["brokers"]),
                                      "--run", info["run_id"], "--releases", info["releases"],
                                      "--contract", info["contract"], "--state", str(tmp_path / "tstate"),
                                      "--init-checkpoint", info["init_checkpoint"]], env=env)
    deadline = time.monotonic() + limit_s
    while demo.poll() is None:
        assert trainer.poll() is None, procs.log("trainer")
        assert time.monotonic() < deadline, f"the demo did not end in {limit_s} s: " + procs.log("demo", "out")[-2000:]
        time.sleep(0.5)
    assert demo.returncode == 0, procs.log("demo", "out") + procs.log("demo")
    return info


def _kl_contract(tf_bin, path):
    """The demo contract with the KL to the reference in the loss (k3, 0.05)."""
    import subprocess
    y = subprocess.run([tf_bin, "contract", "show"], check=True, capture_output=True, text=True).stdout
    assert "  kl_placement: none\n" in y and "  kl_coef: 0\n" in y, y
    y = y.replace("  kl_placement: none\n", "  kl_placement: loss\n  kl_estimator: k3\n").replace("  kl_coef: 0\n", "  kl_coef: 0.05\n")
    path.write_text(y)
    return path


def _updates(out, n):
    return [json.loads((out / "releases" / f"policy-v{v:08d}.update.json").read_text())["data"] for v in range(1, n + 1)]


def test_demo_external_kl_to_reference(tf_bin, tmp_path):
    """With loss.kl_placement loss the Python trainer computes the reference
    log-probs from the initial checkpoint, as the Go train stage does: on
    the same first batch (identical batch hash) the first step's KL is
    exactly 0 in both, the last epoch's KL agrees to float32 rounding of
    the parameters, and later updates carry a positive KL."""
    rounds = 3
    contract = _kl_contract(tf_bin, tmp_path / "kl.yaml")
    procs = Procs(str(tmp_path))
    go_out, py_out = tmp_path / "go", tmp_path / "py"
    try:
        go = procs.start("go", [tf_bin, "demo", "--contract", str(contract), "--updates", str(rounds), "--out", str(go_out)])
        assert go.wait(timeout=300) == 0, procs.log("go", "out") + procs.log("go")
        _external_demo(procs, tf_bin, tmp_path, py_out, rounds, ["--contract", str(contract)], 300)
    finally:
        procs.stop()
    gs = json.loads((go_out / "summary.json").read_text())
    ps = json.loads((py_out / "summary.json").read_text())
    assert gs["batch_hashes"][0] == ps["batch_hashes"][0], (gs["batch_hashes"], ps["batch_hashes"])
    gu, pu = _updates(go_out, rounds), _updates(py_out, rounds)
    assert pu[0]["trainer"]["trainer"] == "trajflow.train (PyTorch)"
    for u in (gu[0], pu[0]):
        assert u["metrics"]["kl"] == 0.0 and u["last"]["kl"] > 0, (u["metrics"]["kl"], u["last"]["kl"])
    g, p = gu[0]["last"]["kl"], pu[0]["last"]["kl"]
    assert abs(g - p) <= 1e-4 * abs(g), (g, p)
    for u in pu[1:]:
        assert u["metrics"]["kl"] > 0, u["metrics"]
