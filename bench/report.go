package bench

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"runtime/metrics"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/trajflow/trajflow/bench/synth"
	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/operators/validate"
	"github.com/trajflow/trajflow/schemas"
)

// Report is the result of a bench. Rates are over the measurement window;
// Accounting covers every attempt launched, after the drain.
type Report struct {
	Run          string    `json:"run"`
	Contract     string    `json:"contract"`
	ContractHash string    `json:"contract_hash"`
	Broker       string    `json:"broker"`
	Partitions   int       `json:"partitions"`
	GOMAXPROCS   int       `json:"gomaxprocs"`
	Started      time.Time `json:"started"`
	WindowS      float64   `json:"window_s"`

	// E2ETokensPerS: tokens (prompt, action, observation) of the attempts
	// whose fate was decided (admitted to a batch, filtered or
	// quarantined) per second; E2EActionTokensPerS the policy-sampled
	// tokens among them; AdmittedTokensPerS the tokens admitted to batches.
	E2ETokensPerS       float64 `json:"e2e_tokens_per_s"`
	E2EActionTokensPerS float64 `json:"e2e_action_tokens_per_s"`
	AdmittedTokensPerS  float64 `json:"admitted_tokens_per_s"`
	E2ERecordsPerS      float64 `json:"e2e_records_per_s"`
	BatchesPerS         float64 `json:"batches_per_s"`

	// PipelineMBPerS is the bytes delivered to consumers on the pipeline's
	// hops (each stage's input, and the batches read by the trainer side)
	// per second; BaselineMBPerS the raw kafka-go produce→consume rate of
	// the same messages; RatioToBaseline their quotient.
	PipelineMBPerS  float64 `json:"pipeline_mb_s"`
	BaselineMBPerS  float64 `json:"baseline_mb_s"`
	RatioToBaseline float64 `json:"ratio_to_baseline"`
	// PipelineMBPerCPUS and RatioToBaselineCPU are the same per second of
	// process CPU time: on a shared machine the baseline and the pipeline
	// phases may get different shares of the cores, and this ratio is
	// the operators' overhead over pure data movement regardless.
	PipelineMBPerCPUS  float64   `json:"pipeline_mb_per_cpu_s"`
	RatioToBaselineCPU float64   `json:"ratio_to_baseline_cpu"`
	Baseline           *Baseline `json:"baseline,omitempty"`
	// Baselines are every raw baseline of the run (Config.Baselines), in
	// the order they ran; Baseline is the kafka-go one among them.
	Baselines []*Baseline `json:"baselines,omitempty"`
	// CPUByRole is the window's CPU by role, most first (Config.CPURoles;
	// its MSPerMB over the pipeline's hop bytes, PipelineMBPerS's).
	CPUByRole []RoleCPU `json:"cpu_by_role,omitempty"`
	hopBytes  int64     // moved on the pipeline's hops in the window

	PackingEfficiency float64 `json:"packing_efficiency"`
	// Yield is valid action tokens admitted / action tokens generated;
	// Losses itemize the rest (docs/SYSTEMS.md §4), as shares of generated action
	// tokens; PaddingShare is the share of packed row slots left empty.
	Yield        float64            `json:"yield"`
	Losses       map[string]float64 `json:"losses"`
	LossReasons  map[string]int64   `json:"loss_reasons"` // attempts per census reason
	PaddingShare float64            `json:"padding_share"`

	LatencyMS Latency `json:"latency_ms"`
	// Lag is the policy lag (trainer version minus the oldest behavior
	// version) of generated and of admitted attempts: lag -> attempts.
	LagGenerated map[string]int64 `json:"lag_generated"`
	LagAdmitted  map[string]int64 `json:"lag_admitted"`

	Stages []StageReport `json:"stages"`
	// TrainerHopMS is the batches topic's hop: a packed batch's production
	// (its Kafka timestamp) to its read on the trainer side.
	TrainerHopMS *Latency     `json:"trainer_hop_ms,omitempty"`
	Source       SourceReport `json:"source"`
	// SinkCPUShare is the share of the window the accounting reader spent
	// decoding batches and census events (bench overhead, not pipeline).
	SinkCPUShare float64 `json:"sink_busy_share"`
	// CPUCores is process CPU time / wall time over the window;
	// E2ETokensPerCPUS the end-to-end tokens per second of process CPU
	// time (the rate per fully available core, on a shared machine).
	CPUCores         float64 `json:"cpu_cores"`
	E2ETokensPerCPUS float64 `json:"e2e_tokens_per_cpu_s"`
	PeakRSSMB        float64 `json:"peak_rss_mb"`
	MemoryLimitMB    float64 `json:"memory_limit_mb"` // Go soft memory limit (0: none)
	RetentionMB      float64 `json:"retention_mb"`    // embedded broker's retention per partition
	// Topics says what became of the run's topics on a cluster
	// (Config.Brokers): "deleted (N)", "kept: <run>.* (--keep-topics)", or
	// why they were not deleted. Empty on the embedded broker.
	Topics     string       `json:"topics,omitempty"`
	RSS        []RSSSample  `json:"rss"`
	DrainS     float64      `json:"drain_s"`
	Accounting audit.Counts `json:"accounting"`
	// Undecided, when attempts were lost, names the topics each lost
	// attempt's group was last seen in (its messages are keyed by group id).
	Undecided map[string][]string `json:"undecided,omitempty"`
	// Duplicates lists up to 20 duplicated admissions as "id@batch".
	Duplicates []string `json:"duplicates,omitempty"`
	// DuplicateCensus is the census history of those attempts.
	DuplicateCensus map[string][]string `json:"duplicate_census,omitempty"`
	// Processes is true when the operators ran as child processes; Kill
	// is what Config.Kill did.
	Processes bool        `json:"processes,omitempty"`
	Kill      *KillReport `json:"kill,omitempty"`
	// Correct is true when nothing launched was lost or duplicated.
	Correct bool         `json:"correct"`
	Synth   synth.Config `json:"synth"`

	latencyHist *histogram
}

