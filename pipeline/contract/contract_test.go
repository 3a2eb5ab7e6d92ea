package contract

import (
	"bytes"
	"errors"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

const dir = "../../testdata/contracts"

func readFile(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// mustResolve parses and resolves data, failing the test on any error.
func mustResolve(t testing.TB, data []byte) *Contract {
	t.Helper()
	c, err := Parse(data)
	if err != nil {
		t.Fatalf("Parse: %v\n%s", err, data)
	}
	if err := c.Resolve(); err != nil {
		t.Fatalf("Resolve: %v\n%s", err, data)
	}
	return c
}

// deleteKey marks a key to remove in mutate.
type deleteKey struct{}

var segRE = regexp.MustCompile(`^([a-z0-9_]+)(?:\[(\d+)\])?$`)

// mutate loads a testdata contract as a generic document, sets the value
// at a dotted key path ("rewards[1].name"), and renders it again.
func mutate(t testing.TB, file string, edits ...any) []byte {
	t.Helper()
	var doc map[string]any
	if err := yaml.Unmarshal(readFile(t, file), &doc); err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(edits); i += 2 {
		setPath(t, doc, edits[i].(string), edits[i+1])
	}
	out, err := yaml.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func setPath(t testing.TB, doc map[string]any, path string, value any) {
	t.Helper()
	segs := strings.Split(path, ".")
	var cur any = doc
	for i, seg := range segs {
		m := segRE.FindStringSubmatch(seg)
		if m == nil {
			t.Fatalf("bad path segment %q", seg)
		}
		mp, ok := cur.(map[string]any)
		if !ok {
			t.Fatalf("%s: not a mapping", path)
		}
		last := i == len(segs)-1
		if m[2] == "" {
			if last {
				if _, del := value.(deleteKey); del {
					delete(mp, m[1])
				} else {
					mp[m[1]] = value
				}
				return
			}
			next, ok := mp[m[1]]
			if !ok || next == nil {
				next = map[string]any{}
				mp[m[1]] = next
			}
			cur = next
			continue
		}
		idx, _ := strconv.Atoi(m[2])
		list, _ := mp[m[1]].([]any)
		for len(list) <= idx {
			list = append(list, map[string]any{})
		}
		mp[m[1]] = list
		if last {
			list[idx] = value
			return
		}
		cur = list[idx]
	}
}

func TestDefaultIsValidAndMatchesDemoFile(t *testing.T) {
	d := Default()
	if err := d.Validate(); err != nil {
		t.Fatalf("Default() invalid: %v", err)
	}
	c, err := Load(filepath.Join(dir, "demo.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	if c.Hash() != d.Hash() {
		t.Fatalf("demo.yaml hash %s != Default() hash %s\n%s\n%s", c.Hash(), d.Hash(), c.Canonical(), d.Canonical())
	}
	if !strings.HasPrefix(d.Hash(), "sha256:") || len(d.Hash()) != len("sha256:")+64 {
		t.Fatalf("hash format: %q", d.Hash())
	}
	if !strings.HasPrefix(d.SamplerID(), "sha256:") || d.SamplerID() == d.Hash() {
		t.Fatalf("sampler id: %q", d.SamplerID())
	}
}

func TestDefaultsFilled(t *testing.T) {
	c := mustResolve(t, readFile(t, "minimal.yaml"))
	if c.Hash() != Default().Hash() {
		t.Fatalf("minimal.yaml resolves to\n%s\nwant\n%s", c.Canonical(), Default().Canonical())
	}
	d := Default()
	tests := []struct {
		name      string
		got, want any
	}{
		{"seed", c.Seed, int64(1)},
		{"sampler.temperature", c.Sampler.Temperature, 1.0},
		{"sampler.tool_retries", c.Sampler.ToolRetries, 2},
		{"estimator.name", c.Estimator.Estimator, "grpo"},
		{"estimator.normalize_std", c.Estimator.NormalizeStd, true},
		{"estimator.lambda", c.Estimator.Lambda, 0.95},
		{"loss.clip_low", c.Loss.ClipLow, 0.2},
		{"loss.kl_placement", c.Loss.KLPlacement, "none"},
		{"loss.optimizer.beta2", c.Loss.Optimizer.Beta2, 0.999},
		{"dispatch.mode", c.Dispatch.Mode, DispatchSync},
		{"packing.batch_groups", c.Packing.BatchGroups, c.Dispatch.GroupsPerUpdate},
		{"rewards[0].weight", c.Rewards[0].Weight, 1.0},
		{"rewards[0].transform", c.Rewards[0].Transform, TransformIdentity},
		{"rewards[0].scope", c.Rewards[0].Scope, "trajectory"},
		{"topics.retention_ms", c.Topics.RetentionMS, d.Topics.RetentionMS},
		{"dispatch.eval_every", c.Dispatch.EvalEvery, 5},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s = %v, want %v", tt.name, tt.got, tt.want)
		}
	}
}

func TestCrossFieldDefaults(t *testing.T) {
	c := mustResolve(t, mutate(t, "minimal.yaml",
		"sampler.group_size", 4, "dispatch.groups_per_update", 32, "estimator.min_group_size", deleteKey{}))
	if c.Estimator.MinGroupSize != 4 {
		t.Errorf("min_group_size = %d, want sampler.group_size 4", c.Estimator.MinGroupSize)
	}
	if c.Packing.BatchGroups != 32 {
		t.Errorf("batch_groups = %d, want dispatch.groups_per_update 32", c.Packing.BatchGroups)
	}
}

// A written key is never replaced by a default, even when it is the zero
// value and the default is not.
func TestExplicitZeroKept(t *testing.T) {
	c := mustResolve(t, mutate(t, "minimal.yaml",
		"packing.max_lag", 0, "estimator.normalize_std", false, "sampler.tool_retries", 0,
		"packing.batch_groups", 0, "seed", 0, "estimator.gamma", 0))
	if c.Packing.MaxLag != 0 || c.Estimator.NormalizeStd || c.Sampler.ToolRetries != 0 ||
		c.Packing.BatchGroups != 0 || c.Seed != 0 || c.Estimator.Gamma != 0 {
		t.Fatalf("explicit zeros replaced: %s", c.Canonical())
	}
	if c.Hash() == Default().Hash() {
		t.Fatal("explicit zeros hash like the defaults")
	}
	d := Default()
	d.Packing.MaxLag = 0
	if err := d.Resolve(); err != nil {
		t.Fatal(err)
	}
	if d.Packing.MaxLag != 0 {
		t.Fatalf("Resolve refilled a Default() contract: max_lag %d", d.Packing.MaxLag)
	}
}

// A contract built in Go gets the same defaults as one parsed from YAML.
func TestResolveProgrammatic(t *testing.T) {
	d := Default()
	c := &Contract{
		RunID: d.RunID, Objective: d.Objective, Budgets: d.Budgets,
		StopRules: d.StopRules, Artifacts: d.Artifacts,
		Rewards: []Reward{{Name: "kv_success", Version: "1"}},
	}
	demoKnobs(c)
	h := c.Hash() // hashes the resolved form without modifying c
	if c.Sampler.Temperature != 0 {
		t.Fatal("Hash modified the contract")
	}
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	if c.Hash() != h {
		t.Fatalf("hash before resolving %s, after %s", h, c.Hash())
	}
	// max_lag 0 is a Go zero value: a contract built in Go gets the
	// default unless it sets the field after resolving (TestExplicitZeroKept).
	c.Packing.MaxLag = 0
	if c.Hash() != d.Hash() {
		t.Fatalf("programmatic contract resolved to\n%s\nwant\n%s", c.Canonical(), d.Canonical())
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name, doc string
		sentinel  error
		want      string // substring of the error
	}{
		{"empty", "", ErrSyntax, "empty document"},
		{"comment only", "# nothing\n", ErrSyntax, "empty document"},
		{"null document", "~\n", ErrSyntax, "empty document"},
		{"bad syntax", string(readFile(t, "invalid_syntax.yaml")), ErrSyntax, "yaml"},
		{"tab indentation", "run_id: a\nsampler:\n\ttemperature: 1\n", ErrSyntax, ""},
		{"two documents", "run_id: a\n---\nrun_id: b\n", ErrSyntax, "more than one YAML document"},
		{"scalar root", "hello\n", ErrInvalid, "want a mapping"},
		{"list root", "- a\n", ErrInvalid, "want a mapping"},
		{"unknown top key", "run_id: a\nfoo: 1\n", ErrInvalid, "foo: unknown key"},
		{"unknown nested key", string(readFile(t, "invalid_unknown_key.yaml")), ErrInvalid, "sampler.temprature: unknown key"},
		{"unknown optimizer key", "loss: {optimizer: {learning_rate: 1}}\n", ErrInvalid, "loss.optimizer.learning_rate: unknown key"},
		{"unknown reward key", "rewards: [{name: a, wieght: 1}]\n", ErrInvalid, "rewards[0].wieght: unknown key"},
		{"unknown packing key", "packing: {admission: 1}\n", ErrInvalid, "packing.admission: unknown key"},
		{"duplicate key", "run_id: a\nrun_id: b\n", ErrInvalid, "run_id: duplicate key"},
		{"duplicate map key", "objective: {constraints: {x: 1, x: 2}}\n", ErrInvalid, "objective.constraints.x: duplicate key"},
		{"alias", "objective: {target_distribution: &t foo, primary_metric: *t}\n", ErrInvalid, "objective.primary_metric: YAML aliases are not supported"},
		{"merge key", "sampler: {<<: {top_k: 1}}\n", ErrInvalid, "sampler"},
		{"number as string", "sampler: {temperature: hot}\n", ErrInvalid, "sampler.temperature: want a number"},
		{"fraction into int", "sampler: {max_turns: 2.5}\n", ErrInvalid, "sampler.max_turns: want an integer"},
		{"huge float into int", "budgets: {rollout_tokens: 1e30}\n", ErrInvalid, "budgets.rollout_tokens: integer 1e30 out of range for int64"},
		{"int32 overflow", "sampler: {stop_token_ids: [3000000000]}\n", ErrInvalid, "sampler.stop_token_ids[0]: integer 3000000000 out of range"},
		{"bool as string", "estimator: {normalize_std: yes}\n", ErrInvalid, "estimator.normalize_std: want true or false"},
		{"section as list", "sampler: [1, 2]\n", ErrInvalid, "sampler: want a mapping"},
		{"list as string", "stop_rules: safety_violation\n", ErrInvalid, "stop_rules: want a sequence"},
		{"string as mapping", "run_id: {a: 1}\n", ErrInvalid, "run_id: want a string"},
		{"custom tag", "run_id: !secret a\n", ErrInvalid, "run_id: want a string"},
		{"null list item", "stop_rules: [~]\n", ErrInvalid, "stop_rules[0]: missing value"},
		{"null map value", "objective: {constraints: {x: ~}}\n", ErrInvalid, "objective.constraints.x: missing value"},
		{"unknown stop rule", "stop_rules: [stop_now]\n", ErrInvalid, "stop_rules[0]: unknown stop rule"},
		{"stop rule N zero", "stop_rules: [no_validation_gain_for_0_evals]\n", ErrInvalid, "stop_rules[0]: stop rule"},
		{"stop rule unit", "stop_rules: [kl_above_limit_for_3_evals]\n", ErrInvalid, "stop_rules[0]: stop rule"},
		{"bad floor", "objective: {regression_floors: {x: abc_of_initial}}\n", ErrInvalid, "objective.regression_floors.x: floor"},
		{"floor as list", "objective: {regression_floors: {x: [1]}}\n", ErrInvalid, "objective.regression_floors.x: want a number"},
		{"non-string key", "objective: {constraints: {[a]: 1}}\n", ErrInvalid, "objective.constraints: mapping keys must be strings"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.doc))
			if err == nil {
				t.Fatalf("no error; got %+v", c)
			}
			if c != nil {
				t.Error("contract returned with an error")
			}
			if !errors.Is(err, tt.sentinel) {
				t.Errorf("error %q does not wrap %v", err, tt.sentinel)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not mention %q", err, tt.want)
			}
		})
	}
}

