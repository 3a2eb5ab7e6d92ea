package k8s

import (
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"
)

// Schema is the subset of a CustomResourceDefinition's OpenAPI v3 schema
// (apiextensions.k8s.io/v1 JSONSchemaProps) that the KEDA CRDs use: types,
// properties, required fields, items, enums, maps (additionalProperties),
// int-or-string, minimum, minLength, minItems and patterns. Validate
// rejects every field the schema does not declare, as the API server's
// strict field validation (kubectl apply --validate=strict) does. CEL rules
// (x-kubernetes-validations) are not evaluated: Check tests the one rule of
// the ScaledObject CRD (minReplicaCount <= maxReplicaCount) itself.
type Schema struct {
	Type                 string             `json:"type"`
	Properties           map[string]*Schema `json:"properties"`
	Required             []string           `json:"required"`
	Items                *Schema            `json:"items"`
	AdditionalProperties *Schema            `json:"additionalProperties"`
	Enum                 []json.RawMessage  `json:"enum"`
	AnyOf                []*Schema          `json:"anyOf"`
	Minimum              *float64           `json:"minimum"`
	MinLength            *int64             `json:"minLength"`
	MinItems             *int64             `json:"minItems"`
	Pattern              string             `json:"pattern"`
	IntOrString          bool               `json:"x-kubernetes-int-or-string"`
	PreserveUnknown      bool               `json:"x-kubernetes-preserve-unknown-fields"`
}

// UnmarshalJSON accepts additionalProperties: true|false as well as a schema.
func (s *Schema) UnmarshalJSON(b []byte) error {
	type plain Schema
	var raw struct {
		plain
		AdditionalProperties json.RawMessage `json:"additionalProperties"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		return err
	}
	*s = Schema(raw.plain)
	switch ap := strings.TrimSpace(string(raw.AdditionalProperties)); ap {
	case "", "false":
	case "true":
		s.AdditionalProperties = &Schema{PreserveUnknown: true}
	default:
		s.AdditionalProperties = &Schema{}
		if err := json.Unmarshal(raw.AdditionalProperties, s.AdditionalProperties); err != nil {
			return err
		}
	}
	return nil
}

// CRD is one served version of a CustomResourceDefinition.
type CRD struct {
	Group, Version, Kind string
	Schema               *Schema
}

// APIVersion is "group/version".
func (c CRD) APIVersion() string { return c.Group + "/" + c.Version }

// ParseCRD reads the served versions of a CustomResourceDefinition (YAML).
func ParseCRD(data []byte) ([]CRD, error) {
	var doc struct {
		Kind string `json:"kind"`
		Spec struct {
			Group string `json:"group"`
			Names struct {
				Kind string `json:"kind"`
			} `json:"names"`
			Versions []struct {
				Name   string `json:"name"`
				Served bool   `json:"served"`
				Schema struct {
					OpenAPIV3Schema *Schema `json:"openAPIV3Schema"`
				} `json:"schema"`
			} `json:"versions"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("k8s: CRD: %w", err)
	}
	if doc.Kind != "CustomResourceDefinition" {
		return nil, fmt.Errorf("k8s: CRD: kind %q, want CustomResourceDefinition", doc.Kind)
	}
	var out []CRD
	for _, v := range doc.Spec.Versions {
		if !v.Served || v.Schema.OpenAPIV3Schema == nil {
			continue
		}
		out = append(out, CRD{Group: doc.Spec.Group, Version: v.Name, Kind: doc.Spec.Names.Kind, Schema: v.Schema.OpenAPIV3Schema})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("k8s: CRD %s.%s: no served version with a schema", doc.Spec.Names.Kind, doc.Spec.Group)
	}
	return out, nil
}

// Validate checks v (a document decoded from JSON: map[string]any, []any,
// string, float64, bool, nil) against s; every problem is returned, each
// naming its field path.
func (s *Schema) Validate(v any) []error {
	var errs []error
	s.validate(v, "", &errs)
	return errs
}

