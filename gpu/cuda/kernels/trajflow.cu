// Device kernels of the trajflow CUDA trainer (gpu/cuda). Our own CUDA C,
// compiled to PTX (make cuda-ptx) and loaded with the driver's module API.
// Matrix products are cuBLAS calls made from Go (gpu/cuda/step.go);
// these kernels do everything else of one optimizer step of the built-in
// window-MLP policy (gpu/model) and its objective (gpu/objective), pipeline
// document §12-§14.
//
// Layout conventions: every tensor is row-major; positions of all rows of
// a batch are concatenated (T positions); see gpu/cuda/layout.go for the
// staged per-position columns. The vocabulary is processed in chunks of C
// entries: Z is one chunk of logits [T][ldz], never the full [T][V].

#include <math_constants.h>

#define TF_BLOCK 256

// The state of an online log-sum-exp over logits x (gpu/cuda/reduce.go,
// type LSE): m = max x, s = sum exp(x - m), a = sum exp(x - m) (x - m).
struct lse_state {
    float m, s, a;
};

// Raises the state's maximum to x > st.m, rescaling the sums.
__device__ __forceinline__ void lse_raise(lse_state &st, float x) {
    if (st.s > 0.f) {
        float d = st.m - x;
        float e = expf(d);
        st.a = e * (st.a + st.s * d);
        st.s = st.s * e;
    }
    st.m = x;
}

__device__ __forceinline__ void lse_add(lse_state &st, float x) {
    if (x == -CUDART_INF_F) return;  // a removed token contributes nothing
    if (x > st.m) {
        lse_raise(st, x);
        st.s += 1.f;
    } else {
        float d = x - st.m;
        float e = expf(d);
        st.s += e;
        st.a += e * d;
    }
}

__device__ __forceinline__ lse_state lse_merge(lse_state x, lse_state y) {
    if (x.s == 0.f) return y;
    if (y.s == 0.f) return x;
    float m = fmaxf(x.m, y.m);
    float dx = x.m - m, dy = y.m - m;
    float ex = expf(dx), ey = expf(dy);
    lse_state r;
    r.m = m;
    r.s = x.s * ex + y.s * ey;
    r.a = ex * (x.a + x.s * dx) + ey * (y.a + y.s * dy);
    return r;
}

// Block-wide merge of one lse_state per thread; the result is valid in
// thread 0.
__device__ lse_state lse_block_reduce(lse_state st) {
    __shared__ float sm[TF_BLOCK], ss[TF_BLOCK], sa[TF_BLOCK];
    int t = threadIdx.x;
    // Warp level first.
    for (int off = 16; off > 0; off >>= 1) {
        lse_state o;
        o.m = __shfl_down_sync(0xffffffffu, st.m, off);
        o.s = __shfl_down_sync(0xffffffffu, st.s, off);
        o.a = __shfl_down_sync(0xffffffffu, st.a, off);
        st = lse_merge(st, o);
    }
    int warp = t >> 5, lane = t & 31;
    if (lane == 0) {
        sm[warp] = st.m;
        ss[warp] = st.s;
        sa[warp] = st.a;
    }
    __syncthreads();
    if (warp == 0) {
        int nw = (blockDim.x + 31) >> 5;
        lse_state w;
        w.m = lane < nw ? sm[lane] : -CUDART_INF_F;
        w.s = lane < nw ? ss[lane] : 0.f;
        w.a = lane < nw ? sa[lane] : 0.f;
        for (int off = 16; off > 0; off >>= 1) {
            lse_state o;
            o.m = __shfl_down_sync(0xffffffffu, w.m, off);
            o.s = __shfl_down_sync(0xffffffffu, w.s, off);
            o.a = __shfl_down_sync(0xffffffffu, w.a, off);
            w = lse_merge(w, o);
        }
        st = w;
    }
    return st;
}

// X[i][s*E+e] = emb[window token][e]: the window of the last W tokens
// ending at position i, PAD (0) before the segment start i - pos[i]
// (gpu/model: windowAt).
extern "C" __global__ void tf_gather_x(const int *tok, const int *pos, const float *emb, float *X,
                                       int T, int W, int E) {
    long long n = (long long)T * W * E;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        int WE = W * E;
        int i = (int)(idx / WE);
        int r = (int)(idx % WE);
        int s = r / E, e = r % E;
        int j = i - (W - 1) + s;
        int first = i - pos[i];
        int t = j < first ? 0 : tok[j];
        X[idx] = emb[(long long)t * E + e];
    }
}

