package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/trajflow/trajflow/connectors/state"
	"github.com/trajflow/trajflow/internal/regfile"
)

// Env is everything a stage may use besides its input messages. The
// runtime owns every I/O: it opens and closes the local state store, reads
// topic tails, keeps the release files, and gives the stage its clock and
// logger. A stage that reaches the outside world only through its Env is a
// deterministic function of its inputs, so the same stage runs live (the
// Operator over Kafka), offline over captured messages (Drive) and in
// tests.
//
// An Env is handed to Starter.Start and stays valid until the stage's
// Close returns. Its methods are safe for concurrent use.
type Env struct {
	// Logger names the stage and its instance.
	Logger *slog.Logger

	now      func() time.Time
	scanner  Scanner
	stateDir string
	releases ReleaseStore
	dups     func(id string)
	domain   *Domain
	dupLog   logLimiter
	emit     func(ctx context.Context, outs []Output) error

	mu    sync.Mutex
	store *state.Store
	open  bool
}

// Scanner reads records of a topic without a consumer group and without
// committing anything.
type Scanner interface {
	// ScanTail calls fn for the last `last` records of every partition of
	// topic (all records when last <= 0), partition by partition in offset
	// order, and returns when every partition's end (as of the call) is
	// reached.
	ScanTail(ctx context.Context, topic string, last int64, fn func(Message) error) error
}

// EnvConfig builds an Env.
type EnvConfig struct {
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Scanner reads topic tails; nil makes every scan an error.
	Scanner Scanner
	// StateDir is where State opens the stage's Badger store; "" opens an
	// in-memory store.
	StateDir string
	// Releases is the release store; nil makes Releases an error.
	Releases ReleaseStore
	// Duplicates receives the ids of the duplicates the stage drops
	// (DuplicateDropped); nil: they are only logged.
	Duplicates func(id string)
	// Domain receives the stage's domain metrics (Metrics); nil: none.
	Domain *Domain
	// Emit produces records at once, while a message is being processed
	// (Env.Emit); nil: Emit reports false and the stage returns them
	// with its Result.
	Emit func(ctx context.Context, outs []Output) error
}

// NewEnv returns an Env.
func NewEnv(c EnvConfig) *Env {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return &Env{Logger: c.Logger, now: c.Now, scanner: c.Scanner, stateDir: c.StateDir, releases: c.Releases,
		dups: c.Duplicates, domain: c.Domain, dupLog: logLimiter{every: 10 * time.Second}, emit: c.Emit}
}

// Emit produces outs now, before the Result of the message being
// processed, and reports whether it did (false: this environment cannot;
// the stage returns them with its Result instead). Nothing waits for their
// acknowledgement and nothing orders them with the Result's outputs; a
// message processed again after a crash emits them again. It is for
// progress events whose consumers deduplicate by id, such as a rollout's
// census "started" events, which pack reads while the episode runs. A nil
// Env cannot emit.
func (e *Env) Emit(ctx context.Context, outs ...Output) (bool, error) {
	if e == nil || e.emit == nil {
		return false, nil
	}
	return true, e.emit(ctx, outs)
}

// Metrics is where the stage reports its domain metrics (policy
// versions, updates, rewards, packing, lag); nil (its methods do nothing)
// when the stage runs without metrics. A nil Env has none.
func (e *Env) Metrics() *Domain {
	if e == nil {
		return nil
	}
	return e.domain
}

// DuplicateDropped reports that the stage consumed a record and dropped
// it as a duplicate of one it already decided (id: the record's or the
// batch's id): a redelivery after a crash or a rebalance, or a record an
// upstream stage produced twice. The runtime counts it
// (trajflow_duplicates_dropped_total) and logs it, at most once every 10
// s with the number held back. A nil Env does nothing.
func (e *Env) DuplicateDropped(id string) {
	if e == nil {
		return
	}
	if e.dups != nil {
		e.dups(id)
	}
	if ok, held := e.dupLog.allow(time.Now()); ok {
		e.Logger.Info("duplicate dropped", "id", id, "not_logged", held)
	}
}

// Now is the stage's clock. Record ids and random streams never depend on
// it; timestamps and timeouts do.
func (e *Env) Now() time.Time { return e.now() }

// ErrNoScanner is returned by Scan when the Env has no Scanner.
var ErrNoScanner = errors.New("pipeline: no topic scanner in this environment")