// Decode problems are reported together, with line numbers.
func TestParseReportsAllProblems(t *testing.T) {
	_, err := Parse([]byte("run_id: a\nfoo: 1\nsampler:\n  temperature: hot\n  bar: 2\n"))
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"foo: unknown key", "(line 2)", "sampler.temperature: want a number", "sampler.bar: unknown key", "(line 5)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Path == "" {
		t.Errorf("error is not a *FieldError: %v", err)
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "absent.yaml"))
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("err = %v, want os.ErrNotExist", err)
	}
	if _, err := Load(filepath.Join(dir, "invalid_syntax.yaml")); !errors.Is(err, ErrSyntax) || !strings.Contains(err.Error(), "invalid_syntax.yaml") {
		t.Fatalf("err = %v, want ErrSyntax naming the file", err)
	}
}

// Load names the file once and "contract" once: a syntax error's text
// already starts with the package's name.
func TestLoadErrorMessages(t *testing.T) {
	syntax := filepath.Join(dir, "invalid_syntax.yaml")
	unknown := filepath.Join(dir, "invalid_unknown_key.yaml")
	for _, tc := range []struct {
		path, want string
	}{
		{syntax, syntax + `: contract: invalid YAML: yaml: line 2: did not find expected ',' or '}'`},
		{unknown, "contract " + unknown + ": sampler.temprature: unknown key (known: temperature, top_p, top_k, min_p, " +
			"max_tokens_per_action, max_tokens_per_episode, max_turns, stop_token_ids, group_size, tool_timeout_ms, tool_retries) (line 4)"},
	} {
		_, err := Load(tc.path)
		if err == nil || err.Error() != tc.want {
			t.Errorf("Load(%s):\n got  %v\n want %s", tc.path, err, tc.want)
		}
	}
}

