package pack

import (
	"github.com/trajflow/trajflow/internal/idset"
)

// deadlines tracks, in asynchronous mode, the groups running and not yet
// decided by this pack (census "started" events), with the policy version
// each one's rollout started at. A group started at version v has its last
// chance to be trained within MaxLag in the batch the trainer trains at
// version v + MaxLag; the open window keeps a place for every such group
// whose last chance it is, and a younger group that would take that place
// waits for the next window (earliest deadline first, docs/ARCHITECTURE.md
// "Pacing"). Without it a straggler continued under a newer policy is
// overtaken by younger groups that fill its last window, and its first
// turns are masked as stale at the update.
//
// The tracker is a scheduling hint, never a decision the accounting relies
// on: a group it does not know of (started before a restart of pack, or
// its event not read yet) only loses its reservation; a reservation whose
// group never comes is dropped after StageConfig.DeadlineWait.
type deadlines struct {
	maxLag int64
	open   map[string]int64 // running, undecided group → version it started at
	// done holds the groups decided (or given up on), the oldest forgotten
	// beyond its ring's capacity: a started event read after its group
	// was decided (the census lags the scored topic) reserves nothing.
	done     *idset.Set
	doneRing *idset.Ring
}

func newDeadlines(maxLag int64, memory int) *deadlines {
	return &deadlines{maxLag: maxLag, open: map[string]int64{}, done: idset.New(), doneRing: idset.NewRing(memory)}
}

// started records that group's rollout started at policy version v (a try
// run again starts again, on a version at least as new). A group still
// waiting for a rollout worker is not tracked: it starts on the newest
// version, which its dispatch version only bounds from below (reserving
// for the queue would make every window wait for the groups dispatched
// with its predecessor's policy).
func (d *deadlines) started(group string, v int64) {
	if group == "" || d.done.Has(group) {
		return
	}
	if old, ok := d.open[group]; !ok || v > old {
		d.open[group] = v
	}
}

// decided records that group reached pack (or will never be waited for).
func (d *deadlines) decided(group string) {
	delete(d.open, group)
	if group == "" || d.done.Has(group) {
		return
	}
	if oldest, dropped := d.doneRing.Push(d.done.Add(group)); dropped {
		d.done.Delete(oldest)
	}
}

// reserved is the number of running groups that must be trained at
// trainer version e or earlier to stay within MaxLag: the places a window
// trained at e keeps for them.
func (d *deadlines) reserved(e int64) int {
	n := 0
	for _, v := range d.open {
		if v+d.maxLag <= e {
			n++
		}
	}
	return n
}

// expire gives up on the groups reserved at version e (their window waited
// DeadlineWait for them) and returns their number.
func (d *deadlines) expire(e int64) int {
	var gone []string
	for g, v := range d.open {
		if v+d.maxLag <= e {
			gone = append(gone, g)
		}
	}
	for _, g := range gone {
		d.decided(g)
	}
	return len(gone)
}
