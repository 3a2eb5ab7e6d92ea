package envsvc

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/trajflow/trajflow/connectors/env/capability"
	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/internal/strictjson"
	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// Config configures a Server. Zero durations and sizes take the defaults.
type Config struct {
	// Registries are the families served (one registry per family).
	Registries []*rollout.Registry
	// Key is the capability run key (capability.KeySize bytes) shared with
	// the controllers that mint the tokens.
	Key []byte
	// Store persists episodes and transitions; every transition is written
	// to it before it is acknowledged. Open it with SyncWrites for
	// durability across a machine crash (a process crash loses nothing
	// written without it). nil: an in-memory store (nothing survives the
	// process).
	Store *state.Store
	// MaxEpisodes is the number of episode slots (default 1024).
	MaxEpisodes int
	// StepTimeout caps one step's execution and persistence (default 5 s);
	// a step past it is answered Unknown (step_timeout) and finishes in
	// the background, where a status query finds its outcome.
	StepTimeout time.Duration
	// MaxObservationBytes caps one transition's observation, JSON-encoded
	// (default 64 KiB); a larger one ends the episode as an
	// infrastructure failure (observation_size).
	MaxObservationBytes int
	// DefaultLease is the lease of a request that asks for none (default
	// 10 s); MaxLease bounds what a request may ask (default 2 min).
	DefaultLease, MaxLease time.Duration
	// ReapInterval is how often expired leases are collected (default
	// 100 ms).
	ReapInterval time.Duration
	// MaxRequestBytes bounds a request body (default 1 MiB).
	MaxRequestBytes int64
	// MaxTokenTTL is the longest capability token lifetime accepted
	// (default capability.DefaultMaxTTL, 10 min): a token expiring more
	// than MaxTokenTTL + capability.ClockSlack ahead is refused
	// (token_malformed). Clients mint tokens for 30 s by default.
	MaxTokenTTL time.Duration
	Now         func() time.Time
	Logger      *slog.Logger
	// Metrics receives the service's Prometheus collectors (nil: a new
	// registry, served at /metrics either way).
	Metrics MetricsRegisterer
}

// Server runs the episodes of its families behind the protocol. Create it
// with NewServer (which resumes what its store holds), serve Handler, and
// Close it when done.
type Server struct {
	cfg   Config
	ver   *capability.Verifier
	store *state.Store
	owned bool // store opened here
	fams  map[string]*rollout.Registry
	hash  map[string]string // family -> registry configuration hash
	met   *metrics
	put   func(key string, v any) error // persistence (tests inject faults)

	// Lock order: episode.mu, then Server.mu, then episode.leaseMu.
	mu     sync.Mutex
	nlive  atomic.Int64 // len(live), readable without mu
	live   map[string]*episode
	slots  []*episode
	free   []int // free slot indices, a stack: the slot freed last is reused first
	closed bool

	ctx     context.Context // steps run under it, not under their requests
	cancel  context.CancelFunc
	workers sync.WaitGroup
	reaper  chan struct{} // closed when the reaper returns
}

// episode is a live episode. mu serializes its actions (step, status
// query of its newest action, terminate, expiry); ended is set under mu.
type episode struct {
	id   string
	meta epMeta
	reg  *rollout.Registry
	slot int

	mu    sync.Mutex
	ep    rollout.Episode
	state []byte // world state as last persisted
	next  uint64
	steps map[uint64]*stepRec
	last  *rollout.Transition
	ended bool

	dead    atomic.Bool // ended (readable without mu)
	leaseMu sync.Mutex
	lease   time.Time
}

// Persisted records (keys under "env/1/ep/<id>/").
type epMeta struct {
	ID           string              `json:"id"`
	Run          string              `json:"run"`
	Attempt      schemas.TaskAttempt `json:"attempt"`
	Key          string              `json:"idempotency_key"`
	Family       string              `json:"family"`
	RegistryHash string              `json:"registry_hash"`
	Spec         rollout.Spec        `json:"spec"`
	Observation  rollout.Observation `json:"observation"`
	State        []byte              `json:"state"` // world state at allocation
	Slot         int                 `json:"slot"`
	CreatedMS    int64               `json:"created_unix_ms"`
	// LeaseMS is the lease expiry at allocation; renewals write the lease
	// record (the later of the two holds).
	LeaseMS int64 `json:"lease_expires_unix_ms"`
}

type stepRec struct {
	Seq        uint64             `json:"seq"`
	Key        string             `json:"idempotency_key"`
	ActionHash string             `json:"action_hash"`
	Turn       int32              `json:"turn"`
	Transition rollout.Transition `json:"transition"`
	State      []byte             `json:"state"` // world state after the step
}

type endRec struct {
	Status    string              `json:"status"`
	Reason    string              `json:"reason"`
	Steps     int                 `json:"steps"`
	NextSeq   uint64              `json:"next_seq"`
	Final     *rollout.Transition `json:"final,omitempty"`
	Artifacts string              `json:"artifacts"`
	EndedMS   int64               `json:"ended_unix_ms"`
}

const keyPrefix = "env/1/ep/"

// End reasons of episodes the service ends on its own (status infra),
// besides ReasonLeaseExpired, ReasonObservation and ReasonCapacity.
const (
	endSnapshotChanged = "snapshot_changed" // the registry configuration changed across a restart
	endCorruptLog      = "corrupt_log"      // a record of the episode is unreadable, or its steps have a gap
	endCorruptState    = "corrupt_state"    // the persisted world state does not resume
	endStateLost       = "state_lost"       // a failed write could not be rolled back
)

// MaxReasonBytes caps a terminate request's reason: a longer one is a
// bad_request (400) naming the field.
const MaxReasonBytes = 256

// reasonLabels are the end reasons counted under their own name in
// trajflow_env_episodes_ended_total: those the agent loop sends and those
// the service ends episodes with. Any other reason is counted as "other"
// (the reason itself is stored with the episode's end).
var reasonLabels = map[string]bool{
	rollout.ReasonAnswer: true, rollout.ReasonMaxTurns: true, rollout.ReasonTokenBudget: true, rollout.ReasonAborted: true,
	ReasonLeaseExpired: true, ReasonObservation: true, ReasonCapacity: true,
	endSnapshotChanged: true, endCorruptLog: true, endCorruptState: true, endStateLost: true,
}

