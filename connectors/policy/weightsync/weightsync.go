// Package weightsync loads a policy release into a policy server replica
// with that server's own weight-update calls, then verifies what the
// replica serves (docs/SYSTEMS.md §8 "Publication protocol": load into a shadow
// slot, verify, switch atomically, let old requests drain, acknowledge the
// replica's version). The operator that runs it on every release and
// publishes the acknowledgements (and calls gateway.SetReady) drives this
// library; it holds no state between calls.
//
// Per protocol:
//
//   - llama.cpp (router mode, llama-server --models-dir): the release is
//     the model policy.ModelName(version) of the models directory (a file
//     policy-vNNNNNNNN.gguf, or a release in `trajflow serve policy`'s
//     directory). GET /models?reload=1 (llama-server discovers files added
//     to its models directory only on a rescan); POST /models/load
//     {"model": NAME} unless it is loaded; poll GET /models until its
//     status is "loaded" (a failed load is an error with the child's exit
//     code). Then the router unloads (POST /models/unload) every other
//     policy model nothing needs (Replica.Retain; by default the newest
//     older version stays, so requests on it drain). Verified: the model
//     is listed loaded, and its checkpoint hash when the router reports one
//     (trajflow serve policy) or, when the release's checkpoint is a GGUF
//     file, the sha256 of the file GET /props?model=NAME names, if that
//     file is readable here (llama-server reports no checksum).
//   - llama.cpp single-model server (Replica.Single: llama-server -m
//     FILE): nothing is loaded; GET /props must name the release's
//     checkpoint file as its model_path (and the file's sha256, where it
//     is readable here, must be the checkpoint hash). It serves only the
//     release it was started with.
//   - SGLang: POST /update_weights_from_disk {model_path, weight_version,
//     abort_all_requests, flush_cache}; GET /get_model_info must report the
//     weight_version; GET /get_server_info's checkpoint hash, when
//     reported, must be the release's.
//   - vLLM (VLLM_SERVER_DEV_MODE): POST /pause?mode=wait (requests in
//     flight finish on the old weights), POST /start_weight_update (when
//     the server has it), POST /update_weights {update_info: {model_path}},
//     POST /finish_weight_update {weight_version}, POST /resume (also after
//     a failure, so a replica is never left paused); GET /weight_info must
//     report the version; POST /weight_checker {action: checksum} is
//     recorded, and compared when it has a "checkpoint" entry.
//
// model_path is the release's checkpoint path by default
// (Replica.ModelPath maps it otherwise, e.g. to an exported model
// directory).
package weightsync

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/schemas"
)

// Replica is a server to load releases into.
type Replica struct {
	Protocol string // policy.LlamaCpp, policy.SGLang or policy.VLLM
	Addr     string // base URL
	// Timeout bounds each call, and a llama.cpp router's wait for a load
	// (0: 2 min; loads can be slow).
	Timeout time.Duration
	// ModelPath is the model path sent to SGLang and vLLM for a release
	// (nil: its checkpoint path).
	ModelPath func(schemas.PolicyRelease) string
	// Retain says which other loaded versions a llama.cpp router keeps
	// (requests still use them); nil keeps the newest version older than
	// the one loaded.
	Retain func(version int64) bool
	// AbortAll sends SGLang's abort_all_requests (default false: requests
	// in flight finish on the weights they started with).
	AbortAll bool
	// PollInterval is the period of a llama.cpp router's status polls
	// (0: 100 ms).
	PollInterval time.Duration
	// Single marks a llama.cpp server started with one model (-m), not a
	// router: Load only verifies that it serves the release.
	Single bool
}

// Ack is what a replica acknowledged after a load.
type Ack struct {
	Protocol string `json:"protocol"`
	Addr     string `json:"addr"`
	// Version is the policy version the replica reports serving.
	Version int64 `json:"version"`
	// Model is the model name or path the replica reports.
	Model string `json:"model"`
	// Checksum is what the replica reports of its weights: "sha256:<hex>"
	// of the checkpoint when it reports that (and it then equals the
	// release's checkpoint hash), a digest of vLLM's per-weight checksums
	// otherwise, "" when the protocol offers none.
	Checksum string `json:"checksum"`
	// Unloaded lists the versions a llama.cpp router unloaded.
	Unloaded []int64 `json:"unloaded,omitempty"`
}

// ErrVerify is wrapped when a replica reports, after a load, something
// else than the release.
var ErrVerify = errors.New("weightsync: replica does not serve the release")

