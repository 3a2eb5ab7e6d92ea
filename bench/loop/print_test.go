package loop

import (
	"strings"
	"testing"
)

// TestPrintSpeedups: the whole-run speed-up is printed only when both modes
// made the same number of updates; otherwise the line names the counts
// instead of a meaningless 0.00x.
func TestPrintSpeedups(t *testing.T) {
	for _, tc := range []struct {
		name          string
		sync, async   int
		speedupAll    float64
		want, notWant string
	}{
		{"same updates", 30, 30, 1.5, "all 30, final drain included: speed-up 1.50x", "not compared"},
		{"different updates", 55, 60, 0, "the runs to their end not compared (updates: sync 55, async 60)", "0.00x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &Report{
				Results: []Result{
					{Mode: ModeSync, Updates: tc.sync, Compared: 26, SecondsAt: 100},
					{Mode: ModeAsync, Updates: tc.async, Compared: 26, SecondsAt: 40},
				},
				Speedup: 2.5, SpeedupAll: tc.speedupAll, EvalGap: -0.01,
			}
			var b strings.Builder
			r.Print(&b)
			out := b.String()
			if !strings.Contains(out, "async completes 26 updates in 0.40x the time of sync (speed-up 2.50x)") {
				t.Errorf("no compared speed-up in:\n%s", out)
			}
			if !strings.Contains(out, tc.want) || strings.Contains(out, tc.notWant) {
				t.Errorf("want %q and not %q in:\n%s", tc.want, tc.notWant, out)
			}
		})
	}
}
