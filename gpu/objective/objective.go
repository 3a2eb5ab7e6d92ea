package objective

import (
	"fmt"
	"math"

	"github.com/trajflow/trajflow/schemas"
)

// Inputs are the tensors of one row (or of several rows concatenated with
// Concat) of T positions over a vocabulary of V entries. Every per-position
// slice has length T and is aligned to the next-token target (docs/PIPELINE.md §11,
// §12): entry i describes the prediction made at position i of Targets[i].
type Inputs struct {
	T, V int
	// Logits is [T*V], row-major: position i is Logits[i*V:(i+1)*V].
	Logits []float32
	// Targets[i] is the token predicted at position i; NoTarget (< 0) where
	// nothing is predicted. Masked positions need a target in [0, V).
	Targets []int32
	// Mask[i] is 1 iff the target of position i is a trained policy token.
	Mask []uint8
	// OldLogprobs are the behavior log-probs of the targets.
	OldLogprobs []float32
	// RefLogprobs are the reference log-probs of the targets; nil when no
	// reference ran.
	RefLogprobs []float32
	// ProxLogprobs are the proximal log-probs of the targets — the
	// trainer's policy at the start of the update — for
	// OffPolicyDecoupled; nil means the current log-probs of this call
	// (the first step of an update, where the clipped ratio is exactly 1).
	// Ignored by the other corrections.
	ProxLogprobs []float32
	// Advantages per target token.
	Advantages []float32
	// SegmentIDs identify the sequence each position belongs to, in
	// [0, T). A sequence must lie entirely within one Inputs (a packed
	// segment never spans rows; split microbatches by rows).
	SegmentIDs []int32
}

// InputsFromRow builds the Inputs of a packed row and the logits the
// current actor produced for it ([len(row.InputIDs)*V]). Targets come from
// ShiftTargets(row.InputIDs, row.SegmentIDs); the other per-token slices
// are taken (not copied) from the row.
func InputsFromRow(row schemas.PackedRow, logits []float32, V int) (Inputs, error) {
	targets, err := ShiftTargets(row.InputIDs, row.SegmentIDs)
	if err != nil {
		return Inputs{}, fmt.Errorf("inputs from row: %w", err)
	}
	return Inputs{
		T: len(row.InputIDs), V: V,
		Logits:      logits,
		Targets:     targets,
		Mask:        row.ActionMask,
		OldLogprobs: row.OldLogprobs,
		RefLogprobs: row.RefLogprobs,
		Advantages:  row.Advantages,
		SegmentIDs:  row.SegmentIDs,
	}, nil
}

// Concat joins Inputs along positions into one Inputs. Segment ids of part k
// are shifted by the number of positions of the parts before it, so
// sequences of different parts stay distinct. All parts must share V, and
// either all or none must carry RefLogprobs. Slices are copied.
func Concat(parts ...Inputs) (Inputs, error) {
	if len(parts) == 0 {
		return Inputs{}, fmt.Errorf("objective: concat of nothing: %w", ErrShape)
	}
	out := Inputs{V: parts[0].V}
	hasRef := parts[0].RefLogprobs != nil
	for k, p := range parts {
		if err := p.check(); err != nil {
			return Inputs{}, fmt.Errorf("concat part %d: %w", k, err)
		}
		if p.V != out.V {
			return Inputs{}, fmt.Errorf("objective: concat part %d has V=%d, want %d: %w", k, p.V, out.V, ErrShape)
		}
		if (p.RefLogprobs != nil) != hasRef {
			return Inputs{}, fmt.Errorf("objective: concat part %d: reference log-probs in some parts only: %w", k, ErrShape)
		}
		off := int32(out.T)
		out.Logits = append(out.Logits, p.Logits...)
		out.Targets = append(out.Targets, p.Targets...)
		out.Mask = append(out.Mask, p.Mask...)
		out.OldLogprobs = append(out.OldLogprobs, p.OldLogprobs...)
		if hasRef {
			out.RefLogprobs = append(out.RefLogprobs, p.RefLogprobs...)
		}
		out.Advantages = append(out.Advantages, p.Advantages...)
		for _, s := range p.SegmentIDs {
			out.SegmentIDs = append(out.SegmentIDs, s+off)
		}
		out.T += p.T
	}
	return out, nil
}

