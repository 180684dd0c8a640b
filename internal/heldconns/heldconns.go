// Package heldconns lists the TCP connections the processes of a cgroup hold now: what a snapshot taken
// at this moment would have to contain. The agent compares it with a job's last snapshot, because a
// connection opened after that snapshot cannot be rebuilt by a restore from it: the restored process
// would accept or connect again, while its peer's end is already established.
package heldconns

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// Held is what List found.
type Held struct {
	// Conns are the connections of the cgroup's sockets (addresses unmapped), seen from the cgroup's end:
	// every state from established to closing. A connect still waiting for its SYN-ACK is left out: its
	// peer holds nothing yet, and a restored process would connect again.
	Conns []tcpflow.Tuple
	// Pending are the cgroup's listening sockets with connections the kernel completed and the program has
	// not accepted yet: their peers are connected, and a snapshot now would not hold those connections
	// (CRIU refuses to dump them).
	Pending []netip.AddrPort
	// Connecting counts the connects waiting for their SYN-ACK: they become connections without a new
	// socket.
	Connecting int
}

// Settled reports whether h can change only with a new socket: no connect in progress, no connection
// waiting in a listen queue. (A listener may still get one at any time: callers look again now and then.)
func (h Held) Settled() bool { return h.Connecting == 0 && len(h.Pending) == 0 }

// Sockets are the socket inodes of each cgroup's processes (Inodes).
type Sockets map[string]map[uint64]bool

// Equal reports whether s and o name the same sockets for the same cgroups.
func (s Sockets) Equal(o Sockets) bool {
	return maps.EqualFunc(s, o, maps.Equal[map[uint64]bool])
}

// Inodes reads the socket inodes of every process in each cgroup (a cgroup v2 directory; its descendants
// included) from /proc. Processes that exit meanwhile are skipped; a cgroup that cannot be read is an
// error. It costs a few microseconds per descriptor; List's socket table costs about a millisecond,
// whatever the number of sockets, so a caller may skip List while the inodes stay the same.
func Inodes(cgroups ...string) (Sockets, error) {
	out := make(Sockets, len(cgroups))
	for _, cg := range cgroups {
		in := map[uint64]bool{}
		if err := socketInodes(cg, in); err != nil {
			return nil, err
		}
		out[cg] = in
	}
	return out, nil
}

// owners maps each socket inode of socks to its cgroup.
func owners(socks Sockets) map[uint64]string {
	owner := map[uint64]string{}
	for cg, in := range socks {
		for n := range in {
			owner[n] = cg
		}
	}
	return owner
}

// List returns what the sockets of each cgroup hold, from one sock_diag dump of the TCP sockets in the
// calling thread's network namespace (enter the processes' namespace first).
func List(socks Sockets) (map[string]Held, error) {
	owner := owners(socks)
	out := make(map[string]Held, len(socks))
	for cg := range socks {
		out[cg] = Held{}
	}
	if len(owner) == 0 {
		return out, nil
	}
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		diag, err := netlink.SocketDiagTCP(family)
		if err != nil {
			return nil, fmt.Errorf("list TCP sockets (sock_diag): %w", err)
		}
		for _, s := range diag {
			cg, ok := owner[uint64(s.INode)]
			if !ok {
				continue
			}
			h := out[cg]
			switch s.State {
			case unix.BPF_TCP_LISTEN:
				if s.RQueue > 0 {
					h.Pending = append(h.Pending, connOf(s).Local)
				}
			case unix.BPF_TCP_SYN_SENT:
				h.Connecting++
			default:
				if isConn(s.State) {
					h.Conns = append(h.Conns, connOf(s))
				}
			}
			out[cg] = h
		}
	}
	return out, nil
}

// Flow is how far one connection has come, seen from one end.
type Flow struct {
	Conn tcpflow.Tuple
	// Sent counts the bytes this end sent, each once (tcpi_bytes_sent less tcpi_bytes_retrans), Received
	// the bytes it received in order (tcpi_bytes_received). Both count from the socket's creation, or from
	// its restore: the counts of the two ends of a connection restored at one end do not compare.
	Sent, Received uint64
	// Unacked counts the segments this end sent that its peer has not acknowledged (tcpi_unacked), its FIN
	// included.
	Unacked uint32
	// FinSent says this end sent its FIN, FinReceived that it received its peer's (the socket's state): a FIN
	// moves no byte count.
	FinSent, FinReceived bool
}

