package lab

import (
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// TCPSockets is the kernel's TCP_INFO of every established IPv4 TCP socket in host's network namespace, by
// 4-tuple (local end on host), read with sock_diag.
func (l *Lab) TCPSockets(host string) (map[tcpflow.Tuple]netlink.TCPInfo, error) {
	out := map[tcpflow.Tuple]netlink.TCPInfo{}
	err := l.Do(host, func() error {
		socks, err := netlink.SocketDiagTCPInfo(unix.AF_INET)
		if err != nil {
			return fmt.Errorf("sock_diag: %w", err)
		}
		for _, s := range socks {
			if s.TCPInfo == nil || s.InetDiagMsg.State != unix.BPF_TCP_ESTABLISHED {
				continue
			}
			id := s.InetDiagMsg.ID
			src, _ := netip.AddrFromSlice(id.Source.To4())
			dst, _ := netip.AddrFromSlice(id.Destination.To4())
			out[tcpflow.Tuple{Local: netip.AddrPortFrom(src, id.SourcePort), Remote: netip.AddrPortFrom(dst, id.DestinationPort)}] = *s.TCPInfo
		}
		return nil
	})
	return out, err
}
