package pipeline

import (
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"

	"github.com/trajflow/trajflow/schemas"
)

// Planes of a topic's records.
const (
	PlaneArrow = "arrow" // one self-describing Arrow IPC stream per record
	PlaneJSON  = "json"  // one JSON document {"kind","version","data"} per record
	PlaneRaw   = "raw"   // the refused record's key, bytes and headers as they were
)

// TopicInfo is one row of the topology: a topic of a run, what it
// carries, how it is laid out, and which stages produce, consume, follow
// and read it back.
type TopicInfo struct {
	Short string       // short name; the topic is "<run>.<short>"
	Kind  schemas.Kind // record kind ("" for quarantine: any)
	Plane string       // PlaneArrow, PlaneJSON or PlaneRaw
	// Partitions is the fixed partition count, or 0 for the contract's
	// topics.partitions (topics whose order is one sequence per run have
	// one partition).
	Partitions int
	// Compacted topics keep the latest record per key forever (no
	// retention).
	Compacted bool
	// Key is what records are keyed by.
	Key string
	// Producers produce to the topic; Consumers consume it in their
	// consumer group (offsets committed); Side follow it as a side input
	// (SideInputs: tailed from the start, nothing committed); Scanned read
	// its tail back at start to rebuild their state.
	Producers, Consumers, Side, Scanned []string
	Doc                                 string
}

// stagesThatRefuse are the stages whose refusals and census events reach
// the quarantine and census topics.
var stagesThatRefuse = []string{"dispatch", "rollout", "validate", "reward", "advantage", "pack", "train"}

// topology is the one table every topic-related list derives from: topic
// creation (operators.TopicSpecs), TopicsFor, each stage's Topics and
// SideTopics, the snapshot's kinds, `trajflow schemas` and
// docs/TOPOLOGY.md.
var topology = []TopicInfo{
	{Short: "tasks", Kind: schemas.KindTaskAttempt, Plane: PlaneArrow, Key: "group id (partition: the group's index modulo the partitions, dealt out in turn)",
		Producers: []string{"dispatch"}, Consumers: []string{"rollout"}, Scanned: []string{"dispatch"},
		Doc: "one message per group of attempts of a round (header trajflow-round)"},
	{Short: "trajectories", Kind: schemas.KindTrajectory, Plane: PlaneArrow, Key: "group id",
		Producers: []string{"rollout"}, Consumers: []string{"validate"},
		Doc: "the finalized event logs of a group's episodes"},
	{Short: "valid", Kind: schemas.KindTrajectory, Plane: PlaneArrow, Key: "group id",
		Producers: []string{"validate"}, Consumers: []string{"reward"},
		Doc: "trajectories that passed validation (refused members declared in trajflow-absent-members)"},
	{Short: "rewarded", Kind: schemas.KindRewarded, Plane: PlaneArrow, Key: "group id",
		Producers: []string{"reward"}, Consumers: []string{"advantage"},
		Doc: "trajectories with their separately kept reward components"},
	{Short: "scored", Kind: schemas.KindScored, Plane: PlaneArrow, Partitions: 1, Key: "group id",
		Producers: []string{"advantage"}, Consumers: []string{"pack"}, Scanned: []string{"advantage"},
		Doc: "whole groups with returns and advantages; one partition: the pack window is one per run"},
	{Short: "batches", Kind: schemas.KindPackedBatch, Plane: PlaneArrow, Partitions: 1, Key: "batch id",
		Producers: []string{"pack"}, Consumers: []string{"train"}, Scanned: []string{"pack", "train"},
		Doc: "packed training batches; batch indexes are one sequence per run"},
	{Short: "quarantine", Plane: PlaneRaw, Key: "the refused record's key",
		Producers: append(slices.Clone(stagesThatRefuse), "weightsync"),
		Doc:       "every refused record as it was, with trajflow-reason, -detail, -stage and its source coordinates"},
	{Short: "census", Kind: schemas.KindCensusEvent, Plane: PlaneJSON, Key: "attempt id",
		Producers: stagesThatRefuse, Consumers: []string{"gate", "pack"},
		Doc: "the life of every attempt: dispatched, started, completed, failed, quarantined, filtered, admitted, trained"},
	{Short: "incidents", Kind: schemas.KindIncident, Plane: PlaneJSON, Partitions: 1, Key: "attempt id",
		Producers: []string{"dispatch", "rollout", "validate", "pack", "train"}, Side: []string{"gate"},
		Doc: "safety and integrity incidents"},
	{Short: "policy", Kind: schemas.KindPolicyRelease, Plane: PlaneJSON, Partitions: 1, Compacted: true, Key: "run id",
		Producers: []string{"train"}, Consumers: []string{"dispatch", "pack", "weightsync", "eval"}, Side: []string{"rollout"},
		Scanned: []string{"dispatch", "train"},
		Doc:     "policy release manifests (compacted: the latest release per key)"},
	{Short: "windows", Kind: schemas.KindWindowRecord, Plane: PlaneJSON, Partitions: 1, Key: "run id",
		Producers: []string{"pack"}, Consumers: []string{"dispatch"}, Scanned: []string{"dispatch", "pack"},
		Doc: "pack's window decisions: lineage for replay, round completion for dispatch"},
	{Short: "weights", Kind: schemas.KindWeightAck, Plane: PlaneJSON, Partitions: 1, Compacted: true, Key: "replica",
		Producers: []string{"weightsync"}, Side: []string{"rollout"},
		Doc: "policy server replicas' acknowledgements of releases, the version each serves: rollout routes a group only to replicas serving its version (compacted: the latest per replica)"},
	{Short: "decisions", Kind: schemas.KindGateDecision, Plane: PlaneJSON, Partitions: 1, Key: "run id",
		Producers: []string{"gate", "dispatch"}, Consumers: []string{"dispatch", "train"}, Scanned: []string{"dispatch", "gate"},
		Doc: "the gate's decision on every release (promote, continue, rollback, stop) with its evidence; dispatch's acknowledgement of a stop (halted); a rollback makes the trainer publish the promoted release's parameters as the next version"},
	{Short: "evaluations", Kind: schemas.KindEvaluation, Plane: PlaneJSON, Partitions: 1, Key: "run id",
		Producers: []string{"eval"}, Consumers: []string{"gate"},
		Doc: "the eval operator's measurement of every release, in release order: KL to the reference on every release, every suite with confidence intervals on release 0 and every dispatch.eval_every-th; the gate decides on it"},
}

