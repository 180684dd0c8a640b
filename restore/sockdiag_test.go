package restore

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestSocketReceived looks up one end of a loopback connection (no privileges needed) before and after
// bytes arrive and after the application read part of them; a socket that does not exist (the kernel
// answers with the listener on its local port) and an IPv6 flow are errors.
func TestSocketReceived(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	conn := tcpflow.Tuple{Local: server.LocalAddr().(*net.TCPAddr).AddrPort(), Remote: server.RemoteAddr().(*net.TCPAddr).AddrPort()}

	if got, unread, err := SocketReceived(conn); err != nil || got != 0 || unread != 0 {
		t.Fatalf("before any byte: received %d, unread %d, %v; want 0, 0", got, unread, err)
	}
	if _, err := client.Write(make([]byte, 5000)); err != nil {
		t.Fatal(err)
	}
	// Loopback delivers within the write, but the test does not rely on it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, unread, err := SocketReceived(conn)
		if err != nil {
			t.Fatal(err)
		}
		if got == 5000 && unread == 5000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 5000 bytes sent: received %d, unread %d", got, unread)
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := io.ReadFull(server, make([]byte, 1200)); err != nil {
		t.Fatal(err)
	}
	if got, unread, err := SocketReceived(conn); err != nil || got != 5000 || unread != 3800 {
		t.Errorf("after reading 1200: received %d, unread %d, %v; want 5000, 3800", got, unread, err)
	}

	gone := conn
	gone.Remote = netip.AddrPortFrom(conn.Remote.Addr(), conn.Remote.Port()^1)
	if _, _, err := SocketReceived(gone); !errors.Is(err, errNoSocket) {
		t.Errorf("a socket that does not exist: %v, want %v", err, errNoSocket)
	}
	v6 := tcpflow.Tuple{Local: netip.MustParseAddrPort("[::1]:1"), Remote: netip.MustParseAddrPort("[::1]:2")}
	if _, _, err := SocketReceived(v6); err == nil {
		t.Error("an IPv6 flow was looked up")
	}
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
	e := make([]byte, sizeofNlMsghdr+4)
	ne.PutUint32(e[0:], uint32(len(e)))
	ne.PutUint16(e[4:], unix.NLMSG_ERROR)
	enoent := -int32(unix.ENOENT)
	ne.PutUint32(e[16:], uint32(enoent))
	f.Add(e)
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("0.0.0.0:0"), Remote: netip.MustParseAddrPort("0.0.0.0:0")}
	f.Fuzz(func(t *testing.T, b []byte) {
		parseDiagReply(b, conn)
	})
}
