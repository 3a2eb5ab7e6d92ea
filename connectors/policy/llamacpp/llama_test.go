//go:build llama && unix

// Tests of the llama.cpp client against a real llama-server serving
// SmolLM2-135M-Instruct. They need TRAJFLOW_LLAMA_SERVER (the binary) and
// TRAJFLOW_LLAMA_MODEL (the GGUF file), as `deploy/local/llama.sh env`
// prints them, and fail without them:
//
//	eval "$(deploy/local/llama.sh env)"
//	go test -tags llama -run Llama -v ./connectors/policy/llamacpp/
package llamacpp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/gateway"
	"github.com/trajflow/trajflow/connectors/policy/llamacpp"
	"github.com/trajflow/trajflow/connectors/policy/weightsync"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// llamaServer is a llama-server child process on a free 127.0.0.1 port,
// in its own process group (a router's model processes die with it).
type llamaServer struct {
	url string
	cmd *exec.Cmd
	log string
}

func llamaEnv(t *testing.T) (bin, gguf string) {
	t.Helper()
	bin, gguf = os.Getenv("TRAJFLOW_LLAMA_SERVER"), os.Getenv("TRAJFLOW_LLAMA_MODEL")
	if bin == "" || gguf == "" {
		t.Fatal("TRAJFLOW_LLAMA_SERVER and TRAJFLOW_LLAMA_MODEL must name the llama-server binary and the SmolLM2 GGUF model: run deploy/local/llama.sh build, then eval \"$(deploy/local/llama.sh env)\"")
	}
	for _, p := range []string{bin, gguf} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%v", err)
		}
	}
	return bin, gguf
}