// Latency is a distribution summary with its histogram.
type Latency struct {
	P50     float64   `json:"p50"`
	P90     float64   `json:"p90"`
	P99     float64   `json:"p99"`
	Max     float64   `json:"max"`
	Count   int64     `json:"count"`
	Buckets []float64 `json:"bucket_upper_ms"`
	Counts  []int64   `json:"bucket_counts"`
}

// StageReport is one stage's throughput; Instances when it ran more than
// once in its consumer group.
type StageReport struct {
	Name      string           `json:"name"`
	Instances []InstanceReport `json:"instances"`
	InstanceReport
}

// InstanceReport is the throughput of one operator instance (or a stage's
// total). Tokens and rows are those of the groups in the messages it
// consumed; MB/s counts bytes consumed plus bytes produced; BusyShare is
// the share of the window spent in the stage's function.
type InstanceReport struct {
	ID          string  `json:"id,omitempty"`
	Messages    int64   `json:"messages"`
	TokensPerS  float64 `json:"tokens_per_s"`
	RecordsPerS float64 `json:"records_per_s"`
	InMBPerS    float64 `json:"in_mb_s"`
	OutMBPerS   float64 `json:"out_mb_s"`
	MBPerS      float64 `json:"mb_s"`
	MeanProcUS  float64 `json:"mean_process_us"`
	BusyShare   float64 `json:"busy_share"`
	// CPUCores is the CPU time of the instance's process over the window
	// (operators in processes: its Kafka client, runtime and collector
	// included).
	CPUCores float64 `json:"cpu_cores,omitempty"`
	// HopMS is the latency from a message's production to the stage's
	// Process call (the broker hop plus the queue in front of the stage).
	HopMS *Latency `json:"hop_ms,omitempty"`
}

// SourceReport is the synthetic source's own rate: tokens generated and
// encoded per second of its own busy time (its ceiling), and its share of
// the window.
type SourceReport struct {
	Groups        int64   `json:"groups"`
	TokensPerS    float64 `json:"tokens_per_s"`
	CeilingPerS   float64 `json:"ceiling_tokens_per_s"`
	BusyShare     float64 `json:"busy_share"`
	MeanMsgBytes  float64 `json:"mean_message_bytes"`
	BytesPerToken float64 `json:"bytes_per_token"`
}

