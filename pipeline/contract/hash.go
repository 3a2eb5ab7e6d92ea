package contract

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// Domain-separation prefixes of the hashes; a change of the canonical
// encoding changes the version.
const (
	contractHashDomain = "trajflow/contract/v1\n"
	samplerHashDomain  = "trajflow/sampler/v1\n"
	curriculumDomain   = "trajflow/curriculum/v1\n"
	rewardDomain       = "trajflow/reward/v1\n"
)

// resolved returns c itself when its defaults are filled, else a filled
// clone (c is not modified).
func (c *Contract) resolved() *Contract {
	if c.filled {
		return c
	}
	r := c.Clone()
	r.fillDefaults()
	return r
}

// Canonical returns the canonical encoding of the resolved contract (the
// defaults filled, c not modified): JSON-shaped text with object keys in
// declaration order (the YAML key names), map keys sorted, strings quoted as
// Go string literals (an injective quoting), nil and empty lists and maps
// alike, floats in shortest round-trip form with -0 written as 0 and
// non-finite values as the strings "NaN", "+Inf", "-Inf", floors and stop
// rules in their text form. It is independent of key order, whitespace,
// comments and whether a default was written out. The policy section is
// left out: it says which servers generate (deployment), and what a sample
// depends on — the servers' protocol, software and model — is recorded per
// trajectory in its sampler id, the version per turn. So is a key added
// after contracts were written (loss.ratio) while it holds its default,
// so that those contracts keep their hash.
func (c *Contract) Canonical() []byte {
	var b bytes.Buffer
	canonical(&b, reflect.ValueOf(c.resolved()).Elem())
	return b.Bytes()
}

// Hash returns "sha256:<hex>" of the canonical encoding of the resolved
// contract (see Canonical). Equal contracts hash equally; any semantic
// change changes the hash. It is the contract_hash of every record.
func (c *Contract) Hash() string {
	return digest(contractHashDomain, c.Canonical())
}

// SamplerID returns "sha256:<hex>" of the canonical encoding of the resolved
// sampler section alone (docs/PIPELINE.md §5: the resolved sampler recorded with
// every trajectory).
func (c *Contract) SamplerID() string {
	var b bytes.Buffer
	canonical(&b, reflect.ValueOf(c.resolved().Sampler))
	return digest(samplerHashDomain, b.Bytes())
}

// curriculum is what decides which tasks a run draws, in which round and
// how: the seed, the target distribution, the task corpus and its splits,
// and the dispatch section (docs/PIPELINE.md §17).
type curriculum struct {
	Seed               int64    `yaml:"seed"`
	TargetDistribution string   `yaml:"target_distribution"`
	TaskCorpus         string   `yaml:"task_corpus"`
	SplitManifest      string   `yaml:"split_manifest"`
	Dispatch           Dispatch `yaml:"dispatch"`
}

// reward is what decides a trajectory's reward: the components, the
// validator and the reward model.
type reward struct {
	Rewards     []Reward `yaml:"rewards"`
	Validator   string   `yaml:"validator"`
	RewardModel string   `yaml:"reward_model"`
}

// CurriculumVersion returns "sha256:<hex>" of the canonical encoding of
// the run's curriculum: {"seed", "target_distribution", "task_corpus",
// "split_manifest", "dispatch"} (artifacts.task_corpus and
// artifacts.split_manifest, the resolved dispatch section). Every
// release records it; a rollback restores the release's together with
// its parameters (docs/PIPELINE.md §17).
func (c *Contract) CurriculumVersion() string {
	r := c.resolved()
	var b bytes.Buffer
	canonical(&b, reflect.ValueOf(curriculum{Seed: r.Seed, TargetDistribution: r.Objective.TargetDistribution,
		TaskCorpus: r.Artifacts.TaskCorpus, SplitManifest: r.Artifacts.SplitManifest, Dispatch: r.Dispatch}))
	return digest(curriculumDomain, b.Bytes())
}

