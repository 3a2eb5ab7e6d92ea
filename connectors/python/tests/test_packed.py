"""Packed-row helpers: the per-segment causal mask (and a leak test in a
tiny attention model), position restarts, target alignment, and the
objective's normalizations, clipping and KL estimators."""

import math

import numpy as np
import pytest
import torch

from conftest import PARITY
from trajflow import packed as P
from trajflow.batches import decode_packed_batch
from trajflow.model import WindowMLP, Config, behavior_logits_row, Behavior

SEG = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2], dtype=np.int32)


def test_mask_is_block_diagonal_causal():
    m = P.segment_causal_mask(SEG)
    T = len(SEG)
    want = np.array([[j <= i and SEG[i] == SEG[j] for j in range(T)] for i in range(T)])
    np.testing.assert_array_equal(m.numpy(), want)
    assert m.shape == (T, T) and m.dtype == torch.bool
    b = P.segment_causal_mask(torch.stack([torch.from_numpy(SEG), torch.zeros(len(SEG), dtype=torch.int32)]))
    assert b.shape == (2, T, T)
    np.testing.assert_array_equal(b[1].numpy(), np.tril(np.ones((T, T), dtype=bool)))


class TinyAttention(torch.nn.Module):
    """One attention layer over a packed row, masked with segment_causal_mask."""

    def __init__(self, vocab=16, d=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(vocab, d, generator=g, dtype=torch.float64))
        self.pos = torch.nn.Parameter(torch.randn(32, d, generator=g, dtype=torch.float64))
        self.q, self.k, self.v, self.o = (torch.nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64))
                                          for _ in range(4))
        self.out = torch.nn.Parameter(torch.randn(d, vocab, generator=g, dtype=torch.float64))

    def forward(self, tokens, positions, segments):
        x = self.emb[tokens] + self.pos[positions]
        s = (x @ self.q) @ (x @ self.k).T / math.sqrt(x.shape[1])
        s = s.masked_fill(~P.segment_causal_mask(segments), float("-inf"))
        h = torch.softmax(s, dim=-1) @ (x @ self.v) @ self.o + x
        return h @ self.out


def positions_of(seg):
    pos = np.zeros(len(seg), dtype=np.int64)
    for i in range(1, len(seg)):
        pos[i] = 0 if seg[i] != seg[i - 1] else pos[i - 1] + 1
    return pos


def test_no_attention_across_segments():
    torch.manual_seed(1)
    model = TinyAttention()
    tok = torch.randint(0, 16, (len(SEG),))
    pos = torch.from_numpy(positions_of(SEG))
    seg = torch.from_numpy(SEG)
    base = model(tok, pos, seg)
    for s in range(3):
        t2 = tok.clone()
        t2[seg == s] = (t2[seg == s] + 5) % 16
        out = model(t2, pos, seg)
        assert not torch.equal(out[seg == s], base[seg == s])  # the perturbation matters...
        for other in {0, 1, 2} - {s}:  # ...only inside its own segment
            assert torch.equal(out[seg == other], base[seg == other]), (s, other)
    # And causality inside a segment: changing the last token of segment 1
    # leaves its earlier positions unchanged.
    t3 = tok.clone()
    t3[8] = (t3[8] + 3) % 16
    out = model(t3, pos, seg)
    assert torch.equal(out[5:8], base[5:8])


def test_window_mlp_does_not_see_other_segments():
    m = WindowMLP(Config(vocab=32, window=6, embed=4, hidden=8), seed=3)
    tok = np.random.default_rng(0).integers(0, 32, len(SEG)).astype(np.int32)
    pos = positions_of(SEG).astype(np.int32)
    at = np.arange(len(SEG))
    base = behavior_logits_row(m, Behavior(), tok, pos, at).detach()
    t2 = tok.copy()
    t2[SEG == 0] = (t2[SEG == 0] + 7) % 32
    out = behavior_logits_row(m, Behavior(), t2, pos, at).detach()
    assert torch.equal(out[SEG != 0], base[SEG != 0])
    assert not torch.equal(out[SEG == 0], base[SEG == 0])


def test_position_restart_check():
    P.check_position_restart(positions_of(SEG), SEG)
    bad = positions_of(SEG)
    bad[5] = 1  # segment 1 does not restart
    with pytest.raises(ValueError):
        P.check_position_restart(bad, SEG)
    bad = positions_of(SEG)
    bad[3] = 4  # a gap inside segment 0
    with pytest.raises(ValueError):
        P.check_position_restart(bad, SEG)


