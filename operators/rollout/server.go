package rollout

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// Server is a policy served by policy server replicas (docs/SYSTEMS.md §3): in a
// deployment, connectors/policy's gateway over llama.cpp, SGLang or vLLM
// replicas, which the operators registry adapts and injects (this package
// never imports the clients). The rollout stage asks it for samples of a
// version, and tells it which replica serves which version as weight sync
// acknowledges them (the weights topic).
type Server interface {
	// GenerateAt samples reqs on replicas serving version v, exactly, or
	// v or newer when atLeast. Each sample carries the version that served
	// it. An infrastructure failure is an error whose chain has an
	// InfraReason (see InfraReason).
	GenerateAt(ctx context.Context, reqs []model.Request, v int64, atLeast bool) ([]model.Sample, error)
	// SetReady records that a replica serves version v (weight sync
	// verified it); requests in flight finish where they are.
	SetReady(replica string, v int64) error
	// Prepare asks the replicas who they are (server, model, vocabulary,
	// tokenizer and template hashes) before the first group; it is called
	// again after a failure.
	Prepare(ctx context.Context) error
	// SamplerID is the sampler id a trajectory sampled with settings s
	// records: the settings' id, the replicas' protocol and identity, and
	// the exact sampler fields sent (Prepare first).
	SamplerID(s model.Settings) string
	// Tokenizer is the replicas' tokenizer and chat template (text
	// families render and tokenize with it).
	Tokenizer() Tokenizer
}

// SamplerRecorder is implemented by a Policy whose samples record another
// sampler id than the settings' own (a policy server's: its identity and
// protocol are part of what the sample depends on).
type SamplerRecorder interface {
	SamplerID(s model.Settings) string
}

// InfraReason returns the reason of an infrastructure failure in err's
// chain (an error with an InfraReason() string method: a policy server
// client's *InfraError), or "".
func InfraReason(err error) string {
	var ir interface{ InfraReason() string }
	if errors.As(err, &ir) {
		return ir.InfraReason()
	}
	return ""
}

// served is the Policy of one group on a Server: every request wants the
// group's version (exactly, or at least it), and every sample is checked
// to have been served by such a version.
type served struct {
	srv     Server
	version int64
	atLeast bool
}

var (
	_ Policy          = served{}
	_ SamplerRecorder = served{}
	_ Tokenizer       = served{}
)

// Generate implements Policy.
func (p served) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	out, err := p.srv.GenerateAt(ctx, reqs, p.version, p.atLeast)
	if err != nil {
		return nil, err
	}
	for i, s := range out {
		if s.PolicyVersion != p.version && !(p.atLeast && s.PolicyVersion > p.version) {
			return nil, &versionError{fmt.Sprintf("request %s was served by version %d, the group wants %d (at least: %v)", reqs[i].ID, s.PolicyVersion, p.version, p.atLeast)}
		}
	}
	return out, nil
}

// versionError is a sample of another version than wanted: an
// infrastructure failure (a replica that acknowledged a version and serves
// another).
type versionError struct{ msg string }

func (e *versionError) Error() string       { return "rollout: " + e.msg }
func (e *versionError) InfraReason() string { return "version_mismatch" }

// SamplerID implements SamplerRecorder.
func (p served) SamplerID(s model.Settings) string { return p.srv.SamplerID(s) }

func (p served) tok() (Tokenizer, error) {
	if t := p.srv.Tokenizer(); t != nil {
		return t, nil
	}
	return nil, errors.New("rollout: the policy servers have no tokenizer")
}

// ApplyTemplate implements Tokenizer with the servers' tokenizer.
func (p served) ApplyTemplate(ctx context.Context, msgs []ChatMessage, add bool) (string, error) {
	t, err := p.tok()
	if err != nil {
		return "", err
	}
	return t.ApplyTemplate(ctx, msgs, add)
}

// Tokenize implements Tokenizer.
func (p served) Tokenize(ctx context.Context, text string) ([]int32, error) {
	t, err := p.tok()
	if err != nil {
		return nil, err
	}
	return t.Tokenize(ctx, text)
}

