package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// childrenOf lists the processes whose parent is pid, from /proc.
func childrenOf(t *testing.T, pid int) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(pid) && f[0] != "Z" {
			out = append(out, p)
		}
	}
	return out
}

// running says whether pid has not exited (a zombie counts as exited).
func running(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

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
			kids = childrenOf(t, cmd.Process.Pid)
		}
		t.Cleanup(func() {
			for _, k := range kids {
				if p, err := os.FindProcess(k); err == nil {
					_ = p.Kill()
				}
			}
		})
		if len(kids) < c.helpers {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("%s: %d helper processes started, want %d", c.name, len(kids), c.helpers)
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			alive := 0
			for _, k := range kids {
				if running(k) {
					alive++
				}
			}
			if alive == 0 {
				break
			}
		}
		for _, k := range kids {
			if running(k) {
				t.Errorf("%s: helper %d still running 10 s after the bench's SIGKILL", c.name, k)
			}
		}
	}
}
