package sockdiag

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/tcpflow"
)

// loopbackPair connects two ends over IPv4 loopback; the test's end closes both (a test may close them
// before) and the listener, which stays open until then: the kernel answers for it on the server's port.
func loopbackPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	client, err = net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	return client, server
}

// TestLookup looks up one end of a loopback connection (no privileges needed) before and after bytes
// arrive and after the application read part of them; a socket that does not exist (the kernel answers
// with the listener on its local port) and an IPv6 flow are errors. The socket's cgroup is the test's.
func TestLookup(t *testing.T) {
	client, server := loopbackPair(t)
	conn := tcpflow.Tuple{Local: server.LocalAddr().(*net.TCPAddr).AddrPort(), Remote: server.RemoteAddr().(*net.TCPAddr).AddrPort()}

	s, err := Lookup(conn)
	if err != nil || s.Received != 0 || s.Unread != 0 {
		t.Fatalf("before any byte: %+v, %v; want 0 received, 0 unread", s, err)
	}
	if want := ownCgroupID(t); s.CgroupID != want {
		t.Errorf("socket's cgroup id %d, want the test's %d", s.CgroupID, want)
	}
	if s.UID != uint32(os.Geteuid()) {
		t.Errorf("socket's owner %d, want the test's uid %d", s.UID, os.Geteuid())
	}
	if want := fdInode(t, server); s.Inode != want {
		t.Errorf("socket's inode %d, want %d (its descriptor's)", s.Inode, want)
	}
	if _, err := client.Write(make([]byte, 5000)); err != nil {
		t.Fatal(err)
	}
	// Loopback delivers within the write, but the test does not rely on it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, err := Lookup(conn)
		if err != nil {
			t.Fatal(err)
		}
		if s.Received == 5000 && s.Unread == 5000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 5000 bytes sent: %+v", s)
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := io.ReadFull(server, make([]byte, 1200)); err != nil {
		t.Fatal(err)
	}
	if s, err := Lookup(conn); err != nil || s.Received != 5000 || s.Unread != 3800 {
		t.Errorf("after reading 1200: %+v, %v; want 5000 received, 3800 unread", s, err)
	}

	gone := conn
	gone.Remote = netip.AddrPortFrom(conn.Remote.Addr(), conn.Remote.Port()^1)
	if _, err := Lookup(gone); !errors.Is(err, ErrNoSocket) {
		t.Errorf("a socket that does not exist: %v, want %v", err, ErrNoSocket)
	}
	v6 := tcpflow.Tuple{Local: netip.MustParseAddrPort("[::1]:1"), Remote: netip.MustParseAddrPort("[::1]:2")}
	if _, err := Lookup(v6); err == nil {
		t.Error("an IPv6 flow was looked up")
	}
}

// ownCgroupID is the cgroup v2 id of the test process: the inode number of its cgroup's directory.
func ownCgroupID(t *testing.T) uint64 {
	t.Helper()
	d, err := cgroupv2.ProcessDir(0)
	if err != nil {
		t.Fatal(err)
	}
	id, err := cgroupv2.ID(d)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// FuzzParseDiagReply: whatever the reply's bytes, parsing returns an error or values, and never reads
// outside the buffer.
func FuzzParseDiagReply(f *testing.F) {
	ok := make([]byte, sizeofNlMsghdr+sizeofInetDiagMsg+4+unix.SizeofTCPInfo)
	ne := binary.NativeEndian
	ne.PutUint32(ok[0:], uint32(len(ok)))
	ne.PutUint16(ok[4:], unix.SOCK_DIAG_BY_FAMILY)
	a := ok[sizeofNlMsghdr+sizeofInetDiagMsg:]
	ne.PutUint16(a[0:], uint16(len(a)))
	ne.PutUint16(a[2:], inetDiagInfo)
	f.Add(ok)
	withCgroup := append(slices.Clone(ok), 12, 0, inetDiagCgroupID, 0, 1, 2, 3, 4, 5, 6, 7, 8)
	ne.PutUint32(withCgroup[0:], uint32(len(withCgroup)))
	f.Add(withCgroup)
	e := make([]byte, sizeofNlMsghdr+4)
	ne.PutUint32(e[0:], uint32(len(e)))
	ne.PutUint16(e[4:], unix.NLMSG_ERROR)
	enoent := -int32(unix.ENOENT)
	ne.PutUint32(e[16:], uint32(enoent))
	f.Add(e)
	timeWait := make([]byte, sizeofNlMsghdr+sizeofInetDiagMsg) // the kernel gives a TIME_WAIT socket no tcp_info
	ne.PutUint32(timeWait[0:], uint32(len(timeWait)))
	ne.PutUint16(timeWait[4:], unix.SOCK_DIAG_BY_FAMILY)
	timeWait[sizeofNlMsghdr+1] = stateTimeWait
	f.Add(timeWait)
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("0.0.0.0:0"), Remote: netip.MustParseAddrPort("0.0.0.0:0")}
	f.Fuzz(func(t *testing.T, b []byte) {
		parseDiagReply(b, conn)
	})
}

// fdInode is the inode of c's socket, from its descriptor.
func fdInode(t *testing.T, c net.Conn) uint32 {
	t.Helper()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	var serr error
	if err := raw.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	return uint32(st.Ino)
}
