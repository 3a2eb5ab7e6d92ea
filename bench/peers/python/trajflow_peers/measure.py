"""CPU time and proportional memory of a process tree, sampled in the
background: what a multi-process peer costs as a whole (every Ray daemon and
worker, every ZeroMQ stage process)."""

from __future__ import annotations

import os
import threading
import time

import psutil


def _pss_mb(p: psutil.Process) -> float:
    # smaps_rollup: shared pages (Ray's object store, shared libraries)
    # are counted once over the processes that map them.
    try:
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        return p.memory_info().rss / (1 << 20)
    except psutil.Error:
        return 0.0


class TreeSampler:
    """Samples the tree under root (itself included) every interval: CPU
    seconds (a process that exits keeps its last reading) and the sum of
    PSS. Between mark() and cpu_since() the CPU is that of the window."""

    def __init__(self, root: int | None = None, interval: float = 0.5):
        self.root = psutil.Process(root or os.getpid())
        self.interval = interval
        self._cpu: dict[tuple[int, float], float] = {}
        self._procs: dict[tuple[int, float], psutil.Process] = {}
        self.peak_mb = 0.0
        self.samples: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._measuring = False

    def start(self) -> "TreeSampler":
        self.sample()
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> tuple[float, float]:
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            procs = []
        mem = 0.0
        with self._lock:
            for p in procs:
                try:
                    key = (p.pid, p.create_time())
                    t = p.cpu_times()
                    self._cpu[key] = t.user + t.system
                    self._procs[key] = p
                except psutil.Error:
                    continue
                mem += _pss_mb(p)
            cpu = sum(self._cpu.values())
            if self._measuring:
                self.peak_mb = max(self.peak_mb, mem)
                self.samples.append((time.time(), mem))
        return cpu, mem

    def mark(self) -> float:
        """Starts the window: returns the CPU seconds so far."""
        cpu, _ = self.sample()
        with self._lock:
            self._measuring = True
            self.peak_mb = 0.0
        return cpu

    def end(self) -> float:
        cpu, _ = self.sample()
        with self._lock:
            self._measuring = False
        return cpu


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    i = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[i]
