import os
import subprocess
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]


@pytest.fixture(scope="session")
def trajflow_bin(tmp_path_factory) -> str:
    b = os.environ.get("TRAJFLOW_BIN")
    if b:
        return b
    out = tmp_path_factory.mktemp("bin") / "trajflow"
    subprocess.run(["go", "build", "-o", str(out), "./cmd/trajflow"], cwd=ROOT, check=True, timeout=600)
    return str(out)


@pytest.fixture(scope="session")
def corpus_path(trajflow_bin, tmp_path_factory) -> str:
    """96 groups of the bench source through trajflow's own stages."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.bin"
    subprocess.run([trajflow_bin, "bench", "peers", "--export-corpus", str(path), "--corpus-groups", "96"],
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    return str(path)
