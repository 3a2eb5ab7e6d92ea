package main

import (
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/testkit"
)

// TestBenchHelpersEndWithIt: the processes a bench starts — the operators
// of `bench --processes`, the stages of the Go ZeroMQ peer — are SIGKILLed
// by the kernel when the bench process is (internal/orphan), instead of
// retrying a broker or waiting on a socket that is gone.
func TestBenchHelpersEndWithIt(t *testing.T) {
	t.Parallel()
	corpus := exportCorpus(t)
	for _, c := range []struct {
		name    string
		args    []string
		helpers int
	}{
		{"bench --processes", []string{"bench", "--contract", "../../testdata/contracts/bench.yaml", "--duration", "60s",
			"--warmup", "1s", "--baseline", "-1s", "--processes"}, 4},
		{"bench peers-zmq", []string{"bench", "peers-zmq", "--corpus", corpus, "--duration", "60s", "--warmup", "1s"}, 5},
	} {
		cmd := exec.Command(trajflowBinary(t), c.args...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		var kids []int
		for deadline := time.Now().Add(60 * time.Second); len(kids) < c.helpers && time.Now().Before(deadline); {
			time.Sleep(100 * time.Millisecond)
			kids = testkit.Children(cmd.Process.Pid)
		}
		t.Cleanup(func() {
			for _, k := range kids {
				_ = syscall.Kill(k, syscall.SIGKILL)
			}
		})
		if len(kids) < c.helpers {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("%s: %d helper processes started, want %d", c.name, len(kids), c.helpers)
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		running := func() []int {
			return slices.DeleteFunc(slices.Clone(kids), func(k int) bool { return !testkit.Running(k) })
		}
		for deadline := time.Now().Add(10 * time.Second); len(running()) > 0 && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
		}
		if left := running(); len(left) > 0 {
			t.Errorf("%s: helpers %v still running 10 s after the bench's SIGKILL", c.name, left)
		}
	}
}
