package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/parquet"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/pipeline"
)

const conformanceContract = "../../testdata/contracts/conformance.yaml"

// TestReplaySyntheticRun runs `trajflow replay`, `trajflow census` and
// `trajflow replay --to-brokers` over the snapshot of a synthetic run, and
// checks that a corrupt file, another contract and missing trajectories
// are reported.
func TestReplaySyntheticRun(t *testing.T) {
	run0 := testkit.StartRun(t, testkit.LoadContract(t, conformanceContract), "")
	dir := run0.SnapshotRun(t, 40)

	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"replay", dir}, &out, &errb); code != 0 {
		t.Fatalf("trajflow replay: exit %d: %s", code, errb.String())
	}
	if want := "batches identical"; !strings.Contains(out.String(), want) {
		t.Fatalf("output %q lacks %q", out.String(), want)
	}
	if want := "no --contract: using the contract recorded in the snapshot (" + filepath.Join(mustRunDir(t, dir), parquet.ContractFile) + ")"; !strings.Contains(errb.String(), want) {
		t.Fatalf("stderr %q lacks %q", errb.String(), want)
	}

	t.Run("census", func(t *testing.T) {
		var out, errb bytes.Buffer
		if code := run(context.Background(), []string{"census", dir}, &out, &errb); code != 0 {
			t.Fatalf("trajflow census: exit %d: %s", code, errb.String())
		}
		for _, want := range []string{"launched", "admitted", "filtered", "by task", "reward"} {
			if !strings.Contains(out.String(), want) {
				t.Fatalf("census output lacks %q:\n%s", want, out.String())
			}
		}
		t.Log(out.String())
	})

	t.Run("to-brokers", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		addr := testkit.StartBroker(t)
		var out, errb bytes.Buffer
		if code := run(ctx, []string{"replay", dir, "--to-brokers", addr}, &out, &errb); code != 0 {
			t.Fatalf("replay --to-brokers: exit %d: %s", code, errb.String())
		}
		snap, err := parquet.ReadRun(t.Context(), mustRunDir(t, dir), []string{"batches"}, parquet.ReadOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cfg := pipeline.Config{Brokers: []string{addr}}
		var got []pipeline.Message
		err = pipeline.ScanTail(ctx, &cfg, snap.FullTopics["batches"], 1<<20, func(m pipeline.Message) error {
			got = append(got, m)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		want := snap.Topics["batches"]
		if len(got) != len(want) {
			t.Fatalf("%d batches re-emitted, snapshot holds %d", len(got), len(want))
		}
		for i := range got {
			if !bytes.Equal(got[i].Value, want[i].Value) || got[i].Offset != want[i].Offset {
				t.Fatalf("re-emitted batch %d differs", i)
			}
		}
	})

	t.Run("corrupt byte names the file", func(t *testing.T) {
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, topic := range []string{"scored", "batches", "windows"} {
			var path string
			for _, f := range files {
				if f.Topic == topic {
					path = f.Path
					break
				}
			}
			if path == "" {
				t.Fatalf("no %s file", topic)
			}
			orig, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			b := bytes.Clone(orig)
			b[len(b)/2] ^= 1
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
			var out, errb bytes.Buffer
			code := run(context.Background(), []string{"replay", dir}, &out, &errb)
			if err := os.WriteFile(path, orig, 0o644); err != nil {
				t.Fatal(err)
			}
			if code != 1 || !strings.Contains(errb.String(), path) {
				t.Fatalf("%s corrupted: exit %d, stderr %q; want exit 1 naming %s", topic, code, errb.String(), path)
			}
		}
	})
	t.Run("wrong contract", func(t *testing.T) {
		other := filepath.Join(t.TempDir(), "c.yaml")
		b, err := os.ReadFile(filepath.Join(mustRunDir(t, dir), parquet.ContractFile))
		if err != nil {
			t.Fatal(err)
		}
		changed := regexp.MustCompile(`(?m)^seed: .*$`).ReplaceAll(b, []byte("seed: 987654"))
		if bytes.Equal(changed, b) {
			t.Fatal("recorded contract has no seed line")
		}
		if err := os.WriteFile(other, changed, 0o644); err != nil {
			t.Fatal(err)
		}
		var out, errb bytes.Buffer
		if code := run(context.Background(), []string{"replay", dir, "--contract", other}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "hash") {
			t.Fatalf("replay under another contract: exit %d, %q", code, errb.String())
		}
	})

	t.Run("a missing trajectories file is refused", func(t *testing.T) {
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		var victim parquet.File
		for _, f := range files {
			if f.Topic == "trajectories" {
				victim = f
				break
			}
		}
		moved := filepath.Join(t.TempDir(), "x")
		if err := os.Rename(victim.Path, moved); err != nil {
			t.Fatal(err)
		}
		defer os.Rename(moved, victim.Path)
		// Its sidecar remains: the replay refuses the snapshot, naming
		// the missing file.
		var out, errb bytes.Buffer
		code := run(context.Background(), []string{"replay", dir}, &out, &errb)
		if code != 1 || !strings.Contains(errb.String(), "file missing") || !strings.Contains(errb.String(), victim.Path) {
			t.Fatalf("replay without %s (its sidecar left): exit %d, stdout %q, stderr %q", victim.Path, code, out.String(), errb.String())
		}
		t.Log(strings.TrimSpace(errb.String()))
		side, movedSide := parquet.SidecarPath(victim.Path), filepath.Join(t.TempDir(), "x.sha256")
		if err := os.Rename(side, movedSide); err != nil {
			t.Fatal(err)
		}
		defer os.Rename(movedSide, side)
		out.Reset()
		errb.Reset()
		code = run(context.Background(), []string{"replay", dir}, &out, &errb)
		// With its sidecar gone too, it is the first file of its
		// partition that is missing: the replay refuses the snapshot,
		// naming the partition, before it compares anything.
		if code != 1 || !strings.Contains(errb.String(), "incomplete snapshot") || !strings.Contains(errb.String(), fmt.Sprintf("trajectories/%d", victim.Partition)) {
			t.Fatalf("replay without %s: exit %d, stdout %q, stderr %q", victim.Path, code, out.String(), errb.String())
		}
		t.Log(strings.TrimSpace(errb.String()))
	})
}

func mustRunDir(t testing.TB, dir string) string {
	t.Helper()
	d, err := parquet.FindRun(dir, "")
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestSnapshotSIGKILL kills `trajflow run snapshot` (a separate process)
// with SIGKILL while the run is producing, restarts it, and checks that
// the files hold every offset of every partition exactly once.
func TestSnapshotSIGKILL(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "trajflow")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	c := testkit.LoadContract(t, conformanceContract)
	run := testkit.StartRun(t, c, "")
	dir := t.TempDir()
	state := t.TempDir()
	start := func() *exec.Cmd {
		cmd := exec.Command(bin, "run", "snapshot", "--brokers", run.Addr, "--contract", conformanceContract,
			"--snapshot-dir", dir, "--snapshot-roll-bytes", "65536", "--snapshot-roll-interval", "150ms",
			"--state", state, "--log-level", "warn")
		var errb bytes.Buffer
		cmd.Stderr = &errb
		cmd.Stdout = &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if cmd.ProcessState == nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
		})
		return cmd
	}
	s := run.Synth(300, 3000)
	run.Produce(t, s, 0, 30)
	for _, name := range []string{"validate", "reward", "advantage", "pack"} {
		run.StartOperator(t, name, t.TempDir())
	}
	cmd := start()
	// Kill it once it has written some files but not all.
	deadline := time.Now().Add(30 * time.Second)
	for {
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(files) >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot files after 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	run.Produce(t, s, 30, 45)
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	before, _ := parquet.List(dir)
	run.Produce(t, s, 45, 60)
	cmd = start()
	run.WaitCovered(t, dir, 40*time.Second)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	files, err := parquet.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d files before the kill, %d after the restart", len(before), len(files))
	if len(files) <= len(before) {
		t.Fatalf("restart wrote no file")
	}
	if gaps := parquet.Contiguity(files); len(gaps) > 0 {
		t.Fatalf("offsets not contiguous after SIGKILL and restart: %v", gaps)
	}
	first := map[string]int64{}
	for _, f := range files {
		k := f.Topic + "/" + string(rune('0'+f.Partition))
		if _, ok := first[k]; !ok {
			first[k] = f.FirstOffset
		}
	}
	for k, off := range first {
		if off != 0 {
			t.Fatalf("%s starts at offset %d", k, off)
		}
	}
	// Every file verifies, and no message appears twice.
	snap, err := parquet.ReadRun(t.Context(), mustRunDir(t, dir), nil, parquet.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for topic, msgs := range snap.Topics {
		seen := map[[2]int64]bool{}
		for _, m := range msgs {
			k := [2]int64{int64(m.Partition), m.Offset}
			if seen[k] {
				t.Fatalf("%s/%d@%d written twice", topic, m.Partition, m.Offset)
			}
			seen[k] = true
		}
	}
}

// copySnapshot copies the snapshot directory src to a new directory.
func copySnapshot(t *testing.T, src string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "snap")
	if err := os.CopyFS(dst, os.DirFS(src)); err != nil {
		t.Fatal(err)
	}
	return dst
}

