package loop

import (
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/trajflow/trajflow/internal/gate"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// identityKeys are the keys no stage reads as a setting: they name the
// experiment (docs/PIPELINE.md §2, §3) and enter the contract hash, which every
// record carries and validate and the trainer check (a record of another
// contract is refused), and the snapshot writes them with the run.
var identityKeys = map[string]bool{
	"objective.target_distribution": true,
	"artifacts.policy_checkpoint":   true,
	"artifacts.tokenizer":           true,
	"artifacts.chat_template":       true,
	"artifacts.tool_schemas":        true,
	"artifacts.task_corpus":         true,
	"artifacts.split_manifest":      true,
	"artifacts.validator":           true,
	"artifacts.reward_model":        true,
	"artifacts.code_revision":       true,
	"artifacts.container_image":     true,
}

// consumerView is everything the stages, the evaluation plane and the gate
// derive from a contract, without the contract hash (which every key
// changes): a key no stage reads leaves it unchanged.
func consumerView(t *testing.T, c *contract.Contract) map[string]any {
	t.Helper()
	d, err := operators.BuiltinDeps(c)
	if err != nil {
		t.Fatal(err)
	}
	d.ReleaseDir = t.TempDir()
	v := map[string]any{
		"topics":      d.Topics,
		"task family": d.Tasks.Config(),
		"validate":    validateView(d),
		"reward":      []any{operators.RewardComponents(c), operators.RewardChecks(c), c.Sampler.ToolRetries},
		"dispatch":    []any{c.Dispatch.Mode, c.Packing.MaxLag},
		"rollout": []any{operators.RolloutSettings(c, d.Tasks), operators.RolloutLimits(c), c.Sampler.ToolRetries, c.Sampler.ToolTimeoutMS,
			operators.RolloutLatency(c), c.Dispatch.PartialRollouts},
		"advantage":        c.Estimator,
		"pack":             c.Packing,
		"topic specs":      operators.TopicSpecs(c, d.Topics),
		"producers":        compressionView(t, c, d),
		"policy gateway":   c.Policy,
		"gate":             gate.PolicyOf(c),
		"evaluation plane": []any{c.Dispatch.EvalEvery, c.Seed},
	}
	// The planner (its configuration, as operators.Planner builds it).
	if _, err := operators.Planner(d); err != nil {
		t.Fatal(err)
	}
	v["dispatch planner"] = []any{c.Seed, c.Dispatch.TasksPerUpdate, c.Dispatch.GroupsPerUpdate, c.Sampler.GroupSize, c.Dispatch.DomainQuotas}
	tc, err := operators.TrainConfig(d)
	if err != nil {
		t.Fatal(err)
	}
	tc.Backend, tc.ContractHash, tc.Meta.ContractHash = nil, "", ""
	v["train"] = tc
	mc, seed := operators.ModelConfig(c)
	v["model"] = []any{mc, seed}
	return v
}

// compressionView is the codec of every topic the operators' writers use.
func compressionView(t *testing.T, c *contract.Contract, d operators.Deps) any {
	t.Helper()
	m, err := operators.Compression(c, d.Topics)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// validateView is validate's options without the hash and the denylist
// function (reflect.DeepEqual never equates two non-nil functions).
func validateView(d operators.Deps) any {
	o := operators.ValidateOptions(d)
	o.ContractHash, o.EvalDenylist = "", nil
	return o
}

// leaves lists the dotted key paths of every scalar (and list of
// scalars, and empty mapping) of a YAML document.
func leaves(prefix string, node any, out *[]string) {
	switch n := node.(type) {
	case map[string]any:
		if len(n) == 0 && prefix != "" {
			*out = append(*out, prefix)
		}
		for k, v := range n {
			p := k
			if prefix != "" {
				p = prefix + "." + k
			}
			leaves(p, v, out)
		}
	case []any:
		if len(n) > 0 {
			if _, ok := n[0].(map[string]any); ok {
				for i, v := range n {
					leaves(fmt.Sprintf("%s[%d]", prefix, i), v, out)
				}
				return
			}
		}
		*out = append(*out, prefix)
	default:
		*out = append(*out, prefix)
	}
}

var segRE = regexp.MustCompile(`^([a-z0-9_]+)(?:\[(\d+)\])?$`)

// at returns the parent mapping and key of path in doc.
func at(doc map[string]any, path string) (map[string]any, string) {
	segs := strings.Split(path, ".")
	cur := doc
	for _, seg := range segs[:len(segs)-1] {
		m := segRE.FindStringSubmatch(seg)
		next := cur[m[1]]
		if m[2] != "" {
			i, _ := strconv.Atoi(m[2])
			next = next.([]any)[i]
		}
		cur = next.(map[string]any)
	}
	return cur, segs[len(segs)-1]
}

// companions are edits made together with a key's change, for keys valid
// only with others.
//
// A nil value removes the key: keys that apply only under another key's
// value (estimator.normalize_std with grpo, ...) are refused where they
// do not apply, and left out they take their default.
var companions = map[string]map[string]any{
	"estimator.name":            {"estimator.min_group_size": 2, "estimator.normalize_std": nil, "estimator.epsilon": nil},
	"estimator.normalize_std":   {"estimator.epsilon": nil},
	"dispatch.partial_rollouts": {"dispatch.mode": "async"},
	"latency.tool_sigma":        {"latency.tool_median_ms": 1},
	"latency.token_sigma":       {"latency.token_median_ms": 1},
	"policy.protocol":           {"policy.endpoints": []any{"http://127.0.0.1:1"}, "dispatch.eval_every": nil},
	"policy.endpoints":          {"policy.protocol": "llamacpp", "dispatch.eval_every": nil},
	"policy.router":             {"policy.protocol": "llamacpp", "policy.endpoints": []any{"http://127.0.0.1:1"}, "dispatch.eval_every": nil},
	"rewards[0].clip_min":       {"rewards[0].transform": "clip", "rewards[0].clip_max": 2},
	"rewards[0].clip_max":       {"rewards[0].transform": "clip", "rewards[0].clip_min": -1},
	"loss.normalization":        {"loss.norm_tokens": 0},
	"loss.kl_placement":         {"loss.kl_coef": 0.05},
	"loss.kl_coef":              {"loss.kl_placement": "loss"},
	"loss.kl_estimator":         {"loss.kl_placement": "loss", "loss.kl_coef": 0.05},
	"loss.ratio":                {"loss.off_policy": "none"},
}

// refused are the keys whose every other value is refused as not
// implemented: the edit and the message contract validation gives.
var refused = map[string]struct {
	edits []any
	msg   string
}{}

// alternatives are the other values tried for a key; the first that
// resolves is used.
func alternatives(path string, v any) []any {
	special := map[string][]any{
		"estimator.bootstrap_truncations":               {[]any{"max_turns"}},
		"objective.regression_floors.eval_success_rate": {"0.5_of_initial", 0.5},
		"policy.protocol":                               {"llamacpp"},
		"policy.endpoints":                              {[]any{"http://127.0.0.1:1"}},
		"estimator.name":                                {"rloo"},
		"estimator.std_mode":                            {"sample"},
		"estimator.zero_variance":                       {"keep"},
		"loss.normalization":                            {"seq-mean-token-sum", "seq-mean-token-mean"},
		"packing.overflow":                              {"truncate"},
		"packing.stale_policy":                          {"mask_stale"},
		"packing.multi_policy":                          {"new_segments"},
		"loss.off_policy":                               {"none"},
		"loss.kl_placement":                             {"loss"},
		"loss.kl_estimator":                             {"k1"},
		"loss.ratio":                                    {"sequence"},
		"dispatch.partial_rollouts":                     {"continue"},
		"dispatch.mode":                                 {"async"},
		"rewards[0].transform":                          {"tanh"},
		"rewards[0].scope":                              {"turn"},
		"stop_rules":                                    {[]any{"safety_violation"}},
		"sampler.stop_token_ids":                        {[]any{9, 8}},
		"rewards[0].raw_range":                          {[]any{0, 1}},
		"dispatch.domain_quotas":                        {map[string]any{"kv-lookup": 1}},
		"artifacts.environment":                         {"builtin:env/ledger-env@v1"},
		"objective.primary_metric":                      {"eval_success_rate"},
		"objective.constraints":                         {map[string]any{"p95_turns": 4}},
		"objective.regression_floors":                   {map[string]any{"eval_success_rate": 0.5}},
		"topics.compression":                            {map[string]any{"batches": "lz4"}},
	}
	if s, ok := special[path]; ok {
		return s
	}
	switch x := v.(type) {
	case bool:
		return []any{!x}
	case int:
		return []any{x + 1, x * 2, x / 2, x - 1, 0, 0.5}
	case float64:
		if x == 0 {
			return []any{1.0, 0.5}
		}
		return []any{x / 2, x * 2, x + 1, 0.0}
	case string:
		return []any{x + "x", x + "-2"}
	}
	return nil
}

// at1 is the value at path.
func at1(doc map[string]any, path string) any {
	parent, key := at(doc, path)
	return parent[key]
}

// resolveEdited applies edits (path, value pairs) to a copy of doc and
// resolves it.
func resolveEdited(doc map[string]any, edits []any) (*contract.Contract, error) {
	b, _ := yaml.Marshal(doc)
	var cp map[string]any
	if err := yaml.Unmarshal(b, &cp); err != nil {
		return nil, err
	}
	for i := 0; i+1 < len(edits); i += 2 {
		parent, key := at(cp, edits[i].(string))
		parent[key] = edits[i+1]
	}
	b, _ = yaml.Marshal(cp)
	c, err := contract.Parse(b)
	if err != nil {
		return nil, err
	}
	return c, c.Resolve()
}

// checkRefused: edits are refused with msg.
func checkRefused(t *testing.T, doc map[string]any, edits []any, msg string) {
	t.Helper()
	if _, err := resolveEdited(doc, edits); err == nil || !strings.Contains(err.Error(), msg) {
		t.Errorf("%v: error %v, want one saying %q", edits, err, msg)
	}
}

// TestEveryContractKeyHasAConsumer walks every key of the resolved demo
// contract, changes it to another valid value, and fails when nothing a
// stage, the evaluation plane or the gate derives from the contract
// changes: a key validated and then ignored.
func TestEveryContractKeyHasAConsumer(t *testing.T) {
	base := contract.Default()
	if err := base.Resolve(); err != nil {
		t.Fatal(err)
	}
	y, err := base.YAML()
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := yaml.Unmarshal(y, &doc); err != nil {
		t.Fatal(err)
	}
	var paths []string
	leaves("", doc, &paths)
	// Keys the printed contract leaves out at their default (tagged
	// contract:"omitzero"): walked too.
	paths = append(paths, "loss.ratio")
	slices.Sort(paths)
	// The baseline is the document parsed again, as every edit is.
	again, err := resolveEdited(doc, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := consumerView(t, again)
	if !reflect.DeepEqual(want, consumerView(t, again)) {
		t.Fatal("the view of one contract differs from itself (a function or a hash in it)")
	}
	var unread, stuck []string
	for _, p := range paths {
		if identityKeys[p] {
			continue
		}
		if r, ok := refused[p]; ok {
			checkRefused(t, doc, r.edits, r.msg)
			continue
		}
		// With companions, the baseline carries them too when it is valid,
		// so only the key itself differs.
		base := want
		var comp []any
		for k, v := range companions[p] {
			comp = append(comp, k, v)
		}
		if cb, err := resolveEdited(doc, comp); err == nil && comp != nil {
			base = consumerView(t, cb)
		}
		var c *contract.Contract
		for _, alt := range alternatives(p, at1(doc, p)) {
			if fmt.Sprint(alt) == fmt.Sprint(at1(doc, p)) {
				continue // not another value
			}
			edits := []any{p, alt}
			for k, v := range companions[p] {
				edits = append(edits, k, v)
			}
			cc, err := resolveEdited(doc, edits)
			if err == nil {
				c = cc
				break
			}
		}
		if c == nil {
			stuck = append(stuck, p)
			continue
		}
		if reflect.DeepEqual(base, consumerView(t, c)) {
			unread = append(unread, p)
		}
	}
	if len(stuck) > 0 {
		t.Errorf("no other valid value tried for %v", stuck)
	}
	if len(unread) > 0 {
		t.Errorf("keys validated but read by no stage: %v", unread)
	}
	t.Logf("%d keys: %d with a consumer, %d identity, %d refused as not implemented", len(paths),
		len(paths)-len(identityKeys)-len(refused)-len(unread)-len(stuck), len(identityKeys), len(refused))
}
