package heldconns

import (
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

func TestSocketInode(t *testing.T) {
	for _, c := range []struct {
		link string
		want uint64
		ok   bool
	}{
		{"socket:[12345]", 12345, true},
		{"socket:[0]", 0, true},
		{"pipe:[12345]", 0, false},
		{"/dev/null", 0, false},
		{"socket:[12345", 0, false},
		{"socket:[x]", 0, false},
		{"socket:[-1]", 0, false},
	} {
		n, ok := socketInode(c.link)
		if n != c.want || ok != c.ok {
			t.Errorf("socketInode(%q) = %d, %v; want %d, %v", c.link, n, ok, c.want, c.ok)
		}
	}
}

func tupleOf(c net.Conn) tcpflow.Tuple {
	return tcpflow.Tuple{Local: c.LocalAddr().(*net.TCPAddr).AddrPort(), Remote: c.RemoteAddr().(*net.TCPAddr).AddrPort()}.Unmap()
}

// List on this test's own process (a directory whose cgroup.procs names it stands for its cgroup): an
// accepted connection shows from both ends, a connection still in a listener's accept queue makes that
// listener pending, a listener without one is not listed, a child cgroup that
// names no process adds nothing, and a second cgroup listed in the same call gets none of them.
func TestListOwnProcess(t *testing.T) {
	cg := t.TempDir()
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(cg, "child"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cg, "child", "cgroup.procs"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()
	if err := os.WriteFile(filepath.Join(empty, "cgroup.procs"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	listen := func() net.Listener {
		l, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	dial := func(l net.Listener) net.Conn {
		c, err := net.Dial("tcp4", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	accepting, idle, queued := listen(), listen(), listen()
	client := dial(accepting)
	server, err := accepting.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	waiting := dial(queued) // never accepted

	// The kernel moves a completed connection to the accept queue as the client's final ACK arrives,
	// which on loopback is before Dial returns; the listing is read until it shows it all the same.
	var h Held
	deadline := time.Now().Add(10 * time.Second)
	for {
		socks, err := Inodes(cg, empty)
		if err != nil {
			t.Fatal(err)
		}
		again, err := Inodes(cg, empty)
		if err != nil || !socks.Equal(again) || socks.Equal(Sockets{cg: socks[cg]}) {
			t.Fatalf("the same sockets read twice: %v and %v (%v)", socks, again, err)
		}
		all, err := List(socks)
		if err != nil {
			t.Fatal(err)
		}
		if e := all[empty]; len(e.Conns)+len(e.Pending) != 0 {
			t.Fatalf("a cgroup without processes holds %+v", e)
		}
		h = all[cg]
		if len(h.Pending) > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, want := range []tcpflow.Tuple{tupleOf(client), tupleOf(server), tupleOf(waiting)} {
		if !slices.Contains(h.Conns, want) {
			t.Errorf("connection %s not listed: %v", want, h.Conns)
		}
	}
	if len(h.Conns) != 3 {
		t.Errorf("listed %d connections, want the 3 this process holds: %v", len(h.Conns), h.Conns)
	}
	if h.Settled() || h.Connecting != 0 {
		t.Errorf("with a connection waiting to be accepted: settled %v, connecting %d", h.Settled(), h.Connecting)
	}
	wantPending := []netip.AddrPort{queued.Addr().(*net.TCPAddr).AddrPort()}
	if !slices.Equal(h.Pending, wantPending) {
		t.Errorf("pending listeners %v, want %v (and not %s, which has nothing queued)", h.Pending, wantPending, idle.Addr())
	}
}

// A missing cgroup is an error, not an empty listing.
func TestListMissing(t *testing.T) {
	if _, err := Inodes(filepath.Join(t.TempDir(), "gone")); err == nil {
		t.Error("a missing cgroup listed without error")
	}
}

// BenchmarkList: a process holding 64 connections and a listener: reading its sockets' inodes (what the
// agent pays per job and check) and listing them (per network namespace, when the inodes changed).
func BenchmarkList(b *testing.B) {
	cg := b.TempDir()
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	for range 32 {
		c, err := net.Dial("tcp4", l.Addr().String())
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		s, err := l.Accept()
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
	}
	b.Run("inodes", func(b *testing.B) {
		for b.Loop() {
			if s, err := Inodes(cg); err != nil || len(s[cg]) < 65 {
				b.Fatalf("%d sockets, %v", len(s[cg]), err)
			}
		}
	})
	b.Run("list", func(b *testing.B) {
		s, err := Inodes(cg)
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if h, err := List(s); err != nil || len(h[cg].Conns) != 64 {
				b.Fatalf("%d connections, %v", len(h[cg].Conns), err)
			}
		}
	})
}

// Flows on this test's own process: the two ends of a loopback connection count the bytes one sent and the
// other received, and once the receiver's kernel has them (read or not), the sender's count equals the
// receiver's and nothing is left unacknowledged.
func TestFlowsOwnProcess(t *testing.T) {
	cg := t.TempDir()
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err := net.Dial("tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	const n = 100_000
	if _, err := client.Write(make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	// ends lists the flows of the cgroup's sockets until cond holds of the client's and the server's ends, or
	// 10 s have passed, and returns those of the last listing.
	ends := func(cond func(c, s Flow) bool) (Flow, Flow) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			socks, err := Inodes(cg)
			if err != nil {
				t.Fatal(err)
			}
			flows, err := Flows(socks)
			if err != nil {
				t.Fatal(err)
			}
			by := map[tcpflow.Tuple]Flow{}
			for _, f := range flows[cg] {
				by[f.Conn] = f
			}
			c, s := by[tupleOf(client)], by[tupleOf(server)]
			if cond(c, s) || time.Now().After(deadline) {
				return c, s
			}
		}
	}
	c, s := ends(func(c, s Flow) bool { return s.Received == n && c.Unacked == 0 })
	if c.Sent != n || c.Received != 0 || c.Unacked != 0 {
		t.Errorf("client end %+v: want %d bytes sent, none received, none unacknowledged", c, n)
	}
	if s.Sent != 0 || s.Received != n {
		t.Errorf("server end %+v: want none sent, %d received (its kernel holds them, unread)", s, n)
	}
	if c.FinSent || c.FinReceived || s.FinSent || s.FinReceived {
		t.Errorf("ends %+v, %+v: want no FIN either way before a close", c, s)
	}
	// The client's FIN moves no byte count: the ends' states say it was sent and received.
	if err := client.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	finned := func(c, s Flow) bool { return c.FinSent && s.FinReceived && !c.FinReceived && !s.FinSent }
	if c, s = ends(finned); !finned(c, s) {
		t.Fatalf("after the client's close: client end %+v, server end %+v; want the FIN sent by the client, received by the server", c, s)
	}
}

// FuzzSocketInode: a descriptor's link names what it holds, a path a user chose included. Only the
// kernel's own "socket:[N]" gives an inode, the one it names.
func FuzzSocketInode(f *testing.F) {
	for _, s := range []string{"socket:[12345]", "socket:[0]", "pipe:[1]", "/tmp/socket:[1]", "socket:[1] (deleted)", "socket:[18446744073709551616]"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, link string) {
		n, ok := socketInode(link)
		if !ok {
			return
		}
		digits := strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")
		if !strings.HasPrefix(link, "socket:[") || !strings.HasSuffix(link, "]") || strings.TrimLeft(digits, "0123456789") != "" {
			t.Fatalf("socketInode(%q) = %d: not a socket's link", link, n)
		}
		if m, err := strconv.ParseUint(digits, 10, 64); err != nil || m != n {
			t.Fatalf("socketInode(%q) = %d, want %d", link, n, m)
		}
	})
}
