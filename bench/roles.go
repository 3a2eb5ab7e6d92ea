package bench

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"runtime/pprof"
	"slices"
	"time"

	"github.com/google/pprof/profile"
)

// Unlabelled is the role of the CPU samples of goroutines without a role
// label: mostly the Go runtime's collector and scheduler. (The kafka-go
// writers' connection goroutines take the label of the producer whose
// request they send: kafka.LabelRequests.)
const Unlabelled = "unlabelled"

// RoleCPU is the CPU one role spent in a measured window, from a CPU
// profile of that window (Config.CPURoles). Roles are the "role" labels
// the bench puts on its goroutines: broker, source, sink, each stage
// (validate, reward, advantage, pack), baseline (a raw client), and
// Unlabelled for the rest.
type RoleCPU struct {
	Role string `json:"role"`
	// CPUSeconds is the role's CPU time: the process's CPU time over the
	// window (getrusage) in the proportions of the profile's samples (a
	// profile at 100 Hz can drop samples on a loaded machine, the
	// proportions stay); Share is its part of the whole.
	CPUSeconds float64 `json:"cpu_s"`
	Share      float64 `json:"share"`
	// MSPerMB is CPUSeconds in milliseconds per MB (1e6 bytes) the window
	// moved through the broker: comparable between the pipeline and a raw
	// baseline, whose sum is its CPU per byte.
	MSPerMB float64 `json:"ms_per_mb"`
}

// windowProfile is a CPU profile of one measured window, in memory, and
// the process's CPU time when it started.
type windowProfile struct {
	buf bytes.Buffer
	cpu time.Duration
}

// startWindowProfile starts profiling this process's CPU (nil, nil when
// on is false). Go runs one CPU profile at a time: it fails while another
// (--cpuprofile, go test -cpuprofile) runs.
func startWindowProfile(on bool) (*windowProfile, error) {
	if !on {
		return nil, nil
	}
	w := &windowProfile{}
	if err := pprof.StartCPUProfile(&w.buf); err != nil {
		return nil, fmt.Errorf("bench: profile the window by role: %w", err)
	}
	w.cpu = processCPU()
	return w, nil
}

// stop ends the profile and returns the process's CPU seconds since it
// started, split by role in the profile's proportions (nil for a nil
// profile).
func (w *windowProfile) stop() (map[string]float64, error) {
	if w == nil {
		return nil, nil
	}
	cpu := (processCPU() - w.cpu).Seconds()
	pprof.StopCPUProfile()
	sampled, err := cpuByRole(&w.buf)
	if err != nil {
		return nil, err
	}
	return scaleTo(sampled, cpu), nil
}

// scaleTo scales the values of byRole so that they sum to total (byRole
// unchanged when it sums to zero).
func scaleTo(byRole map[string]float64, total float64) map[string]float64 {
	var sum float64
	for _, v := range byRole {
		sum += v
	}
	if sum <= 0 {
		return byRole
	}
	out := make(map[string]float64, len(byRole))
	for k, v := range byRole {
		out[k] = v * total / sum
	}
	return out
}

// cpuByRole reads a CPU profile and sums its CPU time by the goroutines'
// "role" label (Unlabelled without one), in seconds.
func cpuByRole(r io.Reader) (map[string]float64, error) {
	p, err := profile.Parse(r)
	if err != nil {
		return nil, fmt.Errorf("bench: read the window's CPU profile: %w", err)
	}
	idx := -1
	for i, st := range p.SampleType {
		if st.Type == "cpu" && st.Unit == "nanoseconds" {
			idx = i
		}
	}
	if idx < 0 {
		return nil, fmt.Errorf("bench: the window's CPU profile has no cpu/nanoseconds values (%d sample types)", len(p.SampleType))
	}
	out := map[string]float64{}
	for _, s := range p.Sample {
		role := Unlabelled
		if v := s.Label["role"]; len(v) > 0 && v[0] != "" {
			role = v[0]
		}
		out[role] += float64(s.Value[idx]) / 1e9
	}
	return out, nil
}

// roleTable turns CPU seconds by role into rows, most CPU first, with
// each role's share and its milliseconds per MB of bytes moved.
func roleTable(byRole map[string]float64, bytes int64) []RoleCPU {
	if byRole == nil {
		return nil
	}
	var total float64
	for _, s := range byRole {
		total += s
	}
	rows := make([]RoleCPU, 0, len(byRole))
	for role, s := range byRole {
		r := RoleCPU{Role: role, CPUSeconds: s}
		if total > 0 {
			r.Share = s / total
		}
		if bytes > 0 {
			r.MSPerMB = s * 1e3 / (float64(bytes) / 1e6)
		}
		rows = append(rows, r)
	}
	slices.SortFunc(rows, func(a, b RoleCPU) int {
		if c := cmp.Compare(b.CPUSeconds, a.CPUSeconds); c != 0 {
			return c
		}
		return cmp.Compare(a.Role, b.Role)
	})
	return rows
}

// splitBroker is the milliseconds per MB of the broker role and of every
// other role together (ok false without a broker row: a cluster's broker
// runs in other processes).
func splitBroker(rows []RoleCPU) (broker, rest float64, ok bool) {
	for _, r := range rows {
		if r.Role == "broker" {
			broker, ok = r.MSPerMB, true
		} else {
			rest += r.MSPerMB
		}
	}
	return broker, rest, ok
}
