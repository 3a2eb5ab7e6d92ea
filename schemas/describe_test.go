package schemas

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func TestDescribe(t *testing.T) {
	var b strings.Builder
	if err := Describe(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	t.Log("\n" + out)
	for _, want := range []string{
		"task_attempt v1", "trajectory v2", "reward_component v1", "rewarded_trajectory v2",
		"scored_trajectory v2", "weight_ack v1", "chat_template_hash", "packed_batch v1", "policy_release v1", "census_event v1",
		"window_record v1", "incident v1", "update_record v1",
		"turns", "list<item: struct<index: int32", "ref_logprobs", "(nullable)", "action_mask",
		"list<item: uint8", "reward_total", "group ", "checkpoint_hash", "at_us",
		"filtered                 []object\n    record_id", "clip_frac_neg", // nested JSON fields, embedded ones flattened
		"quarantine record", "then the headers         trajflow-reason, trajflow-detail",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("Describe output lacks %q", want)
		}
	}
	for _, h := range HeaderDoc {
		if !strings.Contains(out, "  "+h.Name+" ") {
			t.Errorf("Describe output lacks header %s", h.Name)
		}
	}
}

// The catalog lists every kind of Versions exactly once, every header of
// HeaderDoc, and the data fields encoding/json writes for each JSON kind.
func TestCatalogCoversEveryKind(t *testing.T) {
	c := NewCatalog(nil)
	seen := map[Kind]int{}
	for _, a := range c.Arrow {
		seen[a.Kind]++
		if a.Version != Versions[a.Kind] || len(a.Columns) == 0 {
			t.Errorf("arrow %s: version %d, %d columns", a.Kind, a.Version, len(a.Columns))
		}
	}
	for _, j := range c.JSON {
		seen[j.Kind]++
		if j.Version != Versions[j.Kind] || len(j.Fields) == 0 {
			t.Errorf("json %s: version %d, %d fields", j.Kind, j.Version, len(j.Fields))
		}
	}
	for k := range Versions {
		if seen[k] != 1 {
			t.Errorf("kind %s listed %d times", k, seen[k])
		}
	}
	if len(seen) != len(Versions) {
		t.Errorf("catalog lists %d kinds, Versions has %d", len(seen), len(Versions))
	}
	if len(c.Headers) != len(HeaderDoc) {
		t.Errorf("%d headers, HeaderDoc has %d", len(c.Headers), len(HeaderDoc))
	}
	// The fields listed for the update record are exactly the keys
	// encoding/json writes, nested objects included.
	var u UpdateRecord
	u.Metrics.Lag = []LagStat{{}}
	u.Trainer = json.RawMessage(`{}`) // omitted when empty
	u.MinibatchOrder = [][][]int{{{0}}}
	u.RolledBackTo = new(int64)
	// The fields written only when set (omitempty).
	u.StalePolicy, u.NotTrained = "drop", []string{"x"}
	u.StaleLag, u.Lag = []LagCount{{}}, []LagCount{{}}
	u.Selection = &UpdateSelection{}
	u.Cost = &UpdateCost{}
	for _, s := range []*ObjectiveStats{&u.Last, &u.Metrics.ObjectiveStats} {
		s.ISWeightMean, s.ISWeightMax, s.ISTruncated = 1, 1, 1
	}
	raw, err := json.Marshal(u)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	for _, j := range c.JSON {
		if j.Kind == KindUpdateRecord {
			if got, want := fieldNames(j.Fields), keysOf(doc); !reflect.DeepEqual(got, want) {
				t.Errorf("update_record fields\n got %v\nwant %v", got, want)
			}
		}
	}
}

// fieldNames flattens documented fields to sorted dotted paths.
func fieldNames(fs []FieldDoc) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Name)
		for _, sub := range fieldNames(f.Fields) {
			out = append(out, f.Name+"."+sub)
		}
	}
	slices.Sort(out)
	return out
}

// keysOf flattens the keys of a decoded JSON object (arrays: their first
// element) to sorted dotted paths.
func keysOf(v map[string]any) []string {
	var out []string
	for k, x := range v {
		out = append(out, k)
		if a, ok := x.([]any); ok && len(a) > 0 {
			x = a[0]
		}
		if m, ok := x.(map[string]any); ok {
			for _, sub := range keysOf(m) {
				out = append(out, k+"."+sub)
			}
		}
	}
	slices.Sort(out)
	return out
}
