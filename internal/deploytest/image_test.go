//go:build container

package deploytest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/x509"
	"debug/elf"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/trajflow/trajflow/internal/loop"
)

// The container tests (make test-image) build the image with
// deploy/image/build.sh, or use TRAJFLOW_IMAGE, and run it with podman.
var (
	imageOnce sync.Once
	imageTag  string
	imageErr  error
)

func image(t *testing.T) string {
	t.Helper()
	imageOnce.Do(func() {
		if imageTag = os.Getenv("TRAJFLOW_IMAGE"); imageTag != "" {
			return
		}
		cmd := exec.Command("../../deploy/image/build.sh", "localhost/trajflow:test")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			imageErr = fmt.Errorf("deploy/image/build.sh: %v\n%s", err, stderr.String())
			return
		}
		imageTag = strings.TrimSpace(string(out))
	})
	if imageErr != nil {
		t.Fatal(imageErr)
	}
	return imageTag
}

// podmanRunFlags are the flags every `podman run` of the tests needs on
// machines like the development machine (Debian 12, podman 4.3, rootful,
// cgroup v1 with a cgroup v2 hierarchy that has a controller enabled, no
// CAP_SYS_RESOURCE):
//   - --runtime runc: crun 1.8 refuses to start any container there
//     ("cgroups in hybrid mode not supported, drop all controllers from
//     cgroupv2"); TRAJFLOW_OCI_RUNTIME overrides it;
//   - --ulimit nofile and nproc within the hard limits: podman's defaults
//     for root (1048576 files, 4194304 processes) exceed them, and without
//     CAP_SYS_RESOURCE the runtime cannot raise a hard limit ("error setting
//     rlimit type 7: operation not permitted"). podman lowers its own
//     RLIMIT_NPROC to 32768, so a container may ask for at most that.
func podmanRunFlags() []string {
	rt := os.Getenv("TRAJFLOW_OCI_RUNTIME")
	if rt == "" {
		rt = "runc"
	}
	var files, procs syscall.Rlimit
	_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &files)
	_ = syscall.Getrlimit(6 /* RLIMIT_NPROC */, &procs)
	nproc := min(procs.Max, 32768)
	return []string{"--runtime", rt,
		"--ulimit", fmt.Sprintf("nofile=%d:%d", files.Max, files.Max),
		"--ulimit", fmt.Sprintf("nproc=%d:%d", nproc, nproc),
		// The manifests' pod: host network here, read-only root, /tmp an
		// emptyDir, no capabilities, no privilege escalation.
		"--network", "host", "--read-only", "--tmpfs", "/tmp:rw,mode=1777",
		"--cap-drop", "ALL", "--security-opt", "no-new-privileges"}
}

