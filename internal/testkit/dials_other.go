//go:build !linux

package testkit

import "net"

// dialedHere counts every connection as this process's where the socket
// tables are not at hand.
func dialedHere(net.Conn) (bool, error) { return true, nil }