// Detokenize implements Tokenizer.
func (p served) Detokenize(ctx context.Context, ids []int32) (string, error) {
	t, err := p.tok()
	if err != nil {
		return "", err
	}
	return t.Detokenize(ctx, ids)
}

// TokenizerHash implements Tokenizer.
func (p served) TokenizerHash() string {
	if t := p.srv.Tokenizer(); t != nil {
		return t.TokenizerHash()
	}
	return ""
}

// ChatTemplateHash implements Tokenizer.
func (p served) ChatTemplateHash() string {
	if t := p.srv.Tokenizer(); t != nil {
		return t.ChatTemplateHash()
	}
	return ""
}

// replicas tracks the versions weight sync acknowledged per replica (the
// weights topic), for the stage's wait before a group.
type replicas struct {
	mu      sync.Mutex
	version map[string]int64
	changed chan struct{} // closed and replaced on every change
	ready   bool          // Prepare succeeded
}

func newReplicas() *replicas {
	return &replicas{version: map[string]int64{}, changed: make(chan struct{})}
}

// ack records an acknowledgement; it reports whether anything changed.
func (r *replicas) ack(a schemas.WeightAck) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if v, ok := r.version[a.Replica]; ok && v == a.Version {
		return false
	}
	r.version[a.Replica] = a.Version
	close(r.changed)
	r.changed = make(chan struct{})
	return true
}

// serving reports whether a replica serves version v (exactly, or v or
// newer when atLeast), and the channel that is closed on the next change.
func (r *replicas) serving(v int64, atLeast bool) (bool, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, got := range r.version {
		if got == v || (atLeast && got > v) {
			return true, r.changed
		}
	}
	return false, r.changed
}

// sideWeights applies one record of the weights topic: a loaded release
// makes its replica eligible for that version.
func (s *Stage) sideWeights(m pipeline.Message) {
	a, err := schemas.DecodeWeightAck(m.Value)
	if err != nil {
		s.log().Warn("weights topic: record skipped", "source", m.Ref.String(), "err", err)
		return
	}
	if !a.Loaded {
		s.log().Warn("weight sync reports a failed load; the replica keeps what it served", "replica", a.Replica, "version", a.Version, "err", a.Error)
		return
	}
	if s.cfg.Server == nil || !s.reps.ack(a) {
		return
	}
	if err := s.cfg.Server.SetReady(a.Replica, a.Version); err != nil {
		s.log().Error("weights topic: acknowledgement of an unknown replica", "replica", a.Replica, "version", a.Version, "err", err)
		return
	}
	s.log().Info("replica serves a new version", "replica", a.Replica, "version", a.Version, "checksum", a.Checksum)
}

// awaitServed waits until a replica serves version v (exactly with
// StageConfig.Exact, stop-and-synchronize mode; v or newer otherwise) and
// returns the group's policy.
func (s *Stage) awaitServed(ctx context.Context, v int64) (Policy, error) {
	if s.cfg.PolicyWait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.cfg.PolicyWait)
		defer cancel()
	}
	atLeast := !s.cfg.Exact
	for {
		ok, ch := s.reps.serving(v, atLeast)
		if ok {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("rollout: waiting for a policy server replica serving version %d: %w", v, ctx.Err())
		case <-ch:
		}
	}
	return served{srv: s.cfg.Server, version: v, atLeast: atLeast}, nil
}

// prepare asks the servers who they are once (Server.Prepare), before a
// group's first try; a failure is the try's infrastructure failure.
func (s *Stage) prepare(ctx context.Context) error {
	if s.cfg.Server == nil || s.reps.isReady() {
		return nil
	}
	if err := s.cfg.Server.Prepare(ctx); err != nil {
		return err
	}
	s.reps.setReady()
	return nil
}

func (r *replicas) isReady() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ready
}

func (r *replicas) setReady() {
	r.mu.Lock()
	r.ready = true
	r.mu.Unlock()
}

// ServedPolicy is the Policy a group wanting version v (or newer, with
// atLeast) runs on srv, as the stage builds it: samples are checked to
// come from such a version, and its sampler id and tokenizer are srv's.
func ServedPolicy(srv Server, v int64, atLeast bool) Policy {
	return served{srv: srv, version: v, atLeast: atLeast}
}
