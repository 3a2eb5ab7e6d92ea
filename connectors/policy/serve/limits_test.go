package serve_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/internal/policytest"
	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/gpu"
)

// endless is a vLLM generation that runs until its client goes away: no
// stop id, a bound it never reaches in a test.
const endless = `{"token_ids":[1,3],"sampling_params":{"max_tokens":100000000,"seed":1,"stop_token_ids":[]}}`

// startEndless sends endless and returns once the server counts it in
// flight; cancel ends it.
func startEndless(t *testing.T, srv *policytest.Server) (cancel func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	go policytest.Post(ctx, srv.URL+"/inference/v1/generate", endless)
	waitFor(t, "the generation in flight", func() bool { return srv.InFlight() == 1 })
	return cancel
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !ok(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after 20 s", what)
		}
	}
}

func isPaused(t *testing.T, srv *policytest.Server) bool {
	t.Helper()
	_, body, err := policytest.Get(context.Background(), srv.URL+"/is_paused")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(body, `"is_paused":true`)
}

// TestFailedPauseIsUndone: a pause whose caller gives up before the
// requests in flight finish leaves generation running, as it found it (it
// once left the server paused for good, every later request waiting).
func TestFailedPauseIsUndone(t *testing.T) {
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.StartWith(t, serve.Config{Protocol: policy.VLLM, Releases: dir, MaxTokens: 100000000}, nil, 1)
	defer startEndless(t, srv)()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, _, err := policytest.Post(ctx, srv.URL+"/pause?mode=wait", ""); err == nil {
		t.Fatal("pause?mode=wait returned while a request generates")
	}
	waitFor(t, "the pause undone", func() bool { return !isPaused(t, srv) })
	code, body, err := policytest.Post(context.Background(), srv.URL+"/inference/v1/generate", `{"token_ids":[1,3],"sampling_params":{"max_tokens":2,"seed":1}}`)
	if err != nil || code != http.StatusOK {
		t.Fatalf("a request after the failed pause: %d %s %v", code, body, err)
	}
}

// TestSlowReaderHoldsNoPause: a client that never reads its (large)
// answer does not hold a pause in abort mode, which waits only for the
// generation, not for the answer's delivery.
func TestSlowReaderHoldsNoPause(t *testing.T) {
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.StartWith(t, serve.Config{Protocol: policy.VLLM, Releases: dir}, nil, 1)
	u, _ := url.Parse(srv.URL)
	conn, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.(*net.TCPConn).SetReadBuffer(4096); err != nil {
		t.Fatal(err)
	}
	body := `{"token_ids":[1,3],"sampling_params":{"max_tokens":65536,"seed":1,"stop_token_ids":[],"logprobs":0}}` // ~9 MB answered
	fmt.Fprintf(conn, "POST /inference/v1/generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", u.Host, len(body), body)
	waitFor(t, "the generation in flight", func() bool { return srv.InFlight() == 1 })
	waitFor(t, "the generation done", func() bool { return srv.InFlight() == 0 }) // its answer now waits on the socket
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if code, body, err := policytest.Post(ctx, srv.URL+"/pause?mode=abort", ""); err != nil || code != http.StatusOK {
		t.Fatalf("pause while a client does not read its answer: %d %s %v", code, body, err)
	}
}

