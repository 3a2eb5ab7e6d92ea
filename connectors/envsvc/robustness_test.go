package envsvc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/operators/rollout"
)

// TestTerminateReasonBounded: a reason over MaxReasonBytes is refused
// (400, naming the field) and ends nothing; reasons outside the known set
// are stored as sent but counted under one metric label, "other".
func TestTerminateReasonBounded(t *testing.T) {
	regs := registries(t)
	reg := prometheus.NewRegistry()
	svc := startService(t, Config{Registries: regs, Metrics: reg})
	r := newRaw(t, svc.url, time.Minute, nil)
	var ids []string
	for i := range 4 {
		_, att := ledgerTask(t, regs, 20+i)
		al := r.allocate(att, "k", 0)
		if al.Outcome != Executed {
			t.Fatalf("allocate: %+v", al)
		}
		ids = append(ids, al.EpisodeID)
	}

	long := strings.Repeat("x", MaxReasonBytes+1)
	var out TerminateResponse
	code := r.post(strings.Replace(PathTerminate, "{id}", ids[0], 1),
		TerminateRequest{Protocol: 1, Reason: long, Token: r.iss.Issue(ids[0], 0, TerminateAction)}, &out)
	if code != http.StatusBadRequest || out.Reason != ReasonBadRequest || !strings.Contains(out.Detail, "reason") {
		t.Fatalf("over-long reason: %d %+v", code, out)
	}
	if svc.srv.Live() != 4 {
		t.Fatalf("a refused terminate ended an episode: %d live", svc.srv.Live())
	}

	for i, reason := range []string{"custom-1-" + strings.Repeat("y", 200), "custom-2", rollout.ReasonAnswer, strings.Repeat("z", MaxReasonBytes)} {
		end := r.terminate(ids[i], reason)
		if end.Outcome != Executed || end.Status != StatusCompleted || end.EndReason != reason {
			t.Fatalf("terminate %q: %+v", reason, end)
		}
	}
	series := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "trajflow_env_episodes_ended_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" {
					series[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	if len(series) != 2 || series["other"] != 3 || series[rollout.ReasonAnswer] != 1 {
		t.Fatalf("ended series by reason %v, want other=3 and answer=1", series)
	}
}

// TestLowDiskRefusedAsPersistFailed: while the data directory has less
// free space than the store's reserve, an action is refused with
// persist_failed (retry) and nothing runs; it executes once space is back.
func TestLowDiskRefusedAsPersistFailed(t *testing.T) {
	regs := registries(t)
	var free atomic.Uint64
	free.Store(1 << 40)
	st, err := state.Open(t.TempDir(), state.Options{FreeSpace: func(string) (uint64, error) { return free.Load(), nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	svc := startService(t, Config{Registries: regs, Store: st})
	r := newRaw(t, svc.url, time.Minute, nil)
	task, att := ledgerTask(t, regs, 3)
	id := r.allocate(att, "k", 0).EpisodeID
	xfer := []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}

	free.Store(1 << 20)
	got := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...))
	if got.Outcome != Refused || got.Reason != ReasonPersistFailed || !got.Retry || !strings.Contains(got.Detail, "free") {
		t.Fatalf("step on a full disk: %+v", got)
	}
	if _, att2 := ledgerTask(t, regs, 4); r.allocate(att2, "k", 0).Reason != ReasonPersistFailed {
		t.Fatal("allocation on a full disk not refused with persist_failed")
	}
	if q := r.send(PathStatus, id, r.stepReq(id, 1, "s1", 0, xfer...)); q.Outcome != Unknown || q.Reason != ReasonNotReceived {
		t.Fatalf("status of the refused step: %+v", q)
	}

	free.Store(1 << 40)
	if got := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...)); got.Outcome != Executed || got.Replayed {
		t.Fatalf("step once space is back: %+v", got)
	}
}

// health fetches /healthz.
func health(t *testing.T, url string) (int, Health) {
	t.Helper()
	resp, err := http.Get(url + PathHealth)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h Health
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, h
}

