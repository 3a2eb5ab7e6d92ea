package orphan

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/testkit"
)

// The helper process of TestDieWithParent: it starts `sleep 60` (with
// DieWithParent unless told not to), prints its pid and waits.
func TestMain(m *testing.M) {
	if mode := os.Getenv("ORPHAN_TEST_PARENT"); mode != "" {
		cmd := exec.Command("sleep", "60")
		if mode == "die" {
			DieWithParent(cmd)
		}
		if err := cmd.Start(); err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		fmt.Println(cmd.Process.Pid)
		_ = cmd.Wait()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// startParent starts the helper parent in mode and returns it and its
// child's pid.
func startParent(t *testing.T, mode string) (*exec.Cmd, int) {
	t.Helper()
	parent := exec.Command(os.Args[0], "-test.run=^$")
	parent.Env = append(os.Environ(), "ORPHAN_TEST_PARENT="+mode)
	out, err := parent.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("helper parent: %v", err)
	}
	child, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("helper parent printed %q", line)
	}
	return parent, child
}

// TestDieWithParent: a child started with DieWithParent is gone soon after
// its parent is SIGKILLed; one started without it is still there.
func TestDieWithParent(t *testing.T) {
	for _, c := range []struct {
		mode      string
		wantAlive bool
		wait      time.Duration // for the child to go
	}{{"die", false, 5 * time.Second}, {"keep", true, 300 * time.Millisecond}} {
		parent, child := startParent(t, c.mode)
		t.Cleanup(func() { _ = syscall.Kill(child, syscall.SIGKILL) })
		if !testkit.Running(child) {
			t.Fatalf("%s: child %d not running before the parent's kill", c.mode, child)
		}
		_ = parent.Process.Kill()
		_ = parent.Wait()
		deadline := time.Now().Add(c.wait)
		for testkit.Running(child) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if got := testkit.Running(child); got != c.wantAlive {
			t.Errorf("%s: child alive %v after its parent's SIGKILL, want %v", c.mode, got, c.wantAlive)
		}
	}
}
