"""Language-model fixtures: a tiny llama-architecture GGUF (random weights,
the same code path as SmolLM2: reader, dequantization, q/k permutation,
export) and the SmolLM2 file of deploy/local/llama.sh."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as T

from trajflow import gguf_io as G

SMOLLM2_ENV = "TRAJFLOW_LLAMA_MODEL"
SERVER_ENV = "TRAJFLOW_LLAMA_SERVER"


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF; a test that needs it FAILS (never
    skips) when the variable is missing: eval "$(deploy/local/llama.sh env)"."""
    p = os.environ.get(SMOLLM2_ENV)
    if not p or not os.path.isfile(p):
        pytest.fail(f"{SMOLLM2_ENV} must name the SmolLM2 GGUF (eval \"$(deploy/local/llama.sh env)\"); got {p!r}")
    return p


def server_path() -> str:
    p = os.environ.get(SERVER_ENV)
    if not p or not os.access(p, os.X_OK):
        pytest.fail(f"{SERVER_ENV} must name llama-server (eval \"$(deploy/local/llama.sh env)\"); got {p!r}")
    return p


def tiny_gguf(path: str, seed: int = 7, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, ffn: int = 48) -> str:
    """Writes a tiny llama GGUF with random weights (float32) to path."""
    F = G.Field
    fields = [
        F("general.architecture", T.STRING, None, "llama"), F("general.name", T.STRING, None, "trajflow-tiny"),
        F("general.file_type", T.UINT32, None, 0),
        F("llama.block_count", T.UINT32, None, layers), F("llama.context_length", T.UINT32, None, 256),
        F("llama.embedding_length", T.UINT32, None, hidden), F("llama.feed_forward_length", T.UINT32, None, ffn),
        F("llama.attention.head_count", T.UINT32, None, heads), F("llama.attention.head_count_kv", T.UINT32, None, kv_heads),
        F("llama.rope.freq_base", T.FLOAT32, None, 10000.0),
        F("llama.attention.layer_norm_rms_epsilon", T.FLOAT32, None, 1e-5), F("llama.vocab_size", T.UINT32, None, vocab),
        F("tokenizer.ggml.model", T.STRING, None, "gpt2"),
        F("tokenizer.ggml.tokens", T.ARRAY, T.STRING, [f"t{i}" for i in range(vocab)]),
        F("tokenizer.ggml.token_type", T.ARRAY, T.INT32, [1] * vocab),
        F("tokenizer.ggml.bos_token_id", T.UINT32, None, 1), F("tokenizer.ggml.eos_token_id", T.UINT32, None, 2),
        F("tokenizer.chat_template", T.STRING, None, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ]
    names = [g for g, _ in G.TENSOR_NAMES(layers, tied=True)]
    tmpl = G.GGUFModel(path=path, fields=fields, tensors={}, order=names)
    cfg = G.hf_config(tmpl)
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    sd = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
    G.write_gguf(path, tmpl, G.from_hf(sd, cfg))
    return path


def segment(tokens, trained, logprobs, adv, tid, gid="g", version=0) -> dict:
    return {"tokens": list(tokens), "trained": list(trained), "logprobs": list(logprobs), "advantage": float(adv),
            "version": version, "trajectory_id": tid, "group_id": gid}


def random_segments(rng: np.random.Generator, n: int, vocab: int, prefix: str, version: int = 0,
                    lo: int = 6, hi: int = 20) -> list[dict]:
    out = []
    for k in range(n):
        L = int(rng.integers(lo, hi))
        toks = rng.integers(3, vocab, L)
        prompt = int(rng.integers(2, L - 2))
        trained = list(range(prompt, L))
        out.append(segment(toks, trained, rng.uniform(-4, -0.1, len(trained)), rng.choice([-1.0, 1.0]),
                           f"{prefix}-t{k}", f"{prefix}-g{k // 2}", version))
    return out
