package stagekit

import (
	"strings"
	"testing"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

func header(hs []pipeline.Header, key string) string {
	for _, h := range hs {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// TestTraceParents: every record of an attempt, its census events
// included, is in the attempt's trace (docs/SYSTEMS.md §15); a census
// event names the emitting stage's span of the attempt as its parent; ids
// that are not 32 digits get a derived trace.
func TestTraceParents(t *testing.T) {
	attempt := schemas.DerivedID("attempt", "a")
	parse := func(tp string) (trace, span string) {
		parts := strings.Split(tp, "-")
		if len(parts) != 4 || parts[0] != "00" || len(parts[1]) != 32 || len(parts[2]) != 16 || parts[3] != "01" {
			t.Fatalf("traceparent %q is not 00-<32>-<16>-01", tp)
		}
		return parts[1], parts[2]
	}
	recTrace, recSpan := parse(TraceParent(attempt))
	if recTrace != attempt {
		t.Errorf("record trace %s, want the attempt id %s", recTrace, attempt)
	}
	var spans []string
	for _, kind := range []string{schemas.CensusAdmitted, schemas.CensusFiltered} {
		out, err := Census("census", schemas.CensusEvent{RunID: "r", AttemptID: attempt, Kind: kind, Stage: "pack"})
		if err != nil {
			t.Fatal(err)
		}
		trace, span := parse(header(out.Headers, schemas.HeaderTrace))
		if trace != attempt {
			t.Errorf("%s event: trace %s, want the attempt id %s", kind, trace, attempt)
		}
		if want := AttemptSpanID("pack", attempt).String(); span != want {
			t.Errorf("%s event: parent span %s, want pack's span of the attempt %s", kind, span, want)
		}
		spans = append(spans, span)
	}
	if other, _ := Census("census", schemas.CensusEvent{RunID: "r", AttemptID: attempt, Kind: schemas.CensusTrained, Stage: "train"}); header(other.Headers, schemas.HeaderTrace) == AttemptParent("pack", attempt) {
		t.Errorf("train's event names pack's span")
	}
	if spans[0] == recSpan {
		t.Errorf("the census events' span is the record's %s", recSpan)
	}
	trace, _ := parse(TraceParent("task-7"))
	if trace != schemas.DerivedID("trace", "task-7") {
		t.Errorf("short id: trace %s, want one derived from it", trace)
	}
}

// TestHeadersMustAgreeWithBody: a valid body under a kind, version or id
// header that names something else is refused with header_mismatch;
// absent headers are not a mismatch.
func TestHeadersMustAgreeWithBody(t *testing.T) {
	rows := []schemas.TaskAttempt{{AttemptID: "a", RunID: "r", TaskID: "t", GroupID: "g", GroupSize: 1}}
	out, err := Encode(schemas.TaskAttempts, "r.tasks", "g", "g", rows)
	if err != nil {
		t.Fatal(err)
	}
	with := func(key, value string) pipeline.Message {
		m := pipeline.Message{Value: out.Value}
		for _, h := range out.Headers {
			if h.Key != key {
				m.Headers = append(m.Headers, h)
			}
		}
		if value != "" {
			m.Headers = append(m.Headers, pipeline.Header{Key: key, Value: []byte(value)})
		}
		return m
	}
	for _, c := range []struct {
		name       string
		m          pipeline.Message
		mismatched bool
	}{
		{"as produced", with("", ""), false},
		{"no kind header", with(schemas.HeaderKind, ""), false},
		{"kind of another record", with(schemas.HeaderKind, string(schemas.KindPackedBatch)), true},
		{"unknown version", with(schemas.HeaderVersion, "99"), true},
		{"bogus id", with(schemas.HeaderID, "not-the-group"), true},
	} {
		_, err := Decode(schemas.TaskAttempts, c.m)
		if err == nil {
			err = CheckID(&c.m, "g")
		}
		r, refused := pipeline.AsRefusal(err)
		if got := refused && r.Reason == ReasonHeaderMismatch; got != c.mismatched {
			t.Errorf("%s: %v, want mismatch %v", c.name, err, c.mismatched)
		}
	}
}

// TestRefuseRowCost: the census event of a refused episode carries its
// rollout tokens (prompts, actions, observations of every turn) and its
// generation plus environment time, which pack counts as failed
// generation (schemas.FailureCost); a refusal without turns carries none.
func TestRefuseRowCost(t *testing.T) {
	topics, _ := pipeline.TopicsFor("r")
	tr := schemas.Trajectory{RecordID: "a1", RunID: "r", TaskID: "t", GroupID: "g", Turns: []schemas.Turn{
		{PromptIDs: []int32{1, 2}, ActionIDs: []int32{3}, ObservationIDs: []int32{4, 5, 6}, GenLatencyUS: 100, EnvLatencyUS: 20},
		{PromptIDs: []int32{7}, ActionIDs: []int32{8, 9}, GenLatencyUS: 3, EnvLatencyUS: -1},
	}}
	m := pipeline.Message{Ref: pipeline.Ref{Topic: topics.Trajectories}, Key: []byte("g")}
	for _, tc := range []struct {
		name            string
		turns           []schemas.Turn
		tokens, latency int64
	}{
		{"with turns", tr.Turns, 2 + 1 + 3 + 1 + 2, 100 + 20 + 3},
		{"without", nil, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			outs, err := RefuseRow(schemas.Trajectories, topics, "validate", m, 0, tr, Refused{
				RunID: "r", AttemptID: "a1", Reason: "bad_tokens", Turns: tc.turns})
			if err != nil {
				t.Fatal(err)
			}
			var ev schemas.CensusEvent
			for _, o := range outs {
				if o.Topic == topics.Census {
					if ev, err = schemas.DecodeCensus(o.Value); err != nil {
						t.Fatal(err)
					}
				}
			}
			if ev.Kind != schemas.CensusQuarantined || ev.Tokens != tc.tokens || ev.LatencyUS != tc.latency {
				t.Fatalf("census event %+v, want quarantined with %d tokens, %d µs", ev, tc.tokens, tc.latency)
			}
		})
	}
}
