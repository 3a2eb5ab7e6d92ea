// Package policy holds what trajflow's network policy clients share: the
// infrastructure error every server or network failure becomes
// (InfraError, with a reason and the server's address), the identity of a
// server (Identity, hashed into sampler ids), the version requirement of a
// request (Want), the Client interface the protocol clients (llamacpp,
// sglang, vllm) implement beside rollout.Policy, the JSON call (Conn), and
// the validation of every generation a server returns (Check).
//
// See README.md in this directory for the protocols, what is sent, how
// log-probs are made exact, the error reasons and the gateway's policies.
package policy
