package gpu

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/operators/advantage"
	"github.com/trajflow/trajflow/schemas"
)

// Golden fixtures of the CPU reference trainer for the Python trainer
// (connectors/python, tests/test_parity.py): packed batches built from real
// rollouts of the built-in task, the initial checkpoint, and what
// Trainer.Step computes on them — statistics, the gradient before clipping,
// and the parameters after one and two steps.
//
// TestParityFixtures regenerates every file in memory and compares it with
// the committed one, so the fixtures cannot drift from the Go trainer.
// Rewrite them with
//
//	go test ./gpu -run TestParityFixtures -args -write-parity
var writeParity = flag.Bool("write-parity", false, "rewrite testdata/parity from the CPU reference trainer")

const parityDir = "../testdata/parity"

// parityCase is one fixture: a sampler, a model, a loss and an optimizer.
type parityCase struct {
	Name      string
	Model     model.Config
	Behavior  model.Behavior // Grammar is the registry's
	Objective objective.Options
	Adam      AdamOptions
	// Steps is 1 or 2; the second step is on the same batch (a second
	// epoch), where the ratio is no longer 1 and clipping engages.
	Steps int
	// RefSeed, when non-zero, adds reference log-probs from a model with
	// that seed (KL to a reference).
	RefSeed     uint64
	TokenBudget int
	// BehaviorSeed, when non-zero, makes the batch off-policy: the old
	// log-probs of its trained tokens are those of a model with that
	// seed, as if an older policy had sampled them (for the off-policy
	// corrections; the ratio before the first update is then not 1).
	BehaviorSeed uint64
}

func parityCases() []parityCase {
	small := model.Config{Vocab: 32, Window: 6, Embed: 8, Hidden: 16}
	return []parityCase{
		{
			Name: "demo-token-mean", Model: model.DefaultConfig(),
			Behavior: model.Behavior{Temperature: 1}, Objective: DefaultObjective(), Adam: DefaultAdam(),
			Steps: 2, TokenBudget: 256,
		},
		{
			Name: "seq-mean-token-sum-k3-loss", Model: small,
			Behavior: model.Behavior{Temperature: 0.8},
			Objective: objective.Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: objective.SeqMeanTokenSum,
				KLPlacement: objective.KLLoss, KLEstimator: objective.K3, KLCoef: 0.1, EntropyCoef: 0.02},
			Adam:  AdamOptions{LR: 0.02, Beta1: 0.9, Beta2: 0.99, Eps: 1e-8, WeightDecay: 0.01, MaxGradNorm: 0.5},
			Steps: 2, RefSeed: 7, TokenBudget: 96,
		},
		{
			Name: "seq-mean-token-mean-k1-clamp", Model: small,
			Behavior: model.Behavior{Temperature: 1},
			Objective: objective.Options{ClipLow: 0.1, ClipHigh: 0.1, Normalization: objective.SeqMeanTokenMean,
				KLPlacement: objective.KLLoss, KLEstimator: objective.K1, KLCoef: 0.05, EntropyCoef: 0.01, MaxLogRatio: 0.05},
			Adam:  AdamOptions{LR: 0.05, Beta1: 0.8, Beta2: 0.999, Eps: 1e-6},
			Steps: 2, RefSeed: 11, TokenBudget: 64,
		},
		{
			Name: "topk-topp-k2-reported", Model: small,
			Behavior: model.Behavior{Temperature: 0.9, TopK: 6, TopP: 0.95},
			Objective: objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean,
				KLPlacement: objective.KLNone, KLEstimator: objective.K2, EntropyCoef: 0.05},
			Adam:  AdamOptions{LR: 0.01, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, MaxGradNorm: 1},
			Steps: 1, RefSeed: 3, TokenBudget: 128,
		},
		{
			// Off-policy samples, the decoupled objective with a capped
			// importance weight: the proximal policy is the first step's.
			Name: "decoupled-is-cap-off-policy", Model: small,
			Behavior: model.Behavior{Temperature: 1},
			Objective: objective.Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: objective.TokenMean,
				KLPlacement: objective.KLNone, EntropyCoef: 0.02, MaxLogRatio: objective.DefaultMaxLogRatio,
				OffPolicy: objective.OffPolicyDecoupled, ISCap: 1.05},
			Adam:  AdamOptions{LR: 0.02, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, MaxGradNorm: 1},
			Steps: 2, TokenBudget: 96, BehaviorSeed: 13,
		},
		{
			// Off-policy samples, truncated importance sampling.
			Name: "tis-seq-mean-token-mean-off-policy", Model: small,
			Behavior: model.Behavior{Temperature: 0.9},
			Objective: objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.SeqMeanTokenMean,
				KLPlacement: objective.KLNone, EntropyCoef: 0.01, MaxLogRatio: objective.DefaultMaxLogRatio,
				OffPolicy: objective.OffPolicyTIS, ISCap: 1.1},
			Adam:  AdamOptions{LR: 0.02, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, MaxGradNorm: 1},
			Steps: 2, TokenBudget: 64, BehaviorSeed: 17,
		},
		{
			// The sequence-level ratio (GSPO's token form) with the KL to a
			// reference in the loss; the second step clips whole sequences.
			Name: "sequence-ratio-seq-mean-token-mean-k3", Model: small,
			Behavior: model.Behavior{Temperature: 1},
			Objective: objective.Options{ClipLow: 0.05, ClipHigh: 0.05, Normalization: objective.SeqMeanTokenMean,
				KLPlacement: objective.KLLoss, KLEstimator: objective.K3, KLCoef: 0.1, EntropyCoef: 0.02,
				MaxLogRatio: objective.DefaultMaxLogRatio, Ratio: objective.RatioSequence},
			Adam:  AdamOptions{LR: 0.05, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, MaxGradNorm: 1},
			Steps: 2, RefSeed: 23, TokenBudget: 96,
		},
		{
			// The demo's objective: token-sum over a declared constant,
			// off-policy samples under the decoupled objective.
			Name: "token-sum-decoupled-off-policy", Model: small,
			Behavior: model.Behavior{Temperature: 1},
			Objective: objective.Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: objective.TokenSum, NormTokens: 256,
				KLPlacement: objective.KLNone, EntropyCoef: 0.1, MaxLogRatio: objective.DefaultMaxLogRatio,
				OffPolicy: objective.OffPolicyDecoupled},
			Adam:  AdamOptions{LR: 0.01, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, MaxGradNorm: 1},
			Steps: 2, TokenBudget: 96, BehaviorSeed: 19,
		},
	}
}

