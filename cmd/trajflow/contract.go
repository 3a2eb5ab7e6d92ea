package main

import (
	"fmt"
	"io"

	"github.com/trajflow/trajflow/pipeline/contract"
)

// contractFlag loads the contract of a --contract flag. Every command that
// takes --contract follows one rule: without it, the command says on
// stderr which contract it uses (stage, run, topics create: the built-in
// demo contract; replay: the contract recorded in the snapshot).
func contractFlag(path string, stderr io.Writer) (*contract.Contract, error) {
	if path == "" {
		fmt.Fprintln(stderr, "no --contract: using the built-in demo contract (testdata/contracts/demo.yaml)")
	}
	return loadContract(path)
}
