//go:build !unix

package kafka

// lockDataDir is a no-op where flock is unavailable.
func lockDataDir(string) (func(), error) { return func() {}, nil }
