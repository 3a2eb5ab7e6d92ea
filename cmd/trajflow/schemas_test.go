package main

import (
	"bytes"
	"context"
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/schemas"
)

func runSchemas(t *testing.T, args ...string) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), append([]string{"schemas"}, args...), &stdout, &stderr); code != 0 {
		t.Fatalf("trajflow schemas %v: exit %d: %s", args, code, stderr.String())
	}
	return stdout.String()
}

// The JSON form lists every topic of the topology (in order, with its
// kind and version), every kind of schemas.Versions and every header.
func TestSchemasJSON(t *testing.T) {
	out := runSchemas(t, "--json")
	var doc struct {
		Topics []struct {
			Topic      string   `json:"topic"`
			Kind       string   `json:"kind"`
			Version    int      `json:"version"`
			Plane      string   `json:"plane"`
			Partitions int      `json:"partitions"`
			Compacted  bool     `json:"compacted"`
			Producers  []string `json:"producers"`
			Consumers  []string `json:"consumers"`
			SideInputs []string `json:"side_inputs"`
			ReadBack   []string `json:"read_back"`
		} `json:"topics"`
		Arrow []struct {
			Kind    string `json:"kind"`
			Version int    `json:"version"`
			Columns []struct {
				Name     string `json:"name"`
				Type     string `json:"type"`
				Nullable bool   `json:"nullable"`
			} `json:"columns"`
		} `json:"arrow"`
		JSON []struct {
			Kind   string `json:"kind"`
			Fields []struct {
				Name string `json:"name"`
			} `json:"fields"`
		} `json:"json"`
		Quarantine struct {
			AddedHeaders []string `json:"added_headers"`
		} `json:"quarantine"`
		Headers []struct {
			Name string `json:"name"`
			Doc  string `json:"doc"`
		} `json:"headers"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("trajflow schemas --json: %v\n%s", err, out)
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &top); err != nil {
		t.Fatal(err)
	}
	if keys := slices.Sorted(maps.Keys(top)); !slices.Equal(keys, []string{"arrow", "headers", "json", "quarantine", "topics"}) {
		t.Fatalf("top-level fields %v", keys)
	}
	topo := pipeline.Topology()
	if len(doc.Topics) != len(topo) {
		t.Fatalf("%d topics, the topology has %d", len(doc.Topics), len(topo))
	}
	for i, info := range topo {
		got := doc.Topics[i]
		if got.Topic != info.Short || got.Kind != string(info.Kind) || got.Version != schemas.Versions[info.Kind] ||
			got.Plane != info.Plane || got.Partitions != info.Partitions || got.Compacted != info.Compacted ||
			!slices.Equal(got.Producers, info.Producers) || !slices.Equal(got.ReadBack, info.Scanned) ||
			!slices.Equal(got.SideInputs, info.Side) || got.SideInputs == nil ||
			!slices.Equal(got.Consumers, append(slices.Clip(info.Consumers), pipeline.SnapshotStage)) {
			t.Errorf("topic %d: %+v, topology %+v", i, got, info)
		}
	}
	kinds := map[string]bool{}
	for _, a := range doc.Arrow {
		kinds[a.Kind] = true
		if len(a.Columns) == 0 || a.Columns[0].Type == "" {
			t.Errorf("arrow %s: columns %+v", a.Kind, a.Columns)
		}
	}
	for _, j := range doc.JSON {
		kinds[j.Kind] = true
		if len(j.Fields) == 0 {
			t.Errorf("json %s: no fields", j.Kind)
		}
	}
	for k := range schemas.Versions {
		if !kinds[string(k)] {
			t.Errorf("kind %s missing", k)
		}
	}
	if len(doc.Headers) != len(schemas.HeaderDoc) {
		t.Fatalf("%d headers, schemas.HeaderDoc has %d", len(doc.Headers), len(schemas.HeaderDoc))
	}
	for i, h := range schemas.HeaderDoc {
		if doc.Headers[i].Name != h.Name || doc.Headers[i].Doc != h.Doc {
			t.Errorf("header %d: %+v, want %+v", i, doc.Headers[i], h)
		}
	}
	if !slices.Equal(doc.Quarantine.AddedHeaders, schemas.QuarantineHeaders) {
		t.Errorf("quarantine headers %v", doc.Quarantine.AddedHeaders)
	}
}

// The text form names every topic, the control plane included, and every
// kind and header.
func TestSchemasText(t *testing.T) {
	out := runSchemas(t)
	for _, info := range pipeline.Topology() {
		if !strings.Contains(out, "\n"+info.Short+": ") {
			t.Errorf("no line for topic %s", info.Short)
		}
	}
	for _, want := range []string{
		"windows: window_record v1, plane json, partitions 1",
		"quarantine: any kind (the refused record's), plane raw",
		"incidents: incident v1, plane json",
		"policy: policy_release v1, plane json, partitions 1, compacted",
		"side input of  rollout",
		"quarantine record", "Kafka headers",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for k := range schemas.Versions {
		if !strings.Contains(out, "\n"+string(k)+" v") {
			t.Errorf("no schema section for kind %s", k)
		}
	}
	for _, h := range schemas.HeaderDoc {
		if !strings.Contains(out, "  "+h.Name+" ") {
			t.Errorf("header %s missing", h.Name)
		}
	}
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"schemas", "extra"}, &stdout, &stderr); code != 2 {
		t.Errorf("trajflow schemas extra: exit %d, want 2", code)
	}
}

// The quarantine layout `trajflow schemas` documents is the one the
// pipeline writes: the refused record's key, value and headers, then
// schemas.QuarantineHeaders in order. (The test lives here, not in
// schemas, so that the schemas benchmarks do not link the pipeline.)
func TestSchemasQuarantineLayout(t *testing.T) {
	m := pipeline.Message{
		Ref:     pipeline.Ref{Topic: "run.valid", Partition: 2, Offset: 41},
		Key:     []byte("g-1"),
		Value:   []byte("refused bytes"),
		Headers: []pipeline.Header{{Key: schemas.HeaderKind, Value: []byte("trajectory")}, {Key: "custom", Value: []byte("x")}},
	}
	out := pipeline.QuarantineRecord("run.quarantine", "validate", m, "no_turns", "turns: empty")
	if string(out.Key) != "g-1" || string(out.Value) != "refused bytes" {
		t.Fatalf("quarantine record key %q value %q", out.Key, out.Value)
	}
	var names []string
	for _, h := range out.Headers {
		names = append(names, h.Key)
	}
	want := append([]string{schemas.HeaderKind, "custom"}, schemas.QuarantineHeaders...)
	if !slices.Equal(names, want) {
		t.Fatalf("quarantine headers %v, want %v", names, want)
	}
	if got := schemas.NewCatalog(nil).Quarantine.AddedHeaders; !slices.Equal(got, schemas.QuarantineHeaders) {
		t.Fatalf("catalog lists %v", got)
	}
}
