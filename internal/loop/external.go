package loop

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/operators"
)

// Trainers of Options.Trainer.
const (
	TrainerBuiltin  = "builtin"  // the Go train stage in the loop (default)
	TrainerExternal = "external" // a trainer outside the loop (python -m trajflow.train)
)

// TrainerFile is the file in the output directory that tells an external
// trainer where the run is (written once the run's topics exist).
const TrainerFile = "trainer.json"

// ContractFile is the run's resolved contract in the output directory
// (with an external trainer: its --contract).
const ContractFile = "contract.yaml"

// InitialCheckpointFile is the built-in policy's version 0 in the output
// directory (with an external trainer: its --init-checkpoint).
const InitialCheckpointFile = "initial.ckpt"

// TrainerInfo is OUT/trainer.json: the arguments of the external trainer.
type TrainerInfo struct {
	Brokers  []string `json:"brokers"`
	RunID    string   `json:"run_id"`
	Group    string   `json:"group"`    // the consumer group of the batches topic (the train stage's)
	Batches  string   `json:"batches"`  // the topic it consumes
	Policy   string   `json:"policy"`   // the compacted topic it publishes releases on
	Releases string   `json:"releases"` // the release directory (the loop reads update records there)
	Contract string   `json:"contract"` // the resolved contract
	Updates  int      `json:"updates"`  // releases after release 0 the run waits for
	// InitCheckpoint is the built-in policy's version 0, the model the
	// hidden eval measured at the start (the trainer's --init-checkpoint;
	// empty for a language model, whose version 0 is its GGUF file).
	InitCheckpoint string `json:"init_checkpoint,omitempty"`
	// Command is `python -m trajflow.train` with these arguments (for the
	// built-in policy; a language model adds --model gguf:PATH instead of
	// --init-checkpoint).
	Command []string `json:"command"`
}

// external reports whether the run's trainer runs outside the loop.
func (o Options) external() bool { return o.Trainer == TrainerExternal }

// writeTrainerInfo writes the resolved contract and OUT/trainer.json when
// the trainer is external, and prints the trainer's command line.
func (r *runner) writeTrainerInfo() error {
	if !r.o.external() {
		return nil
	}
	y, err := r.c.YAML()
	if err != nil {
		return fmt.Errorf("demo: resolved contract: %w", err)
	}
	cp, err := filepath.Abs(filepath.Join(r.o.Out, ContractFile))
	if err != nil {
		return err
	}
	if err := writeFileAtomic(cp, y); err != nil {
		return fmt.Errorf("demo: resolved contract: %w", err)
	}
	rel, err := filepath.Abs(r.deps.ReleaseDir)
	if err != nil {
		return err
	}
	info := TrainerInfo{Brokers: r.brokers, RunID: r.c.RunID, Group: r.c.RunID + ".train", Batches: r.topics.Batches,
		Policy: r.topics.Policy, Releases: rel, Contract: cp, Updates: r.o.Updates}
	info.Command = []string{"python", "-m", "trajflow.train", "--brokers", strings.Join(r.brokers, ","), "--run", info.RunID,
		"--releases", rel, "--contract", cp}
	if r.o.Updates > 0 {
		// The trainer stops by itself after the run's updates (or with
		// SIGTERM / Ctrl-C, also when a round trained nothing).
		info.Command = append(info.Command, "--max-updates", strconv.Itoa(r.o.Updates))
	}
	if r.o.Tasks != TasksText {
		// The Python trainer draws other initial weights than the Go
		// trainer's (gpu.InitialModel): it is given these, so that release
		// 0 is the policy the hidden eval measured.
		mc, seed := operators.ModelConfig(r.c)
		m0, err := gpu.InitialModel(mc, seed)
		if err != nil {
			return err
		}
		b, err := m0.Bytes()
		if err != nil {
			return err
		}
		info.InitCheckpoint = filepath.Join(filepath.Dir(cp), InitialCheckpointFile)
		if err := writeFileAtomic(info.InitCheckpoint, b); err != nil {
			return fmt.Errorf("demo: initial checkpoint: %w", err)
		}
		info.Command = append(info.Command, "--init-checkpoint", info.InitCheckpoint)
	}
	b, err := json.MarshalIndent(info, "", "  ")
	if err != nil {
		return err
	}
	if err := writeFileAtomic(filepath.Join(r.o.Out, TrainerFile), append(b, '\n')); err != nil {
		return fmt.Errorf("demo: %s: %w", TrainerFile, err)
	}
	if !r.o.Quiet {
		tj, err := filepath.Abs(filepath.Join(r.o.Out, TrainerFile))
		if err != nil {
			return err
		}
		fmt.Fprintf(r.stdout, "external trainer: waiting for its releases on %s; run it with (python: the one connectors/python/setup.sh prints)\n"+
			"  python -m trajflow.train --from %s\nor, the same arguments written out:\n  %s\n",
			info.Policy, tj, strings.Join(info.Command, " "))
	}
	return nil
}

// writeFileAtomic writes b to path through a temporary file and a rename,
// so a reader polling for path never sees it half written.
func writeFileAtomic(path string, b []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