// RewardVersion returns "sha256:<hex>" of the canonical encoding of the
// run's reward: {"rewards", "validator", "reward_model"} (the resolved
// reward components, artifacts.validator and artifacts.reward_model).
// Every release records it, like CurriculumVersion.
func (c *Contract) RewardVersion() string {
	r := c.resolved()
	var b bytes.Buffer
	canonical(&b, reflect.ValueOf(reward{Rewards: r.Rewards, Validator: r.Artifacts.Validator, RewardModel: r.Artifacts.RewardModel}))
	return digest(rewardDomain, b.Bytes())
}

func digest(domain string, body []byte) string {
	h := sha256.New()
	h.Write([]byte(domain))
	h.Write(body)
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// YAML renders the resolved contract (defaults filled, c not modified) with
// every key written, except two kinds of keys that c's document did not
// write and that hold their default: topics.replication
// (Topics.Replication), and the keys that do not apply under the
// contract's other settings (estimator.lambda with estimator grpo, ...;
// see conditionals), which a document may not write there. Parse(YAML())
// yields a contract with the same Hash, whose topics.replication is
// written where c's was.
func (c *Contract) YAML() ([]byte, error) {
	var b bytes.Buffer
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	r := c.resolved()
	doc, err := yamlNode(reflect.ValueOf(r).Elem())
	if err != nil {
		return nil, fmt.Errorf("contract: encode YAML: %w", err)
	}
	if !c.Written("topics.replication") && r.Topics.Replication == defaultReplication {
		removeKey(doc, "topics", "replication") // unwritten it stays
	}
	for _, keys := range c.unwrittenUnused(r) {
		removeKey(doc, keys...) // read back, it is the same default, and not written
	}
	if err := enc.Encode(doc); err != nil {
		return nil, fmt.Errorf("contract: encode YAML: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("contract: encode YAML: %w", err)
	}
	return b.Bytes(), nil
}

// yamlNode builds the YAML node tree of v (a contract or a part of it),
// as yaml.Node.Encode would: mappings of the yaml keys in declaration
// order, map keys sorted, MarshalYAML honored. Node.Encode is not used:
// it writes v out and parses it back, and the writer loses or garbles
// strings whose plain or block form does not read back ("\nx" is read
// as "x", "\t\n" is not read at all, plain "<<" is a merge key). Here
// such a string is a double-quoted scalar, in which everything is escaped.
func yamlNode(v reflect.Value) (*yaml.Node, error) {
	if m, ok := v.Interface().(yaml.Marshaler); ok { // Floor, StopRule
		x, err := m.MarshalYAML()
		if err != nil {
			return nil, err
		}
		return yamlNode(reflect.ValueOf(x))
	}
	var n *yaml.Node
	switch v.Kind() {
	case reflect.Struct:
		n = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
		for _, f := range fieldsOf(v.Type()).list {
			if f.omitzero && v.FieldByIndex(f.index).IsZero() {
				continue
			}
			e, err := yamlNode(v.FieldByIndex(f.index))
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, strNode(f.name), e)
		}
	case reflect.Map:
		n = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
		keys := make([]string, 0, v.Len())
		for _, k := range v.MapKeys() {
			keys = append(keys, k.String())
		}
		slices.Sort(keys)
		for _, k := range keys {
			e, err := yamlNode(v.MapIndex(reflect.ValueOf(k).Convert(v.Type().Key())))
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, strNode(k), e)
		}
	case reflect.Slice:
		n = &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		for i := 0; i < v.Len(); i++ {
			e, err := yamlNode(v.Index(i))
			if err != nil {
				return nil, err
			}
			n.Content = append(n.Content, e)
		}
	case reflect.String:
		n = strNode(v.String())
	case reflect.Bool:
		n = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: strconv.FormatBool(v.Bool())}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		n = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!int", Value: strconv.FormatInt(v.Int(), 10)}
	case reflect.Float64:
		// Untagged, as the library writes a float: "2" reads back as an
		// int, which a float field takes.
		f := strconv.FormatFloat(v.Float(), 'g', -1, 64)
		switch f {
		case "+Inf":
			f = ".inf"
		case "-Inf":
			f = "-.inf"
		case "NaN":
			f = ".nan"
		}
		n = &yaml.Node{Kind: yaml.ScalarNode, Value: f}
	default:
		n = new(yaml.Node)
		if err := n.Encode(v.Interface()); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// strNode is the scalar node of string s: double-quoted when s holds a
// tab, a line break or another control character, or is "<<"; else in the
// style the writer picks (plain, or quoted where plain would read as
// another type).
func strNode(s string) *yaml.Node {
	n := &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: s}
	if s == "<<" || strings.ContainsFunc(s, func(r rune) bool {
		return r < 0x20 || r == 0x7f || r == 0x85 || r == 0x2028 || r == 0x2029
	}) {
		n.Style = yaml.DoubleQuotedStyle
	}
	return n
}

