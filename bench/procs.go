package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/trajflow/trajflow/internal/orphan"
	"github.com/trajflow/trajflow/pipeline"
)

// KillReport is what Config.Kill did: the stage instance killed (SIGKILL)
// once, when, and how long its restart took to be running again.
type KillReport struct {
	Stage    string  `json:"stage"`
	Instance string  `json:"instance"`
	AtS      float64 `json:"at_s"` // into the measurement window
	// DownS is from the SIGKILL to the restarted process running.
	DownS float64 `json:"down_s"`
}

// proc is one operator running as a child process (Config.Processes).
type proc struct {
	stage, id, state string
	mu               sync.Mutex
	cmd              *exec.Cmd
	done             chan struct{}
	killed           bool
	err              error
	// health is the address of the running process's /metrics, read from
	// its standard output (empty until it has printed it); last is what
	// was read there most recently, and base the counters of the process's
	// earlier lives (a restarted process counts from zero).
	health     string
	last, base instanceStats
}

// TrajflowRun returns a Config.Processes that runs each operator as
// `BINARY run STAGE` with the bench's contract file, state directory,
// instance id and wall-clock policies (extra flags appended, e.g.
// --client-config).
func TrajflowRun(binary, contractPath string, partialGroupTimeout, windowMaxWait time.Duration, extra ...string) func(stage, instance, stateDir string, brokers []string) *exec.Cmd {
	return func(stage, instance, stateDir string, brokers []string) *exec.Cmd {
		args := []string{"run", stage, "--brokers", strings.Join(brokers, ","), "--contract", contractPath,
			"--state", stateDir, "--instance", instance, "--health", "127.0.0.1:0",
			"--log-level", "error", "--restarts", "0"}
		// Each stage is given the flags it reads (trajflow run refuses a
		// flag of another stage).
		switch stage {
		case "advantage":
			args = append(args, "--partial-group-timeout", partialGroupTimeout.String())
		case "pack":
			args = append(args, "--window-max-wait", windowMaxWait.String())
		}
		return exec.Command(binary, append(args, extra...)...)
	}
}

// startProc starts (or restarts) p's command.
func (r *run) startProc(p *proc, opErr chan<- error) error {
	cmd := r.cfg.Processes(p.stage, p.id, p.state, r.addr)
	cmd.Stdout, cmd.Stderr = &stdoutWatch{p: p, w: os.Stderr}, os.Stderr
	orphan.DieWithParent(cmd) // the operators of a bench run end with it, killed or not
	// Their own process group: a Ctrl-C at the terminal reaches the bench
	// alone, which stops each operator with one signal.
	cmd.SysProcAttr.Setpgid = true
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("bench: start %s: %w", p.id, err)
	}
	done := make(chan struct{})
	p.mu.Lock()
	p.cmd, p.done, p.killed = cmd, done, false
	p.mu.Unlock()
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		killed := p.killed
		p.err = err
		p.mu.Unlock()
		close(done)
		if !killed {
			select {
			case opErr <- fmt.Errorf("bench: operator process %s exited: %w", p.id, err):
			default:
			}
		}
	}()
	return nil
}

// stopProc ends p gracefully (SIGTERM; SIGKILL after 30 s).
func stopProc(p *proc) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.killed = true
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// killProc sends SIGKILL to p, waits for it to die, and starts it again
// with the same state directory. p's counters are read just before the
// kill and carried over to the new process's.
func (r *run) killProc(ctx context.Context, p *proc, opErr chan<- error) (time.Duration, error) {
	p.counters(ctx)
	t0 := time.Now()
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.killed = true
	p.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
	p.mu.Lock()
	p.base, p.last, p.health = p.base.add(p.last), instanceStats{}, ""
	p.mu.Unlock()
	if err := r.startProc(p, opErr); err != nil {
		return 0, err
	}
	return time.Since(t0), nil
}

// cpu is the CPU time the bench's figures count: this process, the
// operator processes (Config.Processes) and Config.CPUPids.
func (r *run) cpu() time.Duration {
	t := processCPU()
	if len(r.procs) > 0 {
		t += r.childrenCPU()
	}
	for _, pid := range r.cfg.CPUPids {
		t += ProcCPU(pid)
	}
	return t
}

// childrenCPU is the CPU time of the operator processes: those that
// exited (reaped: RUSAGE_CHILDREN) and those running (/proc).
func (r *run) childrenCPU() time.Duration {
	var ru syscall.Rusage
	var total time.Duration
	if err := syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru); err == nil {
		total = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	for _, p := range r.procs {
		p.mu.Lock()
		cmd := p.cmd
		p.mu.Unlock()
		if cmd != nil && cmd.Process != nil {
			total += ProcCPU(cmd.Process.Pid)
		}
	}
	return total
}

// procsPSSMB is the memory of the running operator processes, summed as
// proportional set sizes (ProcPSSMB): the pages they share with each other
// and with this process, the binary's among them, count once.
func (r *run) procsPSSMB() float64 {
	var mb float64
	for _, p := range r.procs {
		p.mu.Lock()
		cmd := p.cmd
		p.mu.Unlock()
		if cmd != nil && cmd.Process != nil {
			mb += ProcPSSMB(cmd.Process.Pid)
		}
	}
	return mb
}

// ProcPSSMB is a process's proportional set size in MB, Pss of
// /proc/PID/smaps_rollup: its resident pages, each shared one divided by
// the number of processes that map it, so that a sum over processes counts
// every page once (0 when it cannot be read).
func ProcPSSMB(pid int) float64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return 0
	}
	return fieldMB(string(b), "Pss:")
}

