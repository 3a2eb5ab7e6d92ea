"""Policy releases (docs/SYSTEMS.md §8), as gpu/trainer_release.go writes them.

Publication protocol: the checkpoint is written to a temporary file in the
release directory, fsynced, hashed (``sha256:<hex>`` of its bytes) and
renamed to ``policy-v%08d.ckpt``; the directory is fsynced; then the
manifest file ``policy-v%08d.json`` the same way (Ready true). The manifest
then goes on the compacted policy topic as the JSON document
``{"kind":"policy_release","version":1,"data":{...}}`` keyed by the run id,
with the headers of stagekit.Headers (record id
``DerivedID("release", run/version)``), produced with acks=all. A reader that
sees a manifest therefore sees a complete checkpoint; a temporary file is
never named like a checkpoint.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

from .ids import derived_id, go_json, headers
from .model import hash_bytes

KIND = "policy_release"
VERSION = 1

FIELDS = ["policy_version", "training_step", "checkpoint_hash", "checkpoint_uri", "model_config_hash",
          "tokenizer_hash", "chat_template_hash", "sampler_contract", "contract_hash", "created_at", "ready",
          "next_batch", "curriculum_version", "reward_version"]
# Fields written only when not zero (omitempty in schemas.PolicyRelease).
OMIT_EMPTY = {"next_batch", "curriculum_version", "reward_version"}
INT_FIELDS = {"policy_version", "training_step", "next_batch"}


def checkpoint_name(v: int, ext: str = ".ckpt") -> str:
    """The checkpoint file of version v: ``.ckpt`` for the built-in policy,
    ``.gguf`` for a language model (a llama.cpp router serves the file
    ``policy-vNNNNNNNN.gguf`` as the model policy.ModelName(v))."""
    return f"policy-v{v:08d}{ext}"


def manifest_name(v: int) -> str:
    return f"policy-v{v:08d}.json"


def update_name(v: int) -> str:
    return f"policy-v{v:08d}.update.json"


def refused_name(v: int) -> str:
    """gpu.RefusedName: the cost of the batches refused whole after version v."""
    return f"policy-v{v:08d}.refused.json"


def optim_name(v: int) -> str:
    return f"policy-v{v:08d}.optim"


def write_atomic(path: str, data) -> Optional[str]:
    """Temporary file beside path, write, fsync, rename, fsync the directory.
    data is bytes, or a function that writes the file whose path it is
    given (a large checkpoint streamed to disk); then the sha256 of the
    written file is returned (read back after the fsync)."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    digest = None
    try:
        if callable(data):
            os.close(fd)
            data(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
                h = hashlib.sha256()
                for b in iter(lambda: f.read(1 << 22), b""):
                    h.update(b)
                digest = "sha256:" + h.hexdigest()
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return digest


@dataclass
class ReleaseMeta:
    tokenizer_hash: str = ""
    chat_template_hash: str = ""
    sampler_contract: str = ""
    contract_hash: str = ""
    curriculum_version: str = ""
    reward_version: str = ""


def write_release(directory: str, version: int, training_step: int, checkpoint, model_config_hash: str,
                  meta: ReleaseMeta, now: Optional[_dt.datetime] = None, ext: str = ".ckpt",
                  next_batch: int = 0) -> dict:
    """Writes checkpoint and manifest files of version under directory and
    returns the manifest (schemas.PolicyRelease fields, in their order).
    checkpoint is the bytes, or a function writing the file (write_atomic);
    the manifest's checkpoint_hash is the sha256 of the file as written.
    next_batch: every batch index below it was consumed by the trainer
    (0: the initial release)."""
    d = os.path.abspath(directory)
    ckpt = os.path.join(d, checkpoint_name(version, ext))
    digest = write_atomic(ckpt, checkpoint)
    now = now or _dt.datetime.now(_dt.timezone.utc)
    rel = {
        "policy_version": int(version), "training_step": int(training_step),
        "checkpoint_hash": digest if digest is not None else hash_bytes(checkpoint), "checkpoint_uri": "file://" + ckpt,
        "model_config_hash": model_config_hash, "tokenizer_hash": meta.tokenizer_hash,
        "chat_template_hash": meta.chat_template_hash, "sampler_contract": meta.sampler_contract,
        "contract_hash": meta.contract_hash,
        "created_at": now.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "ready": True,
    }
    rel["next_batch"] = int(next_batch)
    rel["curriculum_version"], rel["reward_version"] = meta.curriculum_version, meta.reward_version
    rel = {k: v for k, v in rel.items() if not (k in OMIT_EMPTY and not v)}
    write_atomic(os.path.join(d, manifest_name(version)), go_json(rel, indent="  "))
    return rel


def encode_release(rel: dict) -> bytes:
    """schemas.EncodeRelease."""
    return go_json({"kind": KIND, "version": VERSION,
                    "data": {k: rel[k] for k in FIELDS if not (k in OMIT_EMPTY and not rel.get(k))}})


def decode_release(b: bytes) -> dict:
    """schemas.DecodeRelease: strict (unknown or missing fields, wrong kind
    or version are ValueError)."""
    doc = json.loads(b)
    if not isinstance(doc, dict) or set(doc) != {"kind", "version", "data"}:
        raise ValueError("policy release: not a {kind, version, data} document")
    if doc["kind"] != KIND or doc["version"] != VERSION:
        raise ValueError(f"policy release: kind {doc['kind']!r} version {doc['version']!r}")
    data = doc["data"]
    if not isinstance(data, dict) or set(data) - set(FIELDS):
        raise ValueError(f"policy release: unknown fields {sorted(set(data) - set(FIELDS))}")
    return {k: data.get(k, False if k == "ready" else (0 if k in INT_FIELDS else "")) for k in FIELDS}


def release_record(run_id: str, rel: dict) -> tuple[bytes, bytes, list]:
    """(key, value, headers) of the manifest on the policy topic, as the Go
    train stage writes it."""
    rid = derived_id("release", f"{run_id}/{rel['policy_version']}")
    return run_id.encode(), encode_release(rel), headers(KIND, rid)


def checkpoint_path(rel: dict) -> str:
    uri = rel["checkpoint_uri"]
    return uri[len("file://"):] if uri.startswith("file://") else uri
