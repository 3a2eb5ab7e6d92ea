package pack

import (
	"github.com/trajflow/trajflow/internal/idset"
)

// deadlines tracks, in asynchronous mode, the groups dispatched and not yet
// decided by this pack (census "dispatched" and "started" events), with the
// policy version each one's rollout started at. A group started at version
// v has its last chance to be trained within MaxLag in the batch the trainer trains at
// version v + MaxLag; the open window keeps a place for every such group
// whose last chance it is, and a younger group that would take that place
// waits for the next window (earliest deadline first, docs/ARCHITECTURE.md
// "Pacing"). Without it a straggler continued under a newer policy is
// overtaken by younger groups that fill its last window, and its first
// turns are masked as stale at the update.
//
// The tracker is a scheduling hint, never a decision the accounting relies
// on: a group it does not know of (dispatched before a restart of pack, or
// its event not read yet) only loses its reservation; a reservation whose
// group never comes is dropped after StageConfig.DeadlineWait.
type deadlines struct {
	maxLag int64
	open   map[string]episode // undecided groups
	// done holds the groups decided (or given up on), the oldest forgotten
	// beyond its ring's capacity: a dispatched event read after its group
	// was decided (the census lags the scored topic) reserves nothing.
	done     *idset.Set
	doneRing *idset.Ring
}

// episode is what pack knows of an undecided group: the version it was
// dispatched at, or, once its rollout started (census "started"), the
// version its first turn samples with.
type episode struct {
	version int64
	started bool
}

func newDeadlines(maxLag int64, memory int) *deadlines {
	return &deadlines{maxLag: maxLag, open: map[string]episode{}, done: idset.New(), doneRing: idset.NewRing(memory)}
}

// dispatched records that group was dispatched at policy version v.
func (d *deadlines) dispatched(group string, v int64) {
	if group == "" || d.done.Has(group) {
		return
	}
	if _, ok := d.open[group]; !ok {
		d.open[group] = episode{version: v}
	}
}

// started records that group's rollout started at policy version v (a try
// run again starts again, on a version at least as new).
func (d *deadlines) started(group string, v int64) {
	if group == "" || d.done.Has(group) {
		return
	}
	if e, ok := d.open[group]; !ok || !e.started || v > e.version {
		d.open[group] = episode{version: v, started: true}
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
// trained at e keeps for them. A group still waiting for a rollout worker
// reserves nothing: it starts on the newest version, which its dispatch
// version only bounds from below (reserving for the queue would make every
// window wait for the groups dispatched with its predecessor's policy).
func (d *deadlines) reserved(e int64) int {
	n := 0
	for _, ep := range d.open {
		if ep.started && ep.version+d.maxLag <= e {
			n++
		}
	}
	return n
}

// expire gives up on the groups reserved at version e (their window waited
// DeadlineWait for them) and returns their number.
func (d *deadlines) expire(e int64) int {
	var gone []string
	for g, ep := range d.open {
		if ep.started && ep.version+d.maxLag <= e {
			gone = append(gone, g)
		}
	}
	for _, g := range gone {
		d.decided(g)
	}
	return len(gone)
}