// TestFailedStoreReportedByHealth: once a write fails the store, every
// later action is refused with persist_failed and /healthz answers 503
// "failed" naming the data directory.
func TestFailedStoreReportedByHealth(t *testing.T) {
	regs := registries(t)
	dir := t.TempDir()
	var broken atomic.Bool
	st, err := state.Open(dir, state.Options{FreeSpace: func(string) (uint64, error) {
		if broken.Load() {
			return 0, syscall.EIO
		}
		return 1 << 40, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	svc := startService(t, Config{Registries: regs, Store: st})
	if code, h := health(t, svc.url); code != http.StatusOK || h.Status != HealthOK || h.Error != "" {
		t.Fatalf("healthy service: %d %+v", code, h)
	}
	r := newRaw(t, svc.url, time.Minute, nil)
	task, att := ledgerTask(t, regs, 5)
	id := r.allocate(att, "k", 0).EpisodeID
	xfer := []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}

	broken.Store(true)
	if got := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...)); got.Reason != ReasonPersistFailed {
		t.Fatalf("step on a failing directory: %+v", got)
	}
	broken.Store(false) // the store stays failed
	if got := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...)); got.Reason != ReasonPersistFailed || !strings.Contains(got.Detail, dir) {
		t.Fatalf("step on a failed store: %+v", got)
	}
	code, h := health(t, svc.url)
	if code != http.StatusServiceUnavailable || h.Status != HealthFailed || !strings.Contains(h.Error, dir) || h.Protocol != ProtocolVersion {
		t.Fatalf("health of a failed service: %d %+v", code, h)
	}
}

// TestHealthAnswerBounded: a health answer longer than the client reads
// of any answer (maxResponseBytes), here a valid document with a long
// error, is refused naming the service and the limit, not decoded whole.
func TestHealthAnswerBounded(t *testing.T) {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"status":"ok","protocol":%d,"families":["ledger"],"error":"`, ProtocolVersion)
		w.Write(bytes.Repeat([]byte("a"), maxResponseBytes))
		io.WriteString(w, `"}`)
	}))
	defer hs.Close()
	c := newClient(t, []string{hs.URL}, Options{})
	_, err := c.Health(ctxT(t, time.Minute))
	if err == nil || !strings.Contains(err.Error(), hs.URL) || !strings.Contains(err.Error(), fmt.Sprintf("answer over %d bytes", maxResponseBytes)) {
		t.Fatalf("health answer of %d bytes: %v, want an error naming %s and the limit", maxResponseBytes+60, err, hs.URL)
	}
}

// TestCorruptRecordEndsOnlyItsEpisode: an unreadable record ends its
// episode (infra, corrupt_log) at startup, the log names the key, and the
// other episodes resume.
func TestCorruptRecordEndsOnlyItsEpisode(t *testing.T) {
	regs := registries(t)
	for _, c := range []struct {
		name string
		key  func(id string) string
	}{
		{"meta", metaKey},
		{"step", func(id string) string { return stepKey(id, 1) }},
		{"lease", leaseKey},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			st := openStore(t, dir, false)
			srv, err := NewServer(Config{Registries: regs, Key: testKey, Store: st})
			if err != nil {
				t.Fatal(err)
			}
			hs := httptest.NewServer(srv.Handler())
			r := newRaw(t, hs.URL, time.Minute, nil)
			var ids []string
			for i := range 2 {
				task, att := ledgerTask(t, regs, 30+i)
				id := r.allocate(att, "k", 60000).EpisodeID
				xfer := []int32{rollout.TokXfer, rollout.TokKey0 + task.Key, rollout.TokEnd}
				if got := r.send(PathStep, id, r.stepReq(id, 1, "s1", 0, xfer...)); got.Outcome != Executed {
					t.Fatal(got)
				}
				ids = append(ids, id)
			}
			if rr := r.renew(ids[0], 60000); rr.Outcome != Executed {
				t.Fatal(rr)
			}
			hs.Close()
			srv.Close()
			bad := c.key(ids[0])
			if err := st.Set([]byte(bad), []byte("{garbage"), 0); err != nil {
				t.Fatal(err)
			}

			var logs bytes.Buffer
			var mu sync.Mutex
			logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, nil))
			srv, err = NewServer(Config{Registries: regs, Key: testKey, Store: st, Logger: logger})
			if err != nil {
				t.Fatalf("restart with a corrupt %s record: %v", c.name, err)
			}
			defer srv.Close()
			hs = httptest.NewServer(srv.Handler())
			defer hs.Close()
			r.url = hs.URL
			if srv.Live() != 1 {
				t.Fatalf("%d live episodes, want the intact one", srv.Live())
			}
			mu.Lock()
			logged := logs.String()
			mu.Unlock()
			if !strings.Contains(logged, bad) {
				t.Fatalf("log does not name the key %s:\n%s", bad, logged)
			}
			end := r.terminate(ids[0], rollout.ReasonAnswer)
			if end.EndReason != endCorruptLog {
				t.Fatalf("episode with a corrupt record ended %q, want %s: %+v", end.EndReason, endCorruptLog, end)
			}
			if ok := r.terminate(ids[1], rollout.ReasonAnswer); ok.Status != StatusCompleted || ok.Steps != 1 {
				t.Fatalf("intact episode: %+v", ok)
			}
		})
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// serveForTest runs ListenAndServe on 127.0.0.1 with o's timeouts and
// returns its address, its result channel and its stop.
func serveForTest(t *testing.T, o ServeOptions) (string, <-chan error, context.CancelFunc) {
	t.Helper()
	o.Addr, o.DataDir, o.Families = "127.0.0.1:0", filepath.Join(t.TempDir(), "data"), []string{rollout.FamilyKV}
	ctx, cancel := context.WithCancel(context.Background())
	addrc := make(chan string, 1)
	errc := make(chan error, 1)
	go func() { errc <- ListenAndServe(ctx, o, func(addr string, _ int) { addrc <- addr }) }()
	select {
	case addr := <-addrc:
		t.Cleanup(cancel)
		return addr, errc, cancel
	case err := <-errc:
		cancel()
		t.Fatalf("service did not start: %v", err)
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("service did not start")
	}
	return "", nil, nil
}

