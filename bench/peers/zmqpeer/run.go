package zmqpeer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/trajflow/trajflow/bench"
	"github.com/trajflow/trajflow/bench/peers"
	"github.com/trajflow/trajflow/internal/orphan"
)

// Config configures one run of the peer.
type Config struct {
	// Binary is the trajflow binary: each stage process runs
	// `Binary bench peers-zmq --stage ROLE ...`.
	Binary string
	Corpus string
	// Impl is the ZeroMQ implementation (ImplPure, the default, or
	// ImplLibzmq).
	Impl string
	// Transport is the ZeroMQ transport between the processes:
	// peers.ZmqTCP (the default: tcp://127.0.0.1) or peers.ZmqIPC
	// (ipc://, Unix sockets of Linux's abstract namespace).
	Transport string
	// Duration is the measurement window; Warmup runs before it.
	Duration, Warmup time.Duration
	// InFlight bounds the groups sent and not yet acknowledged (the
	// closed loop).
	InFlight int
	// Kill names the stage SIGKILLed (and restarted) KillAt into the
	// window; "" kills nothing.
	Kill   string
	KillAt time.Duration
	// LossTimeout frees the slot of a group in flight this long (an
	// in-memory hop never says it dropped one); Drain bounds the wait for
	// the groups in flight after the window.
	LossTimeout, Drain time.Duration
}

func (c *Config) defaults() error {
	if c.Duration <= 0 {
		c.Duration = 15 * time.Second
	}
	if c.InFlight <= 0 {
		c.InFlight = 192
	}
	if c.LossTimeout <= 0 {
		c.LossTimeout = 5 * time.Second
	}
	if c.Drain <= 0 {
		c.Drain = 10 * time.Second
	}
	if c.Kill != "" {
		if !slices.Contains(Roles, c.Kill) {
			return fmt.Errorf("zmqpeer: --kill %q: no such stage (have %s)", c.Kill, strings.Join(Roles, ", "))
		}
		if c.KillAt <= 0 {
			c.KillAt = c.Duration / 2
		}
	}
	if c.Impl == "" {
		c.Impl = ImplPure
	}
	if c.Transport == "" {
		c.Transport = peers.ZmqTCP
	}
	if err := peers.CheckZmqTransport(c.Transport); err != nil {
		return fmt.Errorf("zmqpeer: transport %w", err)
	}
	if c.Binary == "" || c.Corpus == "" {
		return errors.New("zmqpeer: Binary and Corpus are required")
	}
	return nil
}

// stageProc is one stage's process, restarted after a kill.
type stageProc struct {
	role, pull, push string
	cmd              *exec.Cmd
	done             chan struct{} // closed when cmd has been waited for
}

// pipelineProcs owns the stage processes and the CPU time of those that
// ended. mu guards each stageProc's cmd and done (a kill replaces them
// while the memory sampler reads them) and deadCPU.
type pipelineProcs struct {
	cfg     *Config
	procs   map[string]*stageProc
	mu      sync.Mutex
	deadCPU time.Duration
}

func (p *pipelineProcs) start(s *stageProc) error {
	cmd := exec.Command(p.cfg.Binary, "bench", "peers-zmq", "--impl", p.cfg.Impl, "--stage", s.role, "--corpus", p.cfg.Corpus,
		"--pull", s.pull, "--push", s.push)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	orphan.DieWithParent(cmd) // a stage without its driver would wait on its socket for ever
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("zmqpeer: start %s: %w", s.role, err)
	}
	done := make(chan struct{})
	p.mu.Lock()
	s.cmd, s.done = cmd, done
	p.mu.Unlock()
	go func() { // owned by p: waited for on done, in stop or kill
		_ = cmd.Wait()
		p.mu.Lock()
		if st := cmd.ProcessState; st != nil {
			p.deadCPU += st.UserTime() + st.SystemTime()
		}
		p.mu.Unlock()
		close(done)
	}()
	return nil
}

// current is the stage's running command and its done channel.
func (p *pipelineProcs) current(s *stageProc) (*exec.Cmd, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return s.cmd, s.done
}