// RSSSample is the resident set size at one moment.
type RSSSample struct {
	Phase string  `json:"phase"`
	AtS   float64 `json:"at_s"`
	MB    float64 `json:"mb"`
	// OperatorsMB is the memory of the operator processes at the same
	// moment (Config.Processes), and PSSMB this process's, both as
	// proportional set sizes (ProcPSSMB): PSSMB + OperatorsMB counts every
	// page of the process tree once, where adding up resident sizes would
	// count the binary's pages once per process.
	OperatorsMB float64 `json:"operators_mb,omitempty"`
	PSSMB       float64 `json:"pss_mb,omitempty"`
	// Go heap at the same moment (runtime/metrics): live objects, the
	// collector's goal, and free heap not yet returned to the OS.
	HeapObjectsMB float64 `json:"heap_objects_mb"`
	HeapGoalMB    float64 `json:"heap_goal_mb"`
	HeapFreeMB    float64 `json:"heap_free_mb"`
	// TokensPerS is the end-to-end rate over the last second or so.
	TokensPerS float64 `json:"tokens_per_s"`
}

// accounting accumulates the fates decided in one phase.
type accounting struct {
	attempts, tokens, action        int64
	admitted, admittedTok, admitAct int64
	lossAct                         map[string]int64
	reasons                         map[string]int64
	lagGen, lagAdm                  map[int64]int64
	lat                             *histogram
	batchHop                        *histogram // a batch's production → read by the trainer side
	batches, rows, segTokens, slots int64
}

func newAccounting() *accounting {
	return &accounting{lossAct: map[string]int64{}, reasons: map[string]int64{},
		lagGen: map[int64]int64{}, lagAdm: map[int64]int64{}, lat: newHistogram(), batchHop: newHistogram()}
}

// Loss categories (docs/SYSTEMS.md §4 "Track losses from").
const (
	LossInvalid      = "invalid"
	LossInfra        = "infrastructure_failure"
	LossEvaluator    = "evaluator_error"
	LossZeroVariance = "zero_variance"
	LossStale        = "stale"
	LossOverlong     = "overlong"
	LossQuarantine   = "quarantine"
	LossOther        = "other_filtered"
)

func lossCategory(f audit.Fate) string {
	if f.Outcome == audit.OutcomeFiltered {
		switch f.Reason {
		case "zero_variance":
			return LossZeroVariance
		case "stale":
			return LossStale
		case "overlong":
			return LossOverlong
		}
		return LossOther
	}
	switch f.Reason {
	case validate.ReasonInfraFailure, validate.ReasonTimedOut:
		return LossInfra
	case validate.ReasonRewardUnavailable:
		return LossEvaluator
	case validate.ReasonSafetyIncident, validate.ReasonEvalTaskID, "undecodable", "wrong_kind", "unknown_version", "output_oversize", "malformed_scored", "bad_group_member":
		return LossQuarantine
	}
	return LossInvalid
}

func (a *accounting) add(f audit.Fate, now time.Time) {
	a.attempts++
	a.tokens += int64(f.Tokens)
	a.action += int64(f.ActionTokens)
	a.lagGen[f.Lag]++
	if f.Outcome == audit.OutcomeAdmitted {
		a.admitted++
		a.admittedTok += int64(f.Tokens)
		a.admitAct += int64(f.ActionTokens)
		a.lagAdm[f.Lag]++
		a.lat.add(float64(now.UnixNano()-f.ProducedAt) / 1e6)
		return
	}
	a.lossAct[lossCategory(f)] += int64(f.ActionTokens)
	a.reasons[f.Outcome+":"+f.Reason]++
}

func (a *accounting) batch(b *schemas.PackedBatch) {
	a.batches++
	for i := range b.Rows {
		a.rows++
		a.slots += int64(b.TokenBudget)
		for _, n := range b.Rows[i].SegLengths {
			a.segTokens += int64(n)
		}
	}
}

func lagMap(m map[int64]int64) map[string]int64 {
	out := map[string]int64{}
	for k, v := range m {
		out[strconv.FormatInt(k, 10)] = v
	}
	return out
}

