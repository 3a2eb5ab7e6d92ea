package rollout

import (
	"context"

	"github.com/trajflow/trajflow/gpu/model"
)

// following is the policy of a group's run under partial-rollout
// continuation (StageConfig.Continue, contract dispatch.partial_rollouts
// continue, docs/SYSTEMS.md §7): each Generate call — one turn of the group's live
// episodes — samples with the newest snapshot the stage has loaded, never
// one older than the snapshot the run started with. An episode in flight
// when a new version is released keeps its environment state, its token
// history and its remaining budget (the agent loop holds them) and
// continues with the newer policy from its next turn; every turn records
// the version that sampled it (model.Sample.PolicyVersion), so versions
// never decrease along a trajectory.
type following struct {
	s     *Stage
	start *model.Policy
}

// Generate implements Policy.
func (f following) Generate(ctx context.Context, reqs []model.Request) ([]model.Sample, error) {
	p := f.start
	if cur := f.s.Policy(); cur != nil && cur.Version() > p.Version() {
		p = cur
	}
	return p.Generate(ctx, reqs)
}

// groupPolicy is the policy a run of a group samples with: pol itself, or
// under Continue the newest loaded snapshot at every turn. A policy
// server (StageConfig.Server) already samples every call with the newest
// version it serves, each sample recording it, so it is used as it is.
func (s *Stage) groupPolicy(pol Policy) Policy {
	if mp, ok := pol.(*model.Policy); ok && s.cfg.Continue {
		return following{s: s, start: mp}
	}
	return pol
}
