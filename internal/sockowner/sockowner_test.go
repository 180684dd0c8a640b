package sockowner

import (
	"net"
	"os"
	"testing"

	"github.com/prometheus/procfs"

	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestFind finds this test process as the holder of both ends of a loopback connection, names its
// command, and leaves out an inode no process holds.
func TestFind(t *testing.T) {
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
	proc, err := procfs.NewDefaultFS()
	if err != nil {
		t.Fatal(err)
	}
	self, err := proc.Self()
	if err != nil {
		t.Fatal(err)
	}
	comm, err := self.Comm()
	if err != nil {
		t.Fatal(err)
	}
	a, b := inode(t, client), inode(t, server)
	const none = 1<<32 - 1 // an inode number far beyond any socket's here
	got, err := Find(proc, []uint32{a, b, none})
	if err != nil {
		t.Fatal(err)
	}
	for _, ino := range []uint32{a, b} {
		if p := got[ino]; p.PID != os.Getpid() || p.Comm != comm {
			t.Errorf("socket %d: %+v, want process %d (%s)", ino, p, os.Getpid(), comm)
		}
	}
	if p, ok := got[none]; ok {
		t.Errorf("an inode nobody holds was found in %+v", p)
	}
	if got, err := Find(proc, nil); err != nil || len(got) != 0 {
		t.Errorf("nothing asked: %v, %v", got, err)
	}
}

// inode is the inode of c's socket, as the agent learns it: from sock_diag.
func inode(t *testing.T, c net.Conn) uint32 {
	t.Helper()
	s, err := sockdiag.Lookup(tcpflow.Tuple{Local: c.LocalAddr().(*net.TCPAddr).AddrPort(), Remote: c.RemoteAddr().(*net.TCPAddr).AddrPort()})
	if err != nil {
		t.Fatal(err)
	}
	return s.Inode
}
