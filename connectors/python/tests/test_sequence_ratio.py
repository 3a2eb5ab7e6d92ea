"""The sequence-level ratio (loss.ratio: sequence; gpu/objective
RatioSequence, gpu/objective/sequence_test.go): every trained token of a
sequence takes exp of the mean log ratio of the sequence's trained tokens;
the gradient reaches each token through its own log-prob only."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trajflow import packed as P

NORMS = (P.TOKEN_MEAN, P.SEQ_MEAN_TOKEN_SUM, P.SEQ_MEAN_TOKEN_MEAN, P.TOKEN_SUM)


def opts_for(norm, **kw):
    return P.Options(clip_low=0.2, clip_high=0.28, normalization=norm, norm_tokens=7 if norm == P.TOKEN_SUM else 0,
                     **kw)


def weights(norm, seq):
    """c_t of the tokens with sequence keys seq (one call = the update)."""
    seq = np.asarray(seq)
    keys, inv, counts = np.unique(seq, return_inverse=True, return_counts=True)
    N, S = len(seq), len(keys)
    if norm == P.TOKEN_MEAN:
        w = np.full(N, 1.0 / N)
    elif norm == P.TOKEN_SUM:
        w = np.full(N, 1.0 / 7)
    elif norm == P.SEQ_MEAN_TOKEN_SUM:
        w = np.full(N, 1.0 / S)
    else:
        w = 1.0 / (counts[inv].astype(np.float64) * S)
    return torch.from_numpy(w)


@pytest.mark.parametrize("lrs,loss,grad,clipped,ratio,tok_loss,tok_clips", [
    # Log ratios 0.2 and 0: the sequence's ratio e^0.1 (inside [0.8,
    # 1.28]) for both tokens; loss -(1/2 + 1/2)·e^0.1, every gradient entry
    # ±0.5·e^0.1·0.5. The token ratio gives -(e^0.2 + 1)/2.
    ((0.2, 0.0), -math.exp(0.1), 0.25 * math.exp(0.1), 0, math.exp(0.1), -(math.exp(0.2) + 1) / 2, 0),
    # Log ratios 0.5 and 0.1: ratio e^0.3 > 1.28 with A > 0, both tokens
    # clipped, loss -1.28, no gradient. The token ratio clips the first only.
    ((0.5, 0.1), -1.28, 0.0, 2, math.exp(0.3), -(1.28 + math.exp(0.1)) / 2, 1),
])
def test_hand_computed(lrs, loss, grad, clipped, ratio, tok_loss, tok_clips):
    """One sequence of two trained tokens, current log-prob log 1/2 each
    (zero logits over V = 2), advantage 1, seq-mean-token-mean, clip
    [0.8, 1.28] (gpu/objective TestSequenceRatioHandComputed)."""
    cur = np.float32(math.log(0.5))
    old = torch.from_numpy(np.array([cur - np.float32(lrs[0]), cur - np.float32(lrs[1])], dtype=np.float32))

    def run(ratio_level):
        z = torch.zeros((2, 2), dtype=torch.float64, requires_grad=True)
        inp = P.TokenInputs(logits=z, targets=torch.tensor([1, 0]), old=old, ref=None,
                            adv=torch.tensor([1.0, 1.0]), weight=torch.tensor([0.5, 0.5], dtype=torch.float64),
                            versions=torch.tensor([0, 0]), seq=torch.tensor([0, 0]))
        l, st, _ = P.objective(inp, opts_for(P.SEQ_MEAN_TOKEN_MEAN, ratio=ratio_level))
        l.backward()
        return l, st, z.grad

    l, st, g = run(P.RATIO_SEQUENCE)
    # The stored old log-probs are float32: the log ratios are the float32
    # differences, within 1e-7 of the decimal ones.
    assert st.loss == pytest.approx(loss, abs=1e-6) and st.policy_loss == st.loss
    assert float(l.detach()) == st.loss
    assert st.clipped_pos == clipped and st.ratio_min == st.ratio_max
    assert st.ratio_mean == pytest.approx(ratio, abs=1e-6)
    want = torch.tensor([[grad, -grad], [-grad, grad]], dtype=torch.float64)
    torch.testing.assert_close(g, want, rtol=0, atol=1e-6)
    _, tok, _ = run(P.RATIO_TOKEN)
    assert tok.loss == pytest.approx(tok_loss, abs=1e-6) and tok.clipped_pos == tok_clips
    _, tok2, _ = run("")
    assert tok2 == tok


def test_gradient_through_own_log_prob_only():
    """Advantages 1 and 3 within one sequence (log ratios 0.2 and 0, as
    above): token t's surrogate gradient is c_t·r·A_t (the other token's
    part of the mean held constant), ±0.25·e^0.1 and ±0.75·e^0.1 per entry,
    not the whole gradient's r/2·Σ c_u A_u = e^0.1 for both."""
    cur = np.float32(math.log(0.5))
    old = torch.from_numpy(np.array([cur - np.float32(0.2), cur], dtype=np.float32))
    z = torch.zeros((2, 2), dtype=torch.float64, requires_grad=True)
    inp = P.TokenInputs(logits=z, targets=torch.tensor([1, 0]), old=old, ref=None,
                        adv=torch.tensor([1.0, 3.0]), weight=torch.tensor([0.5, 0.5], dtype=torch.float64),
                        versions=torch.tensor([0, 0]), seq=torch.tensor([4, 4]))
    loss, st, _ = P.objective(inp, opts_for(P.SEQ_MEAN_TOKEN_MEAN, ratio=P.RATIO_SEQUENCE))
    loss.backward()
    e = math.exp(0.1)
    assert st.loss == pytest.approx(-2 * e, abs=1e-6)
    want = torch.tensor([[0.25 * e, -0.25 * e], [-0.75 * e, 0.75 * e]], dtype=torch.float64)
    torch.testing.assert_close(z.grad, want, rtol=0, atol=1e-6)


