package main

import (
	"context"
	"encoding/hex"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/internal/otlptest"
	"github.com/trajflow/trajflow/internal/testkit"
	"github.com/trajflow/trajflow/operators/stagekit"
)

// attemptChain is the spans every trained attempt's trace holds, in
// pipeline order: each the child of the one before it.
var attemptChain = []string{"dispatch attempt", "rollout attempt", "validate attempt", "reward attempt",
	"advantage attempt", "pack attempt", "train attempt"}

// A fleet of separate processes (trajflow up) exports its spans to an
// in-process OTLP receiver: every launched attempt has one trace, whose id
// is derived from the attempt id, rooted at dispatch; in every trace each
// span's parent is a span of the same trace (connected), and each
// trained attempt's trace runs dispatch → rollout (with its environment
// steps) → validate → reward → advantage → pack → train, the last span
// naming the update that trained it.
func TestFleetAttemptTraces(t *testing.T) {
	addr := startBroker(t)
	recv := otlptest.NewOTLPReceiver(t)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out := filepath.Join(dir, "fleet")
	cmd := exec.CommandContext(ctx, trajflowBinary(t), "up", "--brokers", addr, "--rounds", "1",
		"--eval-samples", "1", "--out", out, "--log-level", "warn", "--otlp-endpoint", recv.URL()+"/v1/traces")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("up: %v\n%s", err, b)
	}
	var sum loop.Summary
	testkit.ReadJSON(t, filepath.Join(out, loop.SummaryFile), &sum)
	traces := map[string][]*tracepb.Span{}
	for _, s := range recv.Spans() {
		id := hex.EncodeToString(s.GetTraceId())
		traces[id] = append(traces[id], s)
	}
	attr := func(s *tracepb.Span, key string) string {
		for _, kv := range s.GetAttributes() {
			if kv.GetKey() == key {
				return kv.GetValue().GetStringValue()
			}
		}
		return ""
	}
	roots, trained := 0, 0
	for tid, spans := range traces {
		var attempt string
		ids := map[string]*tracepb.Span{}
		for _, s := range spans {
			ids[hex.EncodeToString(s.GetSpanId())] = s
			if s.GetName() == "dispatch attempt" {
				attempt = attr(s, "trajflow.attempt_id")
			}
		}
		if attempt == "" {
			continue // a record's trace (the runtime's process spans), not an attempt's
		}
		roots++
		if want := stagekit.AttemptTraceID(attempt).String(); tid != want {
			t.Fatalf("attempt %s in trace %s, want %s", attempt, tid, want)
		}
		byName := map[string]*tracepb.Span{}
		for _, s := range spans {
			p := hex.EncodeToString(s.GetParentSpanId())
			if len(s.GetParentSpanId()) == 0 {
				if s.GetName() != "dispatch attempt" {
					t.Fatalf("attempt %s: span %q is a second root", attempt, s.GetName())
				}
			} else if ids[p] == nil {
				t.Fatalf("attempt %s: span %q has parent %s, which is not in the trace (%d spans)", attempt, s.GetName(), p, len(spans))
			}
			if slices.Contains(attemptChain, s.GetName()) {
				if byName[s.GetName()] != nil {
					t.Fatalf("attempt %s: two %q spans", attempt, s.GetName())
				}
				byName[s.GetName()] = s
			}
			if s.GetName() == "rollout env step" && ids[p].GetName() != "rollout attempt" {
				t.Fatalf("attempt %s: env step under %q", attempt, ids[p].GetName())
			}
		}
		tr := byName["train attempt"]
		if tr == nil || attr(tr, "trajflow.decision") != "trained" {
			continue
		}
		trained++
		for i := 1; i < len(attemptChain); i++ {
			s, prev := byName[attemptChain[i]], byName[attemptChain[i-1]]
			if s == nil || prev == nil || string(s.GetParentSpanId()) != string(prev.GetSpanId()) {
				t.Fatalf("attempt %s: %q is not the child of %q", attempt, attemptChain[i], attemptChain[i-1])
			}
		}
		if attr(tr, "trajflow.batch_id") == "" {
			t.Fatalf("attempt %s: the train span names no batch", attempt)
		}
	}
	if roots != sum.AttemptsLaunched {
		t.Errorf("%d attempt traces, %d attempts launched", roots, sum.AttemptsLaunched)
	}
	if want := sum.TrajectoriesAdmitted - sum.TrajectoriesExcluded; trained != want || trained == 0 {
		t.Errorf("%d traces reach the update, %d trajectories trained", trained, want)
	}
	t.Logf("%d spans in %d traces; %d attempt traces, %d trained", len(recv.Spans()), len(traces), roots, trained)
}
