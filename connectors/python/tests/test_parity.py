"""Parity of the PyTorch port with the Go CPU reference trainer.

The fixtures under testdata/parity are written by gpu/parity_fixture_test.go
(and checked against the Go trainer there, so they cannot drift). Tolerances
(fp32; the Go reference accumulates every dot product in float32 in index
order, PyTorch's autograd in its own order):

  * forward log-probs of the initial policy: bit-identical (exact forward),
    so ratio == 1 and approx KL == 0 exactly at the first step; after a step
    the parameters differ by fp32 rounding, and so do the log-probs
    (abs 1e-5);
  * loss, policy loss, KL, entropy: relative 1e-6 of max(|go|, 1e-3);
    counts (tokens, clipped, clamped) exactly;
  * gradient: max |py - go| <= 2e-6 · max|go|, relative L2 <= 1e-5;
  * parameters after each step: relative L2 <= 1e-6 and max |py - go| <=
    5e-6. The max is set by Adam, not by the model: a first Adam step is
    lr·g/(|g| + eps), whose sensitivity to g is lr·eps/(|g| + eps)², largest
    where |g| is near eps. There the gradient is a sum with cancellation and
    its fp32 accumulation order moves it by ~1e-11 absolute (up to 1e-3
    relative for |g| ~ 2e-8), which moves the parameter by ~1e-6.
"""

import json

import numpy as np
import pytest

from conftest import PARITY
from trajflow.batches import decode_packed_batch
from trajflow.model import Behavior, WindowMLP, grammar_from_id, load_checkpoint
from trajflow.packed import Options
from trajflow.update import Adam, Trainer

CASES = sorted(p.name for p in PARITY.iterdir() if (p / "expected.json").exists())

REL_STATS = 1e-6
GRAD_MAX_REL = 2e-6
GRAD_L2 = 1e-5
PARAM_ABS = 5e-6
PARAM_L2 = 1e-6
LOGPROB_ABS = 1e-5

MEASURED = {}


def f32(path):
    return np.fromfile(path, dtype="<f4")


def load_case(name):
    d = PARITY / name
    fx = json.loads((d / "expected.json").read_text())
    cfg, p0 = load_checkpoint((d / fx["init_file"]).read_bytes())
    b = fx["behavior"]
    beh = Behavior(b["temperature"], b["top_k"], b["top_p"], grammar_from_id(fx["grammar"]))
    o = fx["objective"]
    opts = Options(**o)
    a = fx["adam"]
    adam = Adam(a["lr"], a["beta1"], a["beta2"], a["eps"], a["weight_decay"], a["max_grad_norm"])
    batch = decode_packed_batch((d / fx["batch_file"]).read_bytes(), check_header=False)
    return d, fx, cfg, p0, beh, opts, adam, batch


def test_cases_present():
    assert len(CASES) >= 4, CASES


@pytest.mark.parametrize("name", CASES)
def test_parity(name):
    d, fx, cfg, p0, beh, opts, adam, batch = load_case(name)
    tr = Trainer(WindowMLP(cfg, p0), beh, version=0)
    worst = {}
    for s, want in enumerate(fx["steps"]):
        # Forward: log-probs of every target (trained or context)
        # bit-identical to Go's.
        for ri, row in enumerate(batch.rows):
            go_cur = np.frombuffer(bytes.fromhex(want["cur_logprobs_f32le"][ri]), dtype="<f4")
            cur = tr.logprobs_for_training(row)
            if s == 0:
                np.testing.assert_array_equal(cur, go_cur, err_msg=f"row {ri}: log-probs of the initial policy differ from Go's")
            else:
                err = np.abs(cur.astype(np.float64) - go_cur).max()
                worst["logprob_abs_later"] = max(worst.get("logprob_abs_later", 0), err)
                assert err <= LOGPROB_ABS, (s, ri, err)
        res = tr.step(batch, opts, adam, keep_grad=True)
        m = want["metrics"]
        st = res.stats.to_dict()
        if s == 0 and (not fx.get("off_policy_batch") or opts.off_policy == "decoupled"):
            # On policy, or clipped against the proximal policy (the
            # current one at the first step): the ratio is exactly 1.
            assert st["ratio_min"] == 1.0 and st["ratio_max"] == 1.0 and st["ratio_mean"] == 1.0
        if s == 0 and not fx.get("off_policy_batch"):
            assert st["approx_kl_old"] == 0.0
            assert all(l["k3"] == 0.0 and l["approx_kl"] == 0.0 for l in res.lag)
        for k in ("tokens", "sequences", "log_ratio_clamped", "pos_tokens", "neg_tokens", "clipped_pos", "clipped_neg",
                  "is_truncated"):
            assert st[k] == m.get(k, 0), (s, k, st[k], m.get(k, 0))
        for k in ("loss", "policy_loss", "kl", "entropy", "approx_kl_old", "ratio_mean", "ratio_min", "ratio_max",
                  "clip_frac_pos", "clip_frac_neg", "is_weight_mean", "is_weight_max"):
            err = abs(st[k] - m.get(k, 0)) / max(abs(m.get(k, 0)), 1e-3)
            worst[k] = max(worst.get(k, 0), err)
            assert err <= REL_STATS, (s, k, st[k], m[k], err)
        assert [l["lag"] for l in res.lag] == [l["lag"] for l in m["lag"]]
        assert [l["tokens"] for l in res.lag] == [l["tokens"] for l in m["lag"]]
        for k in ("grad_norm",):
            err = abs(res.grad_norm - m[k]) / m[k]
            worst["grad_norm"] = max(worst.get("grad_norm", 0), err)
            assert err <= GRAD_L2
        assert (res.grad_scale == 1.0) == (m["grad_scale"] == 1.0)
        assert res.rows == m["rows"] and res.segments == m["segments"] and res.input_tokens == m["input_tokens"]
        go_g = f32(d / want["grad_file"]).astype(np.float64)
        g = res.grad.double().numpy()
        gmax = np.abs(g - go_g).max() / np.abs(go_g).max()
        gl2 = np.linalg.norm(g - go_g) / np.linalg.norm(go_g)
        worst["grad_max_rel"] = max(worst.get("grad_max_rel", 0), gmax)
        worst["grad_l2"] = max(worst.get("grad_l2", 0), gl2)
        assert gmax <= GRAD_MAX_REL, (s, gmax)
        assert gl2 <= GRAD_L2, (s, gl2)
        go_p = f32(d / want["params_file"]).astype(np.float64)
        p = tr.model.flat.detach().double().numpy()
        pabs = np.abs(p - go_p).max()
        pl2 = np.linalg.norm(p - go_p) / np.linalg.norm(go_p)
        worst["param_abs"] = max(worst.get("param_abs", 0), pabs)
        worst["param_l2"] = max(worst.get("param_l2", 0), pl2)
        assert pabs <= PARAM_ABS, (s, pabs)
        assert pl2 <= PARAM_L2, (s, pl2)
    MEASURED[name] = worst
    print(f"\nparity {name}: " + " ".join(f"{k}={v:.2e}" for k, v in sorted(worst.items())))