def test_shift_targets_and_gather():
    ids = np.arange(10, 10 + len(SEG), dtype=np.int32)
    t = P.shift_targets(ids, SEG)
    np.testing.assert_array_equal(t[:4], ids[1:5])
    assert t[4] == -1 and t[8] == -1 and t[11] == -1  # segment ends predict nothing
    np.testing.assert_array_equal(t[5:8], ids[6:9])
    # logits at i that put all mass on input_ids[i+1] gather log-prob 0.
    V = 32
    z = torch.full((len(ids), V), -30.0)
    for i, y in enumerate(t):
        if y >= 0:
            z[i, y] = 30.0
    lp = P.gather_target_logprobs(z, torch.from_numpy(t))
    assert (lp[t >= 0].abs() < 1e-20).all() and (lp[t < 0] == 0).all()


def test_packed_columns_are_target_aligned():
    """In Go-packed rows, a trained entry i always has a target input_ids[i+1]
    inside its segment, and its policy version / turn id are set."""
    for case in PARITY.iterdir():
        if not (case / "batch.arrows").exists():
            continue
        b = decode_packed_batch((case / "batch.arrows").read_bytes(), check_header=False)
        for r in b.rows:
            t = P.shift_targets(r.input_ids, r.segment_ids)
            m = r.action_mask == 1
            assert (t[m] >= 0).all()
            assert (r.policy_versions[m] >= 0).all() and (r.turn_ids[m] >= 0).all()
            assert r.action_mask[-1] == 0


def inputs(n=6, V=5, seed=0, ref=True):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g)
    y = torch.randint(0, V, (n,), generator=g)
    old = torch.log_softmax(z.double(), 1).gather(1, y[:, None]).squeeze(1).float() + 0.3 * torch.randn(n, generator=g)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.0, 1.5])[:n]
    r = (old + 0.1 * torch.randn(n, generator=g)) if ref else None
    return z, y, old, adv, r


def test_normalizations_use_global_denominators():
    class Row:
        def __init__(self, mask, seg):
            self.action_mask, self.segment_ids = np.array(mask, np.uint8), np.array(seg, np.int32)
    rows = [Row([1, 1, 0, 1, 0], [0, 0, 0, 1, 1]), Row([1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1])]
    den = P.global_denominators(rows)
    assert (den.tokens, den.sequences) == (7, 4)
    w = P.token_weights(rows, den, P.TOKEN_MEAN)
    assert np.allclose(np.concatenate(w), 1 / 7)
    w = P.token_weights(rows, den, P.SEQ_MEAN_TOKEN_SUM)
    assert np.allclose(np.concatenate(w), 1 / 4)
    w = P.token_weights(rows, den, P.SEQ_MEAN_TOKEN_MEAN)
    np.testing.assert_allclose(w[0], [1 / 8, 1 / 8, 1 / 4])
    np.testing.assert_allclose(w[1], [1 / 4, 1 / 12, 1 / 12, 1 / 12])
    assert math.isclose(sum(x.sum() for x in w), 1.0)
    # token-sum: a declared constant, not the batch's 7 tokens
    w = P.token_weights(rows, den, P.TOKEN_SUM, 28)
    assert np.allclose(np.concatenate(w), 1 / 28) and math.isclose(sum(x.sum() for x in w), 0.25)
    with pytest.raises(ValueError, match="norm_tokens"):
        P.token_weights(rows, den, P.TOKEN_SUM)
    with pytest.raises(ValueError, match="norm_tokens"):
        P.Options(normalization=P.TOKEN_SUM).validate()
    with pytest.raises(ValueError, match="norm_tokens"):
        P.Options(norm_tokens=64).validate()


@pytest.mark.parametrize("norm", P.NORMALIZATIONS)
def test_loss_splits_over_microbatches(norm):
    """With global weights, the losses (and gradients) of two halves add up
    to the loss of the whole."""
    z, y, old, adv, ref = inputs()
    opts = P.Options(clip_low=0.2, clip_high=0.28, normalization=norm, kl_placement="loss", kl_estimator="k3",
                     kl_coef=0.1, entropy_coef=0.05, norm_tokens=64 if norm == P.TOKEN_SUM else 0)
    w = torch.full((6,), 1 / 6, dtype=torch.float64)
    v = torch.zeros(6, dtype=torch.int64)

    def run(sl, zz):
        return P.objective(P.TokenInputs(zz[sl], y[sl], old[sl], ref[sl], adv[sl], w[sl], v[sl]), opts)[0]

    z1 = z.clone().requires_grad_(True)
    whole = run(slice(0, 6), z1)
    whole.backward()
    z2 = z.clone().requires_grad_(True)
    parts = run(slice(0, 3), z2) + run(slice(3, 6), z2)
    parts.backward()
    assert math.isclose(float(whole.detach()), float(parts.detach()), rel_tol=1e-12)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-6, atol=1e-9)


