package dashboard

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

//go:embed web
var webFS embed.FS

// Handler serves the page, its assets (all embedded: nothing is fetched
// from anywhere else) and the JSON API:
//
//	/api/summary                          every panel (Summary)
//	/api/trajectories?id=&task=&group=&version=&outcome=&limit=
//	                                      the attempts matching (TrajectoryList)
//	/api/trajectory?id=ID                 one attempt (TrajectoryDetail)
func (d *Dashboard) Handler() http.Handler {
	static, err := fs.Sub(webFS, "web")
	if err != nil {
		panic(err) // the embedded directory exists at build time
	}
	mux := http.NewServeMux()
	mux.Handle("GET /", http.FileServerFS(static))
	mux.HandleFunc("GET /api/summary", d.summary)
	mux.HandleFunc("GET /api/trajectories", d.trajectories)
	mux.HandleFunc("GET /api/trajectory", d.trajectory)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		// The page may load nothing but what this server serves.
		h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Cache-Control", "no-store")
		mux.ServeHTTP(w, r)
	})
}

func (d *Dashboard) summary(w http.ResponseWriter, _ *http.Request) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	v, lastErr := d.view, d.lastErr
	if lastErr == "" {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(v.JSON)
		return
	}
	s := struct {
		Summary
		RefreshError string `json:"refresh_error"`
	}{v.Summary, lastErr}
	writeJSON(w, http.StatusOK, s)
}

func (d *Dashboard) trajectories(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	query := Query{ID: q.Get("id"), Task: q.Get("task"), Group: q.Get("group"), Outcome: q.Get("outcome")}
	if s := q.Get("version"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": fmt.Sprintf("version %q is not an integer", s)})
			return
		}
		query.Version = &n
	}
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": fmt.Sprintf("limit %q is not a positive integer", s)})
			return
		}
		query.Limit = n
	}
	d.mu.RLock()
	list := d.view.Find(query)
	d.mu.RUnlock()
	nonNil(&list, true)
	writeJSON(w, http.StatusOK, list)
}

func (d *Dashboard) trajectory(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("id")
	if id == "" {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "id is required"})
		return
	}
	d.mu.RLock()
	det, err := d.view.Detail(id)
	var b []byte
	if err == nil {
		nonNil(det, true)
		b, err = json.Marshal(det)
	}
	d.mu.RUnlock()
	if err != nil {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": err.Error()})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// Serve reads the run, listens on addr and serves the dashboard until ctx
// ends, refreshing a live run; it prints the address it serves on.
func Serve(ctx context.Context, cfg Config, addr string, out io.Writer) error {
	d, err := New(ctx, cfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("dashboard: listen on %s: %w", addr, err)
	}
	st, _, _ := d.current()
	fmt.Fprintf(out, "trajflow dashboard: run %s from %s on http://%s/\n", st.Run, st.Source, ln.Addr())
	return d.ServeListener(ctx, ln)
}

// ServeListener serves on ln until ctx ends, then shuts the server down
// (waiting up to 5 s for requests in flight) and closes ln.
func (d *Dashboard) ServeListener(ctx context.Context, ln net.Listener) error {
	srv := &http.Server{Handler: d.Handler(), ReadHeaderTimeout: 10 * time.Second}
	var wg sync.WaitGroup
	rctx, stop := context.WithCancel(ctx)
	defer func() {
		stop()
		wg.Wait()
	}()
	wg.Add(2)
	go func() {
		defer wg.Done()
		_ = d.Run(rctx)
	}()
	go func() {
		defer wg.Done()
		<-rctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	err := srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return fmt.Errorf("dashboard: serve: %w", err)
}