// The object fields every resource has; CRD schemas declare metadata only as
// "type: object" and the API server validates it as ObjectMeta.
var objectMeta = map[string]bool{"apiVersion": true, "kind": true, "metadata": true}

func (s *Schema) validate(v any, path string, errs *[]error) {
	fail := func(format string, args ...any) {
		p := path
		if p == "" {
			p = "."
		}
		*errs = append(*errs, fmt.Errorf("%s: %s", p, fmt.Sprintf(format, args...)))
	}
	if v == nil {
		return // null is absent
	}
	if s.IntOrString {
		switch x := v.(type) {
		case float64:
			if x != float64(int64(x)) {
				fail("%v is not an integer", x)
			}
		case string:
			s.checkString(x, fail)
		default:
			fail("want an integer or a string, got %T", v)
		}
		return
	}
	switch s.Type {
	case "object":
		m, ok := v.(map[string]any)
		if !ok {
			fail("want an object, got %T", v)
			return
		}
		for _, r := range s.Required {
			if _, ok := m[r]; !ok {
				fail("required field %q is missing", r)
			}
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			sub := path + "." + k
			switch {
			case path == "" && objectMeta[k]:
				// apiVersion and kind are matched by the decoder, metadata
				// is decoded strictly into metav1.ObjectMeta.
			case s.Properties[k] != nil:
				s.Properties[k].validate(m[k], sub, errs)
			case s.AdditionalProperties != nil:
				s.AdditionalProperties.validate(m[k], sub, errs)
			case s.PreserveUnknown:
			default:
				*errs = append(*errs, fmt.Errorf("%s: unknown field", sub))
			}
		}
	case "array":
		a, ok := v.([]any)
		if !ok {
			fail("want an array, got %T", v)
			return
		}
		if s.MinItems != nil && int64(len(a)) < *s.MinItems {
			fail("%d items, want at least %d", len(a), *s.MinItems)
		}
		if s.Items != nil {
			for i, x := range a {
				s.Items.validate(x, fmt.Sprintf("%s[%d]", path, i), errs)
			}
		}
	case "string":
		x, ok := v.(string)
		if !ok {
			fail("want a string, got %T", v)
			return
		}
		s.checkString(x, fail)
	case "integer":
		x, ok := v.(float64)
		if !ok || x != float64(int64(x)) {
			fail("want an integer, got %v", v)
			return
		}
		if s.Minimum != nil && x < *s.Minimum {
			fail("%v is below the minimum %v", x, *s.Minimum)
		}
	case "number":
		x, ok := v.(float64)
		if !ok {
			fail("want a number, got %T", v)
			return
		}
		if s.Minimum != nil && x < *s.Minimum {
			fail("%v is below the minimum %v", x, *s.Minimum)
		}
	case "boolean":
		if _, ok := v.(bool); !ok {
			fail("want a boolean, got %T", v)
		}
	case "":
		if len(s.AnyOf) > 0 || s.PreserveUnknown {
			return
		}
		fail("schema declares no type")
	default:
		fail("schema type %q is not supported", s.Type)
	}
	if len(s.Enum) > 0 {
		b, _ := json.Marshal(v)
		for _, e := range s.Enum {
			if string(e) == string(b) {
				return
			}
		}
		fail("%s is not one of the allowed values", b)
	}
}

func (s *Schema) checkString(x string, fail func(string, ...any)) {
	if s.MinLength != nil && int64(len(x)) < *s.MinLength {
		fail("%q is shorter than %d", x, *s.MinLength)
	}
	if s.Pattern != "" {
		re, err := regexp.Compile(s.Pattern)
		if err != nil {
			fail("schema pattern %q: %v", s.Pattern, err)
		} else if !re.MatchString(x) {
			fail("%q does not match %s", x, s.Pattern)
		}
	}
}
