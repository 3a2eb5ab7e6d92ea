"""The language-model trainer (trajflow.llm, trajflow.gguf_io): GGUF load
and export, per-segment attention on the real SmolLM2 (marker smollm2:
TRAJFLOW_LLAMA_MODEL must name the GGUF, the tests fail without it), and
the update on a tiny llama GGUF of the same code path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from llmfix import random_segments, smollm2_path, tiny_gguf
from trajflow import gguf_io as G
from trajflow.batches import PackedBatch, pack_segments
from trajflow.ids import batch_id
from trajflow.llm import LLMPolicy, LLMTrainer, row_logits, segment_attention_mask
from trajflow.model import Behavior
from trajflow.packed import (Options, TokenInputs, global_denominators, objective, sequence_keys, shift_targets,
                             token_weights)
from trajflow.update import Adam

BEH = Behavior(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return LLMPolicy.load(smollm2_path())


def batch(segs, index=0, budget=64):
    return PackedBatch(batch_id=batch_id("t", index), batch_index=index, run_id="t", contract_hash="x",
                       trainer_version=0, token_budget=budget, rows=pack_segments(segs, budget))


def test_mask_is_block_diagonal_causal():
    m = segment_attention_mask(np.array([0, 0, 1, 1, 1]))[0, 0]
    allowed = (m == 0).numpy()
    want = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], bool)
    assert (allowed == want).all()


def test_tiny_export_roundtrip(tiny, tmp_path):
    """Load (dequantize, un-permute q/k) then export (permute again) gives
    the same file bytes, and the identities do not change."""
    pol = LLMPolicy.load(tiny)
    out = str(tmp_path / "x.gguf")
    pol.export(out)
    assert G.file_hash(out) == G.file_hash(tiny)
    assert G.identity(G.read_gguf(out, dequantize=False)) == pol.ident
    # The q rows are really permuted in the file (a layout bug would not
    # show in a round trip alone): GGUF attn_q == permute(HF q_proj).
    m = G.read_gguf(tiny)
    q = pol.model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(m.tensors["blk.0.attn_q.weight"], q)
    assert np.array_equal(G._rope_rows(q, 4, inverse=False), m.tensors["blk.0.attn_q.weight"])


def test_segments_do_not_attend_across_tiny(tiny):
    pol = LLMPolicy.load(tiny)
    rng = np.random.default_rng(1)
    segs = random_segments(rng, 2, 64, "a", lo=20, hi=24)
    b = batch(segs)
    r = b.rows[0]
    assert len(r.segment_lengths) == 2
    n0 = int(r.segment_lengths[0])
    at = np.arange(len(r.input_ids))
    with torch.no_grad():
        z = row_logits(pol.model, r, at)
        r.input_ids = r.input_ids.copy()
        r.input_ids[:n0] = rng.integers(3, 64, n0)
        z2 = row_logits(pol.model, r, at)
    assert torch.equal(z[n0:], z2[n0:])
    assert not torch.equal(z[:n0], z2[:n0])


def test_step_equals_one_objective_over_all_tokens(tiny):
    """Row-by-row backward with the batch's global denominators gives the
    loss, statistics and gradient of one objective call over every token
    of the batch (the Go reference's definition)."""
    rng = np.random.default_rng(2)
    b = batch(random_segments(rng, 7, 64, "s"), budget=48)
    assert len(b.rows) >= 2
    cases = [(n, "") for n in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")]
    cases += [("seq-mean-token-mean", "sequence"), ("token-mean", "sequence")]
    losses = {}
    for norm, ratio in cases:
        opts = Options(clip_low=0.2, clip_high=0.28, normalization=norm, entropy_coef=0.01, ratio=ratio)
        # Reference: one call over all tokens.
        pol = LLMPolicy.load(tiny)
        den = global_denominators(b.rows)
        ws = token_weights(b.rows, den, norm)
        parts, offset = [], 0
        for k, r in enumerate(b.rows):
            at = np.nonzero(r.action_mask == 1)[0]
            z = row_logits(pol.model, r, at)
            parts.append((z, shift_targets(r.input_ids, r.segment_ids)[at], r.old_logprobs[at], r.advantages[at], ws[k],
                          r.policy_versions[at], sequence_keys(r.segment_ids, at, offset)))
            offset += len(r.input_ids)
        inp = TokenInputs(logits=torch.cat([p[0] for p in parts]),
                          targets=torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(np.int64)),
                          old=torch.from_numpy(np.concatenate([p[2] for p in parts])), ref=None,
                          adv=torch.from_numpy(np.concatenate([p[3] for p in parts])),
                          weight=torch.from_numpy(np.concatenate([p[4] for p in parts])),
                          versions=torch.from_numpy(np.concatenate([p[5] for p in parts]).astype(np.int64)),
                          seq=torch.cat([p[6] for p in parts]))
        loss, st, _ = objective(inp, opts)
        loss.backward()
        gref = torch.cat([p.grad.flatten() for _, p in pol.params()])
        # The trainer's step, with a learning rate so small the comparison
        # is of the gradient it applied (captured through Adam's m1).
        tr = LLMTrainer(LLMPolicy.load(tiny), BEH)
        res = tr.step(b, opts, Adam(lr=1e-12, beta1=0.0, max_grad_norm=0.0))
        g = torch.cat([m.flatten() for m in tr.m1])
        assert res.stats.tokens == st.tokens == den.tokens
        for k in ("loss", "policy_loss", "entropy", "ratio_mean", "ratio_min", "ratio_max", "approx_kl_old"):
            assert getattr(res.stats, k) == pytest.approx(getattr(st, k), rel=1e-9, abs=1e-12), (norm, ratio, k)
        for k in ("pos_tokens", "neg_tokens", "clipped_pos", "clipped_neg"):
            assert getattr(res.stats, k) == getattr(st, k)
        assert torch.allclose(g, gref.float(), rtol=1e-5, atol=1e-7), (norm, ratio, float((g - gref).abs().max()))
        assert res.grad_norm == pytest.approx(float(gref.double().norm()), rel=1e-6)
        assert res.extra["mismatch"]["tokens"] == den.tokens
        losses[norm, ratio] = res.stats.loss
    # The sequence's ratio is not the tokens' here.
    assert losses["seq-mean-token-mean", "sequence"] != pytest.approx(losses["seq-mean-token-mean", ""], rel=1e-3)


def test_resume_is_bit_identical(tiny, tmp_path):
    """Two updates in one process equal one update, an export + optimizer
    state, a fresh load, and the second update."""
    rng = np.random.default_rng(3)
    b1, b2 = batch(random_segments(rng, 4, 64, "a"), 0), batch(random_segments(rng, 4, 64, "b", version=1), 1)
    opts, adam = Options(normalization="token-mean"), Adam(lr=1e-3)
    a = LLMTrainer(LLMPolicy.load(tiny), BEH)
    a.update(b1, opts, adam, 2)
    a.update(b2, opts, adam, 2)
    c = LLMTrainer(LLMPolicy.load(tiny), BEH)
    c.update(b1, opts, adam, 2)
    ck, op = str(tmp_path / "v1.gguf"), str(tmp_path / "v1.optim")
    c.checkpoint_payload()(ck)
    c.optim_payload()(op)
    d = LLMTrainer(LLMPolicy.load(ck), BEH, version=1)
    d.load_optim(op)
    assert d.steps == 2
    d.update(b2, opts, adam, 2)
    for (n, p), (_, q) in zip(a.policy.params(), d.policy.params()):
        assert torch.equal(p, q), n
    fa, fd = str(tmp_path / "a.gguf"), str(tmp_path / "d.gguf")
    a.checkpoint_payload()(fa)
    d.checkpoint_payload()(fd)
    assert G.file_hash(fa) == G.file_hash(fd)
    # A damaged optimizer state is refused.
    with open(op, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.raises(ValueError, match="checksum"):
        LLMTrainer(LLMPolicy.load(ck), BEH, version=1).load_optim(op)


def test_version0_checkpoint_is_the_source_file(tiny, tmp_path):
    tr = LLMTrainer(LLMPolicy.load(tiny), BEH)
    p = str(tmp_path / "v0.gguf")
    tr.checkpoint_payload()(p)
    assert G.file_hash(p) == G.file_hash(tiny)


def test_bad_inputs_refused(tiny, tmp_path):
    with pytest.raises(G.GGUFError, match="not a readable GGUF"):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
        G.read_gguf(str(bad))
    with pytest.raises(G.GGUFError, match="checkpoint hash"):
        LLMPolicy.load(tiny, want_hash="sha256:00")
    rng = np.random.default_rng(4)
    b = batch(random_segments(rng, 2, 64, "x"))
    b.rows[0].input_ids = b.rows[0].input_ids.copy()
    b.rows[0].input_ids[3] = 64  # outside the vocabulary
    from trajflow.packed import ObjectiveInputError
    with pytest.raises(ObjectiveInputError, match="vocabulary"):
        LLMTrainer(LLMPolicy.load(tiny), BEH).update(b, Options(), Adam(), 1)


# ------------------------------------------------------------- SmolLM2

@pytest.mark.smollm2
def test_smollm2_segment_isolation(smollm2):
    """Real model, packed row of two chat segments: perturbing segment 0's
    tokens leaves segment 1's logits unchanged bit for bit, and they equal
    segment 1 run alone (to SDPA's reduction order); with plain causal
    attention over the row (no segment mask) they move."""
    s0 = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 5820, 1296, 4683, 30, 2, 198, 1, 520, 9531,
          198, 12869, 28, 10062]
    s1 = [1, 4093, 198, 19556, 905, 30, 2, 198, 1, 520, 9531, 198, 19556, 28, 638, 359, 346, 47, 2]
    ids = np.array(s0 + s1, np.int32)
    seg = np.array([0] * len(s0) + [1] * len(s1), np.int32)
    pos = np.concatenate([np.arange(len(s0)), np.arange(len(s1))]).astype(np.int32)
    from types import SimpleNamespace as NS
    row = NS(input_ids=ids, position_ids=pos, segment_ids=seg)
    at = np.arange(len(ids))
    n0 = len(s0)
    rng = np.random.default_rng(5)
    other = ids.copy()
    other[:n0] = rng.integers(3, 49152, n0)
    with torch.no_grad():
        z = row_logits(smollm2.model, row, at)
        z2 = row_logits(smollm2.model, NS(input_ids=other, position_ids=pos, segment_ids=seg), at)
        alone = row_logits(smollm2.model, NS(input_ids=np.array(s1), position_ids=np.arange(len(s1)),
                                              segment_ids=np.zeros(len(s1))), np.arange(len(s1)))
        leaky = row_logits(smollm2.model, row, at, mask=False)
        leaky2 = row_logits(smollm2.model, NS(input_ids=other, position_ids=pos, segment_ids=seg), at, mask=False)
    assert torch.equal(z[n0:], z2[n0:])
    assert float((z[n0:] - alone).abs().max()) < 1e-3
    assert float((z[:n0] - z2[:n0]).abs().max()) > 1.0  # segment 0 itself did change
    assert float((leaky[n0:] - leaky2[n0:]).abs().max()) > 1e-2  # without the mask it leaks


@pytest.mark.smollm2
def test_smollm2_export_roundtrip(smollm2, tmp_path):
    """The F32 export of the dequantized Q4_1 model keeps every weight and
    the identities (architecture, tokenizer, chat template); the exported
    file loads back to the same parameters."""
    out = str(tmp_path / "v.gguf")
    smollm2.export(out, "f32")
    m = G.read_gguf(out, dequantize=False)
    assert G.identity(m) == smollm2.ident
    assert m.get("general.file_type") == G.FILE_TYPE_F32
    assert m.get("tokenizer.chat_template") == smollm2.template.get("tokenizer.chat_template")
    assert all(t == "F32" for t in m.types.values())
    back = LLMPolicy.load(out)
    for (n, p), (_, q) in zip(smollm2.params(), back.params()):
        assert torch.equal(p, q), n
    assert os.path.getsize(out) > 4 * 134_000_000


def test_llm_contract_config(tf_bin, tiny, tmp_path):
    """--model gguf:PATH: the release identities come from the GGUF, the
    behavior has no grammar, and bad settings are refused by name."""
    import subprocess
    from conftest import ROOT
    from trajflow import contract as C
    from trajflow.train import llm_config_from_contract, main
    text = subprocess.run([tf_bin, "contract", "validate", str(ROOT / "testdata" / "contracts" / "demo.yaml")],
                          check=True, capture_output=True, text=True).stdout
    c = C.parse(text)
    cfg = llm_config_from_contract(c, "127.0.0.1:1", str(tmp_path), None, tiny)
    ident = G.identity(G.read_gguf(tiny, dequantize=False))
    assert cfg.meta.tokenizer_hash == ident.tokenizer_hash and cfg.meta.chat_template_hash == ident.chat_template_hash
    assert cfg.behavior.grammar is None and cfg.backend.model_path == tiny
    with pytest.raises(C.ContractError, match="no such file"):
        llm_config_from_contract(c, "127.0.0.1:1", str(tmp_path), None, str(tmp_path / "missing.gguf"))
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"not a gguf")
    with pytest.raises(C.ContractError, match="x.gguf"):
        llm_config_from_contract(c, "127.0.0.1:1", str(tmp_path), None, str(notgguf))
    bad = C.parse(text.replace("min_p: 0\n", "min_p: 0.1\n").replace("# hash:", "# was:"))
    with pytest.raises(C.ContractError, match="min_p"):
        llm_config_from_contract(bad, "127.0.0.1:1", str(tmp_path), None, tiny)
    cp = tmp_path / "resolved.yaml"
    cp.write_text(text)
    assert main(["--brokers", "127.0.0.1:1", "--run", "demo", "--releases", str(tmp_path), "--contract", str(cp),
                 "--model", "onnx:x"]) == 2