def test_clip_fractions_by_sign_and_clamp():
    V = 3
    z = torch.zeros(4, V)
    y = torch.zeros(4, dtype=torch.int64)
    cur = math.log(1 / 3)
    # ratios 1.5, 0.5, 1.5, exactly the upper bound 1.28
    old = torch.tensor([cur - math.log(1.5), cur - math.log(0.5), cur - math.log(1.5), cur - math.log(1.28)])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    opts = P.Options(clip_low=0.2, clip_high=0.28, normalization=P.TOKEN_MEAN)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    zz = z.clone().requires_grad_(True)
    loss, st, _ = P.objective(P.TokenInputs(zz, y, old, None, adv, w, torch.zeros(4, dtype=torch.int64)), opts)
    assert (st.pos_tokens, st.neg_tokens, st.clipped_pos, st.clipped_neg) == (2, 2, 1, 1)
    assert st.clip_frac_pos == 0.5 and st.clip_frac_neg == 0.5
    loss.backward()
    assert zz.grad[0].abs().sum() == 0 and zz.grad[1].abs().sum() == 0  # clipped: no surrogate gradient
    assert zz.grad[2].abs().sum() > 0 and zz.grad[3].abs().sum() > 0  # unclipped, and exactly on the bound
    opts.max_log_ratio = 0.1
    zz = z.clone().requires_grad_(True)
    loss, st, _ = P.objective(P.TokenInputs(zz, y, old, None, adv, w, torch.zeros(4, dtype=torch.int64)), opts)
    assert st.log_ratio_clamped == 4 and math.isclose(st.ratio_max, math.exp(0.1))
    loss.backward()
    assert zz.grad.abs().sum() == 0


def test_kl_estimators():
    lr = torch.tensor([-0.5, 0.0, 0.7], dtype=torch.float64)
    torch.testing.assert_close(P.kl_term("k1", lr), -lr)
    torch.testing.assert_close(P.kl_term("k2", lr), lr * lr / 2)
    torch.testing.assert_close(P.kl_term("k3", lr), torch.exp(lr) - 1 - lr)
    z, y, old, adv, ref = inputs()
    w = torch.full((6,), 1 / 6, dtype=torch.float64)
    v = torch.zeros(6, dtype=torch.int64)
    for est in ("k1", "k2", "k3"):
        for place, coef in (("none", 0.0), ("loss", 0.3)):
            opts = P.Options(normalization=P.TOKEN_MEAN, kl_placement=place, kl_estimator=est, kl_coef=coef)
            loss, st, cur = P.objective(P.TokenInputs(z, y, old, ref, adv, w, v), opts)
            k = P.kl_term(est, ref.double() - cur.double()).mean()
            assert math.isclose(st.kl, float(k), rel_tol=1e-9)
            assert math.isclose(st.loss, st.policy_loss + coef * st.kl - 0.0, rel_tol=1e-12)
    with pytest.raises(P.ObjectiveInputError):
        P.objective(P.TokenInputs(z, y, old, None, adv, w, v), P.Options(kl_placement="loss", kl_estimator="k1"))


