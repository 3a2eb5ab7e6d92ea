package audit

import (
	"sort"
	"sync"

	"github.com/trajflow/trajflow/schemas"
)

// Attempt is what the producer of an attempt knows about it when it is
// launched; Stream hands it back with the attempt's fate.
type Attempt struct {
	Seq          int64 // launch order
	Group        string
	Tokens       int   // every token of the trajectory (prompts, actions, observations)
	ActionTokens int   // policy-sampled tokens
	Lag          int64 // trainer version minus the oldest behavior version
	ProducedAt   int64 // unix nanoseconds
}

// Outcomes of an attempt.
const (
	OutcomeAdmitted    = "admitted"
	OutcomeFiltered    = "filtered"
	OutcomeQuarantined = "quarantined"
	// OutcomeExcluded: admitted to a batch, not trained (the trainer's lag
	// rule at the update).
	OutcomeExcluded = "excluded"
)

// Fate is the decided outcome of one launched attempt.
type Fate struct {
	ID string
	Attempt
	Outcome string
	Reason  string // filter or quarantine reason
	Batch   string // batch id when admitted
}

// Stream is the streaming form of Report.Account for long runs: it holds
// only the attempts still in flight, so its memory is bounded by the
// in-flight window rather than by the length of the run. Launch every
// attempt before its record is produced, then feed every batch and census
// event read back; each attempt's first decision is its fate, and an
// admission of an attempt that is no longer in flight (already decided, or
// never launched) is a duplicate, as is a repeated batch id. Safe for
// concurrent use.
type Stream struct {
	mu      sync.Mutex
	pending map[string]Attempt
	// excluded are ids the train stage excluded at the update (census
	// filtered of stage train): read before their batch (pending) they
	// count as Excluded when it arrives; after it, Admitted becomes
	// Excluded once.
	excluded map[string]bool // id -> counted already
	batches  map[string]struct{}
	counts   Counts
	dups     []string // up to 20 duplicated ids, for diagnosis
}

// NewStream returns an empty Stream.
func NewStream() *Stream {
	return &Stream{pending: map[string]Attempt{}, batches: map[string]struct{}{}, excluded: map[string]bool{}}
}

// Launch registers an attempt as in flight.
func (s *Stream) Launch(id string, a Attempt) {
	s.mu.Lock()
	s.pending[id] = a
	s.counts.Launched++
	s.mu.Unlock()
}

// Batch accounts the attempts a packed batch admits and returns their
// fates (duplicates are counted, not returned).
func (s *Stream) Batch(b *schemas.PackedBatch) []Fate {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.batches[b.BatchID]; dup {
		s.counts.Duplicated++
	}
	s.batches[b.BatchID] = struct{}{}
	var out []Fate
	for r := range b.Rows {
		for _, id := range b.Rows[r].SegTrajectoryIDs {
			a, ok := s.pending[id]
			if !ok {
				s.counts.Duplicated++
				if len(s.dups) < 20 {
					s.dups = append(s.dups, id+"@"+b.BatchID)
				}
				continue
			}
			delete(s.pending, id)
			if _, ex := s.excluded[id]; ex {
				s.excluded[id] = true
				s.counts.Excluded++
				out = append(out, Fate{ID: id, Attempt: a, Outcome: OutcomeExcluded, Batch: b.BatchID})
				continue
			}
			s.counts.Admitted++
			out = append(out, Fate{ID: id, Attempt: a, Outcome: OutcomeAdmitted, Batch: b.BatchID})
		}
	}
	return out
}

// Census accounts a filtered or quarantined census event; it reports the
// fate when the event decided an in-flight attempt (other kinds, and
// repeated events of decided attempts, report false). A filtered event of
// the train stage (excluded at the update) never decides a fate — the
// attempt's batch does — but moves the attempt from Admitted to Excluded.
func (s *Stream) Census(ev *schemas.CensusEvent) (Fate, bool) {
	var outcome string
	switch ev.Kind {
	case schemas.CensusFiltered:
		outcome = OutcomeFiltered
	case schemas.CensusQuarantined:
		outcome = OutcomeQuarantined
	default:
		return Fate{}, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.pending[ev.AttemptID]
	if outcome == OutcomeFiltered && ev.Stage == TrainStage {
		// Excluded at the update: its batch decided its fate.
		if counted, seen := s.excluded[ev.AttemptID]; !ok && (!seen || !counted) {
			s.excluded[ev.AttemptID] = true
			s.counts.Admitted--
			s.counts.Excluded++
		} else if ok && !seen {
			s.excluded[ev.AttemptID] = false
		}
		return Fate{}, false
	}
	if !ok {
		return Fate{}, false
	}
	delete(s.pending, ev.AttemptID)
	if outcome == OutcomeFiltered {
		s.counts.Filtered++
	} else {
		s.counts.Quarantined++
	}
	return Fate{ID: ev.AttemptID, Attempt: a, Outcome: outcome, Reason: ev.Reason}, true
}

// InFlight is the number of launched attempts not yet decided.
func (s *Stream) InFlight() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pending)
}

// Counts returns the accounting so far. Lost counts the attempts still in
// flight (lost only once the pipeline is drained), LostIDs lists up to 20
// of them.
func (s *Stream) Counts() Counts {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.counts
	c.Lost = len(s.pending)
	for id := range s.pending {
		c.LostIDs = append(c.LostIDs, id)
	}
	sort.Strings(c.LostIDs)
	if len(c.LostIDs) > 20 {
		c.LostIDs = c.LostIDs[:20]
	}
	return c
}

// Undecided returns up to limit of the attempts still in flight, by id.
func (s *Stream) Undecided(limit int) map[string]Attempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]Attempt{}
	for id, a := range s.pending {
		if len(out) >= limit {
			break
		}
		out[id] = a
	}
	return out
}

// Duplicates lists up to 20 admissions counted as duplicates, as
// "id@batch".
func (s *Stream) Duplicates() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.dups...)
}
