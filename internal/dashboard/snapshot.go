package dashboard

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// FileChecks is the verification of a snapshot's files: every Parquet
// file against its sidecar checksum and lineage (parquet.ReadFile), every
// sidecar left without its Parquet file (parquet.Missing), the run-level
// files against their sidecars, and the offsets between files.
type FileChecks struct {
	Verified int           `json:"verified"`
	Failures []FileFailure `json:"failures"`
	Gaps     []string      `json:"gaps"`
	// Unreadable lists the Parquet files among Failures, missing or not
	// verifying, whose records the dashboard therefore lacks: every count
	// from the records is partial when it is not empty.
	Unreadable []string `json:"unreadable"`
}

// FileFailure is a file that did not verify.
type FileFailure struct {
	File  string `json:"file"`
	Error string `json:"error"`
}

// snapshot is a run read from its Parquet snapshot directory.
type snapshot struct {
	runDir   string
	outDir   string // the run's output directory (runRoot): releases/, summary.json
	info     parquet.RunInfo
	contract *contract.Contract
	recs     *Records
	files    FileChecks
	summary  *loop.Summary
}

// readSnapshot reads every file of the run in dir (a demo's output
// directory, trajflow up's or its snapshots directory, or a run=<run>
// directory). A file that does not verify, or is missing while its
// checksum sidecar remains, or is not a regular file, or lies under a
// directory that is not partition=<number>, is reported and skipped,
// never fatal: a dashboard shows what it can. The run's own files
// (run.json, contract.yaml) must be readable. It stops between files
// once ctx is done.
func readSnapshot(ctx context.Context, dir, run string) (*snapshot, error) {
	runDir, err := parquet.FindRun(dir, run)
	if err != nil {
		return nil, err
	}
	s := &snapshot{runDir: runDir, outDir: runRoot(runDir), recs: NewRecords()}
	if s.info, err = parquet.ReadRunInfo(runDir); err != nil {
		return nil, err
	}
	for _, name := range []string{parquet.RunInfoFile, parquet.ContractFile} {
		s.checkSidecar(filepath.Join(runDir, name))
	}
	if s.contract, err = readContract(runDir, s.info.ContractHash); err != nil {
		return nil, err
	}
	files, err := parquet.List(runDir)
	if err != nil {
		return nil, err
	}
	missing, err := parquet.Missing(runDir)
	if err != nil {
		return nil, err
	}
	for _, f := range missing {
		s.unreadable(f.Path, parquet.MissingError(f))
	}
	var read []parquet.File
	for _, f := range files {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("dashboard: reading %s: %w", runDir, err)
		}
		var lin parquet.Lineage
		var msgs []parquet.Message
		err := f.Err
		if err == nil {
			lin, msgs, err = parquet.ReadFile(f.Path, parquet.ReadOptions{})
		}
		if err == nil && (lin.Run != s.info.Run || lin.ContractHash != s.info.ContractHash) {
			err = fmt.Errorf("%w: run %q under contract %s, the run directory is run %q under %s", parquet.ErrCorrupt, lin.Run, lin.ContractHash, s.info.Run, s.info.ContractHash)
		}
		if err != nil {
			s.unreadable(f.Path, err)
			continue
		}
		s.files.Verified++
		read = append(read, f)
		for _, m := range msgs {
			s.recs.Add(f.Topic, m)
		}
	}
	for _, g := range parquet.Contiguity(read) {
		s.files.Gaps = append(s.files.Gaps, g.String())
	}
	s.summary, err = readSummary(filepath.Join(s.outDir, loop.SummaryFile), s.outDir)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// runRoot is the output directory of the run in runDir, where its
// releases/ and summary.json are: the directory holding run=<run> (a
// demo's --out), or above it when that is trajflow up's snapshots
// directory (OUT/snapshots/run=<run>, OUT/releases, OUT/summary.json).
func runRoot(runDir string) string {
	dir := filepath.Dir(filepath.Clean(runDir))
	if filepath.Base(dir) != parquet.SnapshotsDir || holdsRunOutput(dir) || !holdsRunOutput(filepath.Dir(dir)) {
		return dir
	}
	return filepath.Dir(dir)
}

