package k8s

import (
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/trajflow/trajflow/pipeline/contract"
)

// defaultEnvPort is `trajflow serve env`'s default --port.
const defaultEnvPort = 8642

// server checks a workload serving one end of the run (`trajflow serve
// policy` or `trajflow serve env`): a StatefulSet, because the gateway and
// rollout address each replica by its stable name; listening on the pod's
// address at a fixed port, probed and scraped there; the same resources,
// security and secret rules as the stages. The policy servers read the
// fleet's contract and the releases volume; an environment service keeps
// its episodes on a volume claim template and its capability key in a
// Secret.
func (c *checker) server(w Workload, kind string) {
	ct := w.Pod.Spec.Containers[0]
	spec := w.Pod.Spec
	where := fmt.Sprintf("%s %s (serve %s)", w.Kind, w.Name, kind)
	switch kind {
	case "policy":
		c.loadContract(where, ct, spec.Volumes)
		proto, _ := Flag(ct.Args, "protocol")
		if c.contract != nil && proto != c.contract.Policy.Protocol {
			c.fail("%s: --protocol %q, but the contract's policy.protocol is %q", where, proto, c.contract.Policy.Protocol)
		}
		if _, ok := Flag(ct.Args, "releases"); !ok {
			c.fail("%s: no --releases: the server has no release to load", where)
		}
	case "env":
		dir, ok := Flag(ct.Args, "data")
		switch {
		case !ok:
			c.fail("%s: no --data: the service persists its episodes there", where)
		case !onClaim(dir, ct.VolumeMounts, w.Claims):
			c.fail("%s: --data %s is not on a volume claim template: a restarted pod would lose what it acknowledged", where, dir)
		}
		if _, ok := Flag(ct.Args, "key-file"); !ok {
			c.fail("%s: no --key-file: each pod would make its own capability key, which rollout cannot know", where)
		}
	default:
		c.fail("%s: `trajflow serve %s` is not a served end (policy, env)", where, kind)
		return
	}
	if w.Kind != "StatefulSet" {
		c.fail("%s: replicas are addressed one by one by their stable names: run them as a StatefulSet", where)
	}
	port := c.listen(where, kind, ct, w.Pod.Annotations)
	c.serverProbes(where, kind, ct, port)
	c.governing(where, kind, w)
	c.grace(where, spec)
	c.resources(where, ct)
	c.security(where, spec, ct)
	c.secrets(where, ct, spec.Volumes)
	c.mounts(where, ct, spec.Volumes, w.Claims)
}

// servePort is a server's --port (env: its default when absent); 0 when
// unusable.
func servePort(kind string, ct corev1.Container) (int32, string) {
	p, ok := Flag(ct.Args, "port")
	if !ok {
		if kind == "env" {
			return defaultEnvPort, ""
		}
		return 0, "no --port: the server would listen on a random port"
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 || n > 65535 {
		return 0, fmt.Sprintf("--port %q: want a fixed port", p)
	}
	return int32(n), ""
}

// listen checks --host, --port, the container port and the Prometheus
// scrape annotations; it returns the port (0 when unusable).
func (c *checker) listen(where, kind string, ct corev1.Container, ann map[string]string) int32 {
	if h, _ := Flag(ct.Args, "host"); h != "0.0.0.0" && h != "::" {
		c.fail("%s: --host %q: the server must listen on the pod's address (0.0.0.0), or no other pod reaches it", where, h)
	}
	port, msg := servePort(kind, ct)
	if port == 0 {
		c.fail("%s: %s", where, msg)
		return 0
	}
	if !slices.ContainsFunc(ct.Ports, func(cp corev1.ContainerPort) bool { return cp.ContainerPort == port }) {
		c.fail("%s: --port %d is not a containerPort", where, port)
	}
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != strconv.Itoa(int(port)) || ann["prometheus.io/path"] != "/metrics" {
		c.fail("%s: pod annotations prometheus.io/scrape, port, path = %q, %q, %q; want \"true\", %q, \"/metrics\"", where,
			ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"], strconv.Itoa(int(port)))
	}
	return port
}

// serverProbes: readiness on the end's health path (a policy server is
// ready once a release is loaded: /health of every protocol), liveness on
// a path that answers while the process serves, both on the served port.
func (c *checker) serverProbes(where, kind string, ct corev1.Container, port int32) {
	ready := map[string]string{"policy": "/health", "env": "/healthz"}[kind]
	for _, p := range []struct {
		name, path string
		probe      *corev1.Probe
	}{{"readinessProbe", ready, ct.ReadinessProbe}, {"livenessProbe", "", ct.LivenessProbe}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			c.fail("%s: no %s (httpGet)", where, p.name)
			continue
		}
		g := p.probe.HTTPGet
		if p.path != "" && g.Path != p.path {
			c.fail("%s: %s path %q, want %s", where, p.name, g.Path, p.path)
		}
		if got := resolvePort(g.Port, ct.Ports); port != 0 && got != port {
			c.fail("%s: %s on port %s (%d), but the server listens on %d", where, p.name, g.Port.String(), got, port)
		}
	}
}

// governing checks the StatefulSet's Service: headless (each replica its
// own DNS name, no load balancing, which would hide which replica serves
// which version), selecting its pods; for policy servers it publishes the
// names before the pods are ready, since weight sync loads the first
// release into a replica that is not ready yet.
func (c *checker) governing(where, kind string, w Workload) {
	if w.Kind != "StatefulSet" {
		return
	}
	i := slices.IndexFunc(c.s.Services, func(s *corev1.Service) bool { return s.Name == w.Service })
	if i < 0 {
		c.fail("%s: serviceName %q names no Service of the manifests", where, w.Service)
		return
	}
	svc := c.s.Services[i]
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		c.fail("Service %s (%s): clusterIP %q, want None (headless: one DNS name per replica)", svc.Name, where, svc.Spec.ClusterIP)
	}
	if !matches(svc.Spec.Selector, w.Pod.Labels) {
		c.fail("Service %s (%s): its selector %v does not select the pods", svc.Name, where, svc.Spec.Selector)
	}
	if kind == "policy" && !svc.Spec.PublishNotReadyAddresses {
		c.fail("Service %s (%s): publishNotReadyAddresses false: a replica's name resolves only once it is ready, which it becomes only after weight sync reached it by that name", svc.Name, where)
	}
}

