package k8s

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// kedaModule is the KEDA release whose CRD schemas the ScaledObject and
// TriggerAuthentication manifests are validated against. KEDA's Go API
// types (github.com/kedacore/keda/v2/apis/keda/v1alpha1) live in the main
// module with ~350 requirements (controller-runtime, cloud SDKs) and replace
// directives, so the module is not a dependency: the test fetches it into
// the Go module cache with `go mod download` and reads its CRD files.
const kedaModule = "github.com/kedacore/keda/v2@v2.21.0"

var (
	crdOnce sync.Once
	crds    []CRD
	crdErr  error
)

func kedaCRDs(t *testing.T) []CRD {
	t.Helper()
	crdOnce.Do(func() {
		cmd := exec.Command("go", "mod", "download", "-json", kedaModule)
		cmd.Dir = os.TempDir() // outside this module: go.mod and go.sum stay as they are
		cmd.Env = append(os.Environ(), "GOFLAGS=", "GO111MODULE=on")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			crdErr = errors.New("go mod download " + kedaModule + ": " + err.Error() + ": " + stderr.String() + string(out))
			return
		}
		var mod struct{ Dir, Error string }
		if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
			crdErr = errors.New("go mod download " + kedaModule + ": no module directory: " + mod.Error + string(out))
			return
		}
		for _, f := range []string{"keda.sh_scaledobjects.yaml", "keda.sh_triggerauthentications.yaml"} {
			b, err := os.ReadFile(filepath.Join(mod.Dir, "config", "crd", "bases", f))
			if err != nil {
				crdErr = err
				return
			}
			c, err := ParseCRD(b)
			if err != nil {
				crdErr = err
				return
			}
			crds = append(crds, c...)
		}
	})
	if crdErr != nil {
		t.Fatalf("KEDA CRD schemas: %v", crdErr)
	}
	return crds
}

// load renders dir and decodes it strictly; decoding errors are returned
// with the checker's.
func load(t *testing.T, dir string) (*Set, []error) {
	t.Helper()
	data, err := Render(dir)
	if err != nil {
		return nil, []error{err}
	}
	s, err := Decode(data, kedaCRDs(t))
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	return s, append(errs, Check(s, DefaultRules())...)
}

// The base and both overlays render, decode strictly and hold every
// invariant; every registered stage runs in one workload.
func TestManifests(t *testing.T) {
	for _, tc := range []struct {
		dir           string
		scaledObjects int
		clientConfig  bool
		servers       bool // components/servers: policy and environment on servers
	}{{"base", 0, false, false}, {"overlays/dev", 0, false, false}, {"overlays/production", 4, true, false},
		{"overlays/second-run", 4, true, false}, {"overlays/servers", 0, false, true}} {
		t.Run(tc.dir, func(t *testing.T) {
			s, errs := load(t, tc.dir)
			for _, err := range errs {
				t.Error(err)
			}
			if s == nil {
				return
			}
			by := s.StageWorkloads()
			for _, st := range operators.Names() {
				want := 1
				switch {
				case st == "weightsync" && !tc.servers:
					want = 0 // the manifests' contract runs the built-in policy
				case (st == "eval" || st == "gate") && tc.servers:
					want = 0 // the evaluation plane runs the built-in policy in process
				}
				if len(by[st]) != want {
					t.Errorf("stage %s: %d workloads, want %d", st, len(by[st]), want)
				}
			}
			if len(s.ScaledObjects) != tc.scaledObjects {
				t.Errorf("%d ScaledObjects, want %d", len(s.ScaledObjects), tc.scaledObjects)
			}
			for _, w := range s.Workloads() {
				_, ok := Flag(w.Pod.Spec.Containers[0].Args, "client-config")
				if ok != tc.clientConfig {
					t.Errorf("%s %s: --client-config present %v, want %v", w.Kind, w.Name, ok, tc.clientConfig)
				}
			}
			if len(s.Jobs) != 1 || !slices.Contains(s.Jobs[0].Spec.Template.Spec.Containers[0].Args, "topics") {
				t.Errorf("want the topics Job, got %d Jobs", len(s.Jobs))
			}
		})
	}
}

