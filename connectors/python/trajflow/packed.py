"""Packed rows on the training side (docs/PIPELINE.md §11–§13): attention masks,
position checks, target alignment, and the policy objective of
gpu/objective.

Alignment (schemas.PackedRow). ``input_ids``, ``position_ids`` and
``segment_ids`` are indexed by input position i. Every other per-token
column (action_mask, old/ref log-probs, advantages, policy_versions, ...)
is already aligned to the next-token target: entry i describes the
prediction made at position i of ``input_ids[i+1]``. So the logits at i are
gathered at ``input_ids[i+1]`` and combined with entry i of those columns
directly — never shifted again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, asdict
from typing import Optional, Sequence

import numpy as np
import torch

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
TOKEN_SUM = "token-sum"  # token sum / norm_tokens, a declared constant
NORMALIZATIONS = (TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_MEAN, TOKEN_SUM)
K1, K2, K3 = "k1", "k2", "k3"
KL_NONE, KL_LOSS, KL_REWARD = "none", "loss", "reward"
# Off-policy corrections (gpu/objective OffPolicy*).
OFF_NONE, OFF_TIS, OFF_DECOUPLED = "none", "tis", "decoupled"
# Ratio levels (gpu/objective Ratio*): every token's own ratio (the
# default; "" too), or its sequence's, exp of the mean log ratio over the
# sequence's trained tokens (GSPO's token form).
RATIO_TOKEN, RATIO_SEQUENCE = "token", "sequence"
NO_TARGET = -1


class ObjectiveInputError(ValueError):
    """A batch the objective cannot use (gpu/objective ErrInput, ErrTarget,
    ErrShape): the train stage refuses it as untrainable_batch."""


# ------------------------------------------------------------- attention

def segment_causal_mask(segment_ids: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Boolean attention mask [T, T] of one packed row: True where query i
    may attend to key j, i.e. j <= i and segment_ids[j] == segment_ids[i]
    (block-diagonal causal; no attention across segments). For a batch
    [B, T] it returns [B, T, T]."""
    s = torch.as_tensor(np.asarray(segment_ids) if not isinstance(segment_ids, torch.Tensor) else segment_ids)
    T = s.shape[-1]
    same = s.unsqueeze(-1) == s.unsqueeze(-2)
    causal = torch.ones((T, T), dtype=torch.bool).tril()
    return same & causal


def check_position_restart(position_ids, segment_ids) -> None:
    """Raises ValueError unless positions restart at 0 exactly at every
    segment start and count up by one inside a segment."""
    from .model import check_positions, ShapeError
    try:
        check_positions(np.asarray(position_ids), np.asarray(segment_ids))
    except ShapeError as e:
        raise ValueError(str(e)) from None


def shift_targets(input_ids, segment_ids=None) -> np.ndarray:
    """targets[i] = input_ids[i+1] when i+1 is in i's segment, else -1
    (gpu/objective ShiftTargets): logits at i predict input_ids[i+1]."""
    x = np.asarray(input_ids, dtype=np.int32)
    out = np.full(len(x), NO_TARGET, dtype=np.int32)
    if len(x) > 1:
        out[:-1] = x[1:]
        if segment_ids is not None:
            s = np.asarray(segment_ids)
            if len(s) != len(x):
                raise ObjectiveInputError(f"{len(s)} segment ids for {len(x)} input ids")
            out[:-1][s[1:] != s[:-1]] = NO_TARGET
    return out


def gather_target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, targets[i]] in float64 ([T, V] -> [T]); 0 where
    targets[i] < 0."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    safe = targets.clamp(min=0).long()
    out = lp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(targets >= 0, out, torch.zeros((), dtype=out.dtype))


# ------------------------------------------------------------- objective