def random_tokens(seed, N=12, V=9, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=g)
    cur = torch.log_softmax(z, 1).gather(1, y[:, None]).squeeze(1)
    old = (cur + spread * (2 * torch.rand(N, generator=g, dtype=torch.float64) - 1)).float()
    ref = (cur + 0.2 * torch.randn(N, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(N, generator=g).float()
    return z, y, old, ref, adv


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm", NORMS)
def test_one_token_sequences_equal_token_level(seed, norm):
    """Where every sequence has one trained token its ratio is the token's,
    and the sequence level gives the token level's loss, statistics and
    gradient bit for bit (KL in the loss, entropy bonus and a max_log_ratio
    clamp on; gpu/objective TestSequenceRatioOneTokenSequences)."""
    z, y, old, ref, adv = random_tokens(seed)
    N = len(y)
    seq = torch.from_numpy(np.random.default_rng(seed).permutation(10 * N)[:N].astype(np.int64))
    res = {}
    for level in ("", P.RATIO_SEQUENCE):
        zz = z.clone().requires_grad_(True)
        inp = P.TokenInputs(logits=zz, targets=y, old=old, ref=ref, adv=adv, weight=weights(norm, seq),
                            versions=torch.zeros(N, dtype=torch.int64), seq=seq)
        o = opts_for(norm, kl_placement=P.KL_LOSS, kl_estimator=P.K3, kl_coef=0.1, entropy_coef=0.02,
                     max_log_ratio=0.3, ratio=level)
        loss, st, cur = P.objective(inp, o)
        loss.backward()
        res[level] = (float(loss.detach()), st, cur, zz.grad)
    tok, sq = res[""], res[P.RATIO_SEQUENCE]
    assert tok[1].log_ratio_clamped > 0 and tok[1].clipped_pos + tok[1].clipped_neg > 0  # the problem reaches both
    assert tok[0] == sq[0] and tok[1] == sq[1]
    assert torch.equal(tok[2], sq[2]) and torch.equal(tok[3], sq[3])


@pytest.mark.parametrize("norm", NORMS)
def test_gradient_is_the_whole_gradient_with_sequence_advantages(norm):
    """With an advantage constant over each sequence (GRPO, RLOO) the
    gradient through each token's own log-prob is the whole gradient of the
    loss whose sequence ratio depends on every token of the sequence:
    checked against autograd of that loss in float64 (KL term and entropy
    bonus on; gpu/objective TestSequenceRatioFiniteDifference). The
    objective rounds the current log-probs to float32, hence the
    tolerances."""
    z, y, old, ref, _ = random_tokens(7, N=9, V=6, spread=0.15)
    seq = torch.tensor([5, 5, 5, 2, 2, 9, 9, 9, 9])
    adv = torch.tensor([1.3, 1.3, 1.3, -0.7, -0.7, 0.4, 0.4, 0.4, 0.4])
    w = weights(norm, seq)
    o = opts_for(norm, kl_placement=P.KL_LOSS, kl_estimator=P.K3, kl_coef=0.3, entropy_coef=0.05,
                 ratio=P.RATIO_SEQUENCE)
    zz = z.clone().requires_grad_(True)
    loss, st, _ = P.objective(P.TokenInputs(zz, y, old, ref, adv, w, torch.zeros(9, dtype=torch.int64), seq=seq), o)
    loss.backward()
    assert st.clipped_pos + st.clipped_neg == 0 and st.log_ratio_clamped == 0

    zr = z.clone().requires_grad_(True)
    logp = torch.log_softmax(zr, 1)
    cur = logp.gather(1, y[:, None]).squeeze(1)
    d = cur - old.double()
    lr = torch.zeros_like(d)
    for s in seq.unique():
        sel = seq == s
        lr = torch.where(sel, d[sel].mean(), lr)
    sur = torch.exp(lr) * adv.double()
    k = P.kl_term(P.K3, ref.double() - cur)
    H = -(logp.exp() * logp).sum(1)
    want = -(w * sur).sum() + 0.3 * (w * k).sum() - 0.05 * (w * H).sum()
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    torch.testing.assert_close(zz.grad, zr.grad, rtol=1e-5, atol=1e-7)


def test_ratio_statistics_and_clamp_per_sequence():
    """Every token reports its sequence's ratio (mean/min/max over tokens);
    a clamped sequence passes no surrogate gradient to any of its tokens and
    every token of it counts in log_ratio_clamped; approx_kl_old keeps the
    per-token log ratios."""
    V = 2
    cur = np.float32(math.log(0.5))
    lrs = [0.9, 0.5, 0.0, 0.1, -0.3]  # sequence 0: mean 0.7 (clamped at 0.4); sequence 1: mean -0.0667
    seq = torch.tensor([0, 0, 1, 1, 1])
    old = torch.from_numpy(np.array([cur - np.float32(x) for x in lrs], dtype=np.float32))
    z = torch.zeros((5, V), dtype=torch.float64, requires_grad=True)
    inp = P.TokenInputs(logits=z, targets=torch.zeros(5, dtype=torch.int64), old=old, ref=None,
                        adv=torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0]), weight=torch.full((5,), 0.2, dtype=torch.float64),
                        versions=torch.zeros(5, dtype=torch.int64), seq=seq)
    _, st, _ = P.objective(inp, P.Options(clip_low=0.2, clip_high=0.28, max_log_ratio=0.4, ratio=P.RATIO_SEQUENCE))
    d = (np.float64(cur) - old.double().numpy())
    r1 = math.exp(d[2:].sum() / 3)
    assert st.log_ratio_clamped == 2 and st.clipped_pos == 1 and st.clipped_neg == 0  # e^0.4 > 1.28 with A > 0
    assert st.ratio_max == pytest.approx(math.exp(0.4), rel=1e-15) and st.ratio_min == pytest.approx(r1, rel=1e-15)
    assert st.ratio_mean == pytest.approx((2 * math.exp(0.4) + 3 * r1) / 5, rel=1e-15)
    assert st.approx_kl_old == pytest.approx(float((0.5 * d * d).mean()), rel=1e-15)
    loss, _, _ = P.objective(inp, P.Options(clip_low=0.2, clip_high=0.28, max_log_ratio=0.4, ratio=P.RATIO_SEQUENCE))
    loss.backward()
    assert z.grad[:2].abs().sum() == 0 and (z.grad[2:].abs() > 0).all()


