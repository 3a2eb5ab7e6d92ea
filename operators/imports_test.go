package operators_test

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestStagesTouchNoKafkaNorBadger: no stage package imports kafka-go or
// Badger (or franz-go) itself — the runtime owns every I/O and gives a
// stage what it needs through pipeline.Env. Test files are exempt (they
// may start brokers).
func TestStagesTouchNoKafkaNorBadger(t *testing.T) {
	forbidden := []string{"github.com/segmentio/kafka-go", "github.com/dgraph-io/badger", "github.com/twmb/franz-go"}
	dirs, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, d := range dirs {
		if !d.IsDir() {
			continue
		}
		files, _ := filepath.Glob(filepath.Join(d.Name(), "*.go"))
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			ast, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
			if err != nil {
				t.Fatal(err)
			}
			checked++
			for _, imp := range ast.Imports {
				path, _ := strconv.Unquote(imp.Path.Value)
				for _, bad := range forbidden {
					if strings.HasPrefix(path, bad) {
						t.Errorf("%s imports %s: a stage reaches Kafka and local state only through pipeline.Env", f, path)
					}
				}
			}
		}
	}
	if checked < 20 {
		t.Fatalf("checked only %d files: is the test in operators/?", checked)
	}
}
