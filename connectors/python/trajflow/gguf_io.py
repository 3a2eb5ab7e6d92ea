"""GGUF files of llama-architecture models (SmolLM2 and its kin): read and
dequantize into PyTorch, export back to a GGUF that llama-server loads.

Reading (:func:`read_gguf`). Every metadata field is kept with its GGUF
value type (so an export writes it back unchanged: tokenizer, merges,
special ids, chat template, architecture numbers) and every tensor is
dequantized to float32 with the ``gguf`` package (``gguf.quants``: Q4_1,
Q8_0, F16, ... — the values llama.cpp's own dequantization gives).

Names and layout (:data:`TENSOR_NAMES`, :func:`to_hf`, :func:`from_hf`).
llama.cpp's converter stores the query and key projections with their rows
permuted so that its rotary embedding can rotate adjacent pairs; the
Hugging Face Llama implementation rotates the two halves of each head
(``rotate_half``). Per head of size d the converter's row order is
``[0, d/2, 1, d/2+1, ...]``; :func:`to_hf` undoes it and :func:`from_hf`
applies it again, exactly (a permutation). A model with tied embeddings
(no ``output.weight``) keeps them tied.

Hashes of a release (:func:`identity`): ``model_config_hash`` is the
SHA-256 of the architecture metadata (``general.architecture`` and every
``<arch>.*`` key, canonical JSON, keys sorted) — the same for a quantized
file and its F32 export; ``tokenizer_hash`` of every ``tokenizer.ggml.*``
field; ``chat_template_hash`` is ``sha256:`` of the template text, as the
Go llama.cpp client hashes the template llama-server reports
(policy.HashText).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

FILE_TYPE_F32 = 0  # llama_ftype ALL_F32
FILE_TYPE_F16 = 1  # MOSTLY_F16


class GGUFError(ValueError):
    """A GGUF file this module cannot use (names the file and the field)."""


@dataclass
class Field:
    key: str
    vtype: Any          # gguf.GGUFValueType
    sub_type: Any       # for arrays
    value: Any


@dataclass
class GGUFModel:
    path: str
    fields: list[Field]
    tensors: dict[str, np.ndarray]      # float32, row-major (GGUF ne reversed)
    order: list[str]                    # tensor order of the file
    types: dict[str, str] = field(default_factory=dict)  # original tensor types

    def get(self, key: str, default=None):
        for f in self.fields:
            if f.key == key:
                return f.value
        return default

    @property
    def arch(self) -> str:
        return self.get("general.architecture", "")


def _field_value(f):
    from gguf import GGUFValueType
    if not f.types:
        return None
    if f.types[0] == GGUFValueType.ARRAY:
        return f.contents()
    return f.contents()


def read_gguf(path: str, dequantize: bool = True) -> GGUFModel:
    """Reads a GGUF file: metadata with types, tensors as float32."""
    import gguf
    from gguf import GGUFValueType
    try:
        r = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file: {e}") from None
    fields = []
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue  # version, counts: the writer writes its own
        sub = f.types[-1] if f.types and f.types[0] == GGUFValueType.ARRAY else None
        fields.append(Field(k, f.types[0], sub, _field_value(f)))
    tensors, order, types = {}, [], {}
    for t in r.tensors:
        order.append(t.name)
        types[t.name] = t.tensor_type.name
        if not dequantize:
            continue
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        a = np.asarray(a, dtype=np.float32).reshape(shape)
        if not np.isfinite(a).all():
            raise GGUFError(f"{path}: tensor {t.name} has non-finite values")
        tensors[t.name] = a
    m = GGUFModel(path=path, fields=fields, tensors=tensors, order=order, types=types)
    if m.arch != "llama":
        raise GGUFError(f"{path}: general.architecture {m.arch!r}: only llama-architecture models are supported")
    return m


# --------------------------------------------------------------- config

def _arch(m: GGUFModel, key: str, default=None):
    v = m.get(f"{m.arch}.{key}", default)
    if v is None:
        raise GGUFError(f"{m.path}: metadata {m.arch}.{key} missing")
    return v


def hf_config(m: GGUFModel):
    """transformers LlamaConfig from the GGUF metadata."""
    from transformers import LlamaConfig
    n_embd = int(_arch(m, "embedding_length"))
    n_head = int(_arch(m, "attention.head_count"))
    n_kv = int(_arch(m, "attention.head_count_kv", n_head))
    vocab = int(m.get(f"{m.arch}.vocab_size") or len(m.get("tokenizer.ggml.tokens", [])))
    head_dim = int(m.get(f"{m.arch}.attention.key_length") or n_embd // n_head)
    tied = "output.weight" not in m.order
    rope = {"rope_type": "default", "rope_theta": float(_arch(m, "rope.freq_base", 10000.0))}
    if m.get(f"{m.arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"{m.path}: rope scaling {m.get(f'{m.arch}.rope.scaling.type')!r} is not supported")
    return LlamaConfig(
        vocab_size=vocab, hidden_size=n_embd, intermediate_size=int(_arch(m, "feed_forward_length")),
        num_hidden_layers=int(_arch(m, "block_count")), num_attention_heads=n_head, num_key_value_heads=n_kv,
        head_dim=head_dim, max_position_embeddings=int(_arch(m, "context_length")),
        rms_norm_eps=float(_arch(m, "attention.layer_norm_rms_epsilon")), rope_parameters=rope,
        tie_word_embeddings=tied, attention_bias=False, mlp_bias=False, hidden_act="silu",
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"), eos_token_id=m.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=m.get("tokenizer.ggml.padding_token_id"),
    )


# ---------------------------------------------------------------- names

def TENSOR_NAMES(n_layers: int, tied: bool) -> list[tuple[str, str]]:
    """(GGUF name, Hugging Face parameter name) of a llama model."""
    out = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight")]
    if not tied:
        out.append(("output.weight", "lm_head.weight"))
    per = [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
           ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
           ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
           ("ffn_down", "mlp.down_proj")]
    for i in range(n_layers):
        for g, h in per:
            out.append((f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight"))
    return out


def _rope_rows(w: np.ndarray, n_head: int, inverse: bool) -> np.ndarray:
    """llama.cpp's row permutation of a q/k projection (inverse: undo it)."""
    rows = w.shape[0]
    d = rows // n_head
    if d * n_head != rows or d % 2:
        raise GGUFError(f"projection of {rows} rows does not split into {n_head} heads of even size")
    if inverse:  # GGUF -> HF: rows [h, d/2, 2] -> [h, 2, d/2]
        return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_hf(m: GGUFModel, cfg) -> dict[str, np.ndarray]:
    """The state dict of transformers' LlamaForCausalLM from the GGUF tensors."""
    names = TENSOR_NAMES(cfg.num_hidden_layers, cfg.tie_word_embeddings)
    want = {g for g, _ in names}
    have = set(m.order)
    if want - have:
        raise GGUFError(f"{m.path}: tensors missing: {sorted(want - have)[:5]}")
    extra = have - want - {"rope_freqs.weight"}
    if extra:
        raise GGUFError(f"{m.path}: tensors this loader does not know: {sorted(extra)[:5]}")
    sd = {}
    for g, h in names:
        a = m.tensors[g]
        if g.endswith("attn_q.weight"):
            a = _rope_rows(a, cfg.num_attention_heads, inverse=True)
        elif g.endswith("attn_k.weight"):
            a = _rope_rows(a, cfg.num_key_value_heads, inverse=True)
        sd[h] = np.ascontiguousarray(a)
    return sd


