package kafka

import (
	"fmt"
	"net"
	"os"
	"syscall"
)

// peerTrusted reports whether the process listening at the other end of
// the Unix connection c runs as this process's user or as root
// (SO_PEERCRED): an abstract socket name is open to every user of the
// network namespace, so another user could bind the name beside a broker
// that has none (Apache Kafka on 127.0.0.1) and receive what trajflow's
// clients send to it. A socket of another user's broker is not used; the
// client connects over TCP, as to any broker of another user.
func peerTrusted(c net.Conn) (bool, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return false, fmt.Errorf("local socket: %T is not a Unix connection", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return false, err
	}
	var cred *syscall.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return false, err
	}
	if serr != nil {
		return false, fmt.Errorf("local socket: peer credentials: %w", serr)
	}
	return cred.Uid == uint32(os.Getuid()) || cred.Uid == 0, nil
}