// replicaURLs are the URLs of a server StatefulSet's replicas by their
// stable names (NAME-N.SERVICE:PORT, resolved in the fleet's namespace).
func replicaURLs(kind string, w Workload) []string {
	port, _ := servePort(kind, w.Pod.Spec.Containers[0])
	var out []string
	for i := range w.Replicas {
		host := fmt.Sprintf("%s-%d.%s", w.Name, i, w.Service)
		out = append(out, "http://"+net.JoinHostPort(host, strconv.Itoa(int(port))))
	}
	return out
}

// policyEndpoints: the contract's policy.endpoints are exactly the
// replicas of the policy server StatefulSets, so that no replica idles
// unseen and no endpoint names a pod that does not exist.
func (c *checker) policyEndpoints(servers []Workload) {
	if c.contract == nil || len(servers) == 0 {
		return
	}
	if c.contract.Policy.Protocol == contract.PolicyBuiltin {
		c.fail("%d policy server workloads, but the contract's policy.protocol is builtin: nothing generates on them", len(servers))
		return
	}
	var want []string
	for _, w := range servers {
		if w.Kind == "StatefulSet" {
			want = append(want, replicaURLs("policy", w)...)
		}
	}
	c.sameAddresses("the contract's policy.endpoints", c.contract.Policy.Endpoints, "the policy server replicas", want)
}

// envAddresses: rollout's --env lists exactly the environment service
// replicas, and its --env-key-file comes from the Secret their --key-file
// does.
func (c *checker) envAddresses(envs, rollouts []Workload) {
	if len(envs) == 0 {
		return
	}
	var want []string
	keys := map[string]bool{}
	for _, w := range envs {
		if w.Kind == "StatefulSet" {
			want = append(want, replicaURLs("env", w)...)
		}
		ct := w.Pod.Spec.Containers[0]
		if f, ok := Flag(ct.Args, "key-file"); ok {
			if name, ok := secretOf(f, ct, w.Pod.Spec.Volumes); ok {
				keys[name] = true
			}
		}
	}
	for _, r := range rollouts {
		ct := r.Pod.Spec.Containers[0]
		where := fmt.Sprintf("%s %s (rollout)", r.Kind, r.Name)
		list, ok := Flag(ct.Args, "env")
		if !ok {
			c.fail("%s: no --env, but the manifests run %d environment service workloads: rollout would run its episodes in process", where, len(envs))
			continue
		}
		c.sameAddresses(where+": --env", strings.Split(list, ","), "the environment service replicas", want)
		f, ok := Flag(ct.Args, "env-key-file")
		if !ok {
			c.fail("%s: --env without --env-key-file", where)
			continue
		}
		if name, ok := secretOf(f, ct, r.Pod.Spec.Volumes); ok && !keys[name] {
			c.fail("%s: --env-key-file comes from Secret %s, the services' --key-file from %v: their action tokens would not verify", where, name, keys)
		}
	}
}

// sameAddresses fails unless got and want hold the same URLs (order aside).
func (c *checker) sameAddresses(gotName string, got []string, wantName string, want []string) {
	g, w := slices.Clone(got), slices.Clone(want)
	for i := range g {
		g[i] = strings.TrimRight(strings.TrimSpace(g[i]), "/")
	}
	slices.Sort(g)
	slices.Sort(w)
	if !slices.Equal(g, w) {
		c.fail("%s %v are not %s %v", gotName, g, wantName, w)
	}
}