def from_hf(sd: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """GGUF tensors (llama.cpp layout) from a LlamaForCausalLM state dict."""
    out = {}
    for g, h in TENSOR_NAMES(cfg.num_hidden_layers, cfg.tie_word_embeddings):
        a = sd[h]
        if g.endswith("attn_q.weight"):
            a = _rope_rows(a, cfg.num_attention_heads, inverse=False)
        elif g.endswith("attn_k.weight"):
            a = _rope_rows(a, cfg.num_key_value_heads, inverse=False)
        out[g] = np.ascontiguousarray(a)
    return out


# --------------------------------------------------------------- export

def write_gguf(path: str, template: GGUFModel, tensors: dict[str, np.ndarray], dtype: str = "f32") -> None:
    """Writes tensors (GGUF names, float32 arrays) with the metadata of
    template (every field as read, general.file_type set to F32/F16, no
    quantization version) to path, in the template's tensor order. Not
    atomic by itself: the caller writes to a temporary name and renames."""
    import gguf
    if dtype not in ("f32", "f16"):
        raise GGUFError(f"export dtype {dtype!r}: want f32 or f16")
    w = gguf.GGUFWriter(path, arch=template.arch)
    for f in template.fields:
        if f.key in ("general.architecture", "general.quantization_version"):
            continue
        if f.key == "general.file_type":
            w.add_uint32(f.key, FILE_TYPE_F32 if dtype == "f32" else FILE_TYPE_F16)
            continue
        w.add_key_value(f.key, f.value, f.vtype, sub_type=f.sub_type)
    if template.get("general.file_type") is None:
        w.add_uint32("general.file_type", FILE_TYPE_F32 if dtype == "f32" else FILE_TYPE_F16)
    for name in template.order:
        if name not in tensors:
            raise GGUFError(f"export: tensor {name} missing")
        a = np.asarray(tensors[name], dtype=np.float32)
        # 1-D tensors (norms) stay F32, as llama.cpp's converter keeps them.
        if dtype == "f16" and a.ndim > 1:
            a = a.astype(np.float16)
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------- identity

def _canon(v) -> Any:
    if isinstance(v, (np.generic,)):
        return v.item()
    if isinstance(v, float):
        return repr(float(np.float32(v))) if np.isfinite(v) else str(v)
    return v


def _hash_fields(m: GGUFModel, domain: str, pick: Callable[[str], bool]) -> str:
    h = hashlib.sha256(domain.encode() + b"\n")
    for f in sorted((f for f in m.fields if pick(f.key)), key=lambda f: f.key):
        v = f.value
        v = [_canon(x) for x in v] if isinstance(v, list) else _canon(v)
        h.update(json.dumps([f.key, int(f.vtype), None if f.sub_type is None else int(f.sub_type), v],
                            ensure_ascii=False, separators=(",", ":")).encode())
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def hash_text(s: str) -> str:
    return "sha256:" + hashlib.sha256(s.encode()).hexdigest()


@dataclass(frozen=True)
class Identity:
    model_config_hash: str
    tokenizer_hash: str
    chat_template_hash: str


def identity(m: GGUFModel) -> Identity:
    arch = m.arch
    cfg = _hash_fields(m, "trajflow/model/gguf/v1",
                       lambda k: k == "general.architecture" or k.startswith(arch + "."))
    tok = _hash_fields(m, "trajflow/tokenizer/gguf/v1", lambda k: k.startswith("tokenizer.ggml."))
    tpl = m.get("tokenizer.chat_template")
    return Identity(cfg, tok, hash_text(tpl) if tpl else "")


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 22), b""):
            h.update(b)
    return "sha256:" + h.hexdigest()


def load_tokenizer(path: str):
    """The tokenizer of a GGUF file as transformers builds it from the
    GGUF (tokens, merges, special ids, chat template); no hub access."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
