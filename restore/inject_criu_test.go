//go:build linux

package restore

// End-to-end with CRIU: a job's unread receive queue is taken out of its snapshot (image.ClearReceive)
// and delivered after the restore by InjectFromPeer, one receive call at a time, while its real peer on
// another host stays connected (docs/tcp-relocation.md, "Injecting the peer's bytes").

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/tcpflow"
)

// inqHolderRole listens on FTKIT_ADDR and accepts one connection. Once FTKIT_N bytes are queued unread it
// writes FTKIT_DIR/queued; then, for each SIGUSR1, it makes one read with a 1 MiB buffer and writes what
// it got to FTKIT_DIR/read-<k>.bin (k = 1, 2, ...).
func inqHolderRole() error {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	dir := os.Getenv("FTKIT_DIR")
	want, err := strconv.Atoi(os.Getenv("FTKIT_N"))
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp4", os.Getenv("FTKIT_ADDR"))
	if err != nil {
		return err
	}
	c, err := ln.Accept()
	if err != nil {
		return err
	}
	ln.Close()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		return err
	}
	for {
		var n int
		var ierr error
		if err := rc.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }); err != nil || ierr != nil {
			return errors.Join(err, ierr)
		}
		if n == want {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	put := func(name string, b []byte) error {
		if err := os.WriteFile(filepath.Join(dir, name+".tmp"), b, 0o600); err != nil {
			return err
		}
		return os.Rename(filepath.Join(dir, name+".tmp"), filepath.Join(dir, name))
	}
	if err := put("queued", nil); err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for k := 1; ; k++ {
		<-sig
		n, err := c.Read(buf)
		if err != nil {
			return put(fmt.Sprintf("read-%d.err", k), []byte(err.Error()))
		}
		if err := put(fmt.Sprintf("read-%d.bin", k), buf[:n]); err != nil {
			return err
		}
	}
}

