package cuda

import (
	"fmt"
	"math"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
	"unsafe"

	"gonum.org/v1/gonum/blas"
)

// emu is a CPU emulation of the device backend: device memory is a set of
// Go allocations at fake addresses, every kernel of kernels/trajflow.cu is
// transliterated to Go (float32 where the kernel uses float, float64 where
// it uses double), and Gemm is a column-major reference sgemm. Every
// pointer argument is viewed up to the end of its allocation, so a kernel
// that indexes past a buffer panics. It lets the orchestration of the
// device step run, and be compared with the CPU reference, without a GPU.
type emu struct {
	allocs   []emuAlloc // sorted by base
	next     uintptr
	host     [Slots][]byte
	dev      [Slots]DevPtr
	launches map[string][]string // argument kinds of each kernel launched
	gemms    int
}

type emuAlloc struct {
	base uintptr
	mem  []byte
}

func newEmu() *emu { return &emu{next: 1 << 32, launches: map[string][]string{}} }

func (e *emu) Enter() (func(), error) { return func() {}, nil }

func (e *emu) Alloc(bytes int64) (DevPtr, error) {
	if bytes <= 0 {
		bytes = 1
	}
	a := emuAlloc{base: e.next, mem: alignedBuf(int(bytes))}
	e.next += uintptr(alignUp(int(bytes), Align)) + Align // a gap: adjacent buffers never alias
	e.allocs = append(e.allocs, a)
	return DevPtr(a.base), nil
}

func (e *emu) find(p DevPtr) (int, int) {
	i := sort.Search(len(e.allocs), func(i int) bool { return e.allocs[i].base > uintptr(p) }) - 1
	if i < 0 || uintptr(p)-e.allocs[i].base >= uintptr(len(e.allocs[i].mem)) {
		panic(fmt.Sprintf("emu: address %#x is not in an allocation", uintptr(p)))
	}
	return i, int(uintptr(p) - e.allocs[i].base)
}

func (e *emu) Free(p DevPtr) {
	i, off := e.find(p)
	if off != 0 {
		panic("emu: free of an interior pointer")
	}
	e.allocs = append(e.allocs[:i], e.allocs[i+1:]...)
}

// rest is the memory from p to the end of its allocation.
func (e *emu) rest(p DevPtr) []byte {
	i, off := e.find(p)
	return e.allocs[i].mem[off:]
}

func (e *emu) f32(p DevPtr) []float32 { return f32(e.rest(p)) }
func (e *emu) i32(p DevPtr) []int32   { return i32(e.rest(p)) }
func (e *emu) f64(p DevPtr) []float64 {
	b := e.rest(p)
	return unsafe.Slice((*float64)(unsafe.Pointer(&b[0])), len(b)/8)
}

func (e *emu) Upload(dst DevPtr, src unsafe.Pointer, n int64) error {
	copy(e.rest(dst)[:n], unsafe.Slice((*byte)(src), n))
	return nil
}

func (e *emu) Download(dst unsafe.Pointer, src DevPtr, n int64) error {
	copy(unsafe.Slice((*byte)(dst), n), e.rest(src)[:n])
	return nil
}

func (e *emu) Zero(p DevPtr, n int64) error { clear(e.rest(p)[:n]); return nil }
func (e *emu) Copy(dst, src DevPtr, n int64) error {
	copy(e.rest(dst)[:n], e.rest(src)[:n])
	return nil
}
func (e *emu) Synchronize() error { return nil }

// Engine: copies happen at once (the ordering is tested with simEngine).
func (e *emu) Ensure(slot, n int) error {
	if e.dev[slot] != 0 {
		e.Free(e.dev[slot])
	}
	e.host[slot] = alignedBuf(n)
	var err error
	e.dev[slot], err = e.Alloc(int64(n))
	return err
}
func (e *emu) Host(slot int) []byte      { return e.host[slot] }
func (e *emu) WaitCopied(slot int) error { return nil }
func (e *emu) CopyAsync(slot, n int) error {
	copy(e.rest(e.dev[slot])[:n], e.host[slot][:n])
	return nil
}
func (e *emu) SlotPtr(slot int) DevPtr          { return e.dev[slot] }
func (e *emu) ComputeWaitCopied(slot int) error { return nil }
func (e *emu) RecordComputed(slot int) error    { return nil }