func startLlama(t *testing.T, args ...string) *llamaServer {
	t.Helper()
	bin, _ := llamaEnv(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	logPath := filepath.Join(t.TempDir(), "llama-server.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	full := append([]string{"--host", "127.0.0.1", "--port", fmt.Sprint(port), "-c", "2048", "-np", "2", "-t", "2", "--no-webui"}, args...)
	cmd := exec.Command(bin, full...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = filepath.Dir(bin)
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+filepath.Dir(bin))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &llamaServer{url: fmt.Sprintf("http://127.0.0.1:%d", port), cmd: cmd, log: logPath}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait(); logf.Close() }()
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("llama-server log tail:\n%s", b)
		}
	})
	deadline := time.Now().Add(90 * time.Second)
	for {
		res, err := http.Get(s.url + "/health")
		if err == nil {
			var h struct {
				Status string `json:"status"`
			}
			json.NewDecoder(res.Body).Decode(&h)
			res.Body.Close()
			if h.Status == "ok" {
				return s
			}
		}
		select {
		case err := <-exited:
			b, _ := os.ReadFile(logPath)
			t.Fatalf("llama-server exited (%v):\n%s", err, b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("llama-server did not answer /health within 90 s")
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// trace records every call's raw request and response, and writes them to
// a log file (the request log the tests read back).
type trace struct {
	mu    sync.Mutex
	calls []call
	file  *os.File
}

type call struct {
	method, path string
	req, resp    []byte
	status       int
}

func newTrace(t *testing.T) *trace {
	f, err := os.Create(filepath.Join(t.TempDir(), "requests.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return &trace{file: f}
}

func (tr *trace) record(method, path string, req []byte, status int, resp []byte) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.calls = append(tr.calls, call{method, path, append([]byte(nil), req...), append([]byte(nil), resp...), status})
	fmt.Fprintf(tr.file, "%s %s\n> %s\n< %d %s\n", method, path, req, status, resp)
}

func (tr *trace) completions() []call {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var out []call
	for _, c := range tr.calls {
		if strings.HasPrefix(c.path, "/completion") {
			out = append(out, c)
		}
	}
	return out
}

func newLlamaClient(t *testing.T, url string, tr *trace, mod func(*llamacpp.Config)) *llamacpp.Client {
	t.Helper()
	cfg := llamacpp.Config{ClientConfig: policy.ClientConfig{Addr: url, Timeout: 2 * time.Minute, Concurrency: 2}, Version: 1}
	if tr != nil {
		cfg.Trace = tr.record
	}
	if mod != nil {
		mod(&cfg)
	}
	c, err := llamacpp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// smol holds SmolLM2's ids the tests use.
type smol struct {
	imEnd, endOfText int32
	prompt           []int32
}

func smolIDs(t *testing.T, c *llamacpp.Client) smol {
	t.Helper()
	ctx := context.Background()
	var s smol
	for _, tc := range []struct {
		text string
		dst  *int32
	}{{"<|im_end|>", &s.imEnd}, {"<|endoftext|>", &s.endOfText}} {
		ids, err := c.Tokenize(ctx, tc.text)
		if err != nil || len(ids) != 1 {
			t.Fatalf("tokenize %s: %v %v", tc.text, ids, err)
		}
		*tc.dst = ids[0]
	}
	text, err := c.ApplyTemplate(ctx, []rollout.ChatMessage{{Role: "user", Content: "Name three colors."}}, true)
	if err != nil || !strings.HasSuffix(text, "<|im_start|>assistant\n") {
		t.Fatalf("apply-template: %q %v", text, err)
	}
	if s.prompt, err = c.Tokenize(ctx, text); err != nil {
		t.Fatal(err)
	}
	back, err := c.Detokenize(ctx, s.prompt)
	if err != nil || back != text {
		t.Fatalf("detokenize of the prompt: %q, want %q (%v)", back, text, err)
	}
	return s
}

func settings(temp float64, topK int, topP float64, maxTok int, stop ...int32) model.Settings {
	return model.Settings{Behavior: model.Behavior{Temperature: temp, TopK: topK, TopP: topP}, MaxTokens: maxTok, Stop: stop}
}

// TestLlamaExact: the ids sent are the ids in the request log and the
// server evaluated all of them; the same seed twice gives the same ids and
// log-prob bits; every log-prob is float32(log(prob)) of the server's
// post-sampling prob (and not its raw log-prob); finish reasons map;
// an arbitrary stop id cuts exactly.
func TestLlamaExact(t *testing.T) {
	srv := startLlama(t, "-m", os.Getenv("TRAJFLOW_LLAMA_MODEL"))
	tr := newTrace(t)
	c := newLlamaClient(t, srv.url, tr, nil)
	ids := smolIDs(t, c)
	ctx := context.Background()
	id, err := c.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if id.Vocab != 49152 || id.ChatTemplateHash == "" || !strings.HasPrefix(id.Server, "llama.cpp ") {
		t.Fatalf("identity %+v", id)
	}
	t.Logf("identity %+v", id)

	reqs := []model.Request{
		{Context: ids.prompt, Settings: settings(0.7, 20, 0.9, 12, ids.imEnd, ids.endOfText), Seed: 1234567890123, ID: "a"},
		{Context: ids.prompt, Settings: settings(1.0, 0, 0, 12, ids.imEnd, ids.endOfText), Seed: 42, ID: "b"},
		{Context: ids.prompt, Settings: settings(1.3, 0, 0.95, 4, ids.imEnd, ids.endOfText), Seed: 7, ID: "c"},
	}
	first, err := c.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	calls := tr.completions()
	if len(calls) != len(reqs) {
		t.Fatalf("%d completion calls for %d requests", len(calls), len(reqs))
	}
	for _, cl := range calls {
		var sent struct {
			Prompt []int32 `json:"prompt"`
			Seed   uint32  `json:"seed"`
		}
		var got struct {
			Tokens          []int32 `json:"tokens"`
			TokensEvaluated int     `json:"tokens_evaluated"`
			StopType        string  `json:"stop_type"`
			Probs           []struct {
				ID   int32   `json:"id"`
				Prob float64 `json:"prob"`
			} `json:"completion_probabilities"`
		}
		if err := json.Unmarshal(cl.req, &sent); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(cl.resp, &got); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(sent.Prompt, ids.prompt) || got.TokensEvaluated != len(ids.prompt) {
			t.Fatalf("sent prompt %v (evaluated %d), request context %v", sent.Prompt, got.TokensEvaluated, ids.prompt)
		}
		// Which request was it? Match by seed.
		k := slices.IndexFunc(reqs, func(r model.Request) bool { return llamacpp.Seed32(r.Seed) == sent.Seed })
		s := first[k]
		if !slices.Equal(got.Tokens[:len(s.Tokens)], s.Tokens) {
			t.Fatalf("request %s: sample ids %v, logged %v", reqs[k].ID, s.Tokens, got.Tokens)
		}
		for i, lp := range s.Logprobs {
			if want := float32(math.Log(got.Probs[i].Prob)); math.Float32bits(lp) != math.Float32bits(want) || got.Probs[i].ID != s.Tokens[i] {
				t.Fatalf("request %s token %d: log-prob %v, log(prob) %v", reqs[k].ID, i, lp, want)
			}
		}
		switch {
		case s.Finish == model.FinishLength && (got.StopType != "limit" || len(s.Tokens) != reqs[k].Settings.MaxTokens):
			t.Fatalf("request %s: finish length from stop_type %s, %d ids", reqs[k].ID, got.StopType, len(s.Tokens))
		case s.Finish == model.FinishStop && !slices.Contains(reqs[k].Settings.Stop, s.Tokens[len(s.Tokens)-1]):
			t.Fatalf("request %s: finish stop without a stop id", reqs[k].ID)
		}
		t.Logf("request %s: %d ids %v, finish %s (stop_type %s), log-probs %v", reqs[k].ID, len(s.Tokens), s.Tokens, s.Finish, got.StopType, s.Logprobs)
	}
	if first[2].Finish != model.FinishLength {
		t.Fatalf("a 4-token request finished %s", first[2].Finish)
	}
	t.Logf("request log: %s", tr.file.Name())

	// The same seeds again: the same ids and log-prob bits.
	again, err := c.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		if !sameSample(first[i], again[i]) {
			t.Fatalf("request %s twice: %+v then %+v", reqs[i].ID, first[i], again[i])
		}
	}

	// The raw log-prob is another distribution's at temperature 0.7.
	body, _ := json.Marshal(map[string]any{"prompt": ids.prompt, "n_predict": 12, "seed": llamacpp.Seed32(reqs[0].Seed),
		"temperature": 0.7, "top_k": 20, "top_p": 0.9, "samplers": []string{"temperature", "top_k", "top_p"}, "min_p": 0,
		"n_probs": 1, "return_tokens": true, "cache_prompt": false})
	res, err := http.Post(srv.url+"/completion", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	var raw struct {
		Tokens []int32 `json:"tokens"`
		Probs  []struct {
			Logprob float64 `json:"logprob"`
		} `json:"completion_probabilities"`
	}
	json.NewDecoder(res.Body).Decode(&raw)
	res.Body.Close()
	if !slices.Equal(raw.Tokens[:len(first[0].Tokens)], first[0].Tokens) {
		t.Fatalf("without post_sampling_probs the ids change: %v vs %v", raw.Tokens, first[0].Tokens)
	}
	differ := 0
	for i, lp := range first[0].Logprobs {
		if float32(raw.Probs[i].Logprob) != lp {
			differ++
		}
	}
	if differ == 0 {
		t.Fatal("raw and post-sampling log-probs agree at temperature 0.7 with top-k/top-p: the test shows nothing")
	}
	t.Logf("raw log-probs differ from the sampling distribution's at %d of %d ids", differ, len(first[0].Logprobs))

	// A stop id the server does not know: the cut sample is the prefix of
	// the uncut one, ending at the first occurrence of that id.
	long := reqs[1]
	long.Settings.Stop = []int32{ids.imEnd, ids.endOfText}
	full := first[1]
	if len(full.Tokens) < 3 {
		t.Fatalf("request b sampled %d ids; need 3", len(full.Tokens))
	}
	stopID := full.Tokens[2]
	long.Settings.Stop = append(long.Settings.Stop, stopID)
	cut, err := c.Generate(ctx, []model.Request{long})
	if err != nil {
		t.Fatal(err)
	}
	n := slices.Index(full.Tokens, stopID) + 1
	want := model.Sample{Tokens: full.Tokens[:n], Logprobs: full.Logprobs[:n], Finish: model.FinishStop, PolicyVersion: 1}
	if !sameSample(cut[0], want) {
		t.Fatalf("cut at %d: %+v, want %+v", stopID, cut[0], want)
	}

	// A sample that ends at an end-of-generation id: stop_type eos maps
	// to stop; without that id among the stop ids it is refused.
	text, err := c.ApplyTemplate(ctx, []rollout.ChatMessage{{Role: "user", Content: "Reply with the single word yes."}}, true)
	if err != nil {
		t.Fatal(err)
	}
	yes, err := c.Tokenize(ctx, text)
	if err != nil {
		t.Fatal(err)
	}
	short := model.Request{Context: yes, Settings: settings(0.5, 0, 0, 16, ids.imEnd, ids.endOfText), Seed: 3, ID: "yes"}
	s, err := c.Generate(ctx, []model.Request{short})
	if err != nil {
		t.Fatal(err)
	}
	if s[0].Finish != model.FinishStop || s[0].Tokens[len(s[0].Tokens)-1] != ids.imEnd {
		t.Fatalf("the yes request (seed 3) did not end at <|im_end|> within 16 ids: %+v", s[0])
	}
	last := tr.completions()
	var st struct {
		StopType string `json:"stop_type"`
	}
	json.Unmarshal(last[len(last)-1].resp, &st)
	if st.StopType != "eos" {
		t.Fatalf("stop_type %q for an end at <|im_end|>", st.StopType)
	}
	t.Logf("yes request: %d ids, finish %s (stop_type %s)", len(s[0].Tokens), s[0].Finish, st.StopType)
	short.Settings.Stop = nil
	if _, err := c.Generate(ctx, []model.Request{short}); !errors.Is(err, policy.ErrSettings) || policy.IsInfra(err) {
		t.Fatalf("an end at <|im_end|> without it in the stop ids: %v", err)
	}
}

func sameSample(a, b model.Sample) bool {
	if !slices.Equal(a.Tokens, b.Tokens) || a.Finish != b.Finish || a.PolicyVersion != b.PolicyVersion || len(a.Logprobs) != len(b.Logprobs) {
		return false
	}
	for i := range a.Logprobs {
		if math.Float32bits(a.Logprobs[i]) != math.Float32bits(b.Logprobs[i]) {
			return false
		}
	}
	return true
}

// TestLlamaRouter: a router over a models directory with two versions of
// the model; weight sync loads and unloads them; every request records the
// version it named and the router's answer names the same model, so no
// sample comes from another version's process.
func TestLlamaRouter(t *testing.T) {
	_, gguf := llamaEnv(t)
	dir := t.TempDir()
	for v := int64(1); v <= 3; v++ {
		if err := os.Symlink(gguf, filepath.Join(dir, policy.ModelName(v)+".gguf")); err != nil {
			t.Fatal(err)
		}
	}
	srv := startLlama(t, "--models-dir", dir, "--models-max", "3", "--no-models-autoload")
	ctx := context.Background()
	rel := func(v int64) schemas.PolicyRelease {
		return schemas.PolicyRelease{PolicyVersion: v, Ready: true, CheckpointURI: filepath.Join(dir, policy.ModelName(v)+".gguf")}
	}
	rep := weightsync.Replica{Protocol: policy.LlamaCpp, Addr: srv.url}
	ack, err := weightsync.Load(ctx, rep, rel(1))
	if err != nil || ack.Version != 1 || ack.Model != policy.ModelName(1) {
		t.Fatalf("load 1: %+v %v", ack, err)
	}
	tr := newTrace(t)
	c1 := newLlamaClient(t, srv.url, tr, func(c *llamacpp.Config) { c.Router, c.Version, c.Want = true, 0, policy.Want{Version: 1} })
	ids := smolIDs(t, c1)
	req := []model.Request{{Context: ids.prompt, Settings: settings(0.8, 0, 0, 6, ids.imEnd, ids.endOfText), Seed: 5, ID: "r"}}
	s1, err := c1.Generate(ctx, req)
	if err != nil || s1[0].PolicyVersion != 1 {
		t.Fatalf("version 1: %+v %v", s1, err)
	}
	// Version 2 is not loaded: a request naming it is refused, not
	// served by another version and not autoloaded.
	c2 := newLlamaClient(t, srv.url, nil, func(c *llamacpp.Config) { c.Router, c.Version, c.Want = true, 0, policy.Want{Version: 2} })
	if _, err := c2.Generate(ctx, req); !policy.IsInfra(err) {
		t.Fatalf("version 2 before its load: %v", err)
	}
	if ack, err = weightsync.Load(ctx, rep, rel(2)); err != nil || len(ack.Unloaded) != 0 {
		t.Fatalf("load 2: %+v %v", ack, err)
	}
	// Both versions serve, concurrently, through a gateway that knows
	// each replica's version... here one router holds both: requests name
	// their version, and each answer's model must be the one named.
	var wg sync.WaitGroup
	results := make([][]model.Sample, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := c1
			if i%2 == 1 {
				c = c2
			}
			results[i], errs[i] = c.Generate(ctx, req)
		}()
	}
	wg.Wait()
	for i := range results {
		if errs[i] != nil || results[i][0].PolicyVersion != int64(1+i%2) {
			t.Fatalf("concurrent request %d: %+v %v", i, results[i], errs[i])
		}
		// The same file under two names: the same sample, each attributed
		// to the version it named.
		if !slices.Equal(results[i][0].Tokens, s1[0].Tokens) {
			t.Fatalf("concurrent request %d: ids %v, version 1 gave %v", i, results[i][0].Tokens, s1[0].Tokens)
		}
	}
	for _, cl := range tr.completions() {
		var sent, got struct {
			Model string `json:"model"`
		}
		json.Unmarshal(cl.req, &sent)
		json.Unmarshal(cl.resp, &got)
		if sent.Model == "" || got.Model != sent.Model {
			t.Fatalf("asked model %q, answered by %q", sent.Model, got.Model)
		}
	}
	// Version 3: version 1 is unloaded (2 stays for its requests).
	if ack, err = weightsync.Load(ctx, rep, rel(3)); err != nil || !slices.Equal(ack.Unloaded, []int64{1}) {
		t.Fatalf("load 3: %+v %v", ack, err)
	}
	if _, err := c1.Generate(ctx, req); !policy.IsInfra(err) {
		t.Fatalf("version 1 after its unload: %v", err)
	}
	// A gateway over the router as one replica, at version 3.
	c3 := newLlamaClient(t, srv.url, nil, func(c *llamacpp.Config) { c.Router, c.Version = true, 0 })
	g, err := gateway.New(gateway.Config{Replicas: []gateway.Replica{{Name: "router", Client: c3}}, HealthInterval: -1, Want: policy.Want{Version: 3}})
	if err != nil {
		t.Fatal(err)
	}
	g.SetReady("router", 3)
	s3, err := g.Generate(ctx, req)
	if err != nil || s3[0].PolicyVersion != 3 {
		t.Fatalf("through the gateway: %+v %v", s3, err)
	}
}
