// Package llamatest starts a real llama.cpp llama-server as a child process
// on a free 127.0.0.1 port for tests and benchmarks, and carries the request
// bodies the policy clients send to it.
//
// The binary and the model come from the environment, as printed by
// `deploy/local/llama.sh env`:
//
//	TRAJFLOW_LLAMA_SERVER  path to the llama-server binary
//	TRAJFLOW_LLAMA_MODEL   path to a GGUF model (SmolLM2-135M-Instruct Q4_1)
//
// A test that needs the server fails, not skips, when they are missing: put
// it behind the `llama` build tag instead. deploy/local/LLAMA.md records the
// server's HTTP API as checked against this build.
package llamatest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The variables Start reads.
const (
	EnvServer = "TRAJFLOW_LLAMA_SERVER"
	EnvModel  = "TRAJFLOW_LLAMA_MODEL"
)

// Options configures a server. The zero value serves $TRAJFLOW_LLAMA_MODEL
// with a 2048-token context shared by 2 slots on 2 threads.
type Options struct {
	// Model is the GGUF file to serve; "" means $TRAJFLOW_LLAMA_MODEL.
	// Ignored in router mode.
	Model string
	// ModelsDir, when set, starts the server in router mode over the *.gguf
	// files of this folder (no -m): each file is a model named by its base
	// name without ".gguf", loaded on demand into its own child process.
	ModelsDir string
	// ModelsMax is the router's --models-max (most models loaded at once);
	// 0 means 2.
	ModelsMax int
	// Ctx is the total context (-c), shared by the slots; 0 means 2048.
	Ctx int
	// Slots is the number of parallel sequences (-np); 0 means 2.
	Slots int
	// Threads is the number of CPU threads (-t); 0 means 2.
	Threads int
	// Args are appended to the command line as is.
	Args []string
	// StartTimeout bounds the wait for /health; 0 means 60 s.
	StartTimeout time.Duration
	// LogPath receives the server's stdout and stderr; "" means a file in a
	// temporary folder (removed by Close unless the start failed).
	LogPath string
}

// Server is a running llama-server child process.
type Server struct {
	// URL is the server's base address, http://127.0.0.1:PORT.
	URL string
	// Binary and Model are the paths it was started with (Model is "" in
	// router mode).
	Binary string
	Model  string
	// LogPath is the file holding its stdout and stderr.
	LogPath string

	client  *http.Client
	cmd     *exec.Cmd
	logFile *os.File
	tmpDir  string
	done    chan struct{} // closed when the process has exited
	waitErr error

	closeOnce sync.Once
	closeErr  error
}

// Start starts a server from $TRAJFLOW_LLAMA_SERVER (and, unless opts says
// otherwise, $TRAJFLOW_LLAMA_MODEL), waits until it answers /health, and
// stops it when the test ends. It fails the test when a variable is missing
// or the server does not come up.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := StartContext(ctx, opts)
	if err != nil {
		t.Fatalf("llamatest: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("llamatest: stop %s: %v", s.URL, err)
		}
	})
	return s
}

// StartContext is Start without a testing.TB: the caller owns the server
// and calls Close. ctx bounds the start only, not the server's life.
func StartContext(ctx context.Context, opts Options) (*Server, error) {
	bin := os.Getenv(EnvServer)
	if bin == "" {
		return nil, fmt.Errorf("%s is not set (eval \"$(deploy/local/llama.sh env)\" after deploy/local/llama.sh build)", EnvServer)
	}
	if st, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("%s=%s: %w", EnvServer, bin, err)
	} else if st.IsDir() || st.Mode()&0o111 == 0 {
		return nil, fmt.Errorf("%s=%s: not an executable file", EnvServer, bin)
	}
	var modelArgs []string
	model := ""
	if opts.ModelsDir != "" {
		if st, err := os.Stat(opts.ModelsDir); err != nil {
			return nil, fmt.Errorf("models dir: %w", err)
		} else if !st.IsDir() {
			return nil, fmt.Errorf("models dir %s: not a folder", opts.ModelsDir)
		}
		max := opts.ModelsMax
		if max == 0 {
			max = 2
		}
		modelArgs = []string{"--models-dir", opts.ModelsDir, "--models-max", strconv.Itoa(max)}
	} else {
		model = opts.Model
		src := "Options.Model"
		if model == "" {
			model, src = os.Getenv(EnvModel), EnvModel
			if model == "" {
				return nil, fmt.Errorf("%s is not set (eval \"$(deploy/local/llama.sh env)\" after deploy/local/llama.sh fetch)", EnvModel)
			}
		}
		if err := checkGGUF(model); err != nil {
			return nil, fmt.Errorf("%s=%s: %w", src, model, err)
		}
		modelArgs = []string{"-m", model}
	}
	timeout := opts.StartTimeout
	if timeout == 0 {
		timeout = 60 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	// A free port can be taken by someone else between the probe and the
	// server's bind: try a few.
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		args := append([]string{
			"--host", "127.0.0.1", "--port", strconv.Itoa(port),
			"-c", strconv.Itoa(orDefault(opts.Ctx, 2048)),
			"-np", strconv.Itoa(orDefault(opts.Slots, 2)),
			"-t", strconv.Itoa(orDefault(opts.Threads, 2)),
			"--metrics", "--no-webui",
		}, modelArgs...)
		args = append(args, opts.Args...)
		s, err := launch(ctx, bin, model, port, args, opts.LogPath)
		if err == nil {
			return s, nil
		}
		lastErr = err
		if !errors.Is(err, errBind) || ctx.Err() != nil {
			break
		}
	}
	return nil, lastErr
}

