package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/loop"
)

// analystPython finds a Python with pyarrow and duckdb: $TRAJFLOW_PYTHON,
// the repository's .venv (examples/analyst/setup.sh), or python3.
func analystPython(t *testing.T) string {
	t.Helper()
	cands := []string{os.Getenv("TRAJFLOW_PYTHON"), "../../.venv/bin/python", "python3"}
	for _, c := range cands {
		if c == "" {
			continue
		}
		if err := exec.Command(c, "-c", "import pyarrow, duckdb").Run(); err == nil {
			return c
		}
	}
	msg := "no Python with pyarrow and duckdb (run examples/analyst/setup.sh)"
	if os.Getenv("TRAJFLOW_REQUIRE_PYTHON") == "1" {
		t.Fatal(msg)
	}
	t.Skip(msg + "; set TRAJFLOW_REQUIRE_PYTHON=1 to make this a failure")
	return ""
}

// TestDemoReplayAndAnalyst runs `trajflow demo --out D`, then `trajflow
// replay D` (every batch identical), `trajflow census D`, and
// examples/analyst/analyze.py on D: pyarrow must see the exact Arrow types
// trajflow wrote, DuckDB must answer a query over the whole run, and a
// batches message must open with pyarrow.ipc.open_stream.
func TestDemoReplayAndAnalyst(t *testing.T) {
	ctx := context.Background()
	var dir string
	for _, mode := range []struct {
		name  string
		flags []string
	}{
		{"sync", nil},
		{"async with lag", []string{"--async", "--max-lag", "1", "--updates", "4"}},
	} {
		dir = t.TempDir()
		var out, errb bytes.Buffer
		args := append([]string{"demo", "--out", dir, "--updates", "2", "--eval-samples", "1"}, mode.flags...)
		if code := run(ctx, args, &out, &errb); code != 0 {
			t.Fatalf("%s: trajflow demo: exit %d: %s%s", mode.name, code, out.String(), errb.String())
		}
		var demo loop.Summary
		b, err := os.ReadFile(filepath.Join(dir, "summary.json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, &demo); err != nil {
			t.Fatal(err)
		}
		out.Reset()
		errb.Reset()
		if code := run(ctx, []string{"replay", dir}, &out, &errb); code != 0 {
			t.Fatalf("%s: trajflow replay: exit %d: %s%s", mode.name, code, out.String(), errb.String())
		}
		want := fmt.Sprintf("%d batches identical", len(demo.BatchHashes))
		if len(demo.BatchHashes) == 0 || !strings.Contains(out.String(), want) {
			t.Fatalf("%s: replay of a demo with %d batches printed %q, want %q", mode.name, len(demo.BatchHashes), out.String(), want)
		}
		t.Logf("%s: %s", mode.name, want)
		out.Reset()
		if code := run(ctx, []string{"census", dir}, &out, &errb); code != 0 || !strings.Contains(out.String(), "trained") {
			t.Fatalf("%s: trajflow census: exit %d: %s%s", mode.name, code, out.String(), errb.String())
		}
	}

	py := analystPython(t)
	snap, err := parquet.ReadRun(t.Context(), mustRunDir(t, dir), []string{"batches"}, parquet.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Topics["batches"]) == 0 {
		t.Fatal("no batch in the snapshot")
	}
	ipcFile := filepath.Join(t.TempDir(), "batch.arrows")
	if err := os.WriteFile(ipcFile, snap.Topics["batches"][0].Value, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, "../../examples/analyst/analyze.py", dir, "--ipc", ipcFile, "--check")
	pyOut, err := cmd.CombinedOutput()
	t.Logf("%s", pyOut)
	if err != nil {
		t.Fatalf("analyze.py: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(pyOut)), "\n")
	var sum struct {
		TypesExact   bool     `json:"types_exact"`
		Problems     []string `json:"problems"`
		DuckDBRows   int64    `json:"duckdb_rows"`
		PyarrowRows  int64    `json:"pyarrow_rows"`
		TaskVersions int      `json:"task_versions"`
		IPCRows      int      `json:"ipc_rows"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &sum); err != nil {
		t.Fatalf("summary line: %v", err)
	}
	if !sum.TypesExact {
		t.Fatalf("types not exact: %v", sum.Problems)
	}
	if sum.DuckDBRows == 0 || sum.DuckDBRows != sum.PyarrowRows {
		t.Fatalf("DuckDB counted %d rows over the run, pyarrow %d", sum.DuckDBRows, sum.PyarrowRows)
	}
	if sum.TaskVersions == 0 || sum.IPCRows == 0 {
		t.Fatalf("no success table (%d rows) or IPC rows (%d)", sum.TaskVersions, sum.IPCRows)
	}
}