// Flows returns the flows of the connections of each cgroup's sockets (the connections List puts in
// Conns), from one sock_diag dump with TCP_INFO in the calling thread's network namespace.
func Flows(socks Sockets) (map[string][]Flow, error) {
	owner := owners(socks)
	out := make(map[string][]Flow, len(socks))
	if len(owner) == 0 {
		return out, nil
	}
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		diag, err := netlink.SocketDiagTCPInfo(family)
		if err != nil {
			return nil, fmt.Errorf("list TCP sockets with their counters (sock_diag): %w", err)
		}
		for _, d := range diag {
			s, info := d.InetDiagMsg, d.TCPInfo
			cg, ok := owner[uint64(s.INode)]
			if !ok || info == nil || !isConn(s.State) {
				continue
			}
			out[cg] = append(out[cg], Flow{
				Conn:     connOf(s),
				Sent:     info.Bytes_sent - min(info.Bytes_retrans, info.Bytes_sent),
				Received: info.Bytes_received,
				Unacked:  info.Unacked,
				FinSent:  finSent(s.State), FinReceived: finReceived(s.State),
			})
		}
	}
	return out, nil
}

// isConn says whether a socket in state is a connection a snapshot holds: every state from established to
// closing. A connect still waiting for its SYN-ACK is not: its peer holds nothing yet.
func isConn(state uint8) bool {
	switch state {
	case unix.BPF_TCP_LISTEN, unix.BPF_TCP_SYN_SENT, unix.BPF_TCP_SYN_RECV, unix.BPF_TCP_CLOSE, unix.BPF_TCP_TIME_WAIT:
		return false
	}
	return true
}

// finSent says whether a socket in state sent its FIN.
func finSent(state uint8) bool {
	switch state {
	case unix.BPF_TCP_FIN_WAIT1, unix.BPF_TCP_FIN_WAIT2, unix.BPF_TCP_CLOSING, unix.BPF_TCP_LAST_ACK:
		return true
	}
	return false
}

// finReceived says whether a socket in state received its peer's FIN.
func finReceived(state uint8) bool {
	switch state {
	case unix.BPF_TCP_CLOSE_WAIT, unix.BPF_TCP_CLOSING, unix.BPF_TCP_LAST_ACK:
		return true
	}
	return false
}

// connOf is s's connection, seen from s (addresses unmapped).
func connOf(s *netlink.Socket) tcpflow.Tuple {
	return tcpflow.Tuple{
		Local:  netip.AddrPortFrom(addr(s.ID.Source), s.ID.SourcePort),
		Remote: netip.AddrPortFrom(addr(s.ID.Destination), s.ID.DestinationPort),
	}
}

func addr(ip net.IP) netip.Addr {
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap()
}

// socketInodes adds the inodes of the sockets open in the processes of cgroup and its descendants.
func socketInodes(cgroup string, inodes map[uint64]bool) error {
	return filepath.WalkDir(cgroup, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if path != cgroup && errors.Is(err, fs.ErrNotExist) {
				return nil // a child cgroup removed meanwhile
			}
			return err
		}
		if !d.IsDir() {
			return nil
		}
		b, err := os.ReadFile(filepath.Join(path, "cgroup.procs"))
		if err != nil {
			if path != cgroup && errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return fmt.Errorf("list the processes of cgroup %s: %w", path, err)
		}
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				processSockets(pid, func(n uint64) { inodes[n] = true })
			}
		}
		return nil
	})
}

// processSockets calls add with the inode of each of pid's sockets; a process gone meanwhile has none.
func processSockets(pid int, add func(inode uint64)) {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		if n, ok := socketInode(target); ok {
			add(n)
		}
	}
}

// socketInode parses a descriptor's link, "socket:[INODE]".
func socketInode(link string) (uint64, bool) {
	s, ok := strings.CutPrefix(link, "socket:[")
	if !ok {
		return 0, false
	}
	s, ok = strings.CutSuffix(s, "]")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 64)
	return n, err == nil
}
