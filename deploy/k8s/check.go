package k8s

import (
	"errors"
	"fmt"
	"net"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/trajflow/trajflow/operators"
	"github.com/trajflow/trajflow/pipeline"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// DefaultDrainTimeout is the default of pipeline.Config.DrainTimeout (the
// runtime sets it when the field is zero; `trajflow run` has no flag for
// it): a graceful stop flushes, waits for every acknowledgement and commits
// within it.
const DefaultDrainTimeout = 30 * time.Second

// Rules are what Check holds the manifests to.
type Rules struct {
	// Stages must each run in exactly one workload (those the fleet's
	// contract needs: operators.Needed).
	Stages []string
	// Stateful stages keep local state (Badger, release or snapshot files):
	// a StatefulSet whose --state (and --snapshot-dir) live on a volume
	// claim template.
	Stateful map[string]bool
	// OneActive stages run exactly one instance: one replica, never
	// autoscaled, never two at once during an update.
	OneActive map[string]bool
	// DrainTimeout must be shorter than terminationGracePeriodSeconds.
	DrainTimeout time.Duration
}

// DefaultRules are the rules of docs/ARCHITECTURE.md ("State and
// scale-out"): advantage, pack and train keep local state, and snapshot
// writes its Parquet files locally; dispatch, pack and train run one active
// instance, and so does snapshot (one directory tree per run).
func DefaultRules() Rules {
	return Rules{
		Stages:       operators.Names(),
		Stateful:     map[string]bool{"advantage": true, "pack": true, "train": true, "snapshot": true},
		OneActive:    map[string]bool{"dispatch": true, "pack": true, "train": true, "snapshot": true, "eval": true, "gate": true},
		DrainTimeout: DefaultDrainTimeout,
	}
}

// Check returns every violation of the rules in s.
func Check(s *Set, r Rules) []error {
	c := &checker{s: s, r: r}
	c.run()
	return c.errs
}

type checker struct {
	s        *Set
	r        Rules
	errs     []error
	contract *contract.Contract
}

func (c *checker) fail(format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf(format, args...))
}

func (c *checker) run() {
	for _, sec := range c.s.Secrets {
		c.fail("Secret %q is in the manifests: credentials are created apart (deploy/README.md) and only referenced", sec.Name)
	}
	byStage := c.s.StageWorkloads()
	for _, w := range c.s.Workloads() {
		c.workload(w) // loads the fleet's contract
	}
	for _, st := range c.r.Stages {
		switch n := len(byStage[st]); {
		case n == 0 && c.contract != nil && !operators.Needed(st, c.contract):
			// e.g. weightsync, for a run whose policy is not on servers
		case n == 0:
			c.fail("stage %s: no Deployment or StatefulSet runs `trajflow run %s`", st, st)
		case c.contract != nil && !operators.Needed(st, c.contract):
			c.fail("stage %s: the contract does not need it (policy.protocol %s): `trajflow run %s` would exit with a configuration error", st, c.contract.Policy.Protocol, st)
		case n > 1:
			c.fail("stage %s: %d workloads run it, want one", st, n)
		}
	}
	for st := range byStage {
		if !slices.Contains(c.r.Stages, st) {
			c.fail("a workload runs `trajflow run %s`: not a registered stage (%v)", st, c.r.Stages)
		}
	}
	for _, j := range c.s.Jobs {
		for _, ct := range j.Spec.Template.Spec.Containers {
			c.secrets("Job "+j.Name, ct, j.Spec.Template.Spec.Volumes)
		}
	}
	servers := c.s.ServerWorkloads()
	c.policyEndpoints(servers["policy"])
	c.envAddresses(servers["env"], byStage["rollout"])
	c.scaledObjects(byStage)
	c.pdbs(byStage)
	c.pdbs(servers)
}

// partitions is how many instances of stage can own a partition: the most
// partitions among the topics it consumes in its group.
func (c *checker) partitions(stage string) int {
	n := 0
	for _, short := range pipeline.InputsOf(stage) {
		info, _ := pipeline.TopicInfoOf(short)
		p := info.Partitions
		if p == 0 && c.contract != nil {
			p = c.contract.Topics.Partitions
		}
		n = max(n, p)
	}
	return n
}

