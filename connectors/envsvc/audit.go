package envsvc

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/trajflow/trajflow/connectors/state"
)

// LogAudit is what a service's store records: its episodes, how they
// ended, and every transition it executed. Actions are counted once per
// (episode, sequence number), the key they are stored under; an action
// executed twice for one turn of one episode — a retry the service took
// for a new action — is a DuplicateTurns.
type LogAudit struct {
	Episodes int            `json:"episodes"`
	Live     int            `json:"live"`  // not ended
	Ended    map[string]int `json:"ended"` // "status/reason" -> episodes
	Actions  int            `json:"actions"`
	// ActionsByFamily counts the actions of each family.
	ActionsByFamily map[string]int `json:"actions_by_family"`
	// DuplicateTurns counts the executed actions beyond the first of one
	// turn of one episode (the agent loop sends one action per turn).
	DuplicateTurns int `json:"duplicate_turns"`
}

// AuditStore reads the records of st (a service's store, not in use by a
// running service).
func AuditStore(ctx context.Context, st *state.Store) (LogAudit, error) {
	a := LogAudit{Ended: map[string]int{}, ActionsByFamily: map[string]int{}}
	family := map[string]string{}
	ended := map[string]bool{}
	turns := map[string]map[int32]int{}
	err := st.Scan(ctx, []byte(keyPrefix), func(k, v []byte) error {
		id, kind, ok := strings.Cut(strings.TrimPrefix(string(k), keyPrefix), "/")
		if !ok {
			return nil
		}
		switch {
		case kind == "meta":
			var m epMeta
			if err := json.Unmarshal(v, &m); err != nil {
				return fmt.Errorf("envsvc: audit: %s: %w", k, err)
			}
			family[id] = m.Family
		case kind == "end":
			var e endRec
			if err := json.Unmarshal(v, &e); err != nil {
				return fmt.Errorf("envsvc: audit: %s: %w", k, err)
			}
			ended[id] = true
			a.Ended[e.Status+"/"+e.Reason]++
		case strings.HasPrefix(kind, "step/"):
			var r stepRec
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("envsvc: audit: %s: %w", k, err)
			}
			if turns[id] == nil {
				turns[id] = map[int32]int{}
			}
			if turns[id][r.Turn]++; turns[id][r.Turn] > 1 {
				a.DuplicateTurns++
			}
			a.Actions++
		}
		return nil
	})
	if err != nil {
		return LogAudit{}, err
	}
	a.Episodes = len(family)
	for id, f := range family {
		if !ended[id] {
			a.Live++
		}
		for _, n := range turns[id] {
			a.ActionsByFamily[f] += n
		}
	}
	return a, nil
}

// AuditDir reads the records of the store in a service's data directory
// (`trajflow serve env --data DIR`) once the service has stopped.
func AuditDir(ctx context.Context, dataDir string) (LogAudit, error) {
	st, err := state.Open(filepath.Join(dataDir, "badger"), state.Options{})
	if err != nil {
		return LogAudit{}, fmt.Errorf("envsvc: audit %s: %w", dataDir, err)
	}
	defer st.Close()
	return AuditStore(ctx, st)
}