// Every rule: a single change to a valid contract makes Resolve fail with an
// error naming the field path.
func TestValidationErrors(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	tests := []struct {
		name  string
		edits []any
		want  string // substring, starting with the key path
	}{
		{"run_id empty", []any{"run_id", ""}, "run_id: must be 1..128"},
		{"run_id slash", []any{"run_id", "a/b"}, "run_id: must be 1..128"},
		{"run_id missing", []any{"run_id", deleteKey{}}, "run_id: must be 1..128"},
		{"target missing", []any{"objective.target_distribution", deleteKey{}}, "objective.target_distribution: required"},
		{"metric blank", []any{"objective.primary_metric", " "}, "objective.primary_metric: required"},
		{"constraint nan", []any{"objective.constraints.p95_turns", nan}, "objective.constraints.p95_turns: must be finite"},
		{"floor relative zero", []any{"objective.regression_floors.eval_success_rate", "0_of_initial"}, "objective.regression_floors.eval_success_rate: relative floor must be > 0"},
		{"floor inf", []any{"objective.regression_floors.eval_success_rate", inf}, "objective.regression_floors.eval_success_rate: must be finite"},
		{"kl_limit negative", []any{"objective.kl_limit", -1}, "objective.kl_limit: must be >= 0"},
		{"kl_limit needed", []any{"objective.kl_limit", 0}, "objective.kl_limit: must be > 0 when kl_above_limit_for_3_updates"},
		{"rollout tokens zero", []any{"budgets.rollout_tokens", 0}, "budgets.rollout_tokens: must be >= 1, got 0"},
		{"optimizer tokens missing", []any{"budgets.optimizer_tokens", deleteKey{}}, "budgets.optimizer_tokens: must be >= 1"},
		{"env hours zero", []any{"budgets.environment_hours", 0}, "budgets.environment_hours: must be > 0"},
		{"acc hours inf", []any{"budgets.accelerator_hours", inf}, "budgets.accelerator_hours: must be finite"},
		{"stop rules empty", []any{"stop_rules", []any{}}, "stop_rules: at least one"},
		{"stop rules missing", []any{"stop_rules", deleteKey{}}, "stop_rules: at least one"},
		{"stop rule duplicate", []any{"stop_rules", []any{"safety_violation", "safety_violation"}}, "stop_rules[1]: safety_violation already declared"},
		{"artifact missing", []any{"artifacts.tokenizer", deleteKey{}}, "artifacts.tokenizer: required"},
		{"artifact floating", []any{"artifacts.container_image", "registry/img:latest"}, "artifacts.container_image: must be immutable"},
		{"artifact head", []any{"artifacts.code_revision", "HEAD"}, "artifacts.code_revision: must be immutable"},
		{"artifact space", []any{"artifacts.validator", "a b"}, "artifacts.validator: must not contain whitespace"},
		{"temperature negative", []any{"sampler.temperature", -1}, "sampler.temperature: must be > 0, got -1"},
		{"temperature inf", []any{"sampler.temperature", inf}, "sampler.temperature: must be finite"},
		{"top_p zero", []any{"sampler.top_p", 0}, "sampler.top_p: must be in (0, 1], got 0"},
		{"top_p above one", []any{"sampler.top_p", 1.5}, "sampler.top_p: must be in (0, 1]"},
		{"temperature overflowing", []any{"sampler.temperature", 1e-7}, "sampler.temperature: must be >= 1e-06"},
		{"top_k negative", []any{"sampler.top_k", -1}, "sampler.top_k: must be >= 0"},
		{"min_p one", []any{"sampler.min_p", 1}, "sampler.min_p: must be in [0, 1)"},
		{"action tokens zero", []any{"sampler.max_tokens_per_action", 0}, "sampler.max_tokens_per_action: must be >= 1"},
		{"episode below action", []any{"sampler.max_tokens_per_episode", 2}, "sampler.max_tokens_per_episode: must be >= sampler.max_tokens_per_action"},
		{"max turns zero", []any{"sampler.max_turns", 0}, "sampler.max_turns: must be >= 1"},
		{"stop token negative", []any{"sampler.stop_token_ids", []any{-1}}, "sampler.stop_token_ids[0]: must be >= 0"},
		{"stop token duplicate", []any{"sampler.stop_token_ids", []any{2, 2}}, "sampler.stop_token_ids[1]: token 2 already listed"},
		{"group size one for grpo", []any{"sampler.group_size", 1, "estimator.min_group_size", 1}, "sampler.group_size: must be >= 2 for estimator grpo"},
		{"group size one for rloo", []any{"estimator.name", "rloo", "sampler.group_size", 1, "estimator.min_group_size", 1}, "sampler.group_size: must be >= 2 for estimator rloo"},
		{"rloo min group one", []any{"estimator.name", "rloo", "estimator.min_group_size", 1}, "estimator.min_group_size: must be >= 2 for estimator rloo"},
		{"gae single member groups dropped", []any{"estimator.name", "gae", "sampler.group_size", 1, "estimator.min_group_size", 1, "estimator.zero_variance", "drop"},
			"estimator.zero_variance: drop filters every group when sampler.group_size is 1 (a single return has zero variance, so nothing would train); use keep, or sampler.group_size >= 2"},
		{"tool timeout zero", []any{"sampler.tool_timeout_ms", 0}, "sampler.tool_timeout_ms: must be >= 1"},
		{"tool retries negative", []any{"sampler.tool_retries", -1}, "sampler.tool_retries: must be >= 0"},
		{"estimator unknown", []any{"estimator.name", "ppo"}, `estimator.name: must be one of grpo, rloo, gae, got "ppo"`},
		{"std mode unknown", []any{"estimator.std_mode", "biased"}, "estimator.std_mode: must be one of sample, population"},
		{"epsilon negative", []any{"estimator.epsilon", -1e-6}, "estimator.epsilon: must be >= 0"},
		{"gamma above one", []any{"estimator.gamma", 1.5}, "estimator.gamma: must be in [0, 1], got 1.5"},
		{"lambda negative", []any{"estimator.lambda", -0.1}, "estimator.lambda: must be in [0, 1]"},
		{"lambda nan", []any{"estimator.lambda", nan}, "estimator.lambda: must be finite, got NaN"},
		{"zero variance unknown", []any{"estimator.zero_variance", "skip"}, "estimator.zero_variance: must be one of keep, drop, penalize_failed"},
		{"penalize failed with gae", []any{"estimator.name", "gae", "estimator.zero_variance", "penalize_failed"},
			"estimator.zero_variance: penalize_failed needs a group-relative estimator (grpo or rloo), not gae"},
		{"min group above group", []any{"estimator.min_group_size", 17}, "estimator.min_group_size: must be <= sampler.group_size (16), got 17"},
		{"min group zero", []any{"estimator.min_group_size", 0}, "estimator.min_group_size: must be >= 1"},
		{"bootstrap empty", []any{"estimator.bootstrap_truncations", []any{""}}, "estimator.bootstrap_truncations[0]: must not be empty"},
		{"bootstrap duplicate", []any{"estimator.bootstrap_truncations", []any{"max_turns", "max_turns"}}, "estimator.bootstrap_truncations[1]"},
		{"clip_low one", []any{"loss.clip_low", 1}, "loss.clip_low: must be in [0, 1), got 1"},
		{"clip_low negative", []any{"loss.clip_low", -0.1}, "loss.clip_low: must be in [0, 1)"},
		{"clip_high negative", []any{"loss.clip_high", -0.1}, "loss.clip_high: must be >= 0"},
		{"normalization unknown", []any{"loss.normalization", "mean"}, "loss.normalization: must be one of token-mean, seq-mean-token-sum, seq-mean-token-mean"},
		{"kl placement unknown", []any{"loss.kl_placement", "both"}, "loss.kl_placement: must be one of none, loss, reward"},
		{"kl estimator unknown", []any{"loss.kl_estimator", "k4"}, "loss.kl_estimator: must be one of k1, k2, k3"},
		{"kl coef without placement", []any{"loss.kl_coef", 0.1}, "loss.kl_coef: must be 0 unless loss.kl_placement is loss"},
		{"kl loss without coef", []any{"loss.kl_placement", "loss"}, "loss.kl_coef: must be > 0"},
		{"kl reward without component", []any{"loss.kl_placement", "reward"}, "loss.kl_placement: reward placement needs a reward component named \"kl\""},
		{"kl component without placement", []any{"rewards[2]", map[string]any{"name": "kl", "version": "k3/1", "transform": "negate", "scope": "span"}}, "rewards[2].name: a \"kl\" reward component needs loss.kl_placement reward"},
		{"kl in reward not implemented", []any{"loss.kl_placement", "reward",
			"rewards[1]", map[string]any{"name": "kl", "version": "k3/1", "weight": 0.05, "transform": "negate", "scope": "span"}}, `loss.kl_placement: "reward" is not implemented`},
		{"kl in reward and loss", []any{"loss.kl_placement", "loss", "loss.kl_coef", 0.05,
			"rewards[2]", map[string]any{"name": "kl", "version": "k3/1", "transform": "negate", "scope": "span"}}, "rewards[2].name: a \"kl\" reward component with loss.kl_placement loss applies KL twice"},
		{"entropy negative", []any{"loss.entropy_coef", -0.01}, "loss.entropy_coef: must be >= 0"},
		{"token-sum without norm_tokens", []any{"loss.normalization", "token-sum", "loss.norm_tokens", 0}, "loss.norm_tokens: must be > 0 with loss.normalization token-sum"},
		{"norm_tokens with token-mean", []any{"loss.normalization", "token-mean", "loss.norm_tokens", 512}, "loss.norm_tokens: must be 0 unless loss.normalization is token-sum"},
		{"max log ratio negative", []any{"loss.max_log_ratio", -1}, "loss.max_log_ratio: must be >= 0"},
		{"lr zero", []any{"loss.optimizer.lr", 0}, "loss.optimizer.lr: must be > 0"},
		{"beta1 one", []any{"loss.optimizer.beta1", 1}, "loss.optimizer.beta1: must be in [0, 1)"},
		{"beta2 negative", []any{"loss.optimizer.beta2", -0.5}, "loss.optimizer.beta2: must be in [0, 1)"},
		{"eps zero", []any{"loss.optimizer.eps", 0}, "loss.optimizer.eps: must be > 0"},
		{"grad clip negative", []any{"loss.optimizer.grad_clip", -1}, "loss.optimizer.grad_clip: must be >= 0"},
		{"epochs zero", []any{"loss.optimizer.epochs", 0}, "loss.optimizer.epochs: must be >= 1"},
		{"minibatches zero", []any{"loss.optimizer.minibatches", 0}, "loss.optimizer.minibatches: must be >= 1"},
		{"token budget zero", []any{"packing.token_budget", 0}, "packing.token_budget: must be >= 1"},
		{"token budget above int32", []any{"packing.token_budget", 1 << 31, "packing.batch_tokens", 1 << 32}, "packing.token_budget: must be <= 2147483647"},
		{"batch below budget", []any{"packing.batch_tokens", 128}, "packing.batch_tokens: must be >= packing.token_budget (256)"},
		{"batch groups negative", []any{"packing.batch_groups", -1}, "packing.batch_groups: must be >= 0"},
		{"overflow unknown", []any{"packing.overflow", "drop"}, "packing.overflow: must be one of reject, truncate"},
		{"max lag negative", []any{"packing.max_lag", -1}, "packing.max_lag: must be >= 0, got -1"},
		{"stale policy unknown", []any{"packing.stale_policy", "keep"}, "packing.stale_policy: must be one of drop, mask_stale"},
		{"rewards empty", []any{"rewards", []any{}}, "rewards: at least one reward component"},
		{"reward name empty", []any{"rewards[0].name", ""}, "rewards[0].name: required"},
		{"reward name duplicate", []any{"rewards[1]", map[string]any{"name": "kv_success", "version": "2"}}, `rewards[1].name: "kv_success" already declared at rewards[0]`},
		{"reward version missing", []any{"rewards[0].version", deleteKey{}}, "rewards[0].version: required"},
		{"reward weight nan", []any{"rewards[0].weight", nan}, "rewards[0].weight: must be finite, got NaN"},
		{"reward weight inf", []any{"rewards[1].weight", -inf}, "rewards[1].weight: must be finite"},
		{"reward transform unknown", []any{"rewards[0].transform", "square"}, "rewards[0].transform: must be one of identity, clip, tanh, negate"},
		{"clip bounds reversed", []any{"rewards[0].transform", "clip", "rewards[0].clip_min", 1, "rewards[0].clip_max", 0}, "rewards[0].clip_max: transform clip needs finite clip_min < clip_max"},
		{"clip bounds missing", []any{"rewards[0].transform", "clip"}, "rewards[0].clip_max: transform clip needs"},
		{"clip_min without clip", []any{"rewards[0].clip_min", -1}, "rewards[0].clip_min: only used by transform clip"},
		{"clip_max without clip", []any{"rewards[1].clip_max", 1}, "rewards[1].clip_max: only used by transform clip"},
		{"reward scope unknown", []any{"rewards[0].scope", "episode"}, "rewards[0].scope: must be one of trajectory, turn, span"},
		{"partitions zero", []any{"topics.partitions", 0}, "topics.partitions: must be >= 1"},
		{"replication zero", []any{"topics.replication", 0}, "topics.replication: must be >= 1"},
		{"retention zero", []any{"topics.retention_ms", 0}, "topics.retention_ms: must be > 0 or -1"},
		{"retention minus two", []any{"topics.retention_ms", -2}, "topics.retention_ms: must be > 0 or -1"},
		{"message bytes zero", []any{"topics.max_message_bytes", 0}, "topics.max_message_bytes: must be >= 1"},
		{"tasks zero", []any{"dispatch.tasks_per_update", 0}, "dispatch.tasks_per_update: must be >= 1"},
		{"groups zero", []any{"dispatch.groups_per_update", 0}, "dispatch.groups_per_update: must be >= 1"},
		{"groups not multiple", []any{"dispatch.tasks_per_update", 3}, "dispatch.groups_per_update: must be a multiple of dispatch.tasks_per_update (3)"},
		{"quota zero", []any{"dispatch.domain_quotas", map[string]any{"math": 0}}, "dispatch.domain_quotas.math: must be in (0, 1]"},
		{"quota above one", []any{"dispatch.domain_quotas", map[string]any{"code": 1.5}}, "dispatch.domain_quotas.code: must be in (0, 1], got 1.5"},
		{"eval every zero", []any{"dispatch.eval_every", 0}, "dispatch.eval_every: must be >= 1"},
		{"dispatch mode unknown", []any{"dispatch.mode", "eager"}, `dispatch.mode: must be sync or async, got "eager"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			doc := mutate(t, "demo.yaml", tt.edits...)
			c, err := Parse(doc) // refuses non-finite numbers
			if err == nil {
				err = c.Resolve()
			}
			if err == nil {
				t.Fatalf("Resolve accepted the change\n%s", doc)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error %q does not wrap ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not mention %q", err, tt.want)
			}
		})
	}
}

// The positive counterparts of the rules: legal edge values pass.
func TestValidationAccepts(t *testing.T) {
	tests := []struct {
		name  string
		edits []any
	}{
		{"gae with single member groups", []any{"estimator.name", "gae", "sampler.group_size", 1, "estimator.min_group_size", 1, "estimator.zero_variance", "keep",
			"estimator.normalize_std", deleteKey{}, "estimator.epsilon", deleteKey{}, "estimator.lambda", 1}},
		{"gae one-step", []any{"estimator.name", "gae", "estimator.normalize_std", deleteKey{}, "estimator.epsilon", deleteKey{},
			"estimator.zero_variance", "keep", "estimator.lambda", 0}},
		// A partial group of one member is filtered as zero variance, the
		// groups of two or more still train.
		{"drop with single member partial groups", []any{"estimator.zero_variance", "drop", "estimator.min_group_size", 1}},
		{"penalize failed with rloo", []any{"estimator.name", "rloo", "estimator.zero_variance", "penalize_failed", "estimator.min_group_size", 2,
			"estimator.normalize_std", deleteKey{}, "estimator.epsilon", deleteKey{}}},
		{"gae dropping with pairs", []any{"estimator.name", "gae", "sampler.group_size", 2, "estimator.min_group_size", 1, "estimator.zero_variance", "drop",
			"estimator.normalize_std", deleteKey{}, "estimator.epsilon", deleteKey{}}},
		{"on-policy only", []any{"packing.max_lag", 0, "packing.stale_policy", "mask_stale"}},
		{"unlimited retention", []any{"topics.retention_ms", -1}},
		{"clip transform", []any{"rewards[0].transform", "clip", "rewards[0].clip_min", -1, "rewards[0].clip_max", 1}},
		{"tanh transform", []any{"rewards[0].transform", "tanh"}},
		{"absolute floor", []any{"objective.regression_floors.x", -0.5}},
		{"edge probabilities", []any{"sampler.top_p", 1, "sampler.min_p", 0.99, "loss.clip_low", 0, "estimator.gamma", 0}},
		{"no kl rule", []any{"stop_rules", []any{"budget_exhausted"}, "objective.kl_limit", 0}},
		{"quotas", []any{"dispatch.domain_quotas", map[string]any{"math": 0.5, "code": 1}}},
		{"two groups per task", []any{"dispatch.tasks_per_update", 2, "dispatch.groups_per_update", 6}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := mustResolve(t, mutate(t, "demo.yaml", tt.edits...))
			// A resolved contract satisfies every operator's own checks.
			if err := c.Estimator.Validate(); err != nil {
				t.Errorf("advantage options: %v", err)
			}
			if err := c.Packing.Validate(); err != nil {
				t.Errorf("pack options: %v", err)
			}
			if err := c.Loss.Options.Validate(); err != nil {
				t.Errorf("objective options: %v", err)
			}
		})
	}
}

// Validation reports every problem of a contract at once.
func TestInvalidExamples(t *testing.T) {
	tests := []struct {
		file string
		want []string
	}{
		{"invalid_kl_both.yaml", []string{"rewards[1].name: a \"kl\" reward component with loss.kl_placement loss applies KL twice"}},
		{"invalid_values.yaml", []string{
			"run_id:", "budgets.rollout_tokens:", "budgets.accelerator_hours:", "objective.kl_limit:",
			"artifacts.policy_checkpoint:", "sampler.temperature: must be > 0, got -1", "sampler.top_p:",
			"estimator.name:", "estimator.gamma:", "estimator.min_group_size:",
			"loss.clip_low:", "loss.normalization:", "loss.kl_estimator:", "packing.batch_tokens:",
			"packing.overflow:", "packing.max_lag:", "packing.stale_policy:", "rewards[0].clip_max:",
			"rewards[1].name:", "rewards[1].transform:", "topics.partitions:", "topics.replication:",
			"topics.retention_ms:", "topics.max_message_bytes:", "dispatch.groups_per_update:",
			"dispatch.domain_quotas.math:", "dispatch.eval_every:",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			c, err := Load(filepath.Join(dir, tt.file))
			if err != nil {
				t.Fatal(err)
			}
			err = c.Resolve()
			if err == nil {
				t.Fatal("Resolve accepted an invalid contract")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q:\n%v", w, err)
				}
			}
		})
	}
}

// Hash is stable under key order, whitespace, comments, flow style and
// explicitly written defaults.
func TestHashStable(t *testing.T) {
	want := Default().Hash()
	demo := readFile(t, "demo.yaml")
	// Reorder: the generic map renders keys sorted, without comments.
	sorted := mutate(t, "demo.yaml")
	// Flow style with different spacing and comments.
	var node yaml.Node
	if err := yaml.Unmarshal(demo, &node); err != nil {
		t.Fatal(err)
	}
	reverse(&node)
	setFlow(&node)
	flow, err := yaml.Marshal(&node)
	if err != nil {
		t.Fatal(err)
	}
	variants := map[string][]byte{
		"demo file":          demo,
		"sorted keys":        sorted,
		"reversed flow keys": append([]byte("# leading comment\n\n"), flow...),
		"minimal":            readFile(t, "minimal.yaml"),
		"explicit defaults": mutate(t, "minimal.yaml", "sampler.temperature", 1.0, "packing.max_lag", 0,
			"estimator.min_group_size", 1, "rewards[0].weight", 1, "rewards[0].scope", "trajectory", "seed", 1),
		"integral floats":  mutate(t, "demo.yaml", "budgets.rollout_tokens", 2e7, "sampler.max_turns", 4.0),
		"null sections":    []byte(strings.Replace(string(readFile(t, "minimal.yaml")), "run_id: demo", "run_id: demo\ntopics: ~", 1)),
		"negative zero":    mutate(t, "demo.yaml", "loss.kl_coef", math.Copysign(0, -1)),
		"empty vs omitted": mutate(t, "demo.yaml", "dispatch.domain_quotas", deleteKey{}, "estimator.bootstrap_truncations", deleteKey{}),
	}
	for name, doc := range variants {
		c := mustResolve(t, doc)
		if got := c.Hash(); got != want {
			t.Errorf("%s: hash %s, want %s\n%s", name, got, want, c.Canonical())
		}
	}
}

func reverse(n *yaml.Node) {
	if n.Kind == yaml.MappingNode {
		for i, j := 0, len(n.Content)-2; i < j; i, j = i+2, j-2 {
			n.Content[i], n.Content[j] = n.Content[j], n.Content[i]
			n.Content[i+1], n.Content[j+1] = n.Content[j+1], n.Content[i+1]
		}
	}
	for _, c := range n.Content {
		reverse(c)
	}
}

func setFlow(n *yaml.Node) {
	if n.Kind == yaml.MappingNode || n.Kind == yaml.SequenceNode {
		n.Style = yaml.FlowStyle
	}
	n.HeadComment, n.LineComment, n.FootComment = "", "", ""
	for _, c := range n.Content {
		setFlow(c)
	}
}

// Every semantic change gives a different hash; only sampler changes change
// the SamplerID, only the seed, target distribution, task corpus, splits
// and dispatch the CurriculumVersion, only the rewards, validator and
// reward model the RewardVersion.
func TestHashChanges(t *testing.T) {
	base := Default()
	seen := map[string]string{base.Hash(): "base"}
	tests := []struct {
		name                        string
		edits                       []any
		sampler, curriculum, reward bool
	}{
		{"run_id", []any{"run_id", "demo2"}, false, false, false},
		{"seed", []any{"seed", 2}, false, true, false},
		{"target", []any{"objective.target_distribution", "other"}, false, true, false},
		{"constraint value", []any{"objective.constraints.p95_turns", 9}, false, false, false},
		{"constraint added", []any{"objective.constraints.p95_cost", 0.2}, false, false, false},
		{"floor absolute", []any{"objective.regression_floors.eval_success_rate", 0.95}, false, false, false},
		{"kl limit", []any{"objective.kl_limit", 0.25}, false, false, false},
		{"budget", []any{"budgets.environment_hours", 2}, false, false, false},
		{"stop rule count", []any{"stop_rules[1]", "no_validation_gain_for_11_evals"}, false, false, false},
		{"stop rules order", []any{"stop_rules", []any{"budget_exhausted", "safety_violation", "no_validation_gain_for_10_evals", "kl_above_limit_for_3_updates"}}, false, false, false},
		{"artifact", []any{"artifacts.tokenizer", "builtin:tokenizer/bytes@v2"}, false, false, false},
		{"task corpus", []any{"artifacts.task_corpus", "builtin:tasks/kv@v2"}, false, true, false},
		{"splits", []any{"artifacts.split_manifest", "builtin:splits/other@v1"}, false, true, false},
		{"validator", []any{"artifacts.validator", "builtin:validator/kv_success@2"}, false, false, true},
		{"reward model", []any{"artifacts.reward_model", "judge@v2"}, false, false, true},
		{"temperature", []any{"sampler.temperature", 0.7}, true, false, false},
		{"top_k", []any{"sampler.top_k", 5}, true, false, false},
		{"stop tokens", []any{"sampler.stop_token_ids", []any{2}}, true, false, false},
		{"group size", []any{"sampler.group_size", 8}, true, false, false},
		{"tool retries zero", []any{"sampler.tool_retries", 0}, true, false, false},
		{"estimator", []any{"estimator.name", "rloo", "estimator.min_group_size", 2,
			"estimator.normalize_std", deleteKey{}, "estimator.epsilon", deleteKey{}}, false, false, false},
		{"normalize std off", []any{"estimator.normalize_std", false, "estimator.epsilon", deleteKey{}}, false, false, false},
		{"min group size", []any{"estimator.min_group_size", 4}, false, false, false},
		{"bootstrap", []any{"estimator.bootstrap_truncations", []any{"max_turns"}}, false, false, false},
		{"clip high", []any{"loss.clip_high", 0.3}, false, false, false},
		{"normalization", []any{"loss.normalization", "seq-mean-token-sum", "loss.norm_tokens", 0}, false, false, false},
		{"norm tokens", []any{"loss.norm_tokens", 2048}, false, false, false},
		{"lr", []any{"loss.optimizer.lr", 2e-3}, false, false, false},
		{"max lag one", []any{"packing.max_lag", 1}, false, false, false},
		{"batch groups off", []any{"packing.batch_groups", 0}, false, false, false},
		{"reward weight", []any{"rewards[0].weight", 0.2}, false, false, true},
		{"reward version", []any{"rewards[0].version", "2"}, false, false, true},
		{"dispatch mode", []any{"dispatch.mode", "async"}, false, true, false},
		{"topic partitions", []any{"topics.partitions", 8}, false, false, false},
		{"quota", []any{"dispatch.domain_quotas", map[string]any{"math": 0.5}}, false, true, false},
		{"quota key", []any{"dispatch.domain_quotas", map[string]any{"maths": 0.5}}, false, true, false},
		{"eval every", []any{"dispatch.eval_every", 6}, false, true, false},
	}
	for _, tt := range tests {
		c := mustResolve(t, mutate(t, "demo.yaml", tt.edits...))
		h := c.Hash()
		if prev, dup := seen[h]; dup {
			t.Errorf("%s: same hash as %s", tt.name, prev)
		}
		seen[h] = tt.name
		if got := c.SamplerID() != base.SamplerID(); got != tt.sampler {
			t.Errorf("%s: SamplerID changed = %v, want %v", tt.name, got, tt.sampler)
		}
		if got := c.CurriculumVersion() != base.CurriculumVersion(); got != tt.curriculum {
			t.Errorf("%s: CurriculumVersion changed = %v, want %v", tt.name, got, tt.curriculum)
		}
		if got := c.RewardVersion() != base.RewardVersion(); got != tt.reward {
			t.Errorf("%s: RewardVersion changed = %v, want %v", tt.name, got, tt.reward)
		}
	}
}

// YAML renders the resolved contract; parsing it back gives the same hash,
// and rendering again gives the same bytes.
func TestYAMLRoundTrip(t *testing.T) {
	docs := map[string][]byte{
		"demo":    readFile(t, "demo.yaml"),
		"minimal": readFile(t, "minimal.yaml"),
		"edited": mutate(t, "demo.yaml",
			"rewards[1]", map[string]any{"name": "length", "version": "1", "weight": 0.05, "transform": "negate", "scope": "span"},
			"rewards[0].transform", "clip", "rewards[0].clip_min", -1, "rewards[0].clip_max", 1,
			"objective.regression_floors.abs", -0.5, "sampler.stop_token_ids", []any{0, 2},
			"dispatch.domain_quotas", map[string]any{"math": 0.5, "needs \"quoting\": yes": 1},
			"run_id", "1e3", "artifacts.code_revision", "0123456", "estimator.gamma", 0, "packing.max_lag", 0),
	}
	for name, doc := range docs {
		t.Run(name, func(t *testing.T) {
			c := mustResolve(t, doc)
			out, err := c.YAML()
			if err != nil {
				t.Fatal(err)
			}
			back := mustResolve(t, out)
			if back.Hash() != c.Hash() {
				t.Fatalf("round trip changed the hash\n%s\n%s", c.Canonical(), back.Canonical())
			}
			again, err := back.YAML()
			if err != nil {
				t.Fatal(err)
			}
			if string(again) != string(out) {
				t.Fatalf("YAML not stable:\n%s\n---\n%s", out, again)
			}
		})
	}
	// An unresolved contract renders its resolved form.
	c, err := Parse(readFile(t, "minimal.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := c.YAML()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "temperature: 1") || c.Sampler.Temperature != 0 {
		t.Fatalf("YAML of an unresolved contract: %s", out)
	}
}

func TestCloneIndependent(t *testing.T) {
	c := Default()
	d := c.Clone()
	d.Objective.Constraints["p95_turns"] = 99
	d.Rewards[0].Weight = 7
	d.StopRules[0] = StopRule{Kind: StopBudgetExhausted}
	if c.Objective.Constraints["p95_turns"] != 4 || c.Rewards[0].Weight != 1 || c.StopRules[0].Kind != StopSafetyViolation {
		t.Fatal("Clone shares storage with the original")
	}
	if d.Hash() == c.Hash() {
		t.Fatal("clone edits did not change the hash")
	}
}

func TestParseStopRule(t *testing.T) {
	tests := []struct {
		in      string
		want    StopRule
		wantErr bool
	}{
		{"safety_violation", StopRule{Kind: StopSafetyViolation}, false},
		{"budget_exhausted", StopRule{Kind: StopBudgetExhausted}, false},
		{"no_validation_gain_for_5_evals", StopRule{Kind: StopNoValidationGain, N: 5}, false},
		{"kl_above_limit_for_3_updates", StopRule{Kind: StopKLAboveLimit, N: 3}, false},
		{"kl_above_limit_for_1000000_updates", StopRule{Kind: StopKLAboveLimit, N: 1000000}, false},
		{"kl_above_limit_for_1000001_updates", StopRule{}, true},
		{"no_validation_gain_for_0_evals", StopRule{}, true},
		{"no_validation_gain_for_-1_evals", StopRule{}, true},
		{"no_validation_gain_for_05_evals", StopRule{}, true},
		{"no_validation_gain_for_+5_evals", StopRule{}, true},
		{"no_validation_gain_for_N_evals", StopRule{}, true},
		{"no_validation_gain_for_5_updates", StopRule{}, true},
		{"no_validation_gain", StopRule{}, true},
		{"Safety_Violation", StopRule{}, true},
		{"", StopRule{}, true},
	}
	for _, tt := range tests {
		got, err := ParseStopRule(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParseStopRule(%q) err = %v, wantErr %v", tt.in, err, tt.wantErr)
			continue
		}
		if err == nil {
			if got != tt.want {
				t.Errorf("ParseStopRule(%q) = %+v, want %+v", tt.in, got, tt.want)
			}
			if got.String() != tt.in {
				t.Errorf("String() = %q, want %q", got.String(), tt.in)
			}
		}
	}
}

func TestFloor(t *testing.T) {
	tests := []struct {
		in        string
		want      Floor
		threshold float64 // with initial value 0.8
		wantErr   bool
	}{
		{"0.98_of_initial", Floor{0.98, true}, 0.98 * 0.8, false},
		{"0.75", Floor{0.75, false}, 0.75, false},
		{"1_of_initial", Floor{1, true}, 0.8, false},
		{"x_of_initial", Floor{}, 0, true},
		{"0.9_of_final", Floor{}, 0, true},
		{"", Floor{}, 0, true},
		{"NaN", Floor{}, 0, true}, // strconv reads it; .nan is refused as a number too
		{"+Inf", Floor{}, 0, true},
		{"Inf_of_initial", Floor{}, 0, true},
	}
	for _, tt := range tests {
		got, err := ParseFloor(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParseFloor(%q) err = %v", tt.in, err)
			continue
		}
		if err != nil {
			continue
		}
		if got != tt.want || got.Threshold(0.8) != tt.threshold || got.String() != tt.in {
			t.Errorf("ParseFloor(%q) = %+v (threshold %v, string %q)", tt.in, got, got.Threshold(0.8), got.String())
		}
	}
}

func TestRewardValue(t *testing.T) {
	tenth := 0.1 // a variable, so the product is rounded as at run time
	tests := []struct {
		r    Reward
		raw  float64
		want float64
	}{
		{Reward{Weight: 2, Transform: TransformIdentity}, 0.5, 1},
		{Reward{Weight: 1, Transform: TransformClip, ClipMin: -1, ClipMax: 1}, 3, 1},
		{Reward{Weight: 1, Transform: TransformClip, ClipMin: -1, ClipMax: 1}, -3, -1},
		{Reward{Weight: 1, Transform: TransformClip, ClipMin: -1, ClipMax: 1}, 0.25, 0.25},
		{Reward{Weight: 1, Transform: TransformTanh}, 1, math.Tanh(1)},
		{Reward{Weight: tenth, Transform: TransformNegate}, 3, tenth * -3},
	}
	for _, tt := range tests {
		if got := tt.r.Value(tt.raw); got != tt.want {
			t.Errorf("%+v.Value(%v) = %v, want %v", tt.r, tt.raw, got, tt.want)
		}
	}
	if v := (Reward{Weight: 1, Transform: "square"}).Value(2); !math.IsNaN(v) {
		t.Errorf("unknown transform = %v, want NaN", v)
	}
}

func FuzzParse(f *testing.F) {
	for _, name := range []string{"demo.yaml", "minimal.yaml", "invalid_syntax.yaml", "invalid_unknown_key.yaml", "invalid_kl_both.yaml", "invalid_values.yaml"} {
		f.Add(readFile(f, name))
	}
	f.Add([]byte("run_id: a\nrun_id: b\n"))
	f.Add([]byte("objective: {target_distribution: &t foo, primary_metric: *t}\n"))
	f.Add([]byte("sampler: {stop_token_ids: [3000000000], temperature: .nan}\n"))
	f.Add([]byte("budgets: {rollout_tokens: 1e30}\n---\n"))
	f.Add([]byte("seed: -9223372036854775809\nlatency: {tool_sigma: 1e400, token_sigma: -1e400}\n"))
	f.Add([]byte("seed: 1e999999999\nsampler: {max_turns: 9007199254740993.0, group_size: 4294967312}\n"))
	f.Add([]byte(strings.Repeat("k: 1\n", 2*MaxErrors)))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data)
		if err != nil {
			if c != nil {
				t.Fatal("contract returned with an error")
			}
			if !errors.Is(err, ErrSyntax) && !errors.Is(err, ErrInvalid) {
				t.Fatalf("error wraps neither sentinel: %v", err)
			}
			return
		}
		h := c.Hash()
		_ = c.Resolve()
		if c.Hash() != h {
			t.Fatalf("Hash before and after Resolve differ")
		}
		out, err := c.YAML()
		if err != nil {
			t.Fatalf("YAML: %v", err)
		}
		back, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse(YAML()): %v\n%s", err, out)
		}
		if back.Hash() != h {
			t.Fatalf("round trip changed the hash\n%s\n%s", c.Canonical(), back.Canonical())
		}
	})
}

func BenchmarkLoadResolveHash(b *testing.B) {
	data := readFile(b, "demo.yaml")
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		c, err := Parse(data)
		if err != nil {
			b.Fatal(err)
		}
		if err := c.Resolve(); err != nil {
			b.Fatal(err)
		}
		_ = c.Hash()
	}
}

func BenchmarkHash(b *testing.B) {
	c := Default()
	b.ReportAllocs()
	for b.Loop() {
		_ = c.Hash()
	}
}

// TestYAMLKeepsReplicationUnwritten: topics.replication decides how
// `topics create` replicates only when a document writes it, so YAML
// leaves it out where the contract did not write it — the document
// printed from the built-in contract behaves as that contract — and keeps
// it where it was written, even at the default.
func TestYAMLKeepsReplicationUnwritten(t *testing.T) {
	roundTrip := func(c *Contract) *Contract {
		t.Helper()
		y, err := c.YAML()
		if err != nil {
			t.Fatal(err)
		}
		back, err := Parse(y)
		if err == nil {
			err = back.Resolve()
		}
		if err != nil {
			t.Fatal(err)
		}
		if back.Hash() != c.Hash() {
			t.Fatalf("round trip changed the hash:\n%s", y)
		}
		return back
	}
	if back := roundTrip(Default()); back.Written("topics.replication") || back.Topics.Replication != defaultReplication {
		t.Errorf("the built-in contract printed and read back: replication %d, written %v; want %d, unwritten",
			back.Topics.Replication, back.Written("topics.replication"), defaultReplication)
	}
	base, err := Default().YAML()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 3} {
		c, err := Parse(bytes.Replace(base, []byte("topics:\n"), []byte("topics:\n  replication: "+strconv.Itoa(n)+"\n"), 1))
		if err == nil {
			err = c.Resolve()
		}
		if err != nil {
			t.Fatal(err)
		}
		if back := roundTrip(c); !back.Written("topics.replication") || back.Topics.Replication != n {
			t.Errorf("replication %d written, printed and read back: %d, written %v", n, back.Topics.Replication, back.Written("topics.replication"))
		}
	}
}

// TestYAMLAwkwardStrings: strings the YAML library writes in a form that
// does not read back — a leading line break (written as a block scalar
// that drops it), a tab before a line break (not read at all), "<<"
// (written plain: a merge key) — are written so that Parse(YAML()) gives
// the same hash, in a contract that resolves.
func TestYAMLAwkwardStrings(t *testing.T) {
	base := string(readFile(t, "minimal.yaml"))
	for _, s := range []string{"\n#", "\na", "<<", "a\tb\n", "x\u2028y"} {
		q := strconv.Quote(s)
		for _, edit := range [][2]string{
			{"primary_metric: verified_success_rate", "primary_metric: " + q},
			{"constraints: {", "constraints: {" + q + ": 1, "},
			{"{name: kv_success", "{name: " + q},
		} {
			c := mustResolve(t, []byte(strings.Replace(base, edit[0], edit[1], 1)))
			y, err := c.YAML()
			if err != nil {
				t.Fatalf("%s: %v", edit[1], err)
			}
			back, err := Parse(y)
			if err != nil {
				t.Fatalf("%s: %v\n%s", edit[1], err, y)
			}
			if back.Hash() != c.Hash() {
				t.Errorf("%s: round trip changed the hash:\n%s", edit[1], y)
			}
		}
	}
}

// overlay applies a YAML snippet to a testdata contract: every leaf of
// the snippet (a scalar, a list, or an empty mapping) is set at its key
// path, and a null leaf removes the key; then more edits as mutate's.
func overlay(t testing.TB, file, snippet string, more ...any) []byte {
	t.Helper()
	var doc map[string]any
	if err := yaml.Unmarshal([]byte(snippet), &doc); err != nil {
		t.Fatalf("snippet %q: %v", snippet, err)
	}
	var edits []any
	var walk func(prefix string, v any)
	walk = func(prefix string, v any) {
		m, ok := v.(map[string]any)
		if !ok || len(m) == 0 {
			if v == nil {
				v = deleteKey{}
			}
			edits = append(edits, prefix, v)
			return
		}
		for k, x := range m {
			walk(join(prefix, k), x)
		}
	}
	walk("", doc)
	return mutate(t, file, append(edits, more...)...)
}

// fieldSays reports whether one of err's problems is at path and says
// words.
func fieldSays(err error, path, words string) bool {
	for _, line := range strings.Split(err.Error(), "\n") {
		if strings.HasPrefix(line, path+": ") && strings.Contains(line, words) {
			return true
		}
	}
	return false
}

// servers is a policy section on servers, for the snippets below.
const servers = "policy: {protocol: vllm, endpoints: ['http://127.0.0.1:8000']}\n"

// TestConditionalKeys: a key that applies only under another key's value
// is refused where the document writes it and it does not apply, with an
// error at its path that names the setting making it unused; the same key
// is accepted where it applies; and a document that leaves it out never
// meets the error, whatever the other keys say (its default is filled).
// Also refused: values the operators narrow to float32 beyond float32's
// range.
func TestConditionalKeys(t *testing.T) {
	refused := []struct {
		name, snippet, path, words string
	}{
		{"lambda with grpo", "estimator: {lambda: 0.9}", "estimator.lambda",
			"applies to estimator gae only; estimator grpo does not use it: leave it out"},
		{"lambda with rloo", "estimator: {name: rloo, min_group_size: 2, lambda: 0.95}", "estimator.lambda",
			"estimator rloo does not use it"},
		{"normalize_std with rloo", "estimator: {name: rloo, min_group_size: 2, normalize_std: true}", "estimator.normalize_std",
			"applies to estimator grpo only (grpo divides its advantages by the group std); estimator rloo does not use it"},
		{"normalize_std with gae", "estimator: {name: gae, zero_variance: keep, normalize_std: false}", "estimator.normalize_std",
			"estimator gae does not use it"},
		{"epsilon with gae", "estimator: {name: gae, zero_variance: keep, epsilon: 0.001}", "estimator.epsilon",
			"applies to estimator grpo only"},
		{"epsilon with rloo", "estimator: {name: rloo, min_group_size: 2, epsilon: 0}", "estimator.epsilon",
			"estimator rloo does not use it"},
		{"epsilon without normalize_std", "estimator: {normalize_std: false, epsilon: 1.0e-6}", "estimator.epsilon",
			"applies only with estimator.normalize_std true"},
		{"clip_high with tis", "loss: {off_policy: tis, is_cap: 2}", "loss.clip_high",
			"applies to loss.off_policy none and decoupled only; tis weights the policy gradient by min(ratio, loss.is_cap) and clips nothing"},
		{"clip_low with tis", "loss: {off_policy: tis, is_cap: 2, clip_high: ~, clip_low: 0.2}", "loss.clip_low",
			"applies to loss.off_policy none and decoupled only"},
		{"kl_estimator with kl_placement none", "loss: {kl_estimator: k3}", "loss.kl_estimator",
			"applies only with loss.kl_placement loss; with kl_placement none no KL term is estimated"},
		{"multi_policy in sync mode", "packing: {multi_policy: discard}", "packing.multi_policy",
			"with dispatch.mode sync every trajectory has one version: leave it out"},
		{"multi_policy without continuation", "dispatch: {mode: async}\npacking: {multi_policy: per_segment}", "packing.multi_policy",
			"with partial_rollouts finish on the builtin policy every episode finishes on the version it started with"},
		{"continue in sync mode", "dispatch: {partial_rollouts: continue}", "dispatch.partial_rollouts",
			"continue applies to dispatch.mode async only"},
		{"eval_every on servers", "dispatch: {eval_every: 5}\n" + servers, "dispatch.eval_every",
			"applies to policy.protocol builtin only: no evaluation runs on policy servers"},
		{"timeout_ms in process", "policy: {timeout_ms: 1000}", "policy.timeout_ms",
			"applies to policy servers only (policy.protocol llamacpp, sglang or vllm); the builtin policy runs in process"},
		{"retries in process", "policy: {protocol: builtin, retries: 2}", "policy.retries", "applies to policy servers only"},
		{"concurrency in process", "policy: {concurrency: 8}", "policy.concurrency", "applies to policy servers only"},
		{"min_p on servers", "sampler: {min_p: 0.05}\n" + servers, "sampler.min_p",
			"applies to policy.protocol builtin only: the vllm client sends min_p 0"},
		{"tool_sigma without median", "latency: {tool_sigma: 1}", "latency.tool_sigma",
			"applies only with latency.tool_median_ms > 0"},
		{"token_sigma without median", "latency: {tool_median_ms: 5, token_sigma: 0.5}", "latency.token_sigma",
			"applies only with latency.token_median_ms > 0"},
		// Finite, but beyond float32, to which the operators narrow them.
		{"entropy_coef beyond float32", "loss: {entropy_coef: 1.0e+300}", "loss.entropy_coef",
			"must be <= 3.4028234663852886e+38 (the CUDA trainer passes it to its kernels as a float32), got 1e+300"},
		{"lr beyond float32", "loss: {optimizer: {lr: 1.0e+39}}", "loss.optimizer.lr",
			"must be <= 3.4028234663852886e+38 (an Adam step moves a parameter by about lr, and the parameters are float32"},
	}
	for _, tt := range refused {
		t.Run(tt.name, func(t *testing.T) {
			doc := overlay(t, "minimal.yaml", tt.snippet)
			c, err := Parse(doc)
			if err != nil {
				t.Fatalf("Parse: %v\n%s", err, doc)
			}
			err = c.Resolve()
			var fe *FieldError
			switch {
			case err == nil:
				t.Fatalf("accepted\n%s", doc)
			case !errors.Is(err, ErrInvalid) || !errors.As(err, &fe):
				t.Fatalf("error %v is not a FieldError wrapping ErrInvalid", err)
			case !fieldSays(err, tt.path, tt.words):
				t.Fatalf("error %q, want one at %s saying %q", err, tt.path, tt.words)
			}
			// Left out, the key takes its default and nothing is refused.
			omitted := mustResolve(t, overlay(t, "minimal.yaml", tt.snippet, tt.path, deleteKey{}))
			if omitted.Written(tt.path) {
				t.Fatalf("%s still written", tt.path)
			}
			// The printed form of such a contract reads back, hash unchanged.
			y, err := omitted.YAML()
			if err != nil {
				t.Fatal(err)
			}
			if back := mustResolve(t, y); back.Hash() != omitted.Hash() {
				t.Fatalf("round trip changed the hash:\n%s", y)
			}
		})
	}
	accepted := []struct{ name, snippet string }{
		{"lambda with gae", "estimator: {name: gae, zero_variance: keep, lambda: 0.9}"},
		{"normalize_std and epsilon with grpo", "estimator: {normalize_std: true, epsilon: 0.001}"},
		{"normalize_std off with grpo", "estimator: {normalize_std: false}"},
		{"clip with decoupled", "loss: {clip_low: 0.1, clip_high: 0.3}"},
		{"clip with none", "loss: {off_policy: none, clip_low: 0.1, clip_high: 0.3}"},
		{"tis without clip", "loss: {off_policy: tis, is_cap: 2, clip_high: ~}"},
		{"multi_policy with continuation", "dispatch: {mode: async, partial_rollouts: continue}\npacking: {multi_policy: discard}"},
		{"multi_policy on servers", "dispatch: {mode: async}\npacking: {multi_policy: new_segments}\n" + servers},
		{"finish in sync mode", "dispatch: {mode: sync, partial_rollouts: finish}"},
		{"continue in async mode", "dispatch: {mode: async, partial_rollouts: continue}"},
		{"eval_every in process", "dispatch: {eval_every: 3}\npolicy: {protocol: builtin}"},
		{"gateway settings on servers", "policy: {protocol: llamacpp, endpoints: ['http://127.0.0.1:8000'], timeout_ms: 1000, retries: 0, concurrency: 2, router: true}"},
		{"min_p in process", "sampler: {min_p: 0.05}"},
		{"latency with medians", "latency: {tool_median_ms: 5, tool_sigma: 1, token_median_ms: 0.5, token_sigma: 2}"},
		// The rules "must be 0 unless ...": 0 says off, which is what
		// happens where the key does not apply.
		{"zeros where unused", "sampler: {min_p: 0}\nlatency: {tool_sigma: 0, token_sigma: 0}\nloss: {kl_coef: 0, is_cap: 0, normalization: token-mean, norm_tokens: 0}\n" +
			"policy: {protocol: vllm, endpoints: ['http://127.0.0.1:8000'], router: false}"},
		{"float32's largest", "loss: {entropy_coef: 3.4e+38, optimizer: {lr: 3.4e+38}}"},
		// Every conditional key left out, under settings where none applies.
		{"nothing applies", "estimator: {name: rloo, min_group_size: 2}\nloss: {off_policy: tis, is_cap: 2, clip_high: ~}\n" +
			"dispatch: {mode: async}\n" + servers},
	}
	for _, tt := range accepted {
		t.Run(tt.name, func(t *testing.T) {
			c := mustResolve(t, overlay(t, "minimal.yaml", tt.snippet))
			y, err := c.YAML()
			if err != nil {
				t.Fatal(err)
			}
			if back := mustResolve(t, y); back.Hash() != c.Hash() {
				t.Fatalf("round trip changed the hash:\n%s", y)
			}
		})
	}
	// Defaults never trigger: the built-in contract, resolved, and with
	// each estimator.
	for _, name := range []string{"grpo", "rloo", "gae"} {
		c := Default()
		c.Estimator.Estimator = name
		c.Estimator.MinGroupSize = 2
		c.Estimator.ZeroVariance = "keep"
		if err := c.Resolve(); err != nil {
			t.Errorf("the built-in contract with estimator %s: %v", name, err)
		}
	}
}

// TestYAMLLeavesOutUnusedKeys: the printed form of a contract leaves out
// the keys its document did not write that do not apply to it (they would
// be refused read back) and keeps every key that applies; a key the
// document wrote is kept as written, so that the refusal reads back too.
func TestYAMLLeavesOutUnusedKeys(t *testing.T) {
	has := func(y []byte, key string) bool { return regexp.MustCompile(`(?m)^ +` + key + `:`).Match(y) }
	y, err := Default().YAML()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"lambda", "kl_estimator", "multi_policy", "timeout_ms", "retries", "concurrency"} {
		if has(y, k) {
			t.Errorf("the built-in contract prints %s:\n%s", k, y)
		}
	}
	for _, k := range []string{"normalize_std", "epsilon", "clip_low", "clip_high", "eval_every", "partial_rollouts", "min_p", "tool_sigma", "kl_coef", "is_cap", "router"} {
		if !has(y, k) {
			t.Errorf("the built-in contract does not print %s:\n%s", k, y)
		}
	}
	gae := mustResolve(t, overlay(t, "minimal.yaml", "estimator: {name: gae, zero_variance: keep}\n"+servers))
	y, err = gae.YAML()
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]bool{"lambda": true, "normalize_std": false, "epsilon": false, "eval_every": false, "timeout_ms": true, "concurrency": true} {
		if has(y, k) != want {
			t.Errorf("a gae contract on servers: %s printed %v, want %v:\n%s", k, has(y, k), want, y)
		}
	}
	wrote, err := Parse(overlay(t, "minimal.yaml", "estimator: {lambda: 0.95}"))
	if err != nil {
		t.Fatal(err)
	}
	if y, err = wrote.YAML(); err != nil || !has(y, "lambda") {
		t.Fatalf("a written lambda is not printed (%v):\n%s", err, y)
	}
}

// TestRecordedContractKeepsUnusedKeys: a contract a run recorded may
// write a key where it does not apply (every contract printed before such
// keys were refused did): read back as recorded it resolves, with the
// hash of the same contract without the key; read as a new contract it is
// refused. The other rules still hold for a recorded contract.
func TestRecordedContractKeepsUnusedKeys(t *testing.T) {
	doc := overlay(t, "minimal.yaml", "estimator: {name: grpo, lambda: 0.95}")
	c, err := Parse(doc)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Clone().Resolve(); err == nil || !strings.Contains(err.Error(), "estimator.lambda") {
		t.Fatalf("a new contract writing lambda under grpo: %v", err)
	}
	if err := c.Recorded().Resolve(); err != nil {
		t.Fatalf("recorded: %v", err)
	}
	if want := mustResolve(t, overlay(t, "minimal.yaml", "estimator: {name: grpo}")).Hash(); c.Hash() != want {
		t.Fatalf("hash %s, want %s (the same contract without the unused key)", c.Hash(), want)
	}
	bad, err := Parse(overlay(t, "minimal.yaml", "estimator: {name: grpo, lambda: 1.5}"))
	if err != nil {
		t.Fatal(err)
	}
	if err := bad.Recorded().Resolve(); err == nil || !strings.Contains(err.Error(), "estimator.lambda") {
		t.Fatalf("a recorded lambda out of [0, 1]: %v", err)
	}
}
