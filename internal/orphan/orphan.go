// Package orphan keeps a command's process from outliving the process that
// started it. The bench starts helper processes — operators, the peers'
// stages and drivers — that mean nothing without the process that measures
// them: if that one is killed (SIGKILL, the OOM killer), they would go on
// polling a directory or retrying a broker that is gone.
package orphan

import "os/exec"

// DieWithParent asks the kernel to SIGKILL cmd's process when the process
// that started it ends (Linux: PR_SET_PDEATHSIG through
// SysProcAttr.Pdeathsig; elsewhere nothing). Call it before cmd.Start. The
// signal follows the OS thread that started the process, so a goroutine
// that starts one must not be locked to a thread that then exits
// (runtime.LockOSThread).
func DieWithParent(cmd *exec.Cmd) { dieWithParent(cmd) }
