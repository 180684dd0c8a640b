// Package sockdiag looks one TCP socket up by its addresses with the kernel's sock_diag (linux/inet_diag.h),
// which x/sys/unix and vishvananda/netlink do not offer for one socket with its cgroup.
package sockdiag

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// The kernel's sock_diag request and reply for one socket (linux/inet_diag.h), which x/sys/unix lacks.
const (
	sizeofNlMsghdr     = 16
	sizeofInetDiagReq  = 56 // struct inet_diag_req_v2
	sizeofInetDiagMsg  = 72 // struct inet_diag_msg
	inetDiagInfo       = 2  // INET_DIAG_INFO: struct tcp_info
	inetDiagCgroupID   = 21 // INET_DIAG_CGROUP_ID: u64, the cgroup v2 id of the socket (Linux 5.7+)
	inetDiagNoCookie   = 0xffffffff
	diagMsgRQueueAt    = 56 // idiag_rqueue in inet_diag_msg: rcv_nxt - copied_seq for an established socket
	diagMsgUIDAt       = 64 // idiag_uid: the socket's owner
	diagMsgInodeAt     = 68 // idiag_inode: the socket's inode, as /proc/PID/fd links name it ("socket:[N]")
	diagReplyBufferLen = 4096
)

// Socket is what sock_diag says of one established TCP socket. Of a socket in TIME_WAIT the kernel keeps
// its addresses and state only: State is all there is (TimeWait).
type Socket struct {
	// Received is how many bytes the socket has received in order (tcpi_bytes_received: rcv_nxt minus
	// its value when the socket was created or restored), Unread how many of them the application has not
	// read yet.
	Received uint64
	Unread   int
	// CgroupID is the cgroup v2 id (the directory's inode number) of the socket: the cgroup its creator was
	// in when it created it, the one the sender-side log's program reads from each segment. 0 if the kernel
	// gave none.
	CgroupID uint64
	// UID is the socket's owner (the creator's file-system uid) and Inode its inode number, by which
	// /proc/PID/fd names it (internal/sockowner finds the processes holding it).
	UID, Inode uint32
	// State is the socket's TCP state (TCP_ESTABLISHED, TCP_CLOSE_WAIT, ... as in include/net/tcp_states.h).
	State uint8
}

// TCP states (include/net/tcp_states.h) that follow the peer's FIN.
const (
	stateTimeWait  = 6
	stateCloseWait = 8
	stateLastAck   = 9
	stateClosing   = 11
)

// TimeWait says the socket is in TIME_WAIT, where sock_diag gives nothing but its state.
func (s Socket) TimeWait() bool { return s.State == stateTimeWait }

// FinReceived says the socket has taken in its peer's FIN (Received does not count it).
func (s Socket) FinReceived() bool {
	switch s.State {
	case stateCloseWait, stateLastAck, stateClosing, stateTimeWait:
		return true
	}
	return false
}

// Lookup returns what sock_diag says of the IPv4 TCP socket conn (conn.Local its local end) in the calling
// thread's network namespace. It asks for that one socket by its addresses: a dump of every socket of the
// namespace took about 5 ms on a lab host, twice per injection of a receive-order replay (a LAMMPS rank's
// 2,000 calls took 24 s, nearly all of it in those dumps). A socket that does not exist is ErrNoSocket.
func Lookup(conn tcpflow.Tuple) (Socket, error) {
	conn = conn.Unmap()
	if !conn.Local.Addr().Is4() || !conn.Remote.Addr().Is4() {
		return Socket{}, fmt.Errorf("sock_diag %s: IPv4 only", conn)
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_INET_DIAG)
	if err != nil {
		return Socket{}, fmt.Errorf("sock_diag: netlink socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Sendto(fd, diagRequest(conn), 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return Socket{}, fmt.Errorf("sock_diag %s: send: %w", conn, err)
	}
	buf := make([]byte, diagReplyBufferLen)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return Socket{}, fmt.Errorf("sock_diag %s: receive: %w", conn, err)
	}
	s, err := parseDiagReply(buf[:n], conn)
	if err != nil {
		return Socket{}, fmt.Errorf("sock_diag %s: %w", conn, err)
	}
	return s, nil
}

// diagRequest is the netlink message that asks for conn's socket with its tcp_info.
func diagRequest(conn tcpflow.Tuple) []byte {
	b := make([]byte, sizeofNlMsghdr+sizeofInetDiagReq)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], uint32(len(b)))
	ne.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST) // not a dump: the kernel looks the one socket up
	ne.PutUint32(b[8:], 1)
	r := b[sizeofNlMsghdr:]
	r[0], r[1], r[2] = unix.AF_INET, unix.IPPROTO_TCP, 1<<(inetDiagInfo-1)
	ne.PutUint32(r[4:], 0xffffffff) // every state
	id := r[8:]
	putSockID(id, conn)
	ne.PutUint32(id[40:], inetDiagNoCookie)
	ne.PutUint32(id[44:], inetDiagNoCookie)
	return b
}

