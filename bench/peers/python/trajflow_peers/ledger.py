"""The rollout side's record of every group it launched: the closed loop
(at most `window` groups produced and not yet decided), what reached the
trainer, latency, and what was lost."""

from __future__ import annotations

import time

from .corpus import Corpus
from .measure import percentile


class Ledger:
    def __init__(self, corpus: Corpus, window: int, loss_timeout: float):
        self.cp = corpus
        self.window = window
        self.loss_timeout = loss_timeout
        self.next = 0
        self.inflight: dict[int, int] = {}  # group -> produced at (ns)
        self.presumed_lost: set[int] = set()  # timed out: slot freed
        self.decided: set[int] = set()
        self.late = 0  # decided after their slot had timed out
        self.duplicates = 0
        self.measuring = False
        self.reset_window()

    def reset_window(self) -> None:
        self.w_groups = 0
        self.w_tokens = 0
        self.w_action = 0
        self.w_bytes = 0
        self.w_batches = 0
        self.w_lat: list[float] = []

    def free(self) -> int:
        return self.window - len(self.inflight)

    def launch(self) -> tuple[int, int]:
        g = self.next
        self.next += 1
        t = time.time_ns()
        self.inflight[g] = t
        return g, t

    def batch(self, groups: list, nbytes: int, recv_ns: int) -> None:
        """A batch reached the trainer holding groups [(g, produced_ns)]."""
        if self.measuring:
            self.w_batches += 1
            self.w_bytes += nbytes
        for g, t in groups:
            if g in self.decided:
                self.duplicates += 1
                continue
            self.decided.add(g)
            if self.inflight.pop(g, None) is None:
                if g in self.presumed_lost:
                    self.presumed_lost.discard(g)
                    self.late += 1
            if self.measuring:
                i = g % self.cp.groups
                self.w_groups += 1
                self.w_tokens += self.cp.tokens[i]
                self.w_action += self.cp.action[i]
                self.w_bytes += self.cp.group_bytes(i)
                self.w_lat.append((recv_ns - t) / 1e6)

    def expire(self, now_ns: int | None = None) -> int:
        """Frees the slots of groups in flight longer than loss_timeout (an
        in-memory pipeline never tells the rollout side it dropped them)."""
        now_ns = now_ns or time.time_ns()
        old = [g for g, t in self.inflight.items() if now_ns - t > self.loss_timeout * 1e9]
        for g in old:
            del self.inflight[g]
            self.presumed_lost.add(g)
        return len(old)

    def fail(self, groups: list[int]) -> None:
        """The pipeline reported these groups failed (a Ray task error)."""
        for g in groups:
            if g in self.inflight:
                del self.inflight[g]
                self.presumed_lost.add(g)

    def summary(self, window_s: float, cpu_s: float) -> dict:
        lat = self.w_lat
        produced = self.next
        lost = produced - len(self.decided)
        return {
            "window_s": window_s,
            "groups": self.w_groups,
            "batches": self.w_batches,
            "tokens_per_s": self.w_tokens / window_s,
            "action_tokens_per_s": self.w_action / window_s,
            "mb_s": self.w_bytes / window_s / 1e6,
            "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99),
                           "max": max(lat) if lat else 0.0, "count": len(lat)},
            "cpu_s": cpu_s,
            "cpu_cores": cpu_s / window_s,
            "cpu_s_per_m_action_tokens": cpu_s / max(self.w_action, 1) * 1e6,
            "cpu_s_per_m_tokens": cpu_s / max(self.w_tokens, 1) * 1e6,
            "action_tokens_per_cpu_s": self.w_action / max(cpu_s, 1e-9),
            "mb_per_cpu_s": self.w_bytes / max(cpu_s, 1e-9) / 1e6,
            "produced_groups": produced,
            "decided_groups": len(self.decided),
            "lost_groups": lost,
            "lost_attempts": lost * int(self.cp.header["synth"]["GroupSize"]),
            "lost_action_tokens": sum(self.cp.action[g % self.cp.groups] for g in range(produced) if g not in self.decided),
            "late_groups": self.late,
            "duplicate_groups": self.duplicates,
        }