// Hm[i][k] = tanh(Hm[i][k] + b1[k]).
extern "C" __global__ void tf_bias_tanh(float *Hm, const float *b1, int T, int H) {
    long long n = (long long)T * H;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        Hm[idx] = (float)tanh((double)(Hm[idx] + b1[idx % H]));
    }
}

// Resets the per-position log-sum-exp state before the first chunk.
extern "C" __global__ void tf_lse_init(float *m, float *s, float *a, float *zy, int T) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < T; i += gridDim.x * blockDim.x) {
        m[i] = -CUDART_INF_F;
        s[i] = 0.f;
        a[i] = 0.f;
        zy[i] = 0.f;
    }
}

// One vocabulary chunk [v0, v0+C) of the online log-sum-exp: one block per
// position (grid-stride over positions). The behavior logit of entry v is
// x = (Z[i][v-v0] + b2[v]) / temp (b2 may be null: x = Z / temp). Positions
// without a target (tgt < 0) are skipped. The chunk's state is merged into
// (m, s, a)[i]; zy[i] receives x at the target when the target lies in the
// chunk. Each logit is read once, as float4 when rows are 16-byte aligned.
//
// Speed (measured on an H200, bench/RESULTS.md): the kernel is bound by
// issued instructions before it is bound by memory, so the aligned path
// folds each float4 as a group (lse_take4: one maximum, at most one rescale,
// then four branch-free terms) instead of four data-dependent branches, keeps
// four float4 loads in flight per thread, and is held to 32 registers so that
// eight blocks fit on a multiprocessor. That took the kernel from 54% to 78%
// of the device copy bandwidth with the same results (parity tests).
__device__ __forceinline__ void lse_take(lse_state &st, float z, const float *b2, int v, int y, float temp,
                                         float *zyi) {
    float x = z;
    if (b2) x += b2[v];
    if (temp != 1.f) x = x / temp;
    lse_add(st, x);
    if (v == y) *zyi = x;
}

// max.NaN: the larger of a and b, NaN if either is NaN (fmaxf would drop a
// NaN logit, which must reach the sum so that the position is flagged).
__device__ __forceinline__ float tf_max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// The four logits of one float4 at entries v..v+3, folded into st as
// lse_add would fold them one by one: the group's maximum first (at most one
// rescale), then the four terms. A -Inf logit adds e = 0 and nothing to a
// (e * d would be 0 * -Inf); a NaN logit makes s NaN.
__device__ __forceinline__ void lse_take4(lse_state &st, float4 q, const float *b2, int v, int y, float temp,
                                          float *zyi) {
    float x[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (b2) x[k] += b2[v + k];
        if (temp != 1.f) x[k] = x[k] / temp;
    }
    if ((unsigned)(y - v) < 4u) {
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (v + k == y) *zyi = x[k];
    }
    float mx = tf_max_nan(tf_max_nan(x[0], x[1]), tf_max_nan(x[2], x[3]));
    if (mx == -CUDART_INF_F) return;
    if (mx > st.m) lse_raise(st, mx);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float d = x[k] - st.m;
        float e = expf(d);
        st.s += e;
        st.a += e > 0.f ? e * d : 0.f;
    }
}

// Float4 loads each thread keeps in flight in tf_lse_chunk.
#define TF_LSE_UNROLL 4

extern "C" __global__ void __launch_bounds__(TF_BLOCK, 8)
tf_lse_chunk(const float *Z, long long ldz, const float *b2, int v0, int C, float temp,
                                        const int *tgt, float *m, float *s, float *a, float *zy, int T) {
    bool vec = (ldz % 4 == 0) && (C % 4 == 0) && (((unsigned long long)Z & 15ull) == 0);
    for (int i = blockIdx.x; i < T; i += gridDim.x) {
        int y = tgt[i];
        if (y < 0) continue;
        const float *z = Z + (long long)i * ldz;
        lse_state st;
        st.m = -CUDART_INF_F;
        st.s = 0.f;
        st.a = 0.f;
        if (vec) {
            const float4 *z4 = (const float4 *)z;
            int n4 = C / 4, bd = blockDim.x, c4 = threadIdx.x;
            for (; c4 + (TF_LSE_UNROLL - 1) * bd < n4; c4 += TF_LSE_UNROLL * bd) {
                float4 q[TF_LSE_UNROLL];
#pragma unroll
                for (int u = 0; u < TF_LSE_UNROLL; u++) q[u] = z4[c4 + u * bd];
#pragma unroll
                for (int u = 0; u < TF_LSE_UNROLL; u++)
                    lse_take4(st, q[u], b2, v0 + 4 * (c4 + u * bd), y, temp, &zy[i]);
            }
            for (; c4 < n4; c4 += bd) lse_take4(st, z4[c4], b2, v0 + 4 * c4, y, temp, &zy[i]);
        } else {
            for (int c = threadIdx.x; c < C; c += blockDim.x) lse_take(st, z[c], b2, v0 + c, y, temp, &zy[i]);
        }
        st = lse_block_reduce(st);
        if (threadIdx.x == 0) {
            lse_state g;
            g.m = m[i];
            g.s = s[i];
            g.a = a[i];
            g = lse_merge(g, st);
            m[i] = g.m;
            s[i] = g.s;
            a[i] = g.a;
        }
        __syncthreads();
    }
}