@dataclass
class Options:
    """gpu/objective Options (the contract's loss section)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    normalization: str = TOKEN_MEAN
    kl_placement: str = KL_NONE
    kl_estimator: str = ""
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    norm_tokens: int = 0
    max_log_ratio: float = 0.0
    off_policy: str = ""
    is_cap: float = 0.0
    # The ratio level: "" or RATIO_TOKEN, or RATIO_SEQUENCE (no off-policy
    # correction with it).
    ratio: str = ""

    def sequence_ratio(self) -> bool:
        return self.ratio == RATIO_SEQUENCE

    def corrected(self) -> bool:
        return self.off_policy not in ("", OFF_NONE)

    def validate(self) -> None:
        fin = lambda x: not (math.isnan(x) or math.isinf(x))  # noqa: E731
        if not fin(self.clip_low) or not (0 <= self.clip_low < 1):
            raise ValueError(f"objective: clip_low {self.clip_low} not in [0, 1)")
        if not fin(self.clip_high) or self.clip_high < 0:
            raise ValueError(f"objective: clip_high {self.clip_high} not finite and >= 0")
        for k in ("kl_coef", "entropy_coef", "max_log_ratio"):
            v = getattr(self, k)
            if not fin(v) or v < 0:
                raise ValueError(f"objective: {k} {v} not finite and >= 0")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"objective: normalization {self.normalization!r}")
        if (self.normalization == TOKEN_SUM) != (self.norm_tokens > 0) or self.norm_tokens < 0:
            raise ValueError(f"objective: norm_tokens {self.norm_tokens} with normalization {self.normalization!r}: "
                             f"want > 0 with {TOKEN_SUM} and 0 otherwise")
        if self.kl_placement not in ("", KL_NONE, KL_LOSS, KL_REWARD):
            raise ValueError(f"objective: kl_placement {self.kl_placement!r}")
        if self.kl_estimator not in ("", K1, K2, K3):
            raise ValueError(f"objective: kl_estimator {self.kl_estimator!r}")
        if self.kl_placement == KL_LOSS and not self.kl_estimator:
            raise ValueError("objective: kl_placement 'loss' needs kl_estimator")
        if not fin(self.is_cap) or (self.is_cap != 0 and self.is_cap < 1):
            raise ValueError(f"objective: is_cap {self.is_cap}: want 0 or a finite cap >= 1")
        if self.off_policy in ("", OFF_NONE):
            if self.is_cap != 0:
                raise ValueError(f"objective: is_cap {self.is_cap} without an off_policy correction")
        elif self.off_policy == OFF_TIS:
            if self.is_cap <= 0:
                raise ValueError("objective: off_policy 'tis' needs is_cap > 0")
        elif self.off_policy != OFF_DECOUPLED:
            raise ValueError(f"objective: off_policy {self.off_policy!r}")
        if self.ratio == RATIO_SEQUENCE:
            if self.corrected():
                raise ValueError(f"objective: ratio {RATIO_SEQUENCE!r} with off_policy {self.off_policy!r} "
                                 "is not implemented")
        elif self.ratio not in ("", RATIO_TOKEN):
            raise ValueError(f"objective: ratio {self.ratio!r} (want {RATIO_TOKEN!r} or {RATIO_SEQUENCE!r})")


@dataclass
class Denominators:
    """Global normalizers of one update (gpu/objective Denominators)."""

    tokens: int = 0
    sequences: int = 0


def segment_counts(mask: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    mask = np.asarray(mask)
    seg = np.asarray(segment_ids)
    T = len(mask)
    if len(seg) != T:
        raise ObjectiveInputError(f"{len(seg)} segment ids for {T} mask entries")
    if T and (seg.min() < 0 or seg.max() >= T):
        i = int(np.argmax((seg < 0) | (seg >= T)))
        raise ObjectiveInputError(f"segment id {seg[i]} at position {i} not in [0, {T})")
    bad = (mask != 0) & (mask != 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ObjectiveInputError(f"action mask {mask[i]} at position {i} (want 0 or 1)")
    return np.bincount(seg[mask == 1], minlength=(int(seg.max()) + 1) if T else 0)


def global_denominators(rows: Sequence) -> Denominators:
    """Masked tokens and sequences with at least one, over every row of the
    update (gpu/objective GlobalDenominators)."""
    d = Denominators()
    for r in rows:
        c = segment_counts(r.action_mask, r.segment_ids)
        d.tokens += int(c.sum())
        d.sequences += int((c > 0).sum())
    return d


@dataclass
class Stats:
    """gpu/objective Stats, same names and meaning."""

    loss: float = 0.0
    policy_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    tokens: int = 0
    sequences: int = 0
    approx_kl_old: float = 0.0
    ratio_mean: float = 0.0
    ratio_min: float = 0.0
    ratio_max: float = 0.0
    log_ratio_clamped: int = 0
    pos_tokens: int = 0
    neg_tokens: int = 0
    clipped_pos: int = 0
    clipped_neg: int = 0
    clip_frac_pos: float = 0.0
    clip_frac_neg: float = 0.0
    is_weight_mean: float = 0.0
    is_weight_max: float = 0.0
    is_truncated: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenInputs:
    """The masked tokens of a whole update, concatenated over rows: logits
    [N, V] (behavior logits of the current policy at the masked positions),
    and per token the target, old/ref log-probs, advantage, normalization
    weight c_t, policy version; and the sequence each token belongs to."""

    logits: torch.Tensor
    targets: torch.Tensor
    old: torch.Tensor
    ref: Optional[torch.Tensor]
    adv: torch.Tensor
    weight: torch.Tensor
    versions: torch.Tensor
    # Proximal log-probs (the decoupled objective): the policy at the start
    # of the update; None means the current log-probs (ratio exactly 1).
    prox: Optional[torch.Tensor] = None
    # The sequence (packed segment) of each token: an int64 key, equal for
    # the tokens of one sequence and distinct across sequences (e.g. the
    # row's offset in the update plus the segment id: sequence_keys). Only
    # the sequence-level ratio reads it (required there).
    seq: Optional[torch.Tensor] = None


def token_weights(rows: Sequence, den: Denominators, normalization: str, norm_tokens: int = 0) -> list[np.ndarray]:
    """c_t for the masked tokens of each row, in position order:
    token-mean 1/N_tok, seq-mean-token-sum 1/N_seq, seq-mean-token-mean
    1/(n_s N_seq) with n_s the masked tokens of t's segment, token-sum
    1/norm_tokens."""
    if normalization == TOKEN_SUM and norm_tokens <= 0:
        raise ValueError(f"objective: {TOKEN_SUM} needs norm_tokens > 0, got {norm_tokens}")
    out = []
    for r in rows:
        m = np.asarray(r.action_mask) == 1
        if normalization == TOKEN_MEAN:
            w = np.full(int(m.sum()), 1.0 / den.tokens)
        elif normalization == TOKEN_SUM:
            w = np.full(int(m.sum()), 1.0 / norm_tokens)
        elif normalization == SEQ_MEAN_TOKEN_SUM:
            w = np.full(int(m.sum()), 1.0 / den.sequences)
        else:
            c = segment_counts(r.action_mask, r.segment_ids)
            seg = np.asarray(r.segment_ids)[m]
            w = 1.0 / (c[seg].astype(np.float64) * float(den.sequences))
        out.append(w)
    return out


def sequence_keys(segment_ids, at: np.ndarray, offset: int = 0) -> torch.Tensor:
    """TokenInputs.seq of a row's trained positions at: offset + the
    segment id. With offset the sum of the lengths of the rows before it
    in the update the keys of every row are distinct (segment ids lie in
    [0, T) of their row)."""
    return torch.from_numpy(np.asarray(segment_ids, dtype=np.int64)[at] + int(offset))


def masked_token_inputs(rows: Sequence, logits_rows: Sequence[torch.Tensor], normalization: str,
                        den: Optional[Denominators] = None, norm_tokens: int = 0) -> TokenInputs:
    """TokenInputs of an update for any causal model: logits_rows[k] is
    [T_k, V], the (behavior-transformed) logits of row k at every input
    position, where the logits at i predict input_ids[i+1]. It keeps the
    trained positions i (action_mask[i] == 1), their targets
    input_ids[i+1], and entry i of the target-aligned columns (old/ref
    log-probs, advantages, policy versions) — no further shift. The
    weights use the global denominators of all rows (computed when den is
    None). Gathers index the logits (differentiable); the columns are
    copied into new tensors (one small gather each)."""
    den = den or global_denominators(rows)
    weights = token_weights(rows, den, normalization, norm_tokens)
    parts = []
    offset = 0
    for k, (r, z) in enumerate(zip(rows, logits_rows)):
        T = len(r.input_ids)
        if z.shape[0] != T:
            raise ObjectiveInputError(f"row {k}: logits for {z.shape[0]} positions, row has {T}")
        at = np.nonzero(np.asarray(r.action_mask) == 1)[0]
        t = shift_targets(r.input_ids, r.segment_ids)[at]
        if (t < 0).any():
            raise ObjectiveInputError(f"row {k}: a trained position has no target in its segment")
        idx = torch.from_numpy(at.astype(np.int64))
        parts.append((z.index_select(0, idx), torch.from_numpy(t.astype(np.int64)),
                      torch.from_numpy(np.asarray(r.old_logprobs, dtype=np.float32)[at]),
                      None if r.ref_logprobs is None else torch.from_numpy(np.asarray(r.ref_logprobs, np.float32)[at]),
                      torch.from_numpy(np.asarray(r.advantages, dtype=np.float32)[at]),
                      torch.from_numpy(weights[k]),
                      torch.from_numpy(np.asarray(r.policy_versions)[at].astype(np.int64)),
                      sequence_keys(r.segment_ids, at, offset)))
        offset += T
    refs = [p[3] for p in parts]
    if any(x is None for x in refs) and not all(x is None for x in refs):
        raise ObjectiveInputError("reference log-probs in some rows only")
    cat = lambda j: torch.cat([p[j] for p in parts])  # noqa: E731
    return TokenInputs(logits=cat(0), targets=cat(1), old=cat(2), ref=None if refs[0] is None else cat(3),
                       adv=cat(4), weight=cat(5), versions=cat(6), seq=cat(7))


def sequence_log_ratios(lr: torch.Tensor, seq: Optional[torch.Tensor]) -> torch.Tensor:
    """Per token, the mean of lr (float64, no gradient) over the tokens of
    its sequence (equal keys in seq): summed in token order in float64 from
    0, then divided by the sequence's token count, as gpu/objective
    sequenceLogRatios does."""
    N = lr.shape[0]
    if seq is None:
        raise ObjectiveInputError(f"ratio {RATIO_SEQUENCE!r} without the tokens' sequences (TokenInputs.seq)")
    key = np.asarray(seq.detach().cpu().numpy() if isinstance(seq, torch.Tensor) else seq).astype(np.int64)
    if key.shape != (N,):
        raise ObjectiveInputError(f"{key.shape} sequence keys for {N} tokens")
    _, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    x = lr.detach().double().cpu().numpy()
    sums = np.zeros(int(inv.max()) + 1, dtype=np.float64)
    np.add.at(sums, inv, x)  # unbuffered, in token order
    counts = np.bincount(inv).astype(np.float64)
    return torch.from_numpy(sums / counts)[torch.from_numpy(inv)]


def attach_reference(rows: Sequence, opts: "Options", reference_logprobs) -> None:
    """With ``kl_placement: loss``, sets every row's ``ref_logprobs`` to
    ``reference_logprobs(row, row_index)`` (replacing any stored ones), all
    rows computed before any is set; otherwise leaves the rows as they are
    and computes nothing. The trainers' reference is their initial policy
    (docs/PIPELINE.md §12)."""
    if opts.kl_placement != KL_LOSS:
        return
    refs = [reference_logprobs(r, ri) for ri, r in enumerate(rows)]
    for r, ref in zip(rows, refs):
        r.ref_logprobs = ref


def kl_term(est: str, logr: torch.Tensor) -> torch.Tensor:
    """KL(pi || ref) estimators at logr = ref - cur: k1 = -logr,
    k2 = logr^2/2, k3 = exp(logr) - 1 - logr."""
    if est == K1:
        return -logr
    if est == K2:
        return logr * logr / 2
    return torch.exp(logr) - 1 - logr


def objective(inp: TokenInputs, opts: Options) -> tuple[torch.Tensor, Stats, torch.Tensor]:
    """The loss of gpu/objective Compute over the masked tokens of an update
    (global denominators already in ``inp.weight``). Returns (loss, stats,
    cur) where loss is a float64 scalar to backpropagate and cur the current
    log-probs (float32 values). Per masked token t:

        cur_t = float32(log_softmax(z_t)[y_t])
        lr_t  = clamp(cur_t - old_t, ±max_log_ratio)  (no clamp when 0)
        r_t   = exp(lr_t)
        s_t   = min(r_t A_t, clamp(r_t, 1-clip_low, 1+clip_high) A_t)

    with an off-policy correction (gpu/objective Compute): tis
    s_t = sg(w_t/r_t)·r_t·A_t, w_t = min(r_t, is_cap); decoupled
    s_t = w_t·min(q_t A_t, clamp(q_t, ...) A_t) with w_t = min(exp(prox_t -
    old_t), is_cap) (no cap when 0) and q_t = exp(cur_t - prox_t), prox
    being inp.prox or, when None, cur itself (q exactly 1).
        loss  = -Σ c_t s_t + kl_coef·Σ c_t k(ref_t - cur_t)·[placement loss]
                - entropy_coef·Σ c_t H_t

    With the sequence-level ratio (opts.ratio "sequence"), lr_t is
    clamp(lr_s, ±max_log_ratio) for the sequence s of t (inp.seq), lr_s the
    mean of cur_u - old_u over the tokens u of s; its gradient reaches t
    through cur_t only (d lr_t/d cur_t = 1: the other tokens' part of the
    mean held constant, GSPO's token form). Clipping, the ratio statistics
    and log_ratio_clamped count per token, each with its sequence's ratio;
    approx_kl_old keeps the tokens' own cur_t - old_t.

    Gradient conventions of the Go reference: the clipped branch passes no
    gradient where it is strictly smaller (r > 1+clip_high with A > 0,
    r < 1-clip_low with A < 0; a token exactly on a bound counts as
    unclipped), nor where max_log_ratio clamped; the KL and entropy terms
    always pass gradient."""
    opts.validate()
    z = inp.logits.double()
    y = inp.targets.long()
    N, V = z.shape
    if N == 0:
        raise ObjectiveInputError("no trained token")
    if (y < 0).any() or (y >= V).any():
        raise ObjectiveInputError("masked position without a target in [0, V)")
    if torch.isnan(z).any() or torch.isposinf(z).any():
        raise ObjectiveInputError("NaN or +Inf logit")
    finite = torch.isfinite(z)
    if not finite.any(dim=1).all():
        raise ObjectiveInputError("a position has no finite logit")
    logp = torch.log_softmax(z, dim=1)
    cur64 = logp.gather(1, y.unsqueeze(1)).squeeze(1)
    if torch.isinf(cur64).any():
        raise ObjectiveInputError("a masked target has current log-prob -Inf (outside the behavior support)")
    cur32 = cur64.detach().float()
    cur = cur64 + (cur32.double() - cur64).detach()  # the float32 value, the float64 gradient
    old = inp.old.double()
    adv = inp.adv.double()
    if not (torch.isfinite(old).all() and torch.isfinite(adv).all()):
        raise ObjectiveInputError("non-finite old log-prob or advantage at a masked position")
    w = inp.weight.double()

    lr_raw = cur - old
    M = opts.max_log_ratio

    def clamp(x):
        """The max_log_ratio guard: a clamped log ratio passes no gradient."""
        if M > 0:
            c = (x.detach() > M) | (x.detach() < -M)
            return torch.where(c, x.detach().clamp(-M, M), x), c
        return x, torch.zeros(N, dtype=torch.bool)

    # The surrogate's ratio r is to the behavior policy, or (decoupled) to
    # the proximal policy, whose ratio to the behavior policy is the
    # importance weight iw (a constant).
    iw = torch.ones(N, dtype=torch.float64)
    clamped_w = torch.zeros(N, dtype=torch.bool)
    truncated = torch.zeros(N, dtype=torch.bool)
    base = old
    if opts.off_policy == OFF_DECOUPLED:
        p = cur32.double() if inp.prox is None else inp.prox.double()
        if not torch.isfinite(p).all():
            raise ObjectiveInputError("non-finite proximal log-prob at a masked position")
        lb, clamped_w = clamp(p - old)
        iw = torch.exp(lb.detach())
        if opts.is_cap > 0:
            truncated = iw > opts.is_cap
            iw = torch.where(truncated, torch.full_like(iw, opts.is_cap), iw)
        base = p
    if opts.sequence_ratio():
        # The sequence's log ratio as the value (exactly: cur - sg(cur) is
        # 0), and as the gradient this token's own log-prob.
        lr_seq = sequence_log_ratios(cur32.double() - old, inp.seq)
        lr, clamped = clamp(lr_seq + (cur - cur.detach()))
    else:
        lr, clamped = clamp(cur - base)
    clamped = clamped | clamped_w
    r = torch.exp(lr)
    lo, hi = 1 - opts.clip_low, 1 + opts.clip_high
    rd = r.detach()
    if opts.off_policy == OFF_TIS:
        # The policy gradient weighted by min(r, cap): value iw·A, gradient
        # iw·A·dcur.
        truncated = rd > opts.is_cap
        iw = torch.where(truncated, torch.full_like(rd, opts.is_cap), rd)
        clip_pos = clip_neg = torch.zeros(N, dtype=torch.bool)
        sur = (iw / rd) * r * adv
    else:
        clip_pos = (adv > 0) & (rd > hi)
        clip_neg = (adv < 0) & (rd < lo)
        clipped = clip_pos | clip_neg
        bound = torch.where(clip_pos, torch.full_like(adv, hi), torch.full_like(adv, lo))
        sur = iw * torch.where(clipped, bound * adv, r * adv)

    kl_on = inp.ref is not None and opts.kl_estimator != ""
    kl_loss = opts.kl_placement == KL_LOSS
    if kl_loss and inp.ref is None:
        raise ObjectiveInputError("kl_placement 'loss' without reference log-probs")
    if kl_on:
        ref = inp.ref.double()
        if not torch.isfinite(ref).all():
            raise ObjectiveInputError("non-finite reference log-prob at a masked position")
        k = kl_term(opts.kl_estimator, ref - cur)
    else:
        k = torch.zeros(N, dtype=torch.float64)

    p = torch.exp(logp)
    plogp = torch.where(finite, p * logp.masked_fill(~finite, 0.0), torch.zeros((), dtype=torch.float64))
    H = -plogp.sum(dim=1)

    policy_loss = -(w * sur).sum()
    kl = (w * k).sum()
    entropy = (w * H).sum()
    kl_coef = opts.kl_coef if kl_loss else 0.0
    loss = policy_loss + kl_coef * kl - opts.entropy_coef * entropy

    st = Stats()
    st.tokens = N
    st.policy_loss = float(policy_loss.detach())
    st.kl = float(kl.detach())
    st.entropy = float(entropy.detach())
    st.loss = st.policy_loss + kl_coef * st.kl - opts.entropy_coef * st.entropy
    st.approx_kl_old = float((0.5 * lr_raw.detach() ** 2).mean())
    st.ratio_mean = float(rd.mean())
    st.ratio_min = float(rd.min())
    st.ratio_max = float(rd.max())
    st.log_ratio_clamped = int(clamped.sum())
    st.pos_tokens = int((adv > 0).sum())
    st.neg_tokens = int((adv < 0).sum())
    st.clipped_pos = int(clip_pos.sum())
    st.clipped_neg = int(clip_neg.sum())
    st.clip_frac_pos = st.clipped_pos / st.pos_tokens if st.pos_tokens else 0.0
    st.clip_frac_neg = st.clipped_neg / st.neg_tokens if st.neg_tokens else 0.0
    if opts.corrected():
        st.is_weight_mean = float(iw.mean())
        st.is_weight_max = float(iw.max())
        st.is_truncated = int(truncated.sum())
    return loss, st, cur32


# gpu/objective MaxReportedLogRatio: the reported ratios saturate at
# exp(600), so the statistics stay finite and an update record (JSON
# without infinities) carries them; the loss clamps far lower.
MAX_REPORTED_LOG_RATIO = 600.0


def lag_stats(cur: torch.Tensor, old: torch.Tensor, versions: torch.Tensor, trainer_version: int) -> list[dict]:
    """gpu/objective LagStats over the masked tokens: per lag (trainer
    version - behavior version) the token count, ratio mean/min/max,
    approx KL 0.5·mean(lr²) and k3 mean(r - 1 - lr), increasing lag; a
    log ratio above MAX_REPORTED_LOG_RATIO counts as that in the ratios and
    k3."""
    v = versions.long()
    if (v < 0).any() or (v > trainer_version).any():
        raise ObjectiveInputError(f"behavior version outside [0, {trainer_version}] at a masked position")
    lr = cur.double() - old.double()
    if not torch.isfinite(lr).all():
        raise ObjectiveInputError("non-finite log ratio at a masked position")
    lag = trainer_version - v
    out = []
    for L in sorted(set(lag.tolist())):
        sel = lag == L
        x = lr[sel]
        sat = x.clamp(max=MAX_REPORTED_LOG_RATIO)
        r = torch.exp(sat)
        out.append({"lag": int(L), "tokens": int(sel.sum()), "ratio_mean": float(r.mean()),
                    "ratio_min": float(r.min()), "ratio_max": float(r.max()),
                    "approx_kl": float((0.5 * x * x).mean()), "k3": float((r - 1 - sat).mean())})
    return out
