package bench

import (
	"bytes"
	"math"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
)

// cpuProfile writes a CPU profile (samples/count, cpu/nanoseconds) with
// one sample per entry of cpuNS, labelled role=key ("" unlabelled).
func cpuProfile(t *testing.T, types []*profile.ValueType, cpuNS map[string][]int64) []byte {
	t.Helper()
	fn := &profile.Function{ID: 1, Name: "work"}
	loc := &profile.Location{ID: 1, Line: []profile.Line{{Function: fn}}}
	p := &profile.Profile{SampleType: types, Function: []*profile.Function{fn}, Location: []*profile.Location{loc}, Period: 1e7,
		PeriodType: &profile.ValueType{Type: "cpu", Unit: "nanoseconds"}}
	for role, vals := range cpuNS {
		for _, v := range vals {
			s := &profile.Sample{Location: []*profile.Location{loc}, Value: []int64{v / 1e7, v}}
			if role != "" {
				s.Label = map[string][]string{"role": {role}}
			}
			p.Sample = append(p.Sample, s)
		}
	}
	var buf bytes.Buffer
	if err := p.Write(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

var cpuTypes = []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "cpu", Unit: "nanoseconds"}}

// TestCPUByRole: a profile's CPU nanoseconds summed by the role label,
// samples without one under Unlabelled; a profile without CPU values or
// not a profile at all is an error that says so.
func TestCPUByRole(t *testing.T) {
	b := cpuProfile(t, cpuTypes, map[string][]int64{
		"broker": {2e9, 1e9}, // 3 s
		"pack":   {5e8, 5e8}, // 1 s
		"":       {1e9},      // 1 s
	})
	got, err := cpuByRole(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"broker": 3, "pack": 1, Unlabelled: 1}
	if len(got) != len(want) {
		t.Fatalf("roles %v, want %v", got, want)
	}
	for k, v := range want {
		if math.Abs(got[k]-v) > 1e-9 {
			t.Errorf("%s: %v s, want %v", k, got[k], v)
		}
	}

	noCPU := cpuProfile(t, []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "alloc_space", Unit: "bytes"}}, map[string][]int64{"broker": {1}})
	if _, err := cpuByRole(bytes.NewReader(noCPU)); err == nil || !strings.Contains(err.Error(), "cpu/nanoseconds") {
		t.Errorf("a profile without CPU values: %v, want an error naming cpu/nanoseconds", err)
	}
	if _, err := cpuByRole(strings.NewReader("not a profile")); err == nil || !strings.Contains(err.Error(), "CPU profile") {
		t.Errorf("garbage: %v, want an error about the CPU profile", err)
	}
}

// TestRoleTable checks the rows against hand-computed values: 5 s of CPU
// over 2000 MB, broker 3 s (60%, 1.5 ms per MB), pack and unlabelled 1 s
// each (20%, 0.5 ms per MB), most CPU first and ties by name; the broker
// against the rest 1.5 and 1.0 ms per MB.
func TestRoleTable(t *testing.T) {
	rows := roleTable(map[string]float64{"broker": 3, Unlabelled: 1, "pack": 1}, 2e9)
	want := []RoleCPU{
		{Role: "broker", CPUSeconds: 3, Share: 0.6, MSPerMB: 1.5},
		{Role: "pack", CPUSeconds: 1, Share: 0.2, MSPerMB: 0.5},
		{Role: Unlabelled, CPUSeconds: 1, Share: 0.2, MSPerMB: 0.5},
	}
	if len(rows) != len(want) {
		t.Fatalf("rows %+v, want %+v", rows, want)
	}
	for i, w := range want {
		g := rows[i]
		if g.Role != w.Role || math.Abs(g.CPUSeconds-w.CPUSeconds) > 1e-9 || math.Abs(g.Share-w.Share) > 1e-9 || math.Abs(g.MSPerMB-w.MSPerMB) > 1e-9 {
			t.Errorf("row %d = %+v, want %+v", i, g, w)
		}
	}
	broker, rest, ok := splitBroker(rows)
	if !ok || math.Abs(broker-1.5) > 1e-9 || math.Abs(rest-1.0) > 1e-9 {
		t.Errorf("splitBroker = %v, %v, %v; want 1.5, 1.0, true", broker, rest, ok)
	}
	if _, _, ok := splitBroker(rows[1:]); ok {
		t.Errorf("splitBroker without a broker row says ok")
	}
	if roleTable(nil, 1) != nil {
		t.Errorf("no profile gives rows")
	}
	// 8 s of process CPU split 1:3 by the samples.
	scaled := scaleTo(map[string]float64{"a": 0.1, "b": 0.3}, 8)
	if math.Abs(scaled["a"]-2) > 1e-9 || math.Abs(scaled["b"]-6) > 1e-9 {
		t.Errorf("scaleTo = %v, want a 2, b 6", scaled)
	}
}
