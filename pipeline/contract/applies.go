package contract

import (
	"fmt"
	"reflect"
	"strings"

	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators/advantage"
)

// A conditional key applies only under the values of other keys (estimator
// lambda with estimator gae only, ...). Where it does not apply no stage
// reads it, so a document that writes it there is refused: a key that is
// validated and then ignored would let a run silently mean something else
// than its contract says. A key the document leaves out is never refused
// (its default is filled whatever the other keys say), and YAML leaves an
// unwritten conditional key out where it does not apply, so that the
// printed contract reads back.
type conditional struct {
	path string
	// unused says why the key does not apply to c (the settings that make
	// it unused and what to do), "" when it applies.
	unused func(c *Contract) string
}

// conditionals are the keys refused where they do not apply when the
// document writes them, whatever their value. (The keys whose rule is
// "must be 0 unless ...", such as loss.kl_coef, loss.is_cap,
// loss.norm_tokens, rewards[i].clip_min and clip_max, sampler.min_p and
// the latency sigmas, are checked by value where they are validated: 0
// says the feature is off, which is what happens where they do not
// apply.)
var conditionals = []conditional{
	{"estimator.normalize_std", func(c *Contract) string {
		if e := c.Estimator.Estimator; e == advantage.RLOO || e == advantage.GAE {
			return fmt.Sprintf("applies to estimator grpo only (grpo divides its advantages by the group std); estimator %s does not use it: leave it out", e)
		}
		return ""
	}},
	{"estimator.epsilon", func(c *Contract) string {
		switch e := c.Estimator; {
		case e.Estimator == advantage.RLOO || e.Estimator == advantage.GAE:
			return fmt.Sprintf("applies to estimator grpo only (it is added to the group std grpo divides by); estimator %s does not use it: leave it out", e.Estimator)
		case e.Estimator == advantage.GRPO && !e.NormalizeStd:
			return "applies only with estimator.normalize_std true (it is added to the group std the advantages are divided by); with normalize_std false it is unused: leave it out"
		}
		return ""
	}},
	{"estimator.lambda", func(c *Contract) string {
		if e := c.Estimator.Estimator; e == advantage.GRPO || e == advantage.RLOO {
			return fmt.Sprintf("applies to estimator gae only; estimator %s does not use it: leave it out", e)
		}
		return ""
	}},
	{"loss.clip_low", clipUnused},
	{"loss.clip_high", clipUnused},
	{"loss.kl_estimator", func(c *Contract) string {
		if p := c.Loss.KLPlacement; p == objective.KLNone || p == "" {
			return "applies only with loss.kl_placement loss; with kl_placement none no KL term is estimated: leave it out"
		}
		return ""
	}},
	{"packing.multi_policy", func(c *Contract) string {
		if multiVersion(c) {
			return ""
		}
		if c.Dispatch.Mode != DispatchAsync {
			return fmt.Sprintf("applies only where a trajectory can be sampled by several policy versions (dispatch.mode async with dispatch.partial_rollouts continue or a policy server); with dispatch.mode %s every trajectory has one version: leave it out", c.Dispatch.Mode)
		}
		return fmt.Sprintf("applies only where a trajectory can be sampled by several policy versions (dispatch.mode async with dispatch.partial_rollouts continue or a policy server); with partial_rollouts %s on the %s policy every episode finishes on the version it started with: leave it out, or set dispatch.partial_rollouts continue", c.Dispatch.PartialRollouts, c.Policy.Protocol)
	}},
	{"dispatch.eval_every", func(c *Contract) string {
		if served(c) {
			return fmt.Sprintf("applies to policy.protocol builtin only: no evaluation runs on policy servers (the eval and gate operators measure the built-in policy in process), and this contract's protocol is %s: leave it out", c.Policy.Protocol)
		}
		return ""
	}},
	{"policy.timeout_ms", builtinUnused},
	{"policy.retries", builtinUnused},
	{"policy.concurrency", builtinUnused},
}

// clipUnused: the trust region [1-clip_low, 1+clip_high] is not part of
// truncated importance sampling.
func clipUnused(c *Contract) string {
	if c.Loss.OffPolicy == objective.OffPolicyTIS {
		return "applies to loss.off_policy none and decoupled only; tis weights the policy gradient by min(ratio, loss.is_cap) and clips nothing: leave it out"
	}
	return ""
}

