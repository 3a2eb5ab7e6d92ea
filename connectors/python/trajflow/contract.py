"""The learning contract as the Python trainer reads it.

The trainer takes the *resolved* contract, every key written (but those of
UNWRITTEN_DEFAULTS where the document left them out: ``topics.replication``,
and the keys that do not apply under the contract's other settings), as
``trajflow contract validate FILE`` prints it (defaults are filled and
validated by the Go side, pipeline/contract). This module checks that every
key of the resolved form is there and no other, and recomputes the contract
hash exactly as pipeline/contract Hash does (``sha256:<hex>`` of
"trajflow/contract/v1\\n" and the canonical encoding: JSON-shaped, keys in
declaration order, map keys sorted, strings quoted as Go string literals,
floats in Go's shortest form), so batches packed under this contract (their
``contract_hash``) are recognized and the manifests carry the same hash. A
``# hash:`` header line, when present, must equal the recomputed hash.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import yaml

from .gostr import format_float_g, quote

S, I, F, B = "str", "int", "float", "bool"
FLOOR, MAPF, MAPS, LISTS, LISTI, LISTF = "floor", "map_float", "map_str", "list_str", "list_int", "list_float"

REWARD = [("name", S), ("version", S), ("weight", F), ("transform", S), ("clip_min", F), ("clip_max", F), ("scope", S), ("raw_range", LISTF)]

SCHEMA: list = [
    ("run_id", S), ("seed", I),
    ("objective", [("target_distribution", S), ("primary_metric", S), ("constraints", MAPF),
                   ("regression_floors", FLOOR), ("kl_limit", F)]),
    ("budgets", [("rollout_tokens", I), ("optimizer_tokens", I), ("environment_hours", F), ("accelerator_hours", F)]),
    ("stop_rules", LISTS),
    ("artifacts", [(k, S) for k in ("policy_checkpoint", "tokenizer", "chat_template", "tool_schemas", "task_corpus",
                                    "split_manifest", "environment", "validator", "reward_model", "code_revision",
                                    "container_image")]),
    ("sampler", [("temperature", F), ("top_p", F), ("top_k", I), ("min_p", F), ("max_tokens_per_action", I),
                 ("max_tokens_per_episode", I), ("max_turns", I), ("stop_token_ids", LISTI), ("group_size", I),
                 ("tool_timeout_ms", I), ("tool_retries", I)]),
    ("estimator", [("name", S), ("normalize_std", B), ("std_mode", S), ("epsilon", F), ("gamma", F), ("lambda", F),
                   ("zero_variance", S), ("min_group_size", I), ("bootstrap_truncations", LISTS)]),
    ("loss", [("clip_low", F), ("clip_high", F), ("normalization", S), ("kl_placement", S), ("kl_estimator", S),
              ("kl_coef", F), ("entropy_coef", F), ("norm_tokens", I), ("max_log_ratio", F), ("off_policy", S),
              ("is_cap", F), ("ratio", S),
              ("optimizer", [("lr", F), ("beta1", F), ("beta2", F), ("eps", F), ("grad_clip", F), ("epochs", I),
                             ("minibatches", I)])]),
    ("packing", [("token_budget", I), ("batch_tokens", I), ("batch_groups", I), ("overflow", S), ("max_lag", I),
                 ("stale_policy", S), ("multi_policy", S)]),
    ("rewards", ("list", REWARD)),
    ("topics", [("partitions", I), ("replication", I), ("retention_ms", I), ("max_message_bytes", I),
                ("compression", MAPS)]),
    ("dispatch", [("tasks_per_update", I), ("groups_per_update", I), ("domain_quotas", MAPF), ("eval_every", I),
                  ("mode", S), ("partial_rollouts", S)]),
    ("latency", [("tool_median_ms", F), ("tool_sigma", F), ("token_median_ms", F), ("token_sigma", F)]),
    ("policy", [("protocol", S), ("endpoints", LISTS), ("timeout_ms", I), ("retries", I), ("concurrency", I),
                ("router", B)]),
]

# Keys that are not part of the contract hash (Go tag contract:"unhashed"),
# by path.
UNHASHED = {"policy", "topics.compression"}

# Keys left out of the contract hash where they hold their zero value (Go
# tag contract:"omitzero"; the resolved form does not print them then
# either), by path: loss.ratio is "" (the token-level ratio) unless a
# contract declares it, and a contract written before the key existed keeps
# its hash.
OMITZERO = {"loss.ratio"}


class ContractError(ValueError):
    pass


def _scalar(path: str, typ: str, v: Any):
    if isinstance(v, (dict, list)):
        raise ContractError(f"{path}: want a {typ}, got {type(v).__name__}")
    s = "" if v is None else str(v)
    try:
        if typ == S:
            return s
        if typ == I:
            f = float(s)
            if f != int(f):
                raise ValueError
            return int(f)
        if typ == F:
            return float(s)
        if typ == B:
            if s not in ("true", "false"):
                raise ValueError
            return s == "true"
    except ValueError:
        raise ContractError(f"{path}: {s!r} is not a {typ}") from None
    raise AssertionError(typ)


# Keys the resolved form leaves out where the contract's document did not
# write them (pipeline/contract Contract.YAML), with the value they hash as:
# an unwritten topics.replication lets `trajflow topics create` replicate
# by the cluster's size; the other keys apply only under other keys' values
# (estimator.lambda with estimator gae only, ...: pipeline/contract
# conditionals), and the resolved form leaves them out, at their default,
# where they do not apply (a document that writes them there is refused);
# loss.ratio is left out at its zero value "" (OMITZERO: not hashed then).
UNWRITTEN_DEFAULTS = {
    "topics.replication": "1",
    "estimator.normalize_std": "true",
    "estimator.epsilon": "1e-06",
    "estimator.lambda": "0.95",
    "loss.clip_low": "0.2",
    "loss.clip_high": "0.2",
    "loss.kl_estimator": "k3",
    "loss.ratio": "",
    "packing.multi_policy": "per_segment",
    "dispatch.eval_every": "5",
    "policy.timeout_ms": "60000",
    "policy.retries": "2",
    "policy.concurrency": "8",
}


def _parse(path: str, schema, doc) -> Any:
    if isinstance(schema, list):
        if not isinstance(doc, dict):
            raise ContractError(f"{path or 'contract'}: want a mapping")
        keys = [k for k, _ in schema]
        doc = {**{k: UNWRITTEN_DEFAULTS[_join(path, k)] for k in keys if _join(path, k) in UNWRITTEN_DEFAULTS}, **doc}
        missing = [k for k in keys if k not in doc]
        extra = [k for k in doc if k not in keys]
        if missing or extra:
            raise ContractError(f"{path or 'contract'}: missing keys {missing}, unknown keys {extra} "
                                "(pass the resolved contract: trajflow contract validate FILE)")
        return {k: _parse(f"{path}.{k}" if path else k, t, doc[k]) for k, t in schema}
    if isinstance(schema, tuple):
        if doc is None:
            doc = []
        if not isinstance(doc, list):
            raise ContractError(f"{path}: want a list")
        return [_parse(f"{path}[{i}]", schema[1], d) for i, d in enumerate(doc)]
    if schema in (MAPF, MAPS, FLOOR):
        doc = doc or {}
        if not isinstance(doc, dict):
            raise ContractError(f"{path}: want a mapping")
        if schema == MAPS:
            return {str(k): _scalar(f"{path}.{k}", S, v) for k, v in doc.items()}
        if schema == MAPF:
            return {str(k): _scalar(f"{path}.{k}", F, v) for k, v in doc.items()}
        return {str(k): str(v) for k, v in doc.items()}
    if schema in (LISTS, LISTI, LISTF):
        doc = doc or []
        if not isinstance(doc, list):
            raise ContractError(f"{path}: want a list")
        elem = {LISTS: S, LISTI: I, LISTF: F}[schema]
        return [_scalar(f"{path}[{i}]", elem, v) for i, v in enumerate(doc)]
    return _scalar(path, schema, doc)


def _floor_text(s: str) -> str:
    """Floor.String: the number in Go's shortest form, '_of_initial' kept."""
    suffix = "_of_initial"
    if s.endswith(suffix):
        return format_float_g(float(s[:-len(suffix)])) + suffix
    return format_float_g(float(s))


