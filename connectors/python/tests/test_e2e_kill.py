"""End to end: the Go fleet (dispatch, rollout, validate, reward, advantage,
pack) on the embedded broker feeds batches to `python -m trajflow.train`,
which is killed with SIGKILL at random moments (12 times, with and without
its local state directory; restarts both from that state and from the
topics) and restarted, until every round is trained.

Checked afterwards:
  * versions 0..N were published on the policy topic, every manifest's
    checkpoint verifies against its hash, and the Go rollout loaded the
    last one (gpu.LoadRelease accepted the Python checkpoints);
  * the update records name every batch of the batches topic exactly once,
    in index order (none lost, none trained twice); nothing was refused;
  * every trajectory of every batch has its census "trained" event, and no
    trajectory was trained in two batches;
  * a reader polling the release directory during the run never saw a
    manifest whose checkpoint was missing or did not verify;
  * the final checkpoint is bit-identical to the one an uninterrupted
    trainer computes from the same batches (training resumed at the right
    version with the right optimizer state).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time

from conftest import ROOT
from fleet import Procs, go_binary, python, start_broker
from trajflow import contract as C
from trajflow.batches import decode_packed_batch
from trajflow.kafka import scan
from trajflow.model import WindowMLP, hash_bytes, init_params, load_checkpoint
from trajflow.release import checkpoint_path, decode_release, manifest_name, update_name
from trajflow.train import config_from_contract
from trajflow.update import Trainer

ROUNDS = 36
KILLS = 12
RUN = "pykill"


def contract_text() -> str:
    t = (ROOT / "testdata" / "contracts" / "demo.yaml").read_text()
    subs = [(r"^run_id: demo", f"run_id: {RUN}"), (r"group_size: 16 ", "group_size: 4 "),
            (r"batch_groups: 16 ", "batch_groups: 4 "), (r"tasks_per_update: 16 ", "tasks_per_update: 4 "),
            (r"groups_per_update: 16 ", "groups_per_update: 4 "),
            # Every round makes a batch (a group of equal returns trains with advantage 0).
            (r"zero_variance: penalize_failed ", "zero_variance: keep ")]
    for a, b in subs:
        t, n = re.subn(a, b, t, flags=re.M)
        assert n == 1, a
    return t


class ReleaseWatcher(threading.Thread):
    """Reads every manifest file of the release directory over and over and
    verifies the checkpoint it names, as a rollout worker would."""

    def __init__(self, d: str):
        super().__init__(daemon=True)
        self.d, self.stop, self.failures, self.checks = d, threading.Event(), [], 0

    def run(self):
        while not self.stop.is_set():
            for mf in glob.glob(os.path.join(self.d, "policy-v*[0-9].json")):
                try:
                    with open(mf, "rb") as f:
                        rel = json.loads(f.read())
                    with open(checkpoint_path(rel), "rb") as f:
                        load_checkpoint(f.read(), rel["checkpoint_hash"])
                    self.checks += 1
                except Exception as e:  # noqa: BLE001 - every failure is a finding
                    self.failures.append(f"{mf}: {e!r}")
            time.sleep(0.01)


def test_kill9_trainer(tmp_path):
    tmp = str(tmp_path)
    tf = go_binary(tmp)
    procs = Procs(tmp)
    watcher = None
    try:
        brokers = start_broker(procs, tf)
        cpath = os.path.join(tmp, "contract.yaml")
        with open(cpath, "w") as f:
            f.write(contract_text())
        resolved = os.path.join(tmp, "resolved.yaml")
        with open(resolved, "wb") as f:
            f.write(subprocess.run([tf, "contract", "validate", cpath], check=True, capture_output=True).stdout)
        subprocess.run([tf, "topics", "create", "--brokers", brokers, "--contract", cpath], check=True,
                       capture_output=True, timeout=60)
        rel_dir, state = os.path.join(tmp, "releases"), os.path.join(tmp, "state")
        os.makedirs(rel_dir)
        for op in ("dispatch", "rollout", "validate", "reward", "advantage", "pack"):
            procs.start(op, [tf, "run", op, "--brokers", brokers, "--contract", cpath, "--releases", rel_dir,
                             "--rounds", str(ROUNDS), "--log-level", "info"])
        watcher = ReleaseWatcher(rel_dir)
        watcher.start()
        env = dict(os.environ, PYTHONPATH=str(ROOT / "connectors" / "python"))

        def trainer(life: int, with_state: bool) -> subprocess.Popen:
            args = [python(), "-m", "trajflow.train", "--brokers", brokers, "--run", RUN, "--releases", rel_dir,
                    "--contract", resolved]
            if with_state:
                args += ["--state", state]
            return procs.start(f"train-{life:02d}", args, env=env)

        rng = random.Random(20261201)
        kills, with_state_lives = 0, 0
        def ready(life: int, p: subprocess.Popen) -> None:
            deadline = time.monotonic() + 90
            while "trainer ready" not in procs.log(f"train-{life:02d}", "out"):
                assert p.poll() is None, procs.log(f"train-{life:02d}")
                assert time.monotonic() < deadline, "trainer did not become ready"
                time.sleep(0.02)

        trained_per_life = []
        for life in range(KILLS):
            # Lives with state follow each other in pairs, so the second of a
            # pair starts from the state the first left (when it is
            # consistent with the latest release); lives without state
            # delete it first.
            with_state = life % 3 != 2
            if not with_state:
                shutil.rmtree(state, ignore_errors=True)
            with_state_lives += with_state
            p = trainer(life, with_state)
            ready(life, p)
            # Kill once this life has trained a batch (or after 30 s), at a
            # random moment of the next ~0.4 s: the fleet waits for each
            # release (sync mode) and sends the next batch a few hundred ms
            # later, so kills land in every phase (training, writing files,
            # producing, committing, idle), under any machine load.
            done = len(glob.glob(os.path.join(rel_dir, "policy-v*.update.json")))
            deadline = time.monotonic() + 30
            while (len(glob.glob(os.path.join(rel_dir, "policy-v*.update.json"))) == done
                   and time.monotonic() < deadline and done < ROUNDS):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.4))
            assert p.poll() is None, f"trainer life {life} exited: " + procs.log(f"train-{life:02d}")
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
            trained_per_life.append(procs.log(f"train-{life:02d}").count("trained batch"))
        # The last life runs until every round is trained.
        p = trainer(KILLS, True)
        ready(KILLS, p)
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(rel_dir, update_name(ROUNDS))):
            assert p.poll() is None, procs.log(f"train-{KILLS:02d}")
            assert time.monotonic() < deadline, "not every round was trained in time"
            time.sleep(0.1)
        # Let the rollout load the last version, then stop the trainer.
        deadline = time.monotonic() + 60
        while f"version={ROUNDS}\n" not in procs.log("rollout"):
            assert time.monotonic() < deadline, "the Go rollout did not load the last Python release"
            time.sleep(0.1)
        p.terminate()
        assert p.wait(30) == 0
        watcher.stop.set()
        watcher.join()

        # Releases: manifests 0..N in the release directory, all verifying;
        # the compacted policy topic keeps the latest, N; the Go rollout
        # loaded every version (sync mode waits for each).
        rels = []
        for v in range(ROUNDS + 1):
            with open(os.path.join(rel_dir, manifest_name(v)), "rb") as f:
                rels.append(json.loads(f.read()))
            assert rels[-1]["policy_version"] == v and rels[-1]["ready"]
            with open(checkpoint_path(rels[-1]), "rb") as f:
                load_checkpoint(f.read(), rels[-1]["checkpoint_hash"])
        on_topic = []
        scan(brokers, f"{RUN}.policy", lambda m: on_topic.append(decode_release(m.value)))
        assert max(r["policy_version"] for r in on_topic) == ROUNDS
        assert on_topic[-1] == rels[-1]
        loaded = {int(v) for v in re.findall(r'msg="policy switched".* version=(\d+)', procs.log("rollout"))}
        assert loaded == set(range(ROUNDS + 1)), sorted(set(range(ROUNDS + 1)) - loaded)
        assert "policy release not loaded" not in procs.log("rollout")

        # Every batch trained exactly once, in order.
        batches = {}
        scan(brokers, f"{RUN}.batches", lambda m: batches.setdefault(decode_packed_batch(m.value, m.headers).batch_id,
                                                                     decode_packed_batch(m.value, m.headers)))
        ups = [json.load(open(os.path.join(rel_dir, update_name(v))))["data"] for v in range(1, ROUNDS + 1)]
        assert [u["batch_index"] for u in ups] == list(range(ROUNDS))
        assert sorted(u["batch_id"] for u in ups) == sorted(batches)
        assert all(u["duplicates"] == 0 for u in ups)
        assert all(u["metrics"]["from_version"] == u["version"] - 1 for u in ups)
        quarantined = []
        scan(brokers, f"{RUN}.quarantine", lambda m: quarantined.append(dict(m.headers)))
        assert not [q for q in quarantined if q.get("trajflow-stage") == b"train"]

        # Census: one trained event per trajectory, each trajectory in one batch.
        trained: dict[str, set] = {}

        def on_census(m):
            d = json.loads(m.value)["data"]
            if d["kind"] == "trained":
                trained.setdefault(d["attempt_id"], set()).add(d["batch_id"])

        scan(brokers, f"{RUN}.census", on_census)
        tids = [t for b in batches.values() for r in b.rows for t in r.segment_trajectory_ids]
        assert len(tids) == len(set(tids)), "a trajectory was packed into two batches"
        assert set(trained) == set(tids), "census trained events lost or extra"
        assert all(len(v) == 1 for v in trained.values())

        assert not watcher.failures, watcher.failures[:5]
        assert watcher.checks > 0

        # An uninterrupted trainer over the same batches ends on the same bytes.
        cfg = config_from_contract(C.load(resolved), brokers, rel_dir, None)
        ref = Trainer(WindowMLP(cfg.model, init_params(cfg.model, cfg.model_seed)), cfg.behavior, 0)
        for b in sorted(batches.values(), key=lambda b: b.batch_index):
            ref.update(b, cfg.objective, cfg.adam, cfg.epochs)
        final = [r for r in rels if r["policy_version"] == ROUNDS][0]
        assert hash_bytes(ref.model.checkpoint()) == final["checkpoint_hash"]

        # The Go train operator takes over from the Python releases: it
        # loads the checkpoint, the optimizer state (checksummed) and the
        # update record, and finds nothing left to train.
        g = procs.start("go-train", [tf, "run", "train", "--brokers", brokers, "--contract", cpath, "--releases",
                                     rel_dir, "--restarts", "0"])
        deadline = time.monotonic() + 60
        while "trainer restored" not in procs.log("go-train"):
            assert g.poll() is None, procs.log("go-train")
            assert time.monotonic() < deadline, "the Go trainer did not restore from the Python releases"
            time.sleep(0.1)
        line = [l for l in procs.log("go-train").splitlines() if "trainer restored" in l][0]
        assert f"version={ROUNDS} " in line and f"last_batch={ROUNDS - 1} " in line, line
        assert "no optimizer state" not in procs.log("go-train")
        print(f"\nkill test: {kills} SIGKILLs ({with_state_lives} killed lives ran with local state, {kills - with_state_lives} "
              f"without), {ROUNDS} batches trained once each, {len(tids)} trajectories, versions 0..{ROUNDS}, "
              f"{watcher.checks} manifest reads verified; batches trained per killed life {trained_per_life}")
        assert sum(1 for n in trained_per_life if n > 0) >= KILLS // 2, "most kills should land in a life that trained"
        from_state = sum("restored from local state" in procs.log(f"train-{k:02d}") for k in range(KILLS + 1))
        rebuilt = sum("restored from the topics" in procs.log(f"train-{k:02d}") for k in range(KILLS + 1))
        print(f"restarts from local state: {from_state}, rebuilt from the topics: {rebuilt}")
        assert from_state >= 1 and rebuilt >= 1
    finally:
        if watcher is not None:
            watcher.stop.set()
        procs.stop()
