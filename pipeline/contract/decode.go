package contract

import (
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"gopkg.in/yaml.v3"
)

// Errors. Every error of Parse and Resolve, and every error of Load but
// those of reading the file (which name it and wrap the os error, e.g.
// os.ErrNotExist), wraps one of them (errors.Is), and every problem with
// one field is a *FieldError.
var (
	// ErrSyntax: the bytes are not one well-formed YAML document.
	ErrSyntax = errors.New("contract: invalid YAML")
	// ErrInvalid: the document does not fit the contract (unknown key,
	// wrong type, duplicate key) or the contract breaks a rule.
	ErrInvalid = errors.New("contract: invalid")
)

// MaxErrors bounds the problems one error reports: a document of a
// hundred thousand unknown keys is refused in a screen, not in megabytes.
const MaxErrors = 50

// joinErrors joins errs (nil when empty), the first MaxErrors of them and
// a count of the rest.
func joinErrors(errs []error) error {
	if len(errs) > MaxErrors {
		more := fmt.Errorf("%w: %d more problems not shown", ErrInvalid, len(errs)-MaxErrors)
		errs = append(errs[:MaxErrors:MaxErrors], more)
	}
	return errors.Join(errs...)
}

// FieldError is one problem with one field, named by its key path in the
// YAML document ("sampler.temperature", "rewards[1].weight"). Line is the
// 1-based line of the document where the problem was found, 0 when it comes
// from validation.
type FieldError struct {
	Path string
	Line int
	Msg  string
}

// Error renders "path: msg" (with " (line N)" when known).
func (e *FieldError) Error() string {
	s := e.Path + ": " + e.Msg
	if e.Path == "" {
		s = e.Msg
	}
	if e.Line > 0 {
		s += " (line " + strconv.Itoa(e.Line) + ")"
	}
	return s
}

// Unwrap makes every FieldError match ErrInvalid.
func (e *FieldError) Unwrap() error { return ErrInvalid }

// Parse strictly decodes one YAML contract document. Unknown keys,
// duplicate keys, aliases, custom tags, values of the wrong type,
// non-finite numbers (.nan, .inf, 1e400), integers that do not fit their
// field exactly and more than one document are errors; all problems found
// (up to MaxErrors) are reported together (errors.Join of *FieldError),
// each naming its key path. A null value counts as absent. Parse fills no
// default and does not validate: call Resolve.
func Parse(data []byte) (c *Contract, err error) {
	// The YAML library is third-party code: a panic in it on hostile bytes
	// becomes a syntax error, never a crash of the caller.
	defer func() {
		if r := recover(); r != nil {
			c, err = nil, fmt.Errorf("%w: decoder failure: %v", ErrSyntax, r)
		}
	}()
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: empty document", ErrSyntax)
		}
		return nil, fmt.Errorf("%w: %w", ErrSyntax, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrSyntax, err)
		}
		return nil, fmt.Errorf("%w: more than one YAML document", ErrSyntax)
	}
	root := &doc
	if root.Kind == yaml.DocumentNode {
		if len(root.Content) != 1 {
			return nil, fmt.Errorf("%w: empty document", ErrSyntax)
		}
		root = root.Content[0]
	}
	d := decoder{set: map[string]bool{}}
	c = &Contract{}
	if root.Kind == yaml.ScalarNode && root.ShortTag() == "!!null" {
		return nil, fmt.Errorf("%w: empty document", ErrSyntax)
	}
	d.value(root, reflect.ValueOf(c).Elem(), "")
	if len(d.errs) > 0 {
		return nil, joinErrors(d.errs)
	}
	c.set = d.set
	return c, nil
}

// MaxFileSize bounds the contract file Load reads: a contract is a few
// kilobytes, and a larger file is a mistake (a log, a checkpoint, /dev/zero)
// that would otherwise be read whole into memory.
const MaxFileSize = 1 << 20

// Load reads and parses the contract file at path (see Parse). The file
// must be a regular file (after symbolic links) of at most MaxFileSize
// bytes: a directory, device, named pipe or socket is refused without
// reading from it, so that a pipe with no writer cannot block the caller
// and a device cannot feed it forever. Errors name path.
func Load(path string) (*Contract, error) {
	data, err := readContractFile(path)
	if err != nil {
		return nil, err
	}
	c, err := Parse(data)
	switch {
	case errors.Is(err, ErrSyntax): // its text starts with "contract: "
		return nil, fmt.Errorf("%s: %w", path, err)
	case err != nil:
		return nil, fmt.Errorf("contract %s: %w", path, err)
	}
	return c, nil
}

