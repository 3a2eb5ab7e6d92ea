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

// Describe prints every Arrow schema (kind, version, each column with its
// Arrow type and nullability) and the fields of the JSON kinds, for the
// `trajflow schemas` command.
func Describe(w io.Writer) error {
	var b strings.Builder
	for _, s := range ArrowSchemas() {
		md := s.Metadata()
		kind, version := md.Values()[md.FindKey(MetaKind)], md.Values()[md.FindKey(MetaVersion)]
		fmt.Fprintf(&b, "%s v%s (Arrow IPC stream, one record batch per message)\n", kind, version)
		for _, f := range s.Fields() {
			null := ""
			if f.Nullable {
				null = " (nullable)"
			}
			fmt.Fprintf(&b, "  %-24s %s%s\n", f.Name, f.Type, null)
		}
		b.WriteString("\n")
	}
	for _, j := range []struct {
		kind Kind
		typ  reflect.Type
	}{
		{KindPolicyRelease, reflect.TypeFor[PolicyRelease]()},
		{KindCensusEvent, reflect.TypeFor[CensusEvent]()},
		{KindWeightAck, reflect.TypeFor[WeightAck]()},
	} {
		fmt.Fprintf(&b, "%s v%d (JSON document {\"kind\",\"version\",\"data\"}; data fields:)\n", j.kind, Versions[j.kind])
		for i := range j.typ.NumField() {
			f := j.typ.Field(i)
			name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
			omit := ""
			if opts == "omitempty" {
				omit = " (omitted when empty)"
			}
			fmt.Fprintf(&b, "  %-24s %s%s\n", name, f.Type, omit)
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}
