"""The stage processes of the peers that run one process per hop (ZeroMQ,
files): each started as `python -m MODULE ROLE ARGS...`, SIGKILLed and
started again by a kill run, stopped at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


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
