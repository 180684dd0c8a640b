package sockdiag

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestLookupDualStack: a program that listens on a dual-stack socket (Go's net.Listen("tcp", ":port"),
// many servers' default) accepts IPv4 peers on IPv6 sockets with IPv4-mapped addresses. The kernel finds
// them by their IPv4 addresses and names them in its reply by their IPv6 form (::ffff:a.b.c.d): Lookup
// must still answer for them, not say they do not exist (which would finish their log and fail a replay).
func TestLookupDualStack(t *testing.T) {
	ln, err := net.Listen("tcp", "[::]:0")
	if err != nil {
		t.Skipf("no dual-stack listener on this host: %v", err)
	}
	t.Cleanup(func() { ln.Close() })
	port := ln.Addr().(*net.TCPAddr).Port
	client, err := net.Dial("tcp4", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	conn := tcpflow.Tuple{Local: server.LocalAddr().(*net.TCPAddr).AddrPort(), Remote: server.RemoteAddr().(*net.TCPAddr).AddrPort()}
	if !conn.Local.Addr().Is4In6() {
		t.Skipf("the accepted socket is not dual-stack: %s", conn)
	}

	if _, err := client.Write(make([]byte, 3000)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, err := Lookup(conn)
		if err != nil {
			t.Fatalf("the dual-stack socket of %s: %v", conn, err)
		}
		if s.Received == 3000 && s.Unread == 3000 {
			if want := fdInode(t, server); s.Inode != want {
				t.Errorf("socket's inode %d, want %d (its descriptor's)", s.Inode, want)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 3000 bytes sent: %+v", s)
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := io.ReadFull(server, make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	if s, err := Lookup(conn); err != nil || s.Received != 3000 || s.Unread != 2000 {
		t.Errorf("after reading 1000: %+v, %v; want 3000 received, 2000 unread", s, err)
	}
	// The same socket named by its peer's IPv4 view, unmapped: the same answer.
	if _, err := Lookup(conn.Unmap()); err != nil {
		t.Errorf("the dual-stack socket named in IPv4: %v", err)
	}
	// A connection that does not exist on the dual-stack listener's port: the kernel answers with the
	// listener (::), which is not conn's socket.
	gone := conn
	gone.Remote = netip.AddrPortFrom(conn.Remote.Addr(), conn.Remote.Port()^1)
	if _, err := Lookup(gone); !errors.Is(err, ErrNoSocket) {
		t.Errorf("a socket that does not exist: %v, want %v", err, ErrNoSocket)
	}
}

// TestParseDiagReplyFamilies: the reply names an IPv4 socket by its IPv4 addresses and a dual-stack one
// by their IPv4-mapped form; either is conn's, another socket is not.
func TestParseDiagReplyFamilies(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:5000"), Remote: netip.MustParseAddrPort("10.0.0.2:6000")}
	other := tcpflow.Tuple{Local: conn.Local, Remote: netip.MustParseAddrPort("10.0.0.3:6000")}
	reply := func(family uint8, c tcpflow.Tuple) []byte {
		b := make([]byte, sizeofNlMsghdr+sizeofInetDiagMsg)
		binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
		binary.NativeEndian.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
		m := b[sizeofNlMsghdr:]
		m[0], m[1] = family, stateTimeWait // no tcp_info needed
		id := m[4:]
		binary.BigEndian.PutUint16(id[0:], c.Local.Port())
		binary.BigEndian.PutUint16(id[2:], c.Remote.Port())
		if family == unix.AF_INET6 {
			src, dst := c.Local.Addr().As16(), c.Remote.Addr().As16()
			copy(id[4:], src[:])
			copy(id[20:], dst[:])
		} else {
			src, dst := c.Local.Addr().As4(), c.Remote.Addr().As4()
			copy(id[4:], src[:])
			copy(id[20:], dst[:])
		}
		return b
	}
	for _, tc := range []struct {
		name   string
		family uint8
		named  tcpflow.Tuple
		wantOK bool
	}{
		{"IPv4 socket", unix.AF_INET, conn, true},
		{"dual-stack socket, IPv4-mapped", unix.AF_INET6, conn, true},
		{"IPv4 socket of another peer", unix.AF_INET, other, false},
		{"dual-stack socket of another peer", unix.AF_INET6, other, false},
	} {
		_, err := parseDiagReply(reply(tc.family, tc.named), conn)
		if tc.wantOK && err != nil {
			t.Errorf("%s: %v, want conn's socket", tc.name, err)
		}
		if !tc.wantOK && !errors.Is(err, ErrNoSocket) {
			t.Errorf("%s: %v, want %v", tc.name, err, ErrNoSocket)
		}
	}
}
