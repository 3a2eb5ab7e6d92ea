//go:build cuda

package cuda

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/apache/arrow-go/v18/arrow"
	"github.com/apache/arrow-go/v18/arrow/memory"
	"gorgonia.org/cu"

	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/gpu/model"
	"github.com/trajflow/trajflow/gpu/objective"
	"github.com/trajflow/trajflow/schemas"
)

// elapsed times fn on the default stream with events, in seconds.
func elapsed(b *testing.B, stream cu.Stream, fn func()) float64 {
	start, _ := cu.MakeEvent(cu.DefaultEvent)
	end, _ := cu.MakeEvent(cu.DefaultEvent)
	defer cu.DestroyEvent(&start)
	defer cu.DestroyEvent(&end)
	if err := start.Record(stream); err != nil {
		b.Fatal(err)
	}
	fn()
	if err := end.Record(stream); err != nil {
		b.Fatal(err)
	}
	if err := end.Synchronize(); err != nil {
		b.Fatal(err)
	}
	ms, err := start.Elapsed(end)
	if err != nil {
		b.Fatal(err)
	}
	return ms / 1e3
}

// BenchmarkH2DPinned: raw host-to-device copy bandwidth from pinned memory
// on the copy stream (the ceiling the staging path is compared with).
func BenchmarkH2DPinned(b *testing.B) {
	d := openDevice(b)
	const n = 256 << 20
	if err := d.Ensure(0, n); err != nil {
		b.Fatal(err)
	}
	done, _ := d.Enter()
	defer done()
	var secs float64
	b.SetBytes(n)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		secs += elapsed(b, d.copy, func() {
			if err := cu.MemcpyHtoDAsync(d.dbuf[0], d.host[0], n, d.copy); err != nil {
				b.Fatal(err)
			}
		})
	}
	b.ReportMetric(float64(n)*float64(b.N)/secs/1e9, "GB/s")
}

func stagingBatch(b *testing.B) (*Device, *Ring, arrow.RecordBatch, objective.Options) {
	d := openDevice(b)
	mem := memory.NewGoAllocator()
	const V = 32000
	batch := randomBatch(rand.New(rand.NewPCG(5, 6)), 128, 8192, V, false, 0)
	rec, err := schemas.PackedBatches.ToRecord(mem, batch)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(rec.Release)
	opts := objective.Options{ClipLow: 0.2, ClipHigh: 0.2, Normalization: objective.TokenMean, KLPlacement: objective.KLNone}
	return d, NewRing(d, V, DefaultCapacity()), rec, opts
}

