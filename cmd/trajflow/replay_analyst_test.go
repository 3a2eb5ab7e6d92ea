package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/connectors/parquet"
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

// TestAnalystExample runs examples/analyst/analyze.py on a run's snapshots:
// pyarrow must see the exact Arrow types trajflow wrote, DuckDB must answer
// a query over the whole run, and a batches message must open with
// pyarrow.ipc.open_stream.
func TestAnalystExample(t *testing.T) {
	py := analystPython(t)
	_, dir := syntheticRun(t, 24)
	snap, err := parquet.ReadRun(mustRunDir(t, dir), []string{"batches"}, parquet.ReadOptions{})
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
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("analyze.py: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
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