// holdsRunOutput reports whether dir holds a summary.json or a releases
// directory.
func holdsRunOutput(dir string) bool {
	for _, name := range []string{loop.SummaryFile, "releases"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			return true
		}
	}
	return false
}

// unreadable records a Parquet file of the run whose records are not read.
func (s *snapshot) unreadable(path string, err error) {
	s.files.Failures = append(s.files.Failures, FileFailure{File: s.rel(path), Error: err.Error()})
	s.files.Unreadable = append(s.files.Unreadable, s.rel(path))
}

func (s *snapshot) rel(path string) string {
	if r, err := filepath.Rel(s.outDir, path); err == nil {
		return r
	}
	return path
}

// checkSidecar verifies a run-level file against its "_<name>.sha256"
// sidecar, when it has one.
func (s *snapshot) checkSidecar(path string) {
	side, err := parquet.ReadRegular(parquet.SidecarPath(path), s.runDir, maxSmallFile)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	if err != nil {
		err = fmt.Errorf("checksum sidecar %s: %w", s.rel(parquet.SidecarPath(path)), err)
	}
	b, rerr := parquet.ReadRegular(path, s.runDir, maxSmallFile)
	if err == nil && rerr == nil {
		sum := sha256.Sum256(b)
		want, _, _ := strings.Cut(strings.TrimSpace(string(side)), " ")
		if hex.EncodeToString(sum[:]) == want {
			s.files.Verified++
			return
		}
		err = fmt.Errorf("sha256 %s, sidecar says %q", hex.EncodeToString(sum[:]), want)
	}
	s.files.Failures = append(s.files.Failures, FileFailure{File: s.rel(path), Error: errors.Join(err, rerr).Error()})
}

// maxSmallFile bounds what the dashboard reads of a run-level file
// (run.json, contract.yaml, summary.json, a sidecar).
const maxSmallFile = 64 << 20

// readContract reads and resolves the contract a run recorded in runDir
// (a regular file, never read past maxSmallFile); want, when set, is the
// hash the run recorded.
func readContract(runDir, want string) (*contract.Contract, error) {
	path := filepath.Join(runDir, parquet.ContractFile)
	b, err := parquet.ReadRegular(path, runDir, maxSmallFile)
	if err != nil {
		if errors.Is(err, parquet.ErrCorrupt) {
			return nil, fmt.Errorf("dashboard: contract %s: %w", path, err)
		}
		return nil, fmt.Errorf("dashboard: contract: %w", err)
	}
	c, err := contract.Parse(b)
	switch {
	case errors.Is(err, contract.ErrSyntax): // its text starts with "contract: "
		return nil, fmt.Errorf("dashboard: %s: %w", path, err)
	case err != nil:
		return nil, fmt.Errorf("dashboard: contract %s: %w", path, err)
	}
	return resolveContract(c.Recorded(), path, want)
}

// loadContract reads and resolves a contract file; want, when set, is the
// hash the run recorded.
func loadContract(path, want string) (*contract.Contract, error) {
	c, err := contract.Load(path)
	if err != nil {
		return nil, fmt.Errorf("dashboard: %w", err)
	}
	return resolveContract(c, path, want)
}

// resolveContract resolves c, read from path, and checks its hash
// against want when set.
func resolveContract(c *contract.Contract, path, want string) (*contract.Contract, error) {
	if err := c.Resolve(); err != nil {
		return nil, fmt.Errorf("dashboard: contract %s: %w", path, err)
	}
	if want != "" && c.Hash() != want {
		return nil, fmt.Errorf("dashboard: contract %s has hash %s, the run was written under %s", path, c.Hash(), want)
	}
	return c, nil
}

// readSummary reads a demo's summary.json (a file of outDir); a missing
// file is no summary.
func readSummary(path, outDir string) (*loop.Summary, error) {
	b, err := parquet.ReadRegular(path, outDir, maxSmallFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("dashboard: %w", err)
	}
	var s loop.Summary
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("dashboard: %s: %w", path, err)
	}
	return &s, nil
}
