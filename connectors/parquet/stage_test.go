package parquet

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/trajflow/trajflow/pipeline"
)

func pmsg(topic string, m Message) pipeline.Message {
	return pipeline.Message{Ref: pipeline.Ref{Topic: topic, Partition: m.Partition, Offset: m.Offset}, Key: m.Key, Value: m.Value, Headers: m.Headers, Time: m.Time}
}

// TestStageHoldsUntilDurable drives the snapshot stage without Kafka: an
// input is held until the file holding it is written, then released; a new
// stage on the same directory skips what is already written, so a
// redelivery after a crash leaves offsets contiguous and unduplicated.
func TestStageHoldsUntilDurable(t *testing.T) {
	topic := testRun + ".trajectories"
	msgs := trajMessages(t, 12, 0)
	size := int64(len(msgs[0].Value) + len(msgs[0].Key))
	tests := []struct {
		name      string
		rollBytes int64
		maxBuffer int64
		wantFiles int // files after the 12 messages, before Flush; -1: at least one
	}{
		{"roll by size", 3 * size, 1 << 30, -1},
		{"bounded memory writes the largest buffer", 1 << 30, 5 * size, -1},
		{"nothing rolls before the interval", 1 << 30, 1 << 30, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			now := time.Unix(1000, 0)
			st, err := NewStage(StageConfig{Dir: dir, Run: testRun, Topics: []string{topic}, RollBytes: tc.rollBytes,
				MaxBufferedBytes: tc.maxBuffer, RollInterval: time.Minute, ContractYAML: []byte("run_id: x\n"),
				Now: func() time.Time { return now }})
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Start(context.Background(), nil); err != nil {
				t.Fatal(err)
			}
			held := map[int64]bool{}
			sizes := map[int64]int64{}
			for _, m := range msgs {
				sizes[m.Offset] = int64(len(m.Value) + len(m.Key))
				res, err := st.Process(context.Background(), pmsg(topic, m))
				if err != nil {
					t.Fatal(err)
				}
				if res.Hold {
					held[m.Offset] = true
				}
				for _, r := range res.Release {
					if !held[r.Offset] {
						t.Fatalf("released %v, which was not held", r)
					}
					delete(held, r.Offset)
				}
				if len(res.Outputs) != 0 {
					t.Fatalf("snapshot produced outputs")
				}
				var inMemory int64
				for o := range held {
					inMemory += sizes[o]
				}
				if inMemory > tc.maxBuffer || (tc.rollBytes < 1<<30 && inMemory >= tc.rollBytes) {
					t.Fatalf("%d bytes held in memory after offset %d (roll %d, max %d)", inMemory, m.Offset, tc.rollBytes, tc.maxBuffer)
				}
			}
			files, _ := List(dir)
			if tc.wantFiles < 0 && len(files) > 0 && st.Files() == len(files) {
				tc.wantFiles = len(files)
			}
			if len(files) != tc.wantFiles || st.Files() != tc.wantFiles {
				t.Fatalf("%d files (stage says %d), want %d", len(files), st.Files(), tc.wantFiles)
			}
			for _, f := range files {
				for o := f.FirstOffset; o <= f.LastOffset; o++ {
					if held[o] {
						t.Fatalf("offset %d is in a durable file but still held", o)
					}
				}
			}
			// Tick before the roll interval writes nothing; after, the rest.
			if res, _ := st.Tick(context.Background(), now.Add(time.Second)); len(res.Release) != 0 {
				t.Fatalf("early tick released %d", len(res.Release))
			}
			res, err := st.Tick(context.Background(), now.Add(2*time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range res.Release {
				delete(held, r.Offset)
			}
			if len(held) != 0 {
				t.Fatalf("offsets still held after the roll interval: %v", held)
			}

			// A restart (new stage, same directory) with a redelivery of
			// everything plus new messages writes only the new ones.
			st2, err := NewStage(StageConfig{Dir: dir, Run: testRun, Topics: []string{topic}, RollBytes: tc.rollBytes, MaxBufferedBytes: tc.maxBuffer})
			if err != nil {
				t.Fatal(err)
			}
			if err := st2.Start(context.Background(), nil); err != nil {
				t.Fatal(err)
			}
			more := append(slices.Clone(msgs), trajMessages(t, 15, 0)[12:]...)
			for _, m := range more {
				res, err := st2.Process(context.Background(), pmsg(topic, m))
				if err != nil {
					t.Fatal(err)
				}
				if m.Offset < 12 && res.Hold {
					t.Fatalf("already written offset %d held again", m.Offset)
				}
			}
			if _, err := st2.Flush(context.Background()); err != nil {
				t.Fatal(err)
			}
			files, _ = List(dir)
			if gaps := Contiguity(files); len(gaps) > 0 || files[0].FirstOffset != 0 || files[len(files)-1].LastOffset != 14 {
				t.Fatalf("files %+v gaps %v", files, gaps)
			}
			if _, err := os.Stat(filepath.Join(RunDir(dir, testRun), ContractFile)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestStageRemovesCrashLeftovers(t *testing.T) {
	dir := t.TempDir()
	pdir := PartitionDir(dir, testRun, testRun+".trajectories", 0)
	if err := os.MkdirAll(pdir, 0o755); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(pdir, "."+FileName(0, 4)+".tmp-123")
	orphan := SidecarPath(filepath.Join(pdir, FileName(0, 4)))
	for _, p := range []string{tmp, orphan} {
		if err := os.WriteFile(p, []byte("half"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	st, err := NewStage(StageConfig{Dir: dir, Run: testRun, Topics: []string{testRun + ".trajectories"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Start(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{tmp, orphan} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("%s left after start: %v", p, err)
		}
	}
}

func TestStageWritesTaskRegistry(t *testing.T) {
	dir := t.TempDir()
	tasks := []TaskRow{{TaskID: "t1", Split: "train", Key: 3, EnvVersion: "e"}, {TaskID: "t2", Split: "eval", Key: 0}}
	st, err := NewStage(StageConfig{Dir: dir, Run: testRun, Topics: []string{testRun + ".census"}, Tasks: tasks})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Start(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	got, err := ReadTasks(RunDir(dir, testRun))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, tasks) {
		t.Fatalf("tasks read %+v, written %+v", got, tasks)
	}
	path := filepath.Join(RunDir(dir, testRun), TasksFile)
	b, _ := os.ReadFile(path)
	b[len(b)/2] ^= 1
	os.WriteFile(path, b, 0o644)
	if _, err := ReadTasks(RunDir(dir, testRun)); err == nil {
		t.Fatal("corrupted task registry read without error")
	}
}
