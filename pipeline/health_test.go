package pipeline

import (
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// A taken health port does not fail the server: it listens on a free port
// of the same host and says which address was taken.
func TestHealthServerPortTaken(t *testing.T) {
	hold, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	taken := hold.Addr().String()

	hs, err := NewHealthServer(taken, NewMetrics(nil))
	if err != nil {
		t.Fatalf("NewHealthServer on a taken port: %v", err)
	}
	if hs.TakenAddr() != taken {
		t.Fatalf("TakenAddr = %q, want %q", hs.TakenAddr(), taken)
	}
	host, port, err := net.SplitHostPort(hs.Addr())
	if err != nil || host != "127.0.0.1" || hs.Addr() == taken || port == "0" {
		t.Fatalf("Addr = %q, want another port of 127.0.0.1 than %s", hs.Addr(), taken)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ctx) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("Serve did not return after cancel")
		}
	}()
	cl := http.Client{Timeout: 5 * time.Second}
	resp, err := cl.Get("http://" + hs.Addr() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
		t.Fatalf("/healthz = %d %q", resp.StatusCode, body)
	}

	// Without an operator yet, the server is alive but not ready.
	resp, err = cl.Get("http://" + hs.Addr() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/readyz without operators = %d, want 503", resp.StatusCode)
	}

	free, err := NewHealthServer("127.0.0.1:0", NewMetrics(nil))
	if err != nil {
		t.Fatal(err)
	}
	if free.TakenAddr() != "" {
		t.Fatalf("TakenAddr = %q on a free port", free.TakenAddr())
	}
	free.ln.Close()

	// Errors other than a taken port still fail.
	for _, bad := range []string{"127.0.0.1:99999", "no-port"} {
		if _, err := NewHealthServer(bad, NewMetrics(nil)); err == nil {
			t.Errorf("NewHealthServer(%q) succeeded", bad)
		}
	}
}

// The health endpoints answer GET and HEAD; other methods get 405 (a
// POST to /healthz once answered "ok").
func TestHealthServerMethods(t *testing.T) {
	hs, err := NewHealthServer("127.0.0.1:0", NewMetrics(nil))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ctx) }()
	defer func() { cancel(); <-done }()
	cl := http.Client{Timeout: 5 * time.Second}
	for _, c := range []struct {
		method, path string
		want         int
	}{
		{"GET", "/healthz", http.StatusOK},
		{"HEAD", "/healthz", http.StatusOK},
		{"GET", "/metrics", http.StatusOK},
		{"POST", "/healthz", http.StatusMethodNotAllowed},
		{"DELETE", "/readyz", http.StatusMethodNotAllowed},
		{"PUT", "/metrics", http.StatusMethodNotAllowed},
	} {
		req, _ := http.NewRequest(c.method, "http://"+hs.Addr()+c.path, nil)
		resp, err := cl.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("%s %s = %d, want %d", c.method, c.path, resp.StatusCode, c.want)
		}
	}
}
