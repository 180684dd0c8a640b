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
	const lport, size = 40041, 1 << 20
	if err := l.ProtectPort(lport); err != nil {
		t.Fatal(err)
	}
	if err := tn.attach(l, hostA); err != nil {
		t.Fatalf("Attach: %v", err)
	}
	dst := &net.TCPAddr{IP: tn.ipB.AsSlice(), Port: 5041}
	var ln *net.TCPListener
	if err := tn.lab.Do(hostB, func() (err error) {
		ln, err = net.ListenTCP("tcp4", dst)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	received := make(chan int64, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			received <- -1
			return
		}
		defer c.Close()
		n, _ := io.Copy(io.Discard, c)
		received <- n
	}()
	var conn *net.TCPConn
	if err := tn.lab.Do(hostA, func() (err error) {
		conn, err = net.DialTCP("tcp4", &net.TCPAddr{Port: lport}, dst)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Nagle on, as a program may leave it (Go turns it off by default).
	if err := conn.SetNoDelay(false); err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() {
		_, err := conn.Write(make([]byte, size))
		if err == nil {
			err = conn.CloseWrite()
		}
		wrote <- err
	}()

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	for {
		c, err := l.Counters()
		if err != nil {
			t.Fatal(err)
		}
		if c.DropsBackpressure > 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no backpressure drop with a 64 KiB ring nobody reads: counters %+v", c)
		case <-time.After(time.Millisecond):
		}
	}

	// Drain until the receiver has everything; ReadBatch kicks the stalled flow once the ring has room.
	var got int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		got = <-received
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
	if got != size {
		t.Fatalf("the receiver got %d bytes, want %d (the flow did not finish within the test's timeout)", got, size)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("write: %v", err)
	}
	c, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("counters %+v", c)
	if c.Kicks == 0 {
		t.Errorf("no kick after %d backpressure drops", c.DropsBackpressure)
	}
	var nodelay int
	raw, err := conn.SyscallConn()
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
