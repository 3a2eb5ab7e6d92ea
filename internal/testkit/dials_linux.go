package testkit

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// dialedHere reports whether the accepted connection c was dialed by this
// process: its client end, the socket of /proc/net/tcp (or tcp6) from
// c's remote port to c's local port, is among this process's file
// descriptors. Other processes on the machine (other packages' tests, run
// in parallel by go test) may dial an address that was theirs before it
// was reused here.
func dialedHere(c net.Conn) (bool, error) {
	from, ok1 := c.RemoteAddr().(*net.TCPAddr)
	to, ok2 := c.LocalAddr().(*net.TCPAddr)
	if !ok1 || !ok2 {
		return false, fmt.Errorf("not a TCP connection: %v -> %v", c.RemoteAddr(), c.LocalAddr())
	}
	inode, err := socketInode(from.Port, to.Port)
	if err != nil {
		return false, err
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return false, err
	}
	want := "socket:[" + inode + "]"
	for _, fd := range fds {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && l == want {
			return true, nil
		}
	}
	return false, nil
}

// socketInode is the inode of the open socket from local port to remote
// port (the client end of a connection on this machine).
func socketInode(local, remote int) (string, error) {
	lhex, rhex := fmt.Sprintf(":%04X", local), fmt.Sprintf(":%04X", remote)
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		f, err := os.Open(table)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
			if len(fields) >= 10 && strings.HasSuffix(fields[1], lhex) && strings.HasSuffix(fields[2], rhex) && fields[9] != "0" {
				f.Close()
				if _, err := strconv.ParseUint(fields[9], 10, 64); err != nil {
					return "", fmt.Errorf("%s: inode %q: %w", table, fields[9], err)
				}
				return fields[9], nil
			}
		}
		f.Close()
	}
	return "", fmt.Errorf("no open socket from port %d to port %d in /proc/net/tcp{,6}", local, remote)
}
