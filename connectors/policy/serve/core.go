package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/internal/regfile"
	"github.com/trajflow/trajflow/internal/strictjson"
	"github.com/trajflow/trajflow/schemas"
)

// Software is the server string every protocol's info endpoint reports.
const Software = "trajflow-serve/1"

// Config configures a Server.
type Config struct {
	// Protocol is policy.LlamaCpp, policy.SGLang or policy.VLLM.
	Protocol string
	// Releases is the directory of policy releases (gpu.Trainer.Release
	// writes policy-vNNNNNNNN.json manifests and .ckpt checkpoints there).
	// Every load names a release in it; nothing outside it is read.
	Releases string
	// Grammar is the constrained-decoding grammar the server applies to
	// every request (a server-side logits processor: the task registry's,
	// rollout.Registry.Grammar); nil: none. Its id is in the server's info
	// endpoints, where clients read it and refuse settings that name
	// another grammar.
	Grammar model.Grammar
	// EOG are the end-of-generation ids of the llama.cpp protocol: like
	// llama-server, generation ends after sampling one (the request has no
	// stop-id field). nil: rollout.TokEnd, the built-in end of action; an
	// empty non-nil slice: none.
	EOG []int32
	// MaxTokens is the most tokens one request may generate; 0:
	// DefaultMaxTokens. A request asking for more is refused with 400
	// naming its field and this limit (as vLLM refuses one past its
	// max_model_len), never cut short in silence. The info endpoints
	// report it ("max_tokens").
	MaxTokens int
	// MaxPromptTokens is the most ids one request may carry (a prompt, the
	// ids to detokenize); 0: DefaultMaxPromptTokens. More is refused with
	// 400 naming the field and this limit.
	MaxPromptTokens int
}

// Defaults of Config's limits.
const (
	DefaultMaxTokens       = 65536
	DefaultMaxPromptTokens = 1 << 20
)

// Limits of one HTTP exchange: a request body is at most maxBody bytes
// (more: 413) and must arrive within bodyTimeout; an answer must be taken
// by the client within writeTimeout, or the connection is dropped.
const (
	maxBody      = 16 << 20
	bodyTimeout  = 60 * time.Second
	writeTimeout = 60 * time.Second
)

// loaded is one policy version ready to serve: immutable once built, so
// a request holding it never sees another version's weights.
type loaded struct {
	version  int64
	name     string // policy.ModelName(version)
	pol      *model.Policy
	m        *model.Model // the same parameters, for raw logits and top lists
	rel      schemas.PolicyRelease
	manifest string // path of the manifest file
}

// core is what every protocol shares: the release directory, the grammar,
// the pause gate, and the loaded versions.
type core struct {
	cfg  Config
	dir  string
	gate gate
	met  *metrics

	mu       sync.Mutex
	current  *loaded            // SGLang, vLLM: the version new requests get
	shadow   *loaded            // vLLM: loaded by /update_weights, switched by /finish_weight_update
	models   map[string]*loaded // llama.cpp: loaded router models by name
	checksum map[int64]string
}

func newCore(cfg Config) (*core, error) {
	switch cfg.Protocol {
	case policy.LlamaCpp, policy.SGLang, policy.VLLM:
	default:
		return nil, fmt.Errorf("%w: serve: protocol %q (want %s, %s or %s)", policy.ErrConfig, cfg.Protocol, policy.LlamaCpp, policy.SGLang, policy.VLLM)
	}
	if cfg.Releases == "" {
		return nil, fmt.Errorf("%w: serve: no releases directory", policy.ErrConfig)
	}
	dir, err := filepath.Abs(cfg.Releases)
	if err != nil {
		return nil, fmt.Errorf("%w: serve: releases %q: %v", policy.ErrConfig, cfg.Releases, err)
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("%w: serve: releases %q is not a directory", policy.ErrConfig, cfg.Releases)
	}
	if cfg.EOG == nil {
		cfg.EOG = []int32{tokEnd}
	}
	switch {
	case cfg.MaxTokens < 0:
		return nil, fmt.Errorf("%w: serve: max tokens %d must be positive (0: %d)", policy.ErrConfig, cfg.MaxTokens, DefaultMaxTokens)
	case cfg.MaxTokens == 0:
		cfg.MaxTokens = DefaultMaxTokens
	}
	switch {
	case cfg.MaxPromptTokens < 0:
		return nil, fmt.Errorf("%w: serve: max prompt tokens %d must be positive (0: %d)", policy.ErrConfig, cfg.MaxPromptTokens, DefaultMaxPromptTokens)
	case cfg.MaxPromptTokens == 0:
		cfg.MaxPromptTokens = DefaultMaxPromptTokens
	}
	c := &core{cfg: cfg, dir: dir, models: map[string]*loaded{}, checksum: map[int64]string{}}
	c.met = newMetrics(c)
	return c, nil
}