def row(ids, seg, mask, old, adv):
    n = len(ids)
    return SimpleNamespace(input_ids=np.array(ids, np.int32), segment_ids=np.array(seg, np.int32),
                           position_ids=np.zeros(n, np.int32), action_mask=np.array(mask, np.uint8),
                           old_logprobs=np.array(old, np.float32), ref_logprobs=None,
                           advantages=np.array(adv, np.float32), policy_versions=np.zeros(n, np.int64))


def test_sequences_of_rows_are_distinct_and_split_by_rows():
    """masked_token_inputs keys every token by its row and segment (the same
    segment id in two rows is two sequences), and the loss of an update is
    the sum of its rows' calls (the language-model trainer's per-row
    backward)."""
    rows = [row([1, 2, 3, 1, 2], [0, 0, 0, 1, 1], [1, 1, 0, 1, 0], [-1.5, -0.9, 0, -1.2, 0], [1, 1, 0, -0.5, 0]),
            row([3, 1, 2, 2], [0, 0, 0, 0], [1, 1, 1, 0], [-0.7, -1.8, -1.0, 0], [0.8, 0.8, 0.8, 0])]
    g = torch.Generator().manual_seed(3)
    zs = [torch.randn(len(r.input_ids), 4, generator=g, dtype=torch.float64) for r in rows]
    o = opts_for(P.SEQ_MEAN_TOKEN_MEAN, ratio=P.RATIO_SEQUENCE, entropy_coef=0.01)
    whole = P.masked_token_inputs(rows, zs, o.normalization)
    assert whole.seq.tolist() == [0, 0, 1, 5, 5, 5]
    lw, sw, _ = P.objective(whole, o)
    den = P.global_denominators(rows)
    total, ratios = 0.0, []
    for r, z in zip(rows, zs):
        part = P.masked_token_inputs([r], [z], o.normalization, den=den)
        l, s, _ = P.objective(part, o)
        total += float(l.detach())
        ratios += [s.ratio_min, s.ratio_max]
    assert float(lw.detach()) == pytest.approx(total, rel=1e-12)
    assert sw.ratio_min == min(ratios) and sw.ratio_max == max(ratios)
    # One key for both rows would make them one sequence: another loss.
    merged = P.masked_token_inputs(rows, zs, o.normalization)
    merged.seq = torch.zeros_like(merged.seq)
    assert float(P.objective(merged, o)[0].detach()) != pytest.approx(total, rel=1e-6)