// reasonLabel is the metric label of end reason r.
func reasonLabel(r string) string {
	if reasonLabels[r] {
		return r
	}
	return "other"
}

func metaKey(id string) string             { return keyPrefix + id + "/meta" }
func leaseKey(id string) string            { return keyPrefix + id + "/lease" }
func endKey(id string) string              { return keyPrefix + id + "/end" }
func stepKey(id string, seq uint64) string { return fmt.Sprintf("%s%s/step/%020d", keyPrefix, id, seq) }

// NewServer validates cfg, opens an in-memory store if it has none, and
// resumes every episode the store holds that has not ended: its world
// state is the one persisted with its last transition; an episode whose
// lease ran out while the service was down, or whose registry
// configuration changed, ends as an infrastructure failure. Call Close to
// stop the lease reaper and wait for steps in flight.
func NewServer(cfg Config) (*Server, error) {
	if len(cfg.Registries) == 0 {
		return nil, errors.New("envsvc: server: no registries")
	}
	ver, err := capability.NewVerifier(cfg.Key, cfg.Now)
	if err != nil {
		return nil, fmt.Errorf("envsvc: server: %w", err)
	}
	ver = ver.WithMaxTTL(cfg.MaxTokenTTL)
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	if cfg.MaxEpisodes <= 0 {
		cfg.MaxEpisodes = 1024
	}
	if cfg.MaxObservationBytes <= 0 {
		cfg.MaxObservationBytes = 64 << 10
	}
	if cfg.MaxRequestBytes <= 0 {
		cfg.MaxRequestBytes = 1 << 20
	}
	def(&cfg.StepTimeout, 5*time.Second)
	def(&cfg.DefaultLease, 10*time.Second)
	def(&cfg.MaxLease, 2*time.Minute)
	def(&cfg.ReapInterval, 100*time.Millisecond)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s := &Server{cfg: cfg, ver: ver, store: cfg.Store, fams: map[string]*rollout.Registry{}, hash: map[string]string{},
		live: map[string]*episode{}, slots: make([]*episode, cfg.MaxEpisodes), reaper: make(chan struct{})}
	for _, r := range cfg.Registries {
		f := r.Family()
		if _, dup := s.fams[f]; dup {
			return nil, fmt.Errorf("envsvc: server: two registries of family %q", f)
		}
		s.fams[f] = r
		b, _ := json.Marshal(r.Config())
		h := sha256.Sum256(b)
		s.hash[f] = hex.EncodeToString(h[:])
	}
	for i := cfg.MaxEpisodes - 1; i >= 0; i-- {
		s.free = append(s.free, i)
	}
	if s.store == nil {
		if s.store, err = state.Open("", state.Options{}); err != nil {
			return nil, fmt.Errorf("envsvc: server: %w", err)
		}
		s.owned = true
	}
	s.put = s.persist
	s.met = newMetrics(cfg.Metrics)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if err := s.recover(); err != nil {
		s.cancel()
		if s.owned {
			s.store.Close()
		}
		return nil, err
	}
	go s.reap()
	return s, nil
}

// Close stops the reaper, refuses new requests and waits for the steps in
// flight to be persisted. It does not close a store it was given.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	<-s.reaper
	s.workers.Wait()
	if s.owned {
		return s.store.Close()
	}
	return nil
}

// Live returns the number of live episodes.
func (s *Server) Live() int { return int(s.nlive.Load()) }

func (s *Server) persist(key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	t0 := time.Now()
	err = s.store.Set([]byte(key), b, 0)
	s.met.persist.Observe(time.Since(t0).Seconds())
	return err
}

func (s *Server) load(key string, v any) (bool, error) {
	b, err := s.store.Get([]byte(key))
	if errors.Is(err, state.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return false, fmt.Errorf("%w: record %s: %w", errCorrupt, key, err)
	}
	return true, nil
}

// errCorrupt is wrapped by load's errors about an unreadable record.
var errCorrupt = errors.New("envsvc: unreadable record")

// recordRefusal is the refusal of a request whose episode's records could
// not be read (err, from lookup or load): an unreadable record ended the
// episode (episode_ended, corrupt_log); a store failure may pass
// (persist_failed, retry).
func (s *Server) recordRefusal(err error) (Response, string) {
	if errors.Is(err, errCorrupt) {
		return s.refused(ReasonEpisodeEnded, err.Error(), false), endCorruptLog
	}
	return s.refused(ReasonPersistFailed, err.Error(), true), ""
}

