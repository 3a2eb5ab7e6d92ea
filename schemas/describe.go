package schemas

import (
	"fmt"
	"io"
	"reflect"
	"strings"

	"github.com/apache/arrow-go/v18/arrow"
)

// ArrowSchemas lists the schema of every Arrow record kind, in pipeline
// order.
func ArrowSchemas() []*arrow.Schema {
	return []*arrow.Schema{
		TaskAttempts.Schema(),
		Trajectories.Schema(),
		RewardComponents.Schema(),
		RewardedTrajectories.Schema(),
		ScoredTrajectories.Schema(),
		PackedBatches.Schema(),
	}
}

// jsonKinds are the JSON document kinds and the type of their data, in
// the order `trajflow schemas` prints them.
var jsonKinds = []struct {
	kind Kind
	typ  reflect.Type
}{
	{KindPolicyRelease, reflect.TypeFor[PolicyRelease]()},
	{KindCensusEvent, reflect.TypeFor[CensusEvent]()},
	{KindWeightAck, reflect.TypeFor[WeightAck]()},
	{KindWindowRecord, reflect.TypeFor[WindowRecord]()},
	{KindIncident, reflect.TypeFor[Incident]()},
	{KindUpdateRecord, reflect.TypeFor[UpdateRecord]()},
	{KindGateDecision, reflect.TypeFor[GateDecision]()},
	{KindEvaluation, reflect.TypeFor[EvaluationRecord]()},
}

// Catalog is everything a run carries, as `trajflow schemas` prints it
// (and, with --json, writes it: the json names are stable).
type Catalog struct {
	Topics     []TopicDoc    `json:"topics"`
	Arrow      []ArrowDoc    `json:"arrow"`
	JSON       []JSONDoc     `json:"json"`
	Quarantine QuarantineDoc `json:"quarantine"`
	Headers    []HeaderEntry `json:"headers"`
}

// TopicDoc is one topic of a run: pipeline.TopicInfo in a form this
// package can take (pipeline imports schemas, so the caller converts).
type TopicDoc struct {
	Topic string `json:"topic"` // short name; the topic is "<run>.<topic>"
	Kind  Kind   `json:"kind"`  // "" for quarantine: any kind
	// Version is Versions[Kind], filled in by NewCatalog (0 without a
	// kind).
	Version int    `json:"version"`
	Plane   string `json:"plane"` // "arrow", "json" or "raw"
	// Partitions is the fixed partition count, or 0 for the contract's
	// topics.partitions.
	Partitions int    `json:"partitions"`
	Compacted  bool   `json:"compacted"`
	Key        string `json:"key"`
	// Producers produce to the topic; Consumers consume it in their
	// consumer group; SideInputs follow it from its first offset without
	// committing; ReadBack scan it at start to rebuild their state.
	Producers  []string `json:"producers"`
	Consumers  []string `json:"consumers"`
	SideInputs []string `json:"side_inputs"`
	ReadBack   []string `json:"read_back"`
	Doc        string   `json:"doc"`
}

// ArrowDoc is the schema of one Arrow record kind.
type ArrowDoc struct {
	Kind    Kind        `json:"kind"`
	Version int         `json:"version"`
	Columns []ColumnDoc `json:"columns"`
}

// ColumnDoc is one top-level column; Type is the Arrow type as Arrow
// prints it (nested types in full).
type ColumnDoc struct {
	Name     string `json:"name"`
	Type     string `json:"type"`
	Nullable bool   `json:"nullable"`
}

// JSONDoc is one JSON document kind: {"kind","version","data"} with the
// fields of Fields under "data".
type JSONDoc struct {
	Kind    Kind       `json:"kind"`
	Version int        `json:"version"`
	Fields  []FieldDoc `json:"fields"`
}

// FieldDoc is one field of a JSON document. Type is the JSON value with
// its Go width: string, bool, int, int64, float64, object, or []T for an
// array; an object (or an array of objects) lists its own Fields.
type FieldDoc struct {
	Name      string     `json:"name"`
	Type      string     `json:"type"`
	OmitEmpty bool       `json:"omitempty"`
	Fields    []FieldDoc `json:"fields,omitempty"`
}