def test_sequence_ratio_needs_sequence_keys():
    z, y, old, ref, adv = random_tokens(1, N=3)
    inp = P.TokenInputs(z, y, old, None, adv, torch.full((3,), 1 / 3, dtype=torch.float64), torch.zeros(3, dtype=torch.int64))
    P.objective(inp, P.Options())  # the token level reads no key
    with pytest.raises(P.ObjectiveInputError, match="sequence"):
        P.objective(inp, P.Options(ratio=P.RATIO_SEQUENCE))
    inp.seq = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(P.ObjectiveInputError, match="sequence keys"):
        P.objective(inp, P.Options(ratio=P.RATIO_SEQUENCE))


@pytest.mark.parametrize("kw", [
    dict(ratio=P.RATIO_SEQUENCE, off_policy=P.OFF_TIS, is_cap=2.0),
    dict(ratio=P.RATIO_SEQUENCE, off_policy=P.OFF_DECOUPLED),
    dict(ratio="seq"),
    dict(ratio="Sequence"),
])
def test_options_refused(kw):
    """The sequence level with an off-policy correction (not implemented)
    and an unknown level (gpu/objective TestSequenceRatioOptions)."""
    with pytest.raises(ValueError, match="ratio"):
        P.Options(clip_low=0.2, clip_high=0.2, normalization=P.TOKEN_MEAN, **kw).validate()


@pytest.mark.parametrize("level", ["", P.RATIO_TOKEN, P.RATIO_SEQUENCE])
def test_options_accepted(level):
    P.Options(clip_low=0.2, clip_high=0.2, normalization=P.TOKEN_MEAN, ratio=level).validate()
    P.Options(ratio=level, off_policy=P.OFF_NONE).validate()
