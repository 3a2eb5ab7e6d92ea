package contract

import (
	"errors"
	"strings"
	"testing"
)

// TestPolicyValidation: the policy section's rules, each reported under
// its key path.
func TestPolicyValidation(t *testing.T) {
	tests := []struct {
		name  string
		edits []any
		want  string
	}{
		{"protocol unknown", []any{"policy.protocol", "tgi"}, `policy.protocol: must be one of builtin, llamacpp, sglang, vllm, got "tgi"`},
		{"builtin with endpoints", []any{"policy.endpoints", []any{"http://127.0.0.1:1"}}, "policy.endpoints: the builtin policy runs in process"},
		{"server without endpoints", []any{"policy.protocol", "sglang"}, "policy.endpoints: protocol sglang needs at least one replica URL"},
		{"endpoint scheme", []any{"policy.protocol", "vllm", "policy.endpoints", []any{"sglang://127.0.0.1:1"}}, "policy.endpoints[0]: want http://host:port"},
		{"endpoint without port", []any{"policy.protocol", "vllm", "policy.endpoints", []any{"http://127.0.0.1"}}, "policy.endpoints[0]: want a host and a port"},
		{"endpoint with path", []any{"policy.protocol", "vllm", "policy.endpoints", []any{"http://127.0.0.1:8000/v1"}}, "policy.endpoints[0]: want a base URL without"},
		{"endpoint twice", []any{"policy.protocol", "vllm", "policy.endpoints", []any{"http://127.0.0.1:1", "http://127.0.0.1:1"}}, `policy.endpoints[1]: "http://127.0.0.1:1" already listed at index 0`},
		{"timeout zero", []any{"policy.timeout_ms", 0}, "policy.timeout_ms: must be >= 1"},
		{"retries negative", []any{"policy.retries", -1}, "policy.retries: must be >= 0"},
		{"concurrency zero", []any{"policy.concurrency", 0}, "policy.concurrency: must be >= 1"},
		{"router without llamacpp", []any{"policy.protocol", "sglang", "policy.endpoints", []any{"http://127.0.0.1:1"}, "policy.router", true}, `policy.router: only for protocol llamacpp`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			doc := mutate(t, "demo.yaml", tt.edits...)
			c, err := Parse(doc)
			if err != nil {
				t.Fatalf("Parse: %v\n%s", err, doc)
			}
			err = c.Resolve()
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

// TestPolicyDefaultsAndHash: a contract without a policy section gets the
// builtin policy and the defaults; the section is rendered by YAML and
// round-trips; and it is left out of the contract hash, so the demo's
// records (batches carry the hash) do not depend on where the policy
// runs, while any other change still changes the hash.
func TestPolicyDefaultsAndHash(t *testing.T) {
	c := mustResolve(t, readFile(t, "demo.yaml"))
	if p := c.Policy; p.Protocol != PolicyBuiltin || len(p.Endpoints) != 0 || p.TimeoutMS != 60000 || p.Retries != 2 || p.Concurrency != 8 || p.Router {
		t.Fatalf("default policy section %+v", p)
	}
	served := mustResolve(t, mutate(t, "demo.yaml", "policy.protocol", "llamacpp", "policy.endpoints",
		[]any{"http://127.0.0.1:8001", "http://127.0.0.1:8002"}, "policy.router", true, "policy.timeout_ms", 5000,
		"dispatch.eval_every", deleteKey{})) // no evaluation runs on servers
	if served.Hash() != c.Hash() || served.SamplerID() != c.SamplerID() {
		t.Fatalf("the policy section changed the hash: %s vs %s", served.Hash(), c.Hash())
	}
	y, err := served.YAML()
	if err != nil {
		t.Fatal(err)
	}
	back := mustResolve(t, y)
	if back.Policy.Protocol != PolicyLlamaCpp || len(back.Policy.Endpoints) != 2 || !back.Policy.Router || back.Policy.TimeoutMS != 5000 {
		t.Fatalf("round trip of the policy section: %+v\n%s", back.Policy, y)
	}
	if !strings.Contains(string(y), "policy:\n") || !strings.Contains(string(y), "http://127.0.0.1:8002") {
		t.Fatalf("YAML lacks the policy section:\n%s", y)
	}
	other := mustResolve(t, mutate(t, "demo.yaml", "sampler.temperature", 0.9))
	if other.Hash() == c.Hash() {
		t.Fatal("a sampler change did not change the hash")
	}
}
