#!/usr/bin/env python3
"""PyTorch eager baseline of the log-prob/loss computation (gpu/devicecheck.sh).

Reads the tensors that BenchmarkLogprobLoss wrote (logits [T][V] float32,
targets, behavior log-probs, advantages, the CUDA kernel's log-probs and
timing) and runs the same computation in PyTorch eager mode on the same GPU:

    lp   = log_softmax(logits, -1).gather(-1, targets)      # log-prob gather
    r    = exp(lp - old)
    loss = -mean(min(r * A, clamp(r, 1 - clip_low, 1 + clip_high) * A))

Prints one JSON object: eager times (ms), achieved bandwidth counting the
logits read once (the same convention as the Go benchmark), max |lp_torch -
lp_cuda| and both losses.
"""
import json
import os
import sys

import numpy as np
import torch


def main(d):
    meta = json.load(open(os.path.join(d, "meta.json")))
    T, V = meta["T"], meta["V"]
    dev = torch.device("cuda")
    logits = torch.from_numpy(np.fromfile(os.path.join(d, "logits.f32"), dtype="<f4").reshape(T, V)).to(dev)
    tgt = torch.from_numpy(np.fromfile(os.path.join(d, "targets.i32"), dtype="<i4").astype(np.int64)).to(dev)
    old = torch.from_numpy(np.fromfile(os.path.join(d, "old.f32"), dtype="<f4")).to(dev)
    adv = torch.from_numpy(np.fromfile(os.path.join(d, "adv.f32"), dtype="<f4")).to(dev)
    lp_cuda = torch.from_numpy(np.fromfile(os.path.join(d, "logprob_gpu.f32"), dtype="<f4")).to(dev)
    lo, hi = 1 - meta["clip_low"], 1 + meta["clip_high"]

    def logprob():
        return torch.log_softmax(logits, dim=-1).gather(-1, tgt[:, None]).squeeze(-1)

    def loss_fn():
        lp = logprob()
        r = torch.exp(lp - old)
        return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv).mean(), lp

    def timed(fn, iters=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    with torch.no_grad():
        ms_lp = timed(logprob)
        ms_loss = timed(loss_fn)
        loss, lp = loss_fn()
    nbytes = 4 * T * V
    out = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "T": T,
        "V": V,
        "torch_logprob_ms": ms_lp,
        "torch_loss_ms": ms_loss,
        "torch_loss_gbps": nbytes / (ms_loss * 1e-3) / 1e9,
        "cuda_kernel_ms": meta["kernel_ms"],
        "cuda_kernel_gbps": meta["kernel_gbps"],
        "speedup_vs_torch": ms_loss / meta["kernel_ms"],
        "max_abs_logprob_diff": float((lp - lp_cuda).abs().max()),
        "torch_loss": float(loss),
        "cuda_loss": meta["loss"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