// BenchmarkStagingH2D: the copies of the staging path — both slots hold a
// packed batch (~0.8M tokens, Arrow record -> pinned buffer), and the
// copies alternate between the slots on the copy stream with the slot
// events, as the ring issues them. GB/s of staged bytes over the copy
// stream's elapsed time; compare with BenchmarkH2DPinned.
func BenchmarkStagingH2D(b *testing.B) {
	d, ring, rec, opts := stagingBatch(b)
	var st *Staged
	for s := 0; s < Slots; s++ {
		_, x, err := ring.PutRecord(rec, opts)
		if err != nil {
			b.Fatal(err)
		}
		st = x
	}
	n := st.Layout.Bytes
	done, _ := d.Enter()
	defer done()
	b.SetBytes(int64(n))
	b.ResetTimer()
	secs := elapsed(b, d.copy, func() {
		for i := 0; i < b.N; i++ {
			if err := d.CopyAsync(i%Slots, n); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.ReportMetric(float64(n)*float64(b.N)/secs/1e9, "GB/s")
	b.ReportMetric(float64(st.Layout.T), "tokens/batch")
}

// BenchmarkStagingPackH2D: the staging path end to end — pack the Arrow
// record into the next pinned slot (host, one goroutine) while the
// previous slot's copy runs. Host-bound: GB/s of staged bytes per wall time.
func BenchmarkStagingPackH2D(b *testing.B) {
	d, ring, rec, opts := stagingBatch(b)
	_, st, err := ring.PutRecord(rec, opts)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(st.Layout.Bytes))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, _, err := ring.PutRecord(rec, opts); err != nil {
			b.Fatal(err)
		}
	}
	for s := 0; s < Slots; s++ {
		_ = d.WaitCopied(s)
	}
	b.ReportMetric(float64(ring.Grows()), "grows")
}

// BenchmarkCopyD2D: device-to-device copy bandwidth (read + write bytes),
// the reference for the memory-bound kernels.
func BenchmarkCopyD2D(b *testing.B) {
	d := openDevice(b)
	done, _ := d.Enter()
	defer done()
	const n = 1 << 30
	src, err := cu.MemAlloc(n)
	if err != nil {
		b.Fatal(err)
	}
	defer cu.MemFree(src)
	dst, err := cu.MemAlloc(n)
	if err != nil {
		b.Fatal(err)
	}
	defer cu.MemFree(dst)
	var secs float64
	b.SetBytes(2 * n)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		secs += elapsed(b, cu.Stream{}, func() {
			if err := cu.MemcpyDtoDAsync(dst, src, n, cu.Stream{}); err != nil {
				b.Fatal(err)
			}
		})
	}
	b.ReportMetric(2*float64(n)*float64(b.N)/secs/1e9, "GB/s")
}

