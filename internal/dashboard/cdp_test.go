package dashboard

// A small Chrome DevTools Protocol client for the browser tests: it
// starts Debian's headless Chromium, attaches to its page over the
// DevTools websocket and drives it (navigate, evaluate, screenshot),
// recording every network request the page makes.

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/websocket"
)

// requireChromiumEnv makes a missing Chromium a test failure (CI sets it).
const requireChromiumEnv = "TRAJFLOW_REQUIRE_CHROMIUM"

// artifactsEnv names the directory the browser tests write their
// screenshots to (default: the test's temporary directory).
const artifactsEnv = "TRAJFLOW_ARTIFACTS"

// findChromium returns the Chromium binary, or fails or skips the test.
func findChromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("TRAJFLOW_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv(requireChromiumEnv) == "1" {
		t.Fatalf("no chromium on PATH but %s=1: install it (apt-get install -y chromium) or set TRAJFLOW_CHROMIUM", requireChromiumEnv)
	}
	t.Skipf("no chromium on PATH: the browser test did not run (apt-get install -y chromium; %s=1 makes this a failure)", requireChromiumEnv)
	return ""
}

// artifactsDir is where screenshots go.
func artifactsDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(artifactsEnv)
	if dir == "" {
		dir = t.TempDir()
	}
	dir = filepath.Join(dir, "dashboard")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// browser is one headless Chromium with one page attached.
type browser struct {
	t    *testing.T
	cmd  *exec.Cmd
	ws   *websocket.Conn
	port string

	mu         sync.Mutex
	next       int
	pending    map[int]chan cdpReply
	requests   []string // URL of every request the page made
	exceptions []string // uncaught exceptions of the page's scripts
	readerDone chan struct{}
	exited     chan struct{}
}

