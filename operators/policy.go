package operators

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/trajflow/trajflow/connectors/policy"
	"github.com/trajflow/trajflow/connectors/policy/gateway"
	"github.com/trajflow/trajflow/connectors/policy/llamacpp"
	"github.com/trajflow/trajflow/connectors/policy/sglang"
	"github.com/trajflow/trajflow/connectors/policy/vllm"
	pweightsync "github.com/trajflow/trajflow/connectors/policy/weightsync"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/operators/weightsync"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// This file translates the contract's policy section (where rollout
// generates) into the rollout stage's policy server and the weight sync
// operator's replicas. Both name a replica by its endpoint URL as the
// contract writes it (without a trailing slash): the weights topic's
// acknowledgements carry that name, and the rollout stage's gateway knows
// the replica by it.

// PolicyEndpoints are the replicas' names and base URLs of the contract's
// policy section (none for the builtin policy).
func PolicyEndpoints(c *contract.Contract) []string {
	out := make([]string, len(c.Policy.Endpoints))
	for i, e := range c.Policy.Endpoints {
		out[i] = strings.TrimRight(e, "/")
	}
	return out
}

// PolicyClient is the protocol client of one replica of the contract's
// policy section, with trace seeing every call (nil: none).
func PolicyClient(c *contract.Contract, endpoint string, trace func(method, path string, req []byte, status int, resp []byte)) (policy.Client, error) {
	p := c.Policy
	cc := policy.ClientConfig{Addr: endpoint, Timeout: time.Duration(p.TimeoutMS) * time.Millisecond, Concurrency: p.Concurrency, Trace: trace}
	switch p.Protocol {
	case contract.PolicyLlamaCpp:
		return llamacpp.New(llamacpp.Config{ClientConfig: cc, Router: p.Router})
	case contract.PolicySGLang:
		return sglang.New(sglang.Config{ClientConfig: cc})
	case contract.PolicyVLLM:
		return vllm.New(vllm.Config{ClientConfig: cc})
	}
	return nil, fmt.Errorf("operators: policy.protocol %q has no client", p.Protocol)
}

// PolicyServer is the rollout stage's policy server for the contract's
// policy section: a gateway over its endpoints with the protocol's client
// (health checks running until Close), or nil for the builtin policy.
// vocab is the vocabulary the run's tokenizer has (Deps.VocabSize, 0:
// unknown) and tokenizer the hash the run's token family speaks ("" for
// a text family): the servers must report the same, when they report one.
func PolicyServer(c *contract.Contract, vocab int32, tokenizer string, trace func(method, path string, req []byte, status int, resp []byte)) (*PolicyGateway, error) {
	p := c.Policy
	if p.Protocol == contract.PolicyBuiltin {
		return nil, nil
	}
	var reps []gateway.Replica
	for _, e := range PolicyEndpoints(c) {
		cl, err := PolicyClient(c, e, trace)
		if err != nil {
			return nil, err
		}
		reps = append(reps, gateway.Replica{Name: e, Client: cl})
	}
	retries := p.Retries
	if retries == 0 {
		retries = -1 // the gateway's 0 is its default
	}
	g, err := gateway.New(gateway.Config{Replicas: reps, MaxRetries: retries})
	if err != nil {
		return nil, err
	}
	g.Start()
	return &PolicyGateway{G: g, vocab: vocab, tokenizer: tokenizer}, nil
}

// PolicyGateway adapts a gateway to rollout.Server.
type PolicyGateway struct {
	G         *gateway.Gateway
	vocab     int32
	tokenizer string
}

var _ rollout.Server = (*PolicyGateway)(nil)

// GenerateAt implements rollout.Server.
func (p *PolicyGateway) GenerateAt(ctx context.Context, reqs []model.Request, v int64, atLeast bool) ([]model.Sample, error) {
	want := policy.Exactly(v)
	if atLeast {
		want = policy.AtLeast(v)
	}
	out, errs := p.G.GenerateEach(ctx, reqs, want)
	if errs != nil {
		return nil, policy.FirstError(ctx, errs)
	}
	return out, nil
}

// SetReady implements rollout.Server.
func (p *PolicyGateway) SetReady(replica string, v int64) error { return p.G.SetReady(replica, v) }

// Prepare implements rollout.Server: the replicas' identity, which must
// agree among them and with the run's vocabulary and tokenizer.
func (p *PolicyGateway) Prepare(ctx context.Context) error {
	id, err := p.G.Identity(ctx)
	if err != nil {
		return err
	}
	if p.vocab > 0 && id.Vocab > 0 && id.Vocab != int(p.vocab) {
		return fmt.Errorf("operators: the %s servers have a vocabulary of %d ids, the run's tokenizer %d", id.Protocol, id.Vocab, p.vocab)
	}
	if p.tokenizer != "" && id.TokenizerHash != "" && id.TokenizerHash != p.tokenizer {
		return fmt.Errorf("operators: the %s servers' tokenizer is %s, the run's tasks speak %s", id.Protocol, id.TokenizerHash, p.tokenizer)
	}
	return nil
}

