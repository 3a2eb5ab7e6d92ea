package operators

import (
	"strings"
	"testing"
)

// TestDeviceNames: the device names the train stage accepts.
func TestDeviceNames(t *testing.T) {
	for _, tc := range []struct {
		in      string
		cuda    bool
		ordinal int
	}{{"", false, -1}, {"cpu", false, -1}, {"cuda", true, 0}, {"cuda:0", true, 0}, {"cuda:3", true, 3}} {
		c, n, err := parseDevice(tc.in)
		if err != nil || c != tc.cuda || n != tc.ordinal {
			t.Errorf("%q: cuda %v ordinal %d err %v", tc.in, c, n, err)
		}
	}
	for _, bad := range []string{"gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "cuda0"} {
		if _, _, err := parseDevice(bad); err == nil || !strings.Contains(err.Error(), "--device") {
			t.Errorf("%q: %v", bad, err)
		}
		if _, err := Backend(bad); err == nil {
			t.Errorf("Backend(%q) accepted", bad)
		}
	}
	if f, err := Backend("cpu"); err != nil || f == nil {
		t.Fatalf("cpu: %v", err)
	}
}
