package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	kafkago "github.com/segmentio/kafka-go"
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
}

// TrajflowRun returns a Config.Processes that runs each operator as
// `BINARY run STAGE` with the bench's contract file, state directory,
// instance id and wall-clock policies (extra flags appended, e.g.
// --client-config).
func TrajflowRun(binary, contractPath string, partialGroupTimeout, windowMaxWait time.Duration, extra ...string) func(stage, instance, stateDir string, brokers []string) *exec.Cmd {
	return func(stage, instance, stateDir string, brokers []string) *exec.Cmd {
		args := []string{"run", stage, "--brokers", strings.Join(brokers, ","), "--contract", contractPath,
			"--state", stateDir, "--instance", instance, "--health", "127.0.0.1:0",
			"--partial-group-timeout", partialGroupTimeout.String(), "--window-max-wait", windowMaxWait.String(),
			"--log-level", "error", "--restarts", "0"}
		return exec.Command(binary, append(args, extra...)...)
	}
}

// startProc starts (or restarts) p's command.
func (r *run) startProc(p *proc, opErr chan<- error) error {
	cmd := r.cfg.Processes(p.stage, p.id, p.state, r.addr)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
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
			case opErr <- fmt.Errorf("bench: operator process %s exited: %v", p.id, err):
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
// with the same state directory.
func (r *run) killProc(p *proc, opErr chan<- error) (time.Duration, error) {
	t0 := time.Now()
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.killed = true
	p.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
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
