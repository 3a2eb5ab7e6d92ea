"""Reference log-probs of ``kl_placement: loss`` (docs/PIPELINE.md §12: a
frozen checkpoint) in both trainers: the reference is the initial policy
(version 0), evaluated exactly as the current log-probs are, once per
update. So at version 0 the KL is exactly 0 for every estimator; after an
update it is the KL of the trained policy to version 0, also in a trainer
restored from a later release; without ``kl_placement: loss`` nothing is
computed."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from conftest import PARITY
from llmfix import random_segments, tiny_gguf
from trajflow.batches import PackedBatch, decode_packed_batch, pack_segments
from trajflow.ids import batch_id
from trajflow.llm import LLMBackend, LLMPolicy, LLMTrainer
from trajflow.model import Behavior, WindowMLP, checkpoint_bytes, grammar_from_id, load_checkpoint
from trajflow.packed import Options, global_denominators, kl_term, token_weights
from trajflow.release import ReleaseMeta, write_release
from trajflow.trainer import MLPBackend
from trajflow.update import Adam, Trainer

ESTIMATORS = ("k1", "k2", "k3")
KL_COEF, ENTROPY_COEF = 0.1, 0.02


def kl_opts(est: str = "k3", norm: str = "seq-mean-token-sum") -> Options:
    return Options(clip_low=0.2, clip_high=0.28, normalization=norm, kl_placement="loss", kl_estimator=est,
                   kl_coef=KL_COEF, entropy_coef=ENTROPY_COEF)


def assert_no_kl(st) -> None:
    """KL exactly 0 and loss = policy_loss − entropy_coef·entropy exactly."""
    assert st.kl == 0.0
    assert st.loss == st.policy_loss - ENTROPY_COEF * st.entropy


def assert_kl(st) -> None:
    assert st.kl > 0
    assert st.loss == st.policy_loss + KL_COEF * st.kl - ENTROPY_COEF * st.entropy
    assert st.loss != st.policy_loss - ENTROPY_COEF * st.entropy


def expected_kl(rows, ref_rows: list[np.ndarray], cur_rows: list[np.ndarray], est: str, norm: str) -> float:
    """Σ c_t k(ref_t − cur_t) over the trained tokens, from log-probs
    computed independently of the update."""
    ws = token_weights(rows, global_denominators(rows), norm)
    tot = 0.0
    for r, ref, cur, w in zip(rows, ref_rows, cur_rows, ws):
        at = np.asarray(r.action_mask) == 1
        lr = torch.from_numpy(ref[at].astype(np.float64) - cur[at].astype(np.float64))
        tot += float((torch.from_numpy(w) * kl_term(est, lr)).sum())
    return tot


# ------------------------------------------------------------ window-MLP

CASE = PARITY / "seq-mean-token-sum-k3-loss"


@pytest.fixture(scope="module")
def mlp_case():
    fx = json.loads((CASE / "expected.json").read_text())
    cfg, p0 = load_checkpoint((CASE / fx["init_file"]).read_bytes())
    b = fx["behavior"]
    beh = Behavior(b["temperature"], b["top_k"], b["top_p"], grammar_from_id(fx["grammar"]))
    batch = decode_packed_batch((CASE / fx["batch_file"]).read_bytes(), check_header=False)
    # The Go fixture stores reference log-probs of its own: the update
    # replaces them (if it did not, the KL at version 0 would not be 0).
    assert all(r.ref_logprobs is not None for r in batch.rows)
    tr = Trainer(WindowMLP(cfg, p0), beh)
    assert any(not np.array_equal(r.ref_logprobs[r.action_mask == 1], tr.logprobs_for_training(r)[r.action_mask == 1])
               for r in batch.rows)
    return cfg, p0, beh, batch


def mlp_config(cfg, p0, beh, opts, init=True):
    """The parts of a TrainConfig that MLPBackend reads."""
    return NS(model=cfg, model_seed=3, behavior=beh, objective=opts,
              init_checkpoint=checkpoint_bytes(cfg, p0) if init else None)


ADAM = Adam(lr=0.02, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, max_grad_norm=0.5)


@pytest.mark.parametrize("est", ESTIMATORS)
def test_mlp_kl_exactly_zero_at_version0(mlp_case, est):
    cfg, p0, beh, batch0 = mlp_case
    for tr in (Trainer(WindowMLP(cfg, p0), beh),  # reference copied at the first update
               MLPBackend().initial(mlp_config(cfg, p0, beh, kl_opts(est)))):
        batch = copy.deepcopy(batch0)
        first, last = tr.update(batch, kl_opts(est), ADAM, epochs=2)
        assert first.from_version == 0 and first.stats.tokens > 0
        assert_no_kl(first.stats)
        # The second epoch trains against the same (version 0) reference
        # (k1 may be negative).
        assert last.kl != 0
        for r in batch.rows:
            m = r.action_mask == 1
            assert r.ref_logprobs.dtype == np.float32 and len(r.ref_logprobs) == len(r.input_ids)
            assert (r.ref_logprobs[~m] == 0).all()
            np.testing.assert_array_equal(r.ref_logprobs[m], Trainer(WindowMLP(cfg, p0), beh).logprobs_for_training(r)[m])


def test_mlp_kl_after_one_update(mlp_case):
    cfg, p0, beh, batch0 = mlp_case
    opts = kl_opts("k3")
    tr = MLPBackend().initial(mlp_config(cfg, p0, beh, opts, init=False))
    p_init = tr.model.flat.detach().clone()
    first, _ = tr.update(copy.deepcopy(batch0), opts, ADAM, epochs=1)
    assert_no_kl(first.stats)
    assert not torch.equal(tr.model.flat.detach(), p_init)
    batch = copy.deepcopy(batch0)
    cur = [tr.logprobs_for_training(r) for r in batch.rows]
    second, _ = tr.update(batch, opts, ADAM, epochs=1)
    assert second.from_version == 1
    assert_kl(second.stats)
    v0 = Trainer(WindowMLP(cfg, p_init.numpy()), beh)
    ref = [v0.logprobs_for_training(r) for r in batch.rows]
    assert second.stats.kl == pytest.approx(expected_kl(batch.rows, ref, cur, "k3", opts.normalization), rel=1e-9)


@pytest.mark.parametrize("init", [True, False], ids=["init_checkpoint", "seeded"])
def test_mlp_reference_after_restore_is_version0(mlp_case, tmp_path, init):
    cfg, p0, beh, batch0 = mlp_case
    opts = kl_opts("k3")
    c = mlp_config(cfg, p0, beh, opts, init=init)
    be = MLPBackend()
    orig = be.initial(c)
    for k in range(2):
        orig.update(copy.deepcopy(batch0), opts, ADAM, epochs=1)
    rel = write_release(str(tmp_path), orig.version, orig.steps, orig.checkpoint_payload(), orig.config_hash(),
                        ReleaseMeta())
    restored = be.restore(c, rel)
    assert restored.version == 2
    assert torch.equal(restored.model.flat.detach(), orig.model.flat.detach())
    b_orig, b_rest = copy.deepcopy(batch0), copy.deepcopy(batch0)
    orig.attach_reference(b_orig, opts)
    restored.attach_reference(b_rest, opts)
    fresh = be.initial(c)
    for ro, rr in zip(b_orig.rows, b_rest.rows):
        np.testing.assert_array_equal(rr.ref_logprobs, ro.ref_logprobs)
        np.testing.assert_array_equal(rr.ref_logprobs, fresh.reference_logprobs(rr))
    # Not the restored version's own log-probs.
    assert any(not np.array_equal(r.ref_logprobs[r.action_mask == 1], restored.logprobs_for_training(r)[r.action_mask == 1])
               for r in b_rest.rows)
    # An update of the restored trainer uses the same reference.
    b = copy.deepcopy(batch0)
    st, _ = restored.update(b, opts, ADAM, epochs=1)
    assert_kl(st.stats)
    for r, ro in zip(b.rows, b_orig.rows):
        np.testing.assert_array_equal(r.ref_logprobs, ro.ref_logprobs)
    # A trainer at a later version without a reference refuses the KL loss.
    with pytest.raises(RuntimeError, match="reference"):
        Trainer(WindowMLP.from_checkpoint(orig.checkpoint_payload()), beh, version=2).update(
            copy.deepcopy(batch0), opts, ADAM, epochs=1)


def test_mlp_no_reference_without_kl_loss(mlp_case):
    cfg, p0, beh, batch0 = mlp_case
    opts = Options(clip_low=0.2, clip_high=0.28, normalization="token-mean", entropy_coef=ENTROPY_COEF)
    tr = MLPBackend().initial(mlp_config(cfg, p0, beh, opts))
    assert tr.reference is None
    batch = copy.deepcopy(batch0)
    for r in batch.rows:
        r.ref_logprobs = None
    first, _ = tr.update(batch, opts, ADAM, epochs=2)
    assert all(r.ref_logprobs is None for r in batch.rows)
    assert tr.reference is None
    assert first.stats.kl == 0.0


# ------------------------------------------------------------ language model

BEH = Behavior(temperature=0.8, top_k=0, top_p=1.0)
LLM_ADAM = Adam(lr=1e-2, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def llm_batch(seed: int, index: int = 0) -> PackedBatch:
    rng = np.random.default_rng(seed)
    return PackedBatch(batch_id=batch_id("t", index), batch_index=index, run_id="t", contract_hash="x",
                       trainer_version=0, token_budget=48, rows=pack_segments(random_segments(rng, 6, 64, f"s{index}"), 48))


def llm_config(opts):
    """The parts of a TrainConfig that LLMBackend reads."""
    return NS(behavior=BEH, objective=opts, meta=ReleaseMeta())


@pytest.mark.parametrize("est", ESTIMATORS)
def test_llm_kl_exactly_zero_at_version0(tiny, est):
    b0 = llm_batch(11)
    assert len(b0.rows) >= 2
    for tr in (LLMTrainer(LLMPolicy.load(tiny), BEH),  # reference copied at the first update
               LLMBackend(tiny).initial(llm_config(kl_opts(est)))):
        b = copy.deepcopy(b0)
        for r in b.rows:  # stored values are replaced
            r.ref_logprobs = np.full(len(r.input_ids), -1.0, np.float32)
        first, last = tr.update(b, kl_opts(est), LLM_ADAM, epochs=2)
        assert first.from_version == 0
        assert_no_kl(first.stats)
        assert last.kl != 0  # the second epoch's, against the same reference
        assert tr.reference is not tr.model
        assert not any(p.requires_grad for p in tr.reference.parameters())
        for r in b.rows:
            assert (r.ref_logprobs[r.action_mask != 1] == 0).all()


def test_llm_kl_after_one_update(tiny):
    opts = kl_opts("k3")
    tr = LLMBackend(tiny).initial(llm_config(opts))
    first, _ = tr.update(llm_batch(12), opts, LLM_ADAM, epochs=1)
    assert_no_kl(first.stats)
    b = llm_batch(13, 1)
    cur = [tr.policy.logprobs(r, BEH) for r in b.rows]
    second, _ = tr.update(b, opts, LLM_ADAM, epochs=1)
    assert second.from_version == 1
    assert_kl(second.stats)
    v0 = LLMPolicy.load(tiny)
    ref = [v0.logprobs(r, BEH) for r in b.rows]
    assert second.stats.kl == pytest.approx(expected_kl(b.rows, ref, cur, "k3", opts.normalization), rel=1e-5)


def test_llm_reference_after_restore_is_version0(tiny, tmp_path):
    opts = kl_opts("k3")
    be = LLMBackend(tiny)
    c = llm_config(opts)
    orig = be.initial(c)
    orig.update(llm_batch(14), opts, LLM_ADAM, epochs=1)
    rel = write_release(str(tmp_path), orig.version, orig.steps, orig.checkpoint_payload(), orig.config_hash(),
                        ReleaseMeta(), ext=orig.CHECKPOINT_EXT)
    restored = be.restore(c, rel)
    assert restored.version == 1 and restored.reference is not None
    b = llm_batch(15, 1)
    fresh = be.initial(c)
    for r in b.rows:
        want = fresh.reference_logprobs(r)
        np.testing.assert_array_equal(restored.reference_logprobs(r), want)
        np.testing.assert_array_equal(orig.reference_logprobs(r), want)
    m = [r.action_mask == 1 for r in b.rows]
    assert any(not np.allclose(restored.reference_logprobs(r)[k], restored.policy.logprobs(r, BEH)[k], atol=1e-4)
               for r, k in zip(b.rows, m))


def test_llm_no_reference_without_kl_loss(tiny):
    opts = Options(normalization="token-mean", entropy_coef=ENTROPY_COEF)
    tr = LLMBackend(tiny).initial(llm_config(opts))
    assert tr.reference is None
    b = llm_batch(16)
    first, _ = tr.update(b, opts, LLM_ADAM, epochs=2)
    assert all(r.ref_logprobs is None for r in b.rows)
    assert tr.reference is None
    assert first.stats.kl == 0.0
