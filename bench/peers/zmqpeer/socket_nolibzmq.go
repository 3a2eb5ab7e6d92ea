//go:build !libzmq

package zmqpeer

// LibzmqBuilt reports whether libzmq is compiled into this binary (build
// tag libzmq).
const LibzmqBuilt = false
