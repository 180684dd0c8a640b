package criu

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	gocriu "github.com/checkpoint-restore/go-criu/v7"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/testenv"
)

// The repair queue a socket in repair mode has selected (TCP_REPAIR_QUEUE, include/uapi/linux/tcp.h).
const (
	tcpNoQueue   = 0
	tcpSendQueue = 2
)

// senderRole is the child role of TestLiveDumpSelectsNoRepairQueue: connect to FTKIT_ADDR and write to
// it until killed.
const senderRole = "tcp-sender"

func runSender(addr string) int {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	buf := make([]byte, 1<<20)
	for {
		if _, err := c.Write(buf); err != nil {
			return 3
		}
	}
}

// TestRepairSendQueueSkipsTransmission pins the kernel fact behind patches/0001: while a socket is in
// repair mode with TCP_SEND_QUEUE selected, data that tcp_write_xmit releases (here, by the peer's window
// update) counts as sent (SIOCOUTQNSD falls) without being transmitted (tcpi_bytes_sent, counted per
// transmission, does not move). With TCP_NO_QUEUE selected the same bytes are transmitted.
func TestRepairSendQueueSkipsTransmission(t *testing.T) {
	testenv.RequireKernel(t, "a network namespace and TCP repair mode")
	for _, tc := range []struct {
		name        string
		queue       int
		transmitted bool
	}{
		{"send queue selected", tcpSendQueue, false},
		{"no queue selected", tcpNoQueue, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.Netns(t, "ftkit-criu-test")
			var ln net.Listener
			var snd net.Conn
			if err := netnsthread.In(ns, func() error {
				var err error
				if ln, err = net.Listen("tcp", "127.0.0.1:0"); err == nil {
					snd, err = net.Dial("tcp", ln.Addr().String())
				}
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			defer snd.Close()
			rcv, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer rcv.Close()
			if err := rcv.(*net.TCPConn).SetReadBuffer(64 << 10); err != nil {
				t.Fatal(err)
			}
			fd := sockFD(t, snd.(*net.TCPConn))
			// Fill the receiver's window and the send buffer: the rest waits unsent behind a zero window.
			buf := make([]byte, 1<<20)
			for {
				if _, err := unix.Write(fd, buf); err != nil {
					if err != unix.EAGAIN {
						t.Fatal(err)
					}
					break
				}
			}
			before := waitTCPInfo(t, fd, "every sent byte acknowledged and some unsent", func(i *unix.TCPInfo) bool {
				return i.Unacked == 0 && i.Notsent_bytes > 0
			})
			if err := unix.SetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR, 1); err != nil {
				t.Fatalf("turn repair mode on: %v", err)
			}
			if err := unix.SetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR_QUEUE, tc.queue); err != nil {
				t.Fatalf("select repair queue %d: %v", tc.queue, err)
			}
			defer unix.SetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_OFF_NO_WP)
			// The receiver empties its queue: its window opens and the update reaches the sender.
			if err := rcv.SetReadDeadline(time.Now().Add(time.Minute)); err != nil {
				t.Fatal(err)
			}
			if _, err := rcv.Read(make([]byte, 1<<20)); err != nil {
				t.Fatal(err)
			}
			after := waitTCPInfo(t, fd, "fewer unsent bytes than before the window update", func(i *unix.TCPInfo) bool {
				return i.Notsent_bytes < before.Notsent_bytes
			})
			released := int64(before.Notsent_bytes) - int64(after.Notsent_bytes)
			sent := int64(after.Bytes_sent - before.Bytes_sent)
			t.Logf("queue %d: %d unsent bytes released, %d bytes transmitted", tc.queue, released, sent)
			if tc.transmitted && sent < released {
				t.Errorf("with no queue selected, %d bytes left the send queue but only %d were transmitted", released, sent)
			}
			if !tc.transmitted && sent >= released {
				t.Errorf("with the send queue selected, the %d released bytes were transmitted (%d): the kernel no longer skips transmission there, and patches/0001 may no longer be needed", released, sent)
			}
		})
	}
}

