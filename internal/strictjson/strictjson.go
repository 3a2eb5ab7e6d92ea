// Package strictjson decodes JSON request bodies the way a signed or
// validated request must be read: one meaning per document.
//
// encoding/json is lenient in two ways that let two readers of the same
// bytes disagree. It matches an object key to a struct field without
// regard to case ("Action" fills the field named "action"), and when a
// key appears twice the last value wins. A service that checks one
// reading of a body (a capability token over the raw bytes of its
// "action" field, say) and acts on another (the decoded struct) can then
// be made to act on something it never checked: {"action": A, ...,
// "Action": B} verifies A and runs B. Unmarshal refuses such bodies
// instead: every object key that reaches a struct must be spelled as the
// field's JSON name, and no object anywhere in the document may name a
// key twice (RFC 8259 §4 leaves duplicate names' meaning undefined).
// Keys no field has are left to the caller's decoder (ignored by
// json.Unmarshal, refused by a Decoder with DisallowUnknownFields).
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"
)

// KeyError is a key Unmarshal refuses: given twice in one object, or
// spelled with another case than the field it would fill.
type KeyError struct {
	Path string // where the object is: "" for the top level, "attempt", "items[2]"
	Key  string // the key as the document spells it
	Want string // the field's JSON name, for a key of the wrong case ("" for a duplicate)
}

func (e *KeyError) Error() string {
	at := ""
	if e.Path != "" {
		at = " in " + e.Path
	}
	if e.Want != "" {
		return fmt.Sprintf("key %q%s: keys are case-sensitive, the field is %q", e.Key, at, e.Want)
	}
	return fmt.Sprintf("key %q%s given twice", e.Key, at)
}

// Unmarshal checks data's object keys against v's type (CheckKeys) and
// then decodes it with json.Unmarshal.
func Unmarshal(data []byte, v any) error {
	if err := CheckKeys(data, reflect.TypeOf(v)); err != nil {
		return err
	}
	return json.Unmarshal(data, v)
}

// CheckKeys returns a *KeyError for the first key of data that is given
// twice in its object, or that reaches a struct field of t (as
// json.Unmarshal would decode data into a value of type t) spelled with
// another case than the field's JSON name. Inside values whose type
// decodes itself (a json.Unmarshaler, json.RawMessage, an interface),
// only duplicates are looked for. A document that is not JSON passes:
// the decoder reports it.
func CheckKeys(data []byte, t reflect.Type) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	err := (&checker{dec: dec}).value(t, "")
	var ke *KeyError
	if errors.As(err, &ke) {
		return err
	}
	return nil // a syntax error: json.Unmarshal names it
}

type checker struct{ dec *json.Decoder }

var unmarshaler = reflect.TypeFor[json.Unmarshaler]()

// schema is the type whose keys are checked: t without pointers, or nil
// when t decodes itself or is not known (only duplicates are checked).
func schema(t reflect.Type) reflect.Type {
	for t != nil && t.Kind() == reflect.Pointer {
		if t.Implements(unmarshaler) {
			return nil
		}
		t = t.Elem()
	}
	if t == nil || t.Kind() == reflect.Interface || reflect.PointerTo(t).Implements(unmarshaler) {
		return nil
	}
	return t
}

func (c *checker) value(t reflect.Type, path string) error {
	tok, err := c.dec.Token()
	if err != nil {
		return err
	}
	t = schema(t)
	switch tok {
	case json.Delim('{'):
		return c.object(t, path)
	case json.Delim('['):
		var elem reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			elem = t.Elem()
		}
		for i := 0; c.dec.More(); i++ {
			if err := c.value(elem, path+"["+strconv.Itoa(i)+"]"); err != nil {
				return err
			}
		}
		_, err := c.dec.Token() // ']'
		return err
	}
	return nil
}

func (c *checker) object(t reflect.Type, path string) error {
	var fields map[string]reflect.Type
	var elem reflect.Type
	switch {
	case t == nil:
	case t.Kind() == reflect.Struct:
		fields = fieldsOf(t)
	case t.Kind() == reflect.Map:
		elem = t.Elem()
	}
	seen := map[string]bool{}
	for c.dec.More() {
		tok, err := c.dec.Token()
		if err != nil {
			return err
		}
		key, _ := tok.(string)
		if seen[key] {
			return &KeyError{Path: path, Key: key}
		}
		seen[key] = true
		vt := elem
		if fields != nil {
			ft, ok := fields[key]
			if !ok {
				// encoding/json would fill a field whose name equals the
				// key under Unicode case folding (ſ, the long s, and s
				// alike): strings.EqualFold is that folding.
				for name := range fields {
					if strings.EqualFold(name, key) {
						return &KeyError{Path: path, Key: key, Want: name}
					}
				}
			}
			vt = ft
		}
		sub := key
		if path != "" {
			sub = path + "." + key
		}
		if err := c.value(vt, sub); err != nil {
			return err
		}
	}
	_, err := c.dec.Token() // '}'
	return err
}

var cache sync.Map // reflect.Type -> map[string]reflect.Type

// fieldsOf returns the JSON names of struct t's fields, as encoding/json
// names them (a tag's name, else the Go name; the fields of an embedded
// struct without a tag name promoted), with their types.
func fieldsOf(t reflect.Type) map[string]reflect.Type {
	if f, ok := cache.Load(t); ok {
		return f.(map[string]reflect.Type)
	}
	fields := map[string]reflect.Type{}
	collect(t, fields, map[reflect.Type]bool{})
	cache.Store(t, fields)
	return fields
}

func collect(t reflect.Type, fields map[string]reflect.Type, visiting map[reflect.Type]bool) {
	if visiting[t] {
		return
	}
	visiting[t] = true
	defer delete(visiting, t)
	// A struct's own fields first: they hide the promoted fields of the
	// same name, as in encoding/json.
	var embedded []reflect.Type
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" {
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				embedded = append(embedded, ft)
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		if _, dup := fields[name]; !dup {
			fields[name] = f.Type
		}
	}
	for _, et := range embedded {
		collect(et, fields, visiting)
	}
}
