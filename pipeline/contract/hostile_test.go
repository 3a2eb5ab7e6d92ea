package contract

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/gpu/objective"
)

// TestLoadRefusesWhatIsNotAContractFile: Load reads only a regular file of
// at most MaxFileSize bytes, and refuses a directory, a named pipe (which
// would block Load forever without a writer), a device (/dev/zero would be
// read until memory runs out) and a larger file, quickly and naming the
// path. A symbolic link to a contract is read.
func TestLoadRefusesWhatIsNotAContractFile(t *testing.T) {
	tmp := t.TempDir()
	fifo := filepath.Join(tmp, "fifo.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(tmp, "big.yaml")
	if err := os.WriteFile(big, append(readFile(t, "minimal.yaml"), "#"+strings.Repeat("x", MaxFileSize)+"\n"...), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(tmp, "link.yaml")
	abs, err := filepath.Abs(filepath.Join(dir, "minimal.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(abs, link); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, path, want string
	}{
		{"directory", tmp, "a directory"},
		{"named pipe", fifo, "a named pipe"},
		{"device", "/dev/zero", "a device"},
		{"too large", big, "larger than 1048576"},
		{"missing", filepath.Join(tmp, "absent.yaml"), "no such file"},
		{"symlink to a contract", link, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := os.Stat(tt.path); err != nil && tt.want != "no such file" {
				t.Skip(err)
			}
			done := make(chan error, 1)
			go func() { _, err := Load(tt.path); done <- err }()
			select {
			case err := <-done:
				switch {
				case tt.want == "" && err != nil:
					t.Fatalf("Load(%s): %v", tt.path, err)
				case tt.want == "":
				case err == nil:
					t.Fatalf("Load(%s) accepted it", tt.path)
				case !strings.Contains(err.Error(), tt.path) || !strings.Contains(err.Error(), tt.want):
					t.Errorf("Load(%s): %q, want the path and %q", tt.path, err, tt.want)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("Load(%s) still reading after 10 s", tt.path)
			}
		})
	}
}

// numericLeaves lists the key path of every number of the contract (maps
// and lists of numbers aside) with its kind, through rewards[0].
func numericLeaves(t reflect.Type, path string, out map[string]reflect.Kind) {
	for _, f := range fieldsOf(t).list {
		p := join(path, f.name)
		ft := t.FieldByIndex(f.index).Type
		switch {
		case ft == floorType || ft == stopRuleType:
		case ft.Kind() == reflect.Struct:
			numericLeaves(ft, p, out)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct && ft.Elem() != stopRuleType:
			numericLeaves(ft.Elem(), p+"[0]", out)
		case ft.Kind() == reflect.Float64, ft.Kind() == reflect.Int, ft.Kind() == reflect.Int32, ft.Kind() == reflect.Int64:
			out[p] = ft.Kind()
		}
	}
}

// TestEveryNumberRefusesNonFinite: NaN, ±Inf and numbers beyond a float64
// (±1e400, which the YAML library takes for strings) are refused in every
// numeric key, by Parse or Resolve, with an error that names the key path
// and says a float must be finite ("must be finite, got NaN") or an
// integer is out of range.
func TestEveryNumberRefusesNonFinite(t *testing.T) {
	leaves := map[string]reflect.Kind{}
	numericLeaves(reflect.TypeFor[Contract](), "", leaves)
	if len(leaves) < 50 {
		t.Fatalf("only %d numeric keys found", len(leaves))
	}
	finiteGot := map[string]string{".nan": "NaN", ".inf": "+Inf", "-.inf": "-Inf", "1e400": "1e400", "-1e400": "-1e400"}
	for p, kind := range leaves {
		for _, lit := range []string{".nan", ".inf", "-.inf", "1e400", "-1e400"} {
			doc := strings.Replace(string(mutate(t, "demo.yaml", p, "MARK")), "MARK", lit, 1)
			c, err := Parse([]byte(doc))
			if err == nil {
				err = c.Resolve()
			}
			switch {
			case err == nil:
				t.Errorf("%s: %s accepted", p, lit)
			case !strings.Contains(err.Error(), p+": "):
				t.Errorf("%s: %s: error does not name the key: %v", p, lit, err)
			case kind == reflect.Float64 && !strings.Contains(err.Error(), p+": must be finite, got "+finiteGot[lit]):
				t.Errorf("%s: %s: %v, want must be finite", p, lit, err)
			case kind != reflect.Float64 && strings.HasSuffix(lit, "e400") && !strings.Contains(err.Error(), p+": integer "+lit+" out of range"):
				t.Errorf("%s: %s: %v, want out of range", p, lit, err)
			}
		}
	}
}

// TestIntegerLiterals: an integer key takes exactly the integer written,
// or refuses it: no literal is rounded or wrapped into another value.
func TestIntegerLiterals(t *testing.T) {
	tests := []struct {
		lit  string
		want int64  // when err is ""
		err  string // substring of the error
	}{
		{"7", 7, ""},
		{"0x1F", 31, ""},
		{"1_000", 1000, ""},
		{"2.0e9", 2_000_000_000, ""},
		{"-9223372036854775808", math.MinInt64, ""},
		{"9007199254740993.0", 9007199254740993, ""}, // a float64 would be ...992
		{"9223372036854775808", 0, "seed: integer 9223372036854775808 out of range for int64"},
		{"-9223372036854775809", 0, "seed: integer -9223372036854775809 out of range for int64"}, // a float64 would be MinInt64
		{"1.8e19", 0, "seed: integer 1.8e19 out of range for int64"},
		{"1e999999999", 0, "seed: integer 1e999999999 out of range for int64"},
		{"1.00000000000000001", 0, `seed: want an integer, got float "1.00000000000000001"`}, // a float64 would be 1
		{"2.5", 0, `seed: want an integer, got float "2.5"`},
		{"1e-400", 0, `seed: want an integer`},
		{`"7"`, 0, `seed: want an integer, got str "7"`},
		{"!!int abc", 0, `seed: want an integer, got int "abc"`},
	}
	for _, tt := range tests {
		t.Run(tt.lit, func(t *testing.T) {
			c, err := Parse([]byte("seed: " + tt.lit + "\n"))
			switch {
			case tt.err == "" && err != nil:
				t.Fatalf("Parse: %v", err)
			case tt.err == "" && c.Seed != tt.want:
				t.Fatalf("seed %d, want %d", c.Seed, tt.want)
			case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
				t.Fatalf("Parse: %v, want %q", err, tt.err)
			}
		})
	}
	// An int32 key: the range is the field's.
	if _, err := Parse([]byte("sampler: {stop_token_ids: [3.0e9]}\n")); err == nil || !strings.Contains(err.Error(), "sampler.stop_token_ids[0]: integer 3.0e9 out of range for int32") {
		t.Errorf("int32 overflow: %v", err)
	}
}

// TestBounds: counts, timeouts and Kafka settings beyond what the
// operators can represent are refused (a group_size of 2^32+16 would be
// recorded as 16, a max_lag of 2^63-1 wraps (max_lag+1)·batch_groups
// negative, a timeout of 2^63-1 ms wraps time.Duration negative: an
// expired timeout), and the largest legal values pass.
func TestBounds(t *testing.T) {
	max64 := int64(math.MaxInt64)
	refused := []struct {
		name  string
		edits []any
		want  string
	}{
		{"group size beyond int32", []any{"sampler.group_size", int64(1<<32 + 16)}, "sampler.group_size: must be <= 2147483647, got 4294967312"},
		{"max turns", []any{"sampler.max_turns", max64}, "sampler.max_turns: must be <= 2147483647"},
		{"top k", []any{"sampler.top_k", int64(1 << 31)}, "sampler.top_k: must be <= 2147483647"},
		{"tokens per action", []any{"sampler.max_tokens_per_action", int64(1 << 40), "sampler.max_tokens_per_episode", int64(1 << 41)}, "sampler.max_tokens_per_action: must be <= 2147483647"},
		{"tool retries", []any{"sampler.tool_retries", max64}, "sampler.tool_retries: must be <= 2147483647"},
		{"max lag", []any{"packing.max_lag", max64}, "packing.max_lag: must be <= 2147483647"},
		{"batch groups", []any{"packing.batch_groups", int64(1 << 31)}, "packing.batch_groups: must be <= 2147483647"},
		{"epochs", []any{"loss.optimizer.epochs", int64(1 << 31)}, "loss.optimizer.epochs: must be <= 2147483647"},
		{"minibatches", []any{"loss.optimizer.minibatches", int64(1 << 31)}, "loss.optimizer.minibatches: must be <= 2147483647"},
		{"groups per update", []any{"dispatch.groups_per_update", int64(1 << 32)}, "dispatch.groups_per_update: must be <= 2147483647"},
		{"eval every", []any{"dispatch.eval_every", int64(1 << 31)}, "dispatch.eval_every: must be <= 2147483647"},
		{"partitions", []any{"topics.partitions", int64(1 << 31)}, "topics.partitions: must be <= 2147483647"},
		{"replication", []any{"topics.replication", 32768}, "topics.replication: must be <= 32767"},
		{"message bytes", []any{"topics.max_message_bytes", math.MaxInt32}, "topics.max_message_bytes: must be <= 1073741824"},
		{"tool timeout", []any{"sampler.tool_timeout_ms", max64}, "sampler.tool_timeout_ms: must be <= 9223372036854"},
		{"policy timeout", []any{"policy.timeout_ms", max64}, "policy.timeout_ms: must be <= 9223372036854"},
		{"group timeout", []any{"policy.timeout_ms", int64(9e12)}, "policy.timeout_ms: a group's timeout, (sampler.tool_timeout_ms 5000 + policy.timeout_ms 9000000000000) × sampler.max_turns 4"},
		{"policy retries", []any{"policy.retries", max64}, "policy.retries: must be <= 2147483647"},
		{"policy concurrency", []any{"policy.concurrency", max64}, "policy.concurrency: must be <= 2147483647"},
		{"tool latency", []any{"latency.tool_median_ms", 1e15}, "latency.tool_median_ms: must be <= 3600000"},
		{"token latency", []any{"latency.token_median_ms", 3600001}, "latency.token_median_ms: must be <= 3600000"},
	}
	for _, tt := range refused {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse(mutate(t, "demo.yaml", tt.edits...))
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Resolve(); err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Resolve: %v, want %q", err, tt.want)
			}
		})
	}
	accepted := [][]any{
		{"sampler.group_size", MaxCount, "dispatch.groups_per_update", MaxCount, "dispatch.tasks_per_update", 1},
		{"packing.max_lag", MaxCount, "packing.batch_groups", MaxCount, "topics.partitions", MaxCount},
		{"topics.replication", 32767, "topics.max_message_bytes", 1 << 30},
		{"sampler.tool_timeout_ms", MaxDurationMS/4 - 60_000, "sampler.max_turns", 4, "policy.timeout_ms", 60_000,
			"policy.protocol", "vllm", "policy.endpoints", []any{"http://127.0.0.1:1"}, "dispatch.eval_every", deleteKey{}},
		{"latency.tool_median_ms", MaxLatencyMedianMS, "latency.tool_sigma", 3, "latency.token_median_ms", MaxLatencyMedianMS, "latency.token_sigma", 3},
	}
	for i, edits := range accepted {
		t.Run("accepted "+strconv.Itoa(i), func(t *testing.T) { mustResolve(t, mutate(t, "demo.yaml", edits...)) })
	}
}