func (c *checker) workload(w Workload) {
	where := w.Kind + " " + w.Name
	spec := w.Pod.Spec
	if len(spec.Containers) != 1 {
		c.fail("%s: %d containers, want one trajflow container", where, len(spec.Containers))
		return
	}
	ct := spec.Containers[0]
	stage := StageOf(ct)
	if stage == "" {
		if kind := ServerOf(ct); kind != "" {
			c.server(w, kind)
			return
		}
		c.fail("%s: its container does not run `trajflow run STAGE` or `trajflow serve policy|env`", where)
		return
	}
	where += " (" + stage + ")"
	c.loadContract(where, ct, spec.Volumes)
	c.kind(where, stage, w)
	c.replicas(where, stage, w)
	port := c.health(where, ct, w.Pod.Annotations)
	c.probes(where, ct, port)
	c.grace(where, spec)
	c.resources(where, ct)
	c.security(where, spec, ct)
	c.secrets(where, ct, spec.Volumes)
	c.mounts(where, ct, spec.Volumes, w.Claims)
}

func (c *checker) kind(where, stage string, w Workload) {
	if c.r.Stateful[stage] {
		if w.Kind != "StatefulSet" {
			c.fail("%s: a stage with local state runs as a StatefulSet with a volume", where)
			return
		}
		args := w.Pod.Spec.Containers[0].Args
		for _, flag := range []string{"state", "snapshot-dir"} {
			dir, ok := Flag(args, flag)
			if !ok {
				if flag == "state" {
					c.fail("%s: no --state: its Badger state would live in a temporary directory", where)
				}
				continue
			}
			if !onClaim(dir, w.Pod.Spec.Containers[0].VolumeMounts, w.Claims) {
				c.fail("%s: --%s %s is not on a volume claim template of the StatefulSet", where, flag, dir)
			}
		}
	} else if w.Kind != "Deployment" {
		c.fail("%s: a stage without local state runs as a Deployment", where)
	}
}

// onClaim reports whether dir lies under a mount of a volume claim template.
func onClaim(dir string, mounts []corev1.VolumeMount, claims []corev1.PersistentVolumeClaim) bool {
	for _, m := range mounts {
		if !under(dir, m.MountPath) {
			continue
		}
		for _, cl := range claims {
			if cl.Name == m.Name {
				return true
			}
		}
	}
	return false
}

func under(p, dir string) bool {
	p, dir = path.Clean(p), path.Clean(dir)
	return p == dir || strings.HasPrefix(p, dir+"/")
}

func (c *checker) replicas(where, stage string, w Workload) {
	if c.r.OneActive[stage] {
		if w.Replicas != 1 {
			c.fail("%s: %d replicas: the stage runs exactly one active instance", where, w.Replicas)
		}
		if w.Surge {
			c.fail("%s: a rolling update with surge would run two instances at once (use strategy Recreate)", where)
		}
		return
	}
	if p := c.partitions(stage); p > 0 && int(w.Replicas) > p {
		c.fail("%s: %d replicas for %d partitions of its input: instances beyond the partitions own nothing", where, w.Replicas, p)
	}
	if w.Replicas < 1 {
		c.fail("%s: %d replicas", where, w.Replicas)
	}
}

// health checks --health and the container port it names, and the
// Prometheus scrape annotations; it returns the port (0 when unusable).
func (c *checker) health(where string, ct corev1.Container, ann map[string]string) int32 {
	addr, ok := Flag(ct.Args, "health")
	if !ok {
		c.fail("%s: no --health address: the operator would serve its probes on a random port", where)
		return 0
	}
	host, p, err := net.SplitHostPort(addr)
	port, perr := strconv.Atoi(p)
	if err != nil || perr != nil || port <= 0 {
		c.fail("%s: --health %q: want HOST:PORT with a fixed port", where, addr)
		return 0
	}
	if host != "" && host != "0.0.0.0" && host != "::" {
		c.fail("%s: --health %s listens on %s only: the kubelet probes the pod's address (use 0.0.0.0)", where, addr, host)
	}
	found := false
	for _, cp := range ct.Ports {
		if cp.ContainerPort == int32(port) {
			found = true
		}
	}
	if !found {
		c.fail("%s: --health port %d is not a containerPort", where, port)
	}
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != strconv.Itoa(port) || ann["prometheus.io/path"] != "/metrics" {
		c.fail("%s: pod annotations prometheus.io/scrape, port, path = %q, %q, %q; want \"true\", %q, \"/metrics\"", where,
			ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"], strconv.Itoa(port))
	}
	return int32(port)
}

func (c *checker) probes(where string, ct corev1.Container, port int32) {
	for _, p := range []struct {
		name, path string
		probe      *corev1.Probe
	}{{"readinessProbe", "/readyz", ct.ReadinessProbe}, {"livenessProbe", "/healthz", ct.LivenessProbe}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			c.fail("%s: no %s (httpGet %s)", where, p.name, p.path)
			continue
		}
		g := p.probe.HTTPGet
		if g.Path != p.path {
			c.fail("%s: %s path %q, want %s", where, p.name, g.Path, p.path)
		}
		if got := resolvePort(g.Port, ct.Ports); port != 0 && got != port {
			c.fail("%s: %s on port %s (%d), but --health serves on %d", where, p.name, g.Port.String(), got, port)
		}
	}
}

