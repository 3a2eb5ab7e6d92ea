package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/sglang"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/pipeline"
)

// TestServePolicy runs `trajflow serve policy`, reads its URL, samples
// through an SGLang client exactly as the release does in process, and
// stops it with its context (the signal path).
func TestServePolicy(t *testing.T) {
	dir := t.TempDir()
	m, err := model.New(model.DefaultConfig(), 3)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := gpu.NewTrainer(m, model.Behavior{Temperature: 1}, 4)
	if err != nil {
		t.Fatal(err)
	}
	files, err := pipeline.NewDirReleases(dir)
	if err != nil {
		t.Fatal(err)
	}
	rel, err := tr.Release(files, gpu.ReleaseMeta{TokenizerHash: rollout.TokenizerHash})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	var stderr bytes.Buffer
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"serve", "policy", "--protocol", "sglang", "--releases", dir}, pw, &stderr)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("no URL printed: %v (stderr %s)", err, stderr.String())
	}
	go io.Copy(io.Discard, pr)
	url := regexp.MustCompile(`http://[0-9.:]+`).FindString(line)
	if url == "" {
		t.Fatalf("no URL in %q", line)
	}
	reg, _ := rollout.NewRegistry(rollout.DefaultRegistryConfig())
	c, err := sglang.New(sglang.Config{ClientConfig: policy.ClientConfig{Addr: url, Timeout: 10 * time.Second, Want: policy.Want{Version: 4}}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := rollout.DefaultSettings(reg)
	reqs := []model.Request{{Context: []int32{rollout.TokBOS, rollout.TokTask, rollout.TokKey0 + 1, rollout.TokAct}, Settings: s, Seed: 11, ID: "t0"}}
	got, err := c.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	pol, err := gpu.LoadRelease(rel)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := pol.Generate(ctx, reqs)
	if len(got) != 1 || got[0].PolicyVersion != 4 || len(got[0].Tokens) != len(want[0].Tokens) || got[0].Logprobs[0] != want[0].Logprobs[0] {
		t.Fatalf("served %+v, release %+v", got, want)
	}
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("exit %d: %s", c, stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve policy did not stop with its context")
	}
}

func TestServeUsage(t *testing.T) {
	var out, errb bytes.Buffer
	ctx := context.Background()
	if c := run(ctx, []string{"serve"}, &out, &errb); c != 2 {
		t.Fatalf("serve without a kind: exit %d", c)
	}
	if c := run(ctx, []string{"serve", "bogus"}, &out, &errb); c != 2 {
		t.Fatalf("serve bogus: exit %d", c)
	}
	if c := run(ctx, []string{"serve", "policy", "--protocol", "grpc", "--releases", t.TempDir()}, &out, &errb); c != 2 {
		t.Fatalf("unknown protocol: exit %d", c)
	}
	if c := run(ctx, []string{"serve", "policy", "--protocol", "vllm"}, &out, &errb); c != 2 {
		t.Fatalf("no releases: exit %d", c)
	}
	errb.Reset()
	if c := run(ctx, []string{"serve", "policy", "--protocol", "vllm", "--releases", t.TempDir(), "--max-tokens", "0"}, &out, &errb); c != 2 || !strings.Contains(errb.String(), "--max-tokens 0") {
		t.Fatalf("--max-tokens 0: exit %d, %q", c, errb.String())
	}
}

// TestServePolicyFlagsRefused: a negative --version, a version the
// release directory does not hold, an empty host and a stray argument
// exit 2 at once naming the flag; nothing listens.
func TestServePolicyFlagsRefused(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []refusalCase{
		{[]string{"--version", "-1"}, []string{"--version -1"}},
		{[]string{"--version", "999"}, []string{"--version 999", "no such release"}},
		{[]string{"--host", ""}, []string{`--host ""`}},
		{[]string{"--host", "no-such-host.invalid"}, []string{`--host "no-such-host.invalid"`}},
		{[]string{"extra"}, []string{"no arguments", "extra"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"serve", "policy", "--protocol", "sglang", "--releases", dir, "--port", "0"}, c.args...), c.want...)
		})
	}
}
