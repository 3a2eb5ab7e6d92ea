package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/internal/dashboard"
	"github.com/trajflow/trajflow/internal/loop"
)

// dashBuffer is a bytes.Buffer safe for a writer and a reader.
type dashBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *dashBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *dashBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestDashboardCommand runs `trajflow demo --out DIR` and `trajflow
// dashboard DIR --port 0`, reads the address it prints and checks the
// page and the API against the run's summary.json.
func TestDashboardCommand(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out := t.TempDir()
	var stderr bytes.Buffer
	if code := run(ctx, []string{"demo", "--updates", "2", "--out", out, "--eval-samples", "1"}, io.Discard, &stderr); code != 0 {
		t.Fatalf("demo: exit %d: %s", code, stderr.String())
	}
	var sum loop.Summary
	b, err := os.ReadFile(filepath.Join(out, loop.SummaryFile))
	if err == nil {
		err = json.Unmarshal(b, &sum)
	}
	if err != nil {
		t.Fatal(err)
	}
	dctx, stop := context.WithCancel(ctx)
	var stdout, derr dashBuffer
	code := make(chan int, 1)
	go func() {
		code <- run(dctx, []string{"dashboard", out, "--port", "0", "--eval-samples", "1"}, &stdout, &derr)
	}()
	url := waitURL(t, &stdout, code)
	var s dashboard.Summary
	resp, err := http.Get(url + "api/summary")
	if err == nil {
		err = json.NewDecoder(resp.Body).Decode(&s)
		resp.Body.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	o := s.Overview
	if o.Updates != sum.Updates || o.Launched != sum.AttemptsLaunched || o.Admitted != sum.TrajectoriesAdmitted ||
		o.EvalFinal == nil || *o.EvalFinal != sum.EvalSuccessFinal {
		t.Errorf("overview %+v, summary.json %+v", o, sum)
	}
	for path, want := range map[string]string{"": "<title>trajflow dashboard</title>", "app.js": "function lineChart", "style.css": ".tok"} {
		resp, err := http.Get(url + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) || resp.Header.Get("Content-Security-Policy") == "" {
			t.Errorf("GET /%s: %d, %d bytes, CSP %q", path, resp.StatusCode, len(body), resp.Header.Get("Content-Security-Policy"))
		}
	}
	stop()
	if c := <-code; c != 0 {
		t.Fatalf("dashboard exit %d: %s", c, derr.String())
	}
}

var dashURL = regexp.MustCompile(`on (http://127\.0\.0\.1:\d+/)`)

// waitURL waits for the dashboard to print its address.
func waitURL(t *testing.T, stdout *dashBuffer, code chan int) string {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		if m := dashURL.FindStringSubmatch(stdout.String()); m != nil {
			return m[1]
		}
		select {
		case c := <-code:
			t.Fatalf("dashboard exited %d before serving: %s", c, stdout.String())
		case <-deadline:
			t.Fatalf("no address printed within a minute: %q", stdout.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TestDashboardUsage: command-line mistakes exit 2 with a message naming
// what is wrong.
func TestDashboardUsage(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no-such-run")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"dashboard"}, "give DIR or --brokers"},
		{[]string{"dashboard", "a", "--brokers", "127.0.0.1:9092"}, "not both"},
		{[]string{"dashboard", missing, "--port", "0"}, missing},
		{[]string{"dashboard", t.TempDir(), "--port", "0"}, "no run=<run> directory"},
		{[]string{"dashboard", "a", "--port", "70000"}, "--port 70000"},
		{[]string{"dashboard", "a", "--eval-samples", "-1"}, "--eval-samples -1"},
	} {
		var stderr bytes.Buffer
		if code := run(context.Background(), tc.args, io.Discard, &stderr); code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q (want 2 and %q)", tc.args, code, stderr.String(), tc.want)
		}
	}
	var stderr bytes.Buffer
	if code := run(context.Background(), []string{"dashboard", "-h"}, io.Discard, &stderr); code != 0 || !strings.Contains(stderr.String(), "trajflow demo --out out/demo && trajflow dashboard out/demo") {
		t.Errorf("dashboard -h: exit %d: %s", code, stderr.String())
	}
}

// TestDashboardFlagsRefused: the live run's flags with a snapshot
// directory, a malformed broker list or address, a host that is empty or
// does not resolve, --eval-samples past its field and a release directory
// that is not there exit 2 at once naming the flag; nothing listens.
func TestDashboardFlagsRefused(t *testing.T) {
	dir := t.TempDir()
	_, missing := testFile(t)
	for _, c := range []refusalCase{
		{[]string{dir, "--contract", missing}, []string{"--contract", "live run"}},
		{[]string{dir, "--refresh", "1s"}, []string{"--refresh 1s", "live run"}},
		{[]string{dir, "--client-config", missing}, []string{"--client-config", "live run"}},
		{[]string{"--brokers", "127.0.0.1:1,,"}, []string{"--brokers", "item 2 is empty"}},
		{[]string{"--brokers", "nohost"}, []string{`--brokers "nohost"`}},
		{[]string{dir, "--host", ""}, []string{`--host ""`}},
		{[]string{dir, "--host", "no-such-host.invalid"}, []string{`--host "no-such-host.invalid"`}},
		{[]string{dir, "--eval-samples", "4294967297"}, []string{"--eval-samples 4294967297"}},
		{[]string{dir, "--releases", missing}, []string{"--releases", "no such file"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"dashboard", "--port", "0"}, c.args...), c.want...)
		})
	}
}