// Gemm is column-major C = op(A)·op(B) + beta·C, float32 accumulation; with
// beta == 0 C is not read (cuBLAS semantics).
func (e *emu) Gemm(tA, tB blas.Transpose, m, n, k int, a DevPtr, lda int, b DevPtr, ldb int, beta float32, c DevPtr, ldc int) error {
	e.gemms++
	A, B, C := e.f32(a), e.f32(b), e.f32(c)
	for j := 0; j < n; j++ {
		for i := 0; i < m; i++ {
			var s float32
			for l := 0; l < k; l++ {
				var x, y float32
				if tA == blas.NoTrans {
					x = A[i+l*lda]
				} else {
					x = A[l+i*lda]
				}
				if tB == blas.NoTrans {
					y = B[l+j*ldb]
				} else {
					y = B[j+l*ldb]
				}
				s += x * y
			}
			if beta != 0 {
				s += beta * C[i+j*ldc]
			}
			C[i+j*ldc] = s
		}
	}
	return nil
}

func kindOf(a any) string {
	switch a.(type) {
	case DevPtr:
		return "ptr"
	case int:
		return "i32"
	case int64:
		return "i64"
	case float32:
		return "f32"
	case float64:
		return "f64"
	}
	return fmt.Sprintf("%T", a)
}

// lse32 is the kernel's float32 online log-sum-exp state.
type lse32 struct{ m, s, a float32 }

func exp32(x float32) float32 { return float32(math.Exp(float64(x))) }

// raise is lse_raise: the maximum raised to x > st.m, the sums rescaled.
func (st *lse32) raise(x float32) {
	if st.s > 0 {
		d := st.m - x
		ex := exp32(d)
		st.a = ex * (st.a + st.s*d)
		st.s = st.s * ex
	}
	st.m = x
}

func (st *lse32) add(x float32) {
	if math.IsInf(float64(x), -1) {
		return
	}
	if x > st.m {
		st.raise(x)
		st.s += 1
	} else {
		d := x - st.m
		ex := exp32(d)
		st.s += ex
		st.a += ex * d
	}
}

// add4 is lse_take4's fold of one float4 group: the group's maximum
// (NaN if any is NaN), at most one rescale, then the four terms.
func (st *lse32) add4(x [4]float32) {
	mx := x[0]
	for _, v := range x[1:] {
		if v != v || mx != mx {
			mx = float32(math.NaN())
		} else {
			mx = max(mx, v)
		}
	}
	if math.IsInf(float64(mx), -1) {
		return
	}
	if mx > st.m {
		st.raise(mx)
	}
	for _, v := range x {
		d := v - st.m
		ex := exp32(d)
		st.s += ex
		if ex > 0 {
			st.a += ex * d
		}
	}
}

func merge32(x, y lse32) lse32 {
	if x.s == 0 {
		return y
	}
	if y.s == 0 {
		return x
	}
	m := max(x.m, y.m)
	dx, dy := x.m-m, y.m-m
	ex, ey := exp32(dx), exp32(dy)
	return lse32{m: m, s: x.s*ex + y.s*ey, a: ex*(x.a+x.s*dx) + ey*(y.a+y.s*dy)}
}

