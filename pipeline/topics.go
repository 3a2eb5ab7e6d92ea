package pipeline

import (
	"fmt"
	"regexp"
)

// Topics names every topic of one run. Data-plane topics carry Arrow IPC
// streams; control-plane topics (census, incidents, policy) carry JSON.
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
}

var runRe = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}$`)

// TopicsFor returns the topic names of run ("<run>.<topic>").
func TopicsFor(run string) (Topics, error) {
	if !runRe.MatchString(run) {
		return Topics{}, fmt.Errorf("pipeline: run id %q: want letters, digits, '.', '_' or '-' (at most 128)", run)
	}
	p := run + "."
	return Topics{
		Tasks:        p + "tasks",
		Trajectories: p + "trajectories",
		Valid:        p + "valid",
		Rewarded:     p + "rewarded",
		Scored:       p + "scored",
		Batches:      p + "batches",
		Quarantine:   p + "quarantine",
		Census:       p + "census",
		Incidents:    p + "incidents",
		Policy:       p + "policy",
		Windows:      p + "windows",
	}, nil
}

// All lists every topic.
func (t Topics) All() []string {
	return []string{t.Tasks, t.Trajectories, t.Valid, t.Rewarded, t.Scored, t.Batches,
		t.Quarantine, t.Census, t.Incidents, t.Policy, t.Windows}
}

// DataPlane lists the topics that carry Arrow IPC streams.
func (t Topics) DataPlane() []string {
	return []string{t.Tasks, t.Trajectories, t.Valid, t.Rewarded, t.Scored, t.Batches}
}