// TestLiveDumpSelectsNoRepairQueue: the CRIU `make setup` builds leaves a live-dumped task's TCP socket with
// no repair queue selected for the rest of the dump (patches/0001), so nothing can make its unsent bytes
// count as sent without transmitting them (TestRepairSendQueueSkipsTransmission). CRIU 4.2.1 without the
// patch leaves TCP_SEND_QUEUE selected.
func TestLiveDumpSelectsNoRepairQueue(t *testing.T) {
	bin := requireCRIU(t, "CRIU and a network namespace")
	child, ns, _ := startSender(t)

	pidfd, err := unix.PidfdOpen(child.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pidfd)
	target := childTCPSocket(t, child.Process.Pid, pidfd)
	waitTCPInfoOf(t, pidfd, target, "unsent bytes behind the receiver's full window", func(i *unix.TCPInfo) bool {
		return i.Notsent_bytes > 0
	})

	nfy := &repairQueueProbe{pidfd: pidfd, fd: target}
	nfy.queue.Store(-1)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (Client{Binary: bin}).dump(ctx, DumpOptions{PID: child.Process.Pid, ImagesDir: t.TempDir(), LeaveRunning: true, Netns: ns}, nfy); err != nil {
		t.Fatal(err)
	}
	if nfy.err != nil {
		t.Fatalf("read the socket's repair queue at post-dump: %v", nfy.err)
	}
	if q := nfy.queue.Load(); q != tcpNoQueue {
		level, _ := BinaryPatchLevel(bin)
		t.Fatalf("after CRIU read the queues, the live task's socket still has repair queue %d selected (want %d, no queue): %s (patch level %d, want %d) lacks patches/0001", q, tcpNoQueue, bin, level, PatchLevel())
	}
}

// repairQueueProbe reads, when CRIU has dumped everything and not yet resumed the task (post-dump), which
// repair queue the task's socket has selected.
type repairQueueProbe struct {
	gocriu.NoNotify
	pidfd, fd int
	queue     atomic.Int64
	err       error
}

func (p *repairQueueProbe) PostDump() error {
	fd, err := unix.PidfdGetfd(p.pidfd, p.fd, 0)
	if err != nil {
		p.err = err
		return nil
	}
	defer unix.Close(fd)
	q, err := unix.GetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR_QUEUE)
	if err != nil {
		p.err = fmt.Errorf("TCP_REPAIR_QUEUE (EINVAL: the socket is not in repair mode): %w", err)
		return nil
	}
	p.queue.Store(int64(q))
	return nil
}

// sockFD returns a non-blocking descriptor of c's socket, closed with the test.
func sockFD(t *testing.T, c *net.TCPConn) int {
	t.Helper()
	f, err := c.File()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	fd := int(f.Fd())
	if err := unix.SetNonblock(fd, true); err != nil {
		t.Fatal(err)
	}
	return fd
}

// waitTCPInfo polls the TCP_INFO of fd until ok accepts it, for at most a minute.
func waitTCPInfo(t *testing.T, fd int, what string, ok func(*unix.TCPInfo) bool) *unix.TCPInfo {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		i, err := unix.GetsockoptTCPInfo(fd, unix.SOL_TCP, unix.TCP_INFO)
		if err != nil {
			t.Fatal(err)
		}
		if ok(i) {
			return i
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s within a minute: %+v", what, i)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitTCPInfoOf is waitTCPInfo on descriptor fd of the process behind pidfd.
func waitTCPInfoOf(t *testing.T, pidfd, fd int, what string, ok func(*unix.TCPInfo) bool) {
	t.Helper()
	dup, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dup)
	waitTCPInfo(t, dup, what, ok)
}

// childTCPSocket returns the descriptor number of the one TCP socket of process pid, waiting for it.
func childTCPSocket(t *testing.T, pid, pidfd int) int {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
			if err != nil || !strings.HasPrefix(link, "socket:") {
				continue
			}
			n, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			dup, err := unix.PidfdGetfd(pidfd, n, 0)
			if err != nil {
				continue
			}
			i, err := unix.GetsockoptTCPInfo(dup, unix.SOL_TCP, unix.TCP_INFO)
			unix.Close(dup)
			if err == nil && i.State == unix.BPF_TCP_ESTABLISHED {
				return n
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d has no established TCP socket after a minute", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// startSender starts a child of role senderRole in a network namespace of the test's own, in a session of
// its own (CRIU dumps it as a tree of its own), writing over TCP to a listener in that namespace that
// accepts its connection. It returns the child, the namespace and the accepted end, which reads nothing
// unless the test reads it; the test's cleanup kills the child.
func startSender(t *testing.T) (*exec.Cmd, string, net.Conn) {
	t.Helper()
	ns := testenv.Netns(t, "ftkit-criu-test")
	var ln net.Listener
	if err := netnsthread.In(ns, func() error {
		var err error
		ln, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command(self)
	child.Env = append(os.Environ(), "FTKIT_CRIU_TEST_ROLE="+senderRole, "FTKIT_ADDR="+ln.Addr().String())
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := netnsthread.In(ns, child.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	rcv, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rcv.Close() })
	return child, ns, rcv
}

// requireCRIU is the CRIU binary for a test that runs it: the test needs root (needs says what for) and
// a CRIU that Require accepts.
func requireCRIU(t *testing.T, needs string) string {
	t.Helper()
	testenv.RequireKernel(t, needs)
	bin, _, err := Require("")
	if err != nil {
		t.Fatal(err)
	}
	return bin
}
