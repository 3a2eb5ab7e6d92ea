package policy

import (
	"math"
	"slices"

	"github.com/trajflow/trajflow/gpu/model"
)

// Finish reasons a client maps its protocol's reasons to before Check.
const (
	FinishStop   = model.FinishStop   // the server stopped at a stop id
	FinishLength = model.FinishLength // the server generated max_tokens ids
	FinishAbort  = "abort"            // the server aborted the request
)

// Raw is one generation as a response carried it, before validation.
type Raw struct {
	Tokens   []int64   // sampled ids, as decoded
	Logprobs []float64 // their log-probs, as decoded (JSON numbers are float64)
	Finish   string    // FinishStop, FinishLength, FinishAbort, or the server's own word
	Version  int64     // the weight version that served it
	// TokensField and LogprobsField name the response fields, for errors.
	TokensField, LogprobsField string
}

// Check validates a generation against its request and returns the
// sample. Every failure is an *InfraError naming addr and the field:
// length_mismatch, token_range (negative, or >= vocab when vocab > 0),
// nan_logprob, positive_logprob, after_stop (an id after a stop id),
// bad_response (no ids, more than max_tokens, a finish reason that
// disagrees with the ids), server_error (aborted), version_mismatch (want).
//
// The finish reason is derived from the ids as the built-in sampler
// defines it: FinishStop when the last id is a stop id, else FinishLength,
// which needs exactly MaxTokens ids.
//
// Log-probs become float32 by conversion. JSON numbers written from a
// float32 value (as the shortest decimal of that value held in a float64,
// which is what Go's encoding/json, Python's json and nlohmann::json
// write) convert back exactly.
func Check(addr string, req model.Request, vocab int, want Want, r Raw) (model.Sample, error) {
	tf, lf := r.TokensField, r.LogprobsField
	if len(r.Tokens) != len(r.Logprobs) {
		return model.Sample{}, Infra(ReasonLengthMismatch, addr, "%d ids in %s, %d log-probs in %s", len(r.Tokens), tf, len(r.Logprobs), lf)
	}
	if r.Finish == FinishAbort {
		return model.Sample{}, Infra(ReasonServerError, addr, "request %s aborted by the server after %d ids", req.ID, len(r.Tokens))
	}
	if len(r.Tokens) == 0 {
		return model.Sample{}, Infra(ReasonBadResponse, addr, "%s is empty (max_tokens %d)", tf, req.Settings.MaxTokens)
	}
	if len(r.Tokens) > req.Settings.MaxTokens {
		return model.Sample{}, Infra(ReasonBadResponse, addr, "%d ids in %s, max_tokens %d", len(r.Tokens), tf, req.Settings.MaxTokens)
	}
	s := model.Sample{
		Tokens:        make([]int32, len(r.Tokens)),
		Logprobs:      make([]float32, len(r.Logprobs)),
		PolicyVersion: r.Version,
	}
	stop := req.Settings.Stop
	for i, t := range r.Tokens {
		if t < 0 || t > math.MaxInt32 || (vocab > 0 && t >= int64(vocab)) {
			return model.Sample{}, Infra(ReasonTokenRange, addr, "%s[%d] = %d, vocab %d", tf, i, t, vocab)
		}
		s.Tokens[i] = int32(t)
		lp := r.Logprobs[i]
		switch {
		case math.IsNaN(lp) || math.IsInf(lp, 0):
			return model.Sample{}, Infra(ReasonNaNLogprob, addr, "%s[%d] = %v", lf, i, lp)
		case lp > 0:
			return model.Sample{}, Infra(ReasonPositiveLogprob, addr, "%s[%d] = %v", lf, i, lp)
		case math.IsInf(float64(float32(lp)), 0):
			// A trajectory carries float32 log-probs: one below float32's
			// range would arrive as -Inf, and every ratio of it too.
			return model.Sample{}, Infra(ReasonNaNLogprob, addr, "%s[%d] = %v is below float32's range", lf, i, lp)
		}
		s.Logprobs[i] = float32(lp)
		if i < len(r.Tokens)-1 && slices.Contains(stop, int32(t)) {
			return model.Sample{}, Infra(ReasonAfterStop, addr, "%s[%d] = %d is a stop id, %d ids follow it", tf, i, t, len(r.Tokens)-1-i)
		}
	}
	last := s.Tokens[len(s.Tokens)-1]
	switch {
	case slices.Contains(stop, last):
		s.Finish = model.FinishStop
	case r.Finish == FinishStop:
		return model.Sample{}, Infra(ReasonBadResponse, addr, "finish reason stop, but the last id %d of %s is not a stop id %v", last, tf, stop)
	case len(s.Tokens) != req.Settings.MaxTokens:
		return model.Sample{}, Infra(ReasonBadResponse, addr, "finish reason %q after %d of %d ids without a stop id", r.Finish, len(s.Tokens), req.Settings.MaxTokens)
	default:
		s.Finish = model.FinishLength
	}
	if err := want.Check(addr, r.Version); err != nil {
		return model.Sample{}, err
	}
	return s, nil
}
