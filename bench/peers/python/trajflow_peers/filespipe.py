"""Files peer: one process per hop (validate, reward, advantage, pack,
trainer), each hop a directory on the local disk, msgpack payloads, as
prime-rl's filesystem transport hands rollout batches from its orchestrator
to its trainer: the sender writes a message under a temporary name and
renames it into the receiver's directory, so the receiver never sees half a
file; the receiver polls its directory.

A stage removes an input file only after the output it made of it has been
renamed into place (pack: after the batch holding it), so a killed stage
loses nothing: restarted, it finds the files it had not finished and does
them again. What it had finished and not yet removed, it does twice (the
ledger counts the duplicates). Nothing is fsynced: the files outlive a
process, not the machine (the page cache holds them until the kernel writes
them back)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import msgpack

from . import corpus as corpus_mod
from .stages import PACK_MAX_WAIT, StageProcesses, pack_msg, stage_setup, trainer_ack

POLL_S = 0.002  # an empty directory is listed again after this long


def put(directory: str, name: str, payload: bytes) -> None:
    """Writes payload as directory/name whole: under a hidden temporary
    name first (listings skip names starting with a dot), then renamed."""
    tmp = os.path.join(directory, "." + name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
    os.rename(tmp, os.path.join(directory, name))


def ready_names(directory: str, skip: set[str] | None = None) -> list[str]:
    """The complete files of directory, oldest name first, less skip."""
    names = [n for n in os.listdir(directory) if not n.startswith(".")]
    if skip:
        names = [n for n in names if n not in skip]
    names.sort()
    return names


def _read(path: str):
    with open(path, "rb") as f:
        return msgpack.unpackb(f.read(), raw=False)


def stage_main(role: str, corpus_path: str, root: str) -> None:
    idx, cp = stage_setup(role, corpus_path)
    roles = corpus_mod.STAGES + ["trainer", "driver"]
    inbox = os.path.join(root, role)
    outbox = os.path.join(root, roles[roles.index(role) + 1])
    n = cp.groups
    if role == "trainer":
        relay(inbox, outbox, trainer_ack)
    if role == "pack":
        packed = 0
        taken: set[str] = set()  # read into the open window, removed with its batch
        pending: list = []
        first = 0.0
        while True:
            names = ready_names(inbox, taken)
            k = None
            for name in names:
                m = _read(os.path.join(inbox, name))
                taken.add(name)
                packed += 1
                if not pending:
                    first = time.monotonic()
                pending.append(([m["g"], m["t"]], name))
                k = cp.batch_due(packed)
                if k is not None:
                    break
            if k is None and pending and time.monotonic() - first > PACK_MAX_WAIT:
                k = 0  # the window's maximum wait closes it
            if k is not None and pending:
                # Named after its last group: unique, and in order.
                put(outbox, "b" + pending[-1][1], pack_msg({"groups": [g for g, _ in pending], "m": cp.batches[k]}))
                for _, name in pending:
                    os.unlink(os.path.join(inbox, name))
                    taken.discard(name)
                pending = []
            elif not names:
                time.sleep(POLL_S)
    out = cp.hops[idx + 1]
    relay(inbox, outbox, lambda m: pack_msg({"g": m["g"], "t": m["t"], "m": out[m["g"] % n]}))


def relay(inbox: str, outbox: str, answer) -> None:
    """Forever: each file of inbox, oldest first, answered by a file of the
    same name in outbox (answer maps the message read to the bytes
    written), then removed."""
    while True:
        names = ready_names(inbox)
        if not names:
            time.sleep(POLL_S)
            continue
        for name in names:
            path = os.path.join(inbox, name)
            put(outbox, name, answer(_read(path)))
            os.unlink(path)


class FilesPipeline(StageProcesses):
    """Driver side: the rollout (files into validate's directory) and the
    trainer's acknowledgements (files in the driver's)."""

    name = "files"
    module = "trajflow_peers.filespipe"

    def __init__(self, corpus_path: str, cp: corpus_mod.Corpus):
        super().__init__()
        self.corpus_path = corpus_path
        self.cp = cp
        self.roles = corpus_mod.STAGES + ["trainer"]
        # Beside the corpus: the disk trajflow's broker log is on.
        self.root = tempfile.mkdtemp(prefix="files-peer-", dir=os.path.dirname(os.path.abspath(corpus_path)))
        for r in self.roles + ["driver"]:
            os.mkdir(os.path.join(self.root, r))
        self.driver = os.path.join(self.root, "driver")
        self.inbox = os.path.join(self.root, "validate")
        for r in self.roles:
            self.start(r)

    def stage_args(self, role: str) -> list[str]:
        return [self.corpus_path, self.root]

    def ready(self, timeout: float = 60.0) -> None:
        # The files wait in the directories until every stage is up.
        time.sleep(1.0)

    def send(self, ledger, g: int, t: int) -> None:
        put(self.inbox, f"{g:012d}", pack_msg({"g": g, "t": t, "m": self.cp.hops[0][g % self.cp.groups]}))

    def poll(self, ledger, timeout_ms: int) -> None:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            names = ready_names(self.driver)
            for name in names:
                path = os.path.join(self.driver, name)
                a = _read(path)
                ledger.batch(a["groups"], a["n"], a["r"])
                os.unlink(path)
            if names or time.monotonic() >= deadline:
                return
            time.sleep(POLL_S)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    stage_main(*sys.argv[1:4])