// putSockID writes conn's ports and addresses into a struct inet_diag_sockid (network byte order) at id.
func putSockID(id []byte, conn tcpflow.Tuple) {
	binary.BigEndian.PutUint16(id[0:], conn.Local.Port())
	binary.BigEndian.PutUint16(id[2:], conn.Remote.Port())
	src, dst := conn.Local.Addr().As4(), conn.Remote.Addr().As4()
	copy(id[4:], src[:])
	copy(id[20:], dst[:])
}

// sizeofSockIDAddrs is the part of an inet_diag_sockid that putSockID writes (ports, then two 16-byte
// address fields).
const sizeofSockIDAddrs = 36

// ErrNoSocket is Lookup's error for a socket that does not exist.
var ErrNoSocket = errors.New("no such TCP socket in this network namespace")

// parseDiagReply reads the socket's received and unread bytes, owner, inode and cgroup from the kernel's reply to
// diagRequest for conn (or the error it answered with). The reply comes from the kernel, yet every length
// in it is checked against the buffer. The kernel's lookup falls back to a listener on the local port
// when no connection matches: a reply about another socket than conn is ErrNoSocket.
func parseDiagReply(b []byte, conn tcpflow.Tuple) (Socket, error) {
	ne := binary.NativeEndian
	if len(b) < sizeofNlMsghdr {
		return Socket{}, fmt.Errorf("reply of %d bytes: shorter than a netlink header", len(b))
	}
	l, typ := int(ne.Uint32(b[0:])), ne.Uint16(b[4:])
	if l < sizeofNlMsghdr || l > len(b) {
		return Socket{}, fmt.Errorf("reply's netlink length %d outside %d..%d", l, sizeofNlMsghdr, len(b))
	}
	msg := b[sizeofNlMsghdr:l]
	switch typ {
	case unix.NLMSG_ERROR:
		if len(msg) < 4 {
			return Socket{}, errors.New("truncated netlink error")
		}
		errno := unix.Errno(-int32(ne.Uint32(msg)))
		if errno == unix.ENOENT {
			return Socket{}, ErrNoSocket
		}
		return Socket{}, fmt.Errorf("kernel answered: %w", errno)
	case unix.SOCK_DIAG_BY_FAMILY:
	default:
		return Socket{}, fmt.Errorf("reply of netlink type %d", typ)
	}
	if len(msg) < sizeofInetDiagMsg {
		return Socket{}, fmt.Errorf("reply of %d bytes: shorter than inet_diag_msg", len(msg))
	}
	var want [sizeofSockIDAddrs]byte
	putSockID(want[:], conn)
	if msg[0] == unix.AF_INET6 {
		// A dual-stack socket of an IPv4 connection (one a listener on :: accepted): the kernel finds it by
		// the IPv4 addresses asked for and names it by their IPv4-mapped form, ::ffff:a.b.c.d. Compared
		// with the IPv4 form, such a live socket read as gone.
		src, dst := conn.Local.Addr().As16(), conn.Remote.Addr().As16()
		copy(want[4:], src[:])
		copy(want[20:], dst[:])
	}
	if !bytes.Equal(msg[4:4+sizeofSockIDAddrs], want[:]) {
		return Socket{}, ErrNoSocket
	}
	s := Socket{State: msg[1], Unread: int(ne.Uint32(msg[diagMsgRQueueAt:])), UID: ne.Uint32(msg[diagMsgUIDAt:]), Inode: ne.Uint32(msg[diagMsgInodeAt:])}
	const at = int(unsafe.Offsetof(unix.TCPInfo{}.Bytes_received))
	info := false
	for a := msg[sizeofInetDiagMsg:]; len(a) >= 4; {
		alen, atyp := int(ne.Uint16(a[0:])), ne.Uint16(a[2:])
		if alen < 4 || alen > len(a) {
			return Socket{}, fmt.Errorf("attribute length %d outside 4..%d", alen, len(a))
		}
		switch v := a[4:alen]; atyp {
		case inetDiagInfo:
			if len(v) < at+8 {
				return Socket{}, fmt.Errorf("tcp_info of %d bytes has no bytes_received (Linux 4.1+)", len(v))
			}
			s.Received, info = ne.Uint64(v[at:]), true
		case inetDiagCgroupID:
			if len(v) < 8 {
				return Socket{}, fmt.Errorf("cgroup id of %d bytes", len(v))
			}
			s.CgroupID = ne.Uint64(v)
		}
		a = a[min(len(a), (alen+3)&^3):]
	}
	if !info && !s.TimeWait() {
		// The kernel answers for a TIME_WAIT socket without tcp_info (inet_twsk_diag_fill).
		return Socket{}, errors.New("reply without tcp_info")
	}
	return s, nil
}
