package rollout

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/trajflow/trajflow/schemas"
)

// retryingEnv is an environment that retries like a service client: every
// third Step counts a "timeout" retry and every Reset an
// "allocate_connection" retry before it succeeds; while failFirst is set,
// the fourth Step of the run fails after counting a "connection" retry (an
// infrastructure failure: the stage runs the group again).
type retryingEnv struct {
	*Registry
	mu        sync.Mutex
	steps     int
	retries   map[string]int64
	failFirst bool
}

func (e *retryingEnv) count(reason string) {
	e.retries[reason]++
}

func (e *retryingEnv) Retries() map[string]int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := map[string]int64{}
	for k, v := range e.retries {
		out[k] = v
	}
	return out
}

func (e *retryingEnv) Reset(ctx context.Context, a schemas.TaskAttempt) (Episode, Observation, error) {
	e.mu.Lock()
	e.count("allocate_connection")
	e.mu.Unlock()
	ep, obs, err := e.Registry.Reset(ctx, a)
	if err != nil {
		return nil, obs, err
	}
	return &retryingEpisode{ep, e}, obs, nil
}

type retryingEpisode struct {
	Episode
	e *retryingEnv
}

func (p *retryingEpisode) Step(ctx context.Context, turn int32, a EnvAction) (Transition, error) {
	p.e.mu.Lock()
	p.e.steps++
	n := p.e.steps
	if n%3 == 0 {
		p.e.count("timeout")
	}
	fail := p.e.failFirst && n == 4
	if fail {
		p.e.count("connection")
		p.e.failFirst = false
	}
	p.e.mu.Unlock()
	if fail {
		return Transition{}, errors.New("service unreachable")
	}
	return p.Episode.Step(ctx, turn, a)
}

// TestStageEnvRetriesInCensus: the stage runs its episodes against the
// injected environment (the trajectories are those of the registry in
// process) and writes one retried census event per retry the environment
// counted, with its reason, on the first member of the try; a try that
// failed is run again and its retries are counted too.
func TestStageEnvRetriesInCensus(t *testing.T) {
	reg := testRegistry(t)
	env := &retryingEnv{Registry: reg, retries: map[string]int64{}, failFirst: true}
	st, topics := newTestStage(t, reg)
	st.cfg.Env, st.cfg.EnvRetries = env, env.Retries
	pol := randomPolicy(t, 1)
	st.Switch(pol)
	atts := Attempts("run", reg.Train()[0], 0, 4, 1, 3, "contract")
	res, err := st.Process(context.Background(), tasksMessage(t, topics, atts))
	if err != nil {
		t.Fatal(err)
	}
	retry := make([]schemas.TaskAttempt, len(atts))
	for i, a := range atts {
		a.Attempt = 1
		a.AttemptID = schemas.AttemptID(a.RunID, a.TaskID, a.GroupID, a.Member, 1)
		a.Seed = int64(schemas.SeedFor(fixedLimits().ContractSeed, a.AttemptID, "env"))
		retry[i] = a
	}
	want, err := reg.RunEpisodes(context.Background(), pol, retry, DefaultSettings(reg), fixedLimits())
	if err != nil {
		t.Fatal(err)
	}
	wantBytes, _ := schemas.Trajectories.Encode(nil, want)
	ids := map[string]bool{}
	byReason := map[string]int64{}
	onAttempt := map[string]int{}
	var failed int
	for _, o := range res.Outputs {
		if o.Topic == topics.Trajectories {
			got, err := schemas.Trajectories.Decode(nil, o.Value)
			if err != nil {
				t.Fatal(err)
			}
			gotBytes, _ := schemas.Trajectories.Encode(nil, got)
			if !bytes.Equal(gotBytes, wantBytes) {
				t.Fatal("trajectories through the injected environment differ from the registry's")
			}
			continue
		}
		ev, err := schemas.DecodeCensus(o.Value)
		if err != nil {
			t.Fatal(err)
		}
		switch ev.Kind {
		case schemas.CensusRetried:
			if !ev.Infra || ev.Stage != "rollout" || ev.GroupID != atts[0].GroupID || ids[ev.EventID] {
				t.Fatalf("retry event %+v (duplicate id %v)", ev, ids[ev.EventID])
			}
			ids[ev.EventID] = true
			byReason[ev.Reason]++
			onAttempt[ev.AttemptID]++
		case schemas.CensusFailed:
			failed++
		}
	}
	counted := env.Retries()
	var total int64
	for r, n := range counted {
		total += n
		if byReason[r] != n {
			t.Fatalf("reason %s: %d census events, %d retries", r, byReason[r], n)
		}
	}
	if int64(len(ids)) != total || total < 8 || failed != len(atts) {
		t.Fatalf("%d retry events for %d retries %v; %d failed events", len(ids), total, counted, failed)
	}
	if onAttempt[atts[0].AttemptID] == 0 || onAttempt[retry[0].AttemptID] == 0 || len(onAttempt) != 2 {
		t.Fatalf("retry events by attempt %v", onAttempt)
	}
	t.Logf("retries %v, census events by attempt %v", counted, onAttempt)
}