// lineWriter calls fn with every complete line written to it.
type lineWriter struct {
	mu  sync.Mutex
	buf []byte
	fn  func(string)
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.fn(string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
	return len(p), nil
}

type cdpReply struct {
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

type cdpMessage struct {
	ID     int             `json:"id"`
	Method string          `json:"method"`
	Params json.RawMessage `json:"params"`
	cdpReply
}

var devtoolsLine = regexp.MustCompile(`DevTools listening on (ws://127\.0\.0\.1:(\d+)/\S+)`)

// startBrowser starts Chromium with the flags this machine's closed
// network needs (no background connections of its own), attaches to its
// first page and enables the Page, Runtime and Network domains. Cleanup
// kills its whole process group.
func startBrowser(t *testing.T, ctx context.Context) *browser {
	t.Helper()
	bin := findChromium(t)
	cmd := exec.Command(bin, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
		"--disable-extensions", "--user-data-dir="+t.TempDir(), "--remote-debugging-address=127.0.0.1",
		"--remote-debugging-port=0", "--remote-allow-origins=http://127.0.0.1", "--window-size=1400,1000", "about:blank")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	wsURL := make(chan string, 1)
	cmd.Stderr = &lineWriter{fn: func(line string) {
		if m := devtoolsLine.FindStringSubmatch(line); m != nil {
			select {
			case wsURL <- m[2]:
			default:
			}
		}
	}}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	b := &browser{t: t, cmd: cmd, pending: map[int]chan cdpReply{}, readerDone: make(chan struct{}), exited: make(chan struct{})}
	go func() { // owned by the process: returns when it exits
		_ = cmd.Wait()
		close(b.exited)
	}()
	t.Cleanup(b.close)
	select {
	case b.port = <-wsURL:
	case <-b.exited:
		t.Fatal("chromium exited before printing its DevTools address")
	case <-time.After(60 * time.Second):
		t.Fatal("chromium did not print its DevTools address within 60 s")
	case <-ctx.Done():
		t.Fatal(ctx.Err())
	}
	b.attach(ctx)
	for _, dom := range []string{"Page.enable", "Runtime.enable", "Network.enable"} {
		b.call(ctx, dom, nil, nil)
	}
	return b
}

// attach connects to the page target's websocket.
func (b *browser) attach(ctx context.Context) {
	b.t.Helper()
	var targets []struct {
		Type string `json:"type"`
		WS   string `json:"webSocketDebuggerUrl"`
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://127.0.0.1:" + b.port + "/json/list")
		if err == nil {
			err = json.NewDecoder(resp.Body).Decode(&targets)
			resp.Body.Close()
		}
		if err == nil && len(targets) > 0 && targets[0].Type == "page" {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			b.t.Fatalf("no page target from chromium: %v %+v", err, targets)
		}
		time.Sleep(200 * time.Millisecond)
	}
	ws, err := websocket.Dial(targets[0].WS, "", "http://127.0.0.1")
	if err != nil {
		b.t.Fatalf("devtools websocket: %v", err)
	}
	ws.MaxPayloadBytes = 256 << 20 // full-page screenshots
	b.ws = ws
	go b.read()
}

// read dispatches replies and records events until the socket closes.
func (b *browser) read() {
	defer close(b.readerDone)
	for {
		var raw []byte
		if err := websocket.Message.Receive(b.ws, &raw); err != nil {
			return
		}
		var m cdpMessage
		if json.Unmarshal(raw, &m) != nil {
			continue
		}
		b.mu.Lock()
		switch {
		case m.ID != 0:
			if ch := b.pending[m.ID]; ch != nil {
				ch <- m.cdpReply
				delete(b.pending, m.ID)
			}
		case m.Method == "Network.requestWillBeSent":
			var p struct {
				Request struct {
					URL string `json:"url"`
				} `json:"request"`
			}
			_ = json.Unmarshal(m.Params, &p)
			b.requests = append(b.requests, p.Request.URL)
		case m.Method == "Runtime.exceptionThrown":
			b.exceptions = append(b.exceptions, string(m.Params))
		}
		b.mu.Unlock()
	}
}

// call sends one command and decodes its result into out (when not nil).
func (b *browser) call(ctx context.Context, method string, params, out any) {
	b.t.Helper()
	if err := b.try(ctx, method, params, out); err != nil {
		b.t.Fatal(err)
	}
}

func (b *browser) try(ctx context.Context, method string, params, out any) error {
	if params == nil {
		params = struct{}{}
	}
	ch := make(chan cdpReply, 1)
	b.mu.Lock()
	b.next++
	id := b.next
	b.pending[id] = ch
	b.mu.Unlock()
	msg, _ := json.Marshal(map[string]any{"id": id, "method": method, "params": params})
	if err := websocket.Message.Send(b.ws, string(msg)); err != nil {
		return fmt.Errorf("cdp %s: %w", method, err)
	}
	select {
	case r := <-ch:
		if r.Error != nil {
			return fmt.Errorf("cdp %s: %s (%d)", method, r.Error.Message, r.Error.Code)
		}
		if out != nil {
			return json.Unmarshal(r.Result, out)
		}
		return nil
	case <-b.readerDone:
		return fmt.Errorf("cdp %s: the devtools connection closed", method)
	case <-ctx.Done():
		return fmt.Errorf("cdp %s: %w", method, ctx.Err())
	}
}

// eval evaluates a JavaScript expression in the page (awaiting a promise)
// and decodes its value into out.
func (b *browser) eval(ctx context.Context, expr string, out any) {
	b.t.Helper()
	if err := b.tryEval(ctx, expr, out); err != nil {
		b.t.Fatal(err)
	}
}

func (b *browser) tryEval(ctx context.Context, expr string, out any) error {
	var r struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		Exception *struct {
			Text      string `json:"text"`
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	err := b.try(ctx, "Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true, "awaitPromise": true}, &r)
	if err != nil {
		return err
	}
	if r.Exception != nil {
		return fmt.Errorf("evaluate %q: %s %s", expr, r.Exception.Text, r.Exception.Exception.Description)
	}
	if out == nil {
		return nil
	}
	if len(r.Result.Value) == 0 {
		return fmt.Errorf("evaluate %q: no value", expr)
	}
	return json.Unmarshal(r.Result.Value, out)
}

// waitFor evaluates a boolean expression until it is true.
func (b *browser) waitFor(ctx context.Context, what, expr string, timeout time.Duration) {
	b.t.Helper()
	deadline := time.Now().Add(timeout)
	var last error
	for {
		var ok bool
		if last = b.tryEval(ctx, "Boolean("+expr+")", &ok); last == nil && ok {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			b.t.Fatalf("waiting for %s (%s): not true within %s (last error: %v); page exceptions: %v", what, expr, timeout, last, b.pageExceptions())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// navigate loads url and waits for the page's first render of the panels.
func (b *browser) navigate(ctx context.Context, url string) {
	b.t.Helper()
	b.call(ctx, "Page.navigate", map[string]any{"url": url}, nil)
	b.waitFor(ctx, "the panels", `document.body && Number(document.body.dataset.loaded || 0) >= 1`, 60*time.Second)
}

// screenshot writes a PNG of the region of the page under the CSS
// selector (the whole page when selector is "") to path.
func (b *browser) screenshot(ctx context.Context, selector, path string) {
	b.t.Helper()
	var clip struct{ X, Y, W, H float64 }
	expr := `(() => { const e = document.documentElement; return {X: 0, Y: 0, W: e.scrollWidth, H: e.scrollHeight}; })()`
	if selector != "" {
		expr = fmt.Sprintf(`(() => { const r = document.querySelector(%q).getBoundingClientRect();
			return {X: r.left + scrollX, Y: r.top + scrollY, W: r.width, H: r.height}; })()`, selector)
	}
	b.eval(ctx, expr, &clip)
	var shot struct {
		Data string `json:"data"`
	}
	b.call(ctx, "Page.captureScreenshot", map[string]any{"format": "png", "captureBeyondViewport": true,
		"clip": map[string]any{"x": clip.X, "y": clip.Y, "width": clip.W, "height": min(clip.H, 16000), "scale": 1}}, &shot)
	png, err := base64.StdEncoding.DecodeString(shot.Data)
	if err != nil || len(png) < 8 || string(png[1:4]) != "PNG" {
		b.t.Fatalf("screenshot of %q: not a PNG (%v)", selector, err)
	}
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatal(err)
	}
	b.t.Logf("screenshot %s (%d bytes)", path, len(png))
}

// offOrigin lists the requests the page made anywhere but origin.
func (b *browser) offOrigin(origin string) (all, off []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, u := range b.requests {
		if !strings.HasPrefix(u, origin+"/") && u != origin && !strings.HasPrefix(u, "data:") && u != "about:blank" {
			off = append(off, u)
		}
	}
	return append([]string(nil), b.requests...), off
}

func (b *browser) pageExceptions() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.exceptions...)
}

// close asks the browser to quit (so it reaps its own children), kills
// its process group if it has not exited within 10 s, and waits for it.
func (b *browser) close() {
	if b.ws != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = b.try(ctx, "Browser.close", nil, nil)
		cancel()
	}
	select {
	case <-b.exited:
	case <-time.After(10 * time.Second):
	}
	_ = syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
	<-b.exited
	if b.ws != nil {
		_ = b.ws.Close()
		<-b.readerDone
	}
}