// Load loads rel into r and verifies it (see the package comment).
// Failures of the calls are *policy.InfraError (retry); a replica that
// answers but serves something else is ErrVerify.
func Load(ctx context.Context, r Replica, rel schemas.PolicyRelease) (Ack, error) {
	if !rel.Ready || rel.PolicyVersion < 0 {
		return Ack{}, fmt.Errorf("weightsync: %w: release %d is not ready", policy.ErrConfig, rel.PolicyVersion)
	}
	if r.Timeout <= 0 {
		r.Timeout = 2 * time.Minute
	}
	if r.PollInterval <= 0 {
		r.PollInterval = 100 * time.Millisecond
	}
	conn, err := policy.NewConn(r.Addr, r.Timeout, 4)
	if err != nil {
		return Ack{}, fmt.Errorf("weightsync: %w", err)
	}
	defer conn.Close()
	s := syncer{r: r, c: conn, rel: rel}
	var ack Ack
	switch r.Protocol {
	case policy.LlamaCpp:
		if r.Single {
			ack, err = s.llamaSingle(ctx)
		} else {
			ack, err = s.llama(ctx)
		}
	case policy.SGLang:
		ack, err = s.sglang(ctx)
	case policy.VLLM:
		ack, err = s.vllm(ctx)
	default:
		return Ack{}, fmt.Errorf("weightsync: %w: protocol %q", policy.ErrConfig, r.Protocol)
	}
	if err != nil {
		return Ack{}, fmt.Errorf("weightsync: load version %d into %s %s: %w", rel.PolicyVersion, r.Protocol, conn.Addr, err)
	}
	ack.Protocol, ack.Addr = r.Protocol, conn.Addr
	return ack, nil
}

type syncer struct {
	r   Replica
	c   *policy.Conn
	rel schemas.PolicyRelease
}

func (s *syncer) modelPath() string {
	if s.r.ModelPath != nil {
		return s.r.ModelPath(s.rel)
	}
	return strings.TrimPrefix(s.rel.CheckpointURI, "file://")
}

// checkHash compares a reported checkpoint hash with the release's (a
// release without one takes the reported hash as its acknowledgement's).
func (s *syncer) checkHash(reported string) (string, error) {
	if reported == "" {
		return "", nil
	}
	if !strings.HasPrefix(reported, "sha256:") {
		reported = "sha256:" + reported
	}
	if s.rel.CheckpointHash != "" && reported != s.rel.CheckpointHash {
		return "", fmt.Errorf("%w: checkpoint hash %s, the release's is %s", ErrVerify, reported, s.rel.CheckpointHash)
	}
	return reported, nil
}

type routerModel struct {
	ID     string `json:"id"`
	Path   string `json:"path"`
	Status struct {
		Value    string `json:"value"`
		Failed   bool   `json:"failed"`
		ExitCode int    `json:"exit_code"`
	} `json:"status"`
	Meta *struct {
		CheckpointHash string `json:"checkpoint_hash"`
	} `json:"meta"`
}

func (s *syncer) routerModels(ctx context.Context, reload bool) ([]routerModel, error) {
	var resp struct {
		Data *[]routerModel `json:"data"`
	}
	path := "/models"
	if reload {
		path += "?reload=1"
	}
	if err := s.c.Call(ctx, "GET", path, nil, &resp); err != nil {
		return nil, err
	}
	if resp.Data == nil {
		return nil, policy.Infra(policy.ReasonBadResponse, s.c.Addr, "GET /models: missing data (not a router?)")
	}
	return *resp.Data, nil
}