// overlays/second-run shares the cluster with overlays/production and
// nothing else: another namespace, run id, topic prefix and consumer groups.
func TestSecondRun(t *testing.T) {
	type run struct {
		ns, id string
		groups []string
	}
	read := func(dir string) run {
		s, errs := load(t, dir)
		if len(errs) > 0 {
			t.Fatalf("%s: %v", dir, errs)
		}
		var r run
		for _, cm := range s.ConfigMaps {
			if strings.HasPrefix(cm.Name, "trajflow-contract") {
				c, err := contract.Parse([]byte(cm.Data["contract.yaml"]))
				if err != nil {
					t.Fatal(err)
				}
				r.id, r.ns = c.RunID, cm.Namespace
			}
		}
		for _, so := range s.ScaledObjects {
			r.groups = append(r.groups, so.Spec.Triggers[0].Metadata["consumerGroup"], so.Spec.Triggers[0].Metadata["topic"])
		}
		return r
	}
	a, b := read("overlays/production"), read("overlays/second-run")
	if a.id == b.id || a.ns == b.ns || a.id == "" {
		t.Fatalf("runs %q/%q in namespaces %q/%q", a.id, b.id, a.ns, b.ns)
	}
	for _, g := range b.groups {
		if slices.Contains(a.groups, g) || !strings.HasPrefix(g, b.id+".") {
			t.Errorf("second run's KEDA trigger names %s", g)
		}
	}
}

// Each fixture of testdata/broken breaks one invariant of the production
// or dev overlay; the checker must reject it with the message in its want
// file.
func TestBrokenFixtures(t *testing.T) {
	dirs, err := filepath.Glob("testdata/broken/*")
	if err != nil || len(dirs) < 10 {
		t.Fatalf("fixtures: %v %v", dirs, err)
	}
	for _, dir := range dirs {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			want, err := os.ReadFile(filepath.Join(dir, "want"))
			if err != nil {
				t.Fatal(err)
			}
			_, errs := load(t, dir)
			if len(errs) == 0 {
				t.Fatal("the checker accepted a broken manifest")
			}
			all := errors.Join(errs...).Error()
			for _, w := range strings.Split(strings.TrimSpace(string(want)), "\n") {
				if !strings.Contains(all, w) {
					t.Errorf("no error says %q; errors:\n%s", w, all)
				}
			}
		})
	}
}

// The strict decoder refuses what the API server's strict validation
// refuses: unknown and duplicate fields, wrong types, unknown kinds.
func TestDecodeStrict(t *testing.T) {
	for _, tc := range []struct{ name, doc, want string }{
		{"duplicate field", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {k: v}\ndata: {k: w}\n", "already set"},
		{"wrong type", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\nspec: {replicas: two}\n", "cannot unmarshal"},
		{"unknown kind", "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata: {name: a}\n", "no API type or CRD schema"},
		{"schema type", "apiVersion: keda.sh/v1alpha1\nkind: ScaledObject\nmetadata: {name: a}\nspec: {scaleTargetRef: {name: x}, maxReplicaCount: many, triggers: [{type: kafka, metadata: {}}]}\n", ".spec.maxReplicaCount: want an integer"},
		{"schema required", "apiVersion: keda.sh/v1alpha1\nkind: ScaledObject\nmetadata: {name: a}\nspec: {triggers: [{type: kafka, metadata: {}}]}\n", `required field "scaleTargetRef" is missing`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode([]byte(tc.doc), kedaCRDs(t))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

// The rules are those of docs/ARCHITECTURE.md and the runtime's default
// drain timeout.
func TestRules(t *testing.T) {
	r := DefaultRules()
	if !slices.Equal(r.Stages, operators.Names()) {
		t.Fatalf("stages %v, registry %v", r.Stages, operators.Names())
	}
	for st := range r.Stateful {
		if _, ok := operators.Lookup(st); !ok {
			t.Errorf("stateful stage %s is not registered", st)
		}
	}
	if r.DrainTimeout != 30*time.Second {
		t.Fatalf("drain timeout %s", r.DrainTimeout)
	}
	for _, s := range []string{"1600MiB", "1677721600"} {
		if n, err := goMemLimit(s); err != nil || n != 1600<<20 {
			t.Errorf("GOMEMLIMIT %s = %d, %v", s, n, err)
		}
	}
}
