//go:build linux

package ebpfprobes

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/tcpframe"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestTCPLoggerForwardedPagedHeaders logs a forwarded segment whose TCP
// header is not in the skb's linear part, as a NIC's receive path can hand
// it to the host that routes a container's or a job namespace's traffic.
// On Linux 6.18 bpf_dynptr_copy from an offset past the linear part copies
// the memory after it instead of the packet (docs/ebpf-logging.md, "Copies
// past the linear part"): the logger must make the headers linear first.
//
// A tap with a virtio-net header whose hdr_len is 14 builds that skb: the
// Ethernet header in the linear part, the rest in page fragments. IP's
// receive path pulls the IP header only, and forwarding leaves the TCP
// header where it was, so the logger on the egress device sees it in a
// fragment.
func TestTCPLoggerForwardedPagedHeaders(t *testing.T) {
	requirePrivileges(t)
	l, err := NewTCPLogger(TCPLoggerOptions{RingBufferSize: 1 << 20})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load the TCX logger: %v", err)
	}
	if err != nil {
		t.Fatalf("NewTCPLogger: %+v", err)
	}
	defer l.Close()

	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.211.1.2:40000"), Remote: netip.MustParseAddrPort("10.211.2.2:5001")}
	if err := l.ProtectFlow(f); err != nil {
		t.Fatal(err)
	}
	seg := tcpframe.Segment{
		Seq: 7000, Ack: 1, Flags: 0x18, Window: 512, // PSH|ACK
		Opts:    []byte{1, 1, 8, 10, 0, 0, 0, 9, 0, 0, 0, 3}, // NOP NOP timestamps
		Payload: 6000,                                        // tun builds a frame under a page linear

	}
	frame := seg.Frame(f)
	tap := forwardingNetns(t, l, net.HardwareAddr(frame[0:6]))

	// virtio_net_hdr: no offloads, hdr_len 14 (little endian, as on every
	// host this runs on).
	vnet := make([]byte, 10)
	binary.LittleEndian.PutUint16(vnet[2:], 14)
	if _, err := tap.Write(append(vnet, frame...)); err != nil {
		t.Fatalf("write the segment to the tap: %v", err)
	}

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	raw, err := l.Read(ctx)
	if err != nil {
		cnt, _ := l.Counters()
		t.Fatalf("no record of the forwarded segment (logger counters %+v): %v", cnt, err)
	}
	rec, err := parseRecord(raw)
	if err != nil {
		t.Fatal(err)
	}
	want := frame[14+20+20+len(seg.Opts):]
	if rec.seq != seg.Seq || rec.sport != f.Local.Port() || rec.dport != f.Remote.Port() || rec.cgroupID != 0 {
		t.Errorf("record seq %d ports %d->%d cgroup %d, want seq %d ports %d->%d cgroup 0",
			rec.seq, rec.sport, rec.dport, rec.cgroupID, seg.Seq, f.Local.Port(), f.Remote.Port())
	}
	if !bytes.Equal(rec.payload, want) {
		i := 0
		for i < min(len(rec.payload), len(want)) && rec.payload[i] == want[i] {
			i++
		}
		t.Fatalf("the record's %d payload bytes are not the segment's %d: first difference at byte %d: % x",
			len(rec.payload), len(want), i, rec.payload[i:min(len(rec.payload), i+16)])
	}
	cnt, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if cnt.PacketsLogged != 1 || cnt.DropsError != 0 || cnt.HeadersPulled != 1 {
		t.Errorf("counters %+v, want 1 packet logged with its headers pulled, and no error", cnt)
	}
}

// forwardingNetns makes a network namespace that forwards from a tap
// (10.211.1.1/24, hardware address mac) to 10.211.2.2 through one end of a
// veth pair (10.211.2.1/24, a static neighbour entry for .2), with l on that
// end's egress. It returns the tap's file; the namespace and
// its devices go with the test.
func forwardingNetns(t *testing.T, l *TCPLogger, mac net.HardwareAddr) *os.File {
	t.Helper()
	ns := testenv.Netns(t, "ftkit-fwd-test")
	var tap *os.File
	err := netnsthread.In(ns, func() error {
		if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0); err != nil {
			return fmt.Errorf("enable forwarding: %w", err)
		}
		var err error
		if tap, err = openTap("fttap0"); err != nil {
			return err
		}
		tapLink, err := netlink.LinkByName("fttap0")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetHardwareAddr(tapLink, mac); err != nil {
			return fmt.Errorf("set the tap's address: %w", err)
		}
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ftout0"}, PeerName: "ftout1"}); err != nil {
			return fmt.Errorf("add a veth pair: %w", err)
		}
		var out, peer netlink.Link
		for _, x := range []struct {
			link *netlink.Link
			name string
		}{{&out, "ftout0"}, {&peer, "ftout1"}} {
			if *x.link, err = netlink.LinkByName(x.name); err != nil {
				return err
			}
		}
		for _, d := range []struct {
			link netlink.Link
			addr string
		}{{tapLink, "10.211.1.1/24"}, {out, "10.211.2.1/24"}, {peer, ""}} {
			if d.addr != "" {
				a, err := netlink.ParseAddr(d.addr)
				if err != nil {
					return err
				}
				if err := netlink.AddrAdd(d.link, a); err != nil {
					return fmt.Errorf("address %s on %s: %w", d.addr, d.link.Attrs().Name, err)
				}
			}
			if err := netlink.LinkSetMTU(d.link, 9000); err != nil {
				return fmt.Errorf("MTU of %s: %w", d.link.Attrs().Name, err)
			}
			if err := netlink.LinkSetUp(d.link); err != nil {
				return fmt.Errorf("bring up %s: %w", d.link.Attrs().Name, err)
			}
		}
		if err := netlink.NeighAdd(&netlink.Neigh{
			LinkIndex: out.Attrs().Index, Family: unix.AF_INET, State: netlink.NUD_PERMANENT,
			// Not the peer's address: the peer drops the frame instead of
			// forwarding it back.
			IP: net.IPv4(10, 211, 2, 2), HardwareAddr: net.HardwareAddr{2, 0, 0, 0, 0, 0x99},
		}); err != nil {
			return fmt.Errorf("neighbour entry for 10.211.2.2: %w", err)
		}
		return l.Attach(out.Attrs().Index)
	})
	if tap != nil {
		t.Cleanup(func() { tap.Close() })
	}
	if err != nil {
		t.Fatalf("set up the forwarding namespace %s: %v", ns, err)
	}
	return tap
}

// openTap creates a tap device named name in the calling thread's network
// namespace. Writes to it carry a virtio-net header, whose hdr_len sets how
// much of the frame tun puts in the skb's linear part. The descriptor stays
// blocking: tun builds a non-blocking writer's small frames linear.
func openTap(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err == nil {
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		err = unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr)
	}
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("create tap %s: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun"), nil
}