// slowSender opens a connection that sends a request's headers and part
// of its body, and then nothing.
func slowSender(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"protocol\":1,", PathEpisodes)
	return c
}

// TestSlowSenderDisconnected: a client that does not finish its request
// within the read timeout is disconnected.
func TestSlowSenderDisconnected(t *testing.T) {
	addr, _, _ := serveForTest(t, ServeOptions{ReadTimeout: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	c := slowSender(t, addr)
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	_, err := io.ReadAll(c) // the server answers or closes; either ends the read
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatal("slow sender still connected 30 s after a 200 ms read timeout")
	}
}

// TestShutdownCutsStuckConnections: a stop with a request still being
// read returns nil once the grace is over, closing the connection and
// logging how many were cut. (Once, in a full test run on a loaded
// machine, the stop found the connection already closed and returned
// within the grace; then nothing is cut and nothing may be logged as cut,
// and the connection must still be closed.)
func TestShutdownCutsStuckConnections(t *testing.T) {
	const grace = 100 * time.Millisecond
	var logs bytes.Buffer
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, nil))
	active := make(chan struct{}, 1)
	addr, errc, stop := serveForTest(t, ServeOptions{ShutdownGrace: grace, Logger: logger,
		connState: func(_ net.Conn, st http.ConnState) {
			if st == http.StateActive {
				select {
				case active <- struct{}{}:
				default:
				}
			}
		}})
	c := slowSender(t, addr)
	select {
	case <-active: // the request is being read
	case <-time.After(30 * time.Second):
		t.Fatal("the request never reached the server")
	}
	stopped := time.Now()
	stop()
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("stop with a stuck connection: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("service still running 30 s after the stop")
	}
	cut := time.Since(stopped) >= grace
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadAll(c); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("stuck connection still open after the stop")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	// Past the grace the connection was cut, and the log says so; a stop
	// within the grace found nothing to cut.
	if cut && !strings.Contains(logs.String(), "connections=1") {
		t.Fatalf("log does not say how many connections were cut:\n%s", logs.String())
	}
	if !cut && strings.Contains(logs.String(), "connections=") {
		t.Fatalf("the stop took less than the grace, yet the log reports a cut:\n%s", logs.String())
	}
}

// TestTokenLifetimeBounded: a token whose expiry is absurdly far ahead is
// refused as malformed; one within the configured maximum passes.
func TestTokenLifetimeBounded(t *testing.T) {
	regs := registries(t)
	svc := startService(t, Config{Registries: regs, MaxTokenTTL: 2 * time.Minute})
	_, att := ledgerTask(t, regs, 7)
	far := newRaw(t, svc.url, 1<<40*time.Microsecond, nil)
	if got := far.allocate(att, "k", 0); got.Outcome != Refused || got.Reason != ReasonTokenMalformed {
		t.Fatalf("token valid for 12 days: %+v", got)
	}
	ok := newRaw(t, svc.url, 2*time.Minute, nil)
	if got := ok.allocate(att, "k", 0); got.Outcome != Executed {
		t.Fatalf("token within the maximum lifetime: %+v", got)
	}
}
