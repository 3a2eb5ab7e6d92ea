package contract_test

import (
	"fmt"

	"github.com/trajflow/trajflow/pipeline/contract"
)

// Resolve reports every problem together, each naming its key path.
func ExampleContract_Resolve() {
	c := contract.Default()
	c.Sampler.Temperature = -1
	c.Packing.MaxLag = -2
	fmt.Println(c.Resolve())
	// Output:
	// sampler.temperature: must be > 0, got -1
	// packing.max_lag: must be >= 0, got -2
}

// Unknown keys are errors that name the key path and its line.
func ExampleParse() {
	_, err := contract.Parse([]byte("run_id: demo\nsampler:\n  temprature: 0.7\n"))
	fmt.Println(err)
	// Output:
	// sampler.temprature: unknown key (known: temperature, top_p, top_k, min_p, max_tokens_per_action, max_tokens_per_episode, max_turns, stop_token_ids, group_size, tool_timeout_ms, tool_retries) (line 3)
}

// Keys a document leaves out take their defaults, so a contract written
// out in full and one relying on defaults hash alike.
func ExampleContract_Hash() {
	full, _ := contract.Load("../../testdata/contracts/demo.yaml")
	short, _ := contract.Load("../../testdata/contracts/minimal.yaml")
	fmt.Println(full.Resolve(), short.Resolve(), full.Hash() == short.Hash(), full.Hash() == contract.Default().Hash())
	// Output:
	// <nil> <nil> true true
}