def _join(path: str, k: str) -> str:
    return f"{path}.{k}" if path else k


def _canon(schema, v, out: list, path: str = "") -> None:
    if isinstance(schema, list):
        out.append("{")
        keys = [(k, t) for k, t in schema if _join(path, k) not in UNHASHED
                and not (_join(path, k) in OMITZERO and _zero(v[k]))]
        for i, (k, t) in enumerate(keys):
            if i:
                out.append(",")
            out.append(quote(k) + ":")
            _canon(t, v[k], out, _join(path, k))
        out.append("}")
    elif isinstance(schema, tuple):
        out.append("[")
        for i, x in enumerate(v):
            if i:
                out.append(",")
            _canon(schema[1], x, out, path)
        out.append("]")
    elif schema in (MAPF, FLOOR):
        out.append("{")
        for i, k in enumerate(sorted(v, key=lambda s: s.encode())):
            if i:
                out.append(",")
            out.append(quote(k) + ":")
            out.append(quote(_floor_text(v[k])) if schema == FLOOR else _float(v[k]))
        out.append("}")
    elif schema in (LISTS, LISTI):
        out.append("[" + ",".join(quote(x) if schema == LISTS else str(x) for x in v) + "]")
    elif schema == LISTF:
        out.append("[" + ",".join(_float(x) for x in v) + "]")
    elif schema == S:
        out.append(quote(v))
    elif schema == I:
        out.append(str(v))
    elif schema == F:
        out.append(_float(v))
    elif schema == B:
        out.append("true" if v else "false")


