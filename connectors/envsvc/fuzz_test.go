package envsvc

import (
	"encoding/binary"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// FuzzStep: whatever a policy sends as one turn's action — ids of any
// value, text of any bytes, at any turn number — under a valid token to a
// fresh episode of either family, the service answers with a well-formed
// response (executed with a transition whose decision is one of the
// three, or refused with a reason), never a panic or a broken reply, and
// the episode still terminates cleanly after it. Ids come from the
// fuzzer four bytes each, the whole int32 range included.
func FuzzStep(f *testing.F) {
	regs := registries(f)
	svc := startService(f, Config{Registries: regs})
	base := newRaw(f, svc.url, time.Hour, nil)
	le := func(ids ...int32) []byte {
		b := make([]byte, 0, 4*len(ids))
		for _, id := range ids {
			b = binary.LittleEndian.AppendUint32(b, uint32(id))
		}
		return b
	}
	f.Add(uint8(0), int32(0), le(rollout.TokXfer, rollout.TokKey0+1, rollout.TokEnd), "")
	f.Add(uint8(0), int32(0), le(rollout.TokAns, rollout.TokVal0, rollout.TokEnd), "")
	f.Add(uint8(0), int32(-1), le(rollout.TokCall, -1<<31, rollout.TokEnd), "")
	f.Add(uint8(1), int32(0), []byte(nil), "CALL K1")
	f.Add(uint8(1), int32(3), le(rollout.TokCall), "ANS V2\x00\xff")
	n := 0
	f.Fuzz(func(t *testing.T, fam uint8, turn int32, idBytes []byte, text string) {
		r := &raw{t: t, url: base.url, iss: base.iss, now: base.now}
		reg := regs[int(fam)%len(regs)]
		n++
		task := reg.Train()[n%len(reg.Train())]
		att := attempts([]rollout.Task{task}, 1, int32(n))[0]
		al := r.allocate(att, fmt.Sprintf("k%d", n), 0)
		if al.Outcome != Executed || al.EpisodeID == "" {
			t.Fatalf("allocate: %+v", al)
		}
		ids := make([]int32, len(idBytes)/4)
		for i := range ids {
			ids[i] = int32(binary.LittleEndian.Uint32(idBytes[4*i:]))
		}
		req := r.stepReq(al.EpisodeID, 1, "s1", turn, ids...)
		req.Action.Text = text
		req.Token = r.iss.Issue(al.EpisodeID, 1, StepAction(turn, req.Action))
		got := r.send(PathStep, al.EpisodeID, req)
		switch {
		case got.Protocol != ProtocolVersion:
			t.Fatalf("step answered protocol %d: %+v", got.Protocol, got)
		case got.Outcome == Refused:
			if got.Reason == "" {
				t.Fatalf("refused without a reason: %+v", got)
			}
		case got.Outcome == Executed:
			if got.Transition == nil || !slices.Contains([]string{schemas.DecisionOK, schemas.DecisionInvalid, schemas.DecisionDenied}, got.Transition.Decision) || got.NextSeq != 2 {
				t.Fatalf("executed: %+v", got)
			}
			if got.Transition.Decision != schemas.DecisionOK && got.Transition.Reason == "" {
				t.Fatalf("decision %s without a reason", got.Transition.Decision)
			}
		default:
			t.Fatalf("outcome %q: %+v", got.Outcome, got)
		}
		if end := r.terminate(al.EpisodeID, "done"); end.Outcome != Executed {
			t.Fatalf("terminate after the step: %+v", end)
		}
	})
}