var errBind = errors.New("port already in use")

func launch(ctx context.Context, bin, model string, port int, args []string, logPath string) (*Server, error) {
	s := &Server{
		URL:    "http://127.0.0.1:" + strconv.Itoa(port),
		Binary: bin,
		Model:  model,
		client: &http.Client{Timeout: 5 * time.Minute},
		done:   make(chan struct{}),
	}
	if logPath == "" {
		dir, err := os.MkdirTemp("", "llamatest-")
		if err != nil {
			return nil, fmt.Errorf("log folder: %w", err)
		}
		s.tmpDir = dir
		logPath = filepath.Join(dir, "server.log")
	}
	f, err := os.Create(logPath)
	if err != nil {
		s.removeTmp()
		return nil, fmt.Errorf("server log: %w", err)
	}
	s.LogPath, s.logFile = logPath, f
	// Not exec.CommandContext: ctx bounds the start, the server outlives it.
	s.cmd = exec.Command(bin, args...)
	s.cmd.Stdout, s.cmd.Stderr = f, f
	s.cmd.Stdin = nil
	s.cmd.Env = os.Environ()
	if os.Getenv("OMP_WAIT_POLICY") == "" {
		// Spinning OpenMP workers cost 20x in throughput when the cores
		// are shared (deploy/local/LLAMA.md).
		s.cmd.Env = append(s.cmd.Env, "OMP_WAIT_POLICY=PASSIVE")
	}
	setProcessGroup(s.cmd)
	if err := s.cmd.Start(); err != nil {
		f.Close()
		s.removeTmp()
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() { // owned by the Server: ends when the process exits
		s.waitErr = s.cmd.Wait()
		close(s.done)
	}()
	if err := s.waitHealthy(ctx); err != nil {
		tail := s.logTail(2048)
		s.stop()
		if strings.Contains(tail, "bind") || strings.Contains(tail, "Address already in use") {
			s.removeTmp()
			return nil, fmt.Errorf("%s: %w", s.URL, errBind)
		}
		return nil, fmt.Errorf("%s %s: %w; log %s:\n%s", bin, strings.Join(args, " "), err, logPath, tail)
	}
	return s, nil
}

func (s *Server) waitHealthy(ctx context.Context) error {
	probe := &http.Client{Timeout: 2 * time.Second}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	last := "no answer"
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/health", nil)
		if err != nil {
			return err
		}
		if resp, err := probe.Do(req); err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			var h struct {
				Status string `json:"status"`
			}
			if resp.StatusCode == http.StatusOK && json.Unmarshal(body, &h) == nil && h.Status == "ok" {
				return nil
			}
			last = fmt.Sprintf("HTTP %d %s", resp.StatusCode, bytes.TrimSpace(body))
		} else {
			last = err.Error()
		}
		select {
		case <-s.done:
			return fmt.Errorf("server exited before /health answered ok: %v", s.waitErr)
		case <-ctx.Done():
			return fmt.Errorf("/health not ok (%s): %w", last, ctx.Err())
		case <-tick.C:
		}
	}
}

// Close stops the server: SIGTERM, then SIGKILL to its process group (the
// router's children included) after 10 s. It removes the temporary log
// folder. Safe to call more than once.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.closeErr = s.stop()
		s.removeTmp()
	})
	return s.closeErr
}

func (s *Server) stop() error {
	defer s.logFile.Close()
	select {
	case <-s.done:
		return nil
	default:
	}
	terminate(s.cmd)
	select {
	case <-s.done:
		return nil
	case <-time.After(10 * time.Second):
	}
	killGroup(s.cmd)
	select {
	case <-s.done:
		return errors.New("did not stop within 10 s of SIGTERM; killed")
	case <-time.After(10 * time.Second):
		return errors.New("still running 10 s after SIGKILL")
	}
}

func (s *Server) removeTmp() {
	if s.tmpDir != "" {
		os.RemoveAll(s.tmpDir)
	}
}

// Pid is the server's process id.
func (s *Server) Pid() int { return s.cmd.Process.Pid }

func (s *Server) logTail(n int64) string {
	f, err := os.Open(s.LogPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		f.Seek(st.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	return string(b)
}

// Post sends body as JSON to path and decodes the JSON answer into out
// (when out is not nil). A status other than 200 is an error carrying the
// server's message.
func (s *Server) Post(ctx context.Context, path string, body, out any) error {
	b, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("POST %s: encode: %w", path, err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+path, bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("POST %s: %w", path, err)
	}
	req.Header.Set("Content-Type", "application/json")
	return s.do(req, out)
}

// Get fetches path and decodes the JSON answer into out.
func (s *Server) Get(ctx context.Context, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+path, nil)
	if err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	return s.do(req, out)
}

func (s *Server) do(req *http.Request, out any) error {
	resp, err := s.client.Do(req)
	if err != nil {
		return fmt.Errorf("%s %s: %w", req.Method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fmt.Errorf("%s %s: read: %w", req.Method, req.URL.Path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s %s: HTTP %d: %s", req.Method, req.URL.Path, resp.StatusCode, bytes.TrimSpace(b))
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("%s %s: decode: %w", req.Method, req.URL.Path, err)
	}
	return nil
}

func checkGGUF(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	var magic [4]byte
	if _, err := io.ReadFull(f, magic[:]); err != nil {
		return fmt.Errorf("read GGUF magic: %w", err)
	}
	if string(magic[:]) != "GGUF" {
		return fmt.Errorf("not a GGUF file (magic %q)", magic[:])
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("free port on 127.0.0.1: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func orDefault(v, d int) int {
	if v == 0 {
		return d
	}
	return v
}