func resolvePort(p intstr.IntOrString, ports []corev1.ContainerPort) int32 {
	if p.Type == intstr.Int {
		return p.IntVal
	}
	for _, cp := range ports {
		if cp.Name == p.StrVal {
			return cp.ContainerPort
		}
	}
	return -1
}

func (c *checker) grace(where string, spec corev1.PodSpec) {
	g := int64(30) // the Kubernetes default
	if spec.TerminationGracePeriodSeconds != nil {
		g = *spec.TerminationGracePeriodSeconds
	}
	if time.Duration(g)*time.Second <= c.r.DrainTimeout {
		c.fail("%s: terminationGracePeriodSeconds %d is not longer than the drain timeout %s: the operator is killed mid-drain", where, g, c.r.DrainTimeout)
	}
}

func (c *checker) resources(where string, ct corev1.Container) {
	req, lim := ct.Resources.Requests, ct.Resources.Limits
	if req.Cpu().IsZero() || req.Memory().IsZero() {
		c.fail("%s: no cpu and memory requests", where)
	}
	if lim.Memory().IsZero() {
		c.fail("%s: no memory limit", where)
		return
	}
	if lim.Memory().Cmp(*req.Memory()) < 0 {
		c.fail("%s: memory limit %s below the request %s", where, lim.Memory(), req.Memory())
	}
	var gml string
	for _, e := range ct.Env {
		if e.Name == "GOMEMLIMIT" {
			gml = e.Value
		}
	}
	if gml == "" {
		c.fail("%s: no GOMEMLIMIT: the Go heap may grow to twice the live memory and hit the limit", where)
		return
	}
	b, err := goMemLimit(gml)
	if err != nil {
		c.fail("%s: GOMEMLIMIT %q: %v", where, gml, err)
	} else if b >= lim.Memory().Value() {
		c.fail("%s: GOMEMLIMIT %s is not below the memory limit %s", where, gml, lim.Memory())
	}
}

var goMemRe = regexp.MustCompile(`^([0-9]+)(B|KiB|MiB|GiB|TiB)?$`)

// goMemLimit parses a GOMEMLIMIT value (runtime/debug.SetMemoryLimit units).
func goMemLimit(s string) (int64, error) {
	m := goMemRe.FindStringSubmatch(s)
	if m == nil {
		return 0, errors.New("want an integer with an optional B, KiB, MiB, GiB or TiB suffix")
	}
	n, err := strconv.ParseInt(m[1], 10, 64)
	if err != nil {
		return 0, err
	}
	shift := map[string]uint{"": 0, "B": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}[m[2]]
	return n << shift, nil
}

func (c *checker) security(where string, spec corev1.PodSpec, ct corev1.Container) {
	psc, sc := spec.SecurityContext, ct.SecurityContext
	nonRoot := (psc != nil && psc.RunAsNonRoot != nil && *psc.RunAsNonRoot) || (sc != nil && sc.RunAsNonRoot != nil && *sc.RunAsNonRoot)
	if !nonRoot {
		c.fail("%s: runAsNonRoot is not set", where)
	}
	if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
		c.fail("%s: the container must set allowPrivilegeEscalation false, readOnlyRootFilesystem true and drop ALL capabilities", where)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		c.fail("%s: automountServiceAccountToken must be false (operators never call the Kubernetes API)", where)
	}
}

var secretName = regexp.MustCompile(`(?i)(password|passwd|secret|token|sasl|credential|private|_key$|^key$)`)

// secrets: credentials come from Secret volumes or secretKeyRef, never as
// literal values, and --client-config is a file of a Secret volume.
func (c *checker) secrets(where string, ct corev1.Container, vols []corev1.Volume) {
	for _, e := range ct.Env {
		if e.Value != "" && secretName.MatchString(e.Name) {
			c.fail("%s: env %s has an inline value: reference a Secret (secretKeyRef)", where, e.Name)
		}
		if e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil && secretName.MatchString(e.Name) {
			c.fail("%s: env %s comes from a ConfigMap: credentials belong in a Secret", where, e.Name)
		}
	}
	for _, a := range append(append([]string(nil), ct.Command...), ct.Args...) {
		if strings.Contains(strings.ToLower(a), "password") {
			c.fail("%s: an argument mentions a password (%q): use --client-config from a Secret", where, a)
		}
	}
	for _, flag := range []string{"client-config", "env-key-file", "key-file"} {
		file, ok := Flag(ct.Args, flag)
		if !ok {
			continue
		}
		if _, ok := secretOf(file, ct, vols); !ok {
			c.fail("%s: --%s %s is not a file of a Secret volume", where, flag, file)
		}
	}
}