// manifestPath is the path of version v's manifest.
func (c *core) manifestPath(v int64) string { return filepath.Join(c.dir, gpu.ManifestName(v)) }

// load reads, verifies and loads release v from the directory: the
// manifest (strict JSON, Ready, its version v), then gpu.LoadRelease
// (checkpoint hash and model config hash), then the same verified bytes
// as a model for the logits the protocols report besides samples.
func (c *core) load(v int64) (*loaded, error) {
	l, err := c.loadRelease(v)
	c.met.observeLoad(err)
	return l, err
}

func (c *core) loadRelease(v int64) (*loaded, error) {
	if v < 0 {
		return nil, fmt.Errorf("serve: policy version %d", v)
	}
	path := c.manifestPath(v)
	b, err := readRegular(path, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("serve: release %d: %w", v, err)
	}
	var rel schemas.PolicyRelease
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rel); err != nil {
		return nil, fmt.Errorf("serve: manifest %s: %w", path, err)
	}
	if rel.PolicyVersion != v {
		return nil, fmt.Errorf("serve: manifest %s declares version %d", path, rel.PolicyVersion)
	}
	ck, err := c.readCheckpoint(path, rel)
	if err != nil {
		return nil, err
	}
	m, err := gpu.ModelFromRelease(rel, ck) // Ready, checkpoint hash, model config hash
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	pol := model.NewPolicy(m, v)
	c.mu.Lock()
	c.checksum[v] = strings.TrimPrefix(rel.CheckpointHash, "sha256:")
	c.mu.Unlock()
	return &loaded{version: v, name: policy.ModelName(v), pol: pol, m: m, rel: rel, manifest: path}, nil
}

// readCheckpoint reads the checkpoint of release rel (manifest at
// manifest) from the releases directory: the file gpu.CheckpointName of
// its version there, whatever directory its checkpoint_uri names (a
// copied releases directory serves its own files; the hash check says
// whether they are the release's), a regular file of bounded size. A
// checkpoint_uri naming another file is refused.
func (c *core) readCheckpoint(manifest string, rel schemas.PolicyRelease) ([]byte, error) {
	name := gpu.CheckpointName(rel.PolicyVersion)
	if base := filepath.Base(filepath.FromSlash(strings.TrimPrefix(rel.CheckpointURI, "file://"))); base != name {
		return nil, fmt.Errorf("serve: manifest %s: checkpoint_uri %q is not the release's checkpoint %s", manifest, rel.CheckpointURI, name)
	}
	b, err := readRegular(filepath.Join(c.dir, name), model.MaxCheckpointBytes)
	if err != nil {
		return nil, fmt.Errorf("serve: release %d: %w", rel.PolicyVersion, err)
	}
	return b, nil
}

// readRegular reads path, which must be a regular file (not a link, device
// or pipe, which could block or never end) of at most max bytes.
func readRegular(path string, max int64) ([]byte, error) {
	st, err := os.Lstat(path)
	switch {
	case err != nil:
		return nil, err
	case !st.Mode().IsRegular():
		return nil, fmt.Errorf("%s is not a regular file (%s)", path, regfile.Kind(st.Mode()))
	}
	b, err := regfile.Read(path, max)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, nil
}

// versionOfPath resolves a model path a weight-update call names: a
// manifest or checkpoint file of the releases directory (absolute, or
// relative to it), or a policy.ModelName.
func (c *core) versionOfPath(p string) (int64, error) {
	if strings.TrimSpace(p) == "" {
		return 0, errors.New("model path is required (a policy-vNNNNNNNN.json manifest of the releases directory)")
	}
	if v, err := policy.ParseModelName(p); err == nil {
		return v, nil
	}
	p = strings.TrimPrefix(p, "file://")
	if !filepath.IsAbs(p) {
		p = filepath.Join(c.dir, p)
	}
	p = filepath.Clean(p)
	if filepath.Dir(p) != c.dir {
		return 0, fmt.Errorf("model path %q is outside the releases directory %s", p, c.dir)
	}
	base := filepath.Base(p)
	for _, ext := range []string{".json", ".ckpt"} {
		if name, ok := strings.CutSuffix(base, ext); ok {
			return policy.ParseModelName(name)
		}
	}
	return 0, fmt.Errorf("model path %q is not a policy-vNNNNNNNN.json manifest or .ckpt checkpoint", p)
}