// BenchmarkLogprobLoss: the log-prob gather (one pass of the online
// log-sum-exp over materialized logits [T][V]) and the per-token clipped
// surrogate, as one would run on the logits of a large model. GB/s counts
// the logits read once. With $TRAJFLOW_DUMP_DIR set, the tensors and the
// kernel time are written there for the PyTorch comparison
// (gpu/devicecheck_torch.py).
func BenchmarkLogprobLoss(b *testing.B) {
	d := openDevice(b)
	T, V := 4096, 32768
	rng := rand.New(rand.NewPCG(1, 2))
	logits := make([]float32, T*V)
	for i := range logits {
		logits[i] = float32(rng.NormFloat64() * 2)
	}
	tgt := make([]int32, T)
	old := make([]float32, T)
	adv := make([]float32, T)
	w := make([]float32, T)
	mask := make([]uint8, T)
	for i := range tgt {
		tgt[i] = int32(rng.IntN(V))
		old[i] = float32(-math.Log(float64(V)) + rng.NormFloat64()*0.1)
		adv[i] = float32(rng.NormFloat64())
		mask[i] = 1
		w[i] = 1 / float32(T)
	}
	done, _ := d.Enter()
	defer done()
	alloc := func(n int) DevPtr {
		p, err := d.Alloc(int64(n))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { d.Free(p) })
		return p
	}
	up := func(p DevPtr, src unsafe.Pointer, n int) {
		if err := d.Upload(p, src, int64(n)); err != nil {
			b.Fatal(err)
		}
	}
	dz := alloc(4 * T * V)
	up(dz, unsafe.Pointer(&logits[0]), 4*T*V)
	dt, dw, dold, dadv, dmask := alloc(4*T), alloc(4*T), alloc(4*T), alloc(4*T), alloc(T)
	up(dt, unsafe.Pointer(&tgt[0]), 4*T)
	up(dw, unsafe.Pointer(&w[0]), 4*T)
	up(dold, unsafe.Pointer(&old[0]), 4*T)
	up(dadv, unsafe.Pointer(&adv[0]), 4*T)
	up(dmask, unsafe.Pointer(&mask[0]), T)
	o := make([]DevPtr, 12)
	for i := range o {
		o[i] = alloc(8 * T)
	}
	run := func() {
		if err := d.Launch("tf_lse_init", gridFor(int64(T)), blockSize, o[0], o[1], o[2], o[3], T); err != nil {
			b.Fatal(err)
		}
		if err := d.Launch("tf_lse_chunk", T, blockSize, dz, int64(V), DevPtr(0), 0, V, float32(1), dt, o[0], o[1], o[2], o[3], T); err != nil {
			b.Fatal(err)
		}
		if err := d.Launch("tf_token_loss", gridFor(int64(T)), blockSize, dt, dmask, dw, dold, dold, dadv, o[0], o[1], o[2], o[3], T,
			0.2, 0.2, 0.0, 0, 0.0, o[4], o[5], o[6], o[7], o[8], o[9], o[10], o[11]); err != nil {
			b.Fatal(err)
		}
	}
	run() // warm up (JIT, caches)
	_ = cu.Synchronize()
	var secs float64
	b.SetBytes(int64(4 * T * V))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		secs += elapsed(b, cu.Stream{}, run)
	}
	b.StopTimer()
	per := secs / float64(b.N)
	b.ReportMetric(float64(4*T*V)/per/1e9, "GB/s")
	b.ReportMetric(per*1e3, "kernel-ms")
	// Results for the side-by-side comparison.
	lp := make([]float32, T)
	sur := make([]float64, T)
	if err := d.Download(unsafe.Pointer(&lp[0]), o[4], int64(4*T)); err != nil {
		b.Fatal(err)
	}
	if err := d.Download(unsafe.Pointer(&sur[0]), o[6], int64(8*T)); err != nil {
		b.Fatal(err)
	}
	var loss float64
	for i := range sur {
		loss -= float64(w[i]) * sur[i]
	}
	if dir := os.Getenv("TRAJFLOW_DUMP_DIR"); dir != "" {
		write := func(name string, data any) {
			f, err := os.Create(filepath.Join(dir, name))
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			if err := binary.Write(f, binary.LittleEndian, data); err != nil {
				b.Fatal(err)
			}
		}
		write("logits.f32", logits)
		write("targets.i32", tgt)
		write("old.f32", old)
		write("adv.f32", adv)
		write("logprob_gpu.f32", lp)
		meta, _ := json.Marshal(map[string]any{"T": T, "V": V, "clip_low": 0.2, "clip_high": 0.2,
			"kernel_ms": per * 1e3, "kernel_gbps": float64(4*T*V) / per / 1e9, "loss": loss, "device": d.Name(), "ptx": d.PTXFrom})
		if err := os.WriteFile(filepath.Join(dir, "meta.json"), meta, 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDeviceStep: one full device optimizer step (forward, chunked
// log-prob gather, loss, backward, Adam) of a window MLP with a 32k
// vocabulary on a ~12k-token batch; tokens/s of batch positions.
func BenchmarkDeviceStep(b *testing.B) {
	d := openDevice(b)
	cfg := model.Config{Vocab: 32000, Window: 8, Embed: 64, Hidden: 512}
	m, err := model.New(cfg, 3)
	if err != nil {
		b.Fatal(err)
	}
	tr, err := NewTrainer(d, m, model.Behavior{Temperature: 1}, 0, TrainerOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer tr.Close()
	batch := randomBatch(rand.New(rand.NewPCG(8, 8)), 8, 2048, cfg.Vocab, false, 0)
	opts, adam := gpu.DefaultObjective(), gpu.DefaultAdam()
	step := func() gpu.Metrics {
		h, err := tr.Stage(batch, opts)
		if err != nil {
			b.Fatal(err)
		}
		met, err := tr.Step(h, opts, adam)
		if err != nil {
			b.Fatal(err)
		}
		return met
	}
	met := step() // warm up: allocation, JIT
	if math.IsNaN(met.Loss) || math.IsInf(met.Loss, 0) {
		b.Fatalf("loss %v", met.Loss)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		met = step()
	}
	b.StopTimer()
	b.ReportMetric(float64(met.InputTokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
	b.ReportMetric(met.Loss, "loss")
}