def _zero(x) -> bool:
    """reflect.Value.IsZero of a parsed scalar (a string, an int, a bool;
    a float is zero when its bits are, so -0.0 is not)."""
    if isinstance(x, float):
        return x == 0 and str(x) == "0.0"
    return x in ("", 0, False)


def _float(f: float) -> str:
    if f != f:
        return '"NaN"'
    if f in (float("inf"), float("-inf")):
        return '"+Inf"' if f > 0 else '"-Inf"'
    return "0" if f == 0 else format_float_g(f)


@dataclass
class Contract:
    doc: dict
    hash: str
    sampler_hash: str
    policy: dict = None  # the policy section (deployment; not hashed, not read)
    # pipeline/contract CurriculumVersion and RewardVersion: recorded by
    # every release.
    curriculum_version: str = ""
    reward_version: str = ""

    def __getitem__(self, k):
        return self.doc[k]


def canonical(doc: dict) -> str:
    out: list = []
    _canon(SCHEMA, doc, out)
    return "".join(out)


def parse(text: str, name: str = "contract") -> Contract:
    """Parses a resolved contract and computes its hashes."""
    try:
        raw = yaml.load(text, Loader=yaml.BaseLoader)  # every scalar as text; types from SCHEMA
    except yaml.YAMLError as e:
        raise ContractError(f"{name}: {e}") from None
    # The policy section says which servers generate (deployment): the Go
    # side leaves it out of the hash (pipeline/contract Canonical) and the
    # trainer does not read it; it is kept as written.
    # (A SCHEMA that lists the policy section parses it itself.)
    policy = raw.pop("policy", None) if isinstance(raw, dict) and "policy" not in dict(SCHEMA) else None
    if policy is not None and not isinstance(policy, dict):
        raise ContractError(f"{name}: policy: want a mapping")
    doc = _parse("", SCHEMA, raw)
    if doc["loss"]["ratio"] == "token":
        doc["loss"]["ratio"] = ""  # the default written out (pipeline/contract fillDefaults)
    h = "sha256:" + hashlib.sha256(b"trajflow/contract/v1\n" + canonical(doc).encode()).hexdigest()
    sout: list = []
    _canon(dict(SCHEMA)["sampler"], doc["sampler"], sout)
    sh = "sha256:" + hashlib.sha256(b"trajflow/sampler/v1\n" + "".join(sout).encode()).hexdigest()
    cv, rv = _versions(doc)
    m = re.search(r"^# hash: (\S+)$", text, re.M)
    if m and m.group(1) != h:
        raise ContractError(f"{name}: header says hash {m.group(1)}, the contract hashes to {h} (edited after resolving? "
                            "resolve it again with trajflow contract validate)")
    return Contract(doc=doc, hash=h, sampler_hash=sh, policy=policy or {}, curriculum_version=cv, reward_version=rv)


def _versions(doc: dict) -> tuple[str, str]:
    """The curriculum and reward versions (pipeline/contract
    CurriculumVersion, RewardVersion): sha256 of the canonical encoding of
    {"seed", "target_distribution", "task_corpus", "split_manifest",
    "dispatch"} and of {"rewards", "validator", "reward_model"}."""
    sch = dict(SCHEMA)
    cur: list = ["{", quote("seed") + ":", str(doc["seed"]),
                 ",", quote("target_distribution") + ":", quote(doc["objective"]["target_distribution"]),
                 ",", quote("task_corpus") + ":", quote(doc["artifacts"]["task_corpus"]),
                 ",", quote("split_manifest") + ":", quote(doc["artifacts"]["split_manifest"]),
                 ",", quote("dispatch") + ":"]
    _canon(sch["dispatch"], doc["dispatch"], cur)
    cur.append("}")
    rew: list = ["{", quote("rewards") + ":"]
    _canon(sch["rewards"], doc["rewards"], rew)
    rew += [",", quote("validator") + ":", quote(doc["artifacts"]["validator"]),
            ",", quote("reward_model") + ":", quote(doc["artifacts"]["reward_model"]), "}"]
    digest = lambda domain, parts: "sha256:" + hashlib.sha256(domain + "".join(parts).encode()).hexdigest()  # noqa: E731
    return digest(b"trajflow/curriculum/v1\n", cur), digest(b"trajflow/reward/v1\n", rew)


def load(path: str) -> Contract:
    with open(path, encoding="utf-8") as f:
        return parse(f.read(), path)
