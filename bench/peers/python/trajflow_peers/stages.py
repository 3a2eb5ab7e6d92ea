"""The stage processes of the peers that run one process per hop (ZeroMQ,
files): each started as `python -m MODULE ROLE ARGS...`, SIGKILLed and
started again by a kill run, stopped at the end, and gone with the driver
if the driver is killed (die_with_parent)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import msgpack

from . import corpus as corpus_mod

PACK_MAX_WAIT = 2.0  # s, as trajflow's bench window_max_wait
PARENT_ENV = "TRAJFLOW_PEERS_PARENT"  # the driver's pid, for die_with_parent
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Called first thing in a stage process: asks Linux to SIGKILL it when
    the driver that started it ends (prctl PR_SET_PDEATHSIG), and exits at
    once if the driver is already gone. A stage without its driver would
    otherwise wait on its socket or poll its directory for ever."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if parent and os.getppid() != parent:
        sys.exit(0)  # the driver ended before the request above took effect


def pack_msg(o) -> bytes:
    """A message's msgpack bytes (binary values stay bytes)."""
    return msgpack.packb(o, use_bin_type=True)


def trainer_ack(batch: dict) -> bytes:
    """The trainer's acknowledgement to the driver of a batch message: its
    groups, its size and the receive time."""
    return pack_msg({"groups": batch["groups"], "n": len(batch["m"]), "r": time.time_ns()})


def stage_setup(role: str, corpus_path: str) -> tuple[int, corpus_mod.Corpus]:
    """The start of a stage process: die_with_parent, SIGTERM ends it, and
    the part of the corpus it sends (hop stages their next hop, pack the
    batches, the trainer nothing). Returns the role's index in
    corpus.STAGES (-1 for the trainer) and the corpus."""
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    idx = corpus_mod.STAGES.index(role) if role in corpus_mod.STAGES else -1
    hops: tuple[int, ...] = (idx + 1,) if 0 <= idx < 3 else ()
    return idx, corpus_mod.load(corpus_path, hops=hops, batches=(role == "pack"))


class StageProcesses:
    """Base of a pipeline whose stages are processes of module; a subclass
    says what each role is started with (stage_args)."""

    module = ""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def stage_args(self, role: str) -> list[str]:
        raise NotImplementedError

    def start(self, role: str) -> None:
        env = dict(os.environ)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
        env[PARENT_ENV] = str(os.getpid())
        self.procs[role] = subprocess.Popen([sys.executable, "-m", self.module, role, *self.stage_args(role)], env=env)

    def kill(self, role: str) -> None:
        p = self.procs[role]
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.start(role)

    def flush(self) -> None:
        pass

    def stop(self) -> None:
        """Terminates every stage, killing one that does not end in 10 s."""
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
