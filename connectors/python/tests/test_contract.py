"""The contract hash recomputed in Python equals the Go one."""

import re
import subprocess

import pytest

from conftest import ROOT
from trajflow import contract as C
from trajflow.model import Behavior, KVGrammar, settings_id
from trajflow.train import config_from_contract

VALID = ["demo", "bench", "conformance", "minimal"]


def resolved(tf_bin, name):
    return subprocess.run([tf_bin, "contract", "validate", str(ROOT / "testdata" / "contracts" / f"{name}.yaml")],
                          check=True, capture_output=True, text=True).stdout


@pytest.mark.parametrize("name", VALID)
def test_hash_matches_go(tf_bin, name):
    text = resolved(tf_bin, name)
    c = C.parse(text)
    assert c.hash == re.search(r"^# hash: (\S+)$", text, re.M).group(1)
    assert c.sampler_hash == re.search(r"^# sampler section hash: (\S+)$", text, re.M).group(1)
    assert c.curriculum_version == re.search(r"^# curriculum version: (\S+) ", text, re.M).group(1)
    assert c.reward_version == re.search(r"^# reward version: (\S+) ", text, re.M).group(1)


def test_edits_and_unresolved_refused(tf_bin):
    text = resolved(tf_bin, "demo")
    with pytest.raises(C.ContractError, match="header says hash"):
        C.parse(text.replace("lr: 0.01", "lr: 0.02"))
    # Without the header an edit is a different contract, not an error.
    edited = C.parse(re.sub(r"^# hash: .*$", "", text, flags=re.M).replace("lr: 0.01", "lr: 0.02"))
    assert edited.hash != C.parse(text).hash
    with pytest.raises(C.ContractError, match="missing keys"):
        C.load(str(ROOT / "testdata" / "contracts" / "demo.yaml"))  # not resolved


def test_trainer_config_from_contract(tf_bin):
    c = C.parse(resolved(tf_bin, "demo"))
    cfg = config_from_contract(c, "127.0.0.1:1", "/tmp/x", None)
    assert cfg.contract_hash == c.hash and cfg.epochs == 4 and cfg.max_lag == 0 and cfg.stale_policy == "drop"
    assert cfg.objective.clip_high == 0.28 and cfg.objective.entropy_coef == 0.1
    # The sampler contract of a release is gpu/model Settings.ID of the
    # rollout's settings (temperature 1, the kv grammar, 3 tokens, stop END).
    assert cfg.meta.sampler_contract == settings_id(Behavior(1.0, 0, 1.0, KVGrammar(4, 8)), 3, [9])
    bad = C.parse(resolved(tf_bin, "demo").replace("min_p: 0\n", "min_p: 0.1\n").replace("# hash:", "# was:"))
    with pytest.raises(C.ContractError, match="min_p"):
        config_from_contract(bad, "127.0.0.1:1", "/tmp/x", None)


def test_release_identities_match_go():
    """The identities the Go train stage writes in its manifests (version 0
    of `trajflow run train` with the demo contract): model config hash,
    tokenizer hash, sampler contract."""
    from trajflow.model import Config
    from trajflow.train import BUILTIN_TOKENIZER_HASH
    assert Config().hash() == "sha256:4ebebc9c16d45caba273db56b2dad0d09be154538ecb2f29f06f83c060406128"
    assert BUILTIN_TOKENIZER_HASH == "sha256:541a29279762fd8b5351ba226be3126141c43ebdcd34912f12187e63a4b2d339"
    assert settings_id(Behavior(1.0, 0, 1.0, KVGrammar(4, 8)), 3, [9]) == \
        "sha256:a0ad44e090427738a1ba4d91557943e151ea3a4e1c3b144549ebc4f19d66bc34"


def test_topic_compression_is_read_and_unhashed(tf_bin):
    text = resolved(tf_bin, "demo")
    c = C.parse(text)
    assert c["topics"]["compression"] == {}
    # Another codec map keeps the hash (the # hash: header still holds), as
    # pipeline/contract leaves topics.compression out of it.
    edited = C.parse(text.replace("  compression: {}\n", "  compression: {batches: zstd, census: lz4}\n"))
    assert edited["topics"]["compression"] == {"batches": "zstd", "census": "lz4"}
    assert edited.hash == c.hash
    cfg = config_from_contract(edited, "127.0.0.1:1", "/tmp/x", None)
    assert cfg.compression == {"demo.batches": "zstd", "demo.census": "lz4"}
    with pytest.raises(C.ContractError, match="topics.compression.batches"):
        C.parse(text.replace("  compression: {}\n", "  compression: {batches: [zstd]}\n"))