// check validates the shapes of the Inputs.
func (in Inputs) check() error {
	if err := checkTV(len(in.Logits), in.T, in.V); err != nil {
		return err
	}
	for _, c := range []struct {
		name string
		n    int
	}{
		{"targets", len(in.Targets)},
		{"mask", len(in.Mask)},
		{"old logprobs", len(in.OldLogprobs)},
		{"advantages", len(in.Advantages)},
		{"segment ids", len(in.SegmentIDs)},
	} {
		if c.n != in.T {
			return fmt.Errorf("objective: %d %s for T=%d: %w", c.n, c.name, in.T, ErrShape)
		}
	}
	if in.RefLogprobs != nil && len(in.RefLogprobs) != in.T {
		return fmt.Errorf("objective: %d ref logprobs for T=%d: %w", len(in.RefLogprobs), in.T, ErrShape)
	}
	if in.ProxLogprobs != nil && len(in.ProxLogprobs) != in.T {
		return fmt.Errorf("objective: %d proximal logprobs for T=%d: %w", len(in.ProxLogprobs), in.T, ErrShape)
	}
	return nil
}

// Stats are the scalar outputs of Compute. The normalized quantities (Loss,
// PolicyLoss, KL, Entropy) use the global Denominators, so the values of the
// microbatches of one update add up to the value of the whole batch; the
// diagnostics (ratio, approximate KL to old, clip fractions) are over the
// masked tokens of this call. Merge combines the Stats of disjoint calls.
type Stats = schemas.ObjectiveStats

