"""The peers move the corpus' bytes over every hop, account every group, and
lose the groups a killed in-memory stage held."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from trajflow_peers import corpus as corpus_mod

HERE = pathlib.Path(__file__).resolve().parents[1]


def run_peer(corpus_path, *args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(HERE))
    p = subprocess.run([sys.executable, "-m", "trajflow_peers.run", "--corpus", corpus_path, *args],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    # The report is the last line (Ray may print notices before it).
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_corpus_holds_every_hop(corpus_path):
    cp = corpus_mod.load(corpus_path)
    assert cp.groups == 96
    assert cp.header["hops"] == ["trajectories", "valid", "rewarded", "scored"]
    assert all(len(cp.hops[0][g]) == 1 for g in range(cp.groups))
    # Most groups reach the scored topic; sizes match the messages kept.
    assert sum(1 for g in range(cp.groups) if cp.hops[3][g]) > 80
    assert cp.hop_sizes[5][1] == sum(len(m) for m in cp.hops[1][5])
    assert cp.batches and all(0 < a <= 96 for a in cp.batch_after)
    assert cp.batch_sizes[0] == len(cp.batches[0]) > 1 << 20
    # Batches recur every corpus cycle, after the same counts.
    first = cp.batch_after[0]
    assert cp.batch_due(first) == 0 and cp.batch_due(first + 96) == 0
    assert cp.batch_due(first + 1) in (None, 1)
    assert sum(cp.action) < sum(cp.tokens)


def test_corpus_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a corpus at all")
    with pytest.raises(corpus_mod.CorpusError, match="not a trajflow peers corpus"):
        corpus_mod.load(str(bad))
    good = tmp_path / "trunc.bin"
    good.write_bytes(corpus_mod.MAGIC + b"\xff\xff\x00\x00{")
    with pytest.raises(corpus_mod.CorpusError, match="truncated"):
        corpus_mod.load(str(good))


def test_zeromq_accounts_every_group(corpus_path):
    r = run_peer(corpus_path, "--system", "zeromq", "--duration", "3", "--warmup", "1", "--inflight", "64")
    assert r["groups"] > 0 and r["batches"] > 0 and r["mb_s"] > 0 and r["cpu_s"] > 0
    assert r["lost_groups"] == 0 and r["decided_groups"] == r["produced_groups"]
    assert r["latency_ms"]["p50"] > 0 and r["peak_mb"] > 0


def test_zeromq_over_ipc_accounts_every_group(corpus_path):
    r = run_peer(corpus_path, "--system", "zeromq", "--zmq-transport", "ipc", "--duration", "2", "--warmup", "1", "--inflight", "64")
    assert r["groups"] > 0 and r["mb_s"] > 0
    assert r["lost_groups"] == 0 and r["decided_groups"] == r["produced_groups"]


def test_zeromq_kill_of_pack_loses_its_window(corpus_path):
    r = run_peer(corpus_path, "--system", "zeromq", "--duration", "4", "--warmup", "1", "--inflight", "64",
                 "--kill", "pack", "--loss-timeout", "3", "--drain", "5")
    assert r["kill"]["stage"] == "pack"
    assert r["lost_groups"] > 0, r
    assert r["lost_attempts"] == 8 * r["lost_groups"]
    assert r["decided_groups"] + r["lost_groups"] == r["produced_groups"]


def test_ray_kill_of_pack_loses_its_window(corpus_path):
    r = run_peer(corpus_path, "--system", "ray", "--duration", "5", "--warmup", "2", "--inflight", "64",
                 "--groups-per-call", "4", "--kill", "pack", "--loss-timeout", "3", "--drain", "6", timeout=400)
    assert r["groups"] > 0 and r["batches"] > 0
    assert r["lost_groups"] > 0, r
    assert r["decided_groups"] + r["lost_groups"] == r["produced_groups"]


def test_files_accounts_every_group(corpus_path):
    r = run_peer(corpus_path, "--system", "files", "--duration", "3", "--warmup", "1", "--inflight", "64")
    assert r["system"] == "files"
    assert r["groups"] > 0 and r["batches"] > 0 and r["mb_s"] > 0 and r["cpu_s"] > 0
    assert r["lost_groups"] == 0 and r["decided_groups"] == r["produced_groups"]
    assert r["latency_ms"]["p50"] > 0 and r["peak_mb"] > 0
    # The hop directories live beside the corpus and go with the run.
    assert not [p for p in os.listdir(os.path.dirname(corpus_path)) if p.startswith("files-peer-")]


def test_files_kill_of_pack_loses_nothing(corpus_path):
    # Pack removes its inputs only with the batch that holds them: the
    # restarted stage finds its open window in its directory.
    r = run_peer(corpus_path, "--system", "files", "--duration", "4", "--warmup", "1", "--inflight", "64",
                 "--kill", "pack", "--loss-timeout", "8", "--drain", "8")
    assert r["kill"]["stage"] == "pack"
    assert r["lost_groups"] == 0, r
    assert r["decided_groups"] == r["produced_groups"] > 0


def test_files_put_is_whole_or_absent(tmp_path):
    from trajflow_peers import filespipe

    d = str(tmp_path)
    filespipe.put(d, "000000000002", b"two")
    filespipe.put(d, "000000000001", b"one")
    # A temporary file left by a killed writer is not a message.
    (tmp_path / ".000000000003.tmp").write_bytes(b"thr")
    assert filespipe.ready_names(d) == ["000000000001", "000000000002"]
    assert filespipe.ready_names(d, {"000000000001"}) == ["000000000002"]
    assert (tmp_path / "000000000002").read_bytes() == b"two"
    # Writing the same name again (a restarted stage redoing a file) replaces it.
    filespipe.put(d, "000000000002", b"again")
    assert (tmp_path / "000000000002").read_bytes() == b"again"
    assert sorted(os.listdir(d)) == [".000000000003.tmp", "000000000001", "000000000002"]


def test_bench_peers_runs_files(trajflow_bin, tmp_path):
    # The Go command drives the Python peer: a round row and a kill row
    # under the files peer's name, the kill row losing nothing.
    out = tmp_path / "out"
    js = tmp_path / "peers.json"
    root = HERE.parents[2]
    p = subprocess.run([trajflow_bin, "bench", "peers", "--contract", "testdata/contracts/bench.yaml", "--systems", "files",
                        "--rounds", "1", "--duration", "3s", "--warmup", "1s", "--corpus-groups", "96",
                        "--inflight-groups", "96", "--python", sys.executable, "--python-path", str(HERE),
                        "--out", str(out), "--json-out", str(js)],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(js.read_text())["rows"]
    assert [r["kill_run"] for r in rows] == [False, True], rows
    for r in rows:
        assert r["system"] == "files + msgpack (processes, local disk)"
        assert r["launched_attempts"] > 0 and r["policy_tokens_per_s"] > 0
        assert r["lost_attempts"] == 0, r
    assert "pack SIGKILLed" in rows[1]["note"]
    assert "files+msgpack" in p.stdout + p.stderr or "files + msgpack" in p.stdout + p.stderr


@pytest.mark.parametrize("system", ["files", "zeromq"])
def test_stages_end_with_a_killed_driver(corpus_path, system):
    # A driver killed mid-run (SIGKILL, the OOM killer) takes its stage
    # processes with it instead of leaving them polling for ever.
    import signal
    import time

    import psutil

    env = dict(os.environ, PYTHONPATH=str(HERE))
    stages: list = []
    driver = subprocess.Popen([sys.executable, "-m", "trajflow_peers.run", "--corpus", corpus_path, "--system", system,
                               "--duration", "60", "--warmup", "1"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(stages) < 5:
            time.sleep(0.2)
            stages = [c for c in psutil.Process(driver.pid).children() if "trajflow_peers." in " ".join(c.cmdline())]
        assert len(stages) == 5, stages
        time.sleep(1.0)  # past the stages' start-up
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        gone, alive = psutil.wait_procs(stages, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for p in stages:  # whatever a failure above left behind
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
