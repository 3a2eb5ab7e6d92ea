import os
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
PARITY = ROOT / "testdata" / "parity"

# Deterministic CPU reductions (the kill test compares checkpoints bit for bit).
torch.set_num_threads(1)


@pytest.fixture
def repo_root():
    return ROOT