// fill computes the window's rates.
func (rep *Report) fill(a *accounting, s0, s1 snapshot, window time.Duration, r *run) {
	w := window.Seconds()
	rep.WindowS = w
	rep.E2ETokensPerS = float64(a.tokens) / w
	rep.E2EActionTokensPerS = float64(a.action) / w
	rep.AdmittedTokensPerS = float64(a.admittedTok) / w
	rep.E2ERecordsPerS = float64(a.attempts) / w
	rep.BatchesPerS = float64(a.batches) / w
	if a.slots > 0 {
		rep.PackingEfficiency = float64(a.segTokens) / float64(a.slots)
		rep.PaddingShare = 1 - rep.PackingEfficiency
	}
	rep.Losses = map[string]float64{}
	for _, k := range []string{LossInvalid, LossInfra, LossEvaluator, LossZeroVariance, LossStale, LossOverlong, LossQuarantine, LossOther} {
		rep.Losses[k] = 0
		if a.action > 0 {
			rep.Losses[k] = float64(a.lossAct[k]) / float64(a.action)
		}
	}
	if a.action > 0 {
		rep.Yield = float64(a.admitAct) / float64(a.action)
	}
	rep.LossReasons = a.reasons
	rep.LagGenerated, rep.LagAdmitted = lagMap(a.lagGen), lagMap(a.lagAdm)
	rep.latencyHist = a.lat
	rep.LatencyMS = a.lat.summary()
	rep.TrainerHopMS = a.batchHop.brief()

	var hops int64
	for _, name := range Stages {
		sr := StageReport{Name: name}
		var tot instanceStats
		insts := r.instances(name)
		hop := newHistogram()
		for _, in := range insts {
			d := s1.stages[in.id].sub(s0.stages[in.id])
			tot = tot.add(d)
			ir := instReport(in.id, d, w)
			h := in.resetWait()
			hop.merge(h)
			ir.HopMS = h.brief()
			sr.Instances = append(sr.Instances, ir)
		}
		sr.InstanceReport = instReport("", tot, w)
		sr.HopMS = hop.brief()
		if len(insts) == 1 {
			sr.Instances = nil
		}
		hops += tot.bytesIn
		rep.Stages = append(rep.Stages, sr)
	}
	hops += s1.sinkB - s0.sinkB // the trainer side's hop: batches
	rep.hopBytes = hops
	rep.PipelineMBPerS = float64(hops) / w / 1e6
	if rep.Baseline != nil {
		rep.BaselineMBPerS = rep.Baseline.MBPerS
	}
	if rep.BaselineMBPerS > 0 {
		rep.RatioToBaseline = rep.PipelineMBPerS / rep.BaselineMBPerS
	}
	if cpu := (s1.cpu - s0.cpu).Seconds(); cpu > 0 {
		rep.PipelineMBPerCPUS = float64(hops) / cpu / 1e6
		if rep.Baseline != nil && rep.Baseline.MBPerCPUS > 0 {
			rep.RatioToBaselineCPU = rep.PipelineMBPerCPUS / rep.Baseline.MBPerCPUS
		}
	}
	gen := float64(s1.genNanos-s0.genNanos) / 1e9
	rep.Source = SourceReport{
		Groups:     s1.produced - s0.produced,
		TokensPerS: float64(s1.genToks-s0.genToks) / w,
		BusyShare:  gen / w,
	}
	if gen > 0 {
		rep.Source.CeilingPerS = float64(s1.genToks-s0.genToks) / gen
	}
	if n := s1.produced - s0.produced; n > 0 {
		rep.Source.MeanMsgBytes = float64(s1.genBytes-s0.genBytes) / float64(n)
	}
	if t := s1.genToks - s0.genToks; t > 0 {
		rep.Source.BytesPerToken = float64(s1.genBytes-s0.genBytes) / float64(t)
	}
	rep.SinkCPUShare = float64(s1.sinkNs-s0.sinkNs) / 1e9 / w
	rep.CPUCores = (s1.cpu - s0.cpu).Seconds() / w
	if cpu := (s1.cpu - s0.cpu).Seconds(); cpu > 0 {
		rep.E2ETokensPerCPUS = float64(a.tokens) / cpu
	}
}

func instReport(id string, d instanceStats, w float64) InstanceReport {
	ir := InstanceReport{
		ID: id, Messages: d.msgs, TokensPerS: float64(d.tokens) / w, RecordsPerS: float64(d.rows) / w,
		InMBPerS: float64(d.bytesIn) / w / 1e6, OutMBPerS: float64(d.bytesOut) / w / 1e6,
		BusyShare: float64(d.procNanos) / 1e9 / w, CPUCores: float64(d.cpuNanos) / 1e9 / w,
	}
	ir.MBPerS = ir.InMBPerS + ir.OutMBPerS
	if d.msgs > 0 {
		ir.MeanProcUS = float64(d.procNanos) / float64(d.msgs) / 1e3
	}
	return ir
}

func (rep *Report) finish() {
	c := rep.Accounting
	rep.Correct = c.Lost == 0 && c.Duplicated == 0 && c.Launched > 0
}