// available lists the versions with a manifest in the directory, in order.
func (c *core) available() ([]int64, error) {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	var out []int64
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		if v, err := policy.ParseModelName(name); err == nil {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out, nil
}

// getCurrent returns the version new requests get (nil: none loaded).
func (c *core) getCurrent() *loaded {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.current
}

// setCurrent switches new requests to l (the shadow-slot switch of systems
// §8: one pointer store; requests in flight keep the *loaded they hold).
func (c *core) setCurrent(l *loaded) {
	c.mu.Lock()
	c.current = l
	c.mu.Unlock()
}

// checkMaxTokens refuses n generated tokens past the server's limit;
// field is the request's name for them.
func (c *core) checkMaxTokens(field string, n int) error {
	if n > c.cfg.MaxTokens {
		return fmt.Errorf("%s %d exceeds this server's limit of %d tokens per request (trajflow serve policy --max-tokens)", field, n, c.cfg.MaxTokens)
	}
	return nil
}

// settingsErr wraps a settings error with the field prefix at (the native
// endpoints' "sampling_params."; "" at the top level of a request).
func settingsErr(at string, err error) error {
	if at == "" {
		return err
	}
	return fmt.Errorf("%s: %w", strings.TrimSuffix(at, "."), err)
}

// contextLen is the context length the info endpoints report where the
// real servers report one (vLLM's max_model_len, SGLang's /tokenize
// max_model_len, llama-server's n_ctx), which clients read as the most
// prompt plus generated tokens a request may have: the built-in policy has
// no context window, and every request whose prompt and generation
// together fit in the smaller of the two limits is within both.
func (c *core) contextLen() int { return min(c.cfg.MaxPromptTokens, c.cfg.MaxTokens) }

// generate samples one request on l with the server's grammar.
func (c *core) generate(ctx context.Context, l *loaded, prompt []int32, s model.Settings, seed uint64, id string) (model.Sample, error) {
	s.Grammar = c.cfg.Grammar
	start := time.Now()
	out, err := l.pol.Generate(ctx, []model.Request{{Context: prompt, Settings: s, Seed: seed, ID: id}})
	n := 0
	if err == nil {
		n = len(out[0].Tokens)
	}
	c.met.observeGenerate(start, len(prompt), n, err)
	if err != nil {
		return model.Sample{}, err
	}
	return out[0], nil
}

// gate pauses generation (SGLang /pause_generation, vLLM /pause) and
// tracks the requests in flight.
type gate struct {
	mu       sync.Mutex
	closed   chan struct{} // closed by close: the server is stopping
	paused   bool
	resumed  chan struct{} // closed by resume
	inflight map[*flight]struct{}
	idle     chan struct{} // closed when the last flight leaves while someone waits
}

type flight struct{ cancel context.CancelCauseFunc }

var errAborted = errors.New("request aborted by a pause in abort mode")

// errStopping is returned by enter once the server is stopping.
var errStopping = errors.New("the server is stopping")

// closing is closed once the server stops taking requests.
func (g *gate) closing() chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed == nil {
		g.closed = make(chan struct{})
	}
	return g.closed
}

