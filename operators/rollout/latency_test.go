package rollout

import (
	"context"
	"math"
	"reflect"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/schemas"
)

// TestLatencyModelKeepsTokens: the latency wrappers only wait. A group run
// through them gives the same trajectories as without (tokens, log-probs,
// versions, decisions), and the waits are exactly the model's draws: one
// tool latency per step of every episode, one generation wait per turn
// (the slowest request's tokens times its per-token latency). No real
// time passes: Sleep records the waits.
func TestLatencyModelKeepsTokens(t *testing.T) {
	reg, err := NewRegistry(DefaultRegistryConfig())
	if err != nil {
		t.Fatal(err)
	}
	pol := randomPolicy(t, 5)
	var atts []schemas.TaskAttempt
	for i, task := range reg.Train()[:3] {
		atts = append(atts, Attempts("run", task, int64(i), 4, 1, pol.Version(), "c")...)
	}
	plain, err := Agent{Env: reg, Policy: pol, Settings: DefaultSettings(reg), Limits: DefaultLimits()}.Run(context.Background(), atts)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var waits []time.Duration
	m := LatencyModel{ToolMedian: 20 * time.Millisecond, ToolSigma: 1, TokenMedian: 2 * time.Millisecond, TokenSigma: 0.5, Seed: 9,
		Sleep: func(_ context.Context, d time.Duration) error {
			mu.Lock()
			waits = append(waits, d)
			mu.Unlock()
			return nil
		}}
	env, p := m.Wrap(reg, pol)
	if c, ok := env.(Concurrent); !ok || c.Concurrency() < len(atts) {
		t.Fatalf("the wrapped environment does not let tool calls overlap: %T", env)
	}
	slow, err := Agent{Env: env, Policy: p, Settings: DefaultSettings(reg), Limits: DefaultLimits()}.Run(context.Background(), atts)
	if err != nil {
		t.Fatal(err)
	}
	for i := range plain {
		a, b := plain[i].Turns, slow[i].Turns
		if len(a) != len(b) {
			t.Fatalf("attempt %d: %d turns with latency, %d without", i, len(b), len(a))
		}
		for k := range a {
			a[k].GenLatencyUS, a[k].EnvLatencyUS, b[k].GenLatencyUS, b[k].EnvLatencyUS = 0, 0, 0, 0
			a[k].Value, b[k].Value = 0, 0 // NaN (no critic) in both
		}
		if !reflect.DeepEqual(a, b) || plain[i].EndReason != slow[i].EndReason {
			t.Fatalf("attempt %d: the latency model changed the trajectory", i)
		}
	}
	// The expected waits: every step's tool draw, and per turn the
	// slowest generation.
	var want []time.Duration
	turns := 0
	for _, tr := range plain {
		turns = max(turns, len(tr.Turns))
	}
	for turn := 0; turn < turns; turn++ {
		var gen time.Duration
		for i, tr := range plain {
			if turn >= len(tr.Turns) {
				continue
			}
			id := schemas.TurnID(atts[i].AttemptID, int32(turn))
			want = append(want, m.Draw(m.ToolMedian, m.ToolSigma, id, "tool"))
			gen = max(gen, time.Duration(len(tr.Turns[turn].ActionIDs))*m.Draw(m.TokenMedian, m.TokenSigma, id, "token"))
		}
		want = append(want, gen)
	}
	sort.Slice(want, func(i, j int) bool { return want[i] < want[j] })
	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	if !reflect.DeepEqual(waits, want) {
		t.Fatalf("waits %v, want %v", waits, want)
	}
}

// TestLatencyDraws: draws are deterministic per key, log-normal around the
// median (the median of many draws is within 10% of it) and bounded by
// e^{MaxZ·σ}.
func TestLatencyDraws(t *testing.T) {
	m := LatencyModel{ToolMedian: 10 * time.Millisecond, ToolSigma: 1.5, Seed: 3}
	var ds []float64
	for i := 0; i < 4000; i++ {
		id := schemas.TurnID("a", int32(i))
		d := m.Draw(m.ToolMedian, m.ToolSigma, id, "tool")
		if d != m.Draw(m.ToolMedian, m.ToolSigma, id, "tool") {
			t.Fatal("a draw depends on more than its key")
		}
		if hi := time.Duration(float64(m.ToolMedian) * math.Exp(MaxZ*m.ToolSigma)); d > hi {
			t.Fatalf("draw %v above the bound %v", d, hi)
		}
		ds = append(ds, float64(d))
	}
	sort.Float64s(ds)
	if med := ds[len(ds)/2]; math.Abs(med/float64(m.ToolMedian)-1) > 0.1 {
		t.Fatalf("median of the draws %v, want about %v", time.Duration(med), m.ToolMedian)
	}
	if (LatencyModel{}).Enabled() || (LatencyModel{ToolSigma: -1}).Validate() == nil {
		t.Fatal("zero model enabled, or a negative sigma accepted")
	}
}