// readContractFile reads path as Load describes.
func readContractFile(path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("contract: %w", err)
	}
	if err := checkRegular(path, fi); err != nil {
		return nil, err
	}
	// O_NONBLOCK: should path have been replaced by a named pipe since the
	// Stat, opening it does not wait for a writer; the Stat of the open
	// file below refuses it. A regular file reads as without the flag.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("contract: %w", err)
	}
	defer f.Close()
	if fi, err = f.Stat(); err != nil {
		return nil, fmt.Errorf("contract: %w", err)
	}
	if err := checkRegular(path, fi); err != nil {
		return nil, err
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("contract: %w", err)
	}
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("contract %s: %w: larger than %d bytes", path, errFile, MaxFileSize)
	}
	return data, nil
}

// errFile marks a contract path that is not a file Load reads.
var errFile = errors.New("not a contract file")

// checkRegular refuses everything but a regular file of at most
// MaxFileSize bytes.
func checkRegular(path string, fi os.FileInfo) error {
	m := fi.Mode()
	var kind string
	switch {
	case m.IsRegular():
		if fi.Size() > MaxFileSize {
			return fmt.Errorf("contract %s: %w: %d bytes, larger than %d", path, errFile, fi.Size(), MaxFileSize)
		}
		return nil
	case m.IsDir():
		kind = "a directory"
	case m&os.ModeNamedPipe != 0:
		kind = "a named pipe"
	case m&os.ModeSocket != 0:
		kind = "a socket"
	case m&os.ModeDevice != 0:
		kind = "a device"
	default:
		kind = fmt.Sprintf("not a regular file (mode %v)", m)
	}
	return fmt.Errorf("contract %s: %w: %s (write the contract to a regular file)", path, errFile, kind)
}

// decoder walks a YAML node tree alongside a Go value, recording the key
// paths written and every problem.
type decoder struct {
	set  map[string]bool
	errs []error
}

func (d *decoder) fail(n *yaml.Node, path, format string, args ...any) {
	line := 0
	if n != nil {
		line = n.Line
	}
	d.errs = append(d.errs, &FieldError{Path: path, Line: line, Msg: fmt.Sprintf(format, args...)})
}

var (
	floorType    = reflect.TypeFor[Floor]()
	stopRuleType = reflect.TypeFor[StopRule]()
)

// kindName describes a node for error messages.
func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a sequence"
	case yaml.ScalarNode:
		return fmt.Sprintf("%s %q", strings.TrimPrefix(n.ShortTag(), "!!"), n.Value)
	}
	return "an unsupported node"
}

// value decodes n into v (settable), at key path path.
func (d *decoder) value(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind == yaml.AliasNode {
		d.fail(n, path, "YAML aliases are not supported")
		return
	}
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return // absent
	}
	d.set[path] = true
	switch v.Type() {
	case floorType:
		d.floor(n, v, path)
		return
	case stopRuleType:
		if s, ok := d.str(n, path); ok {
			r, err := ParseStopRule(s)
			if err != nil {
				d.fail(n, path, "%v", err)
				return
			}
			v.Set(reflect.ValueOf(r))
		}
		return
	}
	switch v.Kind() {
	case reflect.Struct:
		d.structure(n, v, path)
	case reflect.Map:
		d.mapping(n, v, path)
	case reflect.Slice:
		d.sequence(n, v, path)
	case reflect.String:
		if s, ok := d.str(n, path); ok {
			v.SetString(s)
		}
	case reflect.Bool:
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!bool" {
			d.fail(n, path, "want true or false, got %s", kindName(n))
			return
		}
		var b bool
		if err := n.Decode(&b); err != nil {
			d.fail(n, path, "want true or false, got %s", kindName(n))
			return
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int32, reflect.Int64:
		d.integer(n, v, path)
	case reflect.Float64:
		if f, ok := d.number(n, path); ok {
			v.SetFloat(f)
		}
	default:
		d.fail(n, path, "unsupported field type %s", v.Type())
	}
}

// str accepts any non-null scalar as its literal text.
func (d *decoder) str(n *yaml.Node, path string) (string, bool) {
	if n.Kind != yaml.ScalarNode {
		d.fail(n, path, "want a string, got %s", kindName(n))
		return "", false
	}
	switch n.ShortTag() {
	case "!!str", "!!int", "!!float", "!!bool", "!!timestamp":
		return n.Value, true
	}
	d.fail(n, path, "want a string, got tag %s", n.Tag)
	return "", false
}

