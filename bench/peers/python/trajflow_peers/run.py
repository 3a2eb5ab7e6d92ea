"""One run of a peer: `python -m trajflow_peers.run --system ray
--corpus FILE --duration 15` prints one JSON object (the same fields for every
system) on stdout. `trajflow bench peers` starts it once per system and round.

Phases: start the system, warm up, measure for --duration, then (with --kill
STAGE) SIGKILL that stage's process once --kill-at seconds into the window
and let the system restart it, then drain: stop launching and wait for every
group in flight (at most --drain seconds) before counting what was lost."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import corpus as corpus_mod
from .ledger import Ledger
from .measure import TreeSampler


def make(system: str, corpus_path: str, cp, groups_per_call: int, zmq_transport: str = "tcp"):
    if system == "zeromq":
        from .zmqpipe import ZmqPipeline

        return ZmqPipeline(corpus_path, cp, zmq_transport)
    if system == "ray":
        from .raypipe import RayPipeline

        return RayPipeline(corpus_path, cp, groups_per_call)
    if system == "files":
        from .filespipe import FilesPipeline

        return FilesPipeline(corpus_path, cp)
    raise SystemExit(f"--system {system!r}: want ray, zeromq or files")


def run(args) -> dict:
    cp = corpus_mod.load(args.corpus, hops=(0,), batches=False)
    sampler = TreeSampler().start()
    t_start = time.monotonic()
    sysm = make(args.system, args.corpus, cp, args.groups_per_call, args.zmq_transport)
    out: dict = {"system": sysm.name, "groups_per_call": args.groups_per_call if args.system == "ray" else 1,
                 "inflight_groups": args.inflight, "corpus_groups": cp.groups}
    try:
        sysm.ready()
        out["startup_s"] = time.monotonic() - t_start
        led = Ledger(cp, args.inflight, args.loss_timeout)
        phase_end = time.monotonic() + args.warmup
        measuring = False
        killed = False
        t0 = cpu0 = 0.0
        while True:
            now = time.monotonic()
            if not measuring and now >= phase_end:
                measuring, led.measuring = True, True
                led.reset_window()
                cpu0, t0 = sampler.mark(), now
                phase_end = now + args.duration
            elif measuring and now >= phase_end:
                break
            if measuring and args.kill and not killed and now - t0 >= args.kill_at:
                killed = True
                t_kill = time.monotonic()
                sysm.kill(args.kill)
                out["kill"] = {"stage": args.kill, "at_s": now - t0, "restart_s": time.monotonic() - t_kill}
            while led.free() > 0:
                g, t = led.launch()
                sysm.send(led, g, t)
            sysm.poll(led, 5)
            led.expire()
        window = time.monotonic() - t0
        cpu = sampler.end() - cpu0
        led.measuring = False
        out.update(led.summary(window, cpu))
        out["peak_mb"] = sampler.peak_mb
        # Drain: nothing new, every group in flight either arrives or is lost.
        sysm.flush()
        led.loss_timeout = args.drain
        deadline = time.monotonic() + args.drain
        while led.inflight and time.monotonic() < deadline:
            sysm.poll(led, 20)
        final = led.summary(window, cpu)
        for k in ("produced_groups", "decided_groups", "lost_groups", "lost_attempts", "lost_action_tokens",
                  "late_groups", "duplicate_groups"):
            out[k] = final[k]
    finally:
        sysm.close()
        sampler.stop()
    out["load_avg"] = os.getloadavg()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trajflow_peers.run", description=__doc__)
    ap.add_argument("--system", required=True, choices=["ray", "zeromq", "files"])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--inflight", type=int, default=192, help="groups produced and not yet decided (closed loop)")
    ap.add_argument("--groups-per-call", type=int, default=8, help="Ray: groups per actor call (one DataProto)")
    ap.add_argument("--kill", default="", choices=["", "validate", "reward", "advantage", "pack", "trainer"])
    ap.add_argument("--kill-at", type=float, default=0.0, help="seconds into the window (default: half of it)")
    ap.add_argument("--loss-timeout", type=float, default=5.0,
                    help="a group in flight this long is presumed lost and its slot freed")
    ap.add_argument("--drain", type=float, default=10.0)
    ap.add_argument("--zmq-transport", default="tcp", choices=["tcp", "ipc"],
                    help="ZeroMQ: tcp (127.0.0.1) or ipc (Unix sockets of the abstract namespace)")
    args = ap.parse_args(argv)
    if args.kill and args.kill_at <= 0:
        args.kill_at = args.duration / 2
    if args.inflight < 1 or args.groups_per_call < 1 or args.duration <= 0:
        ap.error("--inflight, --groups-per-call and --duration must be positive")
    if not os.path.exists(args.corpus):
        ap.error(f"--corpus {args.corpus}: no such file")
    report = run(args)
    sys.stdout.flush()
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
