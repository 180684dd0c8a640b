//go:build linux

package restore

import (
	"bytes"
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/lab/labtest"
)

func TestGarpPacket(t *testing.T) {
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 7}
	got := garp(mac, [4]byte{10, 1, 2, 3})
	want := []byte{0, 1, 8, 0, 6, 4, 0, 1, 2, 0, 0, 0, 0, 7, 10, 1, 2, 3, 0, 0, 0, 0, 0, 0, 10, 1, 2, 3}
	if !bytes.Equal(got, want) {
		t.Errorf("garp = % x\nwant   % x", got, want)
	}
}

// TestTakeOverAnnounce moves an address to spare1 the way a restore does and
// checks, from node1 (the peer), that its neighbour entry follows the
// announcement and a connection reaches the spare; and that the spare's new
// connections start with the raised initial window.
func TestTakeOverAnnounce(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	l := labtest.New(t, 1, 1)
	peer, err := l.Host("node1")
	if err != nil {
		t.Fatal(err)
	}
	a4 := peer.Addr.Addr().As4()
	a4[3] = 200 // an address no host of the lab has: the "failed node's"
	moved := netip.PrefixFrom(netip.AddrFrom4(a4), peer.Addr.Bits())
	stale := net.HardwareAddr{2, 0, 0, 0, 0, 1}

	// The peer knows the address at the failed node's (made-up) MAC.
	if err := l.Do("node1", func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		return netlink.NeighAdd(&netlink.Neigh{LinkIndex: eth0.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_STALE,
			IP: moved.Addr().AsSlice(), HardwareAddr: stale})
	}); err != nil {
		t.Fatal(err)
	}

	// node1 counts the announcements it receives: the first and, without anyone waiting for it, the repeat.
	var arpFd int
	if err := l.Do("node1", func() (err error) {
		arpFd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ARP)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(arpFd)

	var spareMAC net.HardwareAddr
	var ln net.Listener
	if err := l.Do("spare1", func() error {
		for range 2 { // idempotent
			if err := TakeOver("eth0", moved); err != nil {
				return err
			}
		}
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		spareMAC = eth0.Attrs().HardwareAddr
		addrs, err := netlink.AddrList(eth0, unix.AF_INET)
		if err != nil {
			return err
		}
		n := 0
		for _, a := range addrs {
			if a.IP.Equal(moved.Addr().AsSlice()) {
				n++
				if ones, _ := a.Mask.Size(); ones != moved.Bits() {
					t.Errorf("taken-over address has prefix /%d, want /%d", ones, moved.Bits())
				}
			}
		}
		if n != 1 {
			t.Errorf("%d copies of %v on eth0 after two TakeOvers, want 1", n, moved)
		}
		if ln, err = net.Listen("tcp4", netip.AddrPortFrom(moved.Addr(), 7300).String()); err != nil {
			return err
		}
		return Announce(ctx, "eth0", moved.Addr())
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	// The announcement moves the peer's entry to the spare at once.
	var mac net.HardwareAddr
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if err := l.Do("node1", func() error {
			eth0, err := netlink.LinkByName("eth0")
			if err != nil {
				return err
			}
			ns, err := netlink.NeighList(eth0.Attrs().Index, unix.AF_INET)
			for _, n := range ns {
				if n.IP.Equal(moved.Addr().AsSlice()) {
					mac = n.HardwareAddr
				}
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(mac, spareMAC) {
			break
		}
	}
	if !bytes.Equal(mac, spareMAC) {
		t.Fatalf("node1's neighbour entry for %v is %v after the announcement, want the spare's %v", moved.Addr(), mac, spareMAC)
	}
	want := garp(spareMAC, moved.Addr().As4())
	seen := 0
	unix.SetsockoptTimeval(arpFd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 10})
	for buf := make([]byte, 128); seen < 2; {
		n, _, err := unix.Recvfrom(arpFd, buf, 0)
		if err != nil {
			t.Fatalf("node1 received %d of the 2 announcements: %v", seen, err)
		}
		if bytes.Equal(buf[:n], want) {
			seen++
		}
	}
	if err := l.Do("node1", func() error {
		c, err := (&net.Dialer{Timeout: time.Second}).DialContext(ctx, "tcp4", netip.AddrPortFrom(moved.Addr(), 7300).String())
		if err == nil {
			c.Close()
		}
		return err
	}); err != nil {
		t.Errorf("connect to the taken-over address: %v", err)
	}

	// Initial window: raised, never lowered by a smaller raise, used by new connections, and put back.
	var peerLn net.Listener
	if err := l.Do("node1", func() (err error) {
		peerLn, err = net.Listen("tcp4", netip.AddrPortFrom(peer.Addr.Addr(), 7301).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer peerLn.Close()
	if err := l.Do("spare1", func() error {
		raised, err := SetInitCwnd("eth0", 300)
		if err != nil {
			return err
		}
		raisedSmaller, err := SetInitCwnd("eth0", 20)
		if err != nil {
			return err
		}
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		checkRoutes := func(when string, want int) {
			t.Helper()
			routes, err := netlink.RouteList(eth0, netlink.FAMILY_V4)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range routes {
				if r.Type == unix.RTN_UNICAST && (r.InitCwnd != want || r.InitRwnd != want) {
					t.Errorf("%s: route %v: initcwnd %d initrwnd %d, want %d", when, r.Dst, r.InitCwnd, r.InitRwnd, want)
				}
			}
		}
		newCwnd := func() uint32 {
			t.Helper()
			c, err := net.Dial("tcp4", netip.AddrPortFrom(peer.Addr.Addr(), 7301).String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			rc, err := c.(*net.TCPConn).SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			var info *unix.TCPInfo
			var ierr error
			if err := rc.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil || ierr != nil {
				t.Fatalf("TCP_INFO of a new connection: %v %v", err, ierr)
			}
			return info.Snd_cwnd
		}
		checkRoutes("raised to 300, then to 20", 300)
		if got := newCwnd(); got != 300 {
			t.Errorf("a new connection from the spare starts with cwnd %d, want 300", got)
		}
		// The smaller raise changed nothing and puts nothing back; the first returns the routes to their
		// own windows (none: the kernel's), however often it is called, also as a daemon restarted after a
		// crash does, from what its predecessor kept on disk.
		if err := raisedSmaller.PutBack(); err != nil {
			return err
		}
		checkRoutes("the smaller raise put back", 300)
		for _, w := range []RouteEdit{kept(t, raised), raised} {
			if err := w.PutBack(); err != nil {
				return err
			}
			checkRoutes("put back", 0)
		}
		if got := newCwnd(); got != MinInitCwnd {
			t.Errorf("after the put-back a new connection from the spare starts with cwnd %d, want the kernel's %d", got, MinInitCwnd)
		}
		// A route changed since the raise (by an operator) is left as it is now.
		raised, err = SetInitCwnd("eth0", 50)
		if err != nil {
			return err
		}
		routes, err := netlink.RouteList(eth0, netlink.FAMILY_V4)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.Type == unix.RTN_UNICAST {
				r.InitCwnd, r.InitRwnd = 70, 70
				if err := netlink.RouteReplace(&r); err != nil {
					return err
				}
			}
		}
		if err := raised.PutBack(); err != nil {
			return err
		}
		checkRoutes("changed after the raise, then put back", 70)
		if _, err := SetInitCwnd("eth0", 0); err == nil {
			t.Error("SetInitCwnd accepted 0 segments")
		}
		if _, err := SetInitCwnd("nonexistent0", 10); err == nil {
			t.Error("SetInitCwnd accepted a missing interface")
		}
		if err := Announce(ctx, "eth0", netip.MustParseAddr("fd00::1")); err == nil {
			t.Error("Announce accepted an IPv6 address")
		}
		for range 2 { // a missing address is fine
			if err := Release("eth0", moved); err != nil {
				return err
			}
		}
		addrs, err := netlink.AddrList(eth0, unix.AF_INET)
		for _, a := range addrs {
			if a.IP.Equal(moved.Addr().AsSlice()) {
				t.Errorf("%v still on eth0 after Release", moved)
			}
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
}
