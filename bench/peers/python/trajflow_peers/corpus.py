"""Reader of the corpus `trajflow bench peers` exports (bench/peers/corpus.go).

The corpus holds, for groups 0..N-1 of the bench's synthetic source, the exact
bytes trajflow's own stages put on every hop (trajectories, valid, rewarded,
scored) and the packed batches with the number of groups the pack stage had
read when it produced each. A peer replays them: stage h forwards the group's
hop-h+1 messages, so every system moves the same bytes over the same hops.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

MAGIC = b"TFPEERS1"
STAGES = ["validate", "reward", "advantage", "pack"]


class CorpusError(ValueError):
    """A corpus file that is not one, or is truncated."""


@dataclass
class Corpus:
    header: dict
    tokens: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    # hops[h][g]: the messages of group g on hop h (only the hops loaded).
    hops: dict[int, list[list[bytes]]] = field(default_factory=dict)
    hop_sizes: list[list[int]] = field(default_factory=list)  # [g][h] bytes on hop h
    batch_after: list[int] = field(default_factory=list)
    batches: list[bytes] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def groups(self) -> int:
        return len(self.tokens)

    def group_bytes(self, g: int) -> int:
        """Bytes group g puts on the hops before the batch."""
        return sum(self.hop_sizes[g % self.groups])

    def batch_due(self, packed: int) -> int | None:
        """The batch the pack stage emits after reading its packed-th group
        (counted from 1 over the run; the corpus repeats every N groups), or
        None."""
        pos = (packed - 1) % self.groups + 1
        for k, after in enumerate(self.batch_after):
            if after == pos:
                return k
        return None


def load(path: str, hops: tuple[int, ...] = (0, 1, 2, 3), batches: bool = True) -> Corpus:
    """Reads the corpus at path, keeping the messages of the given hops
    (and of the batches) only: each stage process holds what it sends."""
    with open(path, "rb") as f:
        data = f.read()
    if data[: len(MAGIC)] != MAGIC:
        raise CorpusError(f"{path}: not a trajflow peers corpus (magic {data[:8]!r})")
    off = len(MAGIC)

    def u32() -> int:
        nonlocal off
        if off + 4 > len(data):
            raise CorpusError(f"{path}: truncated at byte {off}")
        (v,) = struct.unpack_from("<I", data, off)
        off += 4
        return v

    def blob(keep: bool) -> bytes | int:
        nonlocal off
        n = u32()
        if off + n > len(data):
            raise CorpusError(f"{path}: truncated at byte {off} (message of {n} bytes)")
        b = data[off : off + n] if keep else n
        off += n
        return b

    hdr = json.loads(blob(True))
    cp = Corpus(header=hdr)
    nhops = len(hdr["hops"])
    for h in hops:
        cp.hops[h] = []
    for _ in range(hdr["groups"]):
        off += 8  # group index
        cp.tokens.append(u32())
        cp.action.append(u32())
        sizes = []
        for h in range(nhops):
            msgs = []
            size = 0
            for _ in range(u32()):
                b = blob(h in cp.hops)
                size += len(b) if isinstance(b, bytes) else b
                if isinstance(b, bytes):
                    msgs.append(b)
            sizes.append(size)
            if h in cp.hops:
                cp.hops[h].append(msgs)
        cp.hop_sizes.append(sizes)
    for _ in range(hdr["batches"]):
        cp.batch_after.append(u32())
        b = blob(batches)
        if isinstance(b, bytes):
            cp.batches.append(b)
            cp.batch_sizes.append(len(b))
        else:
            cp.batch_sizes.append(b)
    return cp
