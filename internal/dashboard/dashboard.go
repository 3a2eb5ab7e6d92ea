package dashboard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/trajflow/trajflow/connectors/kafka"
	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// Config says where a dashboard reads its run.
type Config struct {
	// Dir is a run's snapshot directory (a demo's --out, trajflow up's
	// --out or its snapshots directory, or a run=<run> directory): the
	// offline source. Exactly one of Dir and Brokers.
	Dir string
	// Brokers are the bootstrap brokers of a running cluster: the live
	// source. Client carries its TLS/SASL settings.
	Brokers []string
	Client  kafka.ClientConfig
	// Run is the run id: which run=<run> of Dir, or whose topics on the
	// cluster (default: the contract's).
	Run string
	// Contract is the learning contract of a live run (default the
	// built-in demo contract); a snapshot records its own.
	Contract string
	// Releases is the run's release directory (update records, manifests,
	// checkpoints); default, offline, the releases directory of the run's
	// output directory (OUT/releases of a demo's or trajflow up's --out
	// OUT, whichever of them Dir is in), none live. summary.json is read
	// from that output directory too.
	Releases string
	// Refresh is the interval between two reads of a live run (default
	// 5 s).
	Refresh time.Duration
	// EvalSamples is the number of attempts per hidden-eval task with
	// which the dashboard re-measures releases (the demo's --eval-samples,
	// default 4); 0 measures nothing.
	EvalSamples int
	Logger      *slog.Logger
}

// ErrConfig wraps every error of a configuration the dashboard cannot
// serve (no such directory or run, both sources or none, a contract that
// does not load): retrying cannot fix it.
var ErrConfig = errors.New("dashboard: configuration")

// State is everything one read of the run produced.
type State struct {
	Source   string
	Live     bool
	Run      string
	Contract *contract.Contract
	Records  *Records
	Releases *Releases
	Recorded *loop.Summary // summary.json, when the run wrote one
	Files    *FileChecks   // snapshots only
	Lags     []GroupLag    // live only
	LagError string
	Evals    []EvalPoint
	EvalNote string
	Problems []string
	ReadAt   time.Time
}

// Dashboard serves one run. Its state is replaced as a whole by each
// refresh; handlers read the current one.
type Dashboard struct {
	cfg  Config
	log  *slog.Logger
	live *live
	ev   *evaluator
	// contract is the live run's contract (a snapshot carries its own).
	contract *contract.Contract

	mu      sync.RWMutex
	state   *State
	view    *View
	lastErr string
}

// New validates cfg and reads the run once.
func New(ctx context.Context, cfg Config) (*Dashboard, error) {
	if (cfg.Dir == "") == (len(cfg.Brokers) == 0) {
		return nil, fmt.Errorf("%w: give a snapshot directory or brokers (one of them)", ErrConfig)
	}
	if cfg.Refresh <= 0 {
		cfg.Refresh = 5 * time.Second
	}
	if cfg.EvalSamples < 0 {
		return nil, fmt.Errorf("%w: eval samples %d: want 0 (none) or more", ErrConfig, cfg.EvalSamples)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	d := &Dashboard{cfg: cfg, log: cfg.Logger}
	if cfg.Dir != "" {
		if _, err := os.Stat(cfg.Dir); err != nil {
			return nil, fmt.Errorf("%w: snapshot directory: %w", ErrConfig, err)
		}
		if _, err := parquet.FindRun(cfg.Dir, cfg.Run); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrConfig, err)
		}
	} else if err := d.prepareLive(); err != nil {
		return nil, err
	}
	if err := d.Refresh(ctx); err != nil {
		if d.live == nil || !errors.Is(err, errNoTopics) {
			return nil, err
		}
		// A live run whose topics do not exist yet: serve an empty run and
		// keep reading.
		d.log.Warn("dashboard: waiting for the run's topics", "err", err)
		d.state = &State{Source: "brokers " + strings.Join(cfg.Brokers, ","), Live: true, Run: d.live.run,
			Contract: d.contract, Records: d.live.recs, ReadAt: time.Now()}
		d.view = Assemble(d.state)
	}
	return d, nil
}

// prepareLive resolves the live run's contract and its topics.
func (d *Dashboard) prepareLive() error {
	var c *contract.Contract
	if d.cfg.Contract != "" {
		var err error
		if c, err = loadContract(d.cfg.Contract, ""); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	} else {
		c = contract.Default()
		if err := c.Resolve(); err != nil {
			return err
		}
	}
	run := d.cfg.Run
	if run == "" {
		run = c.RunID
	}
	if run != c.RunID {
		c.RunID = run
		if err := c.Resolve(); err != nil {
			return fmt.Errorf("%w: run %q: %w", ErrConfig, run, err)
		}
	}
	l, err := newLive(d.cfg.Brokers, d.cfg.Client, run, c.Topics.MaxMessageBytes)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	d.live, d.contract = l, c
	d.cfg.Run = run
	return d.setContract(c)
}

