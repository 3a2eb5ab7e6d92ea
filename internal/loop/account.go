package loop

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/trajflow/trajflow/internal/audit"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

// readConfig is the client configuration the runner reads the run's
// topics back with.
func (r *runner) readConfig() *pipeline.Config {
	return &pipeline.Config{Brokers: r.brokers, Dialer: r.dialer, Transport: r.transport, MaxMessageBytes: r.c.Topics.MaxMessageBytes}
}

// account reads the run's topics back once every operator has stopped:
// the launched attempts (tasks topic), their fate (batches and census,
// internal/audit) and the hash of every batch.
func (r *runner) account(ctx context.Context) error {
	cfg := r.readConfig()
	actx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	launched, err := LaunchedAttempts(actx, cfg, r.topics)
	if err != nil {
		return err
	}
	rep, err := audit.Collect(actx, cfg, r.topics)
	if err != nil {
		return err
	}
	counts := rep.AccountAttempts(launched)
	s := r.sum
	s.AttemptsLaunched, s.TrajectoriesAdmitted, s.TrajectoriesFiltered = counts.Launched, counts.Admitted, counts.Filtered
	s.Quarantined, s.DuplicatesAdmitted, s.Lost = counts.Quarantined, counts.Duplicated, counts.Lost
	s.TrajectoriesExcluded, s.StaleTokens = counts.Excluded, rep.StaleTokens
	if s.GeneratedTokens, err = GeneratedTokens(actx, cfg, r.topics); err != nil {
		return err
	}
	if s.GeneratedTokens > 0 {
		s.StaleShare = float64(s.StaleTokens) / float64(s.GeneratedTokens)
	}
	s.AttemptsRetried = counts.Retried
	if len(counts.RetriedTries) > 0 {
		s.InfraRetries = counts.RetriedTries
	}
	s.BatchHashes, err = BatchHashes(actx, cfg, r.topics)
	r.accountEnv(rep)
	return err
}

// Launched lists the distinct attempt ids of the run's tasks topic.
func Launched(ctx context.Context, cfg *pipeline.Config, t pipeline.Topics) ([]string, error) {
	atts, err := LaunchedAttempts(ctx, cfg, t)
	ids := make([]string, len(atts))
	for i, a := range atts {
		ids[i] = a.AttemptID
	}
	return ids, err
}

// LaunchedAttempts lists the distinct attempts of the run's tasks topic.
func LaunchedAttempts(ctx context.Context, cfg *pipeline.Config, t pipeline.Topics) ([]schemas.TaskAttempt, error) {
	var out []schemas.TaskAttempt
	seen := map[string]bool{}
	err := pipeline.ScanTail(ctx, cfg, t.Tasks, 0, func(m pipeline.Message) error {
		atts, err := schemas.TaskAttempts.Decode(nil, m.Value)
		if err != nil {
			return fmt.Errorf("demo: tasks topic at %s: %w", m.Ref, err)
		}
		for _, a := range atts {
			if !seen[a.AttemptID] {
				seen[a.AttemptID] = true
				out = append(out, a)
			}
		}
		return nil
	})
	return out, err
}

// BatchHashes is the SHA-256 of every message of the run's batches topic,
// in order: equal for two runs exactly when their batches are.
func BatchHashes(ctx context.Context, cfg *pipeline.Config, t pipeline.Topics) ([]string, error) {
	var hashes []string
	err := pipeline.ScanTail(ctx, cfg, t.Batches, 0, func(m pipeline.Message) error {
		h := sha256.Sum256(m.Value)
		hashes = append(hashes, hex.EncodeToString(h[:]))
		return nil
	})
	return hashes, err
}

// GeneratedTokens counts the policy-sampled (action) tokens of the
// distinct trajectories on the run's trajectories topic.
func GeneratedTokens(ctx context.Context, cfg *pipeline.Config, t pipeline.Topics) (int64, error) {
	var n int64
	seen := map[string]bool{}
	err := pipeline.ScanTail(ctx, cfg, t.Trajectories, 0, func(m pipeline.Message) error {
		rows, err := schemas.Trajectories.DecodeShared(nil, m.Value)
		if err != nil {
			return nil // quarantined by validate; the census counts it
		}
		for _, tr := range rows {
			if seen[tr.RecordID] {
				continue
			}
			seen[tr.RecordID] = true
			for _, turn := range tr.Turns {
				n += int64(len(turn.ActionIDs))
			}
		}
		return nil
	})
	return n, err
}
