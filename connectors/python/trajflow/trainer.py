"""The trainer's side of the delivery protocol, as the Go train stage
(gpu/stage.go) runs it, for the built-in policy.

Exactly-once training over at-least-once delivery:

* A batch whose id was trained, or whose index is not above the last index
  trained, is skipped (redelivery) and its offset committed.
* A segment whose trajectory id was already trained is masked out of the
  batch (its action mask set to 0) and counted; the update record says how
  many (``duplicates``) and an incident ``duplicate_trajectory`` is raised.
  A batch with no new trajectory is refused (``duplicate_batch``).
* The lag rule holds where the gradient is taken, as in the Go train
  stage (operators/train LagRule): with ``from`` the trainer's version at
  the update, a trained token whose behavior version v has
  ``from - v > max_lag`` is never trained. Under the contract's
  ``stale_policy: drop`` every segment holding such a token is masked out;
  under ``mask_stale`` only the stale tokens are. A segment left with no
  trained token is dropped: census ``filtered`` with reason
  ``stale_at_update`` (stage train, its excluded tokens in
  ``stale_tokens``). The update record counts the excluded tokens
  (``stale_tokens``, ``stale_lag`` by lag), the dropped segments
  (``stale_segments``, ``not_trained``) and the trained tokens by lag
  (``lag_tokens``); a batch left with no trained token is refused
  (``stale_batch``), its trajectories counted in the census the same way.
* State is rebuilt at start from the policy topic (latest ready release),
  that release's update record (last batch index), the optimizer state
  beside it, and the batches topic (the ids of every batch up to that index
  and of their trajectories). A local state directory, when given and
  consistent with the latest release, spares the batches scan; it is never
  needed.
* The offset of a batch is committed only after its release is durable:
  update record, optimizer state, checkpoint and manifest written
  atomically (temporary file, fsync, rename, directory fsync), the
  manifest acknowledged on the policy topic (acks=all), and the census
  "trained" events and incidents acknowledged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from . import batches as B
from .batches import quarantine_record
from .ids import census_record, incident_record, read_update_document, update_document
from .kafka import AckProducer, Message, scan
from .model import Behavior, Config, ShapeError, WindowMLP, init_params, load_checkpoint
from .packed import KL_LOSS, ObjectiveInputError, Options
from .release import (ReleaseMeta, checkpoint_path, decode_release, optim_name, refused_name, release_record,
                      update_name, write_atomic, write_release)
from .update import Adam, Trainer

log = logging.getLogger("trajflow.train")

STALE_DROP = "drop"
STALE_MASK = "mask_stale"
# The census reason of a trajectory the lag rule excluded at the update
# (schemas.ReasonStaleAtUpdate).
REASON_STALE_AT_UPDATE = "stale_at_update"


@dataclass
class Topics:
    batches: str
    policy: str
    quarantine: str
    census: str
    incidents: str

    @classmethod
    def for_run(cls, run: str) -> "Topics":
        return cls(batches=f"{run}.batches", policy=f"{run}.policy", quarantine=f"{run}.quarantine",
                   census=f"{run}.census", incidents=f"{run}.incidents")


class MLPBackend:
    """The built-in window-MLP (trajflow.model) as the trained policy.

    With ``kl_placement: loss`` every trainer it builds holds the frozen
    reference policy: version 0's parameters (the initial checkpoint, else
    the seeded initialization), also when it restores a later version."""

    name = "trajflow.train (PyTorch)"
    keep_optim = 0  # keep every version's optimizer state, as the Go trainer does

    def _initial_params(self, c: "TrainConfig") -> np.ndarray:
        """The parameters of version 0."""
        if c.init_checkpoint is not None:
            cfg, p = load_checkpoint(c.init_checkpoint)
            if cfg != c.model:
                raise ValueError(f"initial checkpoint is {cfg}, the contract's model is {c.model}")
            return p
        return init_params(c.model, c.model_seed)

    def _reference(self, c: "TrainConfig") -> Optional[WindowMLP]:
        """The frozen reference policy (version 0) when the loss needs one."""
        if c.objective.kl_placement != KL_LOSS:
            return None
        return WindowMLP(c.model, self._initial_params(c))

    def initial(self, c: "TrainConfig") -> Trainer:
        p = self._initial_params(c)
        return Trainer(WindowMLP(c.model, p), c.behavior, 0, reference=self._reference(c))

    def restore(self, c: "TrainConfig", rel: dict) -> Trainer:
        v = rel["policy_version"]
        with open(checkpoint_path(rel), "rb") as f:
            model = WindowMLP.from_checkpoint(f.read(), rel["checkpoint_hash"])
        if model.cfg.hash() != rel["model_config_hash"]:
            raise ValueError(f"version {v}: model config hash {model.cfg.hash()}, manifest says {rel['model_config_hash']}")
        return Trainer(model, c.behavior, v, reference=self._reference(c))


@dataclass
class TrainConfig:
    brokers: str
    run_id: str
    topics: Topics
    contract_hash: str
    behavior: Behavior
    model: Config
    model_seed: int
    objective: Options
    adam: Adam
    epochs: int
    release_dir: str
    meta: ReleaseMeta
    max_lag: int
    stale_policy: str
    # packing.token_budget: a longer row is refused as untrainable (0: unchecked).
    token_budget: int = 0
    state_dir: Optional[str] = None
    init_checkpoint: Optional[bytes] = None
    kafka: dict = field(default_factory=dict)
    # Producer codec per full topic name (the contract's topics.compression).
    compression: dict = field(default_factory=dict)
    stage: str = "train"
    # The trained policy: MLPBackend (default) or trajflow.llm_backend.LLMBackend.
    backend: object = None


def json_records(r) -> list:
    """A (topic, key, value, headers) record as JSON (hex bytes)."""
    topic, key, value, hs = r
    return [topic, (key or b"").hex(), value.hex(), [[k, (v or b"").hex()] for k, v in hs]]


def bytes_records(j) -> tuple:
    topic, key, value, hs = j
    return (topic, bytes.fromhex(key), bytes.fromhex(value), hs)


class TrainStage:
    def __init__(self, cfg: TrainConfig, producer: Optional[AckProducer] = None):
        if cfg.epochs < 1:
            raise ValueError(f"epochs {cfg.epochs} must be >= 1")
        if cfg.stale_policy not in (STALE_DROP, STALE_MASK):
            raise ValueError(f"stale_policy {cfg.stale_policy!r}: want {STALE_DROP} or {STALE_MASK}")
        cfg.objective.validate()
        cfg.adam.validate()
        self.cfg = cfg
        self.backend = cfg.backend if cfg.backend is not None else MLPBackend()
        self.producer = producer or AckProducer(cfg.brokers, cfg.kafka, compression=cfg.compression)
        self.trainer: Optional[Trainer] = None
        self.last_index = -1
        self.batches: set[str] = set()
        self.trained: set[str] = set()
        self.initial = False
        self.counts = {"trained": 0, "skipped": 0, "refused": 0}
        # The batches refused whole since the last update record and their
        # cost (batches.refused_cost), which the next record carries;
        # stored beside the release as refused_name(version).
        self.refused: dict = {"batches": [], "cost": None}
        self.release_seconds = 0.0
        self.last_record: Optional[dict] = None
        # Census and incident records of the latest update, re-sent when its
        # batch is redelivered after a restart (see process).
        self.last_outputs: list = []
        self.last_outputs_of: Optional[str] = None

    # ------------------------------------------------------------ start
    def start(self) -> None:
        c = self.cfg
        os.makedirs(c.release_dir, exist_ok=True)
        latest: dict = {}

        def on_release(m: Message):
            try:
                rel = decode_release(m.value)
            except (ValueError, json.JSONDecodeError):
                return
            if rel["ready"] and rel["policy_version"] >= latest.get("policy_version", -1):
                latest.clear()
                latest.update(rel)

        scan(c.brokers, c.topics.policy, on_release, c.kafka)
        if not latest:
            self.trainer = self.backend.initial(c)
            self.initial = True
            log.info("trainer starts from the initial policy, version 0")
            return
        v = latest["policy_version"]
        self._read_refused(v)
        self.trainer = self.backend.restore(c, latest)
        self.trainer.steps = latest["training_step"]
        op = os.path.join(c.release_dir, optim_name(v))
        if os.path.exists(op):
            self.trainer.load_optim(op)
        elif v > 0:
            log.warning("no optimizer state beside release %d; Adam restarts from zero moments", v)
        if v > 0:
            with open(os.path.join(c.release_dir, update_name(v)), "rb") as f:
                u = read_update_document(f.read())
            self.last_index = u["batch_index"]
            self.last_outputs = [tuple(r[:3]) + ([(k, bytes.fromhex(h)) for k, h in r[3]],)
                                 for r in (bytes_records(x) for x in u.get("trainer", {}).get("outputs", []))]
            self.last_outputs_of = u["batch_id"]
        how = "from local state"
        if not self._load_local(v):
            self._rebuild(v)
            self._save_local()
            how = "from the topics"
        log.info("trainer restored %s: version %d, last batch %d, %d trained trajectories", how, v, self.last_index,
                 len(self.trained))

    def _rebuild(self, v: int) -> None:
        """The trained batch and trajectory ids, from the update records of
        versions 1..v (which batch each version trained, and which of its
        trajectories the lag rule took out) and the batches topic (the
        trajectories of those batches). Without the update records (a
        pruned release directory) every batch up to the last index counts
        as trained, as the Go train stage rebuilds it."""
        c = self.cfg
        trained_batches: Optional[set] = set()
        not_trained: set = set()
        for k in range(1, v + 1):
            try:
                with open(os.path.join(c.release_dir, update_name(k)), "rb") as f:
                    u = read_update_document(f.read())
            except (OSError, ValueError):
                log.warning("update record %d missing: every batch up to index %d counts as trained", k, self.last_index)
                trained_batches = None
                break
            trained_batches.add(u["batch_id"])
            not_trained.update(u.get("not_trained") or [])

        def on_batch(m: Message):
            try:
                b = B.decode_packed_batch(m.value, m.headers)
            except B.Refusal:
                return
            if b.batch_index > self.last_index:
                return
            if trained_batches is not None and b.batch_id not in trained_batches:
                return
            self.batches.add(b.batch_id)
            for r in b.rows:
                self.trained.update(t for t in r.segment_trajectory_ids if t not in not_trained)

        scan(c.brokers, c.topics.batches, on_batch, c.kafka)

    def _state_path(self) -> Optional[str]:
        if not self.cfg.state_dir:
            return None
        return os.path.join(self.cfg.state_dir, "train-state.json")

    def _load_local(self, version: int) -> bool:
        p = self._state_path()
        if p is None or not os.path.exists(p):
            return False
        try:
            with open(p, "rb") as f:
                st = json.loads(f.read())
        except (OSError, ValueError):
            return False
        if st.get("run_id") != self.cfg.run_id or st.get("version") != version or st.get("last_index") != self.last_index:
            return False
        self.batches = set(st["batches"])
        self.trained = set(st["trained"])
        return True

    def _save_local(self) -> None:
        p = self._state_path()
        if p is None:
            return
        os.makedirs(os.path.dirname(p), exist_ok=True)
        st = {"run_id": self.cfg.run_id, "version": self.trainer.version, "last_index": self.last_index,
              "batches": sorted(self.batches), "trained": sorted(self.trained)}
        write_atomic(p, json.dumps(st).encode())

    def _read_refused(self, v: int) -> None:
        p = os.path.join(self.cfg.release_dir, refused_name(v))
        self.refused = {"batches": [], "cost": None}
        if not os.path.exists(p):
            return
        with open(p, "rb") as f:
            st = json.loads(f.read())
        cost = B.window_cost([(B.HEADER_WINDOW_COST, json.dumps(st["cost"]).encode())])  # validated as a header is
        self.refused = {"batches": list(st["batches"]), "cost": cost}

    def _refuse_batch(self, batch_id: str, wcost: Optional[dict]) -> None:
        """Adds a batch refused whole to the refused cost and stores it
        beside the current release before the refusal is committed (a
        redelivered batch is not added twice), as the Go train stage does."""
        if wcost is None or batch_id in self.refused["batches"]:
            return
        nxt = {"batches": self.refused["batches"] + [batch_id],
               "cost": B.add_window_cost(self.refused["cost"], B.refused_cost(wcost))}
        write_atomic(os.path.join(self.cfg.release_dir, refused_name(self.trainer.version)),
                     json.dumps(nxt, separators=(",", ":")).encode())
        self.refused = nxt

    # ---------------------------------------------------------- publish
    def _release(self, next_batch: int = 0) -> dict:
        t = self.trainer
        rel = write_release(self.cfg.release_dir, t.version, t.steps, t.checkpoint_payload(), t.config_hash(), self.cfg.meta,
                            ext=t.CHECKPOINT_EXT, next_batch=next_batch)
        return rel

    def publish_initial(self) -> None:
        if not self.initial:
            return
        rel = self._release()
        self.producer.send([(self.cfg.topics.policy,) + release_record(self.cfg.run_id, rel)])
        self.initial = False
        log.info("published the initial policy, version 0")

    # ---------------------------------------------------------- process
    def refuse(self, m: Message, reason: str, detail: str) -> str:
        self.producer.send([quarantine_record(self.cfg.topics.quarantine, self.cfg.stage, m, reason, detail)])
        self.counts["refused"] += 1
        log.warning("batch at %s refused: %s: %s", m.ref, reason, detail)
        return reason

    def process(self, m: Message) -> str:
        """Handles one batches-topic message; returns what happened
        ("trained", "skipped", or the refusal reason). Every output is
        acknowledged when it returns: the caller then commits m."""
        self.publish_initial()
        c = self.cfg
        try:
            batch = B.decode_packed_batch(m.value, m.headers)
            wcost = B.window_cost(m.headers)
        except B.Refusal as r:
            return self.refuse(m, r.reason, r.detail)
        if batch.batch_id in self.batches or batch.batch_index <= self.last_index:
            if batch.batch_index == self.last_index and self.last_outputs_of == batch.batch_id:
                # The latest update's own batch, redelivered: its census and
                # incident records may not all have been acknowledged before
                # a crash (the manifest was). Their ids are deterministic, so
                # sending them again is safe.
                self.producer.send(self.last_outputs)
                self.last_outputs_of = None
            self.counts["skipped"] += 1
            return "skipped"
        if batch.contract_hash != c.contract_hash:
            return self.refuse(m, B.REASON_CONTRACT_MISMATCH,
                               f"batch {batch.batch_id} of contract {batch.contract_hash}, trainer runs {c.contract_hash}")
        try:
            B.check_rows(batch, c.token_budget)
        except B.Refusal as r:
            return self.refuse(m, r.reason, r.detail)
        dups, fresh = 0, 0
        for r in batch.rows:
            for k, tid in enumerate(r.segment_trajectory_ids):
                if tid in self.trained:
                    dups += 1
                    r.action_mask[r.segment_ids == k] = 0
                else:
                    fresh += 1
        if not fresh:
            return self.refuse(m, B.REASON_DUPLICATE_BATCH, f"every trajectory of batch {batch.batch_id} was trained already")
        frm = self.trainer.version
        lag = self._lag_rule(batch)
        ids, stale_ids = lag["trained"], lag["dropped"]
        at = int(time.time() * 1e6)
        stale_events = [(c.topics.census,) + census_record({
            "run_id": c.run_id, "attempt_id": tid, "kind": "filtered", "stage": c.stage, "reason": REASON_STALE_AT_UPDATE,
            "batch_id": batch.batch_id, "update": batch.batch_index, "policy_version": frm,
            "stale_tokens": lag["masked"].get(tid, 0), "at_us": at}) for tid in stale_ids]
        if not ids:
            self.producer.send(stale_events)
            self._refuse_batch(batch.batch_id, wcost)
            return self.refuse(m, B.REASON_STALE_BATCH,
                               f"batch {batch.batch_id}: no trained token within max_lag {c.max_lag} of trainer version {frm} "
                               f"({lag['stale_tokens']} tokens, {len(stale_ids)} segments excluded)")
        t0 = time.monotonic()
        try:
            first, last = self.trainer.update(batch, c.objective, c.adam, c.epochs)
        except (ObjectiveInputError, ShapeError, B.Refusal, ValueError) as e:
            self._refuse_batch(batch.batch_id, wcost)
            return self.refuse(m, B.REASON_UNTRAINABLE, f"batch {batch.batch_id}: {e}")
        secs = time.monotonic() - t0
        v = self.trainer.version
        out = list(stale_events)
        for tid in ids:
            out.append((c.topics.census,) + census_record({
                "run_id": c.run_id, "attempt_id": tid, "kind": "trained", "stage": c.stage,
                "batch_id": batch.batch_id, "update": batch.batch_index, "policy_version": v,
                "tokens": lag["left"].get(tid, 0), "stale_tokens": lag["masked"].get(tid, 0), "at_us": at}))
        if dups:
            out.append((c.topics.incidents,) + incident_record({
                "run_id": c.run_id, "attempt_id": batch.batch_id, "stage": c.stage, "reason": "duplicate_trajectory",
                "detail": f"{dups} segments of batch {batch.batch_id} were trained already and were masked out",
                "source": m.ref, "at_us": at}))
        rec = {"version": v, "batch_id": batch.batch_id, "batch_index": batch.batch_index,
               "metrics": first.metrics(), "last": last.to_dict(), "duplicates": dups,
               "max_lag": c.max_lag, "stale_policy": c.stale_policy, "stale_tokens": lag["stale_tokens"],
               "stale_segments": len(stale_ids)}
        if stale_ids:
            rec["not_trained"] = stale_ids
        if lag["stale_lag"]:
            rec["stale_lag"] = lag["stale_lag"]
        if lag["lag_tokens"]:
            rec["lag_tokens"] = lag["lag_tokens"]
        rec["selection"] = lag["selection"]
        rec["cost"] = B.update_cost(B.add_window_cost(self.refused["cost"], wcost), rec["metrics"]["tokens"] * c.epochs, secs)
        rec.update({"step_seconds": secs,
                    "trainer": {"trainer": self.backend.name, "torch": torch.__version__,
                                "source": m.ref, **first.extra, "outputs": [json_records(r) for r in out]}})
        t1 = time.monotonic()
        write_atomic(os.path.join(c.release_dir, update_name(v)), update_document(rec))
        self.refused = {"batches": [], "cost": None}  # in the record now
        write_atomic(os.path.join(c.release_dir, optim_name(v)), self.trainer.optim_payload())
        rel = self._release(batch.batch_index + 1)
        self.producer.send([(c.topics.policy,) + release_record(c.run_id, rel)] + out)
        self.release_seconds = time.monotonic() - t1
        self.last_record = rec
        self._prune_optim(v)
        self.last_outputs, self.last_outputs_of = out, None
        self.last_index = batch.batch_index
        self.batches.add(batch.batch_id)
        self.trained.update(ids)
        self._save_local()
        self.counts["trained"] += 1
        log.info("trained batch %s (index %d) -> version %d in %.3fs, loss %.5f", batch.batch_id, batch.batch_index, v,
                 secs, first.stats.loss)
        return "trained"

    def _prune_optim(self, v: int) -> None:
        """Removes optimizer states older than the backend keeps (a
        language model's is 1 GB a version); only after the newer release
        is durable, so a restart always finds the state of its release."""
        keep = getattr(self.backend, "keep_optim", 0)
        if not keep:
            return
        for k in range(max(0, v - keep - 8), v - keep + 1):
            try:
                os.unlink(os.path.join(self.cfg.release_dir, optim_name(k)))
            except FileNotFoundError:
                pass

    def _lag_rule(self, batch: B.PackedBatch) -> dict:
        """Masks the tokens the lag rule excludes at this update (see the
        module docstring; operators/train LagRule.Apply) and returns what it
        did: the excluded tokens (``stale_tokens``, by lag ``stale_lag``,
        per trajectory ``masked``), the trained tokens by lag
        (``lag_tokens``, per trajectory ``left``), and the trajectories
        left with a trained token (``trained``) or none (``dropped``), in
        row then segment order. Segments without a trained token before
        the rule (duplicates masked out) are in neither list."""
        frm = self.trainer.version
        stale_h: dict = {}
        kept_h: dict = {}
        masked: dict = {}
        left: dict = {}
        trained_ids, dropped = [], []
        total = 0
        # The selection account (schemas.UpdateSelection): segments with a
        # trained token before the rule, and those left with one.
        segs = segs_trained = length = length_trained = before = 0
        groups, groups_trained = set(), set()
        for r in batch.rows:
            trained = r.action_mask == 1
            lag = frm - r.policy_versions.astype(np.int64)
            stale = trained & (lag > self.cfg.max_lag)
            had = np.bincount(r.segment_ids[trained], minlength=len(r.segment_trajectory_ids))
            if self.cfg.stale_policy == STALE_DROP:
                bad = np.zeros(len(r.segment_trajectory_ids), dtype=bool)
                bad[np.unique(r.segment_ids[stale])] = True
                out = trained & bad[r.segment_ids]
            else:
                out = stale
            for L, n in zip(*np.unique(lag[out], return_counts=True)):
                stale_h[int(L)] = stale_h.get(int(L), 0) + int(n)
            keep = trained & ~out
            for L, n in zip(*np.unique(lag[keep], return_counts=True)):
                kept_h[int(L)] = kept_h.get(int(L), 0) + int(n)
            total += int(out.sum())
            gone = np.bincount(r.segment_ids[out], minlength=len(r.segment_trajectory_ids))
            r.action_mask[out] = 0
            for k, tid in enumerate(r.segment_trajectory_ids):
                if gone[k]:
                    masked[tid] = masked.get(tid, 0) + int(gone[k])
                if had[k] == 0:
                    continue
                segs += 1
                groups.add(r.segment_group_ids[k])
                length += int(r.segment_lengths[k])
                before += int(had[k])
                if had[k] == gone[k]:
                    dropped.append(tid)
                else:
                    trained_ids.append(tid)
                    left[tid] = left.get(tid, 0) + int(had[k] - gone[k])
                    segs_trained += 1
                    groups_trained.add(r.segment_group_ids[k])
                    length_trained += int(r.segment_lengths[k])
        hist = lambda h: [{"lag": L, "tokens": h[L]} for L in sorted(h)]  # noqa: E731
        sel = {"segments": segs, "trained_segments": segs_trained, "groups": len(groups),
               "trained_groups": len(groups_trained), "length_mean": length / segs if segs else 0.0,
               "length_mean_trained": length_trained / segs_trained if segs_trained else 0.0,
               "stale_share": total / before if before else 0.0}
        return {"stale_tokens": total, "stale_lag": hist(stale_h), "lag_tokens": hist(kept_h), "masked": masked,
                "left": left, "trained": trained_ids, "dropped": dropped, "selection": sel}