// recover resumes the episodes of the store.
func (s *Server) recover() error {
	type found struct {
		meta    *epMeta
		lease   int64
		ended   bool
		steps   []*stepRec
		corrupt []string // keys of unreadable records
	}
	byID := map[string]*found{}
	get := func(id string) *found {
		f := byID[id]
		if f == nil {
			f = &found{}
			byID[id] = f
		}
		return f
	}
	err := s.store.Scan(s.ctx, []byte(keyPrefix), func(k, v []byte) error {
		id, kind, ok := strings.Cut(strings.TrimPrefix(string(k), keyPrefix), "/")
		if !ok {
			return nil
		}
		f := get(id)
		var err error
		switch {
		case kind == "meta":
			m := &epMeta{}
			if err = json.Unmarshal(v, m); err == nil {
				f.meta = m
			}
		case kind == "lease":
			f.lease, err = strconv.ParseInt(string(v), 10, 64)
		case kind == "end":
			f.ended = true
		case strings.HasPrefix(kind, "step/"):
			r := &stepRec{}
			if err = json.Unmarshal(v, r); err == nil {
				f.steps = append(f.steps, r)
			}
		}
		if err != nil {
			f.corrupt = append(f.corrupt, string(k))
			s.cfg.Logger.Error("unreadable record", "key", string(k), "episode", id, "err", err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("envsvc: recover: %w", err)
	}
	ids := make([]string, 0, len(byID))
	for id := range byID {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	now := s.cfg.Now()
	for _, id := range ids {
		f := byID[id]
		if f.ended {
			continue
		}
		if len(f.corrupt) > 0 {
			// End only this episode: its log cannot be trusted.
			rec := s.recoveredEnd(f.meta, f.steps, false, endCorruptLog, now)
			if err := s.put(endKey(id), rec); err != nil {
				return fmt.Errorf("envsvc: recover %s: end of an episode with unreadable records (%s): %w", id, strings.Join(f.corrupt, ", "), err)
			}
			s.met.ended.WithLabelValues(StatusInfra, endCorruptLog).Inc()
			s.cfg.Logger.Warn("episode not resumed", "episode", id, "reason", endCorruptLog, "keys", strings.Join(f.corrupt, ", "))
			continue
		}
		if f.meta == nil {
			continue
		}
		e, reason := s.resume(f.meta, f.steps)
		if e == nil {
			// It ends here, and keeps what it executed: status answers for
			// its actions, terminate reports them.
			rec := s.recoveredEnd(f.meta, f.steps, true, reason, now)
			if err := s.put(endKey(id), rec); err != nil {
				return fmt.Errorf("envsvc: recover %s: %w", id, err)
			}
			s.met.ended.WithLabelValues(StatusInfra, reasonLabel(reason)).Inc()
			s.cfg.Logger.Warn("episode not resumed", "episode", id, "reason", reason)
			continue
		}
		e.lease = time.UnixMilli(max(f.lease, f.meta.LeaseMS))
		if !now.Before(e.lease) {
			e.mu.Lock()
			err := s.end(e, StatusInfra, ReasonLeaseExpired, rollout.ReasonAborted)
			e.mu.Unlock()
			if err != nil {
				return fmt.Errorf("envsvc: recover %s: %w", id, err)
			}
			continue
		}
		s.cfg.Logger.Info("episode resumed", "episode", id, "next_seq", e.next)
	}
	return nil
}

// executedPrefix sorts steps by sequence number and returns those
// numbered 1, 2, ... up to the first gap, and whether that is all of them.
func executedPrefix(steps []*stepRec) ([]*stepRec, bool) {
	sort.Slice(steps, func(i, j int) bool { return steps[i].Seq < steps[j].Seq })
	for i, r := range steps {
		if r.Seq != uint64(i+1) {
			return steps[:i], false
		}
	}
	return steps, true
}

// resume rebuilds a live episode from its records, or says why it cannot.
// It leaves steps' world states in place unless it succeeds.
func (s *Server) resume(m *epMeta, steps []*stepRec) (*episode, string) {
	reg := s.fams[m.Family]
	if reg == nil || s.hash[m.Family] != m.RegistryHash {
		return nil, endSnapshotChanged
	}
	steps, whole := executedPrefix(steps)
	if !whole {
		return nil, endCorruptLog
	}
	st := m.State
	e := &episode{id: m.ID, meta: *m, reg: reg, next: uint64(len(steps)) + 1, steps: map[uint64]*stepRec{}}
	for _, r := range steps {
		e.steps[r.Seq] = r
		st = r.State
		tr := r.Transition
		e.last = &tr
	}
	ep, err := reg.Resume(m.Attempt, st)
	if err != nil {
		return nil, endCorruptState
	}
	e.ep, e.state = ep, st
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.free) == 0 {
		return nil, ReasonCapacity
	}
	for _, r := range steps {
		r.State = nil // memory keeps only the newest state (e.state)
	}
	e.slot = s.takeSlot(m.Slot)
	s.slots[e.slot] = e
	s.live[e.id] = e
	s.setLive()
	return e, ""
}

// recoveredEnd is the end record of an episode that ends at recovery
// (reason) instead of resuming: its executed steps, the sequence number it
// would have expected next, and — when its log is whole (every record
// read, intact, and no gap), so that the last step read is the last one
// executed — its final transition and artifacts, so that it answers
// status queries and terminate as any ended episode does. m is nil when
// the episode's meta record is unreadable.
func (s *Server) recoveredEnd(m *epMeta, steps []*stepRec, intact bool, reason string, now time.Time) endRec {
	done, all := executedPrefix(steps)
	rec := endRec{Status: StatusInfra, Reason: reason, Steps: len(done), NextSeq: uint64(len(done)) + 1, EndedMS: now.UnixMilli()}
	if !intact || !all || m == nil {
		return rec
	}
	st := m.State
	if n := len(done); n > 0 {
		tr := done[n-1].Transition
		rec.Final, st = &tr, done[n-1].State
	}
	rec.Artifacts = s.closedArtifacts(m, st)
	return rec
}

// closedArtifacts returns the artifacts that closing the episode of m at
// world state st gives, for an episode that does not resume. The registry
// that allocated it (its family, served at the same configuration)
// resumes and closes it; failing that (the family is no longer served or
// changed, the state does not resume), the state's "artifacts" member:
// the built-in families keep their evidence there, and their Close
// returns exactly those bytes (TestRecoveredArtifactsAsClosed). "" when
// there is none.
func (s *Server) closedArtifacts(m *epMeta, st []byte) string {
	if reg := s.fams[m.Family]; reg != nil && s.hash[m.Family] == m.RegistryHash {
		if ep, err := reg.Resume(m.Attempt, st); err == nil {
			if fin, err := ep.Close(s.ctx, rollout.ReasonAborted); err == nil {
				return fin.Artifacts
			}
		}
	}
	var doc struct {
		Artifacts json.RawMessage `json:"artifacts"`
	}
	if json.Unmarshal(st, &doc) == nil && len(doc.Artifacts) > 0 && doc.Artifacts[0] == '{' {
		return string(doc.Artifacts)
	}
	return ""
}

// takeSlot removes slot want from the free stack if it is free, else the
// top of the stack, and returns it. s.mu is held.
func (s *Server) takeSlot(want int) int {
	for i := len(s.free) - 1; i >= 0; i-- {
		if s.free[i] == want {
			s.free = append(s.free[:i], s.free[i+1:]...)
			return want
		}
	}
	n := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	return n
}

// end ends e (e.mu held): it closes the family episode, persists the end
// record, frees the slot and scrubs the episode's state.
func (s *Server) end(e *episode, status, reason, closeReason string) error {
	var fin rollout.Final
	if e.ep != nil {
		var err error
		if fin, err = e.ep.Close(s.ctx, closeReason); err != nil {
			fin = rollout.Final{}
			s.cfg.Logger.Error("episode close failed", "episode", e.id, "err", err)
		}
	}
	rec := endRec{Status: status, Reason: reason, Steps: len(e.steps), NextSeq: e.next, Final: e.last,
		Artifacts: fin.Artifacts, EndedMS: s.cfg.Now().UnixMilli()}
	if err := s.put(endKey(e.id), rec); err != nil {
		return err
	}
	e.ended = true
	e.dead.Store(true)
	s.mu.Lock()
	delete(s.live, e.id)
	s.slots[e.slot] = nil
	s.free = append(s.free, e.slot)
	s.setLive()
	s.mu.Unlock()
	// Scrub: nothing of the episode's world survives in memory; the next
	// episode of this slot starts from its own task snapshot.
	e.ep, e.state, e.steps, e.last = nil, nil, nil, nil
	e.meta.Observation, e.meta.State = rollout.Observation{}, nil
	s.met.ended.WithLabelValues(status, reasonLabel(reason)).Inc()
	return nil
}

// reap ends the episodes whose lease ran out.
func (s *Server) reap() {
	defer close(s.reaper)
	t := time.NewTicker(s.cfg.ReapInterval)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		now := s.cfg.Now()
		s.mu.Lock()
		var due []*episode
		for _, e := range s.live {
			e.leaseMu.Lock()
			if !now.Before(e.lease) {
				due = append(due, e)
			}
			e.leaseMu.Unlock()
		}
		s.mu.Unlock()
		for _, e := range due {
			if !e.mu.TryLock() {
				continue // busy: the step's own lease check, or the next tick
			}
			if !e.ended && s.expired(e) {
				if err := s.end(e, StatusInfra, ReasonLeaseExpired, rollout.ReasonAborted); err != nil {
					s.cfg.Logger.Error("expired episode not ended", "episode", e.id, "err", err)
				} else {
					s.cfg.Logger.Warn("lease expired", "episode", e.id)
				}
			}
			e.mu.Unlock()
		}
	}
}

func (s *Server) expired(e *episode) bool {
	e.leaseMu.Lock()
	defer e.leaseMu.Unlock()
	return !s.cfg.Now().Before(e.lease)
}

// leaseFor is the lease a request asking for ms milliseconds gets: the
// default for none, at most MaxLease (compared in milliseconds, so that
// an ask near MaxInt64 cannot wrap around as a Duration).
func (s *Server) leaseFor(ms int64) time.Duration {
	switch {
	case ms <= 0:
		return min(s.cfg.DefaultLease, s.cfg.MaxLease)
	case ms >= s.cfg.MaxLease.Milliseconds():
		return s.cfg.MaxLease
	}
	return time.Duration(ms) * time.Millisecond
}

// Handler returns the protocol's HTTP handler.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+PathEpisodes, s.handleAllocate)
	mux.HandleFunc("POST "+PathStep, s.handleStep)
	mux.HandleFunc("POST "+PathStatus, s.handleStatus)
	mux.HandleFunc("POST "+PathRenew, s.handleRenew)
	mux.HandleFunc("POST "+PathTerminate, s.handleTerminate)
	mux.HandleFunc("GET "+PathHealth, s.handleHealth)
	mux.Handle("GET "+PathMetrics, s.met.handler())
	return mux
}

// setLive publishes the number of live episodes (s.mu held).
func (s *Server) setLive() {
	s.nlive.Store(int64(len(s.live)))
	s.met.live.Set(float64(len(s.live)))
}

// base is the common part of a response. It takes no lock, so it may be
// built under any of them.
func (s *Server) base(outcome, reason, detail string, retry bool) Response {
	return Response{Protocol: ProtocolVersion, Outcome: outcome, Reason: reason, Detail: detail, Retry: retry,
		Live: int(s.nlive.Load()), Capacity: s.cfg.MaxEpisodes}
}

func (s *Server) refused(reason, detail string, retry bool) Response {
	return s.base(Refused, reason, detail, retry)
}

// decode reads a request body into v; it answers a bad request itself.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, op string, v any, protocol func() int) bool {
	_, ok := s.decodeBody(w, r, op, v, protocol)
	return ok
}