func frac(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// Result is the output of Compute for one Inputs.
type Result struct {
	Stats
	// CurLogprobs[i] is the current log-prob of Targets[i] (float32, as
	// LogSoftmaxGather computes it) at every position with a target, 0 where
	// Targets[i] < 0. Mask is not applied (docs/PIPELINE.md §12: apply the mask only
	// after the shift is aligned). Feed it to LagStats.
	CurLogprobs []float32
	// DLogits is dLoss/dLogits, [T*V] row-major; exactly 0 at unmasked
	// positions.
	DLogits []float32
}

// Compute evaluates the policy objective of docs/PIPELINE.md §13 on one Inputs with
// the global Denominators of the update, and its gradient with respect to
// the logits. It allocates a new Result; ComputeInto reuses one.
//
// Per masked token t (Mask[t] == 1), with cur_t = log_softmax(z_t)[y_t]
// rounded to float32 (the precision of stored log-probs, so that a policy
// equal to the behavior policy gives a ratio of exactly 1):
//
//	lr_t  = clamp(cur_t - old_t, -MaxLogRatio, MaxLogRatio)   (no clamp when MaxLogRatio == 0)
//	        (RatioSequence: the clamped mean of cur - old over the trained
//	        tokens of t's sequence, the same for each of them; ds/dcur_t
//	        below is then through t's own log-prob only)
//	r_t   = exp(lr_t)
//	s_t   = min(r_t A_t, clamp(r_t, 1-ClipLow, 1+ClipHigh) A_t)
//	k_t   = k1|k2|k3 of logr = ref_t - cur_t                  (KL estimators, see K1)
//	H_t   = -Σ_v p_tv log p_tv
//
// and each masked token has a normalization weight c_t from the global
// denominators (N_tok = den.Tokens, N_seq = den.Sequences, n_s = masked
// tokens of the token's sequence s in this call):
//
//	TokenMean:        c_t = 1 / N_tok
//	SeqMeanTokenSum:  c_t = 1 / N_seq
//	SeqMeanTokenMean: c_t = 1 / (n_s · N_seq)
//	TokenSum:         c_t = 1 / NormTokens        (a declared constant)
//
// so that every normalized term is Σ_t c_t x_t, a sum of per-token terms
// that splits over microbatches. Then
//
//	PolicyLoss = -Σ c_t s_t,  KL = Σ c_t k_t,  Entropy = Σ c_t H_t
//	Loss       = PolicyLoss + KLCoef·KL·[KLPlacement == KLLoss] - EntropyCoef·Entropy
//
// Gradient (analytic, float64, rounded once to float32): with
// dcur/dz_v = 1[v=y] - p_v and dH/dz_v = -p_v (log p_v + H),
//
//	dLoss/dz_tv = c_t [ g_t (1[v=y] - p_v) + EntropyCoef · p_v (log p_v + H_t) ]
//	g_t         = -ds_t/dcur_t + KLCoef·[KLPlacement == KLLoss]·dk_t/dcur_t
//	ds/dcur     = r A  where the unclipped branch is the minimum, including
//	              ties (r exactly on a bound, or A == 0), and 0 where the
//	              clipped branch is strictly smaller (r > 1+ClipHigh with
//	              A > 0, r < 1-ClipLow with A < 0) or MaxLogRatio clamped lr.
//	dk1/dcur = 1,  dk2/dcur = -logr,  dk3/dcur = 1 - exp(logr)
//
// At a bound the two branches have equal value and, as clamp passes
// gradient on its closed interval, equal gradient, so the convention only
// fixes which branch is counted: a token exactly on a bound is not clipped.
//
// All reductions are sequential in position order (and vocabulary order
// within a position) with float64 accumulators, so results are
// bit-for-bit deterministic. Unmasked positions contribute nothing and have
// zero gradient. With no masked token the Stats are all 0 (and den is not
// checked).
//
// Errors: Options.Validate (ErrOptions); shape mismatches (ErrShape); a
// target >= V, or a masked position without target (ErrTarget); NaN/+Inf
// logits, mask values other than 0/1, segment ids outside [0, T), a
// non-finite masked old log-prob, ref log-prob or advantage, a masked target
// whose current log-prob is -Inf, KLPlacement == KLLoss without
// RefLogprobs, or den smaller than the counts of this call (ErrInput); a
// non-finite token surrogate, KL term (reported or in the loss), gradient
// or loss from finite inputs (a log ratio past the exp range without a
// MaxLogRatio clamp, a KL argument that overflows) (ErrNonFinite, which
// wraps ErrInput): every number Compute returns is finite.
func Compute(in Inputs, opts Options, den Denominators) (Result, error) {
	var r Result
	err := ComputeInto(in, opts, den, &r)
	return r, err
}

// ComputeInto is Compute writing into res, reusing res.CurLogprobs and
// res.DLogits when their capacity suffices. On error res is unspecified.
func ComputeInto(in Inputs, opts Options, den Denominators, res *Result) error {
	if err := opts.Validate(); err != nil {
		return err
	}
	if err := in.check(); err != nil {
		return fmt.Errorf("compute: %w", err)
	}
	res.CurLogprobs = grow(res.CurLogprobs, in.T)
	res.DLogits = grow(res.DLogits, in.T*in.V)
	st, err := compute(coreInputs[float32]{
		T: in.T, V: in.V, logits: in.Logits, targets: in.Targets, mask: in.Mask,
		old: in.OldLogprobs, ref: in.RefLogprobs, prox: in.ProxLogprobs, adv: in.Advantages, seg: in.SegmentIDs,
	}, opts, den, res.CurLogprobs, res.DLogits)
	if err != nil {
		return fmt.Errorf("compute: %w", err)
	}
	res.Stats = st
	return nil
}

func grow[F any](b []F, n int) []F {
	if cap(b) < n {
		return make([]F, n)
	}
	return b[:n]
}

// coreInputs are Inputs with logits of either float precision. The float64
// instantiation exists for gradient checks by finite differences.
type coreInputs[F float32 | float64] struct {
	T, V    int
	logits  []F
	targets []int32
	mask    []uint8
	old     []float32
	ref     []float32
	prox    []float32
	adv     []float32
	seg     []int32
}

// surrogate returns the token surrogate s = min(r·A, clamp(r, lo, hi)·A),
// ds/dr·r (the derivative with respect to the log ratio, before any
// MaxLogRatio clamp) and whether the clipped branch is strictly smaller.
// Ties go to the unclipped branch (see Compute).
func surrogate(r, a, lo, hi float64) (s, dsdlr float64, clipped bool) {
	switch {
	case a > 0 && r > hi:
		return hi * a, 0, true
	case a < 0 && r < lo:
		return lo * a, 0, true
	default:
		return r * a, r * a, false
	}
}

// klTerm returns the estimator value at logr = ref - cur and its derivative
// with respect to cur.
func klTerm(est string, logr float64) (k, dkdcur float64) {
	switch est {
	case K1:
		return -logr, 1
	case K2:
		return logr * logr / 2, -logr
	default: // K3
		e := math.Exp(logr)
		return e - 1 - logr, 1 - e
	}
}

func finite(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }

// sequenceLogRatios returns, with RatioSequence, the mean log ratio to the
// behavior policy of every segment's trained tokens (indexed by segment
// id; nil otherwise): a first pass over the masked positions computing
// their current log-probs as compute does (softmaxRow gives the max and
// log-sum that softmaxEntropyRow gives, bit for bit, without the entropy
// or the exponentials kept). Positions compute refuses are skipped here
// and refused there, with the same errors for a row that cannot be
// normalized or a non-finite input.
func sequenceLogRatios[F float32 | float64](in coreInputs[F], opts Options, perSeg []int32) ([]float64, error) {
	if !opts.SequenceRatio() {
		return nil, nil
	}
	lr := make([]float64, len(perSeg))
	for i := 0; i < in.T; i++ {
		y := in.targets[i]
		if in.mask[i] != 1 || y < 0 || int(y) >= in.V {
			continue
		}
		z := in.logits[i*in.V : (i+1)*in.V]
		m, _, logS, err := softmaxRow(z, nil, i)
		if err != nil {
			return nil, err
		}
		c, old, a := float64(F(float64(z[y])-m-logS)), float64(in.old[i]), float64(in.adv[i])
		if !finite(c) || !finite(old) || !finite(a) {
			return nil, fmt.Errorf("objective: masked position %d: cur %v old %v advantage %v: %w", i, c, old, a, ErrInput)
		}
		lr[in.seg[i]] += c - old
	}
	for k, n := range perSeg {
		if n > 0 {
			lr[k] /= float64(n)
		}
	}
	return lr, nil
}

// compute is the body of ComputeInto for either logit precision. cur (len
// T) and dlogits (len T*V) are overwritten.
func compute[F float32 | float64](in coreInputs[F], opts Options, den Denominators, cur []F, dlogits []F) (Stats, error) {
	T, V := in.T, in.V
	var st Stats
	clear(dlogits)

	// Per-sequence masked counts of this call, and its local denominators.
	perSeg, err := segmentCounts(in.mask, in.seg)
	if err != nil {
		return st, err
	}
	for _, n := range perSeg {
		if n > 0 {
			st.Tokens += int64(n)
			st.Sequences++
		}
	}
	klOn := in.ref != nil && opts.KLEstimator != ""
	klLoss := opts.KLPlacement == KLLoss
	if klLoss && in.ref == nil {
		return st, fmt.Errorf("objective: kl_placement %q without reference log-probs: %w", KLLoss, ErrInput)
	}
	if st.Tokens > 0 {
		if den.Tokens < st.Tokens || den.Sequences < st.Sequences {
			return st, fmt.Errorf("objective: denominators %+v smaller than this call's %d tokens / %d sequences: %w",
				den, st.Tokens, st.Sequences, ErrInput)
		}
	}
	klCoef := 0.0
	if klLoss {
		klCoef = opts.KLCoef
	}
	lo, hi := 1-opts.ClipLow, 1+opts.ClipHigh
	e := make([]float64, V)
	off := opts.OffPolicy
	M := opts.MaxLogRatio
	// clampLR applies the MaxLogRatio guard to a log ratio.
	clampLR := func(lr float64) (float64, bool) {
		if M > 0 && (lr > M || lr < -M) {
			return math.Max(-M, math.Min(M, lr)), true
		}
		return lr, false
	}

	segLR, err := sequenceLogRatios(in, opts, perSeg)
	if err != nil {
		return st, err
	}

	var polSum, klSum, entSum, akl, ratioSum, isSum float64
	st.RatioMin, st.RatioMax = math.Inf(1), math.Inf(-1)
	for i := 0; i < T; i++ {
		y := in.targets[i]
		masked := in.mask[i] == 1
		if y < 0 {
			if masked {
				return st, fmt.Errorf("objective: masked position %d has no target: %w", i, ErrTarget)
			}
			cur[i] = 0
			continue
		}
		if int(y) >= V {
			return st, fmt.Errorf("objective: target %d at position %d, V=%d: %w", y, i, V, ErrTarget)
		}
		z := in.logits[i*V : (i+1)*V]
		var m, s, logS, h float64
		if masked {
			m, s, logS, h, err = softmaxEntropyRow(z, e, i)
		} else {
			m, s, logS, err = softmaxRow(z, nil, i)
		}
		if err != nil {
			return st, err
		}
		lp := F(float64(z[y]) - m - logS)
		cur[i] = lp
		if !masked {
			continue
		}

		// Per-token terms.
		c := float64(lp)
		old, a := float64(in.old[i]), float64(in.adv[i])
		if !finite(c) || !finite(old) || !finite(a) {
			return st, fmt.Errorf("objective: masked position %d: cur %v old %v advantage %v: %w", i, c, old, a, ErrInput)
		}
		w := opts.Weight(den, perSeg[in.seg[i]])
		// lrRaw is the log ratio to the behavior policy; the surrogate's
		// ratio r is to the behavior policy, or (decoupled) to the
		// proximal policy, whose own ratio to the behavior policy is the
		// importance weight iw.
		lrRaw := c - old
		base, iw, clampedW := old, 1.0, false
		if off == OffPolicyDecoupled {
			p := c
			if in.prox != nil {
				p = float64(in.prox[i])
				if !finite(p) {
					return st, fmt.Errorf("objective: masked position %d: proximal log-prob %v: %w", i, p, ErrInput)
				}
			}
			var lb float64
			lb, clampedW = clampLR(p - old)
			iw = math.Exp(lb)
			if opts.ISCap > 0 && iw > opts.ISCap {
				iw = opts.ISCap
				st.ISTruncated++
			}
			base = p
		}
		lr, clampedLR := clampLR(c - base)
		if segLR != nil {
			// The sequence's ratio; its gradient through this token's own
			// log-prob only (RatioSequence).
			lr, clampedLR = clampLR(segLR[in.seg[i]])
		}
		if clampedLR || clampedW {
			st.LogRatioClamped++
		}
		r := math.Exp(lr)
		var sur, dsdcur float64
		var clipped bool
		if off == OffPolicyTIS {
			// The policy gradient weighted by min(r, cap): the surrogate
			// sg(w/r)·r·A has value w·A and gradient w·A.
			iw = r
			if iw > opts.ISCap {
				iw = opts.ISCap
				st.ISTruncated++
			}
			sur, dsdcur = iw*a, iw*a
		} else {
			sur, dsdcur, clipped = surrogate(r, a, lo, hi)
			sur, dsdcur = iw*sur, iw*dsdcur
		}
		if clampedLR {
			dsdcur = 0
		}
		if off == OffPolicyTIS || off == OffPolicyDecoupled {
			isSum += iw
			st.ISWeightMax = math.Max(st.ISWeightMax, iw)
		}
		switch {
		case a > 0:
			st.PosTokens++
			if clipped {
				st.ClippedPos++
			}
		case a < 0:
			st.NegTokens++
			if clipped {
				st.ClippedNeg++
			}
		}
		g := -dsdcur
		var k float64
		if klOn {
			ref := float64(in.ref[i])
			if !finite(ref) {
				return st, fmt.Errorf("objective: masked position %d: ref log-prob %v: %w", i, ref, ErrInput)
			}
			var dk float64
			k, dk = klTerm(opts.KLEstimator, ref-c)
			g += klCoef * dk
		}

		polSum += w * sur
		klSum += w * k
		entSum += w * h
		akl += 0.5 * lrRaw * lrRaw
		ratioSum += r
		st.RatioMin = math.Min(st.RatioMin, r)
		st.RatioMax = math.Max(st.RatioMax, r)

		// Gradient of this position:
		//   dL/dz_v = w·[g·1[v=y] + p_v·(-g + α·(log p_v + H))]
		// with log p_v = (z_v - m) - log s; p_v = e_v/s. Entries with
		// p_v = 0 get exactly 0 (no 0·(-Inf)).
		alpha := opts.EntropyCoef
		d := dlogits[i*V : (i+1)*V]
		ws := w / s
		k0 := -g + alpha*(h-logS)
		for v, ev := range e {
			if ev == 0 {
				d[v] = 0
				continue
			}
			d[v] = F(ws * ev * (k0 + alpha*(float64(z[v])-m)))
		}
		d[y] = F(w*g + ws*e[y]*(k0+alpha*(float64(z[y])-m)))
		// A sum of finite float32 values cannot overflow float64: it is
		// non-finite exactly when an entry is.
		var dsum float64
		for _, x := range d {
			dsum += float64(x)
		}
		if !finite(sur) || !finite(k) || !finite(g) || !finite(dsum) {
			return st, fmt.Errorf("objective: masked position %d: log ratio %v (max_log_ratio %v), advantage %v, kl term %v: surrogate %v, gradient %v: %w",
				i, lrRaw, opts.MaxLogRatio, a, k, sur, g, ErrNonFinite)
		}
	}
	if st.Tokens == 0 {
		return Stats{}, nil
	}
	st.PolicyLoss = -polSum
	st.KL = klSum
	st.Entropy = entSum
	st.Loss = st.PolicyLoss + klCoef*st.KL - opts.EntropyCoef*st.Entropy
	if !finite(st.Loss) {
		return st, fmt.Errorf("objective: loss %v (policy %v, kl %v, entropy %v; max_log_ratio %v): %w",
			st.Loss, st.PolicyLoss, st.KL, st.Entropy, opts.MaxLogRatio, ErrNonFinite)
	}
	n := float64(st.Tokens)
	st.ApproxKLOld = akl / n
	st.RatioMean = ratioSum / n
	if off == OffPolicyTIS || off == OffPolicyDecoupled {
		st.ISWeightMean = isSum / n
	}
	st.ClipFracPos = frac(st.ClippedPos, st.PosTokens)
	st.ClipFracNeg = frac(st.ClippedNeg, st.NegTokens)
	return st, nil
}