func podman(t testing.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command("podman", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("podman %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// imageFiles reads the image's layers (podman image save --format oci-dir):
// the config, and every file with its tar header and content.
type imageFile struct {
	hdr  *tar.Header
	data []byte
}

func imageLayers(t *testing.T, tag string) (map[string]any, map[string]imageFile) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "oci")
	podman(t, "image", "save", "--format", "oci-dir", "-o", dir, tag)
	blob := func(digest string) []byte {
		b, err := os.ReadFile(filepath.Join(dir, "blobs", strings.Replace(digest, ":", "/", 1)))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	var index struct {
		Manifests []struct{ Digest string } `json:"manifests"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil || json.Unmarshal(b, &index) != nil || len(index.Manifests) != 1 {
		t.Fatalf("index.json: %v %s", err, b)
	}
	var man struct {
		Config struct{ Digest string } `json:"config"`
		Layers []struct {
			MediaType, Digest string
		} `json:"layers"`
	}
	if err := json.Unmarshal(blob(index.Manifests[0].Digest), &man); err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(blob(man.Config.Digest), &cfg); err != nil {
		t.Fatal(err)
	}
	files := map[string]imageFile{}
	for _, l := range man.Layers {
		var r io.Reader = bytes.NewReader(blob(l.Digest))
		if strings.HasSuffix(l.MediaType, "gzip") {
			if r, err = gzip.NewReader(r); err != nil {
				t.Fatal(err)
			}
		}
		tr := tar.NewReader(r)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("layer %s: %v", l.Digest, err)
			}
			data, _ := io.ReadAll(tr)
			files[strings.TrimSuffix(strings.TrimPrefix(h.Name, "./"), "/")] = imageFile{hdr: h, data: data}
		}
	}
	return cfg, files
}

// The image holds the static binary, Debian's CA certificates, the user
// 65532 and the directories it writes, and nothing else; it runs as that
// user.
func TestImageLayers(t *testing.T) {
	cfg, files := imageLayers(t, image(t))
	c, _ := cfg["config"].(map[string]any)
	if c["User"] != "65532:65532" || c["WorkingDir"] != "/home/trajflow" {
		t.Errorf("config User %v WorkingDir %v, want 65532:65532 /home/trajflow", c["User"], c["WorkingDir"])
	}
	if ep, _ := json.Marshal(c["Entrypoint"]); string(ep) != `["/usr/local/bin/trajflow"]` {
		t.Errorf("Entrypoint %s", ep)
	}
	labels, _ := c["Labels"].(map[string]any)
	rev, _ := exec.Command("git", "rev-parse", "HEAD").Output()
	if labels["org.opencontainers.image.title"] != "trajflow" || labels["org.opencontainers.image.revision"] != strings.TrimSpace(string(rev)) {
		t.Errorf("labels %v (revision want %s)", labels, rev)
	}
	ca, _ := exec.Command("dpkg-query", "-W", "-f", "${Version}", "ca-certificates").Output()
	if labels["io.trajflow.ca-certificates"] != string(ca) {
		t.Errorf("label io.trajflow.ca-certificates %v, Debian package %s", labels["io.trajflow.ca-certificates"], ca)
	}

	want := map[string]bool{"usr": true, "usr/local": true, "usr/local/bin": true, "usr/local/bin/trajflow": true,
		"etc": true, "etc/passwd": true, "etc/group": true, "etc/ssl": true, "etc/ssl/certs": true,
		"etc/ssl/certs/ca-certificates.crt": true, "tmp": true, "home": true, "home/trajflow": true,
		"var": true, "var/lib": true, "var/lib/trajflow": true}
	for name, f := range files {
		if !want[name] && !strings.HasPrefix(filepath.Base(name), ".wh.") {
			t.Errorf("unexpected file in the image: %s (mode %o)", name, f.hdr.Mode)
		}
	}
	bin := files["usr/local/bin/trajflow"]
	if bin.hdr == nil || bin.hdr.Typeflag != tar.TypeReg || bin.hdr.Mode&0o777 != 0o755 || bin.hdr.Uid != 0 {
		t.Fatalf("usr/local/bin/trajflow: %+v", bin.hdr)
	}
	ef, err := elf.NewFile(bytes.NewReader(bin.data))
	if err != nil {
		t.Fatalf("trajflow is not ELF: %v", err)
	}
	for _, p := range ef.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("trajflow has a dynamic loader (PT_INTERP): not statically linked")
		}
	}
	if libs, _ := ef.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("trajflow needs shared libraries %v", libs)
	}
	host, err := os.ReadFile("/etc/ssl/certs/ca-certificates.crt")
	if err != nil {
		t.Fatal(err)
	}
	bundle := files["etc/ssl/certs/ca-certificates.crt"].data
	if !bytes.Equal(bundle, host) {
		t.Error("the image's CA bundle differs from Debian's /etc/ssl/certs/ca-certificates.crt")
	}
	n := 0
	for rest := bundle; ; {
		var blk *pem.Block
		if blk, rest = pem.Decode(rest); blk == nil {
			break
		}
		if _, err := x509.ParseCertificate(blk.Bytes); err != nil {
			t.Errorf("certificate %d: %v", n, err)
		}
		n++
	}
	if n < 100 {
		t.Errorf("%d CA certificates", n)
	}
	if !strings.Contains(string(files["etc/passwd"].data), "\ntrajflow:x:65532:65532:") ||
		!strings.Contains(string(files["etc/group"].data), "\ntrajflow:x:65532:") {
		t.Errorf("passwd/group lack user trajflow 65532:\n%s%s", files["etc/passwd"].data, files["etc/group"].data)
	}
	if h := files["tmp"].hdr; h == nil || h.Mode&0o7777 != 0o1777 {
		t.Errorf("/tmp: %+v, want mode 1777", h)
	}
	for _, d := range []string{"home/trajflow", "var/lib/trajflow"} {
		if h := files[d].hdr; h == nil || h.Uid != 65532 || h.Gid != 65532 {
			t.Errorf("%s: %+v, want owner 65532:65532", d, h)
		}
	}
	t.Logf("image %s: %d files, binary %d bytes, %d CA certificates (ca-certificates %s)", image(t), len(files), len(bin.data), n, ca)
}

// `trajflow demo` in the container, read-only root, no capabilities: it
// learns, loses nothing, and what it writes belongs to uid 65532.
func TestImageDemo(t *testing.T) {
	out := t.TempDir()
	if err := os.Chmod(out, 0o777); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"run", "--rm"}, podmanRunFlags()...)
	args = append(args, "-v", out+":/out", image(t), "demo", "--updates", "5", "--out", "/out")
	text := podman(t, args...)
	t.Logf("%s", lastLine(text))
	b, err := os.ReadFile(filepath.Join(out, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	var s loop.Summary
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	if s.Lost != 0 || s.DuplicatesAdmitted != 0 || s.AttemptsLaunched != 5*16*16 || s.Updates == 0 {
		t.Fatalf("demo in the container: launched %d, updates %d, lost %d, duplicates %d", s.AttemptsLaunched, s.Updates, s.Lost, s.DuplicatesAdmitted)
	}
	st, err := os.Stat(filepath.Join(out, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	if sys := st.Sys().(*syscall.Stat_t); sys.Uid != 65532 || sys.Gid != 65532 {
		t.Fatalf("summary.json owned by %d:%d: the container did not run as 65532", sys.Uid, sys.Gid)
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// containerLauncher runs each operator as a container of the image on the
// host network, with the manifests' paths: the instance's data directory
// at /var/lib/trajflow, the shared releases at /var/lib/trajflow/releases,
// the contract at /etc/trajflow/contract.
type containerLauncher struct {
	image, contractDir, releases, prefix string
}

func (l containerLauncher) path(p, _ string) string { return p }

func (l containerLauncher) start(t testing.TB, name string, args []string, dir, logPath string) (*proc, error) {
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cname := l.prefix + name
	run := append([]string{"run", "--rm", "--name", cname}, podmanRunFlags()...)
	run = append(run, "-v", dir+":"+dataDir, "-v", l.releases+":"+releasesDir,
		"-v", l.contractDir+":/etc/trajflow/contract:ro", l.image)
	cmd := exec.Command("podman", append(run, args...)...)
	cmd.Stdout, cmd.Stderr = lf, lf
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("podman run %s: %w", name, err)
	}
	p := &proc{done: make(chan struct{})}
	p.pid = func() int {
		out, err := exec.Command("podman", "inspect", "-f", "{{.State.Pid}}", cname).Output()
		if err != nil {
			return 0
		}
		n, _ := strconv.Atoi(strings.TrimSpace(string(out)))
		return n
	}
	p.term = func() error {
		return exec.Command("podman", "kill", "--signal", "TERM", cname).Run()
	}
	p.kill = func() { _ = exec.Command("podman", "kill", cname).Run() }
	go func() {
		p.err = cmd.Wait()
		lf.Close()
		close(p.done)
	}()
	return p, nil
}

// TestContainerFleet is TestRollingRestart with every operator a container
// of the image on the host network, against the replicated cluster of
// deploy/local/cluster.sh (TRAJFLOW_KAFKA_CLUSTER; make test-image starts
// none: run make cluster-up first).
func TestContainerFleet(t *testing.T) {
	brokers := clusterBrokers(t)
	if brokers == "" {
		t.Fatal("TRAJFLOW_KAFKA_CLUSTER is not set: make cluster-up, then make test-image")
	}
	tag := image(t)
	runID := uniqueRun("containers")
	cdir := filepath.Join(t.TempDir(), "contract")
	writeContract(t, cdir, runID)
	releases := filepath.Join(t.TempDir(), "releases")
	if err := os.MkdirAll(releases, 0o777); err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(releases, 0o777)
	l := containerLauncher{image: tag, contractDir: cdir, releases: releases, prefix: runID + "-"}
	f := newFleet(t, l, baseManifests(t), brokers)
	rollingScenario(t, f, runID, func() {
		args := append([]string{"run", "--rm"}, podmanRunFlags()...)
		args = append(args, "-v", cdir+":/etc/trajflow/contract:ro", tag, "topics", "create", "--brokers", brokers,
			"--contract", contractPath, "--replication-factor", "3", "--min-insync-replicas", "2")
		t.Logf("topics create (container): %s", strings.SplitN(podman(t, args...), "\n", 2)[0])
	})
	// No container of the run is left behind.
	if out := podman(t, "ps", "-a", "--filter", "name="+runID, "-q"); strings.TrimSpace(out) != "" {
		t.Errorf("containers left: %s", out)
	}
}