// WriteTable writes the human-readable report.
func (rep *Report) WriteTable(w io.Writer) error {
	bw := bufio.NewWriter(w)
	p := func(format string, args ...any) { fmt.Fprintf(bw, format, args...) }
	p("trajflow bench  run=%s  broker=%s  partitions=%d  GOMAXPROCS=%d  window=%.1fs\n\n",
		rep.Run, rep.Broker, rep.Partitions, rep.GOMAXPROCS, rep.WindowS)
	p("%-14s %12s %12s %10s %10s %10s %10s %7s\n", "stage", "tokens/s", "records/s", "in MB/s", "out MB/s", "msgs", "proc µs", "busy")
	row := func(name string, r InstanceReport) {
		toks, rows := human(r.TokensPerS), fmt.Sprintf("%.0f", r.RecordsPerS)
		if rep.Processes {
			toks, rows = "—", "—" // an operator process's metrics count messages, not rows
		}
		p("%-14s %12s %12s %10.1f %10.1f %10d %10.0f %6.0f%%\n", name, toks, rows,
			r.InMBPerS, r.OutMBPerS, r.Messages, r.MeanProcUS, 100*r.BusyShare)
	}
	p("%-14s %12s %12s %10s %10.1f %10d %10s %6.0f%%\n", "source", human(rep.Source.TokensPerS), "", "", rep.Source.TokensPerS*rep.Source.BytesPerToken/1e6,
		rep.Source.Groups, "", 100*rep.Source.BusyShare)
	for _, s := range rep.Stages {
		row(s.Name, s.InstanceReport)
		for _, in := range s.Instances {
			row("  "+in.ID, in)
		}
	}
	p("\nend to end       %s tokens/s (%s action tokens/s, %s admitted tokens/s), %.0f records/s, %.2f batches/s\n",
		human(rep.E2ETokensPerS), human(rep.E2EActionTokensPerS), human(rep.AdmittedTokensPerS), rep.E2ERecordsPerS, rep.BatchesPerS)
	p("through broker   pipeline %.1f MB/s   raw kafka-go baseline %.1f MB/s   ratio %.2f\n",
		rep.PipelineMBPerS, rep.BaselineMBPerS, rep.RatioToBaseline)
	if rep.Baseline != nil {
		paced := ""
		if rep.Baseline.PacedRate > 0 {
			paced = fmt.Sprintf(" (producer paced to %.0f msgs/s)", rep.Baseline.PacedRate)
		}
		p("                 baseline: %.0f msgs/s of %.0f KB, %s tokens/s, %.2f cores%s\n", rep.Baseline.RecordsPerS, rep.Baseline.MeanMsgBytes/1e3, human(rep.Baseline.TokensPerS), rep.Baseline.CPUCores, paced)
		p("per CPU-second   pipeline %.1f MB   baseline %.1f MB   ratio %.2f\n", rep.PipelineMBPerCPUS, rep.Baseline.MBPerCPUS, rep.RatioToBaselineCPU)
	}
	for _, b := range rep.Baselines {
		if b.Client != ClientKafkaGo {
			p("raw %-12s %.1f MB/s, %.1f MB per CPU-second, %.0f msgs/s, %.2f cores\n", b.Client, b.MBPerS, b.MBPerCPUS, b.RecordsPerS, b.CPUCores)
		}
	}
	printRoles(p, rep)
	p("latency (ms)     p50 %.1f  p90 %.1f  p99 %.1f  max %.1f  (production → batch, %d records)\n",
		rep.LatencyMS.P50, rep.LatencyMS.P90, rep.LatencyMS.P99, rep.LatencyMS.Max, rep.LatencyMS.Count)
	p("hops (ms)        p50/p99 ")
	for _, s := range rep.Stages {
		if s.HopMS != nil && s.HopMS.Count > 0 {
			p(" %s %.1f/%.1f", s.Name, s.HopMS.P50, s.HopMS.P99)
		}
	}
	if rep.TrainerHopMS != nil {
		p(" trainer %.1f/%.1f", rep.TrainerHopMS.P50, rep.TrainerHopMS.P99)
	}
	p("  (production → read, per topic)\n")
	p("packing          efficiency %.2f%% (padding %.2f%%)\n", 100*rep.PackingEfficiency, 100*rep.PaddingShare)
	p("yield            %.2f%% of generated action tokens admitted; losses:", 100*rep.Yield)
	keys := make([]string, 0, len(rep.Losses))
	for k := range rep.Losses {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		p(" %s %.2f%%", k, 100*rep.Losses[k])
	}
	p("\n")
	p("policy lag       generated %s   admitted %s\n", lagString(rep.LagGenerated), lagString(rep.LagAdmitted))
	p("source           ceiling %s tokens/s (busy %.0f%% of the window), %.1f bytes/token\n",
		human(rep.Source.CeilingPerS), 100*rep.Source.BusyShare, rep.Source.BytesPerToken)
	limit := "none"
	if rep.MemoryLimitMB > 0 {
		limit = fmt.Sprintf("%.0f MB", rep.MemoryLimitMB)
	}
	p("process          %.2f cores (%s end-to-end tokens per CPU-second), peak RSS %.0f MB (Go memory limit %s)\n", rep.CPUCores, human(rep.E2ETokensPerCPUS), rep.PeakRSSMB, limit)
	if rep.RetentionMB > 0 {
		p("                 embedded broker retention %.0f MB per partition\n", rep.RetentionMB)
	}
	if rep.Topics != "" {
		p("topics           %s\n", rep.Topics)
	}
	if k := rep.Kill; k != nil {
		p("kill             %s (%s) SIGKILLed %.1fs into the window, running again after %.2fs\n", k.Stage, k.Instance, k.AtS, k.DownS)
	}
	if rep.Processes {
		var opsMB float64
		for _, smp := range rep.RSS {
			opsMB = max(opsMB, smp.OperatorsMB)
		}
		p("operator cores  ")
		for _, s := range rep.Stages {
			p(" %s %.2f", s.Name, s.CPUCores)
		}
		p("  (CPU of each stage's processes over the window)\n")
		p("                 operators ran as child processes: their rows and the pipeline's bytes come from each\n"+
			"                 process's /metrics (value bytes, no rows or tokens, no hop latency); CPU adds theirs;\n"+
			"                 their memory (proportional set sizes) peaked at %.0f MB together (sampled once a second)\n", opsMB)
	}
	c := rep.Accounting
	verdict := "OK"
	if !rep.Correct {
		verdict = "FAILED"
	}
	p("correctness      %s: launched %d admitted %d filtered %d quarantined %d lost %d duplicated %d (drain %.1fs)\n",
		verdict, c.Launched, c.Admitted, c.Filtered, c.Quarantined, c.Lost, c.Duplicated, rep.DrainS)
	for g, where := range rep.Undecided {
		p("  undecided group %s: %s\n", g, strings.Join(where, " "))
	}
	for _, d := range rep.Duplicates {
		id, _, _ := strings.Cut(d, "@")
		p("  duplicate admission %s; census: %s\n", d, strings.Join(rep.DuplicateCensus[id], " "))
	}
	return bw.Flush()
}