// builtinUnused: the gateway's settings mean nothing to the policy in
// process.
func builtinUnused(c *Contract) string {
	if c.Policy.Protocol == PolicyBuiltin {
		return "applies to policy servers only (policy.protocol llamacpp, sglang or vllm); the builtin policy runs in process: leave it out"
	}
	return ""
}

// served reports whether c's policy runs on servers.
func served(c *Contract) bool {
	switch c.Policy.Protocol {
	case PolicyLlamaCpp, PolicySGLang, PolicyVLLM:
		return true
	}
	return false
}

// multiVersion reports whether a trajectory of c can be sampled by more
// than one policy version: only asynchronous rounds meet an update
// boundary mid-episode, and an episode then continues with the newer
// version under partial_rollouts continue, or on policy servers, which
// serve each turn of an asynchronous round with the newest version a
// replica has. A synchronous round waits for the exact version.
func multiVersion(c *Contract) bool {
	return c.Dispatch.Mode == DispatchAsync && (c.Dispatch.PartialRollouts == PartialContinue || served(c))
}

// Recorded marks c as the contract a run recorded (a snapshot's, read
// back to replay or account for the run; the caller checks its hash
// against the run's) and returns it. Such a contract is not refused for a
// conditional key it writes where the key does not apply: contracts
// printed before these keys were refused write every key, and the key's
// value changed nothing in the run, which its hash still identifies. The
// other rules hold.
func (c *Contract) Recorded() *Contract {
	c.recorded = true
	return c
}

// DropUnused resets every conditional key that does not apply to c (its
// defaults filled) to its default, as if its document had left it out: a
// program that changes one setting of a contract (an off_policy of tis,
// under which the clip bounds mean nothing) drops the keys the change
// leaves unused, so the contract validates and prints as one written that
// way.
func (c *Contract) DropUnused() {
	c.fillDefaults()
	eachUnused(c, func(k conditional, _ []string, got, def reflect.Value) {
		got.Set(def)
		delete(c.set, k.path)
	})
}

// eachUnused calls fn for every conditional key that does not apply to r
// (its defaults filled), with its path split, its field of r (settable)
// and the field's default.
func eachUnused(r *Contract, fn func(k conditional, keys []string, got, def reflect.Value)) {
	defs := reflect.ValueOf(knobDefaults()).Elem()
	rv := reflect.ValueOf(r).Elem()
	for _, k := range conditionals {
		if k.unused(r) == "" {
			continue
		}
		keys := strings.Split(k.path, ".")
		got, ok1 := fieldAt(rv, keys)
		def, ok2 := fieldAt(defs, keys)
		if ok1 && ok2 {
			fn(k, keys, got, def)
		}
	}
}

// validateConditionals refuses every conditional key the document wrote
// where it does not apply (but in a recorded contract: Recorded).
func (c *Contract) validateConditionals(v *validator) {
	if c.recorded {
		return
	}
	for _, k := range conditionals {
		if !c.set[k.path] {
			continue
		}
		if why := k.unused(c); why != "" {
			v.add(k.path, "%s", why)
		}
	}
	// Only continuation is refused in synchronous mode: finish is what a
	// synchronous round does.
	if c.set["dispatch.partial_rollouts"] && c.Dispatch.PartialRollouts == PartialContinue && c.Dispatch.Mode == DispatchSync {
		v.add("dispatch.partial_rollouts", "continue applies to dispatch.mode async only: a synchronous round never meets an update boundary mid-episode, so no episode would continue; set dispatch.mode async, or leave the key out (finish)")
	}
}

// unwrittenUnused lists the conditional keys of c that its document did
// not write, that do not apply to r (c resolved) and that hold their
// default there: YAML leaves them out, and reading the document back
// fills the same default.
func (c *Contract) unwrittenUnused(r *Contract) [][]string {
	var out [][]string
	eachUnused(r, func(k conditional, keys []string, got, def reflect.Value) {
		if !c.Written(k.path) && reflect.DeepEqual(got.Interface(), def.Interface()) {
			out = append(out, keys)
		}
	})
	return out
}

// fieldAt is the field of struct v at the YAML key path keys.
func fieldAt(v reflect.Value, keys []string) (reflect.Value, bool) {
	for _, k := range keys {
		if v.Kind() != reflect.Struct {
			return reflect.Value{}, false
		}
		f, ok := fieldsOf(v.Type()).byName[k]
		if !ok {
			return reflect.Value{}, false
		}
		v = v.FieldByIndex(f.index)
	}
	return v, true
}
