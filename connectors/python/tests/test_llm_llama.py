"""The language-model trainer against a real llama-server with
SmolLM2-135M-Instruct (TRAJFLOW_LLAMA_SERVER, TRAJFLOW_LLAMA_MODEL from
deploy/local/llama.sh env; the tests FAIL without them, pytest marker
``llama``).

test_mismatch_per_version is the train/inference mismatch of docs/SYSTEMS.md §9,
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
                # The same weights exported as F16 (what --export-dtype f16
                # releases): llama.cpp samples from rounded weights, the
                # trainer keeps float32 ones.
                write_atomic(str(models / "f16-v2.gguf"), lambda path: tr.policy.export(path, "f16"))
                srv.load("f16-v2")
                srv.unload(name)
                f16 = recompute(tr.policy, batch_of(sample(srv, "f16-v2", prompts_ids, v, 1000 * (v + 1)), v), beh)
                report["f16_export_v2"] = {k: x for k, x in f16.items() if k != "by_version"}
                report["f16_export_bytes"] = os.path.getsize(models / "f16-v2.gguf")
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
    # F16 weights (and llama.cpp's F16 activations in their dot products)
    # stay well below the Q4_1 mismatch.
    f16 = report["f16_export_v2"]
    assert f16["rollout_logprobs_diff_mean"] < v0["rollout_logprobs_diff_mean"] / 3, f16


def test_trainer_process_real_model(tf_bin, broker, tmp_path):
    """`python -m trajflow.train --model gguf:SmolLM2` over Kafka for two
    updates, with llama-server in router mode over the release directory
    itself: version 0 (the Q4_1 file the trainer releases at start) samples
    batch 0; the trainer trains it and releases the F32 GGUF of version 1;
    the router loads that file (rescan + load; the file it serves is hashed
    against the manifest) and samples batch 1 with it; version 2 follows.
    The update records carry the mismatch of each behavior version."""
    import subprocess
    from conftest import ROOT
    from fleet import Procs, python
    from trajflow import contract as C
    from trajflow.batches import encode_packed_batch
    from trajflow.kafka import AckProducer
    from trajflow.release import manifest_name, update_name
    binary, q41 = server_path(), smollm2_path()
    run = "llmproc"
    src = (ROOT / "testdata" / "contracts" / "demo.yaml").read_text()
    for a, b in [("run_id: demo", f"run_id: {run}"), ("lr: 0.01 ", "lr: 1.0e-5 "), ("entropy_coef: 0.1 ", "entropy_coef: 0 "),
                 ("epochs: 4 ", "epochs: 1 ")]:
        assert a in src, a
        src = src.replace(a, b)
    cp = tmp_path / "c.yaml"
    cp.write_text(src)
    subprocess.run([tf_bin, "topics", "create", "--brokers", broker, "--contract", str(cp)], check=True,
                   capture_output=True, timeout=60)
    resolved = tmp_path / "resolved.yaml"
    resolved.write_bytes(subprocess.run([tf_bin, "contract", "validate", str(cp)], check=True, capture_output=True).stdout)
    c = C.load(str(resolved))
    rel = tmp_path / "releases"
    rel.mkdir()
    procs = Procs(str(tmp_path))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "connectors" / "python"), HF_HUB_OFFLINE="1")
    t0 = time.monotonic()
    p = procs.start("train", [python(), "-m", "trajflow.train", "--brokers", broker, "--run", run, "--releases", str(rel),
                              "--contract", str(resolved), "--model", f"gguf:{q41}", "--threads", "2", "--print-updates"],
                    env=env)
    tok = G.load_tokenizer(q41)
    prompts_ids = []
    for q in PROMPTS[:4]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts_ids.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    lines = []
    try:
        deadline = time.monotonic() + 600
        while "trainer ready" not in procs.log("train", "out"):
            assert p.poll() is None, procs.log("train")
            assert time.monotonic() < deadline
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        with LlamaServer(binary, models_dir=str(rel), log_path=str(tmp_path / "llama.log")).wait_ready() as srv:
            for v in range(2):
                name = f"policy-v{v:08d}"
                man = json.loads((rel / manifest_name(v)).read_text())
                sync_s = srv.load(name)
                # The replica serves the release's file, and that file is the
                # manifest's checkpoint.
                served = srv.model_path(name)
                assert G.file_hash(served) == man["checkpoint_hash"]
                if v:
                    srv.unload(f"policy-v{v - 1:08d}")
                t = time.monotonic()
                segs = sample(srv, name, prompts_ids, v, 77 + v)
                gen_s = time.monotonic() - t
                b = PackedBatch(batch_id=batch_id(run, v), batch_index=v, run_id=run, contract_hash=c.hash,
                                trainer_version=v, token_budget=c["packing"]["token_budget"],
                                rows=pack_segments(segs, c["packing"]["token_budget"]))
                AckProducer(broker).send([(f"{run}.batches", run.encode()) + encode_packed_batch(b)])
                t = time.monotonic()
                deadline = t + 900
                while not (rel / manifest_name(v + 1)).exists():
                    assert p.poll() is None, procs.log("train")
                    assert time.monotonic() < deadline, "the trainer did not release in time"
                    time.sleep(0.2)
                wait_s = time.monotonic() - t
                u = json.loads((rel / update_name(v + 1)).read_text())["data"]
                lines.append({"version": v + 1, "sampled_with": v, "weight_sync_s": sync_s, "generation_s": gen_s,
                              "train_and_release_s": wait_s, "train_s": u["step_seconds"],
                              "tokens": u["metrics"]["tokens"], **{k: u["trainer"]["mismatch"][k] for k in
                              ("rollout_logprobs_diff_mean", "rollout_logprobs_diff_max", "rollout_probs_diff_mean",
                               "mismatch_kl")}})
            sync_s = srv.load("policy-v00000002")
            assert G.file_hash(srv.model_path("policy-v00000002")) == json.loads((rel / manifest_name(2)).read_text())["checkpoint_hash"]
        p.terminate()
        assert p.wait(60) == 0
    finally:
        procs.stop()
    out = [json.loads(x[len("update "):]) for x in procs.log("train", "out").splitlines() if x.startswith("update ")]
    assert [o["version"] for o in out] == [1, 2]
    print(f"\ntrainer ready after {ready_s:.1f} s; " + json.dumps(lines, indent=1))
    o = os.environ.get("TRAJFLOW_LLM_PROC_OUT")
    if o:
        with open(o, "w") as f:
            json.dump({"ready_s": ready_s, "updates": lines, "printed": out}, f, indent=1)
    # Version 0 is the quantized model: its samples disagree with the
    # trainer's float32 recomputation far more than those of the F32 export.
    assert lines[0]["rollout_logprobs_diff_mean"] > 5 * lines[1]["rollout_logprobs_diff_mean"]
    assert lines[1]["rollout_logprobs_diff_mean"] < 0.01
