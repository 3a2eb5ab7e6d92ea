"""Checkpoints, release files and the release document."""

import json
import os

import numpy as np
import pytest

from conftest import PARITY
from trajflow import release as R
from trajflow.model import CheckpointError, Config, WindowMLP, checkpoint_bytes, hash_bytes, load_checkpoint


def test_go_checkpoint_round_trip():
    b = (PARITY / "demo-token-mean" / "init.ckpt").read_bytes()
    cfg, p = load_checkpoint(b)
    assert cfg == Config()  # the demo model
    assert checkpoint_bytes(cfg, p) == b  # byte for byte what Go wrote
    m = WindowMLP.from_checkpoint(b, hash_bytes(b))
    assert m.checkpoint() == b


def test_checkpoint_refusals():
    b = (PARITY / "demo-token-mean" / "init.ckpt").read_bytes()
    with pytest.raises(CheckpointError):
        load_checkpoint(b, "sha256:" + "0" * 64)
    for bad in (b[:20], b[:-4], b + b"\0\0\0\0", b"XXXXXXXX" + b[8:]):
        with pytest.raises(CheckpointError):
            load_checkpoint(bad)
    cfg, p = load_checkpoint(b)
    p = p.copy()
    p[3] = np.nan
    with pytest.raises(CheckpointError):
        load_checkpoint(checkpoint_bytes(cfg, p))


def test_write_atomic_never_exposes_partial_files(tmp_path, monkeypatch):
    path = tmp_path / "policy-v00000001.ckpt"
    R.write_atomic(str(path), b"one")
    assert path.read_bytes() == b"one"
    # A write that fails before the rename leaves the old file and no
    # temporary file behind.
    real = os.fsync
    calls = {"n": 0}

    def failing(fd):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("disk full")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError):
        R.write_atomic(str(path), b"two, longer")
    monkeypatch.setattr(os, "fsync", real)
    assert path.read_bytes() == b"one"
    assert sorted(os.listdir(tmp_path)) == ["policy-v00000001.ckpt"]


def test_release_files_and_document(tmp_path):
    m = WindowMLP(Config(vocab=32, window=4, embed=4, hidden=8), seed=2)
    ck = m.checkpoint()
    meta = R.ReleaseMeta(tokenizer_hash="sha256:t", sampler_contract="sha256:s", contract_hash="sha256:c",
                         curriculum_version="sha256:cur", reward_version="sha256:rew")
    rel = R.write_release(str(tmp_path), 3, 7, ck, m.cfg.hash(), meta, next_batch=5)
    assert list(rel) == R.FIELDS and rel["ready"] and rel["next_batch"] == 5 and rel["policy_version"] == 3 and rel["training_step"] == 7
    assert open(R.checkpoint_path(rel), "rb").read() == ck
    assert rel["checkpoint_hash"] == hash_bytes(ck)
    assert json.loads((tmp_path / R.manifest_name(3)).read_bytes()) == rel
    key, value, hdrs = R.release_record("runx", rel)
    assert key == b"runx"
    doc = json.loads(value)
    assert doc["kind"] == "policy_release" and doc["version"] == 1 and list(doc["data"]) == R.FIELDS
    assert value.startswith(b'{"kind":"policy_release","version":1,"data":{"policy_version":3,')
    assert R.decode_release(value) == rel
    h = dict(hdrs)
    assert h["trajflow-kind"] == b"policy_release" and h["trajflow-version"] == b"1"
    assert h["traceparent"].startswith(b"00-") and len(h["trajflow-id"]) == 32
    # next_batch is omitted when 0 (the initial release), as Go writes it.
    r0 = R.write_release(str(tmp_path), 0, 0, ck, m.cfg.hash(), meta)
    assert "next_batch" not in r0 and b"next_batch" not in R.encode_release(r0)
    assert R.decode_release(R.encode_release(r0))["next_batch"] == 0
    # So are the curriculum and reward versions of a trainer that does not know them.
    bare = R.write_release(str(tmp_path), 1, 0, ck, m.cfg.hash(), R.ReleaseMeta(contract_hash="sha256:c"))
    assert "curriculum_version" not in bare and b"reward_version" not in R.encode_release(bare)
    assert R.decode_release(R.encode_release(bare))["curriculum_version"] == ""
    with pytest.raises(ValueError):
        R.decode_release(value.replace(b'"ready"', b'"readyx"'))
    with pytest.raises(ValueError):
        R.decode_release(value.replace(b'"policy_release"', b'"census_event"'))