func (d *Dashboard) setContract(c *contract.Contract) error {
	if d.ev != nil || d.cfg.EvalSamples == 0 {
		return nil
	}
	ev, err := newEvaluator(c, d.cfg.EvalSamples)
	if err != nil {
		return err
	}
	d.ev = ev
	return nil
}

// Refresh reads the run again and replaces the state. On error the
// previous state stays and the error is shown.
func (d *Dashboard) Refresh(ctx context.Context) error {
	st, pending, err := d.read(ctx)
	if err == nil {
		d.evaluate(ctx, st) // reads the releases only, never the records
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	// A live run's records grow in place: what a poll read is added under
	// the lock, so no handler reads them while they change.
	for _, p := range pending {
		st.Records.Add(p.short, p.msg)
	}
	if err != nil {
		d.lastErr = err.Error()
		return err
	}
	d.state, d.view, d.lastErr = st, Assemble(st), ""
	return nil
}

// read produces a new State from the source, and for a live run the
// messages read since the previous poll (even when the poll failed
// half-way: they are never read again).
func (d *Dashboard) read(ctx context.Context) (*State, []pendingMsg, error) {
	st := &State{ReadAt: time.Now()}
	var pending []pendingMsg
	relDir := d.cfg.Releases
	if d.cfg.Dir != "" {
		s, err := readSnapshot(ctx, d.cfg.Dir, d.cfg.Run)
		if err != nil {
			return nil, nil, err
		}
		st.Source, st.Run, st.Contract, st.Records = "snapshot "+s.runDir, s.info.Run, s.contract, s.recs
		st.Files, st.Recorded = &s.files, s.summary
		if relDir == "" {
			relDir = filepath.Join(s.outDir, "releases")
			if _, err := os.Stat(relDir); err != nil {
				relDir = ""
			}
		}
		if err := d.setContract(s.contract); err != nil {
			return nil, nil, err
		}
	} else {
		var err error
		pending, err = d.live.poll(ctx)
		st.Source, st.Live, st.Run, st.Records = "brokers "+strings.Join(d.cfg.Brokers, ","), true, d.live.run, d.live.recs
		st.Contract = d.contract
		if err != nil {
			return st, pending, err
		}
		if st.Lags, err = d.live.lags(ctx); err != nil {
			st.LagError = err.Error()
		}
	}
	if relDir != "" {
		var prev *Releases
		if d.state != nil {
			prev = d.state.Releases
		}
		rels, err := readReleases(relDir, prev)
		if err != nil {
			return st, pending, err
		}
		st.Releases = rels
	}
	return st, pending, nil
}

// evaluate re-measures the hidden eval of the chosen releases.
func (d *Dashboard) evaluate(ctx context.Context, st *State) {
	switch {
	case d.ev == nil:
		st.EvalNote = "hidden eval not re-measured (--eval-samples 0)"
		return
	case st.Releases == nil:
		st.EvalNote = "hidden eval needs the release directory (--releases)"
		return
	}
	recorded := map[int64]float64{}
	if st.Recorded != nil {
		for _, e := range st.Recorded.Evals {
			recorded[e.Version] = e.Success
		}
	}
	every := 0
	if st.Contract != nil {
		every = st.Contract.Dispatch.EvalEvery
	}
	for _, v := range evalVersions(st.Releases.Versions(), recorded, every) {
		m, _ := st.Releases.Model(v)
		p, err := d.ev.measure(ctx, v, m)
		if err != nil {
			st.EvalNote = err.Error()
			return
		}
		if r, ok := recorded[v]; ok {
			p.Recorded = &r
			p.Match = r == p.Success
		}
		st.Evals = append(st.Evals, p)
	}
	st.EvalNote = fmt.Sprintf("re-measured by the dashboard from each release's verified checkpoint: %d tasks x %d fixed attempts", d.ev.ev.Tasks(), d.ev.ev.Samples())
}

// Run refreshes a live run every cfg.Refresh until ctx ends; a snapshot
// is read once, so Run only waits.
func (d *Dashboard) Run(ctx context.Context) error {
	if d.live == nil {
		<-ctx.Done()
		return nil
	}
	t := time.NewTicker(d.cfg.Refresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if err := d.Refresh(ctx); err != nil && ctx.Err() == nil {
			d.log.Warn("dashboard: refresh failed; showing the previous read", "err", err)
		}
	}
}

// current returns the state, its view and the last refresh error.
func (d *Dashboard) current() (*State, *View, string) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.state, d.view, d.lastErr
}
