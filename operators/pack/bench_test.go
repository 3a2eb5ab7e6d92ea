package pack

import (
	"math/rand/v2"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/schemas"
)

const (
	benchTrajectories = 4096
	benchBudget       = 32768
	benchTrainer      = 10
)

// benchScored draws 4096 trajectories of heavy-tailed length (log-normal,
// mean ~1000 tokens, clipped to [16, 32768]) split into multi-turn episodes.
func benchScored() ([]schemas.Scored, Options, int64) {
	r := rand.New(rand.NewPCG(42, 4096))
	o := Options{TokenBudget: benchBudget, BatchTokens: benchBudget, Overflow: OverflowTruncate, MaxLag: 2, StalePolicy: StaleMaskTurns}
	out := make([]schemas.Scored, 0, benchTrajectories)
	var tokens int64
	for i := 0; len(out) < benchTrajectories; i++ {
		n := logNormalLength(r, 1000, 1.2, 16, benchBudget)
		s := randomScored(r, idOf(i), idOf(i/8), n, benchTrainer)
		if _, f, err := Reconstruct(&s, benchTrainer, o); err != nil || f != FilterNone {
			continue // a short draw without targets: every benchmark record is admitted
		}
		out = append(out, s)
		tokens += int64(n)
	}
	return out, o, tokens
}

// cpuTime is the CPU time of the process (all threads: the benchmark and
// the garbage collector). With -cpu 1 it is the cost on one core, whatever
// else runs on the machine; tokens per CPU-second is then a load-independent
// figure beside the wall-clock tokens/s.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// report adds tokens/s (wall clock) and tokens/cpu-s.
func report(b *testing.B, tokens int64, n int, cpu0 time.Duration) {
	b.ReportMetric(float64(tokens)*float64(n)/b.Elapsed().Seconds(), "tokens/s")
	if cpu := cpuTime() - cpu0; cpu > 0 {
		b.ReportMetric(float64(tokens)*float64(n)/cpu.Seconds(), "tokens/cpu-s")
	}
}

func reconstructAll(b *testing.B, in []schemas.Scored, o Options, segs []Segment) []Segment {
	segs = segs[:0]
	for i := range in {
		seg, f, err := Reconstruct(&in[i], benchTrainer, o)
		if err != nil || f != FilterNone {
			b.Fatalf("%s: %q %v", in[i].RecordID, f, err)
		}
		segs = append(segs, seg)
	}
	return segs
}

// BenchmarkReconstructPack measures reconstruction plus packing of 4096
// heavy-tailed trajectories into 32768-token rows, in tokens per second,
// with the packing efficiency.
func BenchmarkReconstructPack(b *testing.B) {
	in, o, tokens := benchScored()
	segs := make([]Segment, 0, len(in))
	var st Stats
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	n := 0
	for b.Loop() {
		segs = reconstructAll(b, in, o, segs)
		_, st = Pack(segs, benchBudget)
		n++
	}
	report(b, tokens, n, cpu0)
	b.ReportMetric(st.Efficiency, "efficiency")
	b.ReportMetric(float64(st.Rows), "rows")
}

// BenchmarkReconstruct measures reconstruction alone.
func BenchmarkReconstruct(b *testing.B) {
	in, o, tokens := benchScored()
	segs := make([]Segment, 0, len(in))
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	n := 0
	for b.Loop() {
		segs = reconstructAll(b, in, o, segs)
		n++
	}
	report(b, tokens, n, cpu0)
}

// BenchmarkPack measures packing alone (placement and column expansion).
func BenchmarkPack(b *testing.B) {
	in, o, tokens := benchScored()
	segs := reconstructAll(b, in, o, nil)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	n := 0
	for b.Loop() {
		Pack(segs, benchBudget)
		n++
	}
	report(b, tokens, n, cpu0)
}

// BenchmarkWindow measures the pack stage end to end in memory: Add of
// 4096 records (with deduplication) and Close.
func BenchmarkWindow(b *testing.B) {
	in, o, tokens := benchScored()
	o.BatchTokens = int(tokens) + 1
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	n := 0
	for b.Loop() {
		w, err := NewWindow(o, benchTrainer)
		if err != nil {
			b.Fatal(err)
		}
		for i := range in {
			if _, err := w.Add(in[i]); err != nil {
				b.Fatal(err)
			}
		}
		w.Close(int64(n), "bench", "contract", benchTrainer)
		n++
	}
	report(b, tokens, n, cpu0)
}

// BenchmarkNewestKept measures the per-token scan of a packed batch for
// the version the lag rule judges it by (NewestKept, the trainer's
// reference), beside which Stats.NewestKept reads the same version from
// the spans PackInto already walks.
func BenchmarkNewestKept(b *testing.B) {
	in, o, tokens := benchScored()
	segs := reconstructAll(b, in, o, nil)
	rows, _ := Pack(segs, benchBudget)
	batch := schemas.PackedBatch{Rows: rows}
	for _, policy := range []string{StaleMaskTurns, StaleDrop} {
		b.Run(policy, func(b *testing.B) {
			cpu0 := cpuTime()
			n := 0
			for b.Loop() {
				if NewestKept(&batch, policy) < 0 {
					b.Fatal("no trained token")
				}
				n++
			}
			report(b, tokens, n, cpu0)
		})
	}
}