// kill SIGKILLs the stage's process, waits for it and starts it again.
func (p *pipelineProcs) kill(role string) error {
	cmd, done := p.current(p.procs[role])
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
	return p.start(p.procs[role])
}

// stop ends every stage process (SIGTERM, then SIGKILL after 5 s).
func (p *pipelineProcs) stop() {
	for _, s := range p.procs {
		if cmd, _ := p.current(s); cmd != nil {
			_ = cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, s := range p.procs {
		cmd, done := p.current(s)
		if cmd == nil {
			continue
		}
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}
}

// alive is the process ids of this process and of the running stages.
func (p *pipelineProcs) alive() []int {
	pids := []int{os.Getpid()}
	for _, s := range p.procs {
		cmd, done := p.current(s)
		select {
		case <-done:
		default:
			pids = append(pids, cmd.Process.Pid)
		}
	}
	return pids
}

// cpu is the CPU time of this process and of every stage process, running
// or ended.
func (p *pipelineProcs) cpu() time.Duration {
	var t time.Duration
	for _, pid := range p.alive() {
		t += bench.ProcCPU(pid)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return t + p.deadCPU
}

// memoryMB is the sum of the proportional set sizes of this process and
// the running stage processes.
func (p *pipelineProcs) memoryMB() float64 {
	mb := 0.0
	for _, pid := range p.alive() {
		mb += bench.ProcPSSMB(pid)
	}
	return mb
}

// freeAddrs picks k ZeroMQ endpoints of transport: free TCP ports on
// 127.0.0.1 (closed again: a stage binds its own, and a restarted stage
// binds the same one), or abstract Unix socket names of this process.
func freeAddrs(k int, transport string) ([]string, error) {
	if transport == peers.ZmqIPC {
		addrs := make([]string, k)
		for i := range addrs {
			addrs[i] = fmt.Sprintf("ipc://@trajflow-zmq-%d-%d", os.Getpid(), i)
		}
		return addrs, nil
	}
	ports, err := peers.FreePorts(k)
	if err != nil {
		return nil, err
	}
	addrs := make([]string, k)
	for i, p := range ports {
		addrs[i] = "tcp://127.0.0.1:" + strconv.Itoa(p)
	}
	return addrs, nil
}

// Run starts the stage processes, drives the closed loop through them
// (warm-up, window, optional kill, drain) and reports what reached the
// trainer.
func Run(ctx context.Context, cfg Config) (*peers.PeerReport, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	im, err := implOf(cfg.Impl)
	if err != nil {
		return nil, err
	}
	begin := time.Now()
	cp, err := peers.ReadCorpusHops(cfg.Corpus, []int{0}, false)
	if err != nil {
		return nil, err
	}
	if len(cp.Groups) == 0 {
		return nil, errors.New("zmqpeer: the corpus holds no group")
	}
	addrs, err := freeAddrs(len(Roles)+1, cfg.Transport) // the stages' PULL sockets, then the driver's
	if err != nil {
		return nil, err
	}
	var owned sync.WaitGroup // the receiving goroutine, ended by cancel
	defer owned.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	acks, err := im.listen(ctx, addrs[len(Roles)])
	if err != nil {
		return nil, err
	}
	in := make(chan [][]byte, 64)
	owned.Add(1)
	go func() { defer owned.Done(); receive(ctx, acks, in) }() // closes acks
	pp := &pipelineProcs{cfg: &cfg, procs: map[string]*stageProc{}}
	defer pp.stop()
	for i, role := range Roles {
		s := &stageProc{role: role, pull: addrs[i], push: addrs[i+1]}
		pp.procs[role] = s
		if err := pp.start(s); err != nil {
			return nil, err
		}
	}
	push, err := im.dial(ctx, addrs[0])
	if err != nil {
		return nil, err
	}
	defer push.close()

	groupSize := int64(cp.Header.Synth.GroupSize)
	led := newLedger(cp, cfg.InFlight, cfg.LossTimeout)
	rep := &peers.PeerReport{System: SystemName(cfg.Impl), GroupsPerCall: 1, InFlightGroups: cfg.InFlight, CorpusGroups: len(cp.Groups),
		StartupS: time.Since(begin).Seconds()} // the stages are up: the push to validate connected
	send := func() error {
		for led.free() > 0 {
			g, sent := led.launch()
			frames := append([][]byte{groupHeader{group: g, sent: sent}.append(nil)}, cp.Groups[g%int64(len(cp.Groups))].Hops[0]...)
			if err := push.send(frames); err != nil {
				return fmt.Errorf("zmqpeer: send to validate: %w", err)
			}
		}
		return nil
	}
	onAck := func(m [][]byte) error {
		if len(m) != 1 || len(m[0]) < 16 {
			return fmt.Errorf("zmqpeer: an acknowledgement of %d frames, want one of at least 16 bytes", len(m))
		}
		b := m[0]
		recv, size := int64(binary.LittleEndian.Uint64(b)), int64(binary.LittleEndian.Uint64(b[8:]))
		hs, err := readHeaders(b[16:], (len(b)-16)/headerSize)
		if err != nil {
			return err
		}
		led.batch(hs, size, recv)
		return nil
	}
	// step sends what the window allows, then takes the acknowledgements
	// that come within wait.
	step := func(wait time.Duration) error {
		if err := send(); err != nil {
			return err
		}
		timer := time.NewTimer(wait)
		defer timer.Stop()
		for {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case m := <-in:
				if err := onAck(m); err != nil {
					return err
				}
			case <-timer.C:
				led.expire(time.Now().UnixNano())
				return nil
			}
		}
	}

	for end := time.Now().Add(cfg.Warmup); time.Now().Before(end); {
		if err := step(5 * time.Millisecond); err != nil {
			return nil, err
		}
	}
	led.measuring = true
	led.resetWindow()
	t0, cpu0 := time.Now(), pp.cpu()
	var (
		peak     float64
		sampleMu sync.Mutex
		sampled  = make(chan struct{})
	)
	sampleCtx, stopSampling := context.WithCancel(ctx)
	defer func() { stopSampling(); <-sampled }()
	go func() { // owned by Run: ended by stopSampling, waited for on sampled
		defer close(sampled)
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			mb := pp.memoryMB()
			sampleMu.Lock()
			peak = max(peak, mb)
			sampleMu.Unlock()
			select {
			case <-sampleCtx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	killed := false
	for time.Since(t0) < cfg.Duration {
		if cfg.Kill != "" && !killed && time.Since(t0) >= cfg.KillAt {
			killed = true
			at := time.Since(t0)
			k := time.Now()
			if err := pp.kill(cfg.Kill); err != nil {
				return nil, err
			}
			rep.Kill = &peers.PeerKillEvent{Stage: cfg.Kill, AtS: at.Seconds(), RestartS: time.Since(k).Seconds()}
		}
		if err := step(5 * time.Millisecond); err != nil {
			return nil, err
		}
	}
	window := time.Since(t0)
	cpu := pp.cpu() - cpu0
	stopSampling()
	<-sampled
	sampleMu.Lock()
	rep.PeakMB = peak
	sampleMu.Unlock()
	led.measuring = false
	led.summarize(rep, window, cpu)

	// Drain: nothing new; every group in flight arrives or is lost.
	led.lossTimeout = cfg.Drain
	for deadline := time.Now().Add(cfg.Drain); len(led.inflight) > 0 && time.Now().Before(deadline); {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case m := <-in:
			if err := onAck(m); err != nil {
				return nil, err
			}
		case <-time.After(20 * time.Millisecond):
		}
	}
	rep.ProducedGroups, rep.DecidedGroups = led.next, int64(len(led.decided))
	rep.LostGroups = rep.ProducedGroups - rep.DecidedGroups
	rep.LostAttempts = rep.LostGroups * groupSize
	rep.DuplicateGroups, rep.LateGroups = led.duplicates, led.late
	l := peers.LoadAvg()
	rep.LoadAvg = l[:]
	return rep, nil
}
