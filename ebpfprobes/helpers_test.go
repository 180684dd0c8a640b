//go:build linux

package ebpfprobes

// Test fixtures: network namespaces joined by a veth pair, a cgroup v2 child,
// and child processes (this test binary re-executed) started inside them.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// childEnv selects a child role when the test binary is re-executed.
const childEnv = "FTKIT_TCPLOG_TEST_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		// A child must never outlive a crashed test run for long.
		time.AfterFunc(2*time.Minute, func() { os.Exit(3) })
		if err := runChild(role); err != nil {
			fmt.Fprintf(os.Stderr, "child %s: %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runChild runs a child role, configured by environment variables.
//
//	recv: listen on FTKIT_ADDR, print "ready", accept one connection, read
//	      it to EOF, print "<bytes> <sha256 hex>".
//	send: connect to FTKIT_ADDR (from local port FTKIT_LPORT if set), print
//	      "port <local port>", send testStream(FTKIT_SEED, FTKIT_SIZE) in
//	      writes of varied sizes, close, print "sent <bytes>".
//	sendwait: connect to FTKIT_ADDR, print "port <local port>", then for
//	      each size in the comma-separated FTKIT_SIZES send that many bytes
//	      of testStream(FTKIT_SEED, total) in writes of varied sizes, print
//	      "sent <bytes so far>" and wait for a line on stdin; then close
//	      and print "closed".
func runChild(role string) error {
	addr := os.Getenv("FTKIT_ADDR")
	switch role {
	case "recv":
		ln, err := net.Listen("tcp4", addr)
		if err != nil {
			return err
		}
		fmt.Println("ready")
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		h := newSHA()
		n, err := io.CopyBuffer(h, c, make([]byte, 1<<20))
		if err != nil {
			return err
		}
		fmt.Printf("%d %x\n", n, h.Sum(nil))
		return nil
	case "send":
		var seed uint64
		var size, lport int
		if _, err := fmt.Sscan(os.Getenv("FTKIT_SEED")+" "+os.Getenv("FTKIT_SIZE"), &seed, &size); err != nil {
			return fmt.Errorf("parse FTKIT_SEED/FTKIT_SIZE: %w", err)
		}
		if p := os.Getenv("FTKIT_LPORT"); p != "" {
			if _, err := fmt.Sscan(p, &lport); err != nil {
				return err
			}
		}
		d := net.Dialer{LocalAddr: &net.TCPAddr{Port: lport}}
		c, err := d.Dial("tcp4", addr)
		if err != nil {
			return err
		}
		fmt.Printf("port %d\n", c.LocalAddr().(*net.TCPAddr).Port)
		data := testStream(seed, size)
		sizes := rand.New(rand.NewPCG(seed, 2))
		for off := 0; off < len(data); {
			// 1 B .. 1 MiB, log-uniform: many small writes, some huge.
			n := min(sizes.IntN(1<<sizes.IntN(21))+1, len(data)-off)
			if _, err := c.Write(data[off : off+n]); err != nil {
				return err
			}
			off += n
		}
		if err := c.Close(); err != nil {
			return err
		}
		fmt.Printf("sent %d\n", len(data))
		return nil
	case "sendwait":
		var seed uint64
		if _, err := fmt.Sscan(os.Getenv("FTKIT_SEED"), &seed); err != nil {
			return fmt.Errorf("parse FTKIT_SEED: %w", err)
		}
		var sizes []int
		total := 0
		for f := range strings.SplitSeq(os.Getenv("FTKIT_SIZES"), ",") {
			var n int
			if _, err := fmt.Sscan(f, &n); err != nil {
				return fmt.Errorf("parse FTKIT_SIZES: %w", err)
			}
			sizes = append(sizes, n)
			total += n
		}
		c, err := net.Dial("tcp4", addr)
		if err != nil {
			return err
		}
		fmt.Printf("port %d\n", c.LocalAddr().(*net.TCPAddr).Port)
		data := testStream(seed, total)
		rnd := rand.New(rand.NewPCG(seed, 3))
		in := bufio.NewScanner(os.Stdin)
		off := 0
		for _, size := range sizes {
			for end := off + size; off < end; {
				n := min(rnd.IntN(1<<rnd.IntN(18))+1, end-off)
				if _, err := c.Write(data[off : off+n]); err != nil {
					return err
				}
				off += n
			}
			fmt.Printf("sent %d\n", off)
			if !in.Scan() {
				return fmt.Errorf("stdin closed before the go-ahead: %v", in.Err())
			}
		}
		if err := c.Close(); err != nil {
			return err
		}
		fmt.Println("closed")
		return nil
	}
	return fmt.Errorf("unknown role %q", role)
}

// testStream is the pseudo-random byte stream a sender sends.
func testStream(seed uint64, size int) []byte {
	var key [32]byte
	for i := range 8 {
		key[i] = byte(seed >> (8 * i))
	}
	b := make([]byte, size)
	_, _ = rand.NewChaCha8(key).Read(b)
	return b
}

// withNS runs fn on an OS thread switched into ns. If the thread cannot be
// switched back it is left locked, so the runtime discards it.
func withNS(ns netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("get current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			errc <- fmt.Errorf("enter netns: %w", err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("return to original netns: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// newNS creates an unnamed network namespace; closing the handle (and the
// exit of every process in it) destroys it.
func newNS(t *testing.T) netns.NsHandle {
	t.Helper()
	hc := make(chan netns.NsHandle, 1)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		ns, err := netns.New() // also moves this thread into it
		if err != nil {
			errc <- err
			return
		}
		if err := netns.Set(orig); err != nil {
			ns.Close()
			errc <- err
			return // thread stays locked and dies
		}
		runtime.UnlockOSThread()
		hc <- ns
	}()
	select {
	case err := <-errc:
		t.Fatalf("create network namespace: %v", err)
	case ns := <-hc:
		t.Cleanup(func() { ns.Close() })
		return ns
	}
	return 0
}

// testNet is two namespaces, a (sender) and b (receiver), joined by a veth.
type testNet struct {
	a, b     netns.NsHandle
	ifindexA int    // the veth end in a
	ifindexB int    // the veth end in b
	ipA, ipB net.IP // 10.250.7.1 and 10.250.7.2
}

func newTestNet(t *testing.T) *testNet {
	t.Helper()
	tn := &testNet{
		a:   newNS(t),
		b:   newNS(t),
		ipA: net.IPv4(10, 250, 7, 1).To4(),
		ipB: net.IPv4(10, 250, 7, 2).To4(),
	}
	ha, err := netlink.NewHandleAt(tn.a)
	if err != nil {
		t.Fatalf("netlink handle in netns a: %v", err)
	}
	t.Cleanup(ha.Close)
	hb, err := netlink.NewHandleAt(tn.b)
	if err != nil {
		t.Fatalf("netlink handle in netns b: %v", err)
	}
	t.Cleanup(hb.Close)

	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: "ftlog-a"},
		PeerName:      "ftlog-b",
		PeerNamespace: netlink.NsFd(int(tn.b)),
	}
	if err := ha.LinkAdd(veth); err != nil {
		t.Fatalf("create veth pair: %v", err)
	}
	// Deleting one end deletes the pair; the namespaces' end would too.
	t.Cleanup(func() {
		if err := ha.LinkDel(veth); err != nil {
			t.Logf("delete veth: %v", err)
		}
	})
	for _, side := range []struct {
		h    *netlink.Handle
		name string
		ip   net.IP
	}{{ha, "ftlog-a", tn.ipA}, {hb, "ftlog-b", tn.ipB}} {
		l, err := side.h.LinkByName(side.name)
		if err != nil {
			t.Fatalf("find %s: %v", side.name, err)
		}
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: side.ip, Mask: net.CIDRMask(24, 32)}}
		if err := side.h.AddrAdd(l, addr); err != nil {
			t.Fatalf("address %s: %v", side.name, err)
		}
		if err := side.h.LinkSetUp(l); err != nil {
			t.Fatalf("set %s up: %v", side.name, err)
		}
		if lo, err := side.h.LinkByName("lo"); err == nil {
			_ = side.h.LinkSetUp(lo)
		}
		if side.h == ha {
			tn.ifindexA = l.Attrs().Index
		} else {
			tn.ifindexB = l.Attrs().Index
		}
	}
	return tn
}