// Flag bits (gpu/cuda/reduce.go).
#define TF_CLIPPED 1
#define TF_LR_CLAMPED 2
#define TF_NONFINITE 4
#define TF_NOLOGPROB 8

__device__ __forceinline__ bool tf_finite(double x) { return !isnan(x) && !isinf(x); }

// Per-position objective terms (objective.Compute, float64 arithmetic):
// the current log-prob of the target lp = zy - m - log s (rounded to
// float32 as the CPU reference does), the entropy H = log s - a/s, ratio,
// clipped surrogate, KL estimator, and for the backward pass the logsumexp
// (lse = m + log s, stored in lse) and gw = c_t * g_t with
// g_t = -ds/dcur + klCoef dk/dcur (klCoef = 0 unless the KL is in the loss).
// kl: 0 none, 1 k1, 2 k2, 3 k3.
extern "C" __global__ void tf_token_loss(const int *tgt, const unsigned char *mask, const float *w, const float *old,
                                         const float *ref, const float *adv, const float *m, const float *s,
                                         const float *a, const float *zy, int T, double clipLow, double clipHigh,
                                         double maxLogRatio, int kl, double klCoef, float *lp, double *ratio,
                                         double *sur, double *klv, double *ent, int *flags, float *lse, float *gw) {
    double lo = 1.0 - clipLow, hi = 1.0 + clipHigh;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < T; i += gridDim.x * blockDim.x) {
        lp[i] = 0.f;
        ratio[i] = 0;
        sur[i] = 0;
        klv[i] = 0;
        ent[i] = 0;
        flags[i] = 0;
        gw[i] = 0.f;
        lse[i] = 0.f;
        if (tgt[i] < 0) continue;
        double ls = log((double)s[i]);
        float cur = (float)((double)zy[i] - (double)m[i] - ls);
        lp[i] = cur;
        lse[i] = (float)((double)m[i] + ls);
        if (mask[i] != 1) continue;
        double h = ls - (double)a[i] / (double)s[i];
        ent[i] = h;
        double c = cur, o = old[i], av = adv[i];
        int f = 0;
        if (!tf_finite(c)) f |= TF_NOLOGPROB;
        if (!tf_finite(o) || !tf_finite(av) || (kl && !tf_finite((double)ref[i]))) f |= TF_NONFINITE;
        if (f) {
            flags[i] = f;
            continue;
        }
        double lr = c - o;
        bool clamped = false;
        if (maxLogRatio > 0 && (lr > maxLogRatio || lr < -maxLogRatio)) {
            lr = fmax(-maxLogRatio, fmin(maxLogRatio, lr));
            clamped = true;
            f |= TF_LR_CLAMPED;
        }
        double r = exp(lr);
        double sv, dsdcur;
        if (av > 0 && r > hi) {
            sv = hi * av;
            dsdcur = 0;
            f |= TF_CLIPPED;
        } else if (av < 0 && r < lo) {
            sv = lo * av;
            dsdcur = 0;
            f |= TF_CLIPPED;
        } else {
            sv = r * av;
            dsdcur = r * av;
        }
        if (clamped) dsdcur = 0;
        double g = -dsdcur;
        if (kl) {
            double logr = (double)ref[i] - c, k, dk;
            if (kl == 1) {
                k = -logr;
                dk = 1;
            } else if (kl == 2) {
                k = logr * logr / 2;
                dk = -logr;
            } else {
                double e = exp(logr);
                k = e - 1 - logr;
                dk = 1 - e;
            }
            klv[i] = k;
            g += klCoef * dk;
        }
        ratio[i] = r;
        sur[i] = sv;
        flags[i] = f;
        gw[i] = (float)((double)w[i] * g);
    }
}

