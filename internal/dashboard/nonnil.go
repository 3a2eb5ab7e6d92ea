package dashboard

import "reflect"

// nonNil replaces every nil slice and map reachable from the struct v
// points to with an empty one, so that the JSON API writes [] and {}
// instead of null: a page (or a script) can iterate any list it gets.
// With shallow set it does not follow pointers below v: what they point to
// may be shared with other readers (the records of the run).
func nonNil(v any, shallow bool) {
	rv := reflect.ValueOf(v)
	if rv.Kind() == reflect.Pointer && !rv.IsNil() {
		fill(rv.Elem(), !shallow)
	}
}

func fill(v reflect.Value, deep bool) {
	switch v.Kind() {
	case reflect.Pointer:
		if deep && !v.IsNil() {
			fill(v.Elem(), deep)
		}
	case reflect.Struct:
		for i := 0; i < v.NumField(); i++ {
			if v.Type().Field(i).IsExported() {
				fill(v.Field(i), deep)
			}
		}
	case reflect.Slice:
		if v.IsNil() {
			if v.CanSet() && v.Type().Elem().Kind() != reflect.Uint8 {
				v.Set(reflect.MakeSlice(v.Type(), 0, 0))
			}
			return
		}
		for i := 0; i < v.Len(); i++ {
			fill(v.Index(i), deep)
		}
	case reflect.Map:
		if v.IsNil() && v.CanSet() {
			v.Set(reflect.MakeMap(v.Type()))
		}
	}
}
