//go:build unix

// Package pipetest makes named pipes for tests of code that must never
// open one (snapshot readers, the dashboard).
package pipetest

import (
	"os"
	"syscall"
	"testing"
	"time"
)

// Mkfifo makes a named pipe at path and, until the test ends, opens it
// for writing and closes it again whenever a reader waits on it: code that
// opens it anyway reads an empty file instead of blocking for ever, so a
// test of "never open a pipe" fails instead of hanging.
func Mkfifo(t testing.TB, path string) {
	t.Helper()
	if err := syscall.Mkfifo(path, 0o644); err != nil {
		t.Fatal(err)
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() { // owned by the test: stopped by its cleanup
		defer close(done)
		for {
			if f, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
				f.Close()
			}
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}
