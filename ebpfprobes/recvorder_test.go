//go:build linux

package ebpfprobes

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/tcpflow"
)

// recvOp is one receive call of the recvscript role.
type recvOp struct {
	conn int    // index of the accepted connection
	n    int    // buffer size
	mode string // recv, peek, read, waitall, dontwait; poll, epoll (a readiness call on conn, n ignored), wait (a line on stdin)
}

func (o recvOp) String() string { return fmt.Sprintf("%d:%d:%s", o.conn, o.n, o.mode) }

func formatScript(ops []recvOp) string {
	s := make([]string, len(ops))
	for i, o := range ops {
		s[i] = o.String()
	}
	return strings.Join(s, ",")
}

func parseScript(s string) ([]recvOp, error) {
	var ops []recvOp
	for f := range strings.SplitSeq(s, ",") {
		count := 1
		if i := strings.IndexByte(f, '*'); i >= 0 {
			var err error
			if count, err = strconv.Atoi(f[i+1:]); err != nil {
				return nil, fmt.Errorf("op %q: %w", f, err)
			}
			f = f[:i]
		}
		var o recvOp
		p := strings.Split(f, ":")
		if len(p) != 3 {
			return nil, fmt.Errorf("op %q: want conn:len:mode", f)
		}
		var err1, err2 error
		o.conn, err1 = strconv.Atoi(p[0])
		o.n, err2 = strconv.Atoi(p[1])
		o.mode = p[2]
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("op %q: %w", f, err)
		}
		for range count {
			ops = append(ops, o)
		}
	}
	return ops, nil
}

// recvScript is the recvscript child role: a server made of raw system
// calls on blocking sockets, so that each receive call is exactly one
// recvmsg. It listens on FTKIT_ADDR, prints "ready", accepts one connection
// per comma-separated byte count of FTKIT_EXPECT (printing "conn <i>" after
// each), waits until connection i holds that many bytes (SIOCINQ, not a
// receive), prints "pid <tgid> <tid>", runs the receive calls of
// FTKIT_SCRIPT (see parseScript; "eof" and "dontwait" calls must return 0 or
// EAGAIN, the others exactly len) on one thread, prints "done <ns per
// call>", writes "ok" to every connection and waits for a line on stdin.
func recvScript() error {
	ap, err := netip.ParseAddrPort(os.Getenv("FTKIT_ADDR"))
	if err != nil {
		return fmt.Errorf("FTKIT_ADDR: %w", err)
	}
	var expect []int
	for f := range strings.SplitSeq(os.Getenv("FTKIT_EXPECT"), ",") {
		n, err := strconv.Atoi(f)
		if err != nil {
			return fmt.Errorf("FTKIT_EXPECT: %w", err)
		}
		expect = append(expect, n)
	}
	ops, err := parseScript(os.Getenv("FTKIT_SCRIPT"))
	if err != nil {
		return fmt.Errorf("FTKIT_SCRIPT: %w", err)
	}
	runtime.LockOSThread() // one thread makes every call: one tid

	// An IPv6 address ([::]:port) makes a dual-stack listener, as Go's
	// net.Listen("tcp", ":port") does: its IPv4 connections are AF_INET6
	// sockets with IPv4-mapped addresses.
	family := unix.AF_INET
	if ap.Addr().Is6() {
		family = unix.AF_INET6
	}
	ln, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	if family == unix.AF_INET6 {
		if err := unix.SetsockoptInt(ln, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0); err != nil {
			return err
		}
	}
	if err := unix.SetsockoptInt(ln, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		return err
	}
	// Room for every byte of a cost run before the first read: the sender
	// never waits for the window.
	if err := unix.SetsockoptInt(ln, unix.SOL_SOCKET, unix.SO_RCVBUF, 8<<20); err != nil {
		return err
	}
	var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: ap.Addr().As16(), Port: int(ap.Port())}
	if family == unix.AF_INET {
		sa = &unix.SockaddrInet4{Addr: ap.Addr().As4(), Port: int(ap.Port())}
	}
	if err := unix.Bind(ln, sa); err != nil {
		return fmt.Errorf("bind %s: %w", ap, err)
	}
	if err := unix.Listen(ln, 8); err != nil {
		return err
	}
	fmt.Println("ready")
	conns, err := acceptQueued(ln, expect)
	if err != nil {
		return err
	}
	var gap time.Duration
	if g := os.Getenv("FTKIT_GAP_US"); g != "" {
		us, err := strconv.Atoi(g)
		if err != nil {
			return fmt.Errorf("FTKIT_GAP_US: %w", err)
		}
		gap = time.Duration(us) * time.Microsecond
	}
	var stamps []int64
	fmt.Printf("pid %d %d\n", os.Getpid(), unix.Gettid())
	buf := make([]byte, 1<<16)
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return err
	}
	for i, fd := range conns {
		if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(i)}); err != nil {
			return err
		}
	}
	start := time.Now()
	for _, o := range ops {
		// Spin: a sleep this short takes a millisecond in the Go runtime.
		for end := monoNow() + gap.Nanoseconds(); gap > 0 && monoNow() < end; {
		}
		fd := conns[o.conn]
		b := buf[:o.n]
		var n int
		var err error
		switch o.mode {
		case "recv", "eof":
			n, _, err = unix.Recvfrom(fd, b, 0)
		case "peek":
			n, _, err = unix.Recvfrom(fd, b, unix.MSG_PEEK)
		case "waitall":
			n, _, err = unix.Recvfrom(fd, b, unix.MSG_WAITALL)
		case "dontwait":
			n, _, err = unix.Recvfrom(fd, b, unix.MSG_DONTWAIT)
			if !errors.Is(err, unix.EAGAIN) {
				return fmt.Errorf("op %s: returned %d, %v; want EAGAIN", o, n, err)
			}
			continue
		case "read":
			n, err = unix.Read(fd, b)
		case "poll":
			_, err = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
			if err != nil {
				return fmt.Errorf("op %s: %w", o, err)
			}
			continue
		case "epoll":
			if _, err = unix.EpollWait(ep, make([]unix.EpollEvent, 4), 0); err != nil {
				return fmt.Errorf("op %s: %w", o, err)
			}
			continue
		case "wait":
			// A raw read of stdin: not a socket, not recorded.
			line := make([]byte, 1)
			for line[0] != '\n' {
				if _, err := unix.Read(0, line); err != nil {
					return fmt.Errorf("op %s: %w", o, err)
				}
			}
			continue
		default:
			return fmt.Errorf("op %s: unknown mode", o)
		}
		want := o.n
		if o.mode == "eof" {
			want = 0
		}
		if err != nil || n != want {
			return fmt.Errorf("op %s: returned %d, %v; want %d", o, n, err, want)
		}
		if gap > 0 {
			stamps = append(stamps, monoNow())
		}
	}
	fmt.Printf("done %d\n", time.Since(start).Nanoseconds()/int64(max(len(ops), 1)))
	if gap > 0 {
		fmt.Printf("stamps %s\n", strings.Trim(fmt.Sprint(stamps), "[]"))
	}
	for _, fd := range conns {
		if _, err := unix.Write(fd, []byte("ok")); err != nil {
			return fmt.Errorf("write ok: %w", err)
		}
	}
	_, _ = fmt.Scanln()
	return nil
}