// decodeBody is decode returning the body as received too.
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, op string, v any, protocol func() int) ([]byte, bool) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		s.reply(w, op, http.StatusServiceUnavailable, s.refused(ReasonShuttingDown, "", true))
		return nil, false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxRequestBytes))
	if err == nil {
		// Strictly: the token is checked against the raw bytes of named
		// fields (boundAction), so the decoded request must not read
		// another field than those bytes (a key of another case, a key
		// given twice).
		err = strictjson.Unmarshal(body, v)
	}
	if err == nil && protocol() != ProtocolVersion {
		err = fmt.Errorf("protocol %d, this service speaks %d", protocol(), ProtocolVersion)
	}
	if err != nil {
		s.reply(w, op, http.StatusBadRequest, s.refused(ReasonBadRequest, err.Error(), false))
		return nil, false
	}
	return body, true
}

// rawFields returns the bytes, as received, of the named top-level
// fields of a JSON object body (nil for one absent).
func rawFields(body []byte, names ...string) ([][]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	out := make([][]byte, len(names))
	for i, n := range names {
		out[i] = m[n]
	}
	return out, nil
}

// absentFields returns the named top-level fields of a JSON object body
// that it lacks or gives as null: a required field so given is missing
// (decoding would read it as its zero value, e.g. a seq of 0).
func absentFields(body []byte, names ...string) ([]string, error) {
	raw, err := rawFields(body, names...)
	if err != nil {
		return nil, err
	}
	return absentOf(raw, names), nil
}

// absentOf names the fields of raw (rawFields' answer for names) that are
// absent or null.
func absentOf(raw [][]byte, names []string) []string {
	var out []string
	for i, n := range names {
		if len(raw[i]) == 0 || string(raw[i]) == "null" {
			out = append(out, n)
		}
	}
	return out
}

// boundAction is the action bytes a token binds, built from the request's
// own bytes: {"<a>":<value of a as sent>,"<b>":<value of b as sent>}.
// A client in any language signs what it sends (docs/ENV_PROTOCOL.md,
// "Capability tokens"); the Go client's AllocateAction and StepAction
// build the same bytes from the values it marshals. Absent (or null)
// fields are returned by name, and no bytes.
func boundAction(body []byte, a, b string) ([]byte, []string, error) {
	raw, err := rawFields(body, a, b)
	if err != nil {
		return nil, nil, err
	}
	if absent := absentOf(raw, []string{a, b}); len(absent) > 0 {
		return nil, absent, nil
	}
	out := make([]byte, 0, len(a)+len(b)+len(raw[0])+len(raw[1])+10)
	out = append(append(append(out, `{"`...), a...), `":`...)
	out = append(append(append(append(out, raw[0]...), `,"`...), b...), `":`...)
	return append(append(out, raw[1]...), '}'), nil, nil
}

