package bench

import (
	"os"
	"path/filepath"
	"testing"
)

// TestWritePlotEdgeLatencies: a report whose latency histogram is empty,
// has one bucket, or a bucket at 0 ms (not on a log axis) still draws.
func TestWritePlotEdgeLatencies(t *testing.T) {
	for _, tc := range []struct {
		name    string
		buckets []float64
		counts  []int64
	}{
		{"empty", nil, nil},
		{"one bucket", []float64{4}, []int64{10}},
		{"zero bucket", []float64{0, 1, 2}, []int64{3, 4, 5}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := &Report{}
			rep.LatencyMS.Buckets, rep.LatencyMS.Counts = tc.buckets, tc.counts
			path := filepath.Join(t.TempDir(), "plot.png")
			if err := WritePlot(rep, path); err != nil {
				t.Fatal(err)
			}
			if st, err := os.Stat(path); err != nil || st.Size() == 0 {
				t.Fatalf("no plot written: %v", err)
			}
		})
	}
}