// acceptQueued accepts one connection on listener ln per entry of need, printing "conn <i>" for each, then
// waits until connection i has need[i] bytes queued: the child roles' reads then find their bytes there.
func acceptQueued(ln int, need []int) ([]int, error) {
	conns := make([]int, len(need))
	for i := range conns {
		var err error
		if conns[i], _, err = unix.Accept4(ln, unix.SOCK_CLOEXEC); err != nil {
			return nil, fmt.Errorf("accept: %w", err)
		}
		fmt.Printf("conn %d\n", i)
	}
	for i, fd := range conns {
		for {
			n, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
			if err != nil {
				return nil, fmt.Errorf("SIOCINQ: %w", err)
			}
			if n >= need[i] {
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	return conns, nil
}

// monoNow is CLOCK_MONOTONIC in ns: one clock for every process.
func monoNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// newRecvOrderT loads a recorder with receive positions for a test, closed at its end.
func newRecvOrderT(t *testing.T, parent string, ring int) *RecvOrder {
	t.Helper()
	return newRecvOrderOptsT(t, RecvOrderOptions{CgroupParent: parent, RingBufferSize: ring, Positions: true})
}

func newRecvOrderOptsT(t *testing.T, opts RecvOrderOptions) *RecvOrder {
	t.Helper()
	requirePrivileges(t)
	r, err := NewRecvOrder(opts)
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load the receive-order recorder: %v", err)
	}
	if err != nil {
		t.Fatalf("NewRecvOrder: %+v", err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return r
}

// orderCollector reads a recorder's events until its context is done.
type orderCollector struct {
	mu     sync.Mutex
	events []RecvEvent
	err    error
	done   chan struct{}
}

func collectOrder(ctx context.Context, r *RecvOrder) *orderCollector {
	c := &orderCollector{done: make(chan struct{})}
	go func() {
		defer close(c.done)
		buf := make([]RecvEvent, 0, 64)
		for {
			var err error
			buf, err = r.ReadBatch(ctx, buf[:0])
			c.mu.Lock()
			c.events = append(c.events, buf...)
			c.mu.Unlock()
			if err != nil {
				if ctx.Err() == nil || !errors.Is(err, ctx.Err()) {
					c.err = err
				}
				return
			}
		}
	}()
	return c
}

// waitEvents waits until the collector holds n events.
func (c *orderCollector) waitEvents(ctx context.Context, t *testing.T, n int) []RecvEvent {
	t.Helper()
	for {
		c.mu.Lock()
		got := len(c.events)
		c.mu.Unlock()
		if got >= n {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %d receive events: have %d: %v", n, got, ctx.Err())
		case <-c.done:
			t.Fatalf("collector stopped with %d of %d events: %v", got, n, c.err)
		case <-time.After(time.Millisecond):
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]RecvEvent(nil), c.events...)
}

// dialFrom connects from host of tn to addr; the socket lives in host's
// namespace.
func dialFrom(t *testing.T, tn *testNet, host string, addr netip.AddrPort) *net.TCPConn {
	t.Helper()
	var c net.Conn
	err := tn.lab.Do(host, func() (err error) {
		c, err = net.Dial("tcp", addr.String())
		return err
	})
	if err != nil {
		t.Fatalf("dial %s from %s: %v", addr, host, err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

func addrPort(a net.Addr) netip.AddrPort { return a.(*net.TCPAddr).AddrPort() }

// TestRecvOrderSequence runs a server in a job cgroup (a child of the
// recorder's parent) that reads two connections in a known interleaving, with
// peeks, read(2), MSG_WAITALL, an EOF and an EAGAIN, and checks the exact
// events: connection, copied_seq as an offset from the first byte (the
// client's write_seq before it wrote, read through TCP repair), length,
// flags, pid and tid, job cgroup id. The client's own reads (this test
// process, outside the parent) are not recorded.
func TestRecvOrderSequence(t *testing.T) {
	// With positions, a call that found nothing is recorded too (a replay's stop point); without, it is not
	// (nothing uses it, and a polling program makes many).
	for _, positions := range []bool{true, false} {
		t.Run(fmt.Sprintf("positions=%v", positions), func(t *testing.T) { testRecvOrderSequence(t, positions) })
	}
}

func testRecvOrderSequence(t *testing.T, positions bool) {
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	rec := newRecvOrderOptsT(t, RecvOrderOptions{CgroupParent: parent.Dir, RingBufferSize: 64 << 10, Positions: positions})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cctx, stop := context.WithCancel(ctx)
	col := collectOrder(cctx, rec)
	defer func() { stop(); <-col.done }()

	const a, b = 0, 1
	ops := []recvOp{
		{a, 100, "recv"},
		{b, 7, "read"},
		{a, 5, "peek"},
		{a, 5, "recv"},
		{b, 13, "waitall"},
		{a, 15, "peek"},
		{a, 15, "read"},
		{b, 1, "eof"},      // returns 0: not recorded
		{a, 1, "dontwait"}, // EAGAIN: recorded with no bytes with positions, else not
	}
	sizes := []int{120, 20}
	srv := netip.AddrPortFrom(tn.ipB, 7301)
	child := streamtest.StartT(t, tn.lab, hostB, job, "recvscript",
		"FTKIT_ADDR="+srv.String(), "FTKIT_EXPECT=120,20", "FTKIT_SCRIPT="+formatScript(ops))
	if l := child.LineT(ctx, t); l != "ready" {
		t.Fatalf("server said %q, want ready", l)
	}
	clients := make([]*net.TCPConn, 2)
	bases := make([]uint32, 2)
	for i := range clients {
		clients[i] = dialFrom(t, tn, hostA, srv)
		if l := child.LineT(ctx, t); l != fmt.Sprintf("conn %d", i) {
			t.Fatalf("server said %q, want conn %d", l, i)
		}
		seq, err := streamtest.WriteSeq(clients[i])
		if err != nil {
			t.Fatalf("read the client's write_seq: %v", err)
		}
		bases[i] = seq
	}
	for i, c := range clients {
		if _, err := c.Write(streamtest.Stream(uint64(i), sizes[i])); err != nil {
			t.Fatal(err)
		}
	}
	if err := clients[b].CloseWrite(); err != nil {
		t.Fatal(err)
	}
	var pid, tid uint32
	if l := child.LineT(ctx, t); func() error { _, err := fmt.Sscanf(l, "pid %d %d", &pid, &tid); return err }() != nil {
		t.Fatalf("server said %q, want pid <tgid> <tid>", l)
	}
	if l := child.LineT(ctx, t); !strings.HasPrefix(l, "done ") {
		t.Fatalf("server said %q, want done", l)
	}
	// The test reads the server's answer outside the parent: not recorded.
	for _, c := range clients {
		buf := make([]byte, 2)
		if _, err := c.Read(buf); err != nil || string(buf) != "ok" {
			t.Fatalf("read the server's answer: %q, %v", buf, err)
		}
	}
	if _, err := fmt.Fprintln(child.Stdin); err != nil {
		t.Fatal(err)
	}
	if err := child.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}

	type want struct {
		conn  int
		off   uint32 // copied_seq - first byte
		len   uint32
		flags uint32
		fin   bool // the call may also have consumed the FIN: off or off+1
	}
	wants := []want{
		{a, 100, 100, 0, false},
		{b, 7, 7, 0, false},
		{a, 100, 5, unix.MSG_PEEK, false},
		{a, 105, 5, 0, false},
		// B's last bytes: a FIN in the same skb is consumed with them (the
		// client closed before the server read).
		{b, 20, 13, unix.MSG_WAITALL, true},
		{a, 105, 15, unix.MSG_PEEK, false},
		{a, 120, 15, 0, false},
	}
	if positions {
		wants = append(wants, want{a, 120, 0, unix.MSG_DONTWAIT, false}) // EAGAIN: recorded with no bytes
	}
	got := col.waitEvents(ctx, t, len(wants))
	// The server has exited: every event it caused is counted.
	cnt, err := rec.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if cnt.Recorded != uint64(len(wants)) || cnt.Lost != 0 || cnt.NotInJob != 0 {
		t.Errorf("counters %+v, want %d recorded and nothing else", cnt, len(wants))
	}
	if n, err := rec.LostTotal(); err != nil || n != 0 {
		t.Errorf("LostTotal() = %d, %v; want 0", n, err)
	}
	if len(got) != len(wants) {
		t.Fatalf("%d events, want %d: %+v", len(got), len(wants), got)
	}
	for i, w := range wants {
		e := got[i]
		conn := tcpflow.Tuple{Local: addrPort(clients[w.conn].RemoteAddr()), Remote: addrPort(clients[w.conn].LocalAddr())}
		off := e.CopiedSeq - bases[w.conn]
		if w.fin && off == w.off+1 {
			off = w.off
		}
		if e.Conn != conn || off != w.off || e.Len != w.len || e.Flags != w.flags ||
			e.Cgroup != job.ID || e.Pid != pid || e.Tid != tid {
			t.Errorf("event %d (%s) = %+v (offset %d)\nwant conn %s offset %d len %d flags %#x cgroup %d pid %d tid %d",
				i, ops[i], e, e.CopiedSeq-bases[w.conn], conn, w.off, w.len, w.flags, job.ID, pid, tid)
		}
		if e.Peek() != (w.flags&unix.MSG_PEEK != 0) {
			t.Errorf("event %d: Peek() = %v", i, e.Peek())
		}
	}
	if n, err := rec.Lost(job.ID); err != nil || n != 0 {
		t.Errorf("Lost(job) = %d, %v; want 0", n, err)
	}
}

// TestRecvOrderPositions: every receive call carries the number of readiness calls its thread made before
// it (poll and epoll_wait alike), PollCounts reads each thread's count, and an armed stop stops the thread
// at the readiness call it names, or right after the receive call it names, before its next call.
func TestRecvOrderPositions(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	rec := newRecvOrderT(t, parent.Dir, 64<<10)
	if !rec.Positions() {
		t.Skip("SKIPPED LOUDLY: this kernel cannot attach a BTF program to sys_exit: receive positions are not recorded")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cctx, stop := context.WithCancel(ctx)
	col := collectOrder(cctx, rec)
	defer func() { stop(); <-col.done }()

	const a, b = 0, 1
	ops := []recvOp{
		{a, 0, "wait"},
		{a, 0, "poll"},
		{a, 10, "recv"}, // 1 readiness call before it
		{b, 0, "epoll"},
		{b, 0, "poll"},
		{b, 0, "epoll"}, // the stop at 4 readiness calls
		{b, 7, "read"},  // 4
		{a, 10, "recv"}, // 4; the stop after this call
		{a, 0, "poll"},
		{a, 10, "recv"}, // 5
	}
	srv := netip.AddrPortFrom(tn.ipB, 7302)
	child := streamtest.StartT(t, tn.lab, hostB, job, "recvscript",
		"FTKIT_ADDR="+srv.String(), "FTKIT_EXPECT=30,7", "FTKIT_SCRIPT="+formatScript(ops))
	if l := child.LineT(ctx, t); l != "ready" {
		t.Fatalf("server said %q, want ready", l)
	}
	clients := make([]*net.TCPConn, 2)
	for i := range clients {
		clients[i] = dialFrom(t, tn, hostA, srv)
		if l := child.LineT(ctx, t); l != fmt.Sprintf("conn %d", i) {
			t.Fatalf("server said %q, want conn %d", l, i)
		}
	}
	base, err := streamtest.WriteSeq(clients[a])
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range []int{30, 7} {
		if _, err := clients[i].Write(streamtest.Stream(uint64(i), n)); err != nil {
			t.Fatal(err)
		}
	}
	var pid, tid uint32
	if l := child.LineT(ctx, t); func() error { _, err := fmt.Sscanf(l, "pid %d %d", &pid, &tid); return err }() != nil {
		t.Fatalf("server said %q, want pid <tgid> <tid>", l)
	}
	// The child runs in this PID namespace: its thread's id there is its tid.
	if err := rec.Arm(job.ID, tid, Stop{Polls: 4}); err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprintln(child.Stdin); err != nil { // the "wait" op
		t.Fatal(err)
	}
	waitStopped := func(what string) {
		t.Helper()
		for {
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/stat", pid, tid))
			if err != nil {
				t.Fatal(err)
			}
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); f[0] == "T" {
				return
			}
			select {
			case <-ctx.Done():
				t.Fatalf("the thread did not stop %s", what)
			case <-time.After(time.Millisecond):
			}
		}
	}
	waitStopped("at its 4th readiness call")
	got := col.waitEvents(ctx, t, 2)
	if len(got) != 2 || !got[1].PollStop || !got[1].Stopped || got[1].Polls != 4 || got[1].Thread != tid || got[1].Proc != pid {
		t.Fatalf("events at the first stop: %+v; want a receive, then the stop at 4 readiness calls of thread %d", got, tid)
	}
	if counts, err := rec.PollCounts(job.ID); err != nil || counts[tid] != 4 {
		t.Fatalf("PollCounts = %v, %v; want thread %d at 4", counts, err, tid)
	}
	conn := func(i int) tcpflow.Tuple {
		return tcpflow.Tuple{Local: addrPort(clients[i].RemoteAddr()), Remote: addrPort(clients[i].LocalAddr())}
	}
	if err := rec.Arm(job.ID, tid, Stop{Polls: 4, Conn: conn(a), End: base + 20, Len: 10}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(int(pid), unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	waitStopped("after its second receive call on a")
	got = col.waitEvents(ctx, t, 4)
	if len(got) != 4 || !got[3].Stopped || got[3].PollStop || got[3].CopiedSeq != base+20 {
		t.Fatalf("events at the second stop: %+v; want the receive call on a that ends at %d, stopped", got, base+20)
	}
	if err := rec.Disarm(job.ID, tid); err != nil {
		t.Fatal(err)
	}
	assertFlagCleared(t, rec.objs.StopsArmed, "stops_armed")
	if err := unix.Kill(int(pid), unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if l := child.LineT(ctx, t); !strings.HasPrefix(l, "done ") {
		t.Fatalf("server said %q, want done", l)
	}
	got = col.waitEvents(ctx, t, 5)
	wants := []struct {
		conn  int
		polls uint64
	}{{a, 1}, {-1, 4}, {b, 4}, {a, 4}, {a, 5}}
	for i, w := range wants {
		e := got[i]
		if e.Thread != tid || e.Proc != pid || e.Polls != w.polls || (w.conn >= 0 && e.Conn != conn(w.conn)) || (w.conn < 0) != e.PollStop {
			t.Errorf("event %d = %+v; want conn %d after %d readiness calls of thread %d", i, e, w.conn, w.polls, tid)
		}
	}
	if counts, err := rec.PollCounts(job.ID); err != nil || counts[tid] != 5 {
		t.Errorf("PollCounts = %v, %v; want thread %d at 5", counts, err, tid)
	}
	if _, err := fmt.Fprintln(child.Stdin); err != nil {
		t.Fatal(err)
	}
	for _, c := range clients {
		io.Copy(io.Discard, c)
	}
	if err := child.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}
	if err := rec.Forget(job.ID); err != nil {
		t.Fatal(err)
	}
	if counts, err := rec.PollCounts(job.ID); err != nil || len(counts) != 0 {
		t.Errorf("PollCounts after Forget = %v, %v; want none", counts, err)
	}
}

// TestRecvOrderStopBeforeFirstPoll: a stop armed at a receive call of a thread that has made no readiness
// call yet (0: a blocking recv of a header, then of the body) stops it there. The program compared the stop
// with the thread's positions entry, which only a readiness call makes: with none the stop never fired, and
// a replay waiting for the thread's stop stalled until its deadline.
func TestRecvOrderStopBeforeFirstPoll(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	rec := newRecvOrderT(t, parent.Dir, 64<<10)
	if !rec.Positions() {
		t.Skip("SKIPPED LOUDLY: this kernel cannot attach a BTF program to sys_exit: receive positions are not recorded")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cctx, stop := context.WithCancel(ctx)
	col := collectOrder(cctx, rec)
	defer func() { stop(); <-col.done }()

	ops := []recvOp{{0, 0, "wait"}, {0, 10, "recv"}, {0, 10, "recv"}}
	srv := netip.AddrPortFrom(tn.ipB, 7303)
	child := streamtest.StartT(t, tn.lab, hostB, job, "recvscript",
		"FTKIT_ADDR="+srv.String(), "FTKIT_EXPECT=20", "FTKIT_SCRIPT="+formatScript(ops))
	if l := child.LineT(ctx, t); l != "ready" {
		t.Fatalf("server said %q, want ready", l)
	}
	client := dialFrom(t, tn, hostA, srv)
	if l := child.LineT(ctx, t); l != "conn 0" {
		t.Fatalf("server said %q, want conn 0", l)
	}
	base, err := streamtest.WriteSeq(client)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Write(streamtest.Stream(0, 20)); err != nil {
		t.Fatal(err)
	}
	var pid, tid uint32
	if l := child.LineT(ctx, t); func() error { _, err := fmt.Sscanf(l, "pid %d %d", &pid, &tid); return err }() != nil {
		t.Fatalf("server said %q, want pid <tgid> <tid>", l)
	}
	conn := tcpflow.Tuple{Local: addrPort(client.RemoteAddr()), Remote: addrPort(client.LocalAddr())}
	if err := rec.Arm(job.ID, tid, Stop{Polls: 0, Conn: conn, End: base + 10, Len: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprintln(child.Stdin); err != nil { // the "wait" op
		t.Fatal(err)
	}
	for {
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/stat", pid, tid))
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); f[0] == "T" {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the thread did not stop after its first receive call, armed at 0 readiness calls")
		case <-time.After(time.Millisecond):
		}
	}
	got := col.waitEvents(ctx, t, 1)
	if len(got) != 1 || !got[0].Stopped || got[0].Polls != 0 || got[0].CopiedSeq != base+10 {
		t.Fatalf("events at the stop: %+v; want the first receive call, ending at %d, stopped", got, base+10)
	}
	if err := rec.Disarm(job.ID, tid); err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(int(pid), unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if l := child.LineT(ctx, t); !strings.HasPrefix(l, "done ") {
		t.Fatalf("server said %q, want done", l)
	}
	if _, err := fmt.Fprintln(child.Stdin); err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, client)
	if err := child.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}
}

// TestRecvOrderLostWhenRingFull fills a one-page ring with nobody reading:
// the events that did not fit are counted against the job, the ones in the
// ring are the first ones, in order.
func TestRecvOrderLostWhenRingFull(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	page := os.Getpagesize()
	rec := newRecvOrderT(t, parent.Dir, page)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	const calls = 300
	fits := page / (RecvEventSize + ringHdrLen)
	srv := netip.AddrPortFrom(tn.ipB, 7302)
	child := streamtest.StartT(t, tn.lab, hostB, job, "recvscript",
		"FTKIT_ADDR="+srv.String(), fmt.Sprintf("FTKIT_EXPECT=%d", calls), fmt.Sprintf("FTKIT_SCRIPT=0:1:recv*%d", calls))
	if l := child.LineT(ctx, t); l != "ready" {
		t.Fatalf("server said %q, want ready", l)
	}
	c := dialFrom(t, tn, hostA, srv)
	child.LineT(ctx, t) // conn 0
	base, err := streamtest.WriteSeq(c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(make([]byte, calls)); err != nil {
		t.Fatal(err)
	}
	child.LineT(ctx, t) // pid
	if l := child.LineT(ctx, t); !strings.HasPrefix(l, "done ") {
		t.Fatalf("server said %q, want done", l)
	}
	fmt.Fprintln(child.Stdin)
	if err := child.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}

	cnt, err := rec.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if cnt.Recorded != uint64(fits) || cnt.Lost != calls-uint64(fits) || cnt.LostUnattributed != 0 {
		t.Errorf("counters %+v, want %d recorded (a %d-byte ring), %d lost", cnt, fits, page, calls-fits)
	}
	if n, err := rec.Lost(job.ID); err != nil || n != cnt.Lost {
		t.Errorf("Lost(job) = %d, %v; want %d", n, err, cnt.Lost)
	}
	if n, err := rec.LostTotal(); err != nil || n != cnt.Lost {
		t.Errorf("LostTotal() = %d, %v; want the per-CPU counters' %d", n, err, cnt.Lost)
	}
	if n, err := rec.Lost(parent.ID); err != nil || n != 0 {
		t.Errorf("Lost(another cgroup) = %d, %v; want 0", n, err)
	}
	// Drain: the ring holds the first events.
	dctx, dcancel := context.WithCancel(ctx)
	dcancel() // ReadBatch drains what is there, then returns ctx.Err()
	var got []RecvEvent
	for {
		var err error
		got, err = rec.ReadBatch(dctx, got)
		if err != nil {
			if !errors.Is(err, context.Canceled) {
				t.Fatal(err)
			}
			break
		}
	}
	if len(got) != fits {
		t.Fatalf("drained %d events, want %d", len(got), fits)
	}
	for i, e := range got {
		if e.CopiedSeq-base != uint32(i+1) || e.Len != 1 || e.Cgroup != job.ID {
			t.Fatalf("event %d = %+v (offset %d), want offset %d len 1 cgroup %d", i, e, e.CopiedSeq-base, i+1, job.ID)
		}
	}
	if err := rec.Forget(job.ID); err != nil {
		t.Fatal(err)
	}
	if n, err := rec.Lost(job.ID); err != nil || n != 0 {
		t.Errorf("Lost(job) after Forget = %d, %v; want 0", n, err)
	}
}

func TestNewRecvOrderRejects(t *testing.T) {
	dir := t.TempDir()
	for _, opts := range []RecvOrderOptions{
		{CgroupParent: "relative/ftkit"},
		{CgroupParent: dir}, // not a cgroup v2 directory
		{CgroupParent: "/", RingBufferSize: 100},
	} {
		if r, err := NewRecvOrder(opts); err == nil {
			r.Close()
			t.Errorf("%+v accepted", opts)
		} else {
			t.Logf("%+v: %v", opts, err)
		}
	}
}

// encodeRecvEvent is the inverse of DecodeRecvEvent (struct recv_event).
func encodeRecvEvent(e RecvEvent) []byte {
	b := make([]byte, RecvEventSize)
	h := binary.NativeEndian
	h.PutUint64(b[0:], e.Cgroup)
	l, r := e.Conn.Local.Addr().As4(), e.Conn.Remote.Addr().As4()
	copy(b[8:], l[:])
	copy(b[12:], r[:])
	binary.BigEndian.PutUint16(b[16:], e.Conn.Local.Port())
	binary.BigEndian.PutUint16(b[18:], e.Conn.Remote.Port())
	h.PutUint32(b[20:], e.CopiedSeq)
	h.PutUint32(b[24:], e.Len)
	h.PutUint32(b[28:], e.Flags)
	h.PutUint32(b[32:], e.Pid)
	h.PutUint32(b[36:], e.Tid)
	h.PutUint32(b[40:], e.Thread)
	h.PutUint32(b[44:], e.Proc)
	switch {
	case e.PollStop:
		h.PutUint32(b[48:], 1)
	case e.Held:
		h.PutUint32(b[48:], 2)
	}
	switch {
	case e.StopErr != 0:
		h.PutUint32(b[52:], 2+uint32(e.StopErr))
	case e.Stopped || e.Held:
		h.PutUint32(b[52:], 1)
	}
	h.PutUint64(b[56:], e.Polls)
	return b
}

func TestDecodeRecvEvent(t *testing.T) {
	if RecvEventSize != binary.Size(recvorderRecvEvent{}) {
		t.Fatalf("RecvEventSize %d, struct recv_event %d bytes", RecvEventSize, binary.Size(recvorderRecvEvent{}))
	}
	e := RecvEvent{Cgroup: 1234, Conn: tcpflow.Tuple{
		Local:  netip.MustParseAddrPort("10.0.0.2:5001"),
		Remote: netip.MustParseAddrPort("10.0.0.1:40000"),
	}, CopiedSeq: 0xfffffff0, Len: 7, Flags: unix.MSG_PEEK, Pid: 42, Tid: 43, Thread: 3, Proc: 2, Stopped: true, Polls: 1 << 40}
	raw := encodeRecvEvent(e)
	// The addresses and ports are the wire's bytes.
	if raw[8] != 10 || raw[11] != 2 || raw[16] != 5001>>8 || raw[17] != 5001&0xff {
		t.Fatalf("encoding % x", raw)
	}
	got, err := DecodeRecvEvent(raw)
	if err != nil || got != e {
		t.Fatalf("DecodeRecvEvent = %+v, %v; want %+v", got, err, e)
	}
	// The bpf2go twin of struct recv_event decodes the same bytes alike.
	var twin recvorderRecvEvent
	if _, err := binary.Decode(raw, binary.NativeEndian, &twin); err != nil {
		t.Fatal(err)
	}
	if twin.CgroupId != e.Cgroup || twin.CopiedSeq != e.CopiedSeq || twin.Len != e.Len || twin.Flags != e.Flags || twin.Pid != e.Pid || twin.Tid != e.Tid ||
		twin.Nstid != e.Thread || twin.Nspid != e.Proc || twin.Stopped != 1 || twin.Kind != 0 || twin.Polls != e.Polls {
		t.Fatalf("bpf2go twin %+v disagrees with %+v", twin, e)
	}
	for _, n := range []int{0, RecvEventSize - 1, RecvEventSize + 1} {
		if _, err := DecodeRecvEvent(make([]byte, n)); !errors.Is(err, ErrBadRecvEvent) {
			t.Errorf("%d bytes: %v, want ErrBadRecvEvent", n, err)
		}
	}
	for _, held := range []RecvEvent{{Held: true, Len: 9}, {Held: true, StopErr: unix.ESRCH}, {PollStop: true, StopErr: unix.EPERM}} {
		held.Conn = e.Conn
		if got, err := DecodeRecvEvent(encodeRecvEvent(held)); err != nil || got != held {
			t.Errorf("DecodeRecvEvent(encode(%+v)) = %+v, %v", held, got, err)
		}
	}
	for _, bad := range [][2]uint32{{3, 0}, {2, 0}, {0, 2}} { // kind, stop result
		raw := make([]byte, RecvEventSize)
		binary.NativeEndian.PutUint32(raw[48:], bad[0])
		binary.NativeEndian.PutUint32(raw[52:], bad[1])
		if _, err := DecodeRecvEvent(raw); !errors.Is(err, ErrBadRecvEvent) {
			t.Errorf("kind %d, stop result %d: %v, want ErrBadRecvEvent", bad[0], bad[1], err)
		}
	}
}

func FuzzDecodeRecvEvent(f *testing.F) {
	f.Add(make([]byte, RecvEventSize))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, raw []byte) {
		e, err := DecodeRecvEvent(raw)
		if len(raw) != RecvEventSize && err == nil {
			t.Fatalf("%d bytes decoded", len(raw))
		}
		if err != nil {
			if !errors.Is(err, ErrBadRecvEvent) {
				t.Fatal(err)
			}
			return
		}
		if back := encodeRecvEvent(e); string(back) != string(raw) {
			t.Fatalf("round trip % x -> %+v -> % x", raw, e, back)
		}
	})
}

// recvCost runs calls 1-byte receive calls in a recvscript child born in cg
// on host b and returns the child's ns per call.
func recvCost(ctx context.Context, t *testing.T, tn *testNet, cg *streamtest.Cgroup, port uint16, calls int) int64 {
	t.Helper()
	srv := netip.AddrPortFrom(tn.ipB, port)
	child := streamtest.StartT(t, tn.lab, hostB, cg, "recvscript",
		"FTKIT_ADDR="+srv.String(), fmt.Sprintf("FTKIT_EXPECT=%d", calls), fmt.Sprintf("FTKIT_SCRIPT=0:1:recv*%d", calls))
	if l := child.LineT(ctx, t); l != "ready" {
		t.Fatalf("server said %q, want ready", l)
	}
	c := dialFrom(t, tn, hostA, srv)
	child.LineT(ctx, t) // conn 0
	if _, err := c.Write(make([]byte, calls)); err != nil {
		t.Fatal(err)
	}
	child.LineT(ctx, t) // pid
	var ns int64
	if l := child.LineT(ctx, t); func() error { _, err := fmt.Sscanf(l, "done %d", &ns); return err }() != nil {
		t.Fatalf("server said %q, want done <ns>", l)
	}
	fmt.Fprintln(child.Stdin)
	if err := child.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}
	c.Close()
	return ns
}

// TestRecvOrderCost measures what the recorder adds to a receive call: 1e5
// one-byte recv calls (the data already queued) without the recorder, with
// it loaded but the caller outside the parent cgroup (every other process of
// the machine), and with it recording the caller (a consumer draining the
// ring), by default and with WakeEveryEvent. It logs the median ns per call
// of 5 rounds and the program's own run time (BPF statistics); no timing is
// asserted.
func TestRecvOrderCost(t *testing.T) {
	if testing.Short() {
		t.Skip("SKIPPED: a measurement (-short)")
	}
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	other := streamtest.NewCgroupT(t, "ro-other")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const calls, rounds = 100000, 5
	// The kernel's run time statistics of BPF programs: the program's own
	// cost, without the tracepoint's.
	statsOn, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		t.Fatalf("enable BPF run time statistics: %v", err)
	}
	defer statsOn.Close()
	port := uint16(7400)
	// withRecorder loads a recorder with a draining consumer, runs fn and
	// checks that every call of the job was recorded or counted lost
	// (wantJob calls). It returns the program's own ns per run.
	withRecorder := func(every bool, wantJob uint64, fn func()) int64 {
		r, err := NewRecvOrder(RecvOrderOptions{CgroupParent: parent.Dir, RingBufferSize: 1 << 20, WakeEveryEvent: every})
		if errors.Is(err, ebpf.ErrNotSupported) {
			t.Skipf("SKIPPED: this kernel cannot load the receive-order recorder: %v", err)
		}
		if err != nil {
			t.Fatalf("NewRecvOrder: %+v", err)
		}
		defer r.Close()
		cctx, stop := context.WithCancel(ctx)
		col := collectOrder(cctx, r)
		defer func() { stop(); <-col.done }()
		st0, err := r.objs.Program.Stats()
		if err != nil {
			t.Fatal(err)
		}
		fn()
		st1, err := r.objs.Program.Stats()
		if err != nil {
			t.Fatal(err)
		}
		cnt, err := r.Counters()
		if err != nil {
			t.Fatal(err)
		}
		got := cnt.Recorded
		if cnt.Lost == 0 {
			got = uint64(len(col.waitEvents(ctx, t, int(wantJob))))
		}
		if cnt.Recorded+cnt.Lost != wantJob || got != cnt.Recorded {
			t.Errorf("counters %+v, %d events read; want %d calls recorded or lost", cnt, got, wantJob)
		}
		if cnt.Lost != 0 {
			t.Logf("%d events lost with a 1 MiB ring and a draining consumer", cnt.Lost)
		}
		return int64(st1.Runtime-st0.Runtime) / int64(max(st1.RunCount-st0.RunCount, 1))
	}
	var off, outside, recorded, recordedWake, progOutside, progRecorded []int64
	for range rounds {
		port++
		off = append(off, recvCost(ctx, t, tn, job, port, calls))
		port++
		progOutside = append(progOutside, withRecorder(false, 0, func() {
			outside = append(outside, recvCost(ctx, t, tn, other, port, calls))
		}))
		port++
		progRecorded = append(progRecorded, withRecorder(false, calls, func() {
			recorded = append(recorded, recvCost(ctx, t, tn, job, port, calls))
		}))
		port++
		withRecorder(true, calls, func() {
			recordedWake = append(recordedWake, recvCost(ctx, t, tn, job, port, calls))
		})
	}
	median := func(v []int64) int64 {
		v = append([]int64(nil), v...)
		slices.Sort(v)
		return v[len(v)/2]
	}
	t.Logf("ns per 1-byte recv call (median of %d rounds of %d): no recorder %d, recorder loaded and caller outside the parent %d, caller recorded %d, caller recorded with WakeEveryEvent %d",
		rounds, calls, median(off), median(outside), median(recorded), median(recordedWake))
	t.Logf("the program's own run time per call (kernel BPF statistics, median): caller outside %d ns, caller recorded %d ns",
		median(progOutside), median(progRecorded))
	t.Logf("rounds: no recorder %v, outside %v, recorded %v, with WakeEveryEvent %v", off, outside, recorded, recordedWake)
}

// pingPong is the pingpong child role: it listens on FTKIT_ADDR, prints
// "ready", accepts two connections A and B ("conn <i>" after each), waits
// until each holds FTKIT_ROUNDS bytes, prints "pid <tgid>", then two threads
// take turns, handing over through pipes (not sockets: not recorded): thread
// X receives one byte of A and wakes Y, Y receives one byte of B and wakes
// X, FTKIT_ROUNDS times. It prints "done" and waits for a line on stdin.
func pingPong() error {
	ap, err := netip.ParseAddrPort(os.Getenv("FTKIT_ADDR"))
	if err != nil {
		return fmt.Errorf("FTKIT_ADDR: %w", err)
	}
	rounds, err := strconv.Atoi(os.Getenv("FTKIT_ROUNDS"))
	if err != nil {
		return fmt.Errorf("FTKIT_ROUNDS: %w", err)
	}
	ln, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	if err := unix.Bind(ln, &unix.SockaddrInet4{Addr: ap.Addr().As4(), Port: int(ap.Port())}); err != nil {
		return fmt.Errorf("bind %s: %w", ap, err)
	}
	if err := unix.Listen(ln, 8); err != nil {
		return err
	}
	fmt.Println("ready")
	conns, err := acceptQueued(ln, []int{rounds, rounds})
	if err != nil {
		return err
	}
	var toY, toX [2]int
	if err := unix.Pipe2(toY[:], unix.O_CLOEXEC); err != nil {
		return err
	}
	if err := unix.Pipe2(toX[:], unix.O_CLOEXEC); err != nil {
		return err
	}
	fmt.Printf("pid %d\n", os.Getpid())
	// turn receives one byte of conn, after waiting on in (if >= 0), and
	// then wakes the other thread through out.
	turn := func(conn, in, out int, first bool) error {
		runtime.LockOSThread()
		b := make([]byte, 1)
		for i := range rounds {
			if !first || i > 0 {
				if _, err := unix.Read(in, b); err != nil {
					return fmt.Errorf("pipe read: %w", err)
				}
			}
			if n, _, err := unix.Recvfrom(conn, b, 0); n != 1 || err != nil {
				return fmt.Errorf("recv: %d, %v", n, err)
			}
			if _, err := unix.Write(out, b); err != nil {
				return fmt.Errorf("pipe write: %w", err)
			}
		}
		return nil
	}
	errs := make(chan error, 2)
	go func() { errs <- turn(conns[0], toX[0], toY[1], true) }()
	go func() { errs <- turn(conns[1], toY[0], toX[1], false) }()
	if err := errors.Join(<-errs, <-errs); err != nil {
		return err
	}
	fmt.Println("done")
	_, _ = fmt.Scanln()
	return nil
}

// TestRecvOrderAcrossThreads checks that the order of events follows the
// causality between threads: two threads of a job take turns receiving from
// two connections, handing over through pipes; the events must alternate
// exactly, each connection on its own thread, copied_seq one byte further
// each turn.
func TestRecvOrderAcrossThreads(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	rec := newRecvOrderT(t, parent.Dir, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cctx, stop := context.WithCancel(ctx)
	col := collectOrder(cctx, rec)
	defer func() { stop(); <-col.done }()

	const rounds = 2000
	srv := netip.AddrPortFrom(tn.ipB, 7310)
	child := streamtest.StartT(t, tn.lab, hostB, job, "pingpong",
		"FTKIT_ADDR="+srv.String(), fmt.Sprintf("FTKIT_ROUNDS=%d", rounds))
	if l := child.LineT(ctx, t); l != "ready" {
		t.Fatalf("server said %q, want ready", l)
	}
	var clients [2]*net.TCPConn
	var bases [2]uint32
	for i := range clients {
		clients[i] = dialFrom(t, tn, hostA, srv)
		child.LineT(ctx, t) // conn i
		var err error
		if bases[i], err = streamtest.WriteSeq(clients[i]); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range clients {
		if _, err := c.Write(make([]byte, rounds)); err != nil {
			t.Fatal(err)
		}
	}
	var pid uint32
	if l := child.LineT(ctx, t); func() error { _, err := fmt.Sscanf(l, "pid %d", &pid); return err }() != nil {
		t.Fatalf("server said %q, want pid <tgid>", l)
	}
	if l := child.LineT(ctx, t); l != "done" {
		t.Fatalf("server said %q, want done", l)
	}
	got := col.waitEvents(ctx, t, 2*rounds)
	if len(got) != 2*rounds {
		t.Fatalf("%d events, want %d", len(got), 2*rounds)
	}
	var tids [2]uint32
	for i, e := range got {
		k, round := i%2, uint32(i/2)
		conn := tcpflow.Tuple{Local: addrPort(clients[k].RemoteAddr()), Remote: addrPort(clients[k].LocalAddr())}
		if i < 2 {
			tids[k] = e.Tid
		}
		if e.Conn != conn || e.CopiedSeq-bases[k] != round+1 || e.Len != 1 || e.Pid != pid || e.Tid != tids[k] {
			t.Fatalf("event %d = %+v (offset %d), want conn %s offset %d len 1 pid %d tid %d",
				i, e, e.CopiedSeq-bases[k], conn, round+1, pid, tids[k])
		}
	}
	if tids[0] == tids[1] || tids[0] == pid && tids[1] == pid {
		t.Errorf("both connections read by thread %d: the test did not use two threads", tids[0])
	}
}

// TestRecvOrderOnlyJobsIPv4 runs the same reads in a job on a dual-stack
// listener (an IPv4 connection, recorded with its IPv4 addresses, and an
// IPv6 one, not recorded), in the parent cgroup itself (counted, not
// recorded) and in a cgroup outside the parent (not even counted).
func TestRecvOrderOnlyJobsIPv4(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	other := streamtest.NewCgroupT(t, "ro-other")
	rec := newRecvOrderT(t, parent.Dir, 64<<10)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cctx, stop := context.WithCancel(ctx)
	col := collectOrder(cctx, rec)
	defer func() { stop(); <-col.done }()

	// run starts a recvscript server born in cg, listening on listen, and
	// connects to it from host: one connection per address of dial.
	run := func(cg *streamtest.Cgroup, listen netip.AddrPort, dial []netip.AddrPort, hosts []string) []*net.TCPConn {
		t.Helper()
		// 4 bytes of the first connection, 10 of the second if any, 6 of the first.
		ops := []recvOp{{0, 4, "recv"}, {0, 6, "recv"}}
		if len(dial) == 2 {
			ops = []recvOp{ops[0], {1, 10, "recv"}, ops[1]}
		}
		child := streamtest.StartT(t, tn.lab, hostB, cg, "recvscript", "FTKIT_ADDR="+listen.String(),
			"FTKIT_EXPECT="+strings.Repeat("10,", len(dial)-1)+"10", "FTKIT_SCRIPT="+formatScript(ops))
		if l := child.LineT(ctx, t); l != "ready" {
			t.Fatalf("server said %q, want ready", l)
		}
		var cs []*net.TCPConn
		for i, addr := range dial {
			c := dialFrom(t, tn, hosts[i], addr)
			child.LineT(ctx, t) // conn i
			if _, err := c.Write(make([]byte, 10)); err != nil {
				t.Fatal(err)
			}
			cs = append(cs, c)
		}
		child.LineT(ctx, t) // pid
		if l := child.LineT(ctx, t); !strings.HasPrefix(l, "done ") {
			t.Fatalf("server said %q, want done", l)
		}
		fmt.Fprintln(child.Stdin)
		if err := child.Wait(); err != nil {
			t.Fatalf("server: %v", err)
		}
		return cs
	}

	// Outside the parent: nothing.
	run(other, netip.AddrPortFrom(tn.ipB, 7320), []netip.AddrPort{netip.AddrPortFrom(tn.ipB, 7320)}, []string{hostA})
	if cnt, err := rec.Counters(); err != nil || cnt != (RecvOrderCounters{}) {
		t.Fatalf("after reads outside the parent: counters %+v, %v; want none", cnt, err)
	}
	// In the parent itself: counted as not in a job.
	run(parent, netip.AddrPortFrom(tn.ipB, 7321), []netip.AddrPort{netip.AddrPortFrom(tn.ipB, 7321)}, []string{hostA})
	if cnt, err := rec.Counters(); err != nil || cnt != (RecvOrderCounters{NotInJob: 2}) {
		t.Fatalf("after reads in the parent cgroup: counters %+v, %v; want 2 not in a job", cnt, err)
	}
	// In the job, dual stack: IPv4 from host a, IPv6 on host b's loopback.
	cs := run(job, netip.MustParseAddrPort("[::]:7322"),
		[]netip.AddrPort{netip.AddrPortFrom(tn.ipB, 7322), netip.MustParseAddrPort("[::1]:7322")}, []string{hostA, hostB})
	cnt, err := rec.Counters()
	if err != nil || cnt != (RecvOrderCounters{NotInJob: 2, Recorded: 2, NonIPv4: 1}) {
		t.Fatalf("after reads in the job: counters %+v, %v; want 2 recorded, 1 not IPv4 (and the 2 not in a job)", cnt, err)
	}
	got := col.waitEvents(ctx, t, 2)
	conn := tcpflow.Tuple{Local: addrPort(cs[0].RemoteAddr()), Remote: addrPort(cs[0].LocalAddr())}
	if len(got) != 2 || got[0].Conn != conn || got[0].Len != 4 || got[1].Conn != conn || got[1].Len != 6 ||
		got[1].CopiedSeq-got[0].CopiedSeq != 6 || got[0].Cgroup != job.ID {
		t.Fatalf("events %+v, want 4 then 6 bytes of %s (IPv4 addresses) in cgroup %d", got, conn, job.ID)
	}
}

// TestRecvOrderWakeLatency logs how late events reach a waiting ReadBatch:
// a job makes 1-byte receive calls 100 us apart (it spins in between); each event's delay is its
// arrival in ReadBatch minus the end of its call (CLOCK_MONOTONIC), by
// default (the reader polls every millisecond while events keep coming),
// with WakeEveryEvent, and with it switched on after loading
// (SetWakeEveryEvent). Only the delivery of every event is asserted.
func TestRecvOrderWakeLatency(t *testing.T) {
	if testing.Short() {
		t.Skip("SKIPPED: a measurement (-short)")
	}
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const calls = 1000
	// The third case switches WakeEveryEvent on after loading, as the agent does while a replay watches.
	for i, every := range []bool{false, true, true} {
		r, err := NewRecvOrder(RecvOrderOptions{CgroupParent: parent.Dir, RingBufferSize: 1 << 20, WakeEveryEvent: every && i < 2})
		if errors.Is(err, ebpf.ErrNotSupported) {
			t.Skipf("SKIPPED: this kernel cannot load the receive-order recorder: %v", err)
		}
		if err != nil {
			t.Fatalf("NewRecvOrder: %+v", err)
		}
		if i == 2 {
			if err := r.SetWakeEveryEvent(true); err != nil {
				t.Fatal(err)
			}
		}
		arrivals := make(chan []int64, 1)
		go func() {
			var at []int64
			buf := make([]RecvEvent, 0, 64)
			for len(at) < calls {
				var err error
				if buf, err = r.ReadBatch(ctx, buf[:0]); err != nil {
					break
				}
				now := monoNow()
				for range buf {
					at = append(at, now)
				}
			}
			arrivals <- at
		}()
		srv := netip.AddrPortFrom(tn.ipB, uint16(7500+i))
		child := streamtest.StartT(t, tn.lab, hostB, job, "recvscript", "FTKIT_ADDR="+srv.String(),
			fmt.Sprintf("FTKIT_EXPECT=%d", calls), fmt.Sprintf("FTKIT_SCRIPT=0:1:recv*%d", calls), "FTKIT_GAP_US=100")
		child.LineT(ctx, t) // ready
		c := dialFrom(t, tn, hostA, srv)
		child.LineT(ctx, t) // conn 0
		if _, err := c.Write(make([]byte, calls)); err != nil {
			t.Fatal(err)
		}
		child.LineT(ctx, t) // pid
		child.LineT(ctx, t) // done
		var stamps []int64
		for f := range strings.FieldsSeq(strings.TrimPrefix(child.LineT(ctx, t), "stamps ")) {
			v, err := strconv.ParseInt(f, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			stamps = append(stamps, v)
		}
		at := <-arrivals
		fmt.Fprintln(child.Stdin)
		r.Close()
		if len(at) != calls || len(stamps) != calls {
			t.Fatalf("%d events read, %d calls stamped; want %d", len(at), len(stamps), calls)
		}
		d := make([]int64, calls)
		for k := range d {
			d[k] = at[k] - stamps[k]
		}
		slices.Sort(d)
		t.Logf("case %d, WakeEveryEvent=%v: event delay after its call returned: median %d us, p90 %d us, p99 %d us, max %d us",
			i, every, d[calls/2]/1000, d[calls*9/10]/1000, d[calls*99/100]/1000, d[calls-1]/1000)
	}
}

// TestRecvOrderPessimistic: in a pessimistic job every receive call that consumes bytes stops its process
// right after the call (a Held event), a peek does not, and the process goes on when continued; without
// positions too. Made optimistic again, the job's calls no longer stop it.
func TestRecvOrderPessimistic(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	parent := streamtest.NewCgroupT(t, "ro-parent")
	job := parent.SubT(t, "job1")
	rec := newRecvOrderOptsT(t, RecvOrderOptions{CgroupParent: parent.Dir, RingBufferSize: 64 << 10})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cctx, stop := context.WithCancel(ctx)
	col := collectOrder(cctx, rec)
	defer func() { stop(); <-col.done }()
	if err := rec.SetPessimistic(job.ID, true); err != nil {
		t.Fatal(err)
	}
	ops := []recvOp{{0, 5, "peek"}, {0, 10, "recv"}, {0, 10, "recv"}, {0, 0, "wait"}, {0, 10, "recv"}}
	srv := netip.AddrPortFrom(tn.ipB, 7303)
	child := streamtest.StartT(t, tn.lab, hostB, job, "recvscript",
		"FTKIT_ADDR="+srv.String(), "FTKIT_EXPECT=30", "FTKIT_SCRIPT="+formatScript(ops))
	if l := child.LineT(ctx, t); l != "ready" {
		t.Fatalf("server said %q, want ready", l)
	}
	client := dialFrom(t, tn, hostA, srv)
	if l := child.LineT(ctx, t); l != "conn 0" {
		t.Fatalf("server said %q, want conn 0", l)
	}
	if _, err := client.Write(streamtest.Stream(0, 30)); err != nil {
		t.Fatal(err)
	}
	var pid, tid uint32
	if l := child.LineT(ctx, t); func() error { _, err := fmt.Sscanf(l, "pid %d %d", &pid, &tid); return err }() != nil {
		t.Fatalf("server said %q, want pid <tgid> <tid>", l)
	}
	waitState := func(what string, stopped bool) {
		t.Helper()
		for {
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/stat", pid, tid))
			if err != nil {
				t.Fatal(err)
			}
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); (f[0] == "T") == stopped {
				return
			}
			select {
			case <-ctx.Done():
				t.Fatalf("the thread did not %s", what)
			case <-time.After(time.Millisecond):
			}
		}
	}
	for i := range 2 {
		waitState(fmt.Sprintf("stop after receive call %d", i+1), true)
		got := col.waitEvents(ctx, t, 2+i)
		if e := got[len(got)-1]; !e.Held || e.Stopped || e.Len != 10 || e.Pid != pid || e.Peek() {
			t.Fatalf("event %d = %+v; want the held receive of 10 bytes", len(got)-1, e)
		}
		if got[0].Held || !got[0].Peek() {
			t.Fatalf("the peek = %+v; want it recorded, not held", got[0])
		}
		if err := unix.Kill(int(pid), unix.SIGCONT); err != nil {
			t.Fatal(err)
		}
	}
	// The script now waits for a line: make the job optimistic first, then let it read the rest.
	if err := rec.SetPessimistic(job.ID, false); err != nil {
		t.Fatal(err)
	}
	assertFlagCleared(t, rec.objs.PessimisticAny, "pessimistic_any")
	if _, err := fmt.Fprintln(child.Stdin); err != nil {
		t.Fatal(err)
	}
	if l := child.LineT(ctx, t); !strings.HasPrefix(l, "done ") {
		t.Fatalf("server said %q, want done", l)
	}
	if got := col.waitEvents(ctx, t, 4); got[3].Held || got[3].Stopped || got[3].Len != 10 {
		t.Fatalf("the receive after SetPessimistic(false) = %+v; want it neither held nor stopped", got[3])
	}
	if _, err := fmt.Fprintln(child.Stdin); err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, client)
	if err := child.Wait(); err != nil {
		t.Fatalf("server: %v", err)
	}
}

// assertFlagCleared fails unless the program's flag variable is 0: its map has no key left.
func assertFlagCleared(t *testing.T, flag *ebpf.Variable, name string) {
	t.Helper()
	var v uint32
	if err := flag.Get(&v); err != nil {
		t.Fatalf("read %s: %v", name, err)
	}
	if v != 0 {
		t.Fatalf("%s = %d after its map's last key went; want 0", name, v)
	}
}
