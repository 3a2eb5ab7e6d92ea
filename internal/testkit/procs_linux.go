package testkit

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// procStat is the fields of /proc/PID/stat after the command name (state,
// ppid, ...), or nil when pid is gone. The name is in parentheses and may
// hold spaces and parentheses itself, so the fields start after the last
// ')'.
func procStat(pid string) []string {
	b, err := os.ReadFile(filepath.Join("/proc", pid, "stat"))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

// Running reports whether the process pid has not exited (Linux, from
// /proc; a zombie waiting to be reaped counts as exited).
func Running(pid int) bool {
	f := procStat(strconv.Itoa(pid))
	return len(f) > 0 && f[0] != "Z"
}

// Children lists the running processes whose parent is pid (Linux, from
// /proc).
func Children(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	parent := strconv.Itoa(pid)
	var out []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if f := procStat(e.Name()); len(f) > 1 && f[0] != "Z" && f[1] == parent {
			out = append(out, p)
		}
	}
	return out
}