# Contracts under settings where keys that apply only under other values
# do not apply (pipeline/contract conditionals): the resolved form leaves
# them out, and the hash recomputed here from C.UNWRITTEN_DEFAULTS is
# still Go's.
CONDITIONAL = {
    "rloo, tis, async on servers": (
        "estimator: {name: rloo, std_mode: population, zero_variance: penalize_failed, min_group_size: 2}\n"
        "loss: {normalization: token-sum, norm_tokens: 4096, entropy_coef: 0.1, off_policy: tis, is_cap: 2}\n"
        "dispatch: {tasks_per_update: 16, groups_per_update: 16, mode: async}\n"
        "policy: {protocol: vllm, endpoints: ['http://127.0.0.1:8000']}\n",
        ["normalize_std", "epsilon", "lambda", "clip_low", "clip_high", "kl_estimator", "eval_every"]),
    "grpo without std normalization": (
        "estimator: {std_mode: population, zero_variance: penalize_failed, min_group_size: 1, normalize_std: false}\n",
        ["epsilon", "lambda", "kl_estimator", "multi_policy", "timeout_ms", "retries", "concurrency"]),
}


@pytest.mark.parametrize("name", sorted(CONDITIONAL))
def test_conditional_keys_left_out_hash_matches_go(tf_bin, tmp_path, name):
    edits, absent = CONDITIONAL[name]
    base = (ROOT / "testdata" / "contracts" / "minimal.yaml").read_text()
    # minimal.yaml's estimator, loss and dispatch lines are replaced.
    lines = [ln for ln in base.splitlines() if not ln.startswith(("estimator:", "loss:", "dispatch:"))]
    if "loss:" not in edits:
        lines += [ln for ln in base.splitlines() if ln.startswith(("loss:", "dispatch:"))]
    path = tmp_path / "contract.yaml"
    path.write_text("\n".join(lines) + "\n" + edits)
    text = subprocess.run([tf_bin, "contract", "validate", str(path)], check=True, capture_output=True, text=True).stdout
    for key in absent:
        assert not re.search(rf"^ +{key}:", text, re.M), f"{key} printed:\n{text}"
    c = C.parse(text)
    assert c.hash == re.search(r"^# hash: (\S+)$", text, re.M).group(1)
    assert c["estimator"]["lambda"] == 0.95 and c["loss"]["kl_estimator"] == "k3"


def test_sequence_ratio_hash_matches_go(tf_bin, tmp_path):
    """loss.ratio: the resolved form prints it only where it is declared
    (sequence), and the hash covers it then, right after loss.is_cap; left
    out (the default token level) it is read as "" and not hashed, so the
    contracts written before the key keep their hashes."""
    base = (ROOT / "testdata" / "contracts" / "minimal.yaml").read_text()
    lines = [ln for ln in base.splitlines() if not ln.startswith("loss:")]
    texts = {}
    for name, extra in (("token", ""), ("sequence", ", ratio: sequence")):
        path = tmp_path / f"{name}.yaml"
        path.write_text("\n".join(lines) + f"\nloss: {{normalization: seq-mean-token-mean{extra}}}\n")
        texts[name] = subprocess.run([tf_bin, "contract", "validate", str(path)], check=True, capture_output=True,
                                     text=True).stdout
    assert not re.search(r"^ +ratio:", texts["token"], re.M)
    assert re.search(r"^  ratio: sequence$", texts["sequence"], re.M)
    tok, seq = C.parse(texts["token"]), C.parse(texts["sequence"])
    for c, text in ((tok, texts["token"]), (seq, texts["sequence"])):
        assert c.hash == re.search(r"^# hash: (\S+)$", text, re.M).group(1)
    assert tok.hash != seq.hash and tok.sampler_hash == seq.sampler_hash
    assert tok["loss"]["ratio"] == "" and seq["loss"]["ratio"] == "sequence"
    assert '"is_cap":0,"ratio":"sequence","optimizer":' in C.canonical(seq.doc)
    assert '"ratio"' not in C.canonical(tok.doc)
    assert config_from_contract(tok, "127.0.0.1:1", "/tmp/x", None).objective.ratio == ""
    assert config_from_contract(seq, "127.0.0.1:1", "/tmp/x", None).objective.ratio == "sequence"
    # Declared in the resolved text of the token contract, it is hashed
    # (edited without the header: another contract).
    edited = re.sub(r"^# hash: .*$", "", texts["token"], flags=re.M).replace("  is_cap: 0\n", "  is_cap: 0\n  ratio: sequence\n")
    assert C.parse(edited).hash == seq.hash
    # The default written out is the default: "token" reads as "" and
    # hashes as the contract that leaves the key out.
    written = re.sub(r"^# hash: .*$", "", texts["token"], flags=re.M).replace("  is_cap: 0\n", "  is_cap: 0\n  ratio: token\n")
    assert C.parse(written).hash == tok.hash and C.parse(written)["loss"]["ratio"] == ""