// close makes every request waiting at a pause, and every later one,
// return errStopping; requests in flight go on.
func (g *gate) close() {
	ch := g.closing()
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// enter waits while generation is paused, then registers a request in
// flight; the returned context is cancelled if a pause aborts it.
func (g *gate) enter(ctx context.Context) (context.Context, func(), error) {
	stop := g.closing()
	for {
		select {
		case <-stop:
			return nil, nil, errStopping
		default:
		}
		g.mu.Lock()
		if !g.paused {
			break
		}
		ch := g.resumed
		g.mu.Unlock()
		select {
		case <-ch:
		case <-stop:
			return nil, nil, errStopping
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
	defer g.mu.Unlock()
	fctx, cancel := context.WithCancelCause(ctx)
	f := &flight{cancel: cancel}
	if g.inflight == nil {
		g.inflight = map[*flight]struct{}{}
	}
	g.inflight[f] = struct{}{}
	var once sync.Once
	return fctx, func() { once.Do(func() { g.leave(f, cancel) }) }, nil
}

// leave ends flight f.
func (g *gate) leave(f *flight, cancel context.CancelCauseFunc) {
	{
		cancel(nil)
		g.mu.Lock()
		delete(g.inflight, f)
		if len(g.inflight) == 0 && g.idle != nil {
			close(g.idle)
			g.idle = nil
		}
		g.mu.Unlock()
	}
}

// admit lets a generation request through the pause gate. The returned
// leave ends its flight: call it once the generation is done, before the
// answer is written. When the request cannot enter (the server is
// stopping: 503; the client went away: nothing) admit answers and
// returns false.
func (c *core) admit(w http.ResponseWriter, r *http.Request, op string) (context.Context, func(), bool) {
	ctx, leave, err := c.gate.enter(r.Context())
	switch {
	case errors.Is(err, errStopping):
		writeError(w, http.StatusServiceUnavailable, "%s: %v", op, err)
		return nil, nil, false
	case err != nil:
		return nil, nil, false
	}
	return ctx, leave, true
}

// pause stops new requests. mode "abort" aborts the requests in flight
// (their generation stops at its next token; their answers say so) and
// returns once they are done; "wait" returns once they have finished (on
// the version they started with); "keep" (vLLM) and "in_place" (SGLang)
// leave them running. A request is in flight while it generates, not while
// its answer is written, so no client that is slow to read holds a pause.
// A request's generation cannot be suspended half way, so no mode lets a
// request continue on other weights. When ctx ends first, a pause this
// call set is undone and ctx's error returned.
func (g *gate) pause(ctx context.Context, mode string) error {
	switch mode {
	case "abort", "wait", "keep", "in_place", "retract":
	default:
		return fmt.Errorf("pause mode %q (want abort, wait, keep, in_place or retract)", mode)
	}
	g.mu.Lock()
	set := !g.paused
	if set {
		g.paused = true
		g.resumed = make(chan struct{})
	}
	if mode == "abort" {
		for f := range g.inflight {
			f.cancel(errAborted)
		}
	}
	if mode != "wait" && mode != "abort" && mode != "retract" || len(g.inflight) == 0 {
		g.mu.Unlock()
		return nil
	}
	if g.idle == nil {
		g.idle = make(chan struct{})
	}
	idle := g.idle
	g.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		// The caller gave up: a pause it set is undone, so that a call
		// that failed leaves generation as it found it.
		if set {
			g.resume()
		}
		return ctx.Err()
	}
}

func (g *gate) resume() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.paused {
		g.paused = false
		close(g.resumed)
	}
}

func (g *gate) isPaused() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused
}

// aborted reports whether ctx was cancelled by a pause in abort mode.
func aborted(ctx context.Context) bool { return errors.Is(context.Cause(ctx), errAborted) }

// errBodyTooLarge is wrapped by decodeStrict when a body exceeds maxBody;
// writeError answers it with 413.
var errBodyTooLarge = fmt.Errorf("request body exceeds this server's limit of %d MiB", maxBody>>20)

// decodeStrict decodes a request body into v: one JSON value, no unknown
// fields (a field the server does not implement is refused, never
// ignored), at most maxBody bytes arriving within bodyTimeout.
func decodeStrict(w http.ResponseWriter, r *http.Request, v any) error {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(bodyTimeout)) // not every writer supports deadlines (tests)
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	// No deadline once the body is in: the server watches the connection
	// for a client that goes away while the request runs, and a deadline
	// passing then would read as one.
	_ = rc.SetReadDeadline(time.Time{})
	if err != nil {
		return fmt.Errorf("read body: %w", err)
	}
	if len(b) > maxBody {
		return errBodyTooLarge
	}
	if len(bytes.TrimSpace(b)) == 0 {
		b = []byte("{}")
	}
	// One reading of the body: a key of another case or given twice is
	// refused, where encoding/json would fill a field with it.
	if err := strictjson.CheckKeys(b, reflect.TypeOf(v)); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data after the JSON body")
	}
	return nil
}

// writeJSON writes v with status code.
func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, `{"error":"encode response"}`, http.StatusInternalServerError)
		return
	}
	// A client that does not take its answer holds nothing past this.
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(writeTimeout))
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(b)
}

// errorBody is the error shape of every protocol here: {"error": {...}}
// in llama.cpp's style, which SGLang and vLLM clients read as a message.
func writeError(w http.ResponseWriter, code int, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	for _, a := range args {
		if err, ok := a.(error); ok && code == http.StatusBadRequest && errors.Is(err, errBodyTooLarge) {
			code = http.StatusRequestEntityTooLarge
		}
	}
	typ := "invalid_request_error"
	if code >= 500 {
		typ = "server_error"
	}
	writeJSON(w, code, map[string]any{"error": map[string]any{"code": code, "message": msg, "type": typ}, "message": msg})
}