func lagString(m map[string]int64) string {
	keys := make([]int, 0, len(m))
	var total int64
	for k, v := range m {
		n, _ := strconv.Atoi(k)
		keys = append(keys, n)
		total += v
	}
	sort.Ints(keys)
	var sb strings.Builder
	for i, k := range keys {
		if i > 0 {
			sb.WriteString(" ")
		}
		fmt.Fprintf(&sb, "%d:%.1f%%", k, 100*float64(m[strconv.Itoa(k)])/float64(max(total, 1)))
	}
	return sb.String()
}

func human(v float64) string {
	switch {
	case v >= 1e9:
		return fmt.Sprintf("%.2fG", v/1e9)
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.1fk", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}

// histogram is a log-bucketed histogram of milliseconds: 20 buckets per
// decade from 0.01 ms to 1000 s (bounded memory however long the run).
type histogram struct {
	counts []int64
	n      int64
	max    float64
}

const (
	histMin      = 0.01
	histPerDec   = 20
	histDecades  = 8
	histNBuckets = histPerDec*histDecades + 1
)

func newHistogram() *histogram { return &histogram{counts: make([]int64, histNBuckets)} }

func histUpper(i int) float64 { return histMin * math.Pow(10, float64(i+1)/histPerDec) }

func (h *histogram) add(ms float64) {
	i := 0
	if ms > histMin {
		i = int(math.Log10(ms/histMin) * histPerDec)
	}
	i = min(max(i, 0), histNBuckets-1)
	h.counts[i]++
	h.n++
	h.max = max(h.max, ms)
}

func (h *histogram) merge(o *histogram) {
	for i, n := range o.counts {
		h.counts[i] += n
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

func (h *histogram) quantile(q float64) float64 {
	if h.n == 0 {
		return 0
	}
	target := int64(math.Ceil(q * float64(h.n)))
	var c int64
	for i, n := range h.counts {
		c += n
		if c >= target {
			return min(histUpper(i), h.max)
		}
	}
	return h.max
}

func (h *histogram) summary() Latency {
	l := Latency{P50: h.quantile(0.5), P90: h.quantile(0.9), P99: h.quantile(0.99), Max: h.max, Count: h.n}
	lo, hi := -1, -1
	for i, n := range h.counts {
		if n > 0 {
			if lo < 0 {
				lo = i
			}
			hi = i
		}
	}
	for i := lo; lo >= 0 && i <= hi; i++ {
		l.Buckets = append(l.Buckets, histUpper(i))
		l.Counts = append(l.Counts, h.counts[i])
	}
	return l
}

// brief is summary without the buckets (per-hop latencies in the report).
func (h *histogram) brief() *Latency {
	l := h.summary()
	l.Buckets, l.Counts = nil, nil
	return &l
}

// rssSampler records the resident set size over the run; procs, when
// set, is the operator processes' (Config.Processes).
type rssSampler struct {
	start   time.Time
	last    time.Time
	samples []RSSSample
	procs   func() float64
}

func (s *rssSampler) sample(phase string, tokensPerS float64) {
	now := time.Now()
	if s.start.IsZero() {
		s.start = now
	}
	if !s.last.IsZero() && now.Sub(s.last) < time.Second {
		return
	}
	s.last = now
	ms := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/gc/heap/goal:bytes"}, {Name: "/memory/classes/heap/free:bytes"}}
	metrics.Read(ms)
	mb := func(i int) float64 {
		if ms[i].Value.Kind() != metrics.KindUint64 {
			return 0
		}
		return float64(ms[i].Value.Uint64()) / (1 << 20)
	}
	smp := RSSSample{Phase: phase, AtS: now.Sub(s.start).Seconds(), MB: statusMB("self", "VmRSS:"),
		HeapObjectsMB: mb(0), HeapGoalMB: mb(1), HeapFreeMB: mb(2), TokensPerS: tokensPerS}
	if s.procs != nil {
		smp.OperatorsMB = s.procs()
		smp.PSSMB = ProcPSSMB(os.Getpid())
	}
	s.samples = append(s.samples, smp)
}

// peakRSSMB is the process's peak resident set size (VmHWM).
func peakRSSMB() float64 { return statusMB("self", "VmHWM:") }

// statusMB is a memory field of /proc/PID/status in MB (0 when it cannot
// be read); pid "self" is this process.
func statusMB(pid, field string) float64 {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0
	}
	return fieldMB(string(b), field)
}

// fieldMB is the value in kB of the line of a /proc file that starts with
// field, in MB (0 without one).
func fieldMB(text, field string) float64 {
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, field) {
			f := strings.Fields(line[len(field):])
			if len(f) > 0 {
				kb, _ := strconv.ParseFloat(f[0], 64)
				return kb / 1024
			}
		}
	}
	return 0
}

// processCPU is the user+system CPU time of the process.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// printRoles prints the windows' CPU by role (Config.CPURoles) in
// milliseconds per MB moved, the pipeline's then each baseline's, and the
// broker's part and the rest's against raw kafka-go's.
func printRoles(p func(string, ...any), rep *Report) {
	line := func(head string, rows []RoleCPU) {
		var total float64
		p("%-16s", head)
		for _, r := range rows {
			p(" %s %.2f", r.Role, r.MSPerMB)
			total += r.MSPerMB
		}
		p("  = %.2f\n", total)
	}
	if len(rep.CPUByRole) > 0 {
		line("CPU ms per MB    pipeline:", rep.CPUByRole)
	}
	for _, b := range rep.Baselines {
		if len(b.CPUByRole) > 0 {
			line("                 raw "+b.Client+":", b.CPUByRole)
		}
	}
	if rep.Baseline == nil {
		return
	}
	pb, pr, ok1 := splitBroker(rep.CPUByRole)
	bb, br, ok2 := splitBroker(rep.Baseline.CPUByRole)
	if ok1 && ok2 && bb > 0 && br > 0 {
		p("                 pipeline / raw kafka-go: broker %.2f×, the rest %.2f× (CPU per byte; from profiles of the windows)\n", pb/bb, pr/br)
	}
}
