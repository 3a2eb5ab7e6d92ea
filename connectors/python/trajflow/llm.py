"""A causal language model (llama architecture, loaded from GGUF) trained
on trajflow's packed batches.

Packed rows (schemas.PackedRow) hold several trajectories back to back.
The forward pass of a row (:func:`row_hidden`) gives the model

* ``position_ids`` as stored (they restart at 0 in every segment, so the
  rotary embedding of a token is the one it had at sampling time), and
* a 4D additive attention mask built from ``segment_ids``
  (:func:`segment_attention_mask`): query i attends to key j only when
  j <= i and both are in the same segment (block-diagonal causal; 0 where
  allowed, the dtype's lowest value elsewhere). transformers uses a 4D mask
  as given, for the eager and the SDPA attention alike.

No token therefore sees another trajectory (``tests/test_llm.py`` perturbs
segment 0 of a real SmolLM2 row and checks segment 1's logits do not move,
and that they equal the logits of segment 1 run alone).

Targets (docs/PIPELINE.md §11): the logits at input position i predict
``input_ids[i+1]``; every other per-token column is already aligned to that
target, so the trained positions are those with ``action_mask[i] == 1`` and
their target is ``input_ids[i+1]`` (never across a segment end). The
language-model head is applied only at the trained positions (a [N, V]
matrix instead of [T, V]).

Objective: :func:`trajflow.packed.objective` (the Go reference's clipped
surrogate, global denominators, KL, entropy, log-ratio clamp), evaluated row
by row with the weights of the whole batch's denominators and
backpropagated per row (every term is a weighted sum, so the per-row
gradients add up to the batch gradient); the statistics are merged exactly
as one call over all tokens would report them (:func:`merge_stats`). The
behavior transform is :class:`trajflow.model.Behavior` without a grammar
(temperature, then top-k, then top-p: the order the llama.cpp client sends
``samplers``).

Reference log-probs (docs/PIPELINE.md §12: a frozen checkpoint). With
``kl_placement: loss`` the reference is the model of the ``--model`` source
(version 0), held as a frozen copy only then (it doubles the memory);
:meth:`LLMTrainer.update` computes every row's ``ref_logprobs`` with it
once, before the first epoch, exactly as the current log-probs are
computed (same packed-row forward and behavior transform), so on the
initial policy the KL is exactly 0.

Optimizer: Adam in float32 (moments float32, 2 x 4 bytes per parameter:
1.1 GB for SmolLM2-135M), bias-corrected, decoupled weight decay, one
global-norm gradient clip (float64 norm) — the update rule of
``gpu.Trainer.Step`` with float32 instead of float64 moments, evaluated in
place as ``p -= (lr/c1) m1 / (sqrt(m2)/sqrt(c2) + eps)``.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import resource
import shutil
import struct
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import gguf_io as G
from .batches import PackedBatch
from .model import Behavior
from .packed import (KL_LOSS, ObjectiveInputError, Options, attach_reference, gather_target_logprobs, Stats, TokenInputs, global_denominators, lag_stats, objective,
                     sequence_keys, shift_targets, token_weights)
from .update import Adam, StepResult, merge_lag

GGUF_PREFIX = "gguf:"
OPTIM_MAGIC = b"trajflow-adam32/v1"


# ------------------------------------------------------------------ model

def build_model(m: G.GGUFModel, dtype=torch.float32):
    """transformers LlamaForCausalLM with the GGUF's weights (float32)."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = G.hf_config(m)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    sd = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in G.to_hf(m, cfg).items()}
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, assign=True, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise G.GGUFError(f"{m.path}: state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)  # buffers were on the meta device
    model.to(dtype)
    model.eval()  # no dropout (the config has none); training mode is not needed for gradients
    return model


def segment_attention_mask(segment_ids, dtype=torch.float32) -> torch.Tensor:
    """[1, 1, T, T] additive mask: 0 where key j <= query i in the same
    segment, the lowest value of dtype elsewhere."""
    s = torch.as_tensor(np.asarray(segment_ids, dtype=np.int64))
    T = s.shape[0]
    allowed = (s[:, None] == s[None, :]) & torch.ones((T, T), dtype=torch.bool).tril()
    m = torch.zeros((T, T), dtype=dtype)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m[None, None]


def row_hidden(model, input_ids, position_ids, segment_ids, mask: bool = True) -> torch.Tensor:
    """Last hidden states [T, H] of one packed row (per-segment causal
    attention; ``mask=False`` gives plain causal attention over the whole
    row, for the leak test)."""
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
    pos = torch.as_tensor(np.asarray(position_ids, dtype=np.int64))[None]
    dtype = next(model.parameters()).dtype
    if mask:
        am = segment_attention_mask(segment_ids, dtype)
    else:
        T = ids.shape[1]
        am = torch.zeros((T, T), dtype=dtype).masked_fill_(~torch.ones((T, T), dtype=torch.bool).tril(),
                                                           torch.finfo(dtype).min)[None, None]
    out = model.model(input_ids=ids, position_ids=pos, attention_mask=am, use_cache=False)
    return out.last_hidden_state[0]


def row_logits(model, row, at: np.ndarray, mask: bool = True) -> torch.Tensor:
    """Model logits [len(at), V] at positions ``at`` of a packed row."""
    h = row_hidden(model, row.input_ids, row.position_ids, row.segment_ids, mask=mask)
    idx = torch.from_numpy(np.asarray(at, dtype=np.int64))
    return model.lm_head(h.index_select(0, idx))


# ------------------------------------------------------------------ stats

def merge_stats(parts: list[Stats], kl_coef: float, entropy_coef: float) -> Stats:
    """The Stats one objective call over all the tokens of parts would
    report (sums add; means weighted by token counts; min/max)."""
    st = Stats()
    n = sum(p.tokens for p in parts)
    st.tokens = n
    for k in ("policy_loss", "kl", "entropy"):
        setattr(st, k, sum(getattr(p, k) for p in parts))
    for k in ("log_ratio_clamped", "pos_tokens", "neg_tokens", "clipped_pos", "clipped_neg"):
        setattr(st, k, sum(getattr(p, k) for p in parts))
    st.loss = st.policy_loss + kl_coef * st.kl - entropy_coef * st.entropy
    st.approx_kl_old = sum(p.approx_kl_old * p.tokens for p in parts) / n
    st.ratio_mean = sum(p.ratio_mean * p.tokens for p in parts) / n
    st.ratio_min = min(p.ratio_min for p in parts)
    st.ratio_max = max(p.ratio_max for p in parts)
    st.clip_frac_pos = st.clipped_pos / st.pos_tokens if st.pos_tokens else 0.0
    st.clip_frac_neg = st.clipped_neg / st.neg_tokens if st.neg_tokens else 0.0
    return st


QUANTILES = (0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0)


def mismatch_metrics(cur: np.ndarray, old: np.ndarray, versions: np.ndarray) -> dict:
    """Train/inference mismatch (docs/SYSTEMS.md §9) over trained tokens: cur the
    trainer's log-probs recomputed on the stored tokens, old the behavior
    log-probs the inference server recorded. Names follow the anchors:

    * ``rollout_probs_diff_mean|max|std``: verl's
      ``training/rollout_probs_diff_*``, mean/max/std of |exp(old) - exp(cur)|
      (probability space);
    * ``rollout_logprobs_diff_mean|max``: the same in log space,
      |old - cur| in nats;
    * ``mismatch_kl``: prime-rl's ``mismatch_kl`` (token-level k3 of the
      behavior against the trainer): mean(r - 1 - log r), r = exp(cur - old),
      an estimate of KL(behavior || trainer) on behavior samples;
    * ``ratio_quantiles``: quantiles of r = exp(cur - old);
    * per behavior version the same (``by_version``)."""
    cur = np.asarray(cur, dtype=np.float64)
    old = np.asarray(old, dtype=np.float64)
    versions = np.asarray(versions, dtype=np.int64)

    def one(c, o) -> dict:
        lr = c - o
        r = np.exp(lr)
        dp = np.abs(np.exp(o) - np.exp(c))
        dl = np.abs(lr)
        q = np.quantile(r, QUANTILES)
        return {"tokens": int(len(c)), "rollout_probs_diff_mean": float(dp.mean()),
                "rollout_probs_diff_max": float(dp.max()), "rollout_probs_diff_std": float(dp.std(ddof=1)) if len(c) > 1 else 0.0,
                "rollout_logprobs_diff_mean": float(dl.mean()), "rollout_logprobs_diff_max": float(dl.max()),
                "mismatch_kl": float((r - 1 - lr).mean()),
                "ratio_quantiles": {f"p{int(round(p * 100)):02d}" if 0 < p < 1 else ("min" if p == 0 else "max"): float(x)
                                    for p, x in zip(QUANTILES, q)}}
    if len(cur) == 0:
        return {"tokens": 0}
    out = one(cur, old)
    out["by_version"] = {str(int(v)): one(cur[versions == v], old[versions == v]) for v in np.unique(versions)}
    return out


# ----------------------------------------------------------------- policy

class LLMPolicy:
    """A GGUF llama model in PyTorch with the file's metadata (for the
    export) and identity hashes."""

    def __init__(self, model, template: G.GGUFModel, source_path: str, source_hash: str):
        self.model = model
        self.template = template  # fields and tensor order (tensors dropped)
        self.ident = G.identity(template)
        self.cfg = model.config
        self.source_path = source_path
        self.source_hash = source_hash
        self.load_seconds = 0.0

    @classmethod
    def load(cls, path: str, want_hash: Optional[str] = None) -> "LLMPolicy":
        t0 = time.monotonic()
        h = G.file_hash(path)
        if want_hash is not None and h != want_hash:
            raise G.GGUFError(f"{path}: checkpoint hash {h}, the manifest says {want_hash}")
        m = G.read_gguf(path)
        model = build_model(m)
        m.tensors = {}
        p = cls(model, m, path, h)
        p.load_seconds = time.monotonic() - t0
        return p

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Distinct parameters in a fixed order (tied weights once)."""
        seen, out = set(), []
        for n, p in self.model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append((n, p))
        return out

    def state_numpy(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().float().numpy() for k, v in self.model.state_dict().items()}

    def export(self, path: str, dtype: str = "f32") -> None:
        """Writes the current weights as a GGUF (F32 or F16 tensors) with
        the source file's metadata, tokenizer and chat template."""
        G.write_gguf(path, self.template, G.from_hf(self.state_numpy(), self.cfg), dtype=dtype)

    @torch.no_grad()
    def logprobs(self, row, behavior: Optional[Behavior] = None, mask: bool = True) -> np.ndarray:
        """out[i] = log p(input_ids[i+1] | segment prefix) at every position
        with a target in its segment (0 elsewhere), float32, target-aligned;
        under behavior's transform when given (else the raw distribution)."""
        targets = shift_targets(row.input_ids, row.segment_ids)
        at = np.nonzero(targets >= 0)[0]
        out = np.zeros(len(targets), dtype=np.float32)
        if len(at):
            z = row_logits(self.model, row, at, mask=mask)
            if behavior is not None:
                starts = at - np.asarray(row.position_ids, dtype=np.int64)[at]
                z = behavior.transform(z, np.asarray(row.input_ids), starts, at)
            lp = torch.log_softmax(z.double(), dim=-1)
            t = torch.from_numpy(targets[at].astype(np.int64))
            out[at] = lp.gather(1, t[:, None])[:, 0].float().numpy()
        return out


# ---------------------------------------------------------------- trainer

def frozen(model):
    """model with gradients off and in eval mode (a reference policy)."""
    model.requires_grad_(False)
    model.eval()
    return model


class LLMTrainer:
    """The update of a causal LM from packed batches, with the interface of
    trajflow.update.Trainer that the train stage drives.

    reference: the frozen reference model of ``kl_placement: loss`` (the
    weights of version 0, same architecture). When None, the first update
    that needs it takes a copy of the model if nothing was trained yet
    (version 0, no step); a trainer restored at a later version must be
    given it."""

    CHECKPOINT_EXT = ".gguf"

    def __init__(self, policy: LLMPolicy, behavior: Behavior, version: int = 0, export_dtype: str = "f32",
                 reference=None):
        behavior.validate()
        if behavior.grammar is not None:
            raise ValueError("the language-model trainer applies no grammar")
        if reference is not None:
            shapes = lambda m: [(n, tuple(p.shape)) for n, p in m.named_parameters()]  # noqa: E731
            if shapes(reference) != shapes(policy.model):
                raise ValueError("the reference model's parameters are not the trained model's")
            frozen(reference)
        self.reference = reference
        self.policy = policy
        self.model = policy.model
        self.behavior = behavior
        self.version = int(version)
        self.steps = 0
        self.export_dtype = export_dtype
        self.plist = [p for _, p in policy.params()]
        for p in self.plist:
            p.requires_grad_(True)
        self.m1 = [torch.zeros_like(p, dtype=torch.float32) for p in self.plist]
        self.m2 = [torch.zeros_like(p, dtype=torch.float32) for p in self.plist]
        self.timings: dict = {}

    # -- release payloads
    def config_hash(self) -> str:
        return self.policy.ident.model_config_hash

    def checkpoint_payload(self):
        """A writer of this version's checkpoint file: the source file
        itself while nothing was trained (version 0 is the quantized model
        the inference server samples from), else the GGUF export."""
        if self.steps == 0 and self.policy.source_path:
            src = self.policy.source_path
            return lambda path: shutil.copyfile(src, path)
        return lambda path: self.policy.export(path, self.export_dtype)

    def optim_payload(self):
        """A writer of the optimizer state: magic, steps and element count
        (uint64 LE), m1 then m2 (float32 LE, parameter order), SHA-256."""
        def write(path):
            h = hashlib.sha256()
            n = sum(p.numel() for p in self.plist)
            with open(path, "wb") as f:
                def put(b):
                    h.update(b)
                    f.write(b)
                put(OPTIM_MAGIC + struct.pack("<QQ", self.steps, n))
                for ms in (self.m1, self.m2):
                    for m in ms:
                        put(m.detach().contiguous().numpy().astype("<f4", copy=False).tobytes())
                f.write(h.digest())
        return write

    def load_optim(self, path: str) -> None:
        n = sum(p.numel() for p in self.plist)
        want = len(OPTIM_MAGIC) + 16 + 8 * n + 32
        size = os.path.getsize(path)
        if size != want:
            raise ValueError(f"{path}: optimizer state of {size} bytes, want {want}")
        with open(path, "rb") as f:
            b = f.read()
        body = memoryview(b)[:-32]
        if hashlib.sha256(body).digest() != b[-32:]:
            raise ValueError(f"{path}: optimizer state checksum mismatch")
        if bytes(body[:len(OPTIM_MAGIC)]) != OPTIM_MAGIC:
            raise ValueError(f"{path}: not a {OPTIM_MAGIC.decode()} file")
        steps, nn = struct.unpack_from("<QQ", body, len(OPTIM_MAGIC))
        if nn != n:
            raise ValueError(f"{path}: optimizer state for {nn} parameters, the model has {n}")
        off = len(OPTIM_MAGIC) + 16
        for ms in (self.m1, self.m2):
            for m in ms:
                k = m.numel()
                m.copy_(torch.from_numpy(np.frombuffer(b, dtype="<f4", count=k, offset=off).reshape(m.shape).copy()))
                off += 4 * k
        self.steps = int(steps)

    # -- the reference
    def reference_model(self):
        """The frozen reference (version 0): the one given, else a copy of
        the model taken now if it is still the initial policy."""
        if self.reference is None:
            if self.version != 0 or self.steps != 0:
                raise RuntimeError(f"kl_placement 'loss' needs the reference model (version 0); the trainer is at "
                                   f"version {self.version} and was given none")
            self.reference = frozen(copy.deepcopy(self.model))
        return self.reference

    @torch.no_grad()
    def reference_logprobs(self, r, ri: int = 0) -> np.ndarray:
        """ref[i] = log p_ref(input_ids[i+1]) under the behavior transform at
        every trained position i (action_mask[i] == 1), 0 elsewhere (float32,
        target-aligned): the current log-probs of :meth:`step` (same row
        forward, positions, segment mask and transform, float64
        log-softmax rounded to float32) with the reference weights."""
        out = np.zeros(len(r.input_ids), dtype=np.float32)
        tr = self._trained(r, ri)
        if tr is None:
            return out
        at, targets = tr
        z = self._behavior_logits(self.reference_model(), r, at)
        out[at] = gather_target_logprobs(z, torch.from_numpy(targets.astype(np.int64))).float().numpy()
        return out

    def attach_reference(self, batch: PackedBatch, opts: Options) -> None:
        """With ``kl_placement: loss``, sets every row's ``ref_logprobs`` to
        :meth:`reference_logprobs` (replacing any stored ones); otherwise
        leaves the rows as they are and computes nothing."""
        attach_reference(batch.rows, opts, self.reference_logprobs)

    # -- the update
    def _trained(self, r, ri: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The trained positions of a row and their targets (None when it
        has none); ObjectiveInputError for a position without a target or
        a token outside the vocabulary."""
        mask = np.asarray(r.action_mask) == 1
        at = np.nonzero(mask)[0]
        if len(at) == 0:
            return None
        targets = shift_targets(r.input_ids, r.segment_ids)
        if (targets[at] < 0).any():
            i = int(at[np.argmax(targets[at] < 0)])
            raise ObjectiveInputError(f"row {ri}: masked position {i} has no target")
        V = self.model.config.vocab_size
        if (targets[at] >= V).any() or (np.asarray(r.input_ids) < 0).any() or (np.asarray(r.input_ids) >= V).any():
            raise ObjectiveInputError(f"row {ri}: token id outside the vocabulary [0, {V})")
        return at, targets[at]

    def _behavior_logits(self, model, r, at: np.ndarray) -> torch.Tensor:
        """Behavior-transformed logits of model at positions at of a row."""
        raw = row_logits(model, r, at)
        starts = at - np.asarray(r.position_ids, dtype=np.int64)[at]
        return self.behavior.transform(raw, np.asarray(r.input_ids), starts, at)

    def _row_inputs(self, r, ri: int, w: np.ndarray) -> Optional[TokenInputs]:
        tr = self._trained(r, ri)
        if tr is None:
            return None
        at, targets = tr
        z = self._behavior_logits(self.model, r, at)
        ref = None if r.ref_logprobs is None else torch.from_numpy(np.asarray(r.ref_logprobs, np.float32)[at])
        return TokenInputs(logits=z, targets=torch.from_numpy(targets.astype(np.int64)),
                           old=torch.from_numpy(np.asarray(r.old_logprobs, np.float32)[at]), ref=ref,
                           adv=torch.from_numpy(np.asarray(r.advantages, np.float32)[at]),
                           weight=torch.from_numpy(w), versions=torch.from_numpy(np.asarray(r.policy_versions)[at].astype(np.int64)),
                           seq=sequence_keys(r.segment_ids, at))

    def step(self, batch: PackedBatch, opts: Options, adam: Adam) -> StepResult:
        opts.validate()
        adam.validate()
        den = global_denominators(batch.rows)
        if den.tokens == 0:
            raise ObjectiveInputError(f"batch {batch.batch_id} has no trained token")
        weights = token_weights(batch.rows, den, opts.normalization, opts.norm_tokens)
        refs = {r.ref_logprobs is None for r in batch.rows if (np.asarray(r.action_mask) == 1).any()}
        if len(refs) > 1:
            raise ObjectiveInputError("reference log-probs in some rows only")
        t0 = time.monotonic()
        for p in self.plist:
            p.grad = None
        parts, lags, curs, olds, vers = [], [], [], [], []
        for ri, r in enumerate(batch.rows):
            inp = self._row_inputs(r, ri, weights[ri])
            if inp is None:
                continue
            loss, st, cur = objective(inp, opts)
            loss.backward()
            parts.append(st)
            lags.append(lag_stats(cur, inp.old, inp.versions, self.version))
            curs.append(cur.numpy())
            olds.append(inp.old.numpy())
            vers.append(inp.versions.numpy())
        kl_coef = opts.kl_coef if opts.kl_placement == KL_LOSS else 0.0
        st = merge_stats(parts, kl_coef, opts.entropy_coef)
        st.sequences = den.sequences
        t1 = time.monotonic()
        sq = 0.0
        for p in self.plist:
            if p.grad is not None:
                sq += float(torch.linalg.vector_norm(p.grad.reshape(-1), dtype=torch.float64)) ** 2
        norm = math.sqrt(sq)
        if not math.isfinite(norm):
            for p in self.plist:
                p.grad = None
            raise ObjectiveInputError(f"batch {batch.batch_id}: gradient norm {norm}")
        scale = adam.max_grad_norm / norm if adam.max_grad_norm > 0 and norm > adam.max_grad_norm else 1.0
        self.steps += 1
        c1 = 1 - adam.beta1 ** self.steps
        c2 = 1 - adam.beta2 ** self.steps
        sc2 = math.sqrt(c2)
        with torch.no_grad():
            for p, m1, m2 in zip(self.plist, self.m1, self.m2):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if scale != 1.0:
                    g.mul_(scale)
                m1.mul_(adam.beta1).add_(g, alpha=1 - adam.beta1)
                m2.mul_(adam.beta2).addcmul_(g, g, value=1 - adam.beta2)
                # p -= lr (m1/c1) / (sqrt(m2/c2) + eps), in place: one temporary.
                den = m2.sqrt().div_(sc2).add_(adam.eps)
                if adam.weight_decay:
                    p.mul_(1 - adam.lr * adam.weight_decay)
                p.addcdiv_(m1, den, value=-adam.lr / c1)
                p.grad = None
                del den
        t2 = time.monotonic()
        self.timings = {"forward_backward_s": t1 - t0, "optimizer_s": t2 - t1}
        res_timings = dict(self.timings)
        from_v = self.version
        self.version += 1
        res = StepResult(stats=st, lag=merge_lag(lags), grad_norm=norm, grad_scale=scale, rows=len(batch.rows),
                         segments=sum(len(r.segment_lengths) for r in batch.rows),
                         input_tokens=sum(len(r.input_ids) for r in batch.rows), from_version=from_v, version=self.version)
        res.extra = {"mismatch": mismatch_metrics(np.concatenate(curs), np.concatenate(olds), np.concatenate(vers)),
                     "timings": res_timings}
        return res

    def update(self, batch: PackedBatch, opts: Options, adam: Adam, epochs: int) -> tuple[StepResult, Stats]:
        """epochs steps on batch, one policy version; returns the first
        step's metrics (with the train/inference mismatch of the behavior
        log-probs against the recomputation at the version the batch was
        sampled for) and the last step's stats. On an error of a later
        epoch the parameters and moments are restored. With
        ``kl_placement: loss`` the rows' reference log-probs are computed
        first, once (:meth:`attach_reference`): every epoch sees the same
        values."""
        frm, steps = self.version, self.steps
        saved = None
        if epochs > 1:
            saved = ([p.detach().clone() for p in self.plist], [m.clone() for m in self.m1], [m.clone() for m in self.m2])
        t0 = time.monotonic()
        try:
            self.attach_reference(batch, opts)
            first = last = None
            for e in range(max(1, epochs)):
                res = self.step(batch, opts, adam)
                if e == 0:
                    first = res
                last = res.stats
        except Exception:
            if saved is not None and self.steps != steps:
                with torch.no_grad():
                    for p, s in zip(self.plist, saved[0]):
                        p.copy_(s)
                for a, s in zip(self.m1, saved[1]):
                    a.copy_(s)
                for a, s in zip(self.m2, saved[2]):
                    a.copy_(s)
            self.version, self.steps = frm, steps
            raise
        self.version = frm + 1
        first.version = self.version
        first.extra["train_seconds"] = time.monotonic() - t0
        first.extra["trained_tokens"] = first.stats.tokens
        first.extra["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return first, last


# ---------------------------------------------------------------- backend

class LLMBackend:
    """The train stage's policy backend for a GGUF language model
    (trajflow.trainer.TrainStage): version 0 is the GGUF file itself
    (usually quantized: the model the inference server samples from),
    every later version the F32 (or F16) export of the trained weights,
    released as ``policy-vNNNNNNNN.gguf``. Only the newest optimizer state
    is kept (1.1 GB for 135M parameters). With ``kl_placement: loss`` every
    trainer it builds holds the frozen reference: the model of
    ``model_path`` (version 0), loaded again when it restores a later
    version."""

    name = "trajflow.train llm (PyTorch)"
    keep_optim = 1

    def __init__(self, model_path: str, export_dtype: str = "f32"):
        if export_dtype not in ("f32", "f16"):
            raise ValueError(f"export dtype {export_dtype!r}: want f32 or f16")
        self.model_path = model_path
        self.export_dtype = export_dtype

    def _check(self, c, pol: LLMPolicy, what: str) -> None:
        for k in ("tokenizer_hash", "chat_template_hash"):
            got, want = getattr(pol.ident, k), getattr(c.meta, k)
            if want and got != want:
                raise ValueError(f"{what}: {k} {got}, the trainer runs {want}")

    def initial(self, c) -> LLMTrainer:
        pol = LLMPolicy.load(self.model_path)
        self._check(c, pol, self.model_path)
        ref = copy.deepcopy(pol.model) if c.objective.kl_placement == KL_LOSS else None  # LLMTrainer freezes it
        return LLMTrainer(pol, c.behavior, 0, self.export_dtype, reference=ref)

    def _reference(self, c, pol: LLMPolicy):
        """The frozen reference (the model of model_path) when the loss
        needs one; its model config must be the restored policy's."""
        if c.objective.kl_placement != KL_LOSS:
            return None
        ref = LLMPolicy.load(self.model_path)
        self._check(c, ref, self.model_path)
        if ref.ident.model_config_hash != pol.ident.model_config_hash:
            raise ValueError(f"reference {self.model_path}: model config hash {ref.ident.model_config_hash}, "
                             f"the restored policy's is {pol.ident.model_config_hash}")
        return ref.model

    def restore(self, c, rel: dict) -> LLMTrainer:
        from .release import checkpoint_path
        v = rel["policy_version"]
        pol = LLMPolicy.load(checkpoint_path(rel), want_hash=rel["checkpoint_hash"])
        if pol.ident.model_config_hash != rel["model_config_hash"]:
            raise ValueError(f"version {v}: model config hash {pol.ident.model_config_hash}, "
                             f"manifest says {rel['model_config_hash']}")
        self._check(c, pol, f"version {v}")
        return LLMTrainer(pol, c.behavior, v, self.export_dtype, reference=self._reference(c, pol))
