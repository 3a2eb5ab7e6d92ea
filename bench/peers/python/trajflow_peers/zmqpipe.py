"""ZeroMQ peer: one process per hop (validate, reward, advantage, pack,
trainer), PUSH/PULL sockets on 127.0.0.1, msgpack payloads, as prime-rl moves
rollouts between its orchestrator and trainer. Every stage binds its PULL
socket and connects a PUSH to the next one, so a restarted stage is found
again on the same address; nothing is written anywhere: what a killed stage
had received and not yet sent on is gone."""

from __future__ import annotations

import os
import sys
import time

import msgpack
import zmq

from . import corpus as corpus_mod
from .stages import PACK_MAX_WAIT, StageProcesses, pack_msg, stage_setup, trainer_ack


def stage_main(role: str, corpus_path: str, pull_addr: str, push_addr: str) -> None:
    idx, cp = stage_setup(role, corpus_path)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(pull_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(push_addr)
    n = cp.groups
    if role == "trainer":
        while True:
            push.send(trainer_ack(msgpack.unpackb(pull.recv(), raw=False)))
    if role == "pack":
        packed = 0
        pending: list = []
        first = 0.0
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        while True:
            if poller.poll(100):
                m = msgpack.unpackb(pull.recv(), raw=False)
                packed += 1
                if not pending:
                    first = time.monotonic()
                pending.append([m["g"], m["t"]])
                k = cp.batch_due(packed)
            else:
                k = None
            if k is None and pending and time.monotonic() - first > PACK_MAX_WAIT:
                k = 0  # the window's maximum wait closes it
            if k is not None and pending:
                push.send(pack_msg({"groups": pending, "m": cp.batches[k]}))
                pending = []
    out = cp.hops[idx + 1]
    while True:
        m = msgpack.unpackb(pull.recv(), raw=False)
        g = m["g"]
        push.send(pack_msg({"g": g, "t": m["t"], "m": out[g % n]}))


def _free_ports(k: int) -> list[int]:
    import socket

    socks, ports = [], []
    for _ in range(k):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class ZmqPipeline(StageProcesses):
    """Driver side: the rollout (PUSH into validate) and the trainer's
    acknowledgements (PULL)."""

    name = "zeromq"
    module = "trajflow_peers.zmqpipe"

    def __init__(self, corpus_path: str, cp: corpus_mod.Corpus, transport: str = "tcp"):
        super().__init__()
        self.corpus_path = corpus_path
        self.cp = cp
        roles = corpus_mod.STAGES + ["trainer"]
        if transport == "ipc":
            # Unix sockets of Linux's abstract namespace: no file to remove,
            # gone with the process that bound them.
            self.addr = {r: f"ipc://@trajflow-zmqpy-{os.getpid()}-{r}" for r in roles + ["driver"]}
        elif transport == "tcp":
            ports = _free_ports(len(roles) + 1)
            self.addr = {r: f"tcp://127.0.0.1:{p}" for r, p in zip(roles + ["driver"], ports)}
        else:
            raise ValueError(f"zeromq transport {transport!r}: want tcp or ipc")
        self.roles = roles
        self.ctx = zmq.Context()
        self.acks = self.ctx.socket(zmq.PULL)
        self.acks.bind(self.addr["driver"])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.addr["validate"])
        for r in roles:
            self.start(r)

    def stage_args(self, role: str) -> list[str]:
        nxt = self.roles[self.roles.index(role) + 1] if role != "trainer" else "driver"
        return [self.corpus_path, self.addr[role], self.addr[nxt]]

    def ready(self, timeout: float = 60.0) -> None:
        # PUSH/PULL connect lazily: the first messages wait in the sockets'
        # queues until every stage is up. Nothing to wait for.
        time.sleep(1.0)

    def send(self, ledger, g: int, t: int) -> None:
        self.push.send(pack_msg({"g": g, "t": t, "m": self.cp.hops[0][g % self.cp.groups]}))

    def poll(self, ledger, timeout_ms: int) -> None:
        if self.acks.poll(timeout_ms):
            while True:
                try:
                    a = msgpack.unpackb(self.acks.recv(zmq.NOBLOCK), raw=False)
                except zmq.Again:
                    break
                ledger.batch(a["groups"], a["n"], a["r"])

    def close(self) -> None:
        self.stop()
        self.push.close(linger=0)
        self.acks.close(linger=0)
        self.ctx.term()


if __name__ == "__main__":
    stage_main(*sys.argv[1:5])