// removeKey removes the key at path from the mapping node m, if there.
func removeKey(m *yaml.Node, path ...string) {
	for i := 0; m.Kind == yaml.MappingNode && i+1 < len(m.Content); i += 2 {
		if m.Content[i].Value != path[0] {
			continue
		}
		if len(path) == 1 {
			m.Content = append(m.Content[:i], m.Content[i+2:]...)
		} else {
			removeKey(m.Content[i+1], path[1:]...)
		}
		return
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, cmp.Compare[string])
	return keys
}

func canonicalFloat(b *bytes.Buffer, f float64) {
	switch {
	case math.IsNaN(f):
		b.WriteString(`"NaN"`)
	case math.IsInf(f, 1):
		b.WriteString(`"+Inf"`)
	case math.IsInf(f, -1):
		b.WriteString(`"-Inf"`)
	case f == 0:
		b.WriteByte('0')
	default:
		b.WriteString(strconv.FormatFloat(f, 'g', -1, 64))
	}
}

// canonical writes v's canonical encoding (see Canonical).
func canonical(b *bytes.Buffer, v reflect.Value) {
	switch v.Type() {
	case floorType, stopRuleType:
		b.WriteString(strconv.Quote(v.Interface().(fmt.Stringer).String()))
		return
	}
	switch v.Kind() {
	case reflect.Struct:
		b.WriteByte('{')
		i := 0
		for _, f := range fieldsOf(v.Type()).list {
			if f.unhashed || f.omitzero && v.FieldByIndex(f.index).IsZero() {
				continue
			}
			if i > 0 {
				b.WriteByte(',')
			}
			i++
			b.WriteString(strconv.Quote(f.name))
			b.WriteByte(':')
			canonical(b, v.FieldByIndex(f.index))
		}
		b.WriteByte('}')
	case reflect.Map:
		b.WriteByte('{')
		keys := make([]string, 0, v.Len())
		for _, k := range v.MapKeys() {
			keys = append(keys, k.String())
		}
		slices.Sort(keys)
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(strconv.Quote(k))
			b.WriteByte(':')
			canonical(b, v.MapIndex(reflect.ValueOf(k).Convert(v.Type().Key())))
		}
		b.WriteByte('}')
	case reflect.Slice:
		b.WriteByte('[')
		for i := 0; i < v.Len(); i++ {
			if i > 0 {
				b.WriteByte(',')
			}
			canonical(b, v.Index(i))
		}
		b.WriteByte(']')
	case reflect.String:
		b.WriteString(strconv.Quote(v.String()))
	case reflect.Bool:
		b.WriteString(strconv.FormatBool(v.Bool()))
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		b.WriteString(strconv.FormatInt(v.Int(), 10))
	case reflect.Float32, reflect.Float64:
		canonicalFloat(b, v.Float())
	default:
		panic("contract: canonical encoding of unsupported kind " + v.Kind().String())
	}
}