func (s *syncer) llama(ctx context.Context) (Ack, error) {
	v := s.rel.PolicyVersion
	name := policy.ModelName(v)
	find := func(ms []routerModel) *routerModel {
		for i := range ms {
			if ms[i].ID == name {
				return &ms[i]
			}
		}
		return nil
	}
	ms, err := s.routerModels(ctx, true)
	if err != nil {
		return Ack{}, err
	}
	m := find(ms)
	if m == nil {
		return Ack{}, fmt.Errorf("%w: the router lists no model %s (put the release's model file in its models directory)", ErrVerify, name)
	}
	if m.Status.Value != "loaded" {
		if m.Status.Value != "loading" {
			if err := s.c.Call(ctx, "POST", "/models/load", map[string]string{"model": name}, nil); err != nil {
				return Ack{}, err
			}
		}
		// The wait for the load is bounded like a call: a router that
		// reports "loading" for ever must not hold weight sync for ever.
		deadline := time.Now().Add(s.r.Timeout)
		for {
			if ms, err = s.routerModels(ctx, false); err != nil {
				return Ack{}, err
			}
			if m = find(ms); m == nil {
				return Ack{}, fmt.Errorf("%w: model %s vanished from the router's list while loading", ErrVerify, name)
			}
			if m.Status.Value == "loaded" {
				break
			}
			if m.Status.Failed || m.Status.Value == "unloaded" {
				return Ack{}, policy.Infra(policy.ReasonServerError, s.c.Addr, "loading %s failed (status %s, exit code %d)", name, m.Status.Value, m.Status.ExitCode)
			}
			if time.Now().After(deadline) {
				ie := policy.Infra(policy.ReasonTimeout, s.c.Addr, "GET /models: %s still %q after %v", name, m.Status.Value, s.r.Timeout)
				ie.Err = context.DeadlineExceeded
				return Ack{}, ie
			}
			select {
			case <-ctx.Done():
				return Ack{}, fmt.Errorf("waiting for %s to load: %w", name, ctx.Err())
			case <-time.After(s.r.PollInterval):
			}
		}
	}
	ack := Ack{Version: v, Model: name}
	if m.Meta != nil && m.Meta.CheckpointHash != "" {
		if ack.Checksum, err = s.checkHash(m.Meta.CheckpointHash); err != nil {
			return Ack{}, err
		}
	} else if ack.Checksum, err = s.modelFileHash(ctx, "/props?model="+url.QueryEscape(name)); err != nil {
		return Ack{}, err
	}
	// Unload the policy versions nothing needs.
	var older []int64
	loaded := map[int64]bool{}
	for _, x := range ms {
		if u, err := policy.ParseModelName(x.ID); err == nil && u != v && (x.Status.Value == "loaded" || x.Status.Value == "loading") {
			loaded[u] = true
			if u < v {
				older = append(older, u)
			}
		}
	}
	keep := s.r.Retain
	if keep == nil {
		prev := int64(0)
		if len(older) > 0 {
			prev = slices.Max(older)
		}
		keep = func(u int64) bool { return u == prev }
	}
	var us []int64
	for u := range loaded {
		us = append(us, u)
	}
	slices.Sort(us)
	for _, u := range us {
		if keep(u) {
			continue
		}
		if err := s.c.Call(ctx, "POST", "/models/unload", map[string]string{"model": policy.ModelName(u)}, nil); err != nil {
			return Ack{}, fmt.Errorf("loaded, but unloading version %d: %w", u, err)
		}
		ack.Unloaded = append(ack.Unloaded, u)
	}
	return ack, nil
}

// modelFileHash asks a llama.cpp server's props (path) for its model_path
// and, when the release's checkpoint is a GGUF file and the model file is
// readable here, returns its checked sha256 ("" when unreadable: a server
// on another host).
func (s *syncer) modelFileHash(ctx context.Context, path string) (string, error) {
	if !strings.HasSuffix(s.modelPath(), ".gguf") {
		return "", nil
	}
	var props struct {
		ModelPath string `json:"model_path"`
	}
	if err := s.c.Call(ctx, "GET", path, nil, &props); err != nil {
		return "", err
	}
	sum, err := fileHash(props.ModelPath)
	if err != nil {
		return "", nil
	}
	return s.checkHash(sum)
}

