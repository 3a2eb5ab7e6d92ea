//go:build unix

package llamatest

import (
	"os/exec"
	"syscall"
)

// The server runs in its own process group so that a kill reaches the
// router's child processes too.
func setProcessGroup(c *exec.Cmd) { c.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} }

func terminate(c *exec.Cmd) { c.Process.Signal(syscall.SIGTERM) }

func killGroup(c *exec.Cmd) {
	syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
	c.Process.Kill()
}