// TestKLEstimators: with kl_placement loss every estimator resolves, with
// its coefficient (the trainer computes the reference log-probs); written
// with placement none, the estimator is refused where it is written
// (TestConditionalKeys), and left out it is the default k3. A truncating
// sampler is refused with the placement: a sampled token the reference's
// top-k or nucleus leaves out would have an infinite KL.
func TestKLEstimators(t *testing.T) {
	for _, k := range []string{"k1", "k2", "k3"} {
		c := mustResolve(t, mutate(t, "demo.yaml", "loss.kl_placement", "loss", "loss.kl_coef", 0.05, "loss.kl_estimator", k))
		if c.Loss.KLPlacement != objective.KLLoss || c.Loss.KLEstimator != k || c.Loss.KLCoef != 0.05 {
			t.Errorf("kl_estimator %s: resolved %q, %q, %v", k, c.Loss.KLPlacement, c.Loss.KLEstimator, c.Loss.KLCoef)
		}
		c, err := Parse(mutate(t, "demo.yaml", "loss.kl_estimator", k))
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Resolve(); err == nil || !strings.Contains(err.Error(), "loss.kl_estimator: applies only with loss.kl_placement loss") {
			t.Errorf("kl_estimator %s with placement none: %v", k, err)
		}
	}
	for _, trunc := range [][]any{{"sampler.top_k", 4}, {"sampler.top_p", 0.9}, {"sampler.min_p", 0.05}} {
		c, err := Parse(mutate(t, "demo.yaml", append([]any{"loss.kl_placement", "loss", "loss.kl_coef", 0.05}, trunc...)...))
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Resolve(); err == nil || !strings.Contains(err.Error(), "loss.kl_placement: loss with a truncating sampler") {
			t.Errorf("kl in the loss with %v: %v", trunc, err)
		}
	}
	if c := mustResolve(t, mutate(t, "demo.yaml", "loss.kl_placement", "loss", "loss.kl_coef", 0.05)); c.Loss.KLEstimator != objective.K3 {
		t.Errorf("kl_estimator left out: %q, want the default k3", c.Loss.KLEstimator)
	}
}