// fileHash is "sha256:<hex>" of a file.
func fileHash(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// llamaSingle verifies that a single-model llama-server serves the
// release: its model_path is the release's checkpoint file.
func (s *syncer) llamaSingle(ctx context.Context) (Ack, error) {
	var props struct {
		ModelPath *string `json:"model_path"`
	}
	if err := s.c.Call(ctx, "GET", "/props", nil, &props); err != nil {
		return Ack{}, err
	}
	if props.ModelPath == nil {
		return Ack{}, policy.Infra(policy.ReasonBadResponse, s.c.Addr, "GET /props: missing model_path")
	}
	want := s.modelPath()
	if filepath.Clean(*props.ModelPath) != filepath.Clean(want) {
		return Ack{}, fmt.Errorf("%w: the single-model server serves %s, release %d is %s (a single-model llama-server serves only the model it was started with; start a router, --models-dir, to load releases)",
			ErrVerify, *props.ModelPath, s.rel.PolicyVersion, want)
	}
	ack := Ack{Version: s.rel.PolicyVersion, Model: *props.ModelPath}
	if sum, err := fileHash(*props.ModelPath); err == nil && s.rel.CheckpointHash != "" {
		if ack.Checksum, err = s.checkHash(sum); err != nil {
			return Ack{}, err
		}
	}
	return ack, nil
}

func (s *syncer) sglang(ctx context.Context) (Ack, error) {
	wv := policy.WeightVersion(s.rel.PolicyVersion)
	var up struct {
		Success *bool  `json:"success"`
		Message string `json:"message"`
	}
	q := map[string]any{"model_path": s.modelPath(), "weight_version": wv, "abort_all_requests": s.r.AbortAll, "flush_cache": true}
	if err := s.c.Call(ctx, "POST", "/update_weights_from_disk", q, &up); err != nil {
		return Ack{}, err
	}
	if up.Success == nil || !*up.Success {
		return Ack{}, policy.Infra(policy.ReasonRejected, s.c.Addr, "POST /update_weights_from_disk: %s", up.Message)
	}
	var mi struct {
		ModelPath     string  `json:"model_path"`
		WeightVersion *string `json:"weight_version"`
	}
	if err := s.c.Call(ctx, "GET", "/get_model_info", nil, &mi); err != nil {
		return Ack{}, err
	}
	if mi.WeightVersion == nil || *mi.WeightVersion != wv {
		got := "none"
		if mi.WeightVersion != nil {
			got = *mi.WeightVersion
		}
		return Ack{}, fmt.Errorf("%w: GET /get_model_info reports weight_version %s after loading %s", ErrVerify, got, wv)
	}
	var si struct {
		CheckpointHash string `json:"checkpoint_hash"`
	}
	if err := s.c.Call(ctx, "GET", "/get_server_info", nil, &si); err != nil {
		return Ack{}, err
	}
	sum, err := s.checkHash(si.CheckpointHash)
	if err != nil {
		return Ack{}, err
	}
	return Ack{Version: s.rel.PolicyVersion, Model: mi.ModelPath, Checksum: sum}, nil
}

func (s *syncer) vllm(ctx context.Context) (ack Ack, err error) {
	wv := policy.WeightVersion(s.rel.PolicyVersion)
	if err := s.c.Call(ctx, "POST", "/pause?mode=wait", nil, nil); err != nil {
		return Ack{}, err
	}
	defer func() {
		// Resume whatever happened: a paused replica serves nothing.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.r.Timeout)
		defer cancel()
		if rerr := s.c.Call(rctx, "POST", "/resume", nil, nil); rerr != nil {
			err = errors.Join(err, fmt.Errorf("resume: %w", rerr))
		}
		if err == nil {
			ack, err = s.vllmVerify(ctx)
		}
	}()
	err = s.c.Call(ctx, "POST", "/start_weight_update", nil, nil)
	if ie, ok := policy.AsInfra(err); ok && ie.Status == 404 {
		err = nil // a vLLM without the call
	}
	if err != nil {
		return Ack{}, err
	}
	if err := s.c.Call(ctx, "POST", "/update_weights", map[string]any{"update_info": map[string]string{"model_path": s.modelPath()}}, nil); err != nil {
		return Ack{}, err
	}
	if err := s.c.Call(ctx, "POST", "/finish_weight_update", map[string]string{"weight_version": wv}, nil); err != nil {
		return Ack{}, err
	}
	return Ack{}, nil
}

func (s *syncer) vllmVerify(ctx context.Context) (Ack, error) {
	wv := policy.WeightVersion(s.rel.PolicyVersion)
	var wi struct {
		WeightVersion *string `json:"weight_version"`
	}
	if err := s.c.Call(ctx, "GET", "/weight_info", nil, &wi); err != nil {
		return Ack{}, err
	}
	if wi.WeightVersion == nil || *wi.WeightVersion != wv {
		return Ack{}, fmt.Errorf("%w: GET /weight_info reports %v after loading %s", ErrVerify, wi.WeightVersion, wv)
	}
	var ck struct {
		Checksums map[string]string `json:"checksums"`
	}
	if err := s.c.Call(ctx, "POST", "/weight_checker", map[string]string{"action": "checksum"}, &ck); err != nil {
		return Ack{}, err
	}
	ack := Ack{Version: s.rel.PolicyVersion, Model: s.modelPath()}
	if h, ok := ck.Checksums["checkpoint"]; ok {
		sum, err := s.checkHash(h)
		if err != nil {
			return Ack{}, err
		}
		ack.Checksum = sum
	} else if len(ck.Checksums) > 0 {
		names := make([]string, 0, len(ck.Checksums))
		for n := range ck.Checksums {
			names = append(names, n)
		}
		slices.Sort(names)
		h := sha256.New()
		for _, n := range names {
			fmt.Fprintf(h, "%s=%s\n", url.QueryEscape(n), ck.Checksums[n])
		}
		ack.Checksum = "weights-sha256:" + hex.EncodeToString(h.Sum(nil))
	}
	return ack, nil
}
