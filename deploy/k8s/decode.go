// Package k8s renders the Kubernetes manifests of deploy/k8s with kustomize
// (the library `kubectl apply -k` uses), decodes every object strictly into
// the Kubernetes API types (k8s.io/api: an unknown or duplicated field is an
// error; KEDA's ScaledObject and TriggerAuthentication are validated against
// KEDA's published CRD schemas), and checks the invariants a trajflow fleet
// needs (Check). deploy/README.md describes the manifests.
package k8s

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// Render builds the kustomization in dir, as `kubectl kustomize dir` does,
// and returns the objects as one YAML stream.
func Render(dir string) ([]byte, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("k8s: kustomize %s: %w", dir, err)
	}
	out, err := m.AsYaml()
	if err != nil {
		return nil, fmt.Errorf("k8s: kustomize %s: %w", dir, err)
	}
	return out, nil
}

// ScaledObject is the part of a KEDA ScaledObject (keda.sh/v1alpha1) that
// Check reads; the whole object is validated against the CRD schema first.
type ScaledObject struct {
	Name string
	Spec struct {
		ScaleTargetRef struct {
			APIVersion             string `json:"apiVersion"`
			Kind                   string `json:"kind"`
			Name                   string `json:"name"`
			EnvSourceContainerName string `json:"envSourceContainerName"`
		} `json:"scaleTargetRef"`
		MinReplicaCount *int32 `json:"minReplicaCount"`
		MaxReplicaCount *int32 `json:"maxReplicaCount"`
		Triggers        []struct {
			Type              string            `json:"type"`
			Metadata          map[string]string `json:"metadata"`
			AuthenticationRef *struct {
				Name string `json:"name"`
				Kind string `json:"kind"`
			} `json:"authenticationRef"`
		} `json:"triggers"`
	}
}

// TriggerAuthentication is the part of a KEDA TriggerAuthentication that
// Check reads.
type TriggerAuthentication struct {
	Name string
	Spec struct {
		SecretTargetRef []struct {
			Parameter string `json:"parameter"`
			Name      string `json:"name"`
			Key       string `json:"key"`
		} `json:"secretTargetRef"`
		Env []json.RawMessage `json:"env"`
	}
}

// Set is every object of a rendered kustomization, by kind.
type Set struct {
	Namespaces             []*corev1.Namespace
	ServiceAccounts        []*corev1.ServiceAccount
	ConfigMaps             []*corev1.ConfigMap
	Secrets                []*corev1.Secret
	Services               []*corev1.Service
	PVCs                   []*corev1.PersistentVolumeClaim
	Deployments            []*appsv1.Deployment
	StatefulSets           []*appsv1.StatefulSet
	Jobs                   []*batchv1.Job
	PDBs                   []*policyv1.PodDisruptionBudget
	ScaledObjects          []*ScaledObject
	TriggerAuthentications []*TriggerAuthentication
}

// Decode splits a YAML stream into objects and decodes each strictly by its
// apiVersion and kind; crds are the schemas of the custom resources it
// accepts. An object of any other kind is an error, so that every object
// of a manifest is checked.
func Decode(data []byte, crds []CRD) (*Set, error) {
	s := &Set{}
	var errs []error
	for i, doc := range splitDocs(data) {
		if err := s.add(doc, crds); err != nil {
			errs = append(errs, fmt.Errorf("object %d: %w", i+1, err))
		}
	}
	return s, errors.Join(errs...)
}

func splitDocs(data []byte) [][]byte {
	var out [][]byte
	for _, d := range bytes.Split(append([]byte("\n"), data...), []byte("\n---")) {
		if len(bytes.TrimSpace(d)) > 0 {
			out = append(out, d)
		}
	}
	return out
}

func strictInto[T any](doc []byte, list *[]*T) error {
	v := new(T)
	if err := yaml.UnmarshalStrict(doc, v); err != nil {
		return err
	}
	*list = append(*list, v)
	return nil
}

func (s *Set) add(doc []byte, crds []CRD) error {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := yaml.Unmarshal(doc, &head); err != nil {
		return err
	}
	err := s.addTyped(head.APIVersion, head.Kind, doc, crds)
	if err != nil {
		return fmt.Errorf("%s %s %q: %w", head.APIVersion, head.Kind, head.Metadata.Name, err)
	}
	return nil
}

func (s *Set) addTyped(apiVersion, kind string, doc []byte, crds []CRD) error {
	switch apiVersion + " " + kind {
	case "v1 Namespace":
		return strictInto(doc, &s.Namespaces)
	case "v1 ServiceAccount":
		return strictInto(doc, &s.ServiceAccounts)
	case "v1 ConfigMap":
		return strictInto(doc, &s.ConfigMaps)
	case "v1 Secret":
		return strictInto(doc, &s.Secrets)
	case "v1 Service":
		return strictInto(doc, &s.Services)
	case "v1 PersistentVolumeClaim":
		return strictInto(doc, &s.PVCs)
	case "apps/v1 Deployment":
		return strictInto(doc, &s.Deployments)
	case "apps/v1 StatefulSet":
		return strictInto(doc, &s.StatefulSets)
	case "batch/v1 Job":
		return strictInto(doc, &s.Jobs)
	case "policy/v1 PodDisruptionBudget":
		return strictInto(doc, &s.PDBs)
	}
	for _, c := range crds {
		if c.APIVersion() == apiVersion && c.Kind == kind {
			return s.addCustom(c, doc)
		}
	}
	return errors.New("no API type or CRD schema for this kind")
}