// dLoss/dZ for one vocabulary chunk, in place over the recomputed chunk
// logits Z (objective.Compute's gradient, then the behavior transform's
// 1/temp):
//   x_v = (Z + b2) / temp, lp_v = x_v - lse, p_v = exp(lp_v)
//   dZ_v = ( gw·1[v=y] + w·p_v·(-g + alpha·(lp_v + H)) ) / temp
// with gw = w·g. Rows with w == 0 (unmasked) become exactly 0.
extern "C" __global__ void tf_dz_chunk(float *Z, long long ldz, const float *b2, int v0, int C, float temp,
                                       const int *tgt, const float *w, const float *gw, const float *lse,
                                       const double *ent, float alpha, int T) {
    long long n = (long long)T * C;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        int i = (int)(idx / C), c = (int)(idx % C);
        float *zp = Z + (long long)i * ldz + c;
        float wi = w[i];
        if (wi == 0.f) {
            *zp = 0.f;
            continue;
        }
        float x = *zp + b2[v0 + c];
        if (temp != 1.f) x = x / temp;
        double lpv = (double)x - (double)lse[i];
        double p = exp(lpv);
        double g = (double)gw[i] / (double)wi;
        double d = (double)wi * p * (-g + (double)alpha * (lpv + ent[i]));
        if (v0 + c == tgt[i]) d += (double)gw[i];
        *zp = (float)(d / (double)temp);
    }
}

// out[c] (+)= sum over rows r of A[r][c] (rows summed in order: deterministic).
extern "C" __global__ void tf_colsum(const float *A, int rows, int cols, long long lda, float *out, int accumulate) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float acc = 0.f;
        for (int r = 0; r < rows; r++) acc += A[(long long)r * lda + c];
        out[c] = accumulate ? out[c] + acc : acc;
    }
}

// dh = dh * (1 - h^2): backpropagation through tanh.
extern "C" __global__ void tf_tanh_back(float *dh, const float *h, long long n) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        float hv = h[idx];
        dh[idx] = dh[idx] * (1.f - hv * hv);
    }
}

// gEmb[window token][e] += dX[i][s*E+e] (the window as in tf_gather_x).
extern "C" __global__ void tf_emb_scatter(const float *dX, const int *tok, const int *pos, float *gEmb, int T, int W,
                                          int E) {
    long long n = (long long)T * W * E;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        float d = dX[idx];
        if (d == 0.f) continue;
        int WE = W * E;
        int i = (int)(idx / WE);
        int r = (int)(idx % WE);
        int s = r / E, e = r % E;
        int j = i - (W - 1) + s;
        int first = i - pos[i];
        int t = j < first ? 0 : tok[j];
        atomicAdd(&gEmb[(long long)t * E + e], d);
    }
}

// partial[block] = sum of g[k]^2 over the block's grid-stride share, in
// double (the host adds the partials: the global gradient norm).
extern "C" __global__ void tf_sumsq(const float *g, long long n, double *partial) {
    __shared__ double sh[TF_BLOCK];
    double acc = 0;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x) {
        double x = g[k];
        acc += x * x;
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int off = blockDim.x / 2; off > 0; off >>= 1) {
        if (threadIdx.x < off) sh[threadIdx.x] += sh[threadIdx.x + off];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// One Adam step with bias correction and decoupled weight decay, in double
// as gpu.Trainer.Step: g = grad·scale; m1 = b1 m1 + (1-b1) g;
// m2 = b2 m2 + (1-b2) g^2; p -= lr (m1/c1) / (sqrt(m2/c2) + eps); p -= lr wd p_old.
extern "C" __global__ void tf_adam(float *p, const float *grad, double *m1, double *m2, long long n, double scale,
                                   double b1, double b2, double c1, double c2, double lr, double eps, double wd) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x) {
        double g = (double)grad[k] * scale;
        double a = b1 * m1[k] + (1 - b1) * g;
        double v = b2 * m2[k] + (1 - b2) * g * g;
        m1[k] = a;
        m2[k] = v;
        double old = p[k];
        double q = old - lr * (a / c1) / (sqrt(v / c2) + eps);
        q -= lr * wd * old;
        p[k] = (float)q;
    }
}
