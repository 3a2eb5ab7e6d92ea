"""The per-update lines and summary of examples/llm/run.sh.

Follows the run's topics on the broker (trajectories, windows, batches,
policy, weights) and the update records in the release directory, and
prints one line per trained update once its release is in:

    update  reward  valid  success  kl_first  kl_last  mismatch(mean/max/kl)  tok/s  gen  pipe  train  sync

Stage times of update v (trained from round v-1, sampled by version v-1):

* gen: from the weight-sync acknowledgement of version v-1 (the replica
  serves it) to the last round-(v-1) trajectory finished (dispatch and
  rollout, the llama-server's generation);
* pipe: from there to the batch on the batches topic (validate, reward,
  advantage, pack);
* train: from the batch to release v on the policy topic (the trainer
  consumes, recomputes, steps, exports the GGUF and publishes);
* sync: from release v to its acknowledgement on the weights topic (the
  router rescans, loads and verifies the file).

When --summary names the demo's summary.json (written at its end), the
monitor adds its figures to it: ``llm`` (per update: the line's fields,
the mismatch of the behavior version, the trainer's timings) and
``mismatch_by_version``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pyarrow as pa
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition


def doc(b: bytes) -> dict:
    d = json.loads(b)
    return d.get("data", d)


class Run:
    def __init__(self, a):
        self.a = a
        self.traj = {}          # version -> {"finished_us": max, "turns", "valid", "tokens", "trajectories"}
        self.windows = {}       # batch_index -> window record
        self.batch_ts = {}      # batch_index -> Kafka timestamp (ms)
        self.release_ts = {}    # version -> Kafka timestamp (ms)
        self.synced = {}        # version -> at_us of the first loaded ack
        self.sync_errors = {}
        self.printed = set()
        self.lines = []

    def consume(self, c: Consumer, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        while time.monotonic() < end:
            m = c.poll(0.2)
            if m is None:
                return
            if m.error():
                continue
            topic = m.topic().split(".", 1)[1]
            ts = m.timestamp()[1]
            v = m.value()
            try:
                if topic == "trajectories":
                    self.on_trajectories(v)
                elif topic == "windows":
                    w = doc(v)
                    if w.get("batch_id"):
                        self.windows[w["batch_index"]] = w
                elif topic == "batches":
                    hs = dict(m.headers() or [])
                    # The batch index is in the record; the topic holds one
                    # message per batch, in order, in sync mode.
                    self.batch_ts[len(self.batch_ts)] = ts
                elif topic == "policy":
                    r = doc(v)
                    if r.get("ready"):
                        self.release_ts.setdefault(r["policy_version"], ts)
                elif topic == "weights":
                    k = doc(v)
                    if k.get("loaded"):
                        self.synced.setdefault(k["version"], k["at_us"])
                    elif k.get("error"):
                        self.sync_errors.setdefault(k["version"], k["error"])
            except (ValueError, KeyError, pa.ArrowInvalid) as e:
                print(f"monitor: {topic} record: {e}", file=sys.stderr)

    def on_trajectories(self, v: bytes) -> None:
        t = pa.ipc.open_stream(v).read_all().to_pylist()
        for tr in t:
            turns = tr["turns"]
            if not turns:
                continue
            ver = min(x["policy_version"] for x in turns)
            s = self.traj.setdefault(ver, {"finished_us": 0, "started_us": None, "turns": 0, "valid": 0, "tokens": 0,
                                           "trajectories": 0})
            s["finished_us"] = max(s["finished_us"], tr["finished_at_us"])
            s["started_us"] = tr["started_at_us"] if s["started_us"] is None else min(s["started_us"], tr["started_at_us"])
            s["trajectories"] += 1
            for x in turns:
                s["turns"] += 1
                s["valid"] += x["decision"] != "invalid"
                s["tokens"] += len(x["action_ids"])

    def update_record(self, v: int):
        p = os.path.join(self.a.releases, f"policy-v{v:08d}.update.json")
        try:
            with open(p) as f:
                return doc(f.read().encode())
        except (OSError, ValueError):
            return None

    def ready(self, v: int, final: bool) -> bool:
        if v in self.printed or v not in self.release_ts or (v - 1) not in self.batch_ts:
            return False
        if self.update_record(v) is None:
            return False
        return final or v in self.synced

    def line(self, v: int) -> dict:
        u = self.update_record(v)
        w = self.windows.get(v - 1, {})
        g = self.traj.get(v - 1, {})
        m = u.get("trainer", {}).get("mismatch", {})
        start_us = self.synced.get(v - 1)
        fin_us = g.get("finished_us") or None
        bt, rt = self.batch_ts[v - 1] * 1000, self.release_ts[v] * 1000
        gen = (fin_us - start_us) / 1e6 if fin_us and start_us else None
        pipe = (bt - fin_us) / 1e6 if fin_us else None
        train = (rt - bt) / 1e6
        sync = (self.synced[v] - rt) / 1e6 if v in self.synced else None
        return {
            "update": v, "sampled_by": v - 1, "batch_id": u.get("batch_id"),
            "reward": w.get("reward_mean"), "success": w.get("success_rate"),
            "action_validity": g["valid"] / g["turns"] if g.get("turns") else None,
            "trajectories": g.get("trajectories"), "action_tokens": g.get("tokens"), "trained_tokens": u["metrics"].get("tokens"),
            "tokens_per_s": g["tokens"] / gen if gen and g.get("tokens") else None,
            "kl_first": u["metrics"].get("approx_kl_old"), "kl_last": u.get("last", {}).get("approx_kl_old"),
            "ratio_mean_first": u["metrics"].get("ratio_mean"),
            "mismatch": {k: x for k, x in m.items() if k != "by_version"},
            "seconds": {"generation": gen, "pipeline": pipe, "training": train, "weight_sync": sync},
            "trainer_seconds": {"step": u.get("step_seconds"), **u.get("trainer", {}).get("timings", {})},
            "weight_sync_error": self.sync_errors.get(v),
        }

    def report(self, final: bool) -> None:
        v = max(self.printed, default=0) + 1
        while self.ready(v, final):
            ln = self.line(v)
            self.printed.add(v)
            self.lines.append(ln)
            print(fmt(ln), flush=True)
            v += 1


def f(x, spec):
    return "-" if x is None else format(x, spec)


HEADER = ("update  reward  valid  success  kl_first   kl_last  mm_mean  mm_max   mm_kl   tok/s     gen    pipe   train    sync")


def fmt(ln: dict) -> str:
    s, mm = ln["seconds"], ln["mismatch"]
    return (f"{ln['update']:6d}  {f(ln['reward'], '6.3f')}  {f(ln['action_validity'], '5.3f')}  {f(ln['success'], '7.3f')}  "
            f"{f(ln['kl_first'], '8.5f')}  {f(ln['kl_last'], '8.5f')}  {f(mm.get('rollout_logprobs_diff_mean'), '7.4f')}  "
            f"{f(mm.get('rollout_logprobs_diff_max'), '6.3f')}  {f(mm.get('mismatch_kl'), '6.4f')}  {f(ln['tokens_per_s'], '6.1f')}  "
            f"{f(s['generation'], '6.1f')}  {f(s['pipeline'], '6.2f')}  {f(s['training'], '6.1f')}  {f(s['weight_sync'], '6.1f')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="examples/llm/monitor.py")
    ap.add_argument("--trainer-json", required=True, help="the demo's OUT/trainer.json")
    ap.add_argument("--summary", required=True, help="the demo's OUT/summary.json (merged into when it appears)")
    ap.add_argument("--done", required=True, help="a file whose existence says the demo exited")
    ap.add_argument("--expect", type=int, default=0, help="fail unless the run trained this many updates, each "
                    "sampled by the version before it, with nothing lost or admitted twice")
    a = ap.parse_args(argv)
    with open(a.trainer_json) as fh:
        info = json.load(fh)
    a.releases = info["releases"]
    run = Run(a)
    c = Consumer({"bootstrap.servers": ",".join(info["brokers"]), "group.id": "llm-monitor", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "log_level": 0})
    md = c.list_topics(timeout=30)
    tps = []
    for short in ("trajectories", "windows", "batches", "policy", "weights"):
        t = f"{info['run_id']}.{short}"
        if t not in md.topics:
            print(f"monitor: no topic {t} on {info['brokers']}", file=sys.stderr)
            return 1
        tps += [TopicPartition(t, p, OFFSET_BEGINNING) for p in md.topics[t].partitions]
    c.assign(tps)
    print(HEADER, flush=True)
    try:
        while not os.path.exists(a.done):
            run.consume(c, 2.0)
            run.report(final=False)
        # The demo ended: take what is left (the broker stops with it, so
        # what was consumed is all there is).
        run.report(final=True)
    finally:
        c.close()
    if not os.path.exists(a.summary):
        print(f"monitor: no {a.summary}: the demo failed", file=sys.stderr)
        return 1
    with open(a.summary) as fh:
        s = json.load(fh)
    s["llm"] = run.lines
    by = {}
    for ln in run.lines:
        by[str(ln["sampled_by"])] = ln["mismatch"]
    s["mismatch_by_version"] = by
    s["release0_weight_sync_at_us"] = run.synced.get(0)
    tmp = a.summary + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(s, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, a.summary)
    return check(s, run, a.expect) if a.expect else 0


def check(s: dict, run: Run, k: int) -> int:
    """The smoke's assertions (examples/llm/run.sh --check)."""
    bad = []
    if s["updates"] != k or len(run.lines) != k:
        bad.append(f"{s['updates']} updates in the summary, {len(run.lines)} lines, want {k}")
    if s["lost"] or s["duplicates_admitted"]:
        bad.append(f"lost {s['lost']}, duplicates admitted {s['duplicates_admitted']}")
    for v in range(k):
        if v not in run.traj:
            bad.append(f"no trajectory sampled by version {v}")
        if v not in run.synced:
            bad.append(f"version {v} never acknowledged by weight sync")
    for ln in run.lines:
        mm = ln["mismatch"]
        if not mm.get("tokens") or not (0 <= mm.get("rollout_logprobs_diff_mean", -1) < 10):
            bad.append(f"update {ln['update']}: mismatch {mm}")
    for b in bad:
        print(f"monitor: check failed: {b}", file=sys.stderr)
    if not bad:
        print(f"monitor: check passed: {k} updates, each sampled by the version before it, every version loaded by "
              "weight sync, mismatch recorded, nothing lost or admitted twice", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