// TestStopAnswersWaiters: once the server stops, a request waiting at a
// pause is answered 503 instead of holding the shutdown.
func TestStopAnswersWaiters(t *testing.T) {
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.StartWith(t, serve.Config{Protocol: policy.VLLM, Releases: dir}, nil, 1)
	if code, body, err := policytest.Post(context.Background(), srv.URL+"/pause?mode=keep", ""); err != nil || code != http.StatusOK {
		t.Fatalf("pause: %d %s %v", code, body, err)
	}
	type answer struct {
		code int
		body string
	}
	got := make(chan answer, 1)
	go func() {
		code, body, _ := policytest.Post(context.Background(), srv.URL+"/inference/v1/generate", `{"token_ids":[1,3],"sampling_params":{"max_tokens":2,"seed":1}}`)
		got <- answer{code, body}
	}()
	time.Sleep(100 * time.Millisecond) // let it reach the pause
	srv.Stop()
	select {
	case a := <-got:
		if a.code != http.StatusServiceUnavailable || !strings.Contains(a.body, "stopping") {
			t.Fatalf("a request waiting at the pause when the server stopped: %d %s", a.code, a.body)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the request waiting at the pause was not answered when the server stopped")
	}
}

// TestModelRecheckedAfterPause: a vLLM request naming the version it
// wants, which waited at a pause while the weights switched, is refused
// (404) rather than served by the other version.
func TestModelRecheckedAfterPause(t *testing.T) {
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	policytest.Release(t, dir, 2, false)
	srv := policytest.StartWith(t, serve.Config{Protocol: policy.VLLM, Releases: dir}, nil, 2)
	post := func(path, body string) (int, string) {
		code, out, err := policytest.Post(context.Background(), srv.URL+path, body)
		if err != nil {
			t.Fatal(err)
		}
		return code, out
	}
	if code, body := post("/pause?mode=keep", ""); code != http.StatusOK {
		t.Fatalf("pause: %d %s", code, body)
	}
	got := make(chan [2]any, 1)
	go func() {
		code, body := post("/inference/v1/generate", fmt.Sprintf(`{"token_ids":[1,3],"sampling_params":{"max_tokens":2,"seed":7},"model":%q}`, policy.ModelName(2)))
		got <- [2]any{code, body}
	}()
	time.Sleep(100 * time.Millisecond)
	for _, c := range [][2]string{{"/start_weight_update", ""}, {"/update_weights", `{"update_info":{"model_path":"policy-v00000001.json"}}`}, {"/finish_weight_update", `{"weight_version":"1"}`}, {"/resume", ""}} {
		if code, body := post(c[0], c[1]); code != http.StatusOK {
			t.Fatalf("%s: %d %s", c[0], code, body)
		}
	}
	a := <-got
	if a[0] != http.StatusNotFound || !strings.Contains(a[1].(string), "was replaced by "+policy.ModelName(1)) {
		t.Fatalf("a request naming version 2 after the switch to 1: %v %v", a[0], a[1])
	}
}

// TestRequestLimits: bodies past 16 MiB (413), prompts and id lists past
// the server's --max-prompt-tokens (400 naming the field).
func TestRequestLimits(t *testing.T) {
	dir := t.TempDir()
	policytest.Release(t, dir, 1, false)
	srv := policytest.StartWith(t, serve.Config{Protocol: policy.VLLM, Releases: dir, MaxPromptTokens: 4}, nil, 1)
	ctx := context.Background()
	big := `{"token_ids":[1],"sampling_params":{"max_tokens":1,"seed":1}}` + strings.Repeat(" ", 16<<20)
	if code, body, err := policytest.Post(ctx, srv.URL+"/inference/v1/generate", big); err != nil || code != http.StatusRequestEntityTooLarge || !strings.Contains(body, "16 MiB") {
		t.Fatalf("a 16 MiB body: %d %.200s %v, want 413 naming the limit", code, body, err)
	}
	for _, c := range [][3]string{
		{"/inference/v1/generate", `{"token_ids":[1,2,3,4,5],"sampling_params":{"max_tokens":1,"seed":1}}`, "token_ids has 5 ids, more than this server's limit of 4"},
		{"/detokenize", `{"tokens":[1,2,3,4,5]}`, "tokens has 5 ids"},
	} {
		if code, body, err := policytest.Post(ctx, srv.URL+c[0], c[1]); err != nil || code != http.StatusBadRequest || !strings.Contains(body, c[2]) {
			t.Errorf("%s %s: %d %s %v, want 400 naming %q", c[0], c[1], code, body, err, c[2])
		}
	}
	if code, body, err := policytest.Post(ctx, srv.URL+"/inference/v1/generate", `{"token_ids":[1,2,3,4],"sampling_params":{"max_tokens":1,"seed":1}}`); err != nil || code != http.StatusOK {
		t.Fatalf("a prompt at the limit: %d %s %v", code, body, err)
	}
}

// TestCheckpointFromTheReleasesDirectory: a release's checkpoint is read
// from the releases directory by its name, whatever its manifest's
// checkpoint_uri says: a manifest naming another file (a device that never
// ends) is refused, a checkpoint that is a pipe (which would block) is
// refused, and a copied directory serves its own files.
func TestCheckpointFromTheReleasesDirectory(t *testing.T) {
	dir := t.TempDir()
	rel := policytest.Release(t, dir, 1, false)
	write := func(dir string, v int64, uri string) {
		r := rel
		r.PolicyVersion, r.CheckpointURI = v, uri
		b, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, gpu.ManifestName(v)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(dir, 7, "file:///dev/zero")
	write(dir, 8, "file://"+filepath.Join(dir, gpu.CheckpointName(8)))
	if err := syscall.Mkfifo(filepath.Join(dir, gpu.CheckpointName(8)), 0o644); err != nil {
		t.Fatal(err)
	}
	srv, err := serve.New(serve.Config{Protocol: policy.SGLang, Releases: dir})
	if err != nil {
		t.Fatal(err)
	}
	for v, want := range map[int64]string{7: `checkpoint_uri "file:///dev/zero" is not the release's checkpoint policy-v00000007.ckpt`, 8: "is not a regular file"} {
		if err := srv.Load(v); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("load %d: %v, want an error saying %q", v, err, want)
		}
	}

	// A copy whose manifest still names the original's checkpoint: the
	// copy's own (damaged) checkpoint is read and refused by its hash.
	cp := t.TempDir()
	for _, name := range []string{gpu.ManifestName(1), gpu.CheckpointName(1)} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if name == gpu.CheckpointName(1) {
			b[len(b)-1] ^= 1
		}
		if err := os.WriteFile(filepath.Join(cp, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	csrv, err := serve.New(serve.Config{Protocol: policy.SGLang, Releases: cp})
	if err != nil {
		t.Fatal(err)
	}
	if err := csrv.Load(1); !errors.Is(err, gpu.ErrRelease) {
		t.Fatalf("a copied directory with a damaged checkpoint: %v, want the hash refused (gpu.ErrRelease)", err)
	}
}
