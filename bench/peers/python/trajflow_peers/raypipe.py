"""Ray peer: one actor per hop (validate, reward, advantage, pack, trainer) on
a local Ray cluster started by the driver, each hop an actor call whose
argument is the previous call's result (an object reference: the object
store carries it), as veRL's single controller passes DataProto batches
between worker groups. A call carries `groups_per_call` groups (a DataProto
of that many groups); the closed loop bounds the groups in flight as for
every other system. Actors restart once after a crash (max_restarts=1) and
calls are not retried (max_task_retries=0, Ray's default): the calls in flight
on a killed actor fail and their groups are lost."""

from __future__ import annotations

import logging
import os
import signal
import time

import ray

from . import corpus as corpus_mod

PACK_MAX_WAIT = 2.0


@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)
class Stage:
    def __init__(self, corpus_path: str, stage: int):
        self.out = corpus_mod.load(corpus_path, hops=(stage + 1,), batches=False).hops[stage + 1]

    def pid(self) -> int:
        return os.getpid()

    def process(self, items: list) -> list:
        n = len(self.out)
        return [(g, t, self.out[g % n]) for g, t, _ in items]


@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)
class Pack:
    def __init__(self, corpus_path: str):
        self.cp = corpus_mod.load(corpus_path, hops=(), batches=True)
        self.packed = 0
        self.pending: list = []
        self.first = 0.0

    def pid(self) -> int:
        return os.getpid()

    def process(self, items: list) -> list:
        out = []
        for g, t, _ in items:
            self.packed += 1
            if not self.pending:
                self.first = time.monotonic()
            self.pending.append((g, t))
            k = self.cp.batch_due(self.packed)
            if k is not None:
                out.append((self.pending, self.cp.batches[k]))
                self.pending = []
        return out

    def tick(self) -> list:
        if self.pending and time.monotonic() - self.first > PACK_MAX_WAIT:
            out = [(self.pending, self.cp.batches[0])]
            self.pending = []
            return out
        return []


@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)
class Trainer:
    def pid(self) -> int:
        return os.getpid()

    def train(self, batches: list) -> list:
        now = time.time_ns()
        return [(groups, len(b), now) for groups, b in batches]


class RayPipeline:
    name = "ray"

    def __init__(self, corpus_path: str, cp: corpus_mod.Corpus, groups_per_call: int = 8):
        self.cp = cp
        self.k = groups_per_call
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1 << 30,
                 logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
        self.actors = {name: Stage.remote(corpus_path, i) for i, name in enumerate(corpus_mod.STAGES[:3])}
        self.actors["pack"] = Pack.remote(corpus_path)
        self.actors["trainer"] = Trainer.remote()
        self.calls: dict = {}  # trainer result ref -> groups of the call
        self.buf: list = []
        self.last_tick = time.monotonic()

    def ready(self, timeout: float = 120.0) -> None:
        ray.get([a.pid.remote() for a in self.actors.values()], timeout=timeout)

    def _submit(self, items: list, groups: list[int]) -> None:
        a = self.actors
        ref = items
        for name in corpus_mod.STAGES[:3]:
            ref = a[name].process.remote(ref)
        ref = a["trainer"].train.remote(a["pack"].process.remote(ref))
        self.calls[ref] = groups

    def send(self, ledger, g: int, t: int) -> None:
        self.buf.append((g, t, self.cp.hops[0][g % self.cp.groups]))
        if len(self.buf) >= self.k:
            self._submit(self.buf, [x[0] for x in self.buf])
            self.buf = []

    def poll(self, ledger, timeout_ms: int) -> None:
        now = time.monotonic()
        if self.buf and now - self.last_tick > 0.05:
            self._submit(self.buf, [x[0] for x in self.buf])  # a short call rather than waiting
            self.buf = []
        if now - self.last_tick > 0.5:
            self.last_tick = now
            self.calls[self.actors["trainer"].train.remote(self.actors["pack"].tick.remote())] = []
        if not self.calls:
            time.sleep(timeout_ms / 1000)
            return
        done, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=timeout_ms / 1000, fetch_local=True)
        for ref in done:
            groups = self.calls.pop(ref)
            try:
                res = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.ActorUnavailableError):
                ledger.fail(groups)
                continue
            for batch_groups, nbytes, recv in res:
                ledger.batch(batch_groups, nbytes, recv)

    def kill(self, role: str) -> None:
        pid = ray.get(self.actors[role].pid.remote())
        os.kill(pid, signal.SIGKILL)

    def flush(self) -> None:
        if self.buf:
            self._submit(self.buf, [x[0] for x in self.buf])
            self.buf = []

    def close(self) -> None:
        ray.shutdown()
