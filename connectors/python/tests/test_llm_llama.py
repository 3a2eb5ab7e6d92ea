"""The language-model trainer against a real llama-server with
SmolLM2-135M-Instruct (TRAJFLOW_LLAMA_SERVER, TRAJFLOW_LLAMA_MODEL from
deploy/local/llama.sh env; the tests FAIL without them, pytest marker
``llama``).

test_mismatch_per_version is the train/inference mismatch of systems §9,
measured: llama-server in router mode serves version 0 (the Q4_1 file) and
the trainer's F32 GGUF exports of versions 1 and 2, loaded as new files
(GET /models?reload=1, POST /models/load); the behavior log-probs of its
samples are compared with the trainer's recomputation on the same tokens.
Set TRAJFLOW_MISMATCH_OUT=FILE to keep the figures (bench/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from llmfix import segment, server_path, smollm2_path
from trajflow import gguf_io as G
from trajflow.batches import PackedBatch, pack_segments
from trajflow.ids import batch_id
from trajflow.llamacpp import LlamaServer
from trajflow.llm import LLMPolicy, LLMTrainer, mismatch_metrics
from trajflow.model import Behavior
from trajflow.packed import Options, shift_targets
from trajflow.release import write_atomic
from trajflow.update import Adam

pytestmark = pytest.mark.llama

PROMPTS = ["What is the capital of France?", "Name three colors.", "Count from one to five.",
           "Say hello in Spanish.", "What is 2+2?", "Write one word that rhymes with cat."]
N_PREDICT = 24


def sample(srv, model, prompts_ids, version, seed0):
    segs = []
    for k, ids in enumerate(prompts_ids):
        for j in range(2):
            r = srv.complete(ids, N_PREDICT, seed=seed0 + 2 * k + j, model=model)
            toks = ids + r["tokens"]
            trained = [len(ids) + i for i, lp in enumerate(r["logprobs"]) if lp is not None and len(ids) + i < len(toks)]
            lps = [lp for lp in r["logprobs"] if lp is not None]
            segs.append(segment(toks, trained, lps, 1.0 if j == 0 else -1.0, f"v{version}-p{k}-s{j}", f"v{version}-p{k}",
                                version))
    return segs


def batch_of(segs, index):
    return PackedBatch(batch_id=batch_id("llm", index), batch_index=index, run_id="llm", contract_hash="x",
                       trainer_version=index, token_budget=512, rows=pack_segments(segs, 512))


def recompute(pol, batch, beh):
    cur, old, ver = [], [], []
    for r in batch.rows:
        lp = pol.logprobs(r, beh)
        m = np.asarray(r.action_mask) == 1
        cur.append(lp[m]), old.append(np.asarray(r.old_logprobs)[m]), ver.append(np.asarray(r.policy_versions)[m])
    return mismatch_metrics(np.concatenate(cur), np.concatenate(old), np.concatenate(ver))


def test_mismatch_per_version(tmp_path):
    torch.set_num_threads(2)
    binary, q41 = server_path(), smollm2_path()
    t0 = time.monotonic()
    pol = LLMPolicy.load(q41)
    load_s = time.monotonic() - t0
    tok = G.load_tokenizer(q41)
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(q41, models / "policy-v00000000.gguf")
    beh = Behavior(temperature=1.0, top_k=0, top_p=1.0)
    opts = Options(clip_low=0.2, clip_high=0.28, normalization="token-mean")
    adam = Adam(lr=1e-5, max_grad_norm=1.0)
    tr = LLMTrainer(pol, beh, 0)
    report = {"load_seconds": load_s, "versions": {}}
    with LlamaServer(binary, models_dir=str(models), log_path=str(tmp_path / "llama.log")).wait_ready() as srv:
        report["versions"]["0"] = {"load_into_server_s": srv.load("policy-v00000000")}
        # The GGUF tokenizer in transformers renders and tokenizes chat
        # prompts exactly as the server does.
        prompts_ids = []
        for p in PROMPTS:
            msgs = [{"role": "user", "content": p}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            text = srv.post("/apply-template", {"model": "policy-v00000000", "messages": msgs})["prompt"]
            sids = srv.post("/tokenize", {"model": "policy-v00000000", "content": text, "add_special": False})["tokens"]
            assert ids == sids, (p, ids, sids)
            prompts_ids.append(ids)
        for v in range(3):
            name = f"policy-v{v:08d}"
            t = time.monotonic()
            segs = sample(srv, name, prompts_ids, v, 1000 * (v + 1))
            gen_s = time.monotonic() - t
            batch = batch_of(segs, v)
            assert tr.version == v
            if v < 2:
                first, _ = tr.update(batch, opts, adam, 1)
                mm = first.extra["mismatch"]
                ratio = {"ratio_mean": first.stats.ratio_mean, "ratio_min": first.stats.ratio_min,
                         "ratio_max": first.stats.ratio_max, "clip_frac_pos": first.stats.clip_frac_pos,
                         "clip_frac_neg": first.stats.clip_frac_neg, "train_s": first.extra["train_seconds"]}
                # The metric the update records is the recomputation on
                # the same tokens at the same version.
                nxt = f"policy-v{v + 1:08d}"
                t = time.monotonic()
                write_atomic(str(models / f"{nxt}.gguf"), lambda path: tr.policy.export(path, "f32"))
                export_s = time.monotonic() - t
                load_v = srv.load(nxt)
                assert srv.model_path(nxt).endswith(f"{nxt}.gguf")
                srv.unload(name)
            else:
                mm = recompute(tr.policy, batch, beh)
                ratio, export_s, load_v = {}, None, None
            report["versions"][str(v)].update({"tokens": mm["tokens"], "generation_s": gen_s, **ratio,
                                               **{k: x for k, x in mm.items() if k != "by_version"}})
            if v < 2:
                report["versions"][str(v + 1)] = {"export_s": export_s, "load_into_server_s": load_v}
        report["export_bytes"] = os.path.getsize(models / "policy-v00000001.gguf")
    print("\n" + json.dumps(report, indent=1))
    out = os.environ.get("TRAJFLOW_MISMATCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    v0, v1, v2 = (report["versions"][k] for k in "012")
    for m in (v0, v1, v2):
        assert m["tokens"] >= 100
        assert np.isfinite([m["rollout_logprobs_diff_mean"], m["mismatch_kl"]]).all()
    # Q4_1 (llama.cpp also quantizes activations to 8 bits) against its
    # float32 dequantization: a visible mismatch; the F32 exports served
    # by llama.cpp match the trainer far more closely.
    assert v0["rollout_logprobs_diff_mean"] > 5 * max(v1["rollout_logprobs_diff_mean"], v2["rollout_logprobs_diff_mean"])
    for m in (v1, v2):
        assert m["rollout_logprobs_diff_mean"] < 0.01, m
        assert m["mismatch_kl"] < 1e-3, m
