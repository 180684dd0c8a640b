//go:build linux

package capture

// Test fixtures: the re-executed test binary as sender and receiver inside lab
// hosts, cgroup v2 children to start senders in, and a loss injector.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/lab"
)

// roleEnv selects a child role when the test binary is re-executed.
const roleEnv = "FTKIT_CAPTURE_TEST_ROLE"

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
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
//	recv: listen on FTKIT_ADDR, print "ready", accept one connection. With
//	      FTKIT_PAUSE_AT=N read exactly N bytes, print "read N" and wait for
//	      a line on stdin. Read to EOF, print "<bytes> <sha256 hex>".
//	send: connect to FTKIT_ADDR, print "conn <local addr:port> <write_seq>",
//	      send testStream(FTKIT_SEED, FTKIT_SIZE) in writes of 1 B .. 1 MiB,
//	      close, print "sent <bytes>".
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
		h := sha256.New()
		var n int64
		if p := os.Getenv("FTKIT_PAUSE_AT"); p != "" {
			at, err := strconv.ParseInt(p, 10, 64)
			if err != nil {
				return err
			}
			if n, err = io.CopyN(h, c, at); err != nil {
				return err
			}
			fmt.Printf("read %d\n", n)
			if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
				return fmt.Errorf("wait for go-ahead on stdin: %w", err)
			}
		}
		m, err := io.CopyBuffer(h, c, make([]byte, 1<<20))
		if err != nil {
			return err
		}
		fmt.Printf("%d %x\n", n+m, h.Sum(nil))
		return nil
	case "send":
		seed, err := strconv.ParseUint(os.Getenv("FTKIT_SEED"), 10, 64)
		if err != nil {
			return fmt.Errorf("FTKIT_SEED: %w", err)
		}
		size, err := strconv.Atoi(os.Getenv("FTKIT_SIZE"))
		if err != nil {
			return fmt.Errorf("FTKIT_SIZE: %w", err)
		}
		c, err := net.Dial("tcp4", addr)
		if err != nil {
			return err
		}
		seq, err := writeSeq(c.(*net.TCPConn))
		if err != nil {
			return err
		}
		fmt.Printf("conn %s %d\n", c.LocalAddr(), seq)
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
	}
	return fmt.Errorf("unknown role %q", role)
}

// tcpSendQueue is TCP_SEND_QUEUE for TCP_REPAIR_QUEUE (include/uapi/linux/tcp.h).
const tcpSendQueue = 2

// writeSeq reads the socket's write_seq (the sequence number of the next byte
// written) through TCP repair mode, the way CRIU does: an independent check
// that the log is keyed by the real TCP sequence numbers.
func writeSeq(c *net.TCPConn) (uint32, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var seq int
	var serr error
	err = rc.Control(func(fd uintptr) {
		if serr = unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_REPAIR, 1); serr != nil {
			serr = fmt.Errorf("enter TCP repair mode: %w", serr)
			return
		}
		// Leave without a window probe: it would be an extra segment.
		defer unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_OFF_NO_WP)
		if serr = unix.SetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_REPAIR_QUEUE, tcpSendQueue); serr != nil {
			serr = fmt.Errorf("select the send queue: %w", serr)
			return
		}
		seq, serr = unix.GetsockoptInt(int(fd), unix.SOL_TCP, unix.TCP_QUEUE_SEQ)
	})
	return uint32(seq), errors.Join(err, serr)
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

// testCgroup is a child of the cgroup v2 root.
type testCgroup struct {
	path string
	fd   int // for CLONE_INTO_CGROUP
}

func cgroup2Mount(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		t.Fatalf("read mounts: %v", err)
	}
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) > 2 && f[2] == "cgroup2" {
			return f[1]
		}
	}
	t.Skip("SKIPPED: no cgroup2 hierarchy is mounted; capture filters by cgroup v2 and cannot be tested")
	return ""
}

// newCgroup creates a child cgroup, removed at the end of the test (after the
// processes started in it, whose cleanups run first).
func newCgroup(t *testing.T, name string) *testCgroup {
	t.Helper()
	dir := filepath.Join(cgroup2Mount(t), fmt.Sprintf("ftkit-capture-test-%d-%s", os.Getpid(), name))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		_ = syscall.Rmdir(dir)
		t.Fatalf("open cgroup: %v", err)
	}
	t.Cleanup(func() {
		syscall.Close(fd)
		// A just-reaped cgroup can stay busy for a moment.
		var err error
		for range 100 {
			if err = syscall.Rmdir(dir); err == nil || errors.Is(err, syscall.ENOENT) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("remove cgroup %s: %v", dir, err)
	})
	return &testCgroup{path: dir, fd: fd}
}

// child is a running re-executed test binary.
type child struct {
	role   string
	lines  chan string
	stdin  io.WriteCloser
	stderr *syncBuffer
}

// startChild starts role on host, in cg if not nil, with env added. The
// process is killed and reaped at the end of the test.
func startChild(t *testing.T, l *lab.Lab, host string, cg *testCgroup, role string, env ...string) *child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), append(env, roleEnv+"="+role)...)
	if cg != nil {
		// Born in the cgroup (clone3 CLONE_INTO_CGROUP): its sockets can
		// never be created in another one.
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cg.fd}
	}
	c := &child{role: role, lines: make(chan string, 16), stderr: &syncBuffer{}}
	cmd.Stderr = c.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := l.Start(host, cmd); err != nil {
		t.Fatalf("start %s child on %s: %v", role, host, err)
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
			t.Fatalf("%s child exited without output; stderr: %s", c.role, c.stderr.String())
		}
		return l
	case <-ctx.Done():
		t.Fatalf("waiting for %s child output: %v; stderr: %s", c.role, ctx.Err(), c.stderr.String())
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

// injectLoss drops permille/1000 of the packets longer than 200 bytes that
// arrive on host's eth0: random loss on the link into host, so the sender's
// TCP recovers with real retransmissions (fast retransmit, RTO) after the
// logger has logged the lost segments. Handshakes and pure ACKs are spared to
// keep the test's timing predictable.
//
// This kernel is built without sch_netem (CONFIG_NET_SCH_NETEM is not set), so
// loss is injected with a TCX ingress program instead of a netem qdisc; it is
// detached at the end of the test.
func injectLoss(t *testing.T, l *lab.Lab, host string, permille int32) {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:    "ftkit_test_loss",
		Type:    ebpf.SchedCLS,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R6, asm.R1, 0, asm.Word), // skb->len
			asm.JLT.Imm(asm.R6, 200, "pass"),
			asm.FnGetPrandomU32.Call(),
			asm.Mod.Imm(asm.R0, 1000),
			asm.JLT.Imm(asm.R0, permille, "drop"),
			asm.Mov.Imm(asm.R0, -1).WithSymbol("pass"), // TCX_NEXT
			asm.Return(),
			asm.Mov.Imm(asm.R0, 2).WithSymbol("drop"), // TCX_DROP
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("load loss injector: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	var lk link.Link
	err = l.Do(host, func() error {
		nl, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		lk, err = link.AttachTCX(link.TCXOptions{Interface: nl.Attrs().Index, Program: prog, Attach: ebpf.AttachTCXIngress})
		return err
	})
	if err != nil {
		t.Fatalf("attach loss injector to %s eth0 ingress: %v", host, err)
	}
	t.Cleanup(func() {
		if err := lk.Close(); err != nil {
			t.Errorf("detach loss injector: %v", err)
		}
	})
}