// waitFile waits until path exists and returns its content.
func waitFile(ctx context.Context, t *testing.T, path string) []byte {
	t.Helper()
	for {
		if b, err := os.ReadFile(path); err == nil {
			return b
		}
		if b, err := os.ReadFile(path[:len(path)-len(".bin")] + ".err"); err == nil {
			t.Fatalf("%s: %s", path, b)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", path, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// TestInjectIntoRestoredSocket: a job on node1 holds 100000 unread bytes from its peer on node2 when CRIU
// dumps it (kill variant). The snapshot's receive queue is cleared (image.ReceiveQueue, then
// image.ClearReceive), the job restored on node1, and the queue's bytes injected from the peer's address
// in two parts, each read by one read call of the restored job: the first read returns exactly part 1,
// the second exactly part 2. The peer, live throughout and long past those bytes (its snd_una), drops the
// restored socket's ACKs of them that lie more than its max_window below its snd_una (challenge ACKs) and
// ignores the others; it retransmits nothing. Then fresh bytes from the peer reach the job.
func TestInjectIntoRestoredSocket(t *testing.T) {
	labtest.RequireRoot(t)
	if _, err := os.Stat(criuBin); err != nil {
		t.Fatalf("CRIU 4.2.1 is needed at %s (run `make setup`): %v", criuBin, err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	l := labtest.New(t, 2, 0)
	node1, _ := l.Host("node1")
	node2, _ := l.Host("node2")
	conn := tcpflow.Tuple{Local: netip.AddrPortFrom(node1.Addr.Addr(), 7350), Remote: netip.AddrPortFrom(node2.Addr.Addr(), 7351)}
	const n = 100000
	data := streamBytes(tagInject, 0, n)

	work := t.TempDir()
	images := filepath.Join(work, "images")
	if err := os.Mkdir(images, 0o700); err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	job := exec.Command(exe)
	job.Env = append(os.Environ(), streamtest.RoleEnv+"=inq-holder", "FTKIT_ADDR="+conn.Local.String(), "FTKIT_DIR="+work, "FTKIT_N="+strconv.Itoa(n))
	job.Stdin, job.Stdout, job.Stderr = null, null, null
	job.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID, Setsid: true}
	if err := l.Start("node1", job); err != nil {
		t.Fatal(err)
	}
	jobDone := make(chan struct{})
	go func() { job.Wait(); close(jobDone) }()
	t.Cleanup(func() { job.Process.Kill(); <-jobDone })

	// The peer: this test, in node2's namespace.
	var c net.Conn
	if err := l.Do("node2", func() (err error) {
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(conn.Remote)}
		for {
			if c, err = d.DialContext(ctx, "tcp4", conn.Local.String()); err == nil || ctx.Err() != nil {
				return err
			}
			time.Sleep(20 * time.Millisecond) // the job is not listening yet
		}
	}); err != nil {
		t.Fatal(err)
	}
	peer := c.(*net.TCPConn)
	t.Cleanup(func() { peer.Close() })
	writeAll(t, peer, data)
	waitFile(ctx, t, filepath.Join(work, "queued"))
	waitFor(ctx, t, "the peer's bytes acknowledged", func() bool { return queued(t, peer, unix.SIOCOUTQ) == 0 })

	rcvState := func(what string) {
		socks, err := l.TCPSockets("node1")
		if err != nil {
			t.Fatal(err)
		}
		i := socks[conn]
		t.Logf("%s socket: rcv_ssthresh %d (bounds the window it offers) rcv_space %d rcv_wscale %d rcv_mss %d",
			what, i.Rcv_ssthresh, i.Rcv_space, i.Rcv_wscale, i.Rcv_mss)
	}
	rcvState("original")
	dumper := streamtest.StartT(t, l, "node1", nil, "criu-dump", fmt.Sprintf("FTKIT_PID=%d", job.Process.Pid), "FTKIT_DIR="+images, "FTKIT_KILL=1")
	t.Logf("job snapshot: %s", dumper.LineT(ctx, t))
	<-jobDone

	conns, err := image.TCPConnections(images)
	if err != nil {
		t.Fatal(err)
	}
	if len(conns) != 1 || conns[0].Tuple != conn || conns[0].InqLen != n {
		t.Fatalf("snapshot connections %+v, want %v with %d bytes queued", conns, conn, n)
	}
	ic := conns[0]
	q, err := image.ReceiveQueue(images, ic.Inode)
	if err != nil || !bytes.Equal(q, data) {
		t.Fatalf("receive queue in the snapshot: %d bytes (%v), want the peer's %d", len(q), err, n)
	}
	if err := image.Apply(images, ic.Inode, image.ClearReceive()); err != nil {
		t.Fatal(err)
	}
	if cleared, err := image.TCPConnections(images); err != nil || len(cleared) != 1 {
		t.Fatalf("snapshot after ClearReceive: %+v, %v", cleared, err)
	} else {
		c := cleared[0]
		t.Logf("ClearReceive: inq_seq %d -> %d, inq_len %d -> %d, rcv_wup %d -> %d, rcv_wnd %d -> %d (right edge %d -> %d)",
			ic.InqSeq, c.InqSeq, ic.InqLen, c.InqLen, ic.RcvWup, c.RcvWup, ic.RcvWnd, c.RcvWnd, ic.RcvWup+ic.RcvWnd, c.RcvWup+c.RcvWnd)
	}
	restorer := streamtest.StartT(t, l, "node1", nil, "criu-restore", "FTKIT_DIR="+images)
	line := restorer.LineT(ctx, t)
	var pid, ms int
	if _, err := fmt.Sscanf(line, "pid %d ms=%d", &pid, &ms); err != nil {
		t.Fatalf("restorer said %q", line)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatalf("pidfd of the restored job %d: %v", pid, err)
	}
	t.Cleanup(func() { unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0); unix.Close(pidfd) })

	rcvState("restored")
	// A restored socket counts tcpi_bytes_received from 0: its rcv_nxt is the image's plus that count
	// (what DeliverFromPeer's caller needs).
	received := func() uint64 {
		var r uint64
		if err := l.Do("node1", func() error { s, err := sockdiag.Lookup(conn); r = s.Received; return err }); err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := received(); r != 0 {
		t.Errorf("the restored socket's bytes_received is %d before any injection, want 0", r)
	}
	before := mibs(t, l, "node2")
	peerMaxWindow := int(repairWindow(t, peer)[2])
	seq := ic.InqSeq - ic.InqLen // the restored rcv_nxt
	part1 := 30000
	diag, err := l.TCPSockets("node2")
	if err != nil {
		t.Fatal(err)
	}
	for k, part := range [][]byte{data[:part1], data[part1:]} {
		h := PeerHeader{Seq: seq, Ack: ic.OutqSeq - ic.OutqLen, Window: uint16(min(0xffff, sockInfo(t, peer).Rcv_wnd>>diag[conn.Reverse()].Rcv_wscale)),
			TS: true, TSval: tcpClock(t, peer)}
		if err := l.Do("node1", func() error { return InjectFromPeer(conn, h, part) }); err != nil {
			t.Fatal(err)
		}
		waitFor(ctx, t, "the part queued at the restored socket", func() bool { return unread(t, l, "node1", conn) == len(part) })
		if err := unix.PidfdSendSignal(pidfd, unix.SIGUSR1, nil, 0); err != nil {
			t.Fatal(err)
		}
		got := waitFile(ctx, t, filepath.Join(work, fmt.Sprintf("read-%d.bin", k+1)))
		if !bytes.Equal(got, part) {
			t.Fatalf("read %d of the restored job returned %d bytes, want exactly the %d injected before it", k+1, len(got), len(part))
		}
		seq += uint32(len(part))
	}
	if r := received(); r != n {
		t.Errorf("the restored socket's bytes_received is %d after %d bytes were injected", r, n)
	}
	after := mibs(t, l, "node2")
	t.Logf("restored in %d ms; %d + %d bytes injected, each read whole; the peer's counters meanwhile: %s",
		ms, part1, n-part1, mibDiff(before, after))
	// The restored socket ACKs each injected byte. At the peer, whose snd_una is past all of them, an ack
	// within min(max_window, bytes_acked) below snd_una is old and ignored; an older one is dropped with a
	// challenge ACK (RFC 5961 5.2; rate-limited: TCPACKSkippedChallenge counts the ones not sent).
	challenges := after["TcpExt:TCPChallengeACK"] + after["TcpExt:TCPACKSkippedChallenge"] - before["TcpExt:TCPChallengeACK"] - before["TcpExt:TCPACKSkippedChallenge"]
	t.Logf("the peer's max_window %d, bytes_acked %d: %d of the restored socket's ACKs (the first of them almost %d bytes below its snd_una) were too old there",
		peerMaxWindow, sockInfo(t, peer).Bytes_acked, challenges, n)
	if n > peerMaxWindow+2*DefaultInjectPayload && challenges == 0 {
		t.Errorf("no challenge ACK at the peer for ACKs up to %d bytes below its snd_una, beyond its max_window %d", n, peerMaxWindow)
	}
	if rt := after["Tcp:RetransSegs"] - before["Tcp:RetransSegs"]; rt != 0 {
		t.Errorf("the peer retransmitted %d segments", rt)
	}

	fresh := streamBytes(tagInject, n, n+5000)
	writeAll(t, peer, fresh)
	waitFor(ctx, t, "the fresh bytes acknowledged", func() bool { return queued(t, peer, unix.SIOCOUTQ) == 0 })
	if err := unix.PidfdSendSignal(pidfd, unix.SIGUSR1, nil, 0); err != nil {
		t.Fatal(err)
	}
	if got := waitFile(ctx, t, filepath.Join(work, "read-3.bin")); !bytes.Equal(got, fresh) {
		t.Errorf("the restored job read %d bytes after the injection, want the peer's %d fresh ones", len(got), len(fresh))
	}
	rcvState("restored, after the injection")
}

// repairWindow is the socket's TCP_REPAIR_WINDOW (snd_wl1, snd_wnd, max_window, rcv_wnd, rcv_wup), read in
// repair mode, left without a window probe. Call it while the connection is quiet.
func repairWindow(t *testing.T, c *net.TCPConn) (w [5]uint32) {
	t.Helper()
	sockCtl(t, c, func(fd int) error {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_ON); err != nil {
			return fmt.Errorf("TCP_REPAIR on: %w", err)
		}
		defer unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_OFF_NO_WP)
		l := uint32(len(w) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.IPPROTO_TCP, unix.TCP_REPAIR_WINDOW,
			uintptr(unsafe.Pointer(&w[0])), uintptr(unsafe.Pointer(&l)), 0)
		if errno != 0 {
			return fmt.Errorf("TCP_REPAIR_WINDOW: %w", errno)
		}
		return nil
	})
	return w
}

// unread is the receive queue (bytes not yet read) of host's established socket conn, read with sock_diag.
func unread(t *testing.T, l *lab.Lab, host string, conn tcpflow.Tuple) int {
	t.Helper()
	n := -1
	if err := l.Do(host, func() error {
		socks, err := netlink.SocketDiagTCPInfo(unix.AF_INET)
		if err != nil {
			return err
		}
		for _, s := range socks {
			id := s.InetDiagMsg.ID
			src, _ := netip.AddrFromSlice(id.Source.To4())
			dst, _ := netip.AddrFromSlice(id.Destination.To4())
			if (tcpflow.Tuple{Local: netip.AddrPortFrom(src, id.SourcePort), Remote: netip.AddrPortFrom(dst, id.DestinationPort)}) == conn {
				n = int(s.InetDiagMsg.RQueue)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if n < 0 {
		t.Fatalf("no socket %s on %s", conn, host)
	}
	return n
}