func (s *Set) addCustom(c CRD, doc []byte) error {
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	var v any
	if err := json.Unmarshal(js, &v); err != nil {
		return err
	}
	if errs := c.Schema.Validate(v); len(errs) > 0 {
		return fmt.Errorf("not valid for the %s CRD schema: %w", c.Kind, errors.Join(errs...))
	}
	var meta struct {
		Metadata json.RawMessage `json:"metadata"`
	}
	if err := json.Unmarshal(js, &meta); err != nil {
		return err
	}
	var om metav1.ObjectMeta
	if err := yaml.UnmarshalStrict(meta.Metadata, &om); err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	switch c.Kind {
	case "ScaledObject":
		so := &ScaledObject{Name: om.Name}
		if err := unmarshalSpec(js, &so.Spec); err != nil {
			return err
		}
		s.ScaledObjects = append(s.ScaledObjects, so)
	case "TriggerAuthentication":
		ta := &TriggerAuthentication{Name: om.Name}
		if err := unmarshalSpec(js, &ta.Spec); err != nil {
			return err
		}
		s.TriggerAuthentications = append(s.TriggerAuthentications, ta)
	default:
		return fmt.Errorf("custom resource kind %s is not checked", c.Kind)
	}
	return nil
}

func unmarshalSpec(js []byte, spec any) error {
	var doc struct {
		Spec json.RawMessage `json:"spec"`
	}
	if err := json.Unmarshal(js, &doc); err != nil {
		return err
	}
	if err := json.Unmarshal(doc.Spec, spec); err != nil {
		return fmt.Errorf("spec: %w", err)
	}
	return nil
}

// Workload is a Deployment or a StatefulSet running one stage.
type Workload struct {
	Kind     string // Deployment or StatefulSet
	Name     string
	Replicas int32
	// Strategy is the Deployment's strategy type (Recreate or
	// RollingUpdate) or the StatefulSet's update strategy.
	Strategy string
	// Surge is true when a rolling update starts a new pod before it stops
	// an old one (a Deployment's RollingUpdate with maxSurge > 0).
	Surge bool
	Pod   corev1.PodTemplateSpec
	// Claims are the StatefulSet's volume claim templates.
	Claims []corev1.PersistentVolumeClaim
	// Service is the StatefulSet's governing Service (its pods' DNS names
	// are NAME-N.SERVICE).
	Service string
}

// Workloads lists every Deployment and StatefulSet.
func (s *Set) Workloads() []Workload {
	var out []Workload
	for _, d := range s.Deployments {
		w := Workload{Kind: "Deployment", Name: d.Name, Replicas: 1, Strategy: string(d.Spec.Strategy.Type), Pod: d.Spec.Template}
		if d.Spec.Replicas != nil {
			w.Replicas = *d.Spec.Replicas
		}
		if w.Strategy == "" {
			w.Strategy = string(appsv1.RollingUpdateDeploymentStrategyType)
		}
		if w.Strategy == string(appsv1.RollingUpdateDeploymentStrategyType) {
			w.Surge = true // the default maxSurge is 25%, at least one pod
			if ru := d.Spec.Strategy.RollingUpdate; ru != nil && ru.MaxSurge != nil && ru.MaxSurge.String() == "0" {
				w.Surge = false
			}
		}
		out = append(out, w)
	}
	for _, st := range s.StatefulSets {
		w := Workload{Kind: "StatefulSet", Name: st.Name, Replicas: 1, Strategy: string(st.Spec.UpdateStrategy.Type), Pod: st.Spec.Template,
			Claims: st.Spec.VolumeClaimTemplates, Service: st.Spec.ServiceName}
		if st.Spec.Replicas != nil {
			w.Replicas = *st.Spec.Replicas
		}
		if w.Strategy == "" {
			w.Strategy = string(appsv1.RollingUpdateStatefulSetStrategyType)
		}
		out = append(out, w)
	}
	return out
}

// StageOf is the stage a container runs (`trajflow run STAGE ...`), or "".
func StageOf(c corev1.Container) string { return subcommand(c, "run") }

// ServerOf is the end a container serves (`trajflow serve KIND ...`:
// policy or env), or "".
func ServerOf(c corev1.Container) string { return subcommand(c, "serve") }

// subcommand is X of `trajflow VERB X ...` in a container, or "".
func subcommand(c corev1.Container, verb string) string {
	args := append(append([]string(nil), c.Command...), c.Args...)
	if len(args) > 0 && strings.HasSuffix(args[0], "trajflow") {
		args = args[1:]
	}
	if len(args) >= 2 && args[0] == verb {
		return args[1]
	}
	return ""
}

// Flag returns the value of --name in args ("--name V" or "--name=V").
func Flag(args []string, name string) (string, bool) {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
		if v, ok := strings.CutPrefix(a, "-"+name+"="); ok {
			return v, true
		}
		if (a == "--"+name || a == "-"+name) && i+1 < len(args) {
			return args[i+1], true
		}
	}
	return "", false
}

// StageWorkloads maps each stage to the workloads whose containers run it.
func (s *Set) StageWorkloads() map[string][]Workload { return s.workloadsBy(StageOf) }

// ServerWorkloads maps each served end (policy, env) to the workloads
// whose containers serve it.
func (s *Set) ServerWorkloads() map[string][]Workload { return s.workloadsBy(ServerOf) }

func (s *Set) workloadsBy(key func(corev1.Container) string) map[string][]Workload {
	out := map[string][]Workload{}
	for _, w := range s.Workloads() {
		for _, c := range w.Pod.Spec.Containers {
			if k := key(c); k != "" {
				out[k] = append(out[k], w)
			}
		}
	}
	return out
}
