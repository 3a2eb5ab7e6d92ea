package operators_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/trajflow/trajflow/connectors/policy/serve"
	"github.com/trajflow/trajflow/gpu"
	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
	"github.com/trajflow/trajflow/schemas"
)

// TestWeightSyncRetriesAFailedReplica: of two SGLang-protocol replicas, one
// refuses its weight update (503) at first: weight sync acknowledges the
// healthy one as loaded and the other as failed, with the error, and the
// next tick loads the release into it too. An old release redelivered
// (the compacted topic read again) produces nothing.
func TestWeightSyncRetriesAFailedReplica(t *testing.T) {
	c := conformanceContract(t)
	d := newDeps(t, c)
	files, err := pipeline.NewDirReleases(d.ReleaseDir)
	if err != nil {
		t.Fatal(err)
	}
	mc, seed := operators.ModelConfig(c)
	m0, err := gpu.InitialModel(mc, seed)
	if err != nil {
		t.Fatal(err)
	}
	rel, err := gpu.ReleaseModel(files, m0, 0, 0, gpu.ReleaseMeta{})
	if err != nil {
		t.Fatal(err)
	}
	var refusals atomic.Int64
	var urls []string
	for i := range 2 {
		srv, err := serve.New(serve.Config{Protocol: contract.PolicySGLang, Releases: d.ReleaseDir, Grammar: d.Tasks.Grammar()})
		if err != nil {
			t.Fatal(err)
		}
		h := http.Handler(srv)
		if i == 1 {
			h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/update_weights_from_disk" && refusals.Add(1) <= 3 {
					http.Error(w, "warming up", http.StatusServiceUnavailable)
					return
				}
				srv.ServeHTTP(w, r)
			})
		}
		hs := httptest.NewServer(h)
		t.Cleanup(hs.Close)
		urls = append(urls, hs.URL)
	}
	c = c.Clone()
	c.Policy.Protocol, c.Policy.Endpoints = contract.PolicySGLang, urls
	if err := c.Resolve(); err != nil {
		t.Fatal(err)
	}
	d.Contract = c
	st, err := operators.New("weightsync", d)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := schemas.EncodeRelease(rel)
	if err != nil {
		t.Fatal(err)
	}
	msg := func(off int64) pipeline.Message {
		return pipeline.Message{Ref: pipeline.Ref{Topic: d.Topics.Policy, Offset: off}, Key: []byte(c.RunID), Value: doc, Time: fixedNow()}
	}
	dr, err := pipeline.Drive(context.Background(), st, []pipeline.Message{msg(0), msg(1)}, pipeline.DriveConfig{
		QuarantineTopic: d.Topics.Quarantine, TickAt: fixedNow().Add(time.Minute), Env: pipeline.EnvConfig{Now: fixedNow},
	})
	if err != nil {
		t.Fatal(err)
	}
	var acks []schemas.WeightAck
	for _, o := range dr.Outputs {
		a, err := schemas.DecodeWeightAck(o.Value)
		if err != nil || o.Topic != d.Topics.Weights || !bytes.Equal(o.Key, []byte(a.Replica)) {
			t.Fatalf("output to %s: %v", o.Topic, err)
		}
		acks = append(acks, a)
	}
	if len(acks) != 3 {
		t.Fatalf("%d acknowledgements, want 3 (loaded, failed, loaded after the retry): %+v", len(acks), acks)
	}
	if !acks[0].Loaded || acks[0].Replica != urls[0] || acks[0].Checksum != rel.CheckpointHash {
		t.Fatalf("first replica: %+v", acks[0])
	}
	if acks[1].Loaded || acks[1].Replica != urls[1] || acks[1].Error == "" {
		t.Fatalf("the refusing replica: %+v", acks[1])
	}
	if !acks[2].Loaded || acks[2].Replica != urls[1] || acks[2].Version != 0 {
		t.Fatalf("the refusing replica after the tick: %+v", acks[2])
	}
}

// TestWeightsyncNeededOnPolicyServers: a run needs weight sync only when
// its policy runs on servers, eval and gate only when it does not; every
// other stage is needed by every run.
func TestWeightsyncNeededOnPolicyServers(t *testing.T) {
	c, err := contract.Load("../testdata/contracts/demo.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range operators.Names() {
		if got := operators.Needed(st, c); got != (st != "weightsync") {
			t.Errorf("built-in policy: Needed(%s) = %v", st, got)
		}
	}
	c.Policy.Protocol, c.Policy.Endpoints = contract.PolicyVLLM, []string{"http://127.0.0.1:8000"}
	if !operators.Needed("weightsync", c) {
		t.Error("vLLM replicas: weightsync not needed")
	}
	for _, st := range []string{"eval", "gate"} { // the evaluation plane runs the built-in policy
		if operators.Needed(st, c) {
			t.Errorf("vLLM replicas: %s needed", st)
		}
	}
	if operators.Needed("bogus", c) {
		t.Error("an unregistered stage is needed")
	}
}