def test_masked_token_inputs_any_model():
    """The generic gather (logits at every position of a row) gives the
    trainer's inputs and loss on a Go-packed batch."""
    import json
    from trajflow.model import grammar_from_id, load_checkpoint
    from trajflow.update import Trainer
    d = PARITY / "seq-mean-token-sum-k3-loss"
    fx = json.loads((d / "expected.json").read_text())
    cfg, p0 = load_checkpoint((d / "init.ckpt").read_bytes())
    b = fx["behavior"]
    beh = Behavior(b["temperature"], b["top_k"], b["top_p"], grammar_from_id(fx["grammar"]))
    batch = decode_packed_batch((d / "batch.arrows").read_bytes(), check_header=False)
    opts = P.Options(**fx["objective"])
    tr = Trainer(WindowMLP(cfg, p0), beh)
    den = P.global_denominators(batch.rows)
    want, _ = tr.token_inputs(batch, opts, den)
    zs = [behavior_logits_row(tr.model, beh, r.input_ids, r.position_ids, np.arange(len(r.input_ids))) for r in batch.rows]
    got = P.masked_token_inputs(batch.rows, zs, opts.normalization)
    for k in ("logits", "targets", "old", "ref", "adv", "weight", "versions", "seq"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k
    l1, s1, _ = P.objective(got, opts)
    l2, s2, _ = P.objective(want, opts)
    assert float(l1.detach()) == float(l2.detach()) == pytest.approx(fx["steps"][0]["metrics"]["loss"], rel=1e-6)


def _one_token(old, prox=None):
    """One token over logits [0, 0] (current probability exactly 1/2),
    advantage +1, weight 1 (gpu/objective TestOffPolicyHandComputed)."""
    return P.TokenInputs(logits=torch.zeros((1, 2), dtype=torch.float64, requires_grad=True),
                         targets=torch.tensor([1]), old=torch.tensor([math.log(old)], dtype=torch.float32),
                         ref=None, adv=torch.tensor([1.0], dtype=torch.float32), weight=torch.tensor([1.0], dtype=torch.float64),
                         versions=torch.tensor([0]),
                         prox=None if prox is None else torch.tensor([math.log(prox)], dtype=torch.float32))


@pytest.mark.parametrize("off,cap,prox,sur,dz,ratio,w,truncated,clipped", [
    ("none", 0, None, 1.28, 0, 2, 0, 0, 1),
    ("tis", 1.5, None, 1.5, -0.75, 2, 1.5, 1, 0),
    ("decoupled", 0, 0.4, 2, -1, 1.25, 1.6, 0, 0),
    ("decoupled", 1.5, 0.4, 1.875, -0.9375, 1.25, 1.5, 1, 0),
    ("decoupled", 0, 0.3, 1.536, 0, 5 / 3, 1.2, 0, 1),
])
def test_off_policy_hand_computed(off, cap, prox, sur, dz, ratio, w, truncated, clipped):
    inp = _one_token(0.25, prox)
    opts = P.Options(clip_low=0.2, clip_high=0.28, off_policy=off, is_cap=cap, max_log_ratio=20)
    loss, st, _ = P.objective(inp, opts)
    loss.backward()
    g = inp.logits.grad[0]
    assert st.policy_loss == pytest.approx(-sur, abs=1e-6)
    assert float(g[1]) == pytest.approx(dz, abs=1e-6) and float(g[0]) == pytest.approx(-dz, abs=1e-6)
    assert st.ratio_mean == pytest.approx(ratio, abs=1e-6) and st.is_weight_mean == pytest.approx(w, abs=1e-6)
    assert st.is_truncated == truncated and st.clipped_pos == clipped


@pytest.mark.parametrize("off,cap", [("tis", 2.0), ("decoupled", 0.0), ("decoupled", 1.0)])
def test_off_policy_ratio_exactly_one_on_policy(off, cap):
    z = torch.tensor([[0.3, -1.2, 0.7], [1.5, 0.1, -0.4]], dtype=torch.float64)
    y = torch.tensor([2, 0])
    cur = torch.log_softmax(z, dim=1).gather(1, y.unsqueeze(1)).squeeze(1).float()
    mk = lambda prox: P.TokenInputs(logits=z, targets=y, old=cur, ref=None,  # noqa: E731
                                    adv=torch.tensor([0.5, -1.0]), weight=torch.tensor([0.5, 0.5], dtype=torch.float64),
                                    versions=torch.tensor([0, 0]), prox=prox)
    _, plain, _ = P.objective(mk(None), P.Options())
    for prox in (None, cur):
        _, st, _ = P.objective(mk(prox), P.Options(off_policy=off, is_cap=cap))
        assert st.ratio_min == st.ratio_max == 1.0 and st.is_weight_mean == st.is_weight_max == 1.0
        assert st.is_truncated == 0 and st.loss == plain.loss


def test_lag_stats_saturate_past_exp_range():
    """As gpu/objective LagStats: ratios saturate at e^600 (k3 with them),
    approx KL keeps the log ratio; a behavior log-prob of -6e29 gives
    finite statistics that JSON without infinities carries."""
    import json
    cur = torch.tensor([0.0, 0.0, -1.0], dtype=torch.float32)
    old = torch.tensor([-600.0, -6e29, -1.5], dtype=torch.float32)
    versions = torch.tensor([3, 3, 2], dtype=torch.int32)
    got = P.lag_stats(cur, old, versions, 3)
    r = math.exp(600)
    lr = -float(np.float32(-6e29))
    assert got[0]["lag"] == 0 and got[0]["tokens"] == 2
    assert got[0]["ratio_max"] == r and got[0]["ratio_min"] == r and got[0]["ratio_mean"] == r
    assert got[0]["k3"] == r - 1 - 600
    assert got[0]["approx_kl"] == pytest.approx((0.5 * 600 * 600 + 0.5 * lr * lr) / 2, rel=1e-15)
    assert got[1] == {"lag": 1, "tokens": 1, "ratio_mean": math.exp(0.5), "ratio_min": math.exp(0.5),
                      "ratio_max": math.exp(0.5), "approx_kl": 0.125, "k3": math.exp(0.5) - 1.5}
    json.dumps(got, allow_nan=False)
