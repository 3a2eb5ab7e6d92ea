package bench

import (
	"os"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/pipeline"
)

// parseCounters sums the four operator counters over their series and
// ignores every other family, comments included.
func TestParseCounters(t *testing.T) {
	cases := []struct {
		name, in string
		want     instanceStats
		wantErr  string
	}{
		{
			name: "one stage",
			in: `# HELP trajflow_records_in_total Records consumed.
# TYPE trajflow_records_in_total counter
trajflow_records_in_total{replica="pack-0",stage="pack"} 2300
trajflow_in_bytes_total{replica="pack-0",stage="pack"} 1.6625e+08
trajflow_out_bytes_total{replica="pack-0",stage="pack"} 5.25e+06
trajflow_records_out_total{replica="pack-0",stage="pack",topic="batches"} 40
trajflow_stage_busy_seconds_total{replica="pack-0",stage="pack"} 1.25
go_goroutines 42
`,
			want: instanceStats{msgs: 2300, bytesIn: 166250000, bytesOut: 5250000, procNanos: 1250000000},
		},
		{
			name: "two series summed, no labels",
			in: `trajflow_records_in_total{stage="reward",replica="a"} 10
trajflow_records_in_total{stage="reward",replica="b"} 5
trajflow_in_bytes_total 7
`,
			want: instanceStats{msgs: 15, bytesIn: 7},
		},
		{name: "another process", in: "go_goroutines 3\nprocess_cpu_seconds_total 1\n", wantErr: "no trajflow operator counters"},
		{name: "not a number", in: `trajflow_in_bytes_total{stage="x"} lots` + "\n", wantErr: "not a count"},
		{name: "negative", in: "trajflow_in_bytes_total -1\n", wantErr: "not a count"},
		{name: "too large", in: "trajflow_in_bytes_total 1e300\n", wantErr: "not a count"},
		{name: "sum too large", in: "trajflow_in_bytes_total 4e18\ntrajflow_in_bytes_total 4e18\ntrajflow_in_bytes_total 4e18\n", wantErr: "out of range"},
		{name: "NaN", in: "trajflow_records_in_total NaN\n", wantErr: "not a count"},
		{name: "empty", in: "", wantErr: "no trajflow operator counters"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseCounters(strings.NewReader(tc.in))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func FuzzParseCounters(f *testing.F) {
	f.Add("trajflow_records_in_total{stage=\"pack\"} 2300\ntrajflow_stage_busy_seconds_total 1.5\n")
	f.Add("# HELP x\ntrajflow_in_bytes_total 1e300\n")
	f.Add("trajflow_out_bytes_total{a=\"b c\"} 3")
	f.Fuzz(func(t *testing.T, in string) {
		s, err := parseCounters(strings.NewReader(in))
		if err == nil && (s.msgs < 0 || s.bytesIn < 0 || s.bytesOut < 0) {
			t.Fatalf("negative counters %+v from %q", s, in)
		}
	})
}

// The address `trajflow run` prints is found whatever the writes' split,
// and everything written is passed on unchanged.
func TestStdoutWatchFindsHealthAddress(t *testing.T) {
	out := "starting\n" + pipeline.HealthLine("pack", "pack-0", "127.0.0.1:40123") + "\nmore output\n"
	for _, chunk := range []int{1, 3, 7, 20, len(out)} {
		p := &proc{}
		var fwd strings.Builder
		w := &stdoutWatch{p: p, w: &fwd}
		for i := 0; i < len(out); i += chunk {
			if _, err := w.Write([]byte(out[i:min(i+chunk, len(out))])); err != nil {
				t.Fatal(err)
			}
		}
		if p.health != "127.0.0.1:40123" {
			t.Errorf("chunks of %d: health %q", chunk, p.health)
		}
		if fwd.String() != out {
			t.Errorf("chunks of %d: forwarded %q", chunk, fwd.String())
		}
	}
	// No line, no address.
	p := &proc{}
	w := &stdoutWatch{p: p, w: &strings.Builder{}}
	w.Write([]byte(pipeline.HealthLine("pack", "pack-0", "127.0.0.1:1"))) // no newline yet
	if p.health != "" {
		t.Errorf("address %q taken from an unfinished line", p.health)
	}
}

// TestFieldMB reads a kB field of /proc text as MB, by its exact prefix,
// and 0 for a field that is not there.
func TestFieldMB(t *testing.T) {
	rollup := "55d0c0000000-7ffd4d9ff000 ---p 00000000 00:00 0 [rollup]\n" +
		"Rss:              204800 kB\nPss:              153600 kB\nPss_Anon:         102400 kB\n"
	for _, c := range []struct {
		field string
		want  float64
	}{
		{"Rss:", 200},
		{"Pss:", 150},
		{"Pss_Anon:", 100},
		{"Swap:", 0},
	} {
		if got := fieldMB(rollup, c.field); got != c.want {
			t.Errorf("fieldMB(%q) = %v, want %v", c.field, got, c.want)
		}
	}
}

// TestProcPSSMB: this process has a proportional set size, and no more
// than its resident size; a process that does not exist has none.
func TestProcPSSMB(t *testing.T) {
	pss, rss := ProcPSSMB(os.Getpid()), statusMB("self", "VmRSS:")
	if pss <= 0 || pss > 1.5*rss {
		t.Fatalf("PSS %.1f MB, RSS %.1f MB", pss, rss)
	}
	if got := ProcPSSMB(1 << 30); got != 0 {
		t.Fatalf("PSS of no process: %v", got)
	}
}
