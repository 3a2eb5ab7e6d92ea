"""One update of the built-in policy, as gpu/trainer.go computes it.

:class:`Trainer.step` is ``gpu.Trainer.Step``: global denominators over all
rows; per row the behavior logits of the current model at the trained
positions (windows restart at every segment start), the objective with the
global denominators, backpropagation through the behavior transform and the
model; the global L2 gradient norm (float64), clipping to max_grad_norm;
one Adam step with float64 moments, bias correction ``1 - beta^t`` and
decoupled weight decay::

    m1 = b1 m1 + (1-b1) g          m2 = b2 m2 + (1-b2) g²
    p  = p - lr (m1/c1) / (sqrt(m2/c2) + eps) - lr wd p_old

computed in float64 from the float32 parameter and rounded to float32.
:meth:`Trainer.update` is ``gpu.Trainer.Update``: ``epochs`` steps on the
batch make one policy version; on error nothing changes.

Reference log-probs (docs/PIPELINE.md §12: a frozen checkpoint). With
``kl_placement: loss`` the reference is the initial policy (version 0),
frozen; :meth:`Trainer.update` computes every row's ``ref_logprobs`` with
it once, before the first epoch (:meth:`Trainer.attach_reference`),
exactly as the current log-probs are computed (same behavior transform,
same windows) but with the reference parameters. On the initial policy
the two are therefore equal bit for bit and the KL is exactly 0.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .batches import PackedBatch
from .model import Behavior, WindowMLP, behavior_logits_row
from .packed import (OFF_DECOUPLED, Denominators, attach_reference, gather_target_logprobs, ObjectiveInputError, Options, Stats, TokenInputs, global_denominators, lag_stats,
                     objective, sequence_keys, shift_targets, token_weights)


@dataclass
class Adam:
    """gpu.AdamOptions (contract loss.optimizer; grad_clip -> max_grad_norm)."""

    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def validate(self) -> None:
        fin = lambda x: not (math.isnan(x) or math.isinf(x))  # noqa: E731
        if not fin(self.lr) or self.lr <= 0:
            raise ValueError(f"adam: lr {self.lr}")
        if not (fin(self.beta1) and 0 <= self.beta1 < 1 and fin(self.beta2) and 0 <= self.beta2 < 1):
            raise ValueError(f"adam: betas {self.beta1} {self.beta2}")
        if not fin(self.eps) or self.eps <= 0:
            raise ValueError(f"adam: eps {self.eps}")
        if not fin(self.weight_decay) or self.weight_decay < 0 or not fin(self.max_grad_norm) or self.max_grad_norm < 0:
            raise ValueError(f"adam: weight decay {self.weight_decay}, max grad norm {self.max_grad_norm}")


@dataclass
class StepResult:
    """gpu.Metrics of one step (same JSON names), plus the gradient."""

    stats: Stats
    lag: list
    grad_norm: float
    grad_scale: float
    rows: int
    segments: int
    input_tokens: int
    from_version: int
    version: int
    grad: Optional[torch.Tensor] = None
    # What a trainer records beyond gpu.Metrics (the update record's
    # "trainer" object), e.g. the language-model trainer's mismatch.
    extra: dict = field(default_factory=dict)

    def metrics(self) -> dict:
        d = self.stats.to_dict()
        d.update(lag=self.lag, grad_norm=self.grad_norm, grad_scale=self.grad_scale, rows=self.rows,
                 segments=self.segments, input_tokens=self.input_tokens, from_version=self.from_version,
                 version=self.version)
        return d


def merge_lag(parts: list[list[dict]]) -> list[dict]:
    by: dict[int, dict] = {}
    for p in parts:
        for s in p:
            t = by.get(s["lag"])
            if t is None:
                by[s["lag"]] = dict(s)
                continue
            nt, ns = t["tokens"], s["tokens"]
            n = nt + ns
            for k in ("ratio_mean", "approx_kl", "k3"):
                t[k] = (t[k] * nt + s[k] * ns) / n
            t["ratio_min"] = min(t["ratio_min"], s["ratio_min"])
            t["ratio_max"] = max(t["ratio_max"], s["ratio_max"])
            t["tokens"] = n
    return [by[k] for k in sorted(by)]


OPTIM_MAGIC = b"trajflow-adam/v1"


class Trainer:
    """The policy being trained, its Adam state and its version.

    reference: the frozen reference policy of ``kl_placement: loss`` (the
    parameters of version 0). When None, the first update that needs it
    takes a copy of the model if nothing was trained yet (version 0, no
    step); a trainer restored at a later version must be given it."""

    def __init__(self, model: WindowMLP, behavior: Behavior, version: int = 0, exact: bool = True,
                 reference: Optional[WindowMLP] = None):
        behavior.validate()
        if reference is not None:
            if reference.cfg != model.cfg:
                raise ValueError(f"reference model is {reference.cfg}, the trained model is {model.cfg}")
            reference.flat.requires_grad_(False)
        self.reference = reference
        self.model = model
        self.behavior = behavior
        self.version = int(version)
        self.steps = 0
        n = model.cfg.num_params
        self.m1 = torch.zeros(n, dtype=torch.float64)
        self.m2 = torch.zeros(n, dtype=torch.float64)
        self.exact = exact
        # The decoupled objective's proximal log-probs (gpu.Trainer prox):
        # the current log-probs of the first step on batch _prox_batch since
        # the last update began.
        self._prox: Optional[torch.Tensor] = None
        self._prox_batch: Optional[str] = None

    CHECKPOINT_EXT = ".ckpt"

    def config_hash(self) -> str:
        return self.model.cfg.hash()

    def checkpoint_payload(self) -> bytes:
        return self.model.checkpoint()

    def optim_payload(self) -> bytes:
        return self.optim_bytes()

    def load_optim(self, path: str) -> None:
        with open(path, "rb") as f:
            self.set_optim(f.read())

    # The optimizer state file beside every release (gpu OptimName):
    # magic, steps, n (uint64 LE), m1[n], m2[n] (float64 LE), SHA-256.
    def optim_bytes(self) -> bytes:
        n = self.m1.numel()
        body = OPTIM_MAGIC + struct.pack("<QQ", self.steps, n) + self.m1.numpy().astype("<f8").tobytes() \
            + self.m2.numpy().astype("<f8").tobytes()
        return body + hashlib.sha256(body).digest()

    def set_optim(self, b: bytes) -> None:
        n = self.m1.numel()
        want = len(OPTIM_MAGIC) + 16 + 16 * n + 32
        if len(b) != want or not b.startswith(OPTIM_MAGIC):
            raise ValueError(f"optimizer state of {len(b)} bytes, want {want}")
        body = b[:-32]
        if hashlib.sha256(body).digest() != b[-32:]:
            raise ValueError("optimizer state checksum mismatch")
        steps, nn = struct.unpack_from("<QQ", body, len(OPTIM_MAGIC))
        if nn != n:
            raise ValueError("optimizer state for another model size")
        off = len(OPTIM_MAGIC) + 16
        self.m1 = torch.from_numpy(np.frombuffer(body, dtype="<f8", count=n, offset=off).astype(np.float64))
        self.m2 = torch.from_numpy(np.frombuffer(body, dtype="<f8", count=n, offset=off + 8 * n).astype(np.float64))
        self.steps = int(steps)

    @torch.no_grad()
    def logprobs_for_training(self, row) -> np.ndarray:
        """gpu/model LogprobsForTraining: out[i] = log p_behavior(input_ids[i+1]
        | segment prefix up to i) at every position with a target, 0 elsewhere
        (float32, aligned to next-token targets)."""
        targets = shift_targets(row.input_ids, row.segment_ids)
        at = np.nonzero(targets >= 0)[0]
        return self._logprobs_at(self.model, row, at, targets[at])

    def _logprobs_at(self, model: WindowMLP, row, at: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """model's behavior log-probs of targets at positions at of row
        (float32, target-aligned), 0 at every other position (gpu/model
        LogprobsAt)."""
        out = np.zeros(len(row.input_ids), dtype=np.float32)
        if len(at):
            z = behavior_logits_row(model, self.behavior, row.input_ids, row.position_ids, at, exact=self.exact)
            out[at] = gather_target_logprobs(z, torch.from_numpy(targets.astype(np.int64))).float().numpy()
        return out

    def reference_model(self) -> WindowMLP:
        """The frozen reference (version 0): the one given, else a copy of
        the model taken now if it is still the initial policy."""
        if self.reference is None:
            if self.version != 0 or self.steps != 0:
                raise RuntimeError(f"kl_placement 'loss' needs the reference policy (version 0); the trainer is at "
                                   f"version {self.version} and was given none")
            self.reference = WindowMLP(self.model.cfg, self.model.flat.detach().numpy())
            self.reference.flat.requires_grad_(False)
        return self.reference

    @torch.no_grad()
    def reference_logprobs(self, row, ri: int = 0) -> np.ndarray:
        """ref[i] = log p_ref(input_ids[i+1]) under the behavior transform at
        every trained position i (action_mask[i] == 1), 0 elsewhere (float32,
        target-aligned): the current log-probs of :meth:`step` (same
        positions, windows, transform and float64 log-softmax rounded to
        float32) with the reference parameters."""
        at = np.nonzero(np.asarray(row.action_mask) == 1)[0]
        targets = shift_targets(row.input_ids, row.segment_ids)[at]
        if (targets < 0).any():
            raise ObjectiveInputError(f"row {ri}: masked position {int(at[np.argmax(targets < 0)])} has no target")
        if (targets >= self.model.cfg.vocab).any():
            raise ObjectiveInputError(f"row {ri}: target outside the vocabulary")
        if len(at) == 0:
            return np.zeros(len(row.input_ids), dtype=np.float32)
        return self._logprobs_at(self.reference_model(), row, at, targets)

    def attach_reference(self, batch: PackedBatch, opts: Options) -> None:
        """With ``kl_placement: loss``, sets every row's ``ref_logprobs`` to
        :meth:`reference_logprobs` (replacing any stored ones); otherwise
        leaves the rows as they are and computes nothing."""
        attach_reference(batch.rows, opts, self.reference_logprobs)

    def token_inputs(self, batch: PackedBatch, opts: Options, den: Denominators) -> tuple[TokenInputs, list]:
        """The masked tokens of every row with the current behavior logits
        (row order, position order)."""
        weights = token_weights(batch.rows, den, opts.normalization, opts.norm_tokens)
        parts = []
        offset = 0  # the row's first position in the update: sequence keys
        for ri, r in enumerate(batch.rows):
            row_offset, offset = offset, offset + len(r.input_ids)
            mask = np.asarray(r.action_mask) == 1
            at = np.nonzero(mask)[0]
            targets = shift_targets(r.input_ids, r.segment_ids)
            if (targets[at] < 0).any():
                i = int(at[np.argmax(targets[at] < 0)])
                raise ObjectiveInputError(f"row {ri}: masked position {i} has no target")
            if (targets[at] >= self.model.cfg.vocab).any():
                raise ObjectiveInputError(f"row {ri}: target outside the vocabulary")
            if len(at) == 0:
                continue
            z = behavior_logits_row(self.model, self.behavior, r.input_ids, r.position_ids, at, exact=self.exact)
            ref = None if r.ref_logprobs is None else torch.from_numpy(np.asarray(r.ref_logprobs, dtype=np.float32)[at])
            parts.append((z, torch.from_numpy(targets[at].astype(np.int64)),
                          torch.from_numpy(np.asarray(r.old_logprobs, dtype=np.float32)[at]), ref,
                          torch.from_numpy(np.asarray(r.advantages, dtype=np.float32)[at]),
                          torch.from_numpy(weights[ri]), torch.from_numpy(np.asarray(r.policy_versions)[at].astype(np.int64)),
                          sequence_keys(r.segment_ids, at, row_offset)))
        if not parts:
            raise ObjectiveInputError(f"batch {batch.batch_id} has no trained token")
        refs = [p[3] for p in parts]
        if any(x is None for x in refs) and not all(x is None for x in refs):
            # Rows without a reference contribute no KL (Go: per-row klOn).
            raise ObjectiveInputError("reference log-probs in some rows only")
        cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
        return TokenInputs(logits=cat(0), targets=cat(1), old=cat(2), ref=None if refs[0] is None else cat(3),
                           adv=cat(4), weight=cat(5), versions=cat(6), seq=cat(7)), parts

    def step(self, batch: PackedBatch, opts: Options, adam: Adam, keep_grad: bool = False) -> StepResult:
        opts.validate()
        adam.validate()
        den = global_denominators(batch.rows)
        if den.tokens == 0:
            raise ObjectiveInputError(f"batch {batch.batch_id} has no trained token")
        self.model.zero_grad(set_to_none=True)
        inp, _ = self.token_inputs(batch, opts, den)
        decoupled = opts.off_policy == OFF_DECOUPLED
        take = decoupled and (self._prox is None or self._prox_batch != batch.batch_id
                              or self._prox.numel() != inp.old.numel())
        if decoupled and not take:
            inp.prox = self._prox
        loss, st, cur = objective(inp, opts)
        if take:
            self._prox, self._prox_batch = cur.detach().clone(), batch.batch_id
        st.sequences = den.sequences
        lag = lag_stats(cur, inp.old, inp.versions, self.version)
        loss.backward()
        g = self.model.flat.grad.detach().clone()
        gd = g.double()
        norm = math.sqrt(float((gd * gd).sum()))
        if not math.isfinite(norm):
            raise ObjectiveInputError(f"batch {batch.batch_id}: gradient norm {norm}")
        scale = 1.0
        if adam.max_grad_norm > 0 and norm > adam.max_grad_norm:
            scale = adam.max_grad_norm / norm
        self.steps += 1
        c1 = 1 - adam.beta1 ** self.steps
        c2 = 1 - adam.beta2 ** self.steps
        gs = gd * scale
        self.m1 = adam.beta1 * self.m1 + (1 - adam.beta1) * gs
        self.m2 = adam.beta2 * self.m2 + (1 - adam.beta2) * gs * gs
        with torch.no_grad():
            p0 = self.model.flat.detach().double()
            p = p0 - adam.lr * (self.m1 / c1) / (torch.sqrt(self.m2 / c2) + adam.eps)
            p = p - adam.lr * adam.weight_decay * p0
            self.model.flat.copy_(p.float())
        self.model.zero_grad(set_to_none=True)
        from_v = self.version
        self.version += 1
        return StepResult(stats=st, lag=lag, grad_norm=norm, grad_scale=scale, rows=len(batch.rows),
                          segments=sum(len(r.segment_lengths) for r in batch.rows),
                          input_tokens=sum(len(r.input_ids) for r in batch.rows),
                          from_version=from_v, version=self.version, grad=g if keep_grad else None)

    def update(self, batch: PackedBatch, opts: Options, adam: Adam, epochs: int) -> tuple[StepResult, Stats]:
        """epochs steps on batch, one policy version (gpu.Trainer.Update):
        returns the first step's metrics and the last step's stats; atomic.
        With ``kl_placement: loss`` the rows' reference log-probs are
        computed first, once (:meth:`attach_reference`): every epoch sees
        the same values."""
        saved = (self.model.flat.detach().clone(), self.m1.clone(), self.m2.clone(), self.version, self.steps)
        frm = self.version
        self._prox = None  # the proximal policy is the policy at the start of this update
        try:
            self.attach_reference(batch, opts)
            first = last = None
            for e in range(max(1, epochs)):
                res = self.step(batch, opts, adam)
                if e == 0:
                    first = res
                last = res.stats
        except Exception:
            with torch.no_grad():
                self.model.flat.copy_(saved[0])
            self.m1, self.m2, self.version, self.steps = saved[1], saved[2], saved[3], saved[4]
            raise
        self.version = frm + 1
        first.version = self.version
        return first, last
