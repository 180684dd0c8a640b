//go:build linux

package ebpfprobes

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestKickResumesStalledFlow fills a 64 KiB ring that nobody reads with a 1 MiB stream from a socket of
// the test process on lab host a, so that the program drops its segments until TCP has nothing in flight
// and only its window probe timer (200 ms, doubling) would send again. Draining the ring must then kick
// the flow (tcplog_kick pushes its queue from the lab host's namespace, which the test's threads are not
// in), leave the application's Nagle setting as it was, and let the whole stream through.
func TestKickResumesStalledFlow(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	l := newTestLogger(t, 64<<10)
	const size = 1 << 20
	// Nagle on, as a program may leave it (Go turns it off by default).
	sf := stallFlow(t, tn, l, 40041, 5041, size, false)
	sf.drain(t, l, size)
	c, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("counters %+v", c)
	if c.Kicks == 0 {
		t.Errorf("no kick after %d backpressure drops", c.DropsBackpressure)
	}
	var nodelay int
	raw, err := sf.conn.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if cerr := raw.Control(func(fd uintptr) {
		nodelay, err = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY)
	}); cerr != nil || err != nil {
		t.Fatalf("getsockopt TCP_NODELAY: %v %v", cerr, err)
	}
	if nodelay != 0 {
		t.Errorf("TCP_NODELAY is %d after the kick, want 0: the application's setting changed", nodelay)
	}
}

// stalledFlow is a stream from a socket of the test process on lab host a to a receiver on host b that
// reads it all, whose segments the logger has started to drop for backpressure.
type stalledFlow struct {
	conn     *net.TCPConn
	received chan int64 // what the receiver read, once the stream ends (-1: no connection)
	wrote    chan error // the writer's end: nil once all size bytes are written and the write side closed
}

// stallFlow starts the stream (size bytes from local port lport to port on b; nodelay as the socket's
// TCP_NODELAY) under l, attached to a's interface with nobody reading its ring, and returns once the
// program has dropped one of its segments: the ring is full.
func stallFlow(t *testing.T, tn *testNet, l *TCPLogger, lport, port, size int, nodelay bool) stalledFlow {
	t.Helper()
	if err := l.ProtectPort(uint16(lport)); err != nil {
		t.Fatal(err)
	}
	if err := tn.attach(l, hostA); err != nil {
		t.Fatalf("Attach: %v", err)
	}
	dst := &net.TCPAddr{IP: tn.ipB.AsSlice(), Port: port}
	var ln *net.TCPListener
	if err := tn.lab.Do(hostB, func() (err error) {
		ln, err = net.ListenTCP("tcp4", dst)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	sf := stalledFlow{received: make(chan int64, 1), wrote: make(chan error, 1)}
	go func() {
		c, err := ln.Accept()
		if err != nil {
			sf.received <- -1
			return
		}
		defer c.Close()
		n, _ := io.Copy(io.Discard, c)
		sf.received <- n
	}()
	if err := tn.lab.Do(hostA, func() (err error) {
		sf.conn, err = net.DialTCP("tcp4", &net.TCPAddr{Port: lport}, dst)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sf.conn.Close() })
	if err := sf.conn.SetNoDelay(nodelay); err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := sf.conn.Write(make([]byte, size))
		if err == nil {
			err = sf.conn.CloseWrite()
		}
		sf.wrote <- err
	}()
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Millisecond) {
		c, err := l.Counters()
		if err != nil {
			t.Fatal(err)
		}
		if c.DropsBackpressure > 0 {
			return sf
		}
		if time.Now().After(deadline) {
			t.Fatalf("no backpressure drop with a ring nobody reads: counters %+v", c)
		}
	}
}

// drain reads l's ring until the receiver has the whole stream (ReadBatch kicks the stalled flow once the
// ring has room), and checks that it got all size bytes and that the writer saw no error.
func (sf stalledFlow) drain(t *testing.T, l *TCPLogger, size int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	var got int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		got = <-sf.received
		cancel()
	}()
	for {
		_, err := l.ReadBatch(ctx, 0, func([]byte) error { return nil })
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			break
		}
		if err != nil {
			t.Fatalf("ReadBatch: %v", err)
		}
	}
	<-done
	if got != int64(size) {
		t.Fatalf("the receiver got %d bytes, want %d (the flow did not finish within the test's timeout)", got, size)
	}
	if err := <-sf.wrote; err != nil {
		t.Fatalf("write: %v", err)
	}
}

// TestPausedFlowOutlivesTCPGiveUp holds a stream's segments back as a consumer paused at its log's memory
// cap does (ReadPaused every 5 ms, nothing else) for 16 s, twice the time after which TCP gives up on a
// connection whose window probes its own host drops (7.9 s measured, "connection timed out"). Without the
// ring's reserve the stream's write failed so; with it, the flow gets a segment through the reserve
// every 2 s, and once the pause ends the whole stream arrives.
func TestPausedFlowOutlivesTCPGiveUp(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	l := newTestLogger(t, 64<<10)
	const size = 4 << 20
	sf := stallFlow(t, tn, l, 40042, 5042, size, true)
	const pause = 16 * time.Second
	for end := time.Now().Add(pause); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if _, err := l.ReadPaused(func([]byte) error { return nil }); err != nil {
			t.Fatalf("ReadPaused: %v", err)
		}
		select {
		case err := <-sf.wrote:
			t.Fatalf("the stream's write ended during the pause: %v", err)
		default:
		}
	}
	c, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after the pause: counters %+v, ring pending %d of %d", c, l.Pending(), 64<<10)
	if c.ReserveLogged < 3 {
		t.Errorf("%d segments went through the reserve in %s, want one every 2 s or so", c.ReserveLogged, pause)
	}
	sf.drain(t, l, size)
}

// TestGoneConsumerPassesUnlogged stops reading a stream's ring altogether, as a stopped or hung agent
// does. After 4 s without the consumer taking anything, the program passes the stream's segments
// unlogged instead of dropping them: the stream arrives whole, where dropping made TCP give up on it after
// 15 dropped window probes ("connection timed out" 9.6 s into TestPausedFlowOutlivesTCPGiveUp without its
// reserve); the ring then holds the stream with a hole, and the passes are counted.
func TestGoneConsumerPassesUnlogged(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	l := newTestLogger(t, 64<<10)
	const size = 4 << 20
	sf := stallFlow(t, tn, l, 40043, 5043, size, true)
	wrote, deadline := sf.wrote, time.After(2*time.Minute)
	for got := int64(-2); got != size || wrote != nil; {
		select {
		case got = <-sf.received:
			if got != size {
				t.Fatalf("the receiver got %d bytes, want %d", got, size)
			}
		case err := <-wrote:
			if err != nil {
				t.Fatalf("write: %v", err)
			}
			wrote = nil
		case <-deadline:
			t.Fatal("the stream did not arrive within 2 minutes while nobody read the ring")
		}
	}
	c, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("counters %+v", c)
	if c.UnloggedPassed == 0 {
		t.Fatalf("the stream arrived with no segment passed unlogged: %+v", c)
	}
	// What the ring holds of the stream: its start, then nothing but what TCP sent again.
	var logged int
	for l.Pending() > 0 {
		if _, err := l.ReadBatch(t.Context(), 0, func(raw []byte) error {
			logged += len(raw) - RecordHeaderLen
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if logged >= size {
		t.Errorf("the ring holds %d payload bytes of the %d-byte stream: no hole where segments passed unlogged", logged, size)
	}
}
