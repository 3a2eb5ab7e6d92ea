package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/operators/rollout"
)

func init() {
	registerServe("policy", "the built-in policy over the llama.cpp, SGLang or vLLM protocol (--protocol, --port, --releases, --contract)", cmdServePolicy)
}

// cmdServePolicy serves the releases of a directory over one protocol until
// ctx ends (SIGINT, SIGTERM).
func cmdServePolicy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("serve policy", stderr)
	proto := fs.String("protocol", "", "protocol: llamacpp, sglang or vllm")
	host := fs.String("host", "127.0.0.1", "address to listen on (0.0.0.0: every interface)")
	port := fs.Int("port", 0, "port (0 picks a free one)")
	dir := fs.String("releases", "", "directory of policy releases (policy-vNNNNNNNN.json manifests and checkpoints); required")
	path := fs.String("contract", "", "learning contract (default: the built-in demo contract): its tokenizer must be the built-in one; its sampler.stop_token_ids are llama.cpp's end-of-generation ids")
	version := fs.Int64("version", 0, "release to load at start (0: the newest in --releases; none there: wait for a weight-update call)")
	maxTokens := fs.Int("max-tokens", serve.DefaultMaxTokens, "most tokens one request may generate; a request asking for more is refused (400) naming its field and this limit")
	maxPrompt := fs.Int("max-prompt-tokens", serve.DefaultMaxPromptTokens, "most ids one request may carry (a prompt, ids to detokenize); more is refused (400)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if err := noArgs("serve policy", pos); err != nil {
		return err
	}
	if err := checkServePolicyFlags(*proto, *dir, *port, *maxTokens, *maxPrompt, *version); err != nil {
		return err
	}
	addr, err := listenAddr(*host, *port)
	if err != nil {
		return err
	}
	c, err := loadContract(*path)
	if err != nil {
		return err
	}
	if !strings.HasPrefix(c.Artifacts.Tokenizer, "builtin:tokenizer/kv@") {
		return fmt.Errorf("contract %s: artifacts.tokenizer %q: serve policy serves the built-in policy, whose vocabulary is builtin:tokenizer/kv", *path, c.Artifacts.Tokenizer)
	}
	reg, err := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	if err != nil {
		return err
	}
	srv, err := serve.New(serve.Config{Protocol: *proto, Releases: *dir, Grammar: reg.Grammar(), EOG: append([]int32{}, c.Sampler.StopTokenIDs...), MaxTokens: *maxTokens, MaxPromptTokens: *maxPrompt})
	if errors.Is(err, policy.ErrConfig) { // a --releases that is not a directory: exit status 2
		return fmt.Errorf("%w: --releases: %w", errUsage, err)
	}
	if err != nil {
		return err
	}
	loaded := *version
	if loaded > 0 {
		if err = srv.Load(loaded); errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%w: --version %d: no such release in --releases %s: %w", errUsage, loaded, *dir, err)
		}
	} else {
		loaded, err = srv.LoadNewest()
	}
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	served := "no release yet (load one with the protocol's weight-update call)"
	if loaded > 0 {
		served = "release " + strconv.FormatInt(loaded, 10)
	}
	fmt.Fprintf(stdout, "policy server (%s) listening on http://%s, serving %s of %s, grammar %s, contract %s\n",
		*proto, l.Addr(), served, *dir, reg.Grammar().ID(), c.Hash())
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	return stopPolicyServer(hs, srv, errc, stderr)
}

// checkServePolicyFlags refuses serve policy's impossible flag values.
func checkServePolicyFlags(proto, dir string, port, maxTokens, maxPrompt int, version int64) error {
	switch {
	case proto != policy.LlamaCpp && proto != policy.SGLang && proto != policy.VLLM:
		return fmt.Errorf("%w: --protocol %q: want llamacpp, sglang or vllm", errUsage, proto)
	case dir == "":
		return fmt.Errorf("%w: --releases DIR is required", errUsage)
	case port < 0 || port > 65535:
		return fmt.Errorf("%w: --port %d", errUsage, port)
	case maxTokens < 1:
		return fmt.Errorf("%w: --max-tokens %d must be at least 1", errUsage, maxTokens)
	case maxPrompt < 1:
		return fmt.Errorf("%w: --max-prompt-tokens %d must be at least 1", errUsage, maxPrompt)
	case version < 0:
		return fmt.Errorf("%w: --version %d: want 0 (the newest) or a release's version", errUsage, version)
	}
	return nil
}

// stopPolicyServer stops a policy server: requests waiting at a pause
// answer 503 at once; those generating get 10 s, then their connections
// are closed. errc carries Serve's end.
func stopPolicyServer(hs *http.Server, srv *serve.Server, errc <-chan error, stderr io.Writer) error {
	srv.Stop()
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		if !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		fmt.Fprintf(stderr, "serve policy: %d requests still generating after 10 s; closing their connections\n", srv.InFlight())
		if err := hs.Close(); err != nil {
			return err
		}
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