// outcomeOf extracts the common part of a response for metrics.
type outcomeOf interface{ common() Response }

func (r Response) common() Response { return r }

// missingFields names, sorted, the required fields a request lacks: those
// absent (absentFields) and the empty ones of fields (JSON names); ""
// when none is missing.
func missingFields(absent []string, fields map[string]string) string {
	names := slices.Clone(absent)
	for name, v := range fields {
		if v == "" {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return ""
	}
	slices.Sort(names)
	return "missing " + strings.Join(names, ", ")
}

// reply writes v with code; a bad_request refusal is always answered 400,
// whichever check found it.
func (s *Server) reply(w http.ResponseWriter, op string, code int, v outcomeOf) {
	c := v.common()
	if c.Reason == ReasonBadRequest {
		code = http.StatusBadRequest
	}
	s.met.requests.WithLabelValues(op, c.Outcome, c.Reason).Inc()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set(HeaderProtocol, strconv.Itoa(ProtocolVersion))
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func tokenReason(err error) string {
	switch {
	case errors.Is(err, capability.ErrForged):
		return ReasonTokenForged
	case errors.Is(err, capability.ErrExpired):
		return ReasonTokenExpired
	case errors.Is(err, capability.ErrScope):
		return ReasonTokenScope
	}
	return ReasonTokenMalformed
}

func hashHex(b []byte) string {
	h := capability.ActionHash(b)
	return hex.EncodeToString(h[:])
}

// episodeID is the id of the episode that (attempt, key) allocates.
func episodeID(a schemas.TaskAttempt, key string) string {
	h := sha256.Sum256([]byte("trajflow-env/1 episode\x00" + a.RunID + "\x00" + a.AttemptID + "\x00" + key))
	return "ep-" + hex.EncodeToString(h[:16])
}

func (s *Server) handleAllocate(w http.ResponseWriter, r *http.Request) {
	var req AllocateRequest
	body, ok := s.decodeBody(w, r, "allocate", &req, func() int { return req.Protocol })
	if !ok {
		return
	}
	action, absent, err := boundAction(body, "attempt", "idempotency_key")
	if err != nil || len(absent) > 0 {
		s.reply(w, "allocate", http.StatusBadRequest, AllocateResponse{Response: s.refused(ReasonBadRequest, cmp.Or(missingFields(absent, nil), fmt.Sprint(err)), false)})
		return
	}
	s.reply(w, "allocate", http.StatusOK, s.allocate(req, action))
}

// allocate answers an allocation whose token binds action (boundAction).
func (s *Server) allocate(req AllocateRequest, action []byte) AllocateResponse {
	a := req.Attempt
	if missing := missingFields(nil, map[string]string{"attempt.attempt_id": a.AttemptID, "attempt.run_id": a.RunID,
		"idempotency_key": req.IdempotencyKey, "token": req.Token}); missing != "" {
		return AllocateResponse{Response: s.refused(ReasonBadRequest, missing, false)}
	}
	if _, err := s.ver.Verify(req.Token, a.RunID, AllocateScope(a), 0, action); err != nil {
		return AllocateResponse{Response: s.refused(tokenReason(err), err.Error(), false)}
	}
	id := episodeID(a, req.IdempotencyKey)
	lease := s.leaseFor(req.LeaseMS)
	for {
		s.mu.Lock()
		e := s.live[id]
		s.mu.Unlock()
		if e == nil {
			break
		}
		// A repeated allocation: the same episode, once its allocation is
		// persisted (the allocating request holds e.mu until then).
		e.mu.Lock()
		ended := e.ended
		var resp AllocateResponse
		if !ended {
			e.leaseMu.Lock()
			exp := e.lease
			e.leaseMu.Unlock()
			resp = AllocateResponse{Response: s.base(Executed, "", "", false), EpisodeID: id, LeaseExpiresMS: exp.UnixMilli(),
				Spec: e.meta.Spec, Observation: e.meta.Observation, Slot: e.slot}
		}
		e.mu.Unlock()
		if !ended {
			return resp
		}
		// It ended meanwhile (or its allocation failed): ask the store.
		s.mu.Lock()
		gone := s.live[id] != e
		s.mu.Unlock()
		if gone {
			break
		}
	}
	var end endRec
	if ok, err := s.load(endKey(id), &end); err != nil {
		return AllocateResponse{Response: s.refused(ReasonPersistFailed, err.Error(), true)}
	} else if ok {
		return AllocateResponse{Response: s.refused(ReasonEpisodeEnded, "episode "+id+" ended: "+end.Reason, false), EpisodeID: id}
	}
	var reg *rollout.Registry
	for _, g := range s.fams {
		if _, ok := g.Lookup(a.TaskID); ok {
			reg = g
		}
	}
	if reg == nil {
		return AllocateResponse{Response: s.refused(ReasonUnknownTask, fmt.Sprintf("task %q is in none of the served families", a.TaskID), false)}
	}
	ep, obs, err := reg.Reset(s.ctx, a)
	if err != nil {
		if errors.Is(err, rollout.ErrUnknownTask) {
			return AllocateResponse{Response: s.refused(ReasonUnknownTask, err.Error(), false)}
		}
		return AllocateResponse{Response: s.refused(ReasonEnvironment, err.Error(), true)}
	}
	sf, ok := ep.(rollout.Stateful)
	if !ok {
		return AllocateResponse{Response: s.refused(ReasonEnvironment, "the family's episodes cannot be persisted", false)}
	}
	st, err := sf.State()
	if err != nil {
		return AllocateResponse{Response: s.refused(ReasonEnvironment, err.Error(), true)}
	}
	now := s.cfg.Now()
	e := &episode{id: id, reg: reg, ep: ep, state: st, next: 1, steps: map[uint64]*stepRec{}, lease: now.Add(lease)}
	e.meta = epMeta{ID: id, Run: a.RunID, Attempt: a, Key: req.IdempotencyKey, Family: reg.Family(), RegistryHash: s.hash[reg.Family()],
		Spec: ep.Spec(), Observation: obs, State: st, CreatedMS: now.UnixMilli()}
	e.mu.Lock()
	defer e.mu.Unlock()
	s.mu.Lock()
	if s.live[id] != nil { // a concurrent twin allocated it first
		s.mu.Unlock()
		return AllocateResponse{Response: s.refused(ReasonCapacity, "a concurrent allocation of the same episode is in progress", true)}
	}
	if len(s.free) == 0 {
		s.mu.Unlock()
		return AllocateResponse{Response: s.refused(ReasonCapacity, fmt.Sprintf("all %d episode slots are in use", s.cfg.MaxEpisodes), true)}
	}
	e.slot = s.takeSlot(-1)
	e.meta.Slot = e.slot
	s.slots[e.slot] = e
	s.live[id] = e
	s.setLive()
	s.mu.Unlock()
	// Persist before answering: the meta record (with the lease) makes the
	// episode exist for recovery.
	e.meta.LeaseMS = e.lease.UnixMilli()
	if err = s.put(metaKey(id), e.meta); err != nil {
		s.mu.Lock()
		delete(s.live, id)
		s.slots[e.slot] = nil
		s.free = append(s.free, e.slot)
		s.setLive()
		s.mu.Unlock()
		e.ended = true
		e.dead.Store(true)
		return AllocateResponse{Response: s.refused(ReasonPersistFailed, err.Error(), true)}
	}
	s.met.allocated.WithLabelValues(reg.Family()).Inc()
	return AllocateResponse{Response: s.base(Executed, "", "", false), EpisodeID: id, LeaseExpiresMS: e.lease.UnixMilli(),
		Spec: e.meta.Spec, Observation: obs, Slot: e.slot}
}

// lookup returns the live episode of id, or the records of an ended one.
func (s *Server) lookup(id string) (*episode, *epMeta, *endRec, error) {
	s.mu.Lock()
	e := s.live[id]
	s.mu.Unlock()
	if e != nil {
		return e, &e.meta, nil, nil
	}
	var m epMeta
	ok, err := s.load(metaKey(id), &m)
	if err != nil || !ok {
		return nil, nil, nil, err
	}
	var end endRec
	if ok, err := s.load(endKey(id), &end); err != nil {
		return nil, nil, nil, err
	} else if !ok {
		end = endRec{Status: StatusInfra, Reason: "not_resumed"}
	}
	return nil, &m, &end, nil
}

func (s *Server) handleStep(w http.ResponseWriter, r *http.Request) {
	s.handleStepOrStatus(w, r, "step")
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) {
	s.handleStepOrStatus(w, r, "status")
}

// handleStepOrStatus answers a step or a status query (op), whose token
// binds the turn and action as sent. A request without one of its
// required fields is a bad request, answered before any token is looked
// at; a seq of 0 is present (step: seq_gap, status: not_received).
func (s *Server) handleStepOrStatus(w http.ResponseWriter, r *http.Request, op string) {
	var req StepRequest
	body, ok := s.decodeBody(w, r, op, &req, func() int { return req.Protocol })
	if !ok {
		return
	}
	id := r.PathValue("id")
	action, absent, err := boundAction(body, "turn", "action")
	if err == nil {
		var seq []string
		seq, err = absentFields(body, "seq")
		absent = append(absent, seq...)
	}
	missing := missingFields(absent, map[string]string{"idempotency_key": req.IdempotencyKey, "token": req.Token})
	if err != nil || missing != "" {
		s.reply(w, op, http.StatusBadRequest, StepResponse{Response: s.refused(ReasonBadRequest, cmp.Or(missing, fmt.Sprint(err)), false),
			Seq: req.Seq, NextSeq: s.nextSeqOf(id)})
		return
	}
	s.reply(w, op, http.StatusOK, s.step(id, req, op == "status", action))
}

// step answers a step (query false) or a status query (query true) whose
// token binds action (boundAction).
func (s *Server) step(id string, req StepRequest, query bool, action []byte) StepResponse {
	e, meta, end, err := s.lookup(id)
	if err != nil {
		r, endReason := s.recordRefusal(err)
		return StepResponse{Response: r, Seq: req.Seq, EndReason: endReason}
	}
	if meta == nil {
		return StepResponse{Response: s.refused(ReasonUnknownEpisode, "no episode "+id, false), Seq: req.Seq}
	}
	if _, err := s.ver.Verify(req.Token, meta.Run, id, req.Seq, action); err != nil {
		return StepResponse{Response: s.refused(tokenReason(err), err.Error(), false), Seq: req.Seq, NextSeq: s.nextSeq(e, end)}
	}
	ah := hashHex(action)
	if e != nil {
		e.mu.Lock()
		if !e.ended {
			return s.stepLive(e, req, ah, query) // unlocks e.mu
		}
		next := e.next
		e.mu.Unlock()
		if _, meta, end, err = s.lookup(id); err != nil || end == nil {
			return StepResponse{Response: s.refused(ReasonPersistFailed, fmt.Sprint("episode ended; records: ", err), true), Seq: req.Seq, NextSeq: next}
		}
	}
	// An ended episode answers from its records: a delivery it executed
	// gets its stored transition; nothing new runs.
	if req.Seq >= 1 && req.Seq < end.NextSeq {
		var rec stepRec
		ok, err := s.load(stepKey(id, req.Seq), &rec)
		if err != nil {
			r, endReason := s.recordRefusal(err)
			return StepResponse{Response: r, Seq: req.Seq, NextSeq: end.NextSeq, EndReason: cmp.Or(endReason, end.Reason)}
		}
		if ok {
			return s.stored(&rec, req, ah, end.NextSeq, end.Reason)
		}
	}
	out := StepResponse{Response: s.refused(ReasonEpisodeEnded, "episode ended: "+end.Reason, false), Seq: req.Seq, NextSeq: end.NextSeq, EndReason: end.Reason}
	if end.Reason == ReasonLeaseExpired {
		out.Reason = ReasonLeaseExpired
	}
	return out
}

// nextSeqOf is the next sequence number of episode id, for the answers
// that carry it before the episode is looked at (bad requests): 0 for an
// unknown episode or unreadable records.
func (s *Server) nextSeqOf(id string) uint64 {
	e, _, end, err := s.lookup(id)
	if err != nil {
		return 0
	}
	return s.nextSeq(e, end)
}

// nextSeq is the next sequence number of a live episode e or of an ended
// one's records end.
func (s *Server) nextSeq(e *episode, end *endRec) uint64 {
	if e != nil {
		e.mu.Lock()
		defer e.mu.Unlock()
		if !e.ended {
			return e.next
		}
	}
	if end != nil {
		return end.NextSeq
	}
	return 0
}

// stored answers a delivery of an executed sequence number.
func (s *Server) stored(rec *stepRec, req StepRequest, ah string, next uint64, endReason string) StepResponse {
	switch {
	case rec.ActionHash != ah:
		return StepResponse{Response: s.refused(ReasonSeqConflict, fmt.Sprintf("sequence number %d was used for another action", req.Seq), false),
			Seq: req.Seq, NextSeq: next, EndReason: endReason}
	case rec.Key != req.IdempotencyKey:
		return StepResponse{Response: s.refused(ReasonSeqReplayed, fmt.Sprintf("sequence number %d was used by another delivery", req.Seq), false),
			Seq: req.Seq, NextSeq: next, EndReason: endReason}
	}
	tr := rec.Transition
	s.met.replays.Inc()
	return StepResponse{Response: s.base(Executed, "", "", false), Seq: req.Seq, NextSeq: next, Replayed: true, Transition: &tr, EndReason: endReason}
}

// stepLive answers for a live episode; e.mu is held and released here (by
// the step's worker when it executes).
func (s *Server) stepLive(e *episode, req StepRequest, ah string, query bool) StepResponse {
	unlock := true
	defer func() {
		if unlock {
			e.mu.Unlock()
		}
	}()
	if rec := e.steps[req.Seq]; rec != nil {
		return s.stored(rec, req, ah, e.next, "")
	}
	if req.Seq == 0 || req.Seq > e.next || (query && req.Seq == e.next) {
		if query {
			return StepResponse{Response: s.base(Unknown, ReasonNotReceived, fmt.Sprintf("no delivery of sequence number %d arrived (next is %d)", req.Seq, e.next), false),
				Seq: req.Seq, NextSeq: e.next}
		}
		return StepResponse{Response: s.refused(ReasonSeqGap, fmt.Sprintf("sequence number %d, next is %d", req.Seq, e.next), false), Seq: req.Seq, NextSeq: e.next}
	}
	if !query && e.last != nil && e.last.Terminated {
		// The last executed action ended the episode; the environment
		// would refuse another (its error is no failure of the step).
		return StepResponse{Response: s.refused(ReasonEpisodeEnded, fmt.Sprintf("the action of sequence number %d ended the episode; terminate it for its artifacts", e.next-1), false),
			Seq: req.Seq, NextSeq: e.next}
	}
	if s.expired(e) {
		if err := s.end(e, StatusInfra, ReasonLeaseExpired, rollout.ReasonAborted); err != nil {
			return StepResponse{Response: s.refused(ReasonPersistFailed, err.Error(), true), Seq: req.Seq, NextSeq: e.next}
		}
		return StepResponse{Response: s.refused(ReasonLeaseExpired, "the lease ran out; the episode ended", false), Seq: req.Seq, NextSeq: e.next,
			EndReason: ReasonLeaseExpired}
	}
	// req.Seq == e.next: execute in a worker that owns e.mu until the
	// transition is persisted, so the answer never precedes the record.
	done := make(chan StepResponse, 1)
	unlock = false
	s.workers.Add(1)
	go func() {
		defer s.workers.Done()
		defer e.mu.Unlock()
		done <- s.execute(e, req, ah)
	}()
	t := time.NewTimer(s.cfg.StepTimeout)
	defer t.Stop()
	select {
	case r := <-done:
		return r
	case <-t.C:
		return StepResponse{Response: s.base(Unknown, ReasonStepTimeout, fmt.Sprintf("step %d exceeded %s; ask its status", req.Seq, s.cfg.StepTimeout), false),
			Seq: req.Seq, NextSeq: req.Seq}
	}
}

// execute runs and persists sequence number req.Seq (e.mu held).
func (s *Server) execute(e *episode, req StepRequest, ah string) StepResponse {
	t0 := time.Now()
	tr, err := e.ep.Step(s.ctx, req.Turn, req.Action)
	if err != nil {
		return StepResponse{Response: s.refused(ReasonEnvironment, err.Error(), false), Seq: req.Seq, NextSeq: e.next}
	}
	if ob, _ := json.Marshal(tr.Observation); len(ob) > s.cfg.MaxObservationBytes {
		// Refused: the action did not run. Roll the world back to the
		// persisted state so that the end's artifacts, like its steps,
		// leave the action out.
		detail := fmt.Sprintf("observation of %d bytes, cap %d: the action did not run; the episode ended", len(ob), s.cfg.MaxObservationBytes)
		if rerr := s.rollback(e); rerr != nil {
			s.cfg.Logger.Error("episode not rolled back: its artifacts are lost", "episode", e.id, "err", rerr)
			e.ep = nil // closes with no artifacts rather than with the refused action's
		}
		if err := s.end(e, StatusInfra, ReasonObservation, rollout.ReasonAborted); err != nil {
			return StepResponse{Response: s.refused(ReasonPersistFailed, err.Error(), true), Seq: req.Seq, NextSeq: e.next}
		}
		return StepResponse{Response: s.refused(ReasonObservation, detail, false), Seq: req.Seq, NextSeq: e.next, EndReason: ReasonObservation}
	}
	st, err := e.ep.(rollout.Stateful).State()
	if err == nil {
		rec := &stepRec{Seq: req.Seq, Key: req.IdempotencyKey, ActionHash: ah, Turn: req.Turn, Transition: tr, State: st}
		if err = s.put(stepKey(e.id, req.Seq), rec); err == nil {
			mem := *rec
			mem.State = nil // on disk; memory keeps only the newest (e.state)
			e.steps[req.Seq], e.state, e.next, e.last = &mem, st, req.Seq+1, &mem.Transition
			s.met.steps.WithLabelValues(e.meta.Family).Inc()
			s.met.stepTime.WithLabelValues(e.meta.Family).Observe(time.Since(t0).Seconds())
			out := tr
			return StepResponse{Response: s.base(Executed, "", "", false), Seq: req.Seq, NextSeq: e.next, Transition: &out}
		}
	}
	// Not persisted: the step did not happen. Roll the world back to the
	// persisted state so memory and the log agree.
	if rerr := s.rollback(e); rerr != nil {
		s.cfg.Logger.Error("episode lost: cannot roll back", "episode", e.id, "err", rerr)
		e.ep = nil
		if eerr := s.end(e, StatusInfra, endStateLost, rollout.ReasonAborted); eerr != nil {
			s.cfg.Logger.Error("episode not ended", "episode", e.id, "err", eerr)
		}
		return StepResponse{Response: s.refused(ReasonEpisodeEnded, "the episode's state was lost: "+err.Error(), false), Seq: req.Seq, NextSeq: e.next,
			EndReason: endStateLost}
	}
	return StepResponse{Response: s.refused(ReasonPersistFailed, err.Error(), true), Seq: req.Seq, NextSeq: e.next}
}

// rollback replaces e's world (e.mu held) by the one last persisted
// (e.state): an action that was not acknowledged leaves no trace in it.
func (s *Server) rollback(e *episode) error {
	ep, err := e.reg.Resume(e.meta.Attempt, e.state)
	if err != nil {
		return err
	}
	e.ep = ep
	return nil
}

func (s *Server) handleRenew(w http.ResponseWriter, r *http.Request) {
	var req RenewRequest
	if !s.decode(w, r, "renew", &req, func() int { return req.Protocol }) {
		return
	}
	if missing := missingFields(nil, map[string]string{"token": req.Token}); missing != "" {
		s.reply(w, "renew", http.StatusBadRequest, RenewResponse{Response: s.refused(ReasonBadRequest, missing, false)})
		return
	}
	s.reply(w, "renew", http.StatusOK, s.renew(r.PathValue("id"), req))
}

func (s *Server) renew(id string, req RenewRequest) RenewResponse {
	e, meta, end, err := s.lookup(id)
	switch {
	case err != nil:
		r, _ := s.recordRefusal(err)
		return RenewResponse{Response: r}
	case meta == nil:
		return RenewResponse{Response: s.refused(ReasonUnknownEpisode, "no episode "+id, false)}
	}
	if _, err := s.ver.Verify(req.Token, meta.Run, id, 0, RenewAction); err != nil {
		return RenewResponse{Response: s.refused(tokenReason(err), err.Error(), false)}
	}
	if e == nil || e.dead.Load() {
		reason := "ended"
		if end != nil {
			reason = end.Reason
		}
		if reason == ReasonLeaseExpired {
			return RenewResponse{Response: s.refused(ReasonLeaseExpired, "the lease ran out; the episode ended", false)}
		}
		return RenewResponse{Response: s.refused(ReasonEpisodeEnded, "episode ended: "+reason, false)}
	}
	e.leaseMu.Lock()
	now := s.cfg.Now()
	if !now.Before(e.lease) {
		e.leaseMu.Unlock()
		return RenewResponse{Response: s.refused(ReasonLeaseExpired, "the lease ran out; the episode ends", false)}
	}
	exp := now.Add(s.leaseFor(req.LeaseMS))
	err = s.put(leaseKey(id), exp.UnixMilli())
	if err == nil {
		e.lease = exp
	}
	e.leaseMu.Unlock()
	if err != nil {
		return RenewResponse{Response: s.refused(ReasonPersistFailed, err.Error(), true)}
	}
	s.met.renewals.Inc()
	return RenewResponse{Response: s.base(Executed, "", "", false), LeaseExpiresMS: exp.UnixMilli()}
}

func (s *Server) handleTerminate(w http.ResponseWriter, r *http.Request) {
	var req TerminateRequest
	if !s.decode(w, r, "terminate", &req, func() int { return req.Protocol }) {
		return
	}
	if missing := missingFields(nil, map[string]string{"token": req.Token}); missing != "" {
		s.reply(w, "terminate", http.StatusBadRequest, TerminateResponse{Response: s.refused(ReasonBadRequest, missing, false)})
		return
	}
	s.reply(w, "terminate", http.StatusOK, s.terminate(r.PathValue("id"), req))
}

func (s *Server) terminate(id string, req TerminateRequest) TerminateResponse {
	if len(req.Reason) > MaxReasonBytes {
		return TerminateResponse{Response: s.refused(ReasonBadRequest, fmt.Sprintf("reason of %d bytes, at most %d", len(req.Reason), MaxReasonBytes), false)}
	}
	e, meta, end, err := s.lookup(id)
	switch {
	case err != nil:
		r, endReason := s.recordRefusal(err)
		return TerminateResponse{Response: r, EndReason: endReason}
	case meta == nil:
		return TerminateResponse{Response: s.refused(ReasonUnknownEpisode, "no episode "+id, false)}
	}
	if _, err := s.ver.Verify(req.Token, meta.Run, id, 0, TerminateAction); err != nil {
		return TerminateResponse{Response: s.refused(tokenReason(err), err.Error(), false)}
	}
	m := *meta
	if e != nil {
		e.mu.Lock()
		if !e.ended {
			err := s.end(e, StatusCompleted, req.Reason, req.Reason)
			e.mu.Unlock()
			if err != nil {
				return TerminateResponse{Response: s.refused(ReasonPersistFailed, err.Error(), true)}
			}
		} else {
			e.mu.Unlock()
		}
		var rec endRec
		if ok, err := s.load(endKey(id), &rec); err != nil || !ok {
			return TerminateResponse{Response: s.refused(ReasonPersistFailed, fmt.Sprint("end record: ", err), true)}
		}
		end = &rec
	}
	return TerminateResponse{Response: s.base(Executed, "", "", false), Status: end.Status, EndReason: end.Reason, Steps: end.Steps,
		Final: end.Final, Artifacts: end.Artifacts, ValidatorInput: &ValidatorInput{Family: m.Family, TaskID: m.Attempt.TaskID,
			TaskVersion: m.Attempt.TaskVersion, EnvVersion: m.Attempt.EnvVersion, Artifacts: end.Artifacts}}
}

func (s *Server) handleHealth(w http.ResponseWriter, _ *http.Request) {
	fams := make([]string, 0, len(s.fams))
	for f := range s.fams {
		fams = append(fams, f)
	}
	sort.Strings(fams)
	h := Health{Status: HealthOK, Protocol: ProtocolVersion, Families: fams, Live: s.Live(), Capacity: s.cfg.MaxEpisodes}
	code := http.StatusOK
	if err := s.store.Err(); err != nil {
		h.Status, h.Error, code = HealthFailed, err.Error(), http.StatusServiceUnavailable
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set(HeaderProtocol, strconv.Itoa(ProtocolVersion))
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(h)
}
