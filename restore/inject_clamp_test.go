//go:build linux

package restore

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ackclamp"
	"github.com/ftkit/ftkit/lab/labtest"
)

// TestInjectThroughHeldClamp: with the ACK clamp on node1's interfaces holding the flow (as during a
// replay), the peer's own segment is dropped even when it carries the TOS byte injected segments carry
// (its IP_TOS here; an ECN retransmission or a DSCP re-mark on the way would do the same), and the same
// bytes injected with InjectFromPeer (through lo, marked) reach the socket.
func TestInjectThroughHeldClamp(t *testing.T) {
	labtest.RequireRoot(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	l := labtest.New(t, 2, 0)
	ra, sb, conn := pair(t, l, "node1", "node2", 7370)
	readN(ctx, t, sb, writeAll(t, ra, []byte("hello")))
	readN(ctx, t, ra, writeAll(t, sb, []byte("hello")))
	waitFor(ctx, t, "both hellos acknowledged", func() bool {
		return queued(t, ra, unix.SIOCOUTQ) == 0 && queued(t, sb, unix.SIOCOUTQ) == 0
	})
	rcvNxt, sndNxt := seqs(t, ra)

	c, err := ackclamp.Load()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := l.Do("node1", func() error {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, lk := range links {
			if err := c.Attach(lk.Attrs().Index); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := c.Clamp(conn, sndNxt); err != nil {
		t.Fatal(err)
	}
	if err := c.Hold(conn, true); err != nil {
		t.Fatal(err)
	}

	data := []byte("the peer's bytes")
	sockCtl(t, sb, func(fd int) error { return unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_TOS, InjectedTOS) })
	writeAll(t, sb, data)
	waitFor(ctx, t, "the peer's segment retransmitted (held) or taken", func() bool {
		return sockInfo(t, sb).Total_retrans >= 2 || queued(t, ra, unix.SIOCINQ) > 0
	})
	if n := queued(t, ra, unix.SIOCINQ); n != 0 {
		t.Fatalf("the peer's segment with TOS %#x passed the held clamp: %d bytes queued", InjectedTOS, n)
	}

	h := PeerHeader{Seq: rcvNxt, Ack: sndNxt, Window: 64, TS: true, TSval: tcpClock(t, sb)}
	if err := l.Do("node1", func() error { return InjectFromPeer(conn, h, data) }); err != nil {
		t.Fatal(err)
	}
	if got := readN(ctx, t, ra, len(data)); !bytes.Equal(got, data) {
		t.Fatalf("A read %q, not the injected %q", got, data)
	}
	if err := c.Hold(conn, false); err != nil {
		t.Fatal(err)
	}
}
