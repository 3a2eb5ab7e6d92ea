package main

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// signalChild, set in the environment, makes TestMain's process act as a
// command that takes long to stop: it reports "stopping" once
// signalContext is cancelled, then never ends by itself.
const signalChild = "TRAJFLOW_TEST_SIGNAL_CHILD"

func signalChildMain() {
	ctx, stop := signalContext()
	defer stop()
	fmt.Println("ready")
	<-ctx.Done()
	fmt.Println("stopping")
	time.Sleep(time.Minute)
	os.Exit(3)
}

// TestSecondSignalEndsAtOnce: the first SIGINT cancels the command's
// context and leaves the process to stop in order; a second one ends it
// at once, by the signal's default action.
func TestSecondSignalEndsAtOnce(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), signalChild+"=1")
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			lines := bufio.NewScanner(out)
			expect := func(want string) {
				t.Helper()
				if !lines.Scan() || lines.Text() != want {
					t.Fatalf("child printed %q (%v), want %q", lines.Text(), lines.Err(), want)
				}
			}
			expect("ready")
			if err := cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			expect("stopping")
			// The first signal's handler restores the default action
			// asynchronously; until it has, a second one is still caught.
			// Send it until the process ends, for at most 5 s.
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			var werr error
		wait:
			for deadline := time.Now().Add(5 * time.Second); ; {
				_ = cmd.Process.Signal(sig)
				select {
				case werr = <-done:
					break wait
				case <-time.After(50 * time.Millisecond):
				}
				if time.Now().After(deadline) {
					t.Fatal("the process outlived a second signal by 5 s")
				}
			}
			var ee *exec.ExitError
			if !errors.As(werr, &ee) {
				t.Fatalf("child ended with %v, want the signal %v", werr, sig)
			}
			ws := ee.Sys().(syscall.WaitStatus)
			if !ws.Signaled() || ws.Signal() != sig {
				t.Fatalf("child ended with %v, want killed by %v", werr, sig)
			}
		})
	}
}

func TestMain(m *testing.M) {
	if os.Getenv(signalChild) != "" {
		signalChildMain()
	}
	os.Exit(m.Run())
}
