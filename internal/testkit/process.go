package testkit

import (
	"bufio"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// StartBrokerProcess runs `bin broker --port port` (0: any free port) and
// returns the address the broker prints once it listens. The broker is
// stopped with SIGTERM when the test ends (SIGKILL after 20 s); a broker
// that prints no address within 30 s fails the test.
func StartBrokerProcess(t testing.TB, bin string, port int) string {
	t.Helper()
	cmd := exec.Command(bin, "broker", "--port", fmt.Sprint(port), "--log-level", "warn")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "broker listening on "); ok {
				select {
				case addr <- strings.TrimSpace(a):
				default:
				}
			}
		}
	}()
	select {
	case a := <-addr:
		return a
	case <-time.After(30 * time.Second):
		t.Fatalf("%s broker printed no address in 30 s", bin)
	}
	return ""
}