// TestIncompleteSnapshots: census refuses a snapshot without its census
// topic and warns about a missing partition, counts the quarantine
// records it cannot tie to an attempt; replay refuses a snapshot missing
// a trajectories partition; both name every unreadable file (census
// prints its partial counts and exits 1 unless --partial); both find the
// run in trajflow up's layout; replay --to-brokers refuses topics that
// already hold the run.
func TestIncompleteSnapshots(t *testing.T) {
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var so, se bytes.Buffer
	if code := run(ctx, []string{"demo", "--updates", "1", "--eval-samples", "1", "--out", out}, &so, &se); code != 0 {
		t.Fatalf("demo: exit %d: %s", code, se.String())
	}
	cli := func(args ...string) (int, string, string) {
		var o, e bytes.Buffer
		code := run(ctx, args, &o, &e)
		return code, o.String(), e.String()
	}
	if code, o, e := cli("census", out); code != 0 || strings.Contains(o+e, "warning") {
		t.Fatalf("census of the complete snapshot: exit %d: %s %s", code, o, e)
	}

	t.Run("no census topic", func(t *testing.T) {
		dir := copySnapshot(t, out)
		if err := os.RemoveAll(filepath.Join(dir, "run=demo", "topic=census")); err != nil {
			t.Fatal(err)
		}
		code, o, e := cli("census", dir)
		if code != 1 || !strings.Contains(e, "holds no census record") || !strings.Contains(e, "topic trajectories") {
			t.Fatalf("census without census topic: exit %d: %s %s", code, o, e)
		}
	})

	t.Run("missing trajectories partition", func(t *testing.T) {
		dir := copySnapshot(t, out)
		if err := os.RemoveAll(filepath.Join(dir, "run=demo", "topic=trajectories", "partition=1")); err != nil {
			t.Fatal(err)
		}
		code, o, e := cli("census", dir)
		if code != 0 || !strings.Contains(e, "warning: snapshot incomplete: trajectories/1: no snapshot file for partition 1 of 4") ||
			!strings.Contains(o, "trajectories/1") {
			t.Fatalf("census without trajectories/1: exit %d: %s %s", code, o, e)
		}
		code, o, e = cli("replay", dir)
		if code != 1 || !strings.Contains(e, "incomplete snapshot") || !strings.Contains(e, "trajectories/1") {
			t.Fatalf("replay without trajectories/1: exit %d: %s %s", code, o, e)
		}
	})

	t.Run("quarantine records tied to no attempt", func(t *testing.T) {
		dir := copySnapshot(t, out)
		info, err := parquet.ReadRunInfo(filepath.Join(dir, "run=demo"))
		if err != nil {
			t.Fatal(err)
		}
		q := []parquet.Message{{Offset: 0, Value: []byte("not arrow"), Headers: []pipeline.Header{
			{Key: "trajflow-id", Value: []byte("message-id-of-no-attempt")}, {Key: "trajflow-reason", Value: []byte("decode_error")}}},
			{Offset: 1, Value: []byte("x"), Headers: []pipeline.Header{{Key: "trajflow-reason", Value: []byte("decode_error")}}}}
		tgt := parquet.Target{Dir: dir, Run: "demo", Topic: "demo.quarantine", ContractHash: info.ContractHash}
		if _, _, err := parquet.WriteFile(tgt, 0, q, parquet.WriteOptions{}); err != nil {
			t.Fatal(err)
		}
		code, o, e := cli("census", dir)
		if code != 0 || !strings.Contains(o, "quarantine topic: 2 records, 2 tied to no attempt") || !strings.Contains(o, "decode_error") {
			t.Fatalf("census with quarantine records: exit %d: %s %s", code, o, e)
		}
	})

	t.Run("unreadable files", func(t *testing.T) {
		dir := copySnapshot(t, out)
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		// One file of each topic: census and trajectories (read by both
		// commands) corrupt, valid (read by replay only) removed with its
		// sidecar left.
		victims := map[string]string{}
		for _, f := range files {
			if _, ok := victims[f.Topic]; !ok {
				victims[f.Topic] = f.Path
			}
		}
		testkit.FlipByte(t, victims["census"])
		testkit.FlipByte(t, victims["trajectories"])
		if err := os.Remove(victims["valid"]); err != nil {
			t.Fatal(err)
		}
		code, o, e := cli("census", dir)
		if code != 1 || !strings.HasPrefix(o, "PARTIAL: 2 snapshot file(s) unreadable") || !strings.Contains(o, "attempt funnel") ||
			!strings.Contains(e, "2 snapshot file(s) unreadable") {
			t.Fatalf("census of three bad files: exit %d: %s %s", code, o, e)
		}
		for _, p := range []string{victims["census"], victims["trajectories"]} {
			if !strings.Contains(o, p) || !strings.Contains(e, "unreadable: snapshot file "+p) {
				t.Errorf("census does not name %s on stdout and stderr:\n%s\n%s", p, o, e)
			}
		}
		if !strings.Contains(e, "warning: snapshot incomplete: snapshot file "+victims["valid"]+": snapshot: file missing") {
			t.Errorf("census does not warn of the missing %s:\n%s", victims["valid"], e)
		}
		if code, o2, e2 := cli("census", dir, "--partial"); code != 0 || o2 != o || !strings.Contains(e2, "the counts are partial") {
			t.Errorf("census --partial: exit %d (stdout as without it: %v): %s", code, o2 == o, e2)
		}
		code, o, e = cli("replay", dir)
		if code != 1 || !strings.Contains(e, "file missing") {
			t.Fatalf("replay of bad files: exit %d: %s %s", code, o, e)
		}
		for _, p := range []string{victims["trajectories"], victims["valid"]} {
			if !strings.Contains(e, p) {
				t.Errorf("replay does not name %s:\n%s", p, e)
			}
		}
	})

	t.Run("a corrupt file of a topic replay does not read", func(t *testing.T) {
		dir := copySnapshot(t, out)
		files, err := parquet.List(dir)
		if err != nil {
			t.Fatal(err)
		}
		var removed string
		for _, f := range files {
			switch {
			case f.Topic == "census":
				testkit.FlipByte(t, f.Path)
			case f.Topic == "tasks" && removed == "":
				removed = f.Path
				if err := os.Remove(f.Path); err != nil {
					t.Fatal(err)
				}
			}
		}
		code, o, e := cli("replay", dir)
		if code != 0 || !strings.Contains(o, "batches identical") || !strings.Contains(o, "warning: snapshot file "+removed+": snapshot: file missing") {
			t.Fatalf("replay with corrupt census files and a missing tasks file: exit %d: %s %s", code, o, e)
		}
	})

	t.Run("trajflow up's layout", func(t *testing.T) {
		// up --out OUT writes OUT/snapshots/run=<run>, OUT/releases and
		// OUT/summary.json.
		up := t.TempDir()
		if err := os.CopyFS(filepath.Join(up, parquet.SnapshotsDir, "run=demo"), os.DirFS(filepath.Join(out, "run=demo"))); err != nil {
			t.Fatal(err)
		}
		for _, dir := range []string{up, filepath.Join(up, parquet.SnapshotsDir)} {
			if code, o, e := cli("census", dir); code != 0 || !strings.Contains(o, "attempt funnel") {
				t.Errorf("census %s: exit %d: %s %s", dir, code, o, e)
			}
			if code, o, e := cli("replay", dir); code != 0 || !strings.Contains(o, "batches identical") {
				t.Errorf("replay %s: exit %d: %s %s", dir, code, o, e)
			}
		}
	})

	t.Run("to-brokers twice", func(t *testing.T) {
		addr := startBroker(t)
		if code, o, e := cli("replay", out, "--to-brokers", addr); code != 0 {
			t.Fatalf("first re-emit: exit %d: %s %s", code, o, e)
		}
		code, o, e := cli("replay", out, "--to-brokers", addr)
		if code != 1 || !strings.Contains(e, "already hold records of run demo") || !strings.Contains(e, "demo.batches") {
			t.Fatalf("second re-emit: exit %d: %s %s", code, o, e)
		}
	})
}