// SamplerID implements rollout.Server.
func (p *PolicyGateway) SamplerID(s model.Settings) string { return p.G.SamplerID(s) }

// Tokenizer implements rollout.Server: the gateway (its replicas'
// tokenizer).
func (p *PolicyGateway) Tokenizer() rollout.Tokenizer { return p.G }

// Close stops the gateway's health checks.
func (p *PolicyGateway) Close() { p.G.Close() }

// Vocab asks the replicas their vocabulary size (0 when they do not say).
func (p *PolicyGateway) Vocab(ctx context.Context) (int32, error) {
	id, err := p.G.Identity(ctx)
	return int32(id.Vocab), err
}

// syncReplica is a weightsync.Replica over connectors/policy/weightsync.
type syncReplica struct {
	name string
	r    pweightsync.Replica
}

func (s syncReplica) Name() string     { return s.name }
func (s syncReplica) Protocol() string { return s.r.Protocol }

// Load implements weightsync.Replica. A replica that answers but serves
// something else, or a configuration the calls refuse, is not retried
// within the load (pipeline.ErrPermanent); the operator tries again later.
func (s syncReplica) Load(ctx context.Context, rel schemas.PolicyRelease) (schemas.WeightAck, error) {
	ack, err := pweightsync.Load(ctx, s.r, rel)
	if err != nil {
		if errors.Is(err, pweightsync.ErrVerify) || errors.Is(err, policy.ErrConfig) {
			err = fmt.Errorf("%w: %w", pipeline.ErrPermanent, err)
		}
		return schemas.WeightAck{}, err
	}
	return schemas.WeightAck{Version: ack.Version, Model: ack.Model, Checksum: ack.Checksum, Unloaded: ack.Unloaded}, nil
}

// ErrNoPolicyServer is wrapped when a stage that needs policy servers
// (weight sync) is built for a contract whose policy is builtin.
var ErrNoPolicyServer = errors.New("no policy server")

// ErrServedPolicy is wrapped when a stage that runs the built-in policy in
// process (eval, gate) is built for a contract whose policy runs on
// servers.
var ErrServedPolicy = errors.New("the evaluation plane runs the built-in policy in process; this contract's policy runs on servers")

// SyncReplicas are the weight sync replicas of the contract's policy
// section.
func SyncReplicas(c *contract.Contract) ([]weightsync.Replica, error) {
	p := c.Policy
	if p.Protocol == contract.PolicyBuiltin {
		return nil, fmt.Errorf("operators: weightsync: %w: policy.protocol is builtin, rollout loads the releases itself (set policy.protocol and policy.endpoints)", ErrNoPolicyServer)
	}
	var out []weightsync.Replica
	for _, e := range PolicyEndpoints(c) {
		out = append(out, syncReplica{name: e, r: pweightsync.Replica{
			Protocol: p.Protocol, Addr: e, Single: p.Protocol == contract.PolicyLlamaCpp && !p.Router,
		}})
	}
	return out, nil
}

func newWeightsync(d Deps) (pipeline.Stage, error) {
	reps, err := SyncReplicas(d.Contract)
	if err != nil {
		return nil, err
	}
	return weightsync.NewStage(weightsync.StageConfig{Replicas: reps, Topics: d.Topics, RunID: d.Contract.RunID})
}

// rolloutServer sets the policy server of a rollout stage configuration
// when the contract's policy runs on servers: the gateway, exact versions
// in stop-and-synchronize mode, a backoff between a group's tries (1 s
// doubling to 10 s), and a
// group timeout that includes the generation requests'.
func rolloutServer(d Deps, reg *rollout.Registry, cfg *rollout.StageConfig) error {
	tok := ""
	if reg.Family() != rollout.FamilyText {
		tok = rollout.TokenizerHash
	}
	srv, err := PolicyServer(d.Contract, d.VocabSize, tok, d.PolicyTrace)
	if err != nil || srv == nil {
		return err
	}
	c := d.Contract
	cfg.Server = srv
	cfg.Exact = c.Dispatch.Mode == contract.DispatchSync
	cfg.RetryBackoff = pipeline.Backoff{Initial: time.Second, Max: 10 * time.Second}
	cfg.GroupTimeout = time.Duration(c.Sampler.ToolTimeoutMS+c.Policy.TimeoutMS) * time.Millisecond * time.Duration(max(1, c.Sampler.MaxTurns))
	return nil
}

// onPolicyServers reports whether c's policy runs on servers (weight sync
// is then part of the run).
func onPolicyServers(c *contract.Contract) bool {
	return c.Policy.Protocol != "" && c.Policy.Protocol != contract.PolicyBuiltin
}

// onBuiltinPolicy reports whether c's policy is the built-in one: the
// evaluation plane runs it in process, so the eval and gate operators
// serve such runs only.
func onBuiltinPolicy(c *contract.Contract) bool { return !onPolicyServers(c) }