// ProcCPU is a running process's user+system time from /proc/PID/stat
// (0 when it cannot be read).
func ProcCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// The command name (field 2) may hold spaces: fields after the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * (time.Second / 100) // USER_HZ is 100 on Linux
}

// waitPolicyRead waits until the pack consumer group has committed an
// offset on the policy topic: the pack process has read the release.
func (r *run) waitPolicyRead(ctx context.Context, opErr <-chan error) error {
	cl := &kafkago.Client{Addr: kafkago.TCP(r.addr...), Transport: r.trans(), Timeout: 10 * time.Second}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := cl.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: r.runID + ".pack", Topics: map[string][]int{r.topics.Policy: {0}}})
		if err == nil {
			for _, ps := range resp.Topics[r.topics.Policy] {
				if ps.CommittedOffset > 0 {
					return nil
				}
			}
		}
		select {
		case err := <-opErr:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return errors.New("bench: the pack process did not read the policy release within 60s")
}

// ParsePids parses comma-separated process ids.
func ParsePids(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		pid, err := strconv.Atoi(f)
		if err != nil || pid <= 0 {
			return nil, fmt.Errorf("%q: want a process id", f)
		}
		out = append(out, pid)
	}
	return out, nil
}

// stdoutWatch forwards an operator process's standard output to w and
// records, from the line `trajflow run` prints (pipeline.HealthLine), the
// address of its /metrics. A process that prints no such line (a Config.Processes of
// another command) leaves its stage's rows empty.
type stdoutWatch struct {
	p    *proc
	w    io.Writer
	line []byte
}

func (s *stdoutWatch) Write(b []byte) (int, error) {
	rest := b
	for len(rest) > 0 {
		i := bytes.IndexByte(rest, '\n')
		if i < 0 {
			if len(s.line) < 4096 {
				s.line = append(s.line, rest...)
			}
			break
		}
		s.line = append(s.line, rest[:i]...)
		if addr, ok := pipeline.HealthAddrOf(string(s.line)); ok {
			s.p.mu.Lock()
			s.p.health = addr
			s.p.mu.Unlock()
		}
		s.line, rest = s.line[:0], rest[i+1:]
	}
	return s.w.Write(b)
}

// counters reads p's /metrics and CPU time and returns the counters of
// all its lives so far. When the read fails (the process is starting or
// just died) the last counters read stand in for the current ones.
func (p *proc) counters(ctx context.Context) instanceStats {
	p.mu.Lock()
	addr, cmd := p.health, p.cmd
	p.mu.Unlock()
	var cur instanceStats
	read := addr != ""
	if read {
		var err error
		cur, err = operatorCounters(ctx, addr)
		read = err == nil
	}
	var cpu time.Duration
	if cmd != nil && cmd.Process != nil {
		cpu = ProcCPU(cmd.Process.Pid)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == cmd { // the process read is still p's current one
		if read {
			cur.cpuNanos, p.last = p.last.cpuNanos, cur
		}
		if cpu > 0 {
			p.last.cpuNanos = int64(cpu)
		}
	}
	return p.base.add(p.last)
}

// scrapeClient reads the operators' /metrics on 127.0.0.1; without
// keep-alives no connection outlives its read.
var scrapeClient = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

// operatorCounters reads the counters of an operator process's /metrics
// at addr that a stage's row needs.
func operatorCounters(ctx context.Context, addr string) (instanceStats, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return instanceStats{}, err
	}
	resp, err := scrapeClient.Do(req)
	if err != nil {
		return instanceStats{}, fmt.Errorf("bench: read metrics of %s: %w", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return instanceStats{}, fmt.Errorf("bench: read metrics of %s: %s", addr, resp.Status)
	}
	s, err := parseCounters(resp.Body)
	if err != nil {
		return instanceStats{}, fmt.Errorf("bench: metrics of %s: %w", addr, err)
	}
	return s, nil
}

// parseCounters reads, from Prometheus text exposition, the operator
// counters a stage's row is made of, summed over their series: records
// and value bytes consumed (trajflow_records_in_total,
// trajflow_in_bytes_total), bytes produced (trajflow_out_bytes_total) and
// the time in the stage's code (trajflow_stage_busy_seconds_total). Rows
// and tokens are not among them: the process's rows leave them empty.
func parseCounters(r io.Reader) (instanceStats, error) {
	var s instanceStats
	seen := 0
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		i := strings.IndexAny(line, "{ ")
		if i <= 0 || line[0] == '#' {
			continue
		}
		var dst *int64
		scale := 1.0
		switch line[:i] {
		case "trajflow_records_in_total":
			dst = &s.msgs
		case "trajflow_in_bytes_total":
			dst = &s.bytesIn
		case "trajflow_out_bytes_total":
			dst = &s.bytesOut
		case "trajflow_stage_busy_seconds_total":
			dst, scale = &s.procNanos, 1e9
		default:
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil || !(v >= 0 && v*scale < 1<<62) {
			return instanceStats{}, fmt.Errorf("counter line %q: not a count", line)
		}
		n := int64(v * scale)
		if *dst > math.MaxInt64-n {
			return instanceStats{}, fmt.Errorf("counter %s: sum out of range", line[:i])
		}
		*dst += n
		seen++
	}
	if err := sc.Err(); err != nil {
		return instanceStats{}, err
	}
	if seen == 0 {
		return instanceStats{}, errors.New("no trajflow operator counters")
	}
	return s, nil
}
