"""python -m trajflow.train: the trainer of the built-in policy, or of a
GGUF language model (--model gguf:PATH), over Kafka.

    python -m trajflow.train --brokers 127.0.0.1:9092 --run demo \\
        --releases /shared/releases --contract resolved.yaml [--state DIR]
        [--model gguf:SmolLM2-135M-Instruct.Q4_1.gguf [--export-dtype f32]]

It consumes ``<run>.batches`` from the offsets committed for the group
``<run>.train`` (the Go train operator's group: the two are interchangeable,
one at a time) by direct assignment (see kafka.AssignedConsumer),
trains with the contract's loss and optimizer, and publishes every version
under --releases and on ``<run>.policy`` exactly as the Go trainer does, so
Go rollout workers load them (gpu.LoadRelease). --contract is the resolved
contract (``trajflow contract validate FILE > resolved.yaml``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import logging
import signal
import sys

import torch

from . import contract as C
from .kafka import AssignedConsumer
from .model import Behavior, Config, KVGrammar, settings_id
from .packed import Options
from .release import ReleaseMeta
from .trainer import Topics, TrainConfig, TrainStage
from .update import Adam

# The built-in tokenizer (operators/rollout/vocab.go TokenizerHash).
BUILTIN_TOKENIZER_HASH = "sha256:" + hashlib.sha256(b"trajflow/kv-tokenizer/v1:32").hexdigest()


def config_from_contract(c: C.Contract, brokers: str, releases: str, state: str | None, builtin: bool = True) -> TrainConfig:
    d = c.doc
    s, loss, opt, pk = d["sampler"], d["loss"], d["loss"]["optimizer"], d["packing"]
    if s["min_p"] != 0:
        raise C.ContractError("sampler.min_p: the built-in policy's behavior distribution has no min-p; set it to 0")
    if opt["minibatches"] != 1:
        raise C.ContractError("loss.optimizer.minibatches: the built-in trainer takes one step per epoch; set it to 1")
    if builtin and not d["artifacts"]["tokenizer"].startswith("builtin:tokenizer/kv@"):
        raise C.ContractError(f"artifacts.tokenizer {d['artifacts']['tokenizer']!r}: this trainer trains the built-in "
                              "policy of the built-in kv task family only")
    # The built-in task registry (rollout.DefaultRegistryConfig): 4 keys, 8 values.
    beh = Behavior(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], grammar=KVGrammar(4, 8))
    beh.validate()
    return TrainConfig(
        brokers=brokers, run_id=d["run_id"], topics=Topics.for_run(d["run_id"]), contract_hash=c.hash,
        behavior=beh, model=Config(), model_seed=d["seed"],
        objective=Options(clip_low=loss["clip_low"], clip_high=loss["clip_high"], normalization=loss["normalization"],
                          kl_placement=loss["kl_placement"], kl_estimator=loss["kl_estimator"], kl_coef=loss["kl_coef"],
                          entropy_coef=loss["entropy_coef"], norm_tokens=loss["norm_tokens"],
                          max_log_ratio=loss["max_log_ratio"],
                          off_policy=loss["off_policy"], is_cap=loss["is_cap"], ratio=loss["ratio"]),
        adam=Adam(lr=opt["lr"], beta1=opt["beta1"], beta2=opt["beta2"], eps=opt["eps"], weight_decay=0.0,
                  max_grad_norm=opt["grad_clip"]),
        epochs=opt["epochs"], release_dir=releases,
        meta=ReleaseMeta(tokenizer_hash=BUILTIN_TOKENIZER_HASH,
                         sampler_contract=settings_id(beh, s["max_tokens_per_action"], s["stop_token_ids"]),
                         contract_hash=c.hash, curriculum_version=c.curriculum_version, reward_version=c.reward_version),
        max_lag=pk["max_lag"], stale_policy=pk["stale_policy"], token_budget=pk["token_budget"], state_dir=state,
        compression={f"{d['run_id']}.{short}": codec for short, codec in d["topics"]["compression"].items()},
    )


def llm_config_from_contract(c: C.Contract, brokers: str, releases: str, state: str | None, model_path: str,
                             export_dtype: str = "f32") -> TrainConfig:
    """The trainer of a GGUF language model (trajflow.llm): the contract's
    loss, optimizer and packing; the behavior transform of its sampler
    (temperature, top-k, top-p, no grammar); the release identities from the
    GGUF (tokenizer and chat template hashes, checked again at every
    restore)."""
    from . import gguf_io
    from .llm import LLMBackend
    d = c.doc
    s, opt = d["sampler"], d["loss"]["optimizer"]
    if s["min_p"] != 0:
        raise C.ContractError("sampler.min_p: the language-model trainer's behavior transform has no min-p; set it to 0")
    if opt["minibatches"] != 1:
        raise C.ContractError("loss.optimizer.minibatches: the trainer takes one step per epoch; set it to 1")
    if not os.path.isfile(model_path):
        raise C.ContractError(f"--model gguf:{model_path}: no such file")
    try:
        ident = gguf_io.identity(gguf_io.read_gguf(model_path, dequantize=False))
    except gguf_io.GGUFError as e:
        raise C.ContractError(f"--model gguf:{model_path}: {e}") from None
    cfg = config_from_contract(c, brokers, releases, state, builtin=False)
    cfg.behavior = Behavior(temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], grammar=None)
    cfg.behavior.validate()
    cfg.meta = ReleaseMeta(tokenizer_hash=ident.tokenizer_hash, chat_template_hash=ident.chat_template_hash,
                           sampler_contract=settings_id(cfg.behavior, s["max_tokens_per_action"], s["stop_token_ids"]),
                           contract_hash=c.hash, curriculum_version=c.curriculum_version, reward_version=c.reward_version)
    cfg.backend = LLMBackend(model_path, export_dtype)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trajflow.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="from_file", default=None, metavar="TRAINER_JSON",
                    help="OUT/trainer.json of `trajflow demo --trainer external`: brokers, run, releases, contract, "
                         "initial checkpoint and updates from it (flags given as well override it)")
    ap.add_argument("--brokers", help="comma-separated bootstrap brokers (required without --from)")
    ap.add_argument("--run", help="run id, the contract's run_id (required without --from)")
    ap.add_argument("--releases", help="policy releases directory shared with the rollout workers (required without --from)")
    ap.add_argument("--contract", help="resolved learning contract, trajflow contract validate FILE (required without --from)")
    ap.add_argument("--state", default=None, help="local state directory (optional; rebuilt from the topics when lost)")
    ap.add_argument("--init-checkpoint", default=None, help="checkpoint of version 0 when the policy topic is empty")
    ap.add_argument("--group", default=None, help="consumer group (default <run>.train)")
    ap.add_argument("--max-updates", type=int, default=0, help="stop after this many trained batches (0: until stopped)")
    ap.add_argument("--model", default="builtin", help="builtin (the window-MLP) or gguf:PATH (a llama-architecture GGUF)")
    ap.add_argument("--export-dtype", default="f32", choices=["f32", "f16"], help="tensor type of the GGUF releases (--model gguf:)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fixed reduction order, bit-reproducible)")
    ap.add_argument("--print-updates", action="store_true", help="print one JSON line per trained update on stdout")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    try:
        apply_trainer_json(a)
    except (OSError, ValueError, KeyError) as e:
        print(f"trajflow.train: --from {a.from_file}: {e}", file=sys.stderr)
        return 2
    missing = [f"--{k}" for k in ("brokers", "run", "releases", "contract") if not getattr(a, k)]
    if missing:
        ap.print_usage(sys.stderr)
        print(f"trajflow.train: {', '.join(missing)} required (or --from OUT/trainer.json)", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, a.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    torch.set_num_threads(max(1, a.threads))  # 1: fixed reduction order, the same batches give the same bytes
    try:
        c = C.load(a.contract)
        if c["run_id"] != a.run:
            raise C.ContractError(f"--run {a.run!r} but the contract's run_id is {c['run_id']!r}")
        if a.model == "builtin":
            cfg = config_from_contract(c, a.brokers, a.releases, a.state)
        elif a.model.startswith("gguf:"):
            if a.init_checkpoint:
                raise C.ContractError("--init-checkpoint is for the built-in policy; --model gguf:PATH is version 0")
            cfg = llm_config_from_contract(c, a.brokers, a.releases, a.state, a.model[len("gguf:"):], a.export_dtype)
        else:
            raise C.ContractError(f"--model {a.model!r}: want builtin or gguf:PATH")
    except (OSError, C.ContractError, ValueError) as e:
        print(f"trajflow.train: {e}", file=sys.stderr)
        return 2
    if a.init_checkpoint:
        with open(a.init_checkpoint, "rb") as f:
            cfg.init_checkpoint = f.read()
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stage = TrainStage(cfg)
    stage.start()
    stage.publish_initial()
    consumer = AssignedConsumer(a.brokers, a.group or f"{a.run}.train", cfg.topics.batches, cfg.kafka)
    print(f"trainer ready: run {a.run}, version {stage.trainer.version}", flush=True)
    try:
        while not stop["now"]:
            m = consumer.poll(0.5)
            if m is None:
                continue
            what = stage.process(m)
            consumer.commit(m)
            if what == "trained" and a.print_updates:
                print("update " + json.dumps(update_line(stage)), flush=True)
            if a.max_updates and stage.counts["trained"] >= a.max_updates:
                break
    finally:
        consumer.close()
        stage.producer.close()
    logging.getLogger("trajflow.train").info("stopped: %s", stage.counts)
    return 0


def apply_trainer_json(a) -> None:
    """Fills the arguments a left unset from a.from_file, the trainer.json
    the demo writes (internal/loop.TrainerInfo); a flag given on the command
    line wins."""
    if not a.from_file:
        return
    with open(a.from_file) as f:
        info = json.load(f)
    given = {"brokers": ",".join(info["brokers"]), "run": info["run_id"], "releases": info["releases"],
             "contract": info["contract"], "init_checkpoint": info.get("init_checkpoint") or None,
             "max_updates": int(info.get("updates") or 0)}
    for k, v in given.items():
        if not getattr(a, k):
            setattr(a, k, v)


def update_line(stage: TrainStage) -> dict:
    """The per-update summary printed with --print-updates."""
    rec = stage.last_record or {}
    m = rec.get("metrics", {})
    t = rec.get("trainer", {})
    out = {"version": rec.get("version"), "batch_index": rec.get("batch_index"), "tokens": m.get("tokens"),
           "loss": m.get("loss"), "approx_kl": m.get("approx_kl_old"), "ratio_mean": m.get("ratio_mean"),
           "clip_frac_pos": m.get("clip_frac_pos"), "clip_frac_neg": m.get("clip_frac_neg"),
           "entropy": m.get("entropy"), "grad_norm": m.get("grad_norm"), "train_s": rec.get("step_seconds"),
           "release_s": stage.release_seconds}
    for k in ("timings", "max_rss_mb"):
        if k in t:
            out[k] = t[k]
    if "mismatch" in t:
        out["mismatch"] = {k: v for k, v in t["mismatch"].items() if k != "by_version"}
    return out


if __name__ == "__main__":
    code = main()
    # main closed the consumer and flushed the producer before it returned;
    # nothing is left to release. The interpreter's teardown would still
    # destroy the librdkafka producer handle (which waits for requests in
    # flight, up to socket.timeout.ms) and native worker threads, and a
    # stopped trainer was seen alive more than 30 s after its last log
    # line: exit at once, with the output flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
