"""PyTorch port of trajflow's built-in policy (gpu/model): the window-MLP,
its behavior transform (temperature, grammar, top-k, top-p), the grammar of
the built-in task family, and the checkpoint format.

Architecture (gpu/model/model.go). For position i of a segment the input
is the window of the last ``window`` tokens ending at i; slots before the
segment start hold PAD (0), so no segment sees another one. With x the
concatenated slot embeddings::

    h      = tanh(W1 x + b1)
    logits = W2 h + b2          # logits at i predict the token at i+1

Exact values. The Go model accumulates every dot product in float32 in
index order, each product rounded before the add (no fused multiply-add),
and evaluates tanh in float64. :func:`WindowMLP.logits` computes the forward
values the same way (a loop over the reduction index of elementwise float32
products and adds, which PyTorch never fuses on the CPU), so the logits are
bit-identical to the Go sampler's and the recomputed log-probs of an
unchanged policy equal the stored behavior log-probs exactly (ratio 1 before
the first update). The gradient flows through an ordinary matmul graph of
the same function (``exact + (graph - graph.detach())``): its value is the
derivative at the exact logits, accumulated in PyTorch's order, which is why
gradients agree with Go's to fp32 rounding and not bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .gostr import format_float_g, hash_strings

PAD_ID = 0

# Token ids of the built-in tokenizer (operators/rollout/vocab.go).
TOK_ACT, TOK_CALL, TOK_ANS, TOK_END = 3, 7, 8, 9
TOK_KEY0, TOK_VAL0 = 10, 18
VOCAB_SIZE = 32


class CheckpointError(ValueError):
    """A checkpoint that cannot be decoded or does not match its hash."""


class ShapeError(ValueError):
    """Lengths or position ids that do not fit (gpu/model ErrShape)."""


@dataclass(frozen=True)
class Config:
    """The architecture (gpu/model Config)."""

    vocab: int = 32
    window: int = 12
    embed: int = 16
    hidden: int = 64

    def validate(self) -> None:
        for name in ("vocab", "window", "embed", "hidden"):
            v = getattr(self, name)
            if not (0 < v <= 1 << 16):
                raise ValueError(f"model config: {name} {v} not in [1, 65536]")

    @property
    def input_dim(self) -> int:
        return self.window * self.embed

    @property
    def num_params(self) -> int:
        return (self.vocab * self.embed + self.hidden * self.input_dim + self.hidden
                + self.vocab * self.hidden + self.vocab)

    def offsets(self):
        """Offsets of emb, w1, b1, w2, b2 and the end in the flat vector."""
        emb = 0
        w1 = emb + self.vocab * self.embed
        b1 = w1 + self.hidden * self.input_dim
        w2 = b1 + self.hidden
        b2 = w2 + self.vocab * self.hidden
        return emb, w1, b1, w2, b2, b2 + self.vocab

    def hash(self) -> str:
        """model_config_hash of a release (gpu/model Config.Hash)."""
        h = hashlib.sha256(b"trajflow/model/window-mlp/v1")
        h.update(struct.pack("<4I", self.vocab, self.window, self.embed, self.hidden))
        return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------- checkpoint

MAGIC = b"TFMLP\x00\x00\x01"
HEADER = struct.Struct("<8s5I")


def checkpoint_bytes(cfg: Config, params: torch.Tensor | np.ndarray) -> bytes:
    """The checkpoint format of gpu/model/checkpoint.go: magic, the four
    dimensions and the parameter count (uint32 LE), then the float32 LE
    parameters."""
    p = params.detach().cpu().numpy() if isinstance(params, torch.Tensor) else np.asarray(params)
    p = np.ascontiguousarray(p, dtype="<f4")
    if p.size != cfg.num_params:
        raise ShapeError(f"{p.size} parameters, config needs {cfg.num_params}")
    return HEADER.pack(MAGIC, cfg.vocab, cfg.window, cfg.embed, cfg.hidden, p.size) + p.tobytes()


def hash_bytes(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def load_checkpoint(b: bytes, want_hash: Optional[str] = None) -> tuple[Config, np.ndarray]:
    """Decodes a checkpoint (after checking its hash when given). Bad magic,
    an invalid config, a count mismatch, short or trailing bytes, or a
    non-finite parameter raise CheckpointError."""
    if want_hash is not None and hash_bytes(b) != want_hash:
        raise CheckpointError(f"checkpoint hash {hash_bytes(b)}, manifest says {want_hash}")
    if len(b) < HEADER.size:
        raise CheckpointError(f"checkpoint of {len(b)} bytes is shorter than its header")
    magic, vocab, window, embed, hidden, n = HEADER.unpack_from(b)
    if magic != MAGIC:
        raise CheckpointError(f"bad magic {magic!r}")
    cfg = Config(vocab, window, embed, hidden)
    try:
        cfg.validate()
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if n != cfg.num_params:
        raise CheckpointError(f"{n} parameters, config {cfg} needs {cfg.num_params}")
    if len(b) != HEADER.size + 4 * n:
        raise CheckpointError(f"checkpoint of {len(b)} bytes, want {HEADER.size + 4 * n}")
    p = np.frombuffer(b, dtype="<f4", count=n, offset=HEADER.size).astype(np.float32)
    if not np.isfinite(p).all():
        raise CheckpointError(f"parameter {int(np.argmin(np.isfinite(p)))} is not finite")
    return cfg, p


def init_params(cfg: Config, seed: int) -> np.ndarray:
    """Initial parameters with the distribution of gpu/model New (embeddings
    N(0,1), W1 N(0, 1/In), W2 N(0, 0.01/Hidden), biases 0) drawn from a
    torch generator seeded with seed. The values are not those of the Go
    trainer's version 0 (Go's PCG stream is not reproduced here): a run that
    must start from exactly the Go initial policy passes its checkpoint."""
    cfg.validate()
    g = torch.Generator().manual_seed(int(seed))
    p = torch.zeros(cfg.num_params, dtype=torch.float64)
    emb, w1, b1, w2, b2, _ = cfg.offsets()
    p[emb:w1] = torch.randn(w1 - emb, generator=g, dtype=torch.float64)
    p[w1:b1] = torch.randn(b1 - w1, generator=g, dtype=torch.float64) / math.sqrt(cfg.input_dim)
    p[w2:b2] = torch.randn(b2 - w2, generator=g, dtype=torch.float64) * (0.1 / math.sqrt(cfg.hidden))
    return p.float().numpy()


# ------------------------------------------------------------------ grammar

class KVGrammar:
    """The constrained-decoding mask of the built-in task family
    (operators/rollout Grammar): within an action (the tokens after the last
    ACT of the segment) a verb, then a key after CALL or a value after ANS,
    then END; every token elsewhere."""

    def __init__(self, keys: int = 4, values: int = 8):
        self.keys, self.values = keys, values

    def id(self) -> str:
        return f"kv-grammar/v1/keys={self.keys}/values={self.values}"

    def allowed(self, tokens: np.ndarray, starts: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
        """allowed[k, v] for each position index k of ``positions`` (indexes
        into tokens), whose segment starts at starts[k]."""
        tokens = np.asarray(tokens)
        idx = np.arange(len(tokens))
        last_act = np.maximum.accumulate(np.where(tokens == TOK_ACT, idx, -1))
        la = last_act[positions]
        in_action = la >= starts
        tail_len = positions - la
        first = tokens[np.minimum(la + 1, len(tokens) - 1)]
        out = np.ones((len(positions), vocab), dtype=bool)

        def only(rows, ids):
            if rows.any():
                out[rows] = False
                ids = [t for t in ids if t < vocab]
                out[np.ix_(rows, ids)] = True

        only(in_action & (tail_len == 0), [TOK_CALL, TOK_ANS])
        only(in_action & (tail_len == 1) & (first == TOK_CALL), [TOK_KEY0 + k for k in range(self.keys)])
        only(in_action & (tail_len == 1) & (first == TOK_ANS), [TOK_VAL0 + v for v in range(self.values)])
        only(in_action & (tail_len == 2) & ((first == TOK_CALL) | (first == TOK_ANS)), [TOK_END])
        return out


def grammar_from_id(gid: str) -> KVGrammar:
    prefix = "kv-grammar/v1/keys="
    if not gid.startswith(prefix) or "/values=" not in gid:
        raise ValueError(f"grammar {gid!r}: only the built-in kv grammar is known")
    k, v = gid[len(prefix):].split("/values=")
    return KVGrammar(int(k), int(v))


# ----------------------------------------------------------------- behavior

@dataclass
class Behavior:
    """The behavior distribution of the built-in sampler (gpu/model
    Behavior): z/temperature, the grammar's forbidden tokens removed, then
    top-k and top-p; the kept sets are constants for the gradient."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    grammar: Optional[KVGrammar] = None

    def validate(self) -> None:
        if not (self.temperature > 0) or math.isinf(self.temperature):
            raise ValueError(f"temperature {self.temperature} must be positive and finite")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must not be negative")
        if not (0 <= self.top_p <= 1):
            raise ValueError(f"top_p {self.top_p} must be in [0, 1]")

    def id(self) -> str:
        g = self.grammar.id() if self.grammar is not None else ""
        return hash_strings("behavior/v1", format_float_g(float(self.temperature)), str(int(self.top_k)),
                            format_float_g(float(self.top_p)), g)

    def transform(self, raw: torch.Tensor, tokens: np.ndarray, starts: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Behavior logits [k, V] of the model logits raw [k, V] at the given
        positions of a row: float32(float64(z) / T), -inf where the grammar,
        top-k or top-p remove a token (gpu/model Behavior.Transform)."""
        V = raw.shape[1]
        out = (raw.double() / self.temperature).float()
        ninf = torch.tensor(float("-inf"), dtype=out.dtype)
        if self.grammar is not None:
            allowed = torch.from_numpy(self.grammar.allowed(tokens, starts, positions, V))
            if not allowed.any(dim=1).all():
                raise ValueError(f"grammar {self.grammar.id()} allows no token at some position")
            out = torch.where(allowed, out, ninf)
        top_p = 0 < self.top_p < 1
        if (self.top_k <= 0 or self.top_k >= V) and not top_p:
            return out
        with torch.no_grad():
            z = out.detach()
            finite = torch.isfinite(z)
            # Decreasing logit, ties by increasing id (stable sort).
            zs, order = torch.sort(z, dim=1, descending=True, stable=True)
            keep = finite.sum(dim=1)
            if 0 < self.top_k < V:
                keep = torch.minimum(keep, torch.tensor(self.top_k))
            if top_p:
                j = torch.arange(V).unsqueeze(0)
                inside = j < keep.unsqueeze(1)
                e = torch.where(inside, torch.exp(zs.double() - zs[:, :1].double()), torch.zeros((), dtype=torch.float64))
                s = e.sum(dim=1, keepdim=True)
                cum = torch.cumsum(e / s, dim=1)
                hit = (cum >= self.top_p) & inside
                first = torch.where(hit.any(dim=1), hit.double().argmax(dim=1) + 1, keep)
                keep = torch.minimum(keep, first)
            rank_kept = torch.arange(V).unsqueeze(0) < keep.unsqueeze(1)
            kept = torch.zeros_like(finite)
            kept.scatter_(1, order, rank_kept)
        return torch.where(kept, out, ninf)


def settings_id(b: Behavior, max_tokens: int, stop: list[int]) -> str:
    """The sampler id of a release (gpu/model Settings.ID)."""
    return hash_strings("sampler/v1", b.id(), str(int(max_tokens)), *[str(int(t)) for t in stop])


# -------------------------------------------------------------------- model

def check_positions(positions: np.ndarray, segments: Optional[np.ndarray]) -> None:
    """Positions restart at 0 exactly where segments change and count up by
    one inside a segment (gpu/model CheckPositions); ShapeError otherwise."""
    positions = np.asarray(positions)
    n = len(positions)
    if n == 0:
        return
    if segments is not None:
        segments = np.asarray(segments)
        if len(segments) != n:
            raise ShapeError(f"{len(segments)} segment ids for {n} positions")
        new = np.ones(n, dtype=bool)
        new[1:] = segments[1:] != segments[:-1]
    else:
        new = positions == 0
        new[0] = True
    bad_start = new & (positions != 0)
    if bad_start.any():
        i = int(np.argmax(bad_start))
        raise ShapeError(f"segment starts at {i} with position id {positions[i]}, want 0")
    cont = ~new
    cont[0] = False
    prev = np.concatenate([[0], positions[:-1]])
    bad = cont & (positions != prev + 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ShapeError(f"position id {positions[i]} at {i} follows {positions[i - 1]}")


def windows(tokens: np.ndarray, positions: np.ndarray, at: np.ndarray, window: int) -> np.ndarray:
    """The window tokens [len(at), window] of the positions ``at`` of a row
    (oldest first), PAD before the segment start (gpu/model windowAt)."""
    at = np.asarray(at, dtype=np.int64)
    s = np.arange(window)
    j = at[:, None] - (window - 1) + s[None, :]
    first = at - np.asarray(positions, dtype=np.int64)[at]
    valid = j >= first[:, None]
    return np.where(valid, np.asarray(tokens)[np.clip(j, 0, None)], PAD_ID).astype(np.int64)


class _GoTanh(torch.autograd.Function):
    """h = float32(tanh(float64(pre))) with Go's backward: dpre = dh ·
    (1 - h·h) in float32 from the rounded h, which is exactly 0 for a
    saturated unit (|h| rounds to 1) — as gpu/model Backward computes it.
    (Autograd of the float64 tanh would leave ~1e-9 there, which Adam's
    normalization turns into a visible step.)"""

    @staticmethod
    def forward(ctx, pre):
        h = torch.tanh(pre.double()).float()
        ctx.save_for_backward(h)
        return h

    @staticmethod
    def backward(ctx, dh):
        (h,) = ctx.saved_tensors
        return dh * (1 - h * h)


def go_tanh(pre: torch.Tensor) -> torch.Tensor:
    return _GoTanh.apply(pre)


def _seq_dot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[n, o] = sum_j x[n, j] * w[o, j], accumulated in float32 in j
    order with every product rounded first (Go's dot)."""
    acc = torch.zeros((x.shape[0], w.shape[0]), dtype=torch.float32)
    for j in range(x.shape[1]):
        acc = acc + x[:, j:j + 1] * w[:, j].unsqueeze(0)
    return acc


class WindowMLP(torch.nn.Module):
    """The built-in policy with one flat float32 parameter vector (the layout
    of the Go checkpoint: emb, W1, b1, W2, b2, row-major)."""

    def __init__(self, cfg: Config, params: Optional[np.ndarray] = None, seed: int = 1):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        p = init_params(cfg, seed) if params is None else np.asarray(params, dtype=np.float32)
        if p.size != cfg.num_params:
            raise ShapeError(f"{p.size} parameters, config needs {cfg.num_params}")
        self.flat = torch.nn.Parameter(torch.tensor(p, dtype=torch.float32))

    @classmethod
    def from_checkpoint(cls, b: bytes, want_hash: Optional[str] = None) -> "WindowMLP":
        cfg, p = load_checkpoint(b, want_hash)
        return cls(cfg, p)

    def checkpoint(self) -> bytes:
        return checkpoint_bytes(self.cfg, self.flat)

    def views(self, flat: Optional[torch.Tensor] = None):
        flat = self.flat if flat is None else flat
        c = self.cfg
        emb, w1, b1, w2, b2, end = c.offsets()
        return (flat[emb:w1].view(c.vocab, c.embed), flat[w1:b1].view(c.hidden, c.input_dim), flat[b1:w2],
                flat[w2:b2].view(c.vocab, c.hidden), flat[b2:end])

    def logits(self, win: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """Logits [k, V] of k windows [k, window] (int64 token ids). With
        exact=True the values are bit-identical to gpu/model's (see the
        module docstring); the gradient is that of the matmul graph."""
        c = self.cfg
        if win.numel() and (int(win.min()) < 0 or int(win.max()) >= c.vocab):
            raise ShapeError(f"token outside [0, {c.vocab})")
        E, W1, B1, W2, B2 = self.views()
        x = E[win].reshape(win.shape[0], c.input_dim)
        h = go_tanh(x @ W1.T + B1)
        z = h @ W2.T + B2
        if not exact:
            return z
        with torch.no_grad():
            xe = x.detach()
            he = torch.tanh((_seq_dot(xe, W1.detach()) + B1.detach()).double()).float()
            ze = _seq_dot(he, W2.detach()) + B2.detach()
        return z + (ze - z).detach()

    def forward(self, win: torch.Tensor) -> torch.Tensor:  # noqa: D401 - torch API
        return self.logits(win)


def behavior_logits_row(m: WindowMLP, b: Behavior, tokens: np.ndarray, positions: np.ndarray,
                        at: np.ndarray, exact: bool = True) -> torch.Tensor:
    """Behavior logits [len(at), V] at positions ``at`` of one packed row."""
    win = torch.from_numpy(windows(tokens, positions, at, m.cfg.window))
    raw = m.logits(win, exact=exact)
    starts = np.asarray(at) - np.asarray(positions, dtype=np.int64)[at]
    return b.transform(raw, np.asarray(tokens), starts, np.asarray(at))