// Scan reads the tail of topic (see Scanner). Stages use it to rebuild
// state from their own output topics when their local state is lost.
func (e *Env) Scan(ctx context.Context, topic string, last int64, fn func(Message) error) error {
	if e.scanner == nil {
		return fmt.Errorf("%w (topic %s)", ErrNoScanner, topic)
	}
	return e.scanner.ScanTail(ctx, topic, last, fn)
}

// State returns the stage's local state store, opening it on the first
// call (Badger in the operator's state directory). The runtime closes it
// after the stage's Close. The store is a cache: a stage must be able to
// rebuild everything in it from its topics. So a store that state.Open
// refuses as damaged is moved into a damaged-<time> directory inside the
// state directory (logged), and the stage starts from an empty one.
func (e *Env) State() (*state.Store, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.open {
		return e.store, nil
	}
	st, err := state.Open(e.stateDir, state.Options{Logger: e.Logger})
	if errors.Is(err, state.ErrDamaged) {
		// The store is a cache of the topics: a damaged one is kept aside
		// for inspection and the stage rebuilds from an empty one, as after
		// losing the directory (docs/GUARANTEES.md).
		aside, merr := state.MoveAside(e.stateDir, e.now())
		if merr != nil {
			return nil, fmt.Errorf("%w; moving it aside failed: %w", err, merr)
		}
		e.Logger.Warn("state store damaged: moved aside, the stage rebuilds its state from its topics",
			"dir", e.stateDir, "aside", aside, "err", err)
		st, err = state.Open(e.stateDir, state.Options{Logger: e.Logger})
	}
	if err != nil {
		return nil, err
	}
	e.store, e.open = st, true
	return st, nil
}

// ErrNoReleases is returned by Releases when the Env has no release store.
var ErrNoReleases = errors.New("pipeline: no release store in this environment (--releases)")

// Releases returns the release store (the trainer's checkpoints,
// manifests and update records; rollout workers read the checkpoints).
func (e *Env) Releases() (ReleaseStore, error) {
	if e.releases == nil {
		return nil, ErrNoReleases
	}
	return e.releases, nil
}

// Close closes the state store, if it was opened. The runtime and Drive
// call it after the stage's own Close; code that builds an Env itself
// calls it when the stage is done.
func (e *Env) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.store
	e.store, e.open = nil, false
	return st.Close()
}

// ReleaseStore keeps the files of policy releases (docs/SYSTEMS.md §8): a file is
// written atomically, so a reader never sees a partial one.
type ReleaseStore interface {
	// Write stores data under name: a temporary file in the store, fsynced,
	// renamed to name, then the directory fsynced. It returns the file's
	// URI, which Read accepts.
	Write(name string, data []byte) (uri string, err error)
	// Read returns the file at name or at a URI returned by Write. A
	// missing file is an error wrapping fs.ErrNotExist.
	Read(nameOrURI string) ([]byte, error)
}

// DirReleases is a ReleaseStore in a directory shared by every process of
// a run (file:// URIs).
type DirReleases struct{ dir string }

// NewDirReleases returns the store in dir, creating the directory.
func NewDirReleases(dir string) (*DirReleases, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("pipeline: release directory %s: %w", dir, err)
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, fmt.Errorf("pipeline: release directory %s: %w", dir, err)
	}
	return &DirReleases{dir: abs}, nil
}

// Dir is the store's absolute directory.
func (d *DirReleases) Dir() string { return d.dir }

