"""A llama.cpp ``llama-server`` from Python: start it (single model or router
mode over a models directory) on 127.0.0.1, load versions, and sample with
the behavior log-probs trajflow records (deploy/local/LLAMA.md has the API
facts this relies on).

Sampling requests send every sampler setting explicitly (the server's
defaults are not neutral): the chain ``["temperature", "top_k", "top_p"]``
(the order of trajflow.model.Behavior), ``min_p 0``, no penalties,
``post_sampling_probs: true`` (the probability after the chain, whose log
is the behavior log-prob), ``cache_prompt: false`` (log-probs that do not
depend on what ran before), ``return_tokens: true``. An entry the server
leaves out (a token that ends inside a UTF-8 character has none) gives no
log-prob: :func:`align_probs` pairs entries with tokens and leaves such a
position ``None``; callers do not train it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Optional


class LlamaError(RuntimeError):
    pass


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class LlamaServer:
    """One llama-server process; ``models_dir`` starts router mode (each
    ``NAME.gguf`` there is the model NAME, loaded on demand)."""

    def __init__(self, binary: str, model: Optional[str] = None, models_dir: Optional[str] = None,
                 threads: int = 2, ctx: int = 2048, slots: int = 2, models_max: int = 2, log_path: Optional[str] = None,
                 port: int = 0):
        if (model is None) == (models_dir is None):
            raise ValueError("give exactly one of model (single) and models_dir (router)")
        self.binary, self.model, self.models_dir = binary, model, models_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [binary, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx), "-np", str(slots),
                "-t", str(threads), "--metrics", "--no-webui"]
        if model is not None:
            args += ["-m", model, "--alias", os.path.basename(model).removesuffix(".gguf")]
        else:
            args += ["--models-dir", models_dir, "--models-max", str(models_max), "--no-models-autoload"]
        env = dict(os.environ)
        # Spinning OpenMP workers are ~20x slower on shared cores.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.log_path = log_path or os.devnull
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

    # ------------------------------------------------------------ process
    def wait_ready(self, timeout: float = 120.0) -> "LlamaServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaError(f"llama-server exited with {self.proc.returncode}; log {self.log_path}")
            try:
                if self.get("/health", timeout=2).get("status") == "ok":
                    return self
            except (OSError, LlamaError, ValueError):
                pass
            time.sleep(0.2)
        raise LlamaError(f"llama-server at {self.url} not healthy after {timeout} s; log {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (the router's children
        too), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.stop()

    # --------------------------------------------------------------- HTTP
    def _call(self, method: str, path: str, body=None, timeout: float = 300.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise LlamaError(f"{method} {self.url}{path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except urllib.error.URLError as e:
            raise LlamaError(f"{method} {self.url}{path}: {e.reason}") from None

    def get(self, path: str, timeout: float = 30.0):
        return self._call("GET", path, timeout=timeout)

    def post(self, path: str, body, timeout: float = 300.0):
        return self._call("POST", path, body, timeout=timeout)

    # -------------------------------------------------------------- router
    def models(self, reload: bool = False) -> dict:
        """{name: status value} of a router's models (reload rescans the
        directory: new files appear, removed ones go)."""
        d = self.get("/models?reload=1" if reload else "/models")
        out = {}
        for m in d.get("data", []):
            st = m.get("status", {})
            out[m["id"]] = "failed" if st.get("failed") else st.get("value", "?")
        return out

    def load(self, name: str, timeout: float = 180.0) -> float:
        """Loads a router model (rescanning the directory first) and waits
        until it is loaded; returns the seconds it took."""
        t0 = time.monotonic()
        ms = self.models(reload=True)
        if name not in ms:
            raise LlamaError(f"router at {self.url} has no model {name!r} after a rescan (has {sorted(ms)})")
        if ms[name] != "loaded":
            try:
                self.post("/models/load", {"model": name})
            except LlamaError as e:
                if "already running" not in str(e):
                    raise
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            st = self.models().get(name)
            if st == "loaded":
                return time.monotonic() - t0
            if st == "failed":
                raise LlamaError(f"router at {self.url}: model {name} failed to load; log {self.log_path}")
            time.sleep(0.1)
        raise LlamaError(f"router at {self.url}: model {name} not loaded after {timeout} s")

    def unload(self, name: str) -> None:
        try:
            self.post("/models/unload", {"model": name})
        except LlamaError as e:
            if "not running" not in str(e):
                raise

    def model_path(self, name: Optional[str] = None) -> str:
        return self.get("/props" + (f"?model={name}" if name else ""))["model_path"]

    # ------------------------------------------------------------ sampling
    def complete(self, prompt: list[int], n_predict: int, seed: int, model: Optional[str] = None,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> dict:
        """One sample: {"tokens", "logprobs" (behavior log-prob per token,
        None where the server gave no entry), "stop_type", "timings"}."""
        if not 0 <= seed < 0xFFFFFFFF:
            raise ValueError(f"seed {seed}: llama-server seeds are 32-bit and 4294967295 means random")
        body = {"prompt": list(map(int, prompt)), "n_predict": int(n_predict), "seed": int(seed),
                "return_tokens": True, "n_probs": 1, "post_sampling_probs": True, "cache_prompt": False,
                "stream": False, "samplers": ["temperature", "top_k", "top_p"], "temperature": float(temperature),
                "top_k": int(top_k), "top_p": float(top_p), "min_p": 0.0, "typical_p": 1.0, "top_n_sigma": -1.0,
                "repeat_penalty": 1.0, "repeat_last_n": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0, "dynatemp_range": 0.0}
        if model is not None:
            body["model"] = model
        r = self.post("/completion" + ("?autoload=false" if model is not None else ""), body)
        if r.get("truncated"):
            raise LlamaError(f"prompt of {len(prompt)} tokens truncated by the server's context")
        if r.get("tokens_evaluated") != len(prompt):
            raise LlamaError(f"server evaluated {r.get('tokens_evaluated')} prompt tokens, sent {len(prompt)}")
        toks = list(r["tokens"])
        return {"tokens": toks, "logprobs": align_probs(toks, r.get("completion_probabilities", [])),
                "stop_type": r.get("stop_type"), "timings": r.get("timings", {}), "model": r.get("model")}


def align_probs(tokens: list[int], entries: list[dict]) -> list[Optional[float]]:
    """Behavior log-probs per token: entries are a subsequence of tokens
    (deploy/local/LLAMA.md); each is placed at the first unmatched token of
    its id, and a position without an entry is None. A probability of 0 or
    an entry that cannot be placed is an error."""
    out: list[Optional[float]] = [None] * len(tokens)
    j = 0
    for e in entries:
        while j < len(tokens) and tokens[j] != e["id"]:
            j += 1
        if j == len(tokens):
            raise LlamaError(f"log-prob entry for token {e['id']} does not follow the sampled tokens")
        p = e.get("prob")
        if p is None or not p > 0:
            raise LlamaError(f"token {e['id']}: post-sampling probability {p!r}")
        out[j] = float(math.log(p))
        j += 1
    return out
