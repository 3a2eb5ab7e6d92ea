"""The Go side of end-to-end tests: the trajflow binary, the embedded
broker and operator processes, all on 127.0.0.1, all stopped by the test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

from conftest import ROOT


def go_binary(tmp) -> str:
    """$TRAJFLOW_BIN, or `go build ./cmd/trajflow` into tmp (a go toolchain
    is required: this is a test of the two sides together)."""
    b = os.environ.get("TRAJFLOW_BIN")
    if b:
        return b
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("the end-to-end test needs the Go toolchain (go) or TRAJFLOW_BIN")
    out = os.path.join(tmp, "trajflow")
    subprocess.run([go, "build", "-o", out, "./cmd/trajflow"], cwd=ROOT, check=True, timeout=600)
    return out


class Procs:
    """Processes started by a test; stop() ends each by its pid."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], env=None) -> subprocess.Popen:
        out = open(os.path.join(self.logdir, name + ".out"), "ab")
        err = open(os.path.join(self.logdir, name + ".err"), "ab")
        p = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        self.procs.append((name, p))
        return p

    def log(self, name: str, stream: str = "err") -> str:
        with open(os.path.join(self.logdir, f"{name}.{stream}"), "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 15
        for _, p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_broker(procs: Procs, tf: str, *args: str) -> str:
    """Starts `trajflow broker --port 0 ARGS...` and returns its address."""
    procs.start("broker", [tf, "broker", "--port", "0", *args])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"listening on (\S+)", procs.log("broker", "out"))
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise RuntimeError("broker did not start: " + procs.log("broker"))


def python() -> str:
    return sys.executable