// secretOf is the name of the Secret whose volume holds file in ct.
func secretOf(file string, ct corev1.Container, vols []corev1.Volume) (string, bool) {
	for _, m := range ct.VolumeMounts {
		if !under(file, m.MountPath) {
			continue
		}
		for _, v := range vols {
			if v.Name == m.Name && v.Secret != nil {
				return v.Secret.SecretName, true
			}
		}
	}
	return "", false
}

func (c *checker) mounts(where string, ct corev1.Container, vols []corev1.Volume, claims []corev1.PersistentVolumeClaim) {
	for _, m := range ct.VolumeMounts {
		ok := slices.ContainsFunc(vols, func(v corev1.Volume) bool { return v.Name == m.Name }) ||
			slices.ContainsFunc(claims, func(cl corev1.PersistentVolumeClaim) bool { return cl.Name == m.Name })
		if !ok {
			c.fail("%s: volumeMount %s names no volume", where, m.Name)
		}
	}
	for _, v := range vols {
		if v.PersistentVolumeClaim == nil {
			continue
		}
		if !slices.ContainsFunc(c.s.PVCs, func(p *corev1.PersistentVolumeClaim) bool { return p.Name == v.PersistentVolumeClaim.ClaimName }) {
			c.fail("%s: volume %s claims %s, which the manifests do not define", where, v.Name, v.PersistentVolumeClaim.ClaimName)
		}
	}
	if _, ok := Flag(ct.Args, "releases"); ok {
		dir, _ := Flag(ct.Args, "releases")
		if !slices.ContainsFunc(ct.VolumeMounts, func(m corev1.VolumeMount) bool { return under(dir, m.MountPath) && m.MountPath != "/tmp" }) {
			c.fail("%s: --releases %s is on no volume", where, dir)
		}
	}
}

// loadContract resolves --contract to a ConfigMap key mounted into the
// container, parses and resolves it, and requires every operator to read
// the same contract.
func (c *checker) loadContract(where string, ct corev1.Container, vols []corev1.Volume) {
	file, ok := Flag(ct.Args, "contract")
	if !ok {
		c.fail("%s: no --contract: it would run the built-in demo contract", where)
		return
	}
	var data string
	found := false
	for _, m := range ct.VolumeMounts {
		if path.Dir(path.Clean(file)) != path.Clean(m.MountPath) {
			continue
		}
		for _, v := range vols {
			if v.Name != m.Name || v.ConfigMap == nil {
				continue
			}
			for _, cm := range c.s.ConfigMaps {
				if cm.Name == v.ConfigMap.Name {
					data, found = cm.Data[path.Base(file)]
				}
			}
		}
	}
	if !found {
		c.fail("%s: --contract %s is not a key of a mounted ConfigMap", where, file)
		return
	}
	k, err := contract.Parse([]byte(data))
	if err == nil {
		err = k.Resolve()
	}
	if err != nil {
		c.fail("%s: contract %s: %v", where, file, err)
		return
	}
	switch {
	case c.contract == nil:
		c.contract = k
	case c.contract.Hash() != k.Hash():
		c.fail("%s: reads contract %s (run %s), another operator reads run %s: one fleet is one run", where, k.Hash(), k.RunID, c.contract.RunID)
	}
}

// kafkaKeys are the kafka scaler's trigger metadata keys (KEDA docs,
// "Apache Kafka" scaler); credentials are not among them: they come from a
// TriggerAuthentication.
var kafkaKeys = map[string]bool{
	"bootstrapServers": true, "bootstrapServersFromEnv": true, "consumerGroup": true, "consumerGroupFromEnv": true,
	"topic": true, "topicFromEnv": true, "lagThreshold": true, "activationLagThreshold": true, "offsetResetPolicy": true,
	"allowIdleConsumers": true, "excludePersistentLag": true, "scaleToZeroOnInvalidOffset": true,
	"limitToPartitionsWithLag": true, "ensureEvenDistributionOfPartitions": true, "version": true,
	"partitionLimitation": true, "tls": true, "sasl": true, "unsafeSsl": true,
}