// number accepts !!int and !!float scalars of finite value: no number of
// the contract may be NaN or infinite (.nan, .inf, and 1e400, which is
// beyond a float64).
func (d *decoder) number(n *yaml.Node, path string) (float64, bool) {
	if n.Kind == yaml.ScalarNode {
		switch n.ShortTag() {
		case "!!int", "!!float":
			var f float64
			if err := n.Decode(&f); err == nil {
				if !finite(f) {
					d.fail(n, path, "must be finite, got %s", g(f))
					return 0, false
				}
				return f, true
			}
		}
		if outOfRange(n) {
			d.fail(n, path, "must be finite, got %s (out of the range of a float64)", n.Value)
			return 0, false
		}
	}
	d.fail(n, path, "want a number, got %s", kindName(n))
	return 0, false
}

// outOfRange reports whether n is a plain scalar that is a decimal number
// beyond the range of a float64 ("1e400"): the YAML library resolves it to
// a string, which is not what its writer meant.
func outOfRange(n *yaml.Node) bool {
	if n.Kind != yaml.ScalarNode || n.Style != 0 || n.ShortTag() != "!!str" {
		return false
	}
	_, err := strconv.ParseFloat(strings.ReplaceAll(n.Value, "_", ""), 64)
	return errors.Is(err, strconv.ErrRange)
}

// integer accepts !!int scalars, and !!float scalars that denote an
// integer exactly ("2.0e9", not "2.5" or "1.00000000000000001"), that fit
// the field's type.
func (d *decoder) integer(n *yaml.Node, v reflect.Value, path string) {
	var i int64
	switch {
	case n.Kind != yaml.ScalarNode:
		d.fail(n, path, "want an integer, got %s", kindName(n))
		return
	case n.ShortTag() == "!!int":
		if n.Decode(&i) != nil {
			if _, ok := new(big.Int).SetString(n.Value, 0); ok {
				d.fail(n, path, "integer %s out of range for %s", n.Value, v.Type())
			} else {
				d.fail(n, path, "want an integer, got %s", kindName(n))
			}
			return
		}
	case n.ShortTag() == "!!float" || outOfRange(n):
		x, ok := exactInteger(n.Value)
		switch {
		case !ok && outOfRange(n):
			d.fail(n, path, "integer %s out of range for %s", n.Value, v.Type())
			return
		case !ok:
			d.fail(n, path, "want an integer, got %s", kindName(n))
			return
		}
		if !x.IsInt64() {
			d.fail(n, path, "integer %s out of range for %s", n.Value, v.Type())
			return
		}
		i = x.Int64()
	default:
		d.fail(n, path, "want an integer, got %s", kindName(n))
		return
	}
	if v.OverflowInt(i) {
		d.fail(n, path, "integer %s out of range for %s", n.Value, v.Type())
		return
	}
	v.SetInt(i)
}

// exactInteger returns the integer the decimal literal s denotes exactly,
// if it denotes one. Exponents beyond ±400 are refused before any
// arithmetic (10^1000000000 is not computed).
func exactInteger(s string) (*big.Int, bool) {
	s = strings.ReplaceAll(s, "_", "")
	if i := strings.IndexAny(s, "eE"); i >= 0 {
		e, err := strconv.Atoi(s[i+1:])
		if err != nil || e < -400 || e > 400 {
			return nil, false
		}
	}
	r, ok := new(big.Rat).SetString(s)
	if !ok || !r.IsInt() {
		return nil, false
	}
	return r.Num(), true
}

func (d *decoder) floor(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind == yaml.ScalarNode {
		switch n.ShortTag() {
		case "!!int", "!!float":
			if f, ok := d.number(n, path); ok {
				v.Set(reflect.ValueOf(Floor{Value: f}))
			}
			return
		case "!!str":
			f, err := ParseFloor(n.Value)
			if err != nil {
				d.fail(n, path, "%v", err)
				return
			}
			v.Set(reflect.ValueOf(f))
			return
		}
	}
	d.fail(n, path, "want a number or <x>%s, got %s", relativeSuffix, kindName(n))
}

