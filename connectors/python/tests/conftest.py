import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
PARITY = ROOT / "testdata" / "parity"

# Deterministic CPU reductions (the kill test compares checkpoints bit for bit).
torch.set_num_threads(1)


@pytest.fixture
def repo_root():
    return ROOT


@pytest.fixture(scope="session")
def tf_bin(tmp_path_factory):
    """The trajflow Go binary ($TRAJFLOW_BIN or built once per session)."""
    from fleet import go_binary
    return go_binary(str(tmp_path_factory.mktemp("bin")))


@pytest.fixture
def broker(tf_bin, tmp_path):
    """A fresh embedded broker on 127.0.0.1 (trajflow broker --port 0)."""
    from fleet import Procs, start_broker
    procs = Procs(str(tmp_path))
    try:
        yield start_broker(procs, tf_bin)
    finally:
        procs.stop()