// QuarantineDoc is the layout of a record of the quarantine topic: the
// refused record's key, value and headers as they were, then
// QuarantineHeaders.
type QuarantineDoc struct {
	Key          string   `json:"key"`
	Value        string   `json:"value"`
	KeptHeaders  string   `json:"kept_headers"`
	AddedHeaders []string `json:"added_headers"`
}

// HeaderEntry is one Kafka header (HeaderDoc).
type HeaderEntry struct {
	Name string `json:"name"`
	Doc  string `json:"doc"`
}

// QuarantineHeaders are the headers a quarantine record adds after the
// refused record's own, in order (pipeline.QuarantineRecord).
var QuarantineHeaders = []string{HeaderReason, HeaderDetail, HeaderStage, HeaderSourceTopic, HeaderSourcePartition, HeaderSourceOffset}

var quarantineLayout = QuarantineDoc{
	Key: "the refused record's key",
	Value: "the refused record's bytes as they were; a refused row of a multi-row message is that row alone, " +
		"re-encoded as a one-row message of its kind (the original message stays in its topic)",
	KeptHeaders: "the refused record's headers as they were; a refused row has " + HeaderKind + ", " + HeaderVersion + ", " +
		HeaderID + ", " + HeaderTrace + " of its own and " + HeaderSourceRow,
	AddedHeaders: QuarantineHeaders,
}

// NewCatalog builds the catalog of a run with the given topics (in
// order; their Version is filled in) and every Arrow kind, JSON kind and
// header of this package.
func NewCatalog(topics []TopicDoc) Catalog {
	c := Catalog{Topics: make([]TopicDoc, len(topics)), Arrow: []ArrowDoc{}, JSON: []JSONDoc{}, Headers: []HeaderEntry{}}
	for i, t := range topics {
		t.Version = Versions[t.Kind]
		for _, l := range []*[]string{&t.Producers, &t.Consumers, &t.SideInputs, &t.ReadBack} {
			*l = append([]string{}, *l...) // [] rather than null in JSON
		}
		c.Topics[i] = t
	}
	for _, s := range ArrowSchemas() {
		md := s.Metadata()
		kind := Kind(metaValue(md, MetaKind))
		d := ArrowDoc{Kind: kind, Version: Versions[kind], Columns: make([]ColumnDoc, s.NumFields())}
		for i, f := range s.Fields() {
			d.Columns[i] = ColumnDoc{Name: f.Name, Type: f.Type.String(), Nullable: f.Nullable}
		}
		c.Arrow = append(c.Arrow, d)
	}
	for _, j := range jsonKinds {
		c.JSON = append(c.JSON, JSONDoc{Kind: j.kind, Version: Versions[j.kind], Fields: jsonFields(j.typ)})
	}
	q := quarantineLayout
	q.AddedHeaders = append([]string{}, QuarantineHeaders...)
	c.Quarantine = q
	for _, h := range HeaderDoc {
		c.Headers = append(c.Headers, HeaderEntry{Name: h.Name, Doc: h.Doc})
	}
	return c
}

// jsonFields lists the fields encoding/json writes for struct type t, in
// its order: embedded structs without a json name contribute their fields
// in place.
func jsonFields(t reflect.Type) []FieldDoc {
	var out []FieldDoc
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" || !f.IsExported() && !f.Anonymous {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct {
			out = append(out, jsonFields(f.Type)...)
			continue
		}
		if name == "" {
			name = f.Name
		}
		d := FieldDoc{Name: name, OmitEmpty: strings.Contains(","+opts+",", ",omitempty,")}
		d.Type, d.Fields = jsonType(f.Type)
		out = append(out, d)
	}
	return out
}