func (c *checker) scaledObjects(byStage map[string][]Workload) {
	targets := map[string]string{} // "Kind/name" -> stage
	for st, ws := range byStage {
		for _, w := range ws {
			targets[w.Kind+"/"+w.Name] = st
		}
	}
	scaled := map[string]bool{}
	for _, so := range c.s.ScaledObjects {
		where := "ScaledObject " + so.Name
		ref := so.Spec.ScaleTargetRef
		kind := ref.Kind
		if kind == "" {
			kind = "Deployment"
		}
		stage, ok := targets[kind+"/"+ref.Name]
		if !ok {
			c.fail("%s: scales %s %s, which runs no stage", where, kind, ref.Name)
			continue
		}
		where += " (" + stage + ")"
		if scaled[stage] {
			c.fail("%s: a second ScaledObject for the stage", where)
		}
		scaled[stage] = true
		if c.r.OneActive[stage] {
			c.fail("%s: the stage runs exactly one active instance and is never autoscaled", where)
		}
		minR, maxR := int32(1), int32(100) // KEDA's defaults: 0 (scale to zero) and 100
		if so.Spec.MinReplicaCount != nil {
			minR = *so.Spec.MinReplicaCount
		} else {
			minR = 0
		}
		if so.Spec.MaxReplicaCount != nil {
			maxR = *so.Spec.MaxReplicaCount
		}
		if minR > maxR {
			c.fail("%s: minReplicaCount %d > maxReplicaCount %d", where, minR, maxR)
		}
		if p := c.partitions(stage); int(maxR) > p {
			c.fail("%s: maxReplicaCount %d exceeds the %d partitions of its input", where, maxR, p)
		}
		if minR < 1 {
			c.fail("%s: minReplicaCount %d: a stage scaled to zero stops the loop", where, minR)
		}
		c.triggers(where, stage, so)
	}
}

func (c *checker) triggers(where, stage string, so *ScaledObject) {
	if len(so.Spec.Triggers) == 0 {
		c.fail("%s: no trigger", where)
	}
	for i, t := range so.Spec.Triggers {
		tw := fmt.Sprintf("%s trigger %d", where, i)
		if t.Type != "kafka" {
			c.fail("%s: type %q, want kafka (consumer-group lag)", tw, t.Type)
			continue
		}
		for k := range t.Metadata {
			if !kafkaKeys[k] {
				c.fail("%s: metadata key %q is not a kafka scaler setting (credentials go in a TriggerAuthentication)", tw, k)
			}
		}
		if c.contract != nil {
			if g := t.Metadata["consumerGroup"]; g != c.contract.RunID+"."+stage {
				c.fail("%s: consumerGroup %q, want %q (operators.NewOperator: <run>.<stage>)", tw, g, c.contract.RunID+"."+stage)
			}
			topics, _ := pipeline.TopicsFor(c.contract.RunID)
			want := topics.Names(pipeline.InputsOf(stage))
			if tp := t.Metadata["topic"]; !slices.Contains(want, tp) {
				c.fail("%s: topic %q, want the stage's input %v", tw, tp, want)
			}
		}
		if n, err := strconv.Atoi(t.Metadata["lagThreshold"]); err != nil || n <= 0 {
			c.fail("%s: lagThreshold %q: want a positive number of messages", tw, t.Metadata["lagThreshold"])
		}
		if t.Metadata["bootstrapServers"] == "" && t.Metadata["bootstrapServersFromEnv"] == "" {
			c.fail("%s: no bootstrapServers", tw)
		}
		if t.AuthenticationRef != nil {
			if !slices.ContainsFunc(c.s.TriggerAuthentications, func(a *TriggerAuthentication) bool { return a.Name == t.AuthenticationRef.Name }) {
				c.fail("%s: authenticationRef %s names no TriggerAuthentication", tw, t.AuthenticationRef.Name)
			}
		}
	}
	for _, a := range c.s.TriggerAuthentications {
		if len(a.Spec.Env) > 0 {
			c.fail("TriggerAuthentication %s: env parameters; take credentials from a Secret (secretTargetRef)", a.Name)
		}
	}
}

func (c *checker) pdbs(byStage map[string][]Workload) {
	for st, ws := range byStage {
		for _, w := range ws {
			n := 0
			for _, p := range c.s.PDBs {
				if p.Spec.Selector == nil || !matches(p.Spec.Selector.MatchLabels, w.Pod.Labels) {
					continue
				}
				n++
				if p.Spec.MaxUnavailable == nil {
					c.fail("PodDisruptionBudget %s (%s): use maxUnavailable; minAvailable on a one-instance stage blocks every node drain", p.Name, st)
				}
			}
			if n != 1 {
				c.fail("%s %s (%s): %d PodDisruptionBudgets select its pods, want one", w.Kind, w.Name, st, n)
			}
		}
	}
}

func matches(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}
