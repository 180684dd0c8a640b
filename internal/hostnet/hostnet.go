// Package hostnet reads the addresses of the calling thread's network namespace: which interface holds
// an address (the cluster interface the log and the ACK clamp attach to, the prefix a taken-over address
// gets), and every address there (a receiving node's log watermark lists them).
package hostnet

import (
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
)

// Interface finds the interface that holds addr and the prefix addr has on it.
func Interface(addr netip.Addr) (string, netip.Prefix, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return "", netip.Prefix{}, err
	}
	for _, x := range addrs {
		if ip, ok := netip.AddrFromSlice(x.IP); ok && ip.Unmap() == addr {
			l, err := netlink.LinkByIndex(x.LinkIndex)
			if err != nil {
				return "", netip.Prefix{}, err
			}
			bits, _ := x.Mask.Size()
			return l.Attrs().Name, netip.PrefixFrom(addr, bits), nil
		}
	}
	return "", netip.Prefix{}, fmt.Errorf("no interface holds the cluster address %s; set log.interface", addr)
}

// Addrs lists the addresses configured in this network namespace.
func Addrs() ([]netip.Addr, error) {
	list, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list this host's addresses: %w", err)
	}
	var out []netip.Addr
	for _, x := range list {
		if ip, ok := netip.AddrFromSlice(x.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}
