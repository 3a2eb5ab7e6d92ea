//go:build !unix

package llamatest

import "os/exec"

func setProcessGroup(*exec.Cmd) {}

func terminate(c *exec.Cmd) { c.Process.Kill() }

func killGroup(c *exec.Cmd) { c.Process.Kill() }
