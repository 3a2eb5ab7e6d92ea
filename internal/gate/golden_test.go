package gate

import (
	"os"
	"testing"

	"gopkg.in/yaml.v3"
)

// TestGoldenStatistics checks every hand-computed case of
// testdata/gate/statistics.yaml (inputs beside outputs).
func TestGoldenStatistics(t *testing.T) {
	b, err := os.ReadFile("../../testdata/gate/statistics.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Wilson []struct {
			K, N   int
			Z      float64
			Lo, Hi float64
			How    string
		}
		PassAtK []struct {
			N, C, K int
			Want    float64
			How     string
		} `yaml:"pass_at_k"`
		K3 []struct {
			Logr, Want float64
			How        string
		}
	}
	if err := yaml.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Wilson) == 0 || len(g.PassAtK) == 0 || len(g.K3) == 0 {
		t.Fatalf("golden file has %d wilson, %d pass@k, %d k3 cases", len(g.Wilson), len(g.PassAtK), len(g.K3))
	}
	for _, c := range g.Wilson {
		lo, hi, err := Wilson(c.K, c.N, c.Z)
		if err != nil || !near(lo, c.Lo, 2e-6) || !near(hi, c.Hi, 2e-6) {
			t.Errorf("Wilson(%d, %d, %v) = [%.6f, %.6f] %v, want [%v, %v] (%s)", c.K, c.N, c.Z, lo, hi, err, c.Lo, c.Hi, c.How)
		}
	}
	for _, c := range g.PassAtK {
		got, err := PassAtK(c.N, c.C, c.K)
		if err != nil || !near(got, c.Want, 1e-6) {
			t.Errorf("PassAtK(%d, %d, %d) = %v %v, want %v (%s)", c.N, c.C, c.K, got, err, c.Want, c.How)
		}
	}
	for _, c := range g.K3 {
		if got := K3(c.Logr); !near(got, c.Want, 1e-6) {
			t.Errorf("K3(%v) = %v, want %v (%s)", c.Logr, got, c.Want, c.How)
		}
	}
}
