//go:build linux

package jobnet_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
)

// jobAddr is the n-th job address of the lab: from .201 up, outside the hosts' .11 and .101 ranges.
func jobAddr(l *lab.Lab, n int) netip.Prefix {
	b := l.State().Subnet.Masked().Addr().As4()
	b[3] = byte(200 + n)
	return netip.PrefixFrom(netip.AddrFrom4(b), l.State().Subnet.Bits())
}

// jobSpec is a job network on host's eth0, removed when the test ends.
func jobSpec(t *testing.T, l *lab.Lab, host string, kind jobnet.Kind, n int) jobnet.Spec {
	t.Helper()
	p, err := l.NetnsPath(host)
	if err != nil {
		t.Fatal(err)
	}
	s := jobnet.Spec{Name: fmt.Sprintf("%s-job%d", l.State().ID, n), Parent: "eth0", Kind: kind, Addr: jobAddr(l, n), ParentNetns: p}
	t.Cleanup(func() {
		if err := jobnet.Delete(context.Background(), s.Name, s.ParentNetns); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return s
}

// listen opens a TCP listener inside a namespace (a socket belongs to the namespace it was created in) and
// echoes every connection, reporting each connection's remote address.
func listen(t *testing.T, do func(func() error) error, addr string) (net.Listener, <-chan net.Addr) {
	t.Helper()
	var ln net.Listener
	if err := do(func() (err error) { ln, err = net.Listen("tcp4", addr); return err }); err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	peers := make(chan net.Addr, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			peers <- c.RemoteAddr()
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	return ln, peers
}

// echo dials addr from the job's namespace, round-trips a message and returns the local address used.
func echo(t *testing.T, job, addr string) net.Addr {
	t.Helper()
	var c net.Conn
	if err := jobnet.Do(job, func() (err error) { c, err = net.DialTimeout("tcp4", addr, 10*time.Second); return err }); err != nil {
		t.Fatalf("dial %s from job network %s: %v", addr, job, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	msg := []byte("hello from the job's own address")
	if _, err := c.Write(msg); err != nil {
		t.Fatalf("write to %s: %v", addr, err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != string(msg) {
		t.Fatalf("echo from %s: %q, %v", addr, got, err)
	}
	return c.LocalAddr()
}

// linkNames lists the interfaces of the namespace at path.
func linkNames(t *testing.T, path string) map[string]bool {
	t.Helper()
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, lk := range links {
		names[lk.Attrs().Name] = true
	}
	return names
}

// TestJobNetTraffic: a job network on node1 (address A) reaches a listener on node2's host address and one
// in a job network on node2 (address B); both see A as the peer; Create again changes nothing; Delete
// leaves no namespace and no interface on the parent, and is idempotent too.
func TestJobNetTraffic(t *testing.T) {
	for _, kind := range []jobnet.Kind{jobnet.IPVlan, jobnet.MACVlan} {
		t.Run(string(kind), func(t *testing.T) {
			l := labtest.New(t, 2, 0)
			ctx := context.Background()
			a := jobSpec(t, l, "node1", kind, 1)
			b := jobSpec(t, l, "node2", kind, 2)
			parentBefore := linkNames(t, a.ParentNetns)
			for _, s := range []jobnet.Spec{a, b, a} { // the second Create of a is a no-op
				err := jobnet.Create(ctx, s)
				if errors.Is(err, unix.EOPNOTSUPP) {
					t.Skipf("SKIPPED: this kernel has no %s (CONFIG_IPVLAN/CONFIG_MACVLAN): %v", kind, err)
				}
				if err != nil {
					t.Fatalf("create: %v", err)
				}
			}
			if ok, err := jobnet.Exists(a.Name); err != nil || !ok {
				t.Fatalf("Exists(%s) = %v, %v after Create", a.Name, ok, err)
			}
			node2, _ := l.Host("node2")
			hostAddr := netip.AddrPortFrom(node2.Addr.Addr(), 7001).String()
			jobBAddr := netip.AddrPortFrom(b.Addr.Addr(), 7002).String()
			_, hostPeers := listen(t, func(f func() error) error { return l.Do("node2", f) }, hostAddr)
			_, jobPeers := listen(t, func(f func() error) error { return jobnet.Do(b.Name, f) }, jobBAddr)

			for _, tc := range []struct {
				to    string
				peers <-chan net.Addr
			}{{hostAddr, hostPeers}, {jobBAddr, jobPeers}} {
				local := echo(t, a.Name, tc.to)
				if ip := local.(*net.TCPAddr).IP.String(); ip != a.Addr.Addr().String() {
					t.Errorf("connection to %s left from %s, want the job's address %s", tc.to, ip, a.Addr.Addr())
				}
				select {
				case p := <-tc.peers:
					if ip := p.(*net.TCPAddr).IP.String(); ip != a.Addr.Addr().String() {
						t.Errorf("listener %s saw peer %s, want the job's address %s", tc.to, ip, a.Addr.Addr())
					}
				case <-time.After(30 * time.Second):
					t.Fatalf("listener %s saw no connection", tc.to)
				}
			}
			// Inside: lo and the job's interface, nothing else; on the parent: no interface left behind.
			if got := linkNames(t, jobnet.Path(a.Name)); len(got) != 2 || !got["lo"] || !got[jobnet.DefaultIfName] {
				t.Errorf("interfaces in the job network: %v, want lo and %s", got, jobnet.DefaultIfName)
			}
			if got := linkNames(t, a.ParentNetns); len(got) != len(parentBefore) {
				t.Errorf("parent's interfaces %v after Create, want %v", got, parentBefore)
			}

			for range 2 {
				if err := jobnet.Delete(ctx, a.Name, a.ParentNetns); err != nil {
					t.Fatalf("delete: %v", err)
				}
			}
			if ok, err := jobnet.Exists(a.Name); err != nil || ok {
				t.Fatalf("Exists(%s) = %v, %v after Delete", a.Name, ok, err)
			}
			if _, err := os.Stat(jobnet.Path(a.Name)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s still there after Delete: %v", jobnet.Path(a.Name), err)
			}
			if got := linkNames(t, a.ParentNetns); len(got) != len(parentBefore) {
				t.Errorf("parent's interfaces %v after Delete, want %v", got, parentBefore)
			}
			// The address is gone from the wire: dialling it from node2 fails.
			err := l.Do("node2", func() error {
				c, err := net.DialTimeout("tcp4", netip.AddrPortFrom(a.Addr.Addr(), 7003).String(), 2*time.Second)
				if err == nil {
					c.Close()
				}
				return err
			})
			if err == nil {
				t.Errorf("the deleted job's address %v still accepts connections", a.Addr)
			}
		})
	}
}

// seqClient is what a job does in the CRIU test: the test binary, re-executed, sends a counter every few
// milliseconds and checks each echo.
func init() {
	if os.Getenv("JOBNET_SEQ_CLIENT") == "" {
		return
	}
	os.Exit(seqClient(os.Getenv("JOBNET_SEQ_CLIENT")))
}

func seqClient(addr string) int {
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		return 2
	}
	var buf [8]byte
	for i := uint64(0); ; i++ {
		binary.BigEndian.PutUint64(buf[:], i)
		if _, err := c.Write(buf[:]); err != nil {
			fmt.Fprintln(os.Stderr, "write:", err)
			return 2
		}
		if _, err := io.ReadFull(c, buf[:]); err != nil {
			fmt.Fprintln(os.Stderr, "read:", err)
			return 2
		}
		if got := binary.BigEndian.Uint64(buf[:]); got != i {
			fmt.Fprintln(os.Stderr, "echo", got, "want", i)
			return 3
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestJobNetEgressLogger measures where the sender-side logger (ebpfprobes, TCX egress) sees a job's
// segments: attached to the host's eth0 (where the agent attaches it today) and to the job's own interface
// inside its namespace. The job listens on its address on node1; node2's host connects; what the job sends
// must be logged at both attach points, selected by port and, on the host's eth0, by the socket's cgroup (the
// socket still owns the skb when it leaves through the macvlan's parent).
func TestJobNetEgressLogger(t *testing.T) {
	for _, at := range []string{"host eth0", "job interface", "host eth0 by cgroup"} {
		t.Run(at, func(t *testing.T) {
			l := labtest.New(t, 2, 0)
			ctx := context.Background()
			a := jobSpec(t, l, "node1", jobnet.MACVlan, 1)
			if err := jobnet.Create(ctx, a); err != nil {
				t.Fatalf("create: %v", err)
			}
			lg, err := ebpfprobes.NewTCPLogger(ebpfprobes.TCPLoggerOptions{})
			if err != nil {
				t.Skipf("SKIPPED: this kernel cannot load the TCX logger: %v", err)
			}
			defer lg.Close()
			attach := func() error {
				lk, err := netlink.LinkByName("eth0") // this thread's namespace: the host's or the job's
				if err != nil {
					return err
				}
				return lg.Attach(lk.Attrs().Index)
			}
			if at != "job interface" {
				err = l.Do("node1", attach)
			} else {
				err = jobnet.Do(a.Name, attach)
			}
			if err != nil {
				t.Fatalf("attach to %s: %v", at, err)
			}
			const port = 7010
			if at == "host eth0 by cgroup" {
				// The listener (and so the accepted socket) is created by this test process.
				err = lg.Protect(selfCgroupID(t))
			} else {
				err = lg.ProtectPort(port)
			}
			if err != nil {
				t.Fatal(err)
			}
			jobAddr := netip.AddrPortFrom(a.Addr.Addr(), port).String()
			_, _ = listen(t, func(f func() error) error { return jobnet.Do(a.Name, f) }, jobAddr)
			var c net.Conn
			if err := l.Do("node2", func() (err error) { c, err = net.DialTimeout("tcp4", jobAddr, 10*time.Second); return err }); err != nil {
				t.Fatalf("dial the job from node2: %v", err)
			}
			defer c.Close()
			msg := make([]byte, 1000)
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.ReadFull(c, msg); err != nil {
				t.Fatalf("echo: %v", err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for {
				n, err := lg.Counters()
				if err != nil {
					t.Fatal(err)
				}
				if n.BytesLogged >= uint64(len(msg)) {
					t.Logf("logger on %s: %d segments, %d bytes of the job's", at, n.PacketsLogged, n.BytesLogged)
					return
				}
				if time.Now().After(deadline) {
					t.Fatalf("logger on %s logged %d bytes of the job's %d sent bytes", at, n.BytesLogged, len(msg))
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}

// selfCgroupID is the cgroup v2 id (its directory's inode) of this process.
func selfCgroupID(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	var rel string
	for _, line := range strings.Split(string(b), "\n") {
		if r, ok := strings.CutPrefix(line, "0::"); ok {
			rel = r
		}
	}
	for _, root := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		var fs unix.Statfs_t
		if unix.Statfs(root, &fs) != nil || fs.Type != unix.CGROUP2_SUPER_MAGIC || rel == "" {
			continue
		}
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(root, rel), &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	t.Skipf("SKIPPED: no cgroup v2 hierarchy for this process: %q", b)
	return 0
}
