// Package cuda is the CUDA backend of the trainer consumer (pipeline
// document §12–§14; docs/SYSTEMS.md §8): packed batches travel from Arrow
// records into pinned host staging buffers, are copied to the device
// asynchronously on a copy stream (double-buffered, so the copy of batch
// k+1 overlaps the compute of batch k), and one optimizer step of the
// built-in window-MLP policy (gpu/model) runs on the device: forward and
// backward with cuBLAS matrix products, the target log-prob gather chunked
// over the vocabulary with an online log-sum-exp (the full logits tensor is
// never materialized), the clipped surrogate with the declared
// normalization and global denominators, KL and entropy terms, and Adam.
// The CPU reference is gpu.Trainer.Step (gpu/trainer.go, gpu/objective).
//
// Build tags. The device code (files with the build tag `cuda`) needs cgo,
// cuda.h and cuBLAS headers, and links against libcuda and libcublas; see
// gpu/README.md for building it on a machine without a GPU. Everything that
// does not touch the device — the staging layout, packing Arrow records and
// Go rows into the staging buffer, the capacity policy, the double-buffer
// schedule, the log-sum-exp merge rule and the reduction of per-token
// device outputs to objective.Stats — is pure Go, compiled and tested in
// the default build.
package cuda