// Write implements ReleaseStore.
func (d *DirReleases) Write(name string, data []byte) (string, error) {
	if name == "" || strings.ContainsAny(name, `/\`) {
		return "", fmt.Errorf("pipeline: release file name %q: want a plain file name", name)
	}
	path := filepath.Join(d.dir, name)
	if err := WriteFileAtomic(path, data); err != nil {
		return "", err
	}
	return "file://" + filepath.ToSlash(path), nil
}

// maxReleaseFileBytes bounds a release file Read and ReadURI read. The
// largest file a trainer writes is the optimizer state of the largest
// model (model.Config allows 2^28 parameters, two float64 moments each:
// 4 GiB) with its header and checksum; a checkpoint is a quarter of that.
// The path read comes from a message (a release's checkpoint_uri), so it
// is read only if it is a regular file of at most this size: never a
// device or a pipe, which could block or never end.
const maxReleaseFileBytes = 4<<30 + 1<<20

// Read implements ReleaseStore.
func (d *DirReleases) Read(nameOrURI string) ([]byte, error) {
	path := strings.TrimPrefix(nameOrURI, "file://")
	if !filepath.IsAbs(filepath.FromSlash(path)) {
		path = filepath.Join(d.dir, path)
	}
	return readReleaseFile(filepath.FromSlash(path))
}

// ReadURI reads a release file by its URI (file:// or a plain path), for
// readers that have no store of their own (a rollout worker loading the
// checkpoint a manifest names).
func ReadURI(uri string) ([]byte, error) {
	return readReleaseFile(filepath.FromSlash(strings.TrimPrefix(uri, "file://")))
}

// readReleaseFile reads the regular file at path of at most
// maxReleaseFileBytes; a missing file's error wraps fs.ErrNotExist.
func readReleaseFile(path string) ([]byte, error) {
	b, err := regfile.Read(path, maxReleaseFileBytes)
	var bad *regfile.Error
	if errors.As(err, &bad) {
		return nil, fmt.Errorf("pipeline: release file %s: %w", path, err)
	}
	if err != nil {
		return nil, fmt.Errorf("pipeline: release file: %w", err) // an *fs.PathError names it
	}
	return b, nil
}

// IsNotExist reports whether err says a release file is missing.
func IsNotExist(err error) bool { return errors.Is(err, fs.ErrNotExist) }

// WriteFileAtomic writes b to a temporary file beside path, fsyncs it,
// renames it to path and fsyncs the directory: a reader sees the old file
// or the whole new one, never a part.
func WriteFileAtomic(path string, b []byte) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("pipeline: write %s: %w", path, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			os.Remove(tmp)
		}
	}()
	if _, err = f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("pipeline: write %s: %w", tmp, err)
	}
	if err = f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("pipeline: fsync %s: %w", tmp, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("pipeline: close %s: %w", tmp, err)
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("pipeline: rename to %s: %w", path, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("pipeline: open directory %s: %w", dir, err)
	}
	defer d.Close()
	if err = d.Sync(); err != nil {
		return fmt.Errorf("pipeline: fsync directory %s: %w", dir, err)
	}
	return nil
}

// Backoff is a bounded, exponential retry policy.
type Backoff struct {
	// Attempts is the number of calls at most (>= 1; 0 means 1).
	Attempts int
	// Initial is the wait after the first failure; it doubles after each
	// further one up to Max (0: no wait).
	Initial, Max time.Duration
}

// Delay is the wait before attempt n (n >= 1: after n failures).
func (b Backoff) Delay(n int) time.Duration {
	if n <= 0 || b.Initial <= 0 {
		return 0
	}
	d := b.Initial
	for i := 1; i < n; i++ {
		d *= 2
		if b.Max > 0 && d >= b.Max {
			return b.Max
		}
	}
	if b.Max > 0 && d > b.Max {
		return b.Max
	}
	return d
}

// ErrPermanent marks an error Retry must not retry (wrap it: fmt.Errorf("%w: ...", pipeline.ErrPermanent)).
var ErrPermanent = errors.New("permanent")

// ErrConfig marks a configuration that cannot work: a stage's Start
// returns an error wrapping it when, for example, a directory it was given
// lacks what the run's topics say it holds. Starting the stage again
// cannot fix it, so the operators' restart loop never retries it
// (operators.ErrConfig is the same error).
var ErrConfig = errors.New("configuration error")

// Retry calls fn(ctx, attempt) with attempt = 0, 1, ... until it returns
// nil, an error wrapping ErrPermanent, or the policy's attempts are spent,
// waiting b.Delay(attempt) between calls; it returns fn's last error. It
// returns ctx's error as soon as ctx ends, waiting or not. This is how a
// stage retries a call to an evaluator or a service: never by sleeping in
// Process, so a shutdown is never delayed by a backoff.
func Retry(ctx context.Context, b Backoff, fn func(ctx context.Context, attempt int) error) error {
	n := max(1, b.Attempts)
	var err error
	for attempt := 0; attempt < n; attempt++ {
		if attempt > 0 {
			t := time.NewTimer(b.Delay(attempt))
			select {
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("pipeline: retry after %v: %w", err, ctx.Err())
			case <-t.C:
			}
		}
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		if err = fn(ctx, attempt); err == nil || errors.Is(err, ErrPermanent) {
			return err
		}
	}
	return err
}
