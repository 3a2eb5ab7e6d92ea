package main

import (
	"strings"
	"testing"
)

// TestBrokerFlagsRefused: a port out of range, a log level, a host or a
// size the broker cannot take, a data directory that is a file and a
// stray argument exit 2 at once naming the flag; no broker starts.
func TestBrokerFlagsRefused(t *testing.T) {
	file, _ := testFile(t)
	for _, c := range []refusalCase{
		{[]string{"--port", "-1"}, []string{"--port -1"}},
		{[]string{"--port", "70000"}, []string{"--port 70000"}},
		{[]string{"--log-level", "bogus"}, []string{`--log-level "bogus"`}},
		{[]string{"--retention-bytes", "-5"}, []string{"--retention-bytes -5"}},
		{[]string{"--max-message-bytes", "-1"}, []string{"--max-message-bytes -1"}},
		{[]string{"--host", "localhost"}, []string{`--host "localhost"`, "concrete IP"}},
		{[]string{"--host", ""}, []string{`--host ""`}},
		{[]string{"--data", file}, []string{"--data", "not a directory"}},
		{[]string{"extra"}, []string{"no arguments", "extra"}},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			wantRefused(t, append([]string{"broker", "--port", "0"}, c.args...), c.want...)
		})
	}
}
