//go:build !cuda

package main

import "testing"

// TestRunTrainCUDAWithoutCUDARefused: a build without the cuda tag refuses
// run train --device cuda at once (exit 2, naming the flag and the build),
// before the operator's health server or consumer starts.
func TestRunTrainCUDAWithoutCUDARefused(t *testing.T) {
	for _, dev := range []string{"cuda", "cuda:1"} {
		t.Run(dev, func(t *testing.T) {
			wantRefused(t, []string{"run", "train", "--brokers", "127.0.0.1:1", "--state", t.TempDir(), "--health", "127.0.0.1:0", "--releases", t.TempDir(), "--device", dev},
				"--device "+dev, "built without CUDA")
		})
	}
}