// TestErrorsAreCapped: a document of many problems reports MaxErrors of
// them and the count of the rest, not one line per problem.
func TestErrorsAreCapped(t *testing.T) {
	var b strings.Builder
	for i := range 1000 {
		b.WriteString("k" + strconv.Itoa(i) + ": 1\n")
	}
	_, err := Parse([]byte(b.String()))
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("err = %v", err)
	}
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Path != "k0" {
		t.Errorf("first problem %v, want k0", fe)
	}
	msg := err.Error()
	if n := strings.Count(msg, ": unknown key"); n != MaxErrors {
		t.Errorf("%d problems shown, want %d", n, MaxErrors)
	}
	if !strings.HasSuffix(msg, "950 more problems not shown") || len(msg) > 20_000 {
		t.Errorf("error of %d bytes ends %q", len(msg), msg[max(0, len(msg)-80):])
	}
}

// TestRatioLevel: loss.ratio sequence resolves, prints and changes the
// hash; the token level, written out or left out, is the same contract
// with the hash it had before the key existed (the key is left out of the
// hash and of the printed contract at its default); an unknown level, or
// the sequence level with an off-policy correction, is refused.
func TestRatioLevel(t *testing.T) {
	def := mustResolve(t, readFile(t, "demo.yaml"))
	tok := mustResolve(t, mutate(t, "demo.yaml", "loss.ratio", "token"))
	if tok.Hash() != def.Hash() || tok.Loss.Ratio != "" {
		t.Errorf("ratio token written out: hash %s, ratio %q; want the default's %s", tok.Hash(), tok.Loss.Ratio, def.Hash())
	}
	y, err := def.YAML()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(y), "\n  ratio:") {
		t.Errorf("the default ratio is printed:\n%s", y)
	}
	seq := mustResolve(t, mutate(t, "demo.yaml", "loss.ratio", "sequence", "loss.off_policy", "none"))
	if seq.Hash() == def.Hash() || !seq.Loss.SequenceRatio() {
		t.Errorf("ratio sequence: hash %s (default %s), ratio %q", seq.Hash(), def.Hash(), seq.Loss.Ratio)
	}
	y, err = seq.YAML()
	if err != nil {
		t.Fatal(err)
	}
	back := mustResolve(t, y)
	if !strings.Contains(string(y), "  ratio: sequence\n") || back.Hash() != seq.Hash() {
		t.Errorf("ratio sequence prints and reads back to hash %s, want %s:\n%s", back.Hash(), seq.Hash(), y)
	}
	for _, tc := range []struct {
		edits []any
		want  string
	}{
		{[]any{"loss.ratio", "seq"}, "loss.ratio: must be one of token, sequence"},
		{[]any{"loss.ratio", "sequence"}, `loss.ratio: "sequence" with loss.off_policy decoupled is not implemented`},
	} {
		c, err := Parse(mutate(t, "demo.yaml", tc.edits...))
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Resolve(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.edits, err, tc.want)
		}
	}
}