// Topology returns the topology table, in pipeline order.
func Topology() []TopicInfo {
	out := make([]TopicInfo, len(topology))
	copy(out, topology)
	return out
}

// TopicInfoOf returns the row of a short topic name.
func TopicInfoOf(short string) (TopicInfo, bool) {
	for _, t := range topology {
		if t.Short == short {
			return t, true
		}
	}
	return TopicInfo{}, false
}

func shortsWhere(pick func(TopicInfo) []string, stage string) []string {
	var out []string
	for _, t := range topology {
		if slices.Contains(pick(t), stage) {
			out = append(out, t.Short)
		}
	}
	return out
}

// InputsOf lists the short names of the topics stage consumes in its
// consumer group. The snapshot stage consumes every topic.
func InputsOf(stage string) []string {
	if stage == SnapshotStage {
		out := make([]string, len(topology))
		for i, t := range topology {
			out[i] = t.Short
		}
		return out
	}
	return shortsWhere(func(t TopicInfo) []string { return t.Consumers }, stage)
}

// SnapshotStage is the stage that consumes every topic of a run (Parquet
// snapshots).
const SnapshotStage = "snapshot"

// SideInputsOf lists the short names of the topics stage follows as side
// inputs.
func SideInputsOf(stage string) []string {
	return shortsWhere(func(t TopicInfo) []string { return t.Side }, stage)
}

// OutputsOf lists the short names of the topics stage produces to.
func OutputsOf(stage string) []string {
	return shortsWhere(func(t TopicInfo) []string { return t.Producers }, stage)
}

// Topics names every topic of one run ("<run>.<short>"), with a field per
// topic for the stages' convenience.
type Topics struct {
	Tasks        string
	Trajectories string
	Valid        string
	Rewarded     string
	Scored       string
	Batches      string
	Quarantine   string
	Census       string
	Incidents    string
	Policy       string // compacted: policy release manifests
	Windows      string // pack window decisions (lineage for replay)
	Weights      string // policy server replicas' acknowledgements of releases
	Decisions    string // the gate's decisions, dispatch's halt
	Evaluations  string // the eval operator's measurement of every release

	prefix string
}