// jsonType is the FieldDoc type of Go type t, with the fields of an
// object (or of the objects of an array).
func jsonType(t reflect.Type) (string, []FieldDoc) {
	switch t.Kind() {
	case reflect.Struct:
		return "object", jsonFields(t)
	case reflect.Slice, reflect.Array:
		elem, fields := jsonType(t.Elem())
		return "[]" + elem, fields
	case reflect.Map:
		elem, fields := jsonType(t.Elem())
		return "object of " + elem, fields
	case reflect.Pointer:
		return jsonType(t.Elem())
	}
	return t.Kind().String(), nil
}

// Describe prints every Arrow schema, JSON document kind, the quarantine
// record layout and every header: the catalog without the topics, which
// the pipeline's topology supplies (`trajflow schemas` prints both).
func Describe(w io.Writer) error { return NewCatalog(nil).WriteText(w) }

// WriteText prints the catalog for people: the topics (when any), every
// Arrow schema (columns with type and nullability), every JSON document
// kind (its data fields), the quarantine record and the headers.
func (c Catalog) WriteText(w io.Writer) error {
	var b strings.Builder
	if len(c.Topics) > 0 {
		b.WriteString("Topics of a run, named <run>.<topic> (partitions \"contract\": topics.partitions of the learning contract)\n\n")
		for _, t := range c.Topics {
			kind := "any kind (the refused record's)"
			if t.Kind != "" {
				kind = fmt.Sprintf("%s v%d", t.Kind, t.Version)
			}
			parts := "contract"
			if t.Partitions > 0 {
				parts = fmt.Sprint(t.Partitions)
			}
			if t.Compacted {
				parts += ", compacted"
			}
			fmt.Fprintf(&b, "%s: %s, plane %s, partitions %s, key %s\n", t.Topic, kind, t.Plane, parts, t.Key)
			for _, l := range []struct {
				what   string
				stages []string
			}{
				{"produced by", t.Producers}, {"consumed by", t.Consumers}, {"side input of", t.SideInputs}, {"read back by", t.ReadBack},
			} {
				if len(l.stages) > 0 {
					fmt.Fprintf(&b, "  %-14s %s\n", l.what, strings.Join(l.stages, ", "))
				}
			}
			fmt.Fprintf(&b, "  %s\n\n", t.Doc)
		}
	}
	for _, a := range c.Arrow {
		fmt.Fprintf(&b, "%s v%d (Arrow IPC stream, one record batch per message)\n", a.Kind, a.Version)
		for _, col := range a.Columns {
			null := ""
			if col.Nullable {
				null = " (nullable)"
			}
			fmt.Fprintf(&b, "  %-24s %s%s\n", col.Name, col.Type, null)
		}
		b.WriteString("\n")
	}
	for _, j := range c.JSON {
		fmt.Fprintf(&b, "%s v%d (JSON document {\"kind\",\"version\",\"data\"}; data fields:)\n", j.Kind, j.Version)
		writeFields(&b, j.Fields, "  ")
		b.WriteString("\n")
	}
	q := c.Quarantine
	b.WriteString("quarantine record (the quarantine topic; any kind)\n")
	fmt.Fprintf(&b, "  %-24s %s\n", "key", q.Key)
	fmt.Fprintf(&b, "  %-24s %s\n", "value", q.Value)
	fmt.Fprintf(&b, "  %-24s %s\n", "headers", q.KeptHeaders)
	fmt.Fprintf(&b, "  %-24s %s\n\n", "then the headers", strings.Join(q.AddedHeaders, ", "))
	b.WriteString("Kafka headers\n")
	for _, h := range c.Headers {
		fmt.Fprintf(&b, "  %-26s %s\n", h.Name, h.Doc)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func writeFields(b *strings.Builder, fields []FieldDoc, indent string) {
	for _, f := range fields {
		omit := ""
		if f.OmitEmpty {
			omit = " (omitted when empty)"
		}
		fmt.Fprintf(b, "%s%-*s %s%s\n", indent, max(24-(len(indent)-2), len(f.Name)), f.Name, f.Type, omit)
		writeFields(b, f.Fields, indent+"  ")
	}
}