// f32le is the little-endian IEEE 754 bytes of v: exact.
func f32le(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

// f32hex is f32le hex-encoded.
func f32hex(v []float32) string { return hex.EncodeToString(f32le(v)) }

type parityStep struct {
	Metrics Metrics `json:"metrics"`
	// GradFile holds the gradient of the loss before clipping (flat
	// parameter layout), ParamsFile the parameters after the step, both
	// as little-endian float32.
	GradFile   string `json:"grad_file"`
	ParamsFile string `json:"params_file"`
	// CurLogprobs are the current log-probs per row (aligned to targets,
	// 0 where there is no target) at the parameters before the step.
	CurLogprobs []string `json:"cur_logprobs_f32le"`
}

type parityFixture struct {
	Name      string            `json:"name"`
	Model     model.Config      `json:"model"`
	Behavior  model.Behavior    `json:"behavior"`
	Grammar   string            `json:"grammar"`
	Objective objective.Options `json:"objective"`
	Adam      AdamOptions       `json:"adam"`
	// OffPolicyBatch: the batch's old log-probs are another policy's
	// (parityCase.BehaviorSeed), so the ratio to the behavior policy is
	// not 1 at the first step.
	OffPolicyBatch bool         `json:"off_policy_batch,omitempty"`
	BatchFile      string       `json:"batch_file"`
	InitFile       string       `json:"init_file"`
	Steps          []parityStep `json:"steps"`
}

// buildParity returns the files of one case: name -> bytes.
func buildParity(t *testing.T, pc parityCase) map[string][]byte {
	t.Helper()
	cfg := smallLoop()
	cfg.Model = pc.Model
	cfg.ModelSeed = 5
	cfg.Settings.Behavior = pc.Behavior
	cfg.Pack.TokenBudget = pc.TokenBudget
	cfg.GroupSize, cfg.TasksPerStep = 4, 6
	cfg.Advantage.ZeroVariance = advantage.ZeroVarKeep
	h := newHarness(t, cfg)
	batch := batchFor(t, h, 0)
	if len(batch.Rows) < 2 {
		t.Fatalf("%s: %d rows, want a multi-row batch", pc.Name, len(batch.Rows))
	}
	if pc.RefSeed != 0 {
		ref, err := model.New(pc.Model, pc.RefSeed)
		if err != nil {
			t.Fatal(err)
		}
		for i := range batch.Rows {
			r := &batch.Rows[i]
			// The reference scores with temperature and grammar only:
			// its top-k/top-p sets would exclude sampled tokens.
			rb := model.Behavior{Temperature: pc.Behavior.Temperature, Grammar: h.tr.Behavior().Grammar}
			lp, err := ref.LogprobsForTraining(rb, r.InputIDs, r.PositionIDs, r.SegmentIDs)
			if err != nil {
				t.Fatal(err)
			}
			r.RefLogprobs = lp
		}
	}
	if pc.BehaviorSeed != 0 {
		old, err := model.New(pc.Model, pc.BehaviorSeed)
		if err != nil {
			t.Fatal(err)
		}
		for i := range batch.Rows {
			r := &batch.Rows[i]
			lp, err := old.LogprobsForTraining(h.tr.Behavior(), r.InputIDs, r.PositionIDs, r.SegmentIDs)
			if err != nil {
				t.Fatal(err)
			}
			for j, m := range r.ActionMask {
				if m == 1 {
					r.OldLogprobs[j] = lp[j]
				}
			}
		}
	}
	batchBytes, err := schemas.PackedBatches.Encode(nil, batch)
	if err != nil {
		t.Fatal(err)
	}
	// Train on what the wire carries.
	if batch, err = schemas.PackedBatches.Decode(nil, batchBytes); err != nil {
		t.Fatal(err)
	}
	init := h.tr.Model()
	initBytes, err := init.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	fx := parityFixture{
		Name: pc.Name, Model: pc.Model, Behavior: h.tr.Behavior(), Grammar: h.tr.Behavior().Grammar.ID(),
		Objective: pc.Objective, Adam: pc.Adam, OffPolicyBatch: pc.BehaviorSeed != 0, BatchFile: "batch.arrows", InitFile: "init.ckpt",
	}
	files := map[string][]byte{"batch.arrows": batchBytes, "init.ckpt": initBytes}
	for s := 0; s < pc.Steps; s++ {
		var cur []string
		for i := range batch.Rows {
			r := &batch.Rows[i]
			lp, err := h.tr.m.LogprobsForTraining(h.tr.Behavior(), r.InputIDs, r.PositionIDs, r.SegmentIDs)
			if err != nil {
				t.Fatal(err)
			}
			cur = append(cur, f32hex(lp))
		}
		met, err := h.tr.Step(batch, pc.Objective, pc.Adam)
		if err != nil {
			t.Fatalf("%s step %d: %v", pc.Name, s, err)
		}
		if s == 0 && (pc.BehaviorSeed == 0 || pc.Objective.OffPolicy == objective.OffPolicyDecoupled) && (met.RatioMin != 1 || met.RatioMax != 1) {
			t.Fatalf("%s: ratio [%v, %v] before the first update, want exactly 1", pc.Name, met.RatioMin, met.RatioMax)
		}
		gf, pf := fmt.Sprintf("step%d.grad.f32", s+1), fmt.Sprintf("step%d.params.f32", s+1)
		files[gf], files[pf] = f32le(h.tr.grad), f32le(h.tr.m.Params)
		fx.Steps = append(fx.Steps, parityStep{Metrics: met, GradFile: gf, ParamsFile: pf, CurLogprobs: cur})
	}
	js, err := json.MarshalIndent(fx, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	files["expected.json"] = append(js, '\n')
	return files
}

func TestParityFixtures(t *testing.T) {
	for _, pc := range parityCases() {
		t.Run(pc.Name, func(t *testing.T) {
			files := buildParity(t, pc)
			dir := filepath.Join(parityDir, pc.Name)
			for name, want := range files {
				path := filepath.Join(dir, name)
				if *writeParity {
					if err := os.MkdirAll(dir, 0o755); err != nil {
						t.Fatal(err)
					}
					if err := os.WriteFile(path, want, 0o644); err != nil {
						t.Fatal(err)
					}
					continue
				}
				got, err := os.ReadFile(path)
				if err != nil {
					t.Fatalf("%v (regenerate: go test ./gpu -run TestParityFixtures -args -write-parity)", err)
				}
				if !bytes.Equal(got, want) {
					t.Errorf("%s differs from what the CPU reference trainer computes now (%d vs %d bytes); "+
						"regenerate with go test ./gpu -run TestParityFixtures -args -write-parity", path, len(got), len(want))
				}
			}
		})
	}
}