// key reads a mapping key as a string.
func (d *decoder) key(k *yaml.Node, path string) (string, bool) {
	if k.Kind != yaml.ScalarNode || k.ShortTag() == "!!null" {
		d.fail(k, path, "mapping keys must be strings, got %s", kindName(k))
		return "", false
	}
	if k.ShortTag() == "!!merge" {
		d.fail(k, path, "YAML merge keys are not supported")
		return "", false
	}
	return k.Value, true
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func (d *decoder) structure(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		d.fail(n, path, "want a mapping, got %s", kindName(n))
		return
	}
	fields := fieldsOf(v.Type())
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		name, ok := d.key(k, path)
		if !ok {
			continue
		}
		p := join(path, name)
		if line, dup := seen[name]; dup {
			d.fail(k, p, "duplicate key (first at line %d)", line)
			continue
		}
		seen[name] = k.Line
		f, known := fields.byName[name]
		if !known {
			d.fail(k, p, "unknown key (known: %s)", strings.Join(fields.names, ", "))
			continue
		}
		d.value(val, v.FieldByIndex(f.index), p)
	}
}

func (d *decoder) mapping(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		d.fail(n, path, "want a mapping, got %s", kindName(n))
		return
	}
	m := reflect.MakeMapWithSize(v.Type(), len(n.Content)/2)
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		name, ok := d.key(k, path)
		if !ok {
			continue
		}
		p := join(path, name)
		if line, dup := seen[name]; dup {
			d.fail(k, p, "duplicate key (first at line %d)", line)
			continue
		}
		seen[name] = k.Line
		if val.Kind == yaml.ScalarNode && val.ShortTag() == "!!null" {
			d.fail(val, p, "missing value")
			continue
		}
		e := reflect.New(v.Type().Elem()).Elem()
		before := len(d.errs)
		d.value(val, e, p)
		if len(d.errs) == before {
			m.SetMapIndex(reflect.ValueOf(name), e)
		}
	}
	v.Set(m)
}

func (d *decoder) sequence(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.SequenceNode {
		d.fail(n, path, "want a sequence, got %s", kindName(n))
		return
	}
	s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
	for i, e := range n.Content {
		p := path + "[" + strconv.Itoa(i) + "]"
		if e.Kind == yaml.ScalarNode && e.ShortTag() == "!!null" {
			d.fail(e, p, "missing value")
			continue
		}
		d.value(e, s.Index(i), p)
	}
	v.Set(s)
}

// field is one YAML key of a struct type; index reaches it through inline
// embedded structs.
type field struct {
	name  string
	index []int
	// unhashed fields (tag `contract:"unhashed"`) are left out of the
	// canonical encoding (Canonical, Hash): they say where a run is
	// deployed, not what it means.
	unhashed bool
	// omitzero fields (tag `contract:"omitzero"`) are left out of the
	// canonical encoding and of YAML when they hold their zero value, the
	// default: a key added after contracts were written, so that those
	// keep their hash (a run's records carry it) and print as before.
	omitzero bool
}

type fieldTable struct {
	list   []field // declaration order
	byName map[string]field
	names  []string
}

var fieldCache sync.Map // reflect.Type -> *fieldTable

// fieldsOf lists the YAML keys of struct type t: exported fields by their
// yaml tag name, with ",inline" embedded structs flattened in place.
func fieldsOf(t reflect.Type) *fieldTable {
	if ft, ok := fieldCache.Load(t); ok {
		return ft.(*fieldTable)
	}
	ft := &fieldTable{byName: map[string]field{}}
	var walk func(t reflect.Type, prefix []int)
	walk = func(t reflect.Type, prefix []int) {
		for i := 0; i < t.NumField(); i++ {
			sf := t.Field(i)
			if !sf.IsExported() {
				continue
			}
			tag := sf.Tag.Get("yaml")
			if tag == "-" {
				continue
			}
			name, opts, _ := strings.Cut(tag, ",")
			idx := append(append([]int(nil), prefix...), i)
			if opts == "inline" && sf.Type.Kind() == reflect.Struct {
				walk(sf.Type, idx)
				continue
			}
			if name == "" {
				name = strings.ToLower(sf.Name)
			}
			f := field{name: name, index: idx, unhashed: sf.Tag.Get("contract") == "unhashed", omitzero: sf.Tag.Get("contract") == "omitzero"}
			ft.list = append(ft.list, f)
			ft.byName[name] = f
			ft.names = append(ft.names, name)
		}
	}
	walk(t, nil)
	fieldCache.Store(t, ft)
	return ft
}
