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
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/internal/cgroupv2"
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
	return namedJobSpec(t, l, host, kind, n, fmt.Sprintf("%s-job%d", l.State().ID, n))
}

func namedJobSpec(t *testing.T, l *lab.Lab, host string, kind jobnet.Kind, n int, name string) jobnet.Spec {
	t.Helper()
	p, err := l.NetnsPath(host)
	if err != nil {
		t.Fatal(err)
	}
	s := jobnet.Spec{Name: name, Parent: "eth0", Kind: kind, Addr: jobAddr(l, n), ParentNetns: p}
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
			// The lab's bridge (the switch) has learnt the job interface's MAC: for macvlan its own, for ipvlan
			// the host's.
			mac := jobMAC(t, a.Name)
			fdb, err := exec.Command("bridge", "fdb", "show", "br", l.State().Bridge).CombinedOutput()
			if err != nil || !strings.Contains(string(fdb), mac) {
				t.Errorf("bridge %s has not learnt the job's MAC %s (%v):\n%s", l.State().Bridge, mac, err, fdb)
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
			err = l.Do("node2", func() error {
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
	if os.Getenv("JOBNET_SEQ_RECV") != "" {
		os.Exit(seqReceiver(os.Getenv("JOBNET_SEQ_CLIENT")))
	}
	os.Exit(seqClient(os.Getenv("JOBNET_SEQ_CLIENT")))
}

// seqReceiver only reads counters and checks their order: a job that never sends (but ACKs).
func seqReceiver(addr string) int {
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		return 2
	}
	var buf [8]byte
	for i := uint64(0); ; i++ {
		if _, err := io.ReadFull(c, buf[:]); err != nil {
			fmt.Fprintln(os.Stderr, "read:", err)
			return 2
		}
		if got := binary.BigEndian.Uint64(buf[:]); got != i {
			fmt.Fprintln(os.Stderr, "counter", got, "want", i)
			return 3
		}
	}
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

const criuBin = "/usr/local/sbin/criu"

// seqServer accepts one connection on ln and echoes 8-byte counters, checking that they arrive in order
// with no gap or repeat; it publishes how many it has seen and reports the first violation.
type seqServer struct {
	seen atomic.Uint64
	errc chan error
}

func serveSeq(ln net.Listener) *seqServer {
	s := &seqServer{errc: make(chan error, 1)}
	go func() {
		c, err := ln.Accept()
		if err != nil {
			s.errc <- err
			return
		}
		defer c.Close()
		var buf [8]byte
		for want := uint64(0); ; want++ {
			if _, err := io.ReadFull(c, buf[:]); err != nil {
				s.errc <- fmt.Errorf("read counter %d: %w", want, err)
				return
			}
			if got := binary.BigEndian.Uint64(buf[:]); got != want {
				s.errc <- fmt.Errorf("counter %d arrived, want %d", got, want)
				return
			}
			s.seen.Store(want + 1)
			if _, err := c.Write(buf[:]); err != nil {
				s.errc <- fmt.Errorf("echo counter %d: %w", want, err)
				return
			}
		}
	}()
	return s
}

// sendSeq accepts one connection on ln and sends it a counter every few milliseconds; seen is how many
// counters the peer has acknowledged (TCP_INFO bytes_acked / 8).
func sendSeq(ln net.Listener) *seqServer {
	s := &seqServer{errc: make(chan error, 1)}
	go func() {
		c, err := ln.Accept()
		if err != nil {
			s.errc <- err
			return
		}
		defer c.Close()
		rc, err := c.(*net.TCPConn).SyscallConn()
		if err != nil {
			s.errc <- err
			return
		}
		var buf [8]byte
		for i := uint64(0); ; i++ {
			binary.BigEndian.PutUint64(buf[:], i)
			if _, err := c.Write(buf[:]); err != nil {
				s.errc <- fmt.Errorf("send counter %d: %w", i, err)
				return
			}
			var info *unix.TCPInfo
			_ = rc.Control(func(fd uintptr) { info, err = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) })
			if err == nil {
				s.seen.Store(info.Bytes_acked / 8)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	return s
}

// waitSeen waits until the server has seen n counters, failing on a violation or after timeout.
func (s *seqServer) waitSeen(t *testing.T, n uint64, timeout time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for s.seen.Load() < n {
		select {
		case err := <-s.errc:
			t.Fatalf("server: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Since(start) > timeout {
			t.Fatalf("server saw %d counters after %s, want %d", s.seen.Load(), timeout, n)
		}
	}
	return time.Since(start)
}

// criuIn runs CRIU inside a job network: CRIU then treats that namespace as its own and neither dumps nor
// restores it, so the restored tree lives in whatever namespace the restoring CRIU runs in.
func criuIn(t *testing.T, job string, args ...string) {
	t.Helper()
	var out []byte
	err := jobnet.Do(job, func() (err error) {
		out, err = exec.Command(criuBin, args...).CombinedOutput()
		return err
	})
	if err != nil {
		t.Fatalf("criu %v in %s: %v\n%s", args, job, err, out)
	}
}

// neighbour is node2's neighbour-table entry for addr (MAC and state), "" when there is none.
func neighbour(t *testing.T, l *lab.Lab, host string, addr netip.Addr) string {
	t.Helper()
	var out []byte
	_ = l.Do(host, func() (err error) {
		out, err = exec.Command("ip", "neigh", "show", addr.String()).CombinedOutput()
		return err
	})
	return strings.TrimSpace(string(out))
}

// TestJobNetCRIUMove is the key fact: a job with an established TCP connection to node2's host address,
// living in a macvlan job network on node1, is dumped by CRIU (tcp-established) running inside the job
// network, and restored by CRIU running inside a new job network with the same address on spare1; the
// connection continues, every counter in order, while node1 keeps its own address and stays up. With
// "garp", the restored job's network announces its address (arping -U); without, the test measures how long
// node2 keeps sending to node1's stale MAC before its neighbour entry is re-resolved.
func TestJobNetCRIUMove(t *testing.T) {
	if _, err := os.Stat(criuBin); err != nil {
		t.Skipf("SKIPPED: no CRIU at %s", criuBin)
	}
	for _, tc := range []struct {
		name     string
		garp     bool
		receiver bool // the job only receives: it never sends first after the restore
	}{{"garp", true, false}, {"no garp", false, false}, {"receiver no garp", false, true}, {"receiver garp", true, true}} {
		garp := tc.garp
		t.Run(tc.name, func(t *testing.T) {
			l := labtest.New(t, 2, 1)
			ctx := context.Background()
			from := jobSpec(t, l, "node1", jobnet.MACVlan, 1)
			// One machine holds every lab host's namespaces, so the moved job's network has another name here;
			// on real hosts it keeps its name.
			to := namedJobSpec(t, l, "spare1", jobnet.MACVlan, 1, from.Name+"-moved")
			if err := jobnet.Create(ctx, from); err != nil {
				t.Fatalf("create on node1: %v", err)
			}
			node2, _ := l.Host("node2")
			srvAddr := netip.AddrPortFrom(node2.Addr.Addr(), 7020).String()
			var ln net.Listener
			if err := l.Do("node2", func() (err error) { ln, err = net.Listen("tcp4", srvAddr); return err }); err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			srv := serveSeq
			if tc.receiver {
				srv = sendSeq
			}
			server := srv(ln)

			dir := t.TempDir()
			errf, err := os.Create(filepath.Join(dir, "client.err"))
			if err != nil {
				t.Fatal(err)
			}
			defer errf.Close()
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "JOBNET_SEQ_CLIENT="+srvAddr)
			if tc.receiver {
				cmd.Env = append(cmd.Env, "JOBNET_SEQ_RECV=1")
			}
			cmd.Stdout, cmd.Stderr = errf, errf
			cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
			if err := jobnet.Do(from.Name, cmd.Start); err != nil {
				t.Fatalf("start the job in %s: %v", from.Name, err)
			}
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			t.Cleanup(func() { _ = cmd.Process.Kill() })
			server.waitSeen(t, 50, 60*time.Second)

			images := filepath.Join(dir, "images")
			if err := os.Mkdir(images, 0o700); err != nil {
				t.Fatal(err)
			}
			criuIn(t, from.Name, "dump", "-t", strconv.Itoa(cmd.Process.Pid), "-D", images, "--tcp-established",
				"--network-lock", "nftables", "-v4", "-o", "dump.log")
			select {
			case <-exited:
			case <-time.After(30 * time.Second):
				t.Fatal("the job still runs after criu dump")
			}
			atDump := server.seen.Load()
			before := neighbour(t, l, "node2", from.Addr.Addr())
			// node1 stays up with its own address; only the job's address leaves it.
			if err := jobnet.Delete(ctx, from.Name, from.ParentNetns); err != nil {
				t.Fatal(err)
			}
			if err := jobnet.Create(ctx, to); err != nil {
				t.Fatalf("create on spare1: %v", err)
			}
			pidfile := filepath.Join(dir, "restored.pid")
			criuIn(t, to.Name, "restore", "-D", images, "--tcp-established", "--network-lock", "nftables",
				"-d", "--pidfile", pidfile, "-v4", "-o", "restore.log")
			restoredAt := time.Now()
			restored := readPid(t, pidfile)
			t.Cleanup(func() { killWait(t, restored) })
			if garp {
				var out []byte
				err := jobnet.Do(to.Name, func() (err error) {
					out, err = exec.Command("arping", "-U", "-c", "1", "-I", jobnet.DefaultIfName, to.Addr.Addr().String()).CombinedOutput()
					return err
				})
				if err != nil {
					t.Fatalf("arping -U: %v\n%s", err, out)
				}
			}
			server.waitSeen(t, atDump+1, 120*time.Second)
			first := time.Since(restoredAt)
			server.waitSeen(t, atDump+100, 120*time.Second)
			took := time.Since(restoredAt)
			after := neighbour(t, l, "node2", to.Addr.Addr())
			t.Logf("%s: first counter %s, 100 more in order %s after restore; node2's neighbour entry for the job: before %q, after %q", tc.name, first.Round(time.Millisecond), took.Round(time.Millisecond), before, after)
			if err := unix.Kill(restored, 0); err != nil {
				t.Fatalf("the restored job (pid %d) is gone: %v", restored, err)
			}
			// node1 still has its own address and link.
			node1, _ := l.Host("node1")
			if err := l.Do("node2", func() error {
				c, err := net.DialTimeout("tcp4", netip.AddrPortFrom(node1.Addr.Addr(), 9).String(), 5*time.Second)
				if err == nil {
					c.Close()
				}
				var se syscall.Errno
				if errors.As(err, &se) && se == syscall.ECONNREFUSED {
					return nil // node1 answered with a reset: it is up at its own address
				}
				return err
			}); err != nil {
				t.Errorf("node1 at its own address after the move: %v", err)
			}
		})
	}
}

func readPid(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		t.Fatalf("pid file %s: %q", path, b)
	}
	return pid
}

// killWait SIGKILLs a process that is not our child and waits until it is gone.
func killWait(t *testing.T, pid int) {
	_ = unix.Kill(pid, unix.SIGKILL)
	for start := time.Now(); unix.Kill(pid, 0) == nil; time.Sleep(10 * time.Millisecond) {
		if time.Since(start) > 30*time.Second {
			t.Errorf("pid %d survives SIGKILL", pid)
			return
		}
	}
}

// jobMAC is the MAC address of the job's interface.
func jobMAC(t *testing.T, job string) string {
	t.Helper()
	var mac string
	err := jobnet.Do(job, func() error {
		lk, err := netlink.LinkByName(jobnet.DefaultIfName)
		if err == nil {
			mac = lk.Attrs().HardwareAddr.String()
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return mac
}

// TestJobNetIngressOnParent measures whether a TCX ingress program on the host's eth0 (where ackclamp
// attaches) sees the packets addressed to a macvlan job on that host: a counter of IPv4 packets to the job's
// address, attached to node1's eth0, must count node2's segments to the job.
func TestJobNetIngressOnParent(t *testing.T) {
	l := labtest.New(t, 2, 0)
	ctx := context.Background()
	a := jobSpec(t, l, "node1", jobnet.MACVlan, 1)
	if err := jobnet.Create(ctx, a); err != nil {
		t.Fatalf("create: %v", err)
	}
	counts, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Skipf("SKIPPED: cannot create BPF maps: %v", err)
	}
	defer counts.Close()
	ip := a.Addr.Addr().As4()
	dst := int32(binary.LittleEndian.Uint32(ip[:])) // the destination as a native load of its network-order bytes
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "jobnet_ingress", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			// bpf_skb_load_bytes(skb, 14+16 (the IPv4 destination), fp-8, 4)
			asm.Mov.Imm(asm.R2, 30),
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, -8),
			asm.Mov.Imm(asm.R4, 4),
			asm.FnSkbLoadBytes.Call(),
			asm.JNE.Imm(asm.R0, 0, "out"),
			asm.LoadMem(asm.R1, asm.RFP, -8, asm.Word),
			asm.JNE.Imm32(asm.R1, dst, "out"),
			asm.StoreImm(asm.RFP, -4, 0, asm.Word),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.LoadMapPtr(asm.R1, counts.FD()),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, "out"),
			asm.Mov.Imm(asm.R1, 1),
			asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
			asm.Mov.Imm(asm.R0, -1).WithSymbol("out"), // TCX_NEXT
			asm.Return(),
		},
	})
	if err != nil {
		t.Skipf("SKIPPED: cannot load a TCX program: %v", err)
	}
	defer prog.Close()
	err = l.Do("node1", func() error {
		lk, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		tcx, err := link.AttachTCX(link.TCXOptions{Interface: lk.Attrs().Index, Program: prog, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			return err
		}
		t.Cleanup(func() { tcx.Close() })
		return nil
	})
	if err != nil {
		t.Fatalf("attach TCX ingress to node1's eth0: %v", err)
	}
	jobAddr := netip.AddrPortFrom(a.Addr.Addr(), 7030).String()
	_, _ = listen(t, func(f func() error) error { return jobnet.Do(a.Name, f) }, jobAddr)
	var c net.Conn
	if err := l.Do("node2", func() (err error) { c, err = net.DialTimeout("tcp4", jobAddr, 10*time.Second); return err }); err != nil {
		t.Fatalf("dial the job from node2: %v", err)
	}
	defer c.Close()
	const segments = 20
	buf := make([]byte, 100)
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	for range segments { // one round trip each: at least one packet to the job per round
		if _, err := c.Write(buf); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatal(err)
		}
	}
	var n uint64
	if err := counts.Lookup(uint32(0), &n); err != nil {
		t.Fatal(err)
	}
	t.Logf("TCX ingress on node1's eth0 counted %d packets to the job's address %v", n, a.Addr.Addr())
	if n < segments {
		t.Fatalf("TCX ingress on the parent counted %d packets to the job, want at least %d", n, segments)
	}
}

// TestWithdraw: Withdraw takes the job's address off its interface, so that a socket the job closes after
// it (as a kill closes them) sends nothing: its FIN is dropped for want of a route (the namespace's
// OutNoRoutes counts it) and the peer on node2 reads no end of stream; the network is still there for
// Delete, which then removes it.
func TestWithdraw(t *testing.T) {
	l := labtest.New(t, 2, 0)
	ctx := context.Background()
	a := jobSpec(t, l, "node1", jobnet.MACVlan, 1)
	if err := jobnet.Create(ctx, a); err != nil {
		t.Fatal(err)
	}
	node2, _ := l.Host("node2")
	to := netip.AddrPortFrom(node2.Addr.Addr(), 7003).String()
	var ln net.Listener
	if err := l.Do("node2", func() (err error) { ln, err = net.Listen("tcp4", to); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c
		}
	}()
	var c net.Conn
	if err := jobnet.Do(a.Name, func() (err error) { c, err = net.DialTimeout("tcp4", to, 10*time.Second); return err }); err != nil {
		t.Fatal(err)
	}
	var peer net.Conn
	select {
	case peer = <-accepted:
		defer peer.Close()
	case <-time.After(30 * time.Second):
		t.Fatal("node2 accepted no connection")
	}
	// Read in the job's network from this thread: /proc/net is the network of the process's main thread
	// (ci133 read the root namespace's counter there, which did not move), /proc/thread-self/net this one's.
	noRoutes := func() int {
		t.Helper()
		var b []byte
		if err := jobnet.Do(a.Name, func() (err error) { b, err = os.ReadFile("/proc/thread-self/net/snmp"); return err }); err != nil {
			t.Fatal(err)
		}
		return snmpField(t, b, "Ip:", "OutNoRoutes")
	}
	before := noRoutes()

	for range 2 { // idempotent
		if err := jobnet.Withdraw(a.Name); err != nil {
			t.Fatal(err)
		}
	}
	if err := jobnet.Do(a.Name, func() error {
		lk, err := netlink.LinkByName(jobnet.DefaultIfName)
		if err != nil {
			return err
		}
		addrs, err := netlink.AddrList(lk, netlink.FAMILY_ALL)
		if len(addrs) > 0 {
			t.Errorf("addresses left on the job's interface: %v", addrs)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The job's socket as the job's network sees it: its state in /proc/net/tcp (hex), and the table.
	port := c.LocalAddr().(*net.TCPAddr).Port
	sockState := func() (state, table string) {
		t.Helper()
		var b []byte
		if err := jobnet.Do(a.Name, func() (err error) { b, err = os.ReadFile("/proc/thread-self/net/tcp"); return err }); err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) > 3 && strings.HasSuffix(f[1], fmt.Sprintf(":%04X", port)) {
				return f[3], string(b)
			}
		}
		return "none", string(b)
	}
	c.Close()
	// Closed: the FIN is queued (FIN_WAIT1, 04) and finds no route, so it stays there; a FIN that left
	// would be acknowledged by node2 at once (FIN_WAIT2) and node2 would read the end of the stream.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		st, table := sockState()
		if st == "04" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the job's closed socket (port %d) is in state %s, not FIN_WAIT1 (04), OutNoRoutes +%d; /proc/net/tcp:\n%s", port, st, noRoutes()-before, table)
		}
	}
	peer.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, err := peer.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("node2 read %d bytes, %v after the job closed its withdrawn socket; want nothing", n, err)
	}
	if st, table := sockState(); st != "04" {
		t.Errorf("200 ms after its close the job's socket is in state %s, not FIN_WAIT1: its FIN left; /proc/net/tcp:\n%s", st, table)
	}
	if n := noRoutes() - before; n < 1 {
		t.Errorf("the job's FIN was never tried (OutNoRoutes +%d)", n)
	} else {
		t.Logf("the FIN was tried %d time(s) and found no route (OutNoRoutes)", n)
	}
	if ok, err := jobnet.Exists(a.Name); err != nil || !ok {
		t.Fatalf("Exists(%s) = %v, %v after Withdraw; want the network still there for Delete", a.Name, ok, err)
	}
	if err := jobnet.Delete(ctx, a.Name, a.ParentNetns); err != nil {
		t.Fatal(err)
	}
	if err := jobnet.Withdraw(a.Name); err != nil {
		t.Errorf("Withdraw of a deleted network: %v", err)
	}
}

// snmpField reads field of the /proc/net/snmp line pair whose prefix is proto.
func snmpField(t *testing.T, snmp []byte, proto, field string) int {
	t.Helper()
	lines := strings.Split(string(snmp), "\n")
	for i := 0; i+1 < len(lines); i++ {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) == 0 || names[0] != proto || len(values) != len(names) || values[0] != proto {
			continue
		}
		for k, n := range names {
			if n == field {
				v, err := strconv.Atoi(values[k])
				if err != nil {
					t.Fatalf("%s %s: %v", proto, field, err)
				}
				return v
			}
		}
	}
	t.Fatalf("no %s %s in /proc/net/snmp", proto, field)
	return 0
}
