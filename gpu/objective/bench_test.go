package objective

import (
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

// FuzzCompute feeds arbitrary shapes and values (NaN/Inf logits, targets
// out of range, mask values other than 0/1, wild segment ids, slices of the
// wrong length) to Compute: it must return an error wrapping one of the
// package's sentinels or a finite result, never panic.
func FuzzCompute(f *testing.F) {
	f.Add([]byte{3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})
	f.Add([]byte{1, 1, 1, 0xff, 0xff, 0xc0, 0x7f})
	f.Add([]byte{8, 2, 2, 0, 0, 0x80, 0x7f, 1, 1, 1, 1, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) < 3 {
			return
		}
		T, V, flags := int(data[0]%10), int(data[1]%7), data[2]
		data = data[3:]
		next := func() byte {
			if len(data) == 0 {
				return 0
			}
			b := data[0]
			data = data[1:]
			return b
		}
		nextF := func() float32 {
			var b [4]byte
			for i := range b {
				b[i] = next()
			}
			if flags&1 == 0 { // mostly tame values
				return float32(int8(b[0])) / 16
			}
			return math.Float32frombits(binary.LittleEndian.Uint32(b[:]))
		}
		n := func(k int) int { // sometimes the wrong length
			if flags&2 != 0 && next()%5 == 0 {
				return k + 1
			}
			return k
		}
		in := Inputs{T: T, V: V}
		in.Logits = make([]float32, n(T*V))
		for i := range in.Logits {
			in.Logits[i] = nextF()
		}
		in.Targets = make([]int32, n(T))
		in.Mask = make([]uint8, n(T))
		in.OldLogprobs = make([]float32, n(T))
		in.Advantages = make([]float32, n(T))
		in.SegmentIDs = make([]int32, n(T))
		for i := range in.Targets {
			in.Targets[i] = int32(int8(next())) % 8
		}
		for i := range in.Mask {
			in.Mask[i] = next() % 3
		}
		for i := range in.OldLogprobs {
			in.OldLogprobs[i] = -float32(math.Abs(float64(nextF())))
		}
		for i := range in.Advantages {
			in.Advantages[i] = nextF()
		}
		for i := range in.SegmentIDs {
			in.SegmentIDs[i] = int32(int8(next())) % 5
		}
		opts := Options{ClipLow: 0.2, ClipHigh: 0.3, Normalization: allNorms[int(flags>>2)%3], EntropyCoef: 0.01}
		if flags&32 != 0 {
			in.RefLogprobs = make([]float32, n(T))
			for i := range in.RefLogprobs {
				in.RefLogprobs[i] = -float32(math.Abs(float64(nextF())))
			}
			opts.KLPlacement, opts.KLEstimator, opts.KLCoef = KLLoss, []string{K1, K2, K3}[int(flags>>6)%3], 0.1
		}
		if len(data) > 0 && data[len(data)-1]&1 == 1 { // the last byte, not consumed
			opts.Ratio = RatioSequence
		}
		den := Denominators{Tokens: int64(next()), Sequences: int64(next())}
		res, err := Compute(in, opts, den)
		if err != nil {
			if !errors.Is(err, ErrShape) && !errors.Is(err, ErrTarget) && !errors.Is(err, ErrInput) && !errors.Is(err, ErrOptions) {
				t.Fatalf("error without sentinel: %v", err)
			}
			return
		}
		// Finite inputs within exp's range give a finite loss; huge
		// advantages (fuzzed bits) may legitimately overflow, so only
		// NaN from finite, bounded inputs would be a bug.
		if flags&1 == 0 && (math.IsNaN(res.Loss) || math.IsInf(res.Loss, 0)) {
			t.Fatalf("non-finite loss %v from tame inputs", res.Loss)
		}
	})
}

// benchProblem is a packed row of T positions in 8 segments over a
// vocabulary of V, with KL (k3) in the loss and the entropy bonus on.
func benchProblem(b *testing.B, T, V int) (Inputs, Options, Denominators) {
	rng := rand.New(rand.NewPCG(23, 24))
	in := randProblem(b, rng, T, V, 8, 0.3)
	opts := Options{ClipLow: 0.2, ClipHigh: 0.28, Normalization: SeqMeanTokenMean,
		KLPlacement: KLLoss, KLEstimator: K3, KLCoef: 0.05, EntropyCoef: 0.01}
	return in, opts, mustDen(b, in)
}

// BenchmarkCompute measures the reference objective (forward and gradient)
// on one T=4096, V=256 row; reports positions/s ("tokens/s") and the
// masked (trained) tokens/s.
func BenchmarkCompute(b *testing.B) {
	const T, V = 4096, 256
	in, opts, den := benchProblem(b, T, V)
	var res Result
	if err := ComputeInto(in, opts, den, &res); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(4 * T * V)) // logits read (and gradient written) per call
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		if err := ComputeInto(in, opts, den, &res); err != nil {
			b.Fatal(err)
		}
	}
	sec := time.Since(start).Seconds()
	b.ReportMetric(float64(T)*float64(b.N)/sec, "tokens/s")
	b.ReportMetric(float64(res.Tokens)*float64(b.N)/sec, "masked_tokens/s")
}

// BenchmarkLogSoftmaxGather measures the forward gather alone on the same
// shape.
func BenchmarkLogSoftmaxGather(b *testing.B) {
	const T, V = 4096, 256
	in, _, _ := benchProblem(b, T, V)
	out := make([]float32, T)
	b.SetBytes(int64(4 * T * V))
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		if err := LogSoftmaxGather(in.Logits, T, V, in.Targets, out); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(T)*float64(b.N)/time.Since(start).Seconds(), "tokens/s")
}