var runRe = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}$`)

// TopicsFor returns the topic names of run ("<run>.<topic>").
func TopicsFor(run string) (Topics, error) {
	if !runRe.MatchString(run) {
		return Topics{}, fmt.Errorf("pipeline: run id %q: want letters, digits, '.', '_' or '-' (at most 128)", run)
	}
	p := run + "."
	t := Topics{prefix: p}
	for _, info := range topology {
		*t.field(info.Short) = p + info.Short
	}
	return t, nil
}

// field is the Topics field of a short name.
func (t *Topics) field(short string) *string {
	switch short {
	case "tasks":
		return &t.Tasks
	case "trajectories":
		return &t.Trajectories
	case "valid":
		return &t.Valid
	case "rewarded":
		return &t.Rewarded
	case "scored":
		return &t.Scored
	case "batches":
		return &t.Batches
	case "quarantine":
		return &t.Quarantine
	case "census":
		return &t.Census
	case "incidents":
		return &t.Incidents
	case "policy":
		return &t.Policy
	case "windows":
		return &t.Windows
	case "weights":
		return &t.Weights
	case "decisions":
		return &t.Decisions
	case "evaluations":
		return &t.Evaluations
	}
	panic("pipeline: topic " + short + " is not in the topology")
}

// Name returns the full name of a short topic name of the topology.
func (t Topics) Name(short string) string { return *t.field(short) }

// Names returns the full names of short topic names.
func (t Topics) Names(shorts []string) []string {
	out := make([]string, len(shorts))
	for i, s := range shorts {
		out[i] = t.Name(s)
	}
	return out
}

// Short returns the short name of a full topic name of this run ("" if it
// is not one).
func (t Topics) Short(full string) string {
	for _, info := range topology {
		if t.Name(info.Short) == full {
			return info.Short
		}
	}
	return ""
}

// All lists every topic, in topology order.
func (t Topics) All() []string {
	out := make([]string, len(topology))
	for i, info := range topology {
		out[i] = t.Name(info.Short)
	}
	return out
}

// DataPlane lists the topics that carry Arrow IPC streams.
func (t Topics) DataPlane() []string {
	var out []string
	for _, info := range topology {
		if info.Plane == PlaneArrow {
			out = append(out, t.Name(info.Short))
		}
	}
	return out
}

// KindOf is the record kind carried by a full topic name of this run (""
// for quarantine or an unknown topic).
func (t Topics) KindOf(full string) schemas.Kind {
	if info, ok := TopicInfoOf(t.Short(full)); ok {
		return info.Kind
	}
	return ""
}

// WriteTopologyDoc writes docs/TOPOLOGY.md: the topology table in
// Markdown, generated from the table itself (a test keeps the file
// current).
func WriteTopologyDoc(w io.Writer) error {
	var b strings.Builder
	b.WriteString("# Topology\n\n")
	b.WriteString("Every topic of a run, generated from the topology table (`pipeline.Topology`) by\n")
	b.WriteString("`go test ./pipeline -run TestTopologyDoc -update`; a test fails when this file is stale.\n")
	b.WriteString("Topics are named `<run>.<topic>`. Partitions \"contract\" means `topics.partitions` of the learning\n")
	b.WriteString("contract. Consumed topics are read in the stage's consumer group (offsets committed after every\n")
	b.WriteString("output derived from a record is acknowledged); side inputs are followed from the first offset\n")
	b.WriteString("without committing; read-back topics are scanned at start to rebuild a stage's state.\n\n")
	b.WriteString("| topic | kind | version | plane | partitions | key | produced by | consumed by | side input of | read back by |\n")
	b.WriteString("|---|---|---:|---|---|---|---|---|---|---|\n")
	for _, t := range topology {
		kind, version := "any", "-"
		if t.Kind != "" {
			kind, version = "`"+string(t.Kind)+"`", fmt.Sprint(schemas.Versions[t.Kind])
		}
		parts := "contract"
		if t.Partitions > 0 {
			parts = fmt.Sprint(t.Partitions)
		}
		if t.Compacted {
			parts += ", compacted"
		}
		list := func(s []string) string {
			if len(s) == 0 {
				return "-"
			}
			return strings.Join(s, ", ")
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", t.Short, kind, version, t.Plane, parts, t.Key,
			list(t.Producers), list(t.Consumers), list(t.Side), list(t.Scanned))
	}
	b.WriteString("\nThe snapshot stage (`trajflow run snapshot`) consumes every topic in a consumer group of its own.\n\n")
	for _, t := range topology {
		fmt.Fprintf(&b, "- **%s**: %s.\n", t.Short, t.Doc)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
