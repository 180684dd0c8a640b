//go:build linux

package jobnet_test

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/lab/labtest"
)

// TestClosing: a connection closed from a job network while the peer's host drops its packets is counted
// by Closing until the peer acknowledges its FIN, which it does once the drop ends, with every byte; a
// network that does not exist has none.
func TestClosing(t *testing.T) {
	l := labtest.New(t, 2, 0)
	ctx := context.Background()
	s := jobSpec(t, l, "node1", jobnet.MACVlan, 1)
	if err := jobnet.Create(ctx, s); err != nil {
		t.Fatalf("create: %v", err)
	}
	if n, err := jobnet.Closing(s.Name); err != nil || n != 0 {
		t.Fatalf("Closing(%s) before any connection = %d, %v, want 0", s.Name, n, err)
	}
	if n, err := jobnet.Closing(s.Name + "-none"); err != nil || n != 0 {
		t.Fatalf("Closing of a network that does not exist = %d, %v, want 0, nil", n, err)
	}
	node2, _ := l.Host("node2")
	addr := netip.AddrPortFrom(node2.Addr.Addr(), 7004).String()
	var ln net.Listener
	if err := l.Do("node2", func() (err error) { ln, err = net.Listen("tcp4", addr); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var c net.Conn
	if err := jobnet.Do(s.Name, func() (err error) { c, err = net.DialTimeout("tcp4", addr, 10*time.Second); return err }); err != nil {
		t.Fatalf("dial %s from the job network: %v", addr, err)
	}
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	undrop := labtest.DropFrom(t, l, "node2", s.Addr.Addr())
	const last = "the job's last words"
	if _, err := c.Write([]byte(last)); err != nil {
		t.Fatal(err)
	}
	c.Close() // as the kernel does for a process that exits
	if n, err := jobnet.Closing(s.Name); err != nil || n != 1 {
		t.Fatalf("Closing(%s) after the close, its FIN dropped = %d, %v, want 1", s.Name, n, err)
	}
	undrop()
	_ = peer.SetReadDeadline(time.Now().Add(time.Minute)) // the FIN's retransmission backs off from 200 ms
	got, err := io.ReadAll(peer)
	if err != nil || string(got) != last {
		t.Fatalf("the peer read %q, %v, want %q and the end of the stream", got, err, last)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		n, err := jobnet.Closing(s.Name)
		if err == nil && n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Closing(%s) = %d, %v a minute after the peer read the end, want 0", s.Name, n, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
