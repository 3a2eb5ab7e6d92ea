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