// testCgroup is a child cgroup of the cgroup v2 hierarchy.
type testCgroup struct {
	path string
	id   uint64 // the directory's inode number: what bpf_skb_cgroup_id returns
	fd   int    // for CLONE_INTO_CGROUP
}

func cgroup2Mount(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		t.Fatalf("read mounts: %v", err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) > 2 && f[2] == "cgroup2" {
			return f[1]
		}
	}
	t.Skip("SKIPPED: no cgroup2 hierarchy is mounted; the cgroup filter cannot be tested")
	return ""
}

func newCgroup(t *testing.T, name string) *testCgroup {
	t.Helper()
	dir := filepath.Join(cgroup2Mount(t), fmt.Sprintf("ftkit-tcplog-test-%d-%s", os.Getpid(), name))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatalf("stat cgroup: %v", err)
	}
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open cgroup: %v", err)
	}
	t.Cleanup(func() {
		syscall.Close(fd)
		// Runs after the children's cleanups (LIFO); a just-reaped cgroup
		// can stay busy for a moment.
		var err error
		for range 50 {
			if err = syscall.Rmdir(dir); err == nil || errors.Is(err, syscall.ENOENT) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("remove cgroup %s: %v", dir, err)
	})
	return &testCgroup{path: dir, id: st.Ino, fd: fd}
}

// child is a running re-executed test binary.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser // roles that wait for a go-ahead read lines from it
	lines  chan string
	stderr *syncBuffer
}

// startChild starts role in ns, in cgroup cg if not nil, with env added.
func startChild(t *testing.T, ns netns.NsHandle, cg *testCgroup, role string, env ...string) *child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), append(env, childEnv+"="+role)...)
	if cg != nil {
		// Born in the cgroup (clone3 CLONE_INTO_CGROUP): its sockets can
		// never be created in another one.
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cg.fd}
	}
	c := &child{cmd: cmd, lines: make(chan string, 16), stderr: &syncBuffer{}}
	cmd.Stderr = c.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	// A child inherits the network namespace of the thread that forks it.
	if err := withNS(ns, cmd.Start); err != nil {
		t.Fatalf("start %s child: %v", role, err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() && c.stderr.Len() > 0 {
			t.Logf("%s child stderr:\n%s", role, c.stderr.String())
		}
	})
	return c
}

// line waits for the child's next line of output.
func (c *child) line(ctx context.Context, t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-c.lines:
		if !ok {
			t.Fatalf("child exited without output; stderr: %s", c.stderr.String())
		}
		return l
	case <-ctx.Done():
		t.Fatalf("waiting for child output: %v; stderr: %s", ctx.Err(), c.stderr.String())
	}
	return ""
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (s *syncBuffer) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Len()
}
