package peers

import (
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestFreePorts(t *testing.T) {
	ports, err := FreePorts(5)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if p <= 0 || p > 65535 || seen[p] {
			t.Fatalf("ports %v: %d is not a distinct port", ports, p)
		}
		seen[p] = true
		// Closed again: the caller's processes can bind every one.
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Fatalf("port %d not free after FreePorts: %v", p, err)
		}
		l.Close()
	}
}

func TestStartLocalKafkaNoScript(t *testing.T) {
	_, err := StartLocalKafka(t.Context(), "/nonexistent/kafka.sh", t.TempDir(), nil)
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/kafka.sh") {
		t.Fatalf("err %v, want one naming the script", err)
	}
}

// TestWarmRuns: a warm-up is split into runs of at most warmRunMax (30 s),
// so the broker's disk holds one short run's log at a time.
func TestWarmRuns(t *testing.T) {
	s := time.Second
	for _, c := range []struct {
		total time.Duration
		want  []time.Duration
	}{
		{0, nil},
		{2 * s, []time.Duration{2 * s}},
		{30 * s, []time.Duration{30 * s}},
		{35 * s, []time.Duration{30 * s, 5 * s}},
		{90 * s, []time.Duration{30 * s, 30 * s, 30 * s}},
	} {
		if got := warmRuns(c.total); !slices.Equal(got, c.want) {
			t.Errorf("warmRuns(%s) = %v, want %v", c.total, got, c.want)
		}
	}
}
