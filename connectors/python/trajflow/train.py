"""python -m trajflow.train: the trainer of the built-in policy over Kafka.

    python -m trajflow.train --brokers 127.0.0.1:9092 --run demo \\
        --releases /shared/releases --contract resolved.yaml [--state DIR]

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


def config_from_contract(c: C.Contract, brokers: str, releases: str, state: str | None) -> TrainConfig:
    d = c.doc
    s, loss, opt, pk = d["sampler"], d["loss"], d["loss"]["optimizer"], d["packing"]
    if s["min_p"] != 0:
        raise C.ContractError("sampler.min_p: the built-in policy's behavior distribution has no min-p; set it to 0")
    if opt["minibatches"] != 1:
        raise C.ContractError("loss.optimizer.minibatches: the built-in trainer takes one step per epoch; set it to 1")
    if not d["artifacts"]["tokenizer"].startswith("builtin:tokenizer/kv@"):
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
                          entropy_coef=loss["entropy_coef"], max_log_ratio=loss["max_log_ratio"],
                          off_policy=loss["off_policy"], is_cap=loss["is_cap"]),
        adam=Adam(lr=opt["lr"], beta1=opt["beta1"], beta2=opt["beta2"], eps=opt["eps"], weight_decay=0.0,
                  max_grad_norm=opt["grad_clip"]),
        epochs=opt["epochs"], release_dir=releases,
        meta=ReleaseMeta(tokenizer_hash=BUILTIN_TOKENIZER_HASH,
                         sampler_contract=settings_id(beh, s["max_tokens_per_action"], s["stop_token_ids"]),
                         contract_hash=c.hash),
        max_lag=pk["max_lag"], stale_policy=pk["stale_policy"], state_dir=state,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trajflow.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--brokers", required=True, help="comma-separated bootstrap brokers")
    ap.add_argument("--run", required=True, help="run id (must be the contract's run_id)")
    ap.add_argument("--releases", required=True, help="policy releases directory shared with the rollout workers")
    ap.add_argument("--contract", required=True, help="resolved learning contract (trajflow contract validate FILE)")
    ap.add_argument("--state", default=None, help="local state directory (optional; rebuilt from the topics when lost)")
    ap.add_argument("--init-checkpoint", default=None, help="checkpoint of version 0 when the policy topic is empty")
    ap.add_argument("--group", default=None, help="consumer group (default <run>.train)")
    ap.add_argument("--max-updates", type=int, default=0, help="stop after this many trained batches (0: until stopped)")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, a.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    torch.set_num_threads(1)  # fixed reduction order: the same batches give the same bytes
    try:
        c = C.load(a.contract)
        if c["run_id"] != a.run:
            raise C.ContractError(f"--run {a.run!r} but the contract's run_id is {c['run_id']!r}")
        cfg = config_from_contract(c, a.brokers, a.releases, a.state)
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
            stage.process(m)
            consumer.commit(m)
            if a.max_updates and stage.counts["trained"] >= a.max_updates:
                break
    finally:
        consumer.close()
        stage.producer.close()
    logging.getLogger("trajflow.train").info("stopped: %s", stage.counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
