package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strings"
	"testing"
)

// maxFuncLines is the longest function cmd/trajflow may hold: the command
// parses flags and calls packages, the logic lives in those packages.
const maxFuncLines = 80

// TestThinCommand parses this package's own source (tests excluded) and
// fails on any function longer than maxFuncLines lines.
func TestThinCommand(t *testing.T) {
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, ".", func(fi os.FileInfo) bool {
		return !strings.HasSuffix(fi.Name(), "_test.go")
	}, 0)
	if err != nil {
		t.Fatal(err)
	}
	funcs := 0
	for _, pkg := range pkgs {
		for name, f := range pkg.Files {
			for _, d := range f.Decls {
				fd, ok := d.(*ast.FuncDecl)
				if !ok {
					continue
				}
				funcs++
				lines := fset.Position(fd.End()).Line - fset.Position(fd.Pos()).Line + 1
				if lines > maxFuncLines {
					t.Errorf("%s: func %s is %d lines (at most %d: move the logic into a package)", name, fd.Name.Name, lines, maxFuncLines)
				}
			}
		}
	}
	if funcs == 0 {
		t.Fatal("no function found: the test reads the wrong directory")
	}
}