func finite64(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// Launch runs the Go transliteration of a kernel.
func (e *emu) Launch(name string, grid, block int, args ...any) error {
	kinds := make([]string, len(args))
	for i, a := range args {
		kinds[i] = kindOf(a)
	}
	if prev, ok := e.launches[name]; ok && strings.Join(prev, ",") != strings.Join(kinds, ",") {
		return fmt.Errorf("emu: %s launched with %v and %v", name, prev, kinds)
	}
	e.launches[name] = kinds
	if block != blockSize || grid < 1 {
		return fmt.Errorf("emu: %s launched with grid %d block %d", name, grid, block)
	}
	P := func(i int) DevPtr { return args[i].(DevPtr) }
	I := func(i int) int { return args[i].(int) }
	L := func(i int) int64 { return args[i].(int64) }
	F := func(i int) float32 { return args[i].(float32) }
	D := func(i int) float64 { return args[i].(float64) }
	switch name {
	case "tf_gather_x": // (tok, pos, emb, X, T, W, E)
		tok, pos, emb, X := e.i32(P(0)), e.i32(P(1)), e.f32(P(2)), e.f32(P(3))
		T, W, E := I(4), I(5), I(6)
		for i := 0; i < T; i++ {
			for s := 0; s < W; s++ {
				j := i - (W - 1) + s
				t := int32(0)
				if j >= i-int(pos[i]) {
					t = tok[j]
				}
				copy(X[i*W*E+s*E:i*W*E+(s+1)*E], emb[int(t)*E:int(t+1)*E])
			}
		}
	case "tf_bias_tanh": // (Hm, b1, T, H)
		h, b1, T, H := e.f32(P(0)), e.f32(P(1)), I(2), I(3)
		for idx := 0; idx < T*H; idx++ {
			h[idx] = float32(math.Tanh(float64(h[idx] + b1[idx%H])))
		}
	case "tf_lse_init": // (m, s, a, zy, T)
		m, s, a, zy, T := e.f32(P(0)), e.f32(P(1)), e.f32(P(2)), e.f32(P(3)), I(4)
		for i := 0; i < T; i++ {
			m[i], s[i], a[i], zy[i] = float32(math.Inf(-1)), 0, 0, 0
		}
	case "tf_lse_chunk": // (Z, ldz, b2, v0, C, temp, tgt, m, s, a, zy, T)
		Z, ldz := e.f32(P(0)), int(L(1))
		var b2 []float32
		if P(2) != 0 {
			b2 = e.f32(P(2))
		}
		v0, C, temp, tgt := I(3), I(4), F(5), e.i32(P(6))
		m, s, a, zy, T := e.f32(P(7)), e.f32(P(8)), e.f32(P(9)), e.f32(P(10)), I(11)
		for i := 0; i < T; i++ {
			y := int(tgt[i])
			if y < 0 {
				continue
			}
			logit := func(c int) float32 {
				x := Z[i*ldz+c]
				if b2 != nil {
					x += b2[v0+c]
				}
				if temp != 1 {
					x = x / temp
				}
				if v0+c == y {
					zy[i] = x
				}
				return x
			}
			parts := make([]lse32, block)
			for t := range parts {
				parts[t] = lse32{m: float32(math.Inf(-1))}
				if ldz%4 == 0 && C%4 == 0 { // the float4 path: thread t folds groups t, t+block, ...
					for g := t; g < C/4; g += block {
						parts[t].add4([4]float32{logit(4 * g), logit(4*g + 1), logit(4*g + 2), logit(4*g + 3)})
					}
					continue
				}
				for c := t; c < C; c += block {
					parts[t].add(logit(c))
				}
			}
			st := parts[0]
			for _, p := range parts[1:] {
				st = merge32(st, p)
			}
			g := merge32(lse32{m[i], s[i], a[i]}, st)
			m[i], s[i], a[i] = g.m, g.s, g.a
		}
	case "tf_token_loss": // (tgt, mask, w, old, ref, adv, m, s, a, zy, T, clipLow, clipHigh, maxLogRatio, kl, klCoef, lp, ratio, sur, klv, ent, flags, lse, gw)
		tgt, mask, w := e.i32(P(0)), e.rest(P(1)), e.f32(P(2))
		old, ref, adv := e.f32(P(3)), e.f32(P(4)), e.f32(P(5))
		m, s, a, zy, T := e.f32(P(6)), e.f32(P(7)), e.f32(P(8)), e.f32(P(9)), I(10)
		lo, hi, maxLR, kl, klCoef := 1-D(11), 1+D(12), D(13), I(14), D(15)
		lp, ratio, sur, klv, ent := e.f32(P(16)), e.f64(P(17)), e.f64(P(18)), e.f64(P(19)), e.f64(P(20))
		flags, lse, gw := e.i32(P(21)), e.f32(P(22)), e.f32(P(23))
		for i := 0; i < T; i++ {
			lp[i], ratio[i], sur[i], klv[i], ent[i], flags[i], gw[i], lse[i] = 0, 0, 0, 0, 0, 0, 0, 0
			if tgt[i] < 0 {
				continue
			}
			ls := math.Log(float64(s[i]))
			cur := float32(float64(zy[i]) - float64(m[i]) - ls)
			lp[i] = cur
			lse[i] = float32(float64(m[i]) + ls)
			if mask[i] != 1 {
				continue
			}
			h := ls - float64(a[i])/float64(s[i])
			ent[i] = h
			c, o, av := float64(cur), float64(old[i]), float64(adv[i])
			f := int32(0)
			if !finite64(c) {
				f |= FlagNoLogprob
			}
			if !finite64(o) || !finite64(av) || (kl != 0 && !finite64(float64(ref[i]))) {
				f |= FlagNonFinite
			}
			if f != 0 {
				flags[i] = f
				continue
			}
			lr := c - o
			clamped := false
			if maxLR > 0 && (lr > maxLR || lr < -maxLR) {
				lr = math.Max(-maxLR, math.Min(maxLR, lr))
				clamped = true
				f |= FlagLRClamped
			}
			r := math.Exp(lr)
			var sv, dsdcur float64
			switch {
			case av > 0 && r > hi:
				sv, f = hi*av, f|FlagClipped
			case av < 0 && r < lo:
				sv, f = lo*av, f|FlagClipped
			default:
				sv, dsdcur = r*av, r*av
			}
			if clamped {
				dsdcur = 0
			}
			g := -dsdcur
			if kl != 0 {
				logr := float64(ref[i]) - c
				var k, dk float64
				switch kl {
				case 1:
					k, dk = -logr, 1
				case 2:
					k, dk = logr*logr/2, -logr
				default:
					ex := math.Exp(logr)
					k, dk = ex-1-logr, 1-ex
				}
				klv[i] = k
				g += klCoef * dk
			}
			ratio[i], sur[i], flags[i] = r, sv, f
			gw[i] = float32(float64(w[i]) * g)
		}
	case "tf_dz_chunk": // (Z, ldz, b2, v0, C, temp, tgt, w, gw, lse, ent, alpha, T)
		Z, ldz, b2, v0, C, temp := e.f32(P(0)), int(L(1)), e.f32(P(2)), I(3), I(4), F(5)
		tgt, w, gw, lse, ent, alpha, T := e.i32(P(6)), e.f32(P(7)), e.f32(P(8)), e.f32(P(9)), e.f64(P(10)), F(11), I(12)
		for i := 0; i < T; i++ {
			for c := 0; c < C; c++ {
				zp := &Z[i*ldz+c]
				wi := w[i]
				if wi == 0 {
					*zp = 0
					continue
				}
				x := *zp + b2[v0+c]
				if temp != 1 {
					x = x / temp
				}
				lpv := float64(x) - float64(lse[i])
				p := math.Exp(lpv)
				g := float64(gw[i]) / float64(wi)
				d := float64(wi) * p * (-g + float64(alpha)*(lpv+ent[i]))
				if v0+c == int(tgt[i]) {
					d += float64(gw[i])
				}
				*zp = float32(d / float64(temp))
			}
		}
	case "tf_colsum": // (A, rows, cols, lda, out, accumulate)
		A, rows, cols, lda, out, acc := e.f32(P(0)), I(1), I(2), int(L(3)), e.f32(P(4)), I(5)
		for c := 0; c < cols; c++ {
			var s float32
			for r := 0; r < rows; r++ {
				s += A[r*lda+c]
			}
			if acc != 0 {
				out[c] += s
			} else {
				out[c] = s
			}
		}
	case "tf_tanh_back": // (dh, h, n)
		dh, h, n := e.f32(P(0)), e.f32(P(1)), int(L(2))
		for k := 0; k < n; k++ {
			dh[k] = dh[k] * (1 - h[k]*h[k])
		}
	case "tf_emb_scatter": // (dX, tok, pos, gEmb, T, W, E)
		dX, tok, pos, g := e.f32(P(0)), e.i32(P(1)), e.i32(P(2)), e.f32(P(3))
		T, W, E := I(4), I(5), I(6)
		for i := 0; i < T; i++ {
			for s := 0; s < W; s++ {
				j := i - (W - 1) + s
				t := int32(0)
				if j >= i-int(pos[i]) {
					t = tok[j]
				}
				for c := 0; c < E; c++ {
					if d := dX[i*W*E+s*E+c]; d != 0 {
						g[int(t)*E+c] += d
					}
				}
			}
		}
	case "tf_sumsq": // (g, n, partial) — grid-stride ownership as the kernel
		g, n, part := e.f32(P(0)), int(L(1)), e.f64(P(2))
		for b := 0; b < grid; b++ {
			part[b] = 0
		}
		for k := 0; k < n; k++ {
			part[(k/block)%grid] += float64(g[k]) * float64(g[k])
		}
	case "tf_adam": // (p, grad, m1, m2, n, scale, b1, b2, c1, c2, lr, eps, wd)
		p, gr, m1, m2, n := e.f32(P(0)), e.f32(P(1)), e.f64(P(2)), e.f64(P(3)), int(L(4))
		scale, b1, b2, c1, c2, lr, eps, wd := D(5), D(6), D(7), D(8), D(9), D(10), D(11), D(12)
		for k := 0; k < n; k++ {
			g := float64(gr[k]) * scale
			a := b1*m1[k] + (1-b1)*g
			v := b2*m2[k] + (1-b2)*g*g
			m1[k], m2[k] = a, v
			old := float64(p[k])
			q := old - lr*(a/c1)/(math.Sqrt(v/c2)+eps)
			q -= lr * wd * old
			p[k] = float32(q)
		}
	default:
		return fmt.Errorf("emu: no kernel %q", name)
	}
	return nil
}

// cuSignatures parses the extern "C" kernels of kernels/trajflow.cu into
// argument kinds (ptr, i32, i64, f32, f64).
func cuSignatures(t *testing.T) map[string][]string {
	t.Helper()
	src, err := os.ReadFile("kernels/trajflow.cu")
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\(([^)]*)\)`)
	out := map[string][]string{}
	for _, m := range re.FindAllStringSubmatch(string(src), -1) {
		var kinds []string
		for _, p := range strings.Split(m[2], ",") {
			p = strings.TrimSpace(p)
			switch {
			case strings.Contains(p, "*"):
				kinds = append(kinds, "ptr")
			case strings.HasPrefix(p, "long long"):
				kinds = append(kinds, "i64")
			case strings.HasPrefix(p, "int"):
				kinds = append(kinds, "i32")
			case strings.HasPrefix(p, "float"):
				kinds = append(kinds, "f32")
			case strings.HasPrefix(p, "double"):
				kinds = append(kinds, "f64")
			default:
				t.Fatalf("kernel %s: parameter %q of unknown kind", m[1], p)
			}
		}
		out[m[1]] = kinds
	}
	return out
}
