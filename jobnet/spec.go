// Package jobnet gives a job its own address on the cluster network: a named network namespace holding one
// ipvlan (L2) or macvlan (bridge) interface on the host's cluster interface, the job's address on it,
// loopback up and a default route via the cluster's gateway. Every connection of a process in that namespace
// uses the job's address, so fail-over can move the address with the job and leave the host its own.
//
// The namespace is named (bind-mounted under /run/netns, the `ip netns` convention) rather than held by a
// file descriptor, so that an agent that restarts after a crash finds it again by name; Create and Delete
// are idempotent for the same reason. See docs/job-addresses.md for the measured facts.
package jobnet

import (
	"fmt"
	"hash/fnv"
	"net/netip"
	"path/filepath"
)

// NetnsDir is where named namespaces are bind-mounted (vishvananda/netns and `ip netns` use it).
const NetnsDir = "/run/netns"

// DefaultIfName is the job's interface name inside its namespace.
const DefaultIfName = "eth0"

// Kind is the type of the job's interface.
type Kind string

const (
	// IPVlan in L2 mode shares the parent's MAC address: peers see the job's address at the host's MAC, so
	// after the address moves to another host their neighbour caches must be told (gratuitous ARP).
	IPVlan Kind = "ipvlan"
	// MACVlan in bridge mode has a MAC of its own, which the switch must learn and allow (port security).
	MACVlan Kind = "macvlan"
)

// Spec describes a job's network.
type Spec struct {
	Name    string       // namespace name under NetnsDir: [A-Za-z0-9_.-], at most 64 bytes
	Parent  string       // the host's cluster interface, in ParentNetns
	Kind    Kind         // IPVlan or MACVlan
	Addr    netip.Prefix // the job's IPv4 address with the cluster network's prefix length
	Gateway netip.Addr   // default route via this address; invalid (zero) for none
	IfName  string       // the interface's name inside the namespace; "" for DefaultIfName
	// ParentNetns is the path of the network namespace that holds Parent; "" for the calling process's own
	// (the agent's, /proc/self/ns/net). Tests pass a lab host's namespace.
	ParentNetns string
}

// maxNameLen bounds a namespace name: it becomes a path component and appears in logs.
const maxNameLen = 64

// ValidName reports whether name is usable as a namespace name: a single path component of safe bytes,
// so that it can never escape NetnsDir.
func ValidName(name string) error {
	if name == "" || len(name) > maxNameLen {
		return fmt.Errorf("job network name %q: want 1 to %d bytes", name, maxNameLen)
	}
	if name == "." || name == ".." {
		return fmt.Errorf("job network name %q: not a name", name)
	}
	for _, c := range []byte(name) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-'
		if !ok {
			return fmt.Errorf("job network name %q: only letters, digits, '_', '.' and '-' are allowed", name)
		}
	}
	return nil
}

// validIfName checks a Linux interface name (IFNAMSIZ is 16 with the NUL).
func validIfName(name string) error {
	if name == "" || len(name) > 15 || name == "." || name == ".." {
		return fmt.Errorf("interface name %q: want 1 to 15 bytes", name)
	}
	for _, c := range []byte(name) {
		if c <= ' ' || c == '/' || c == ':' || c >= 0x7f {
			return fmt.Errorf("interface name %q: no spaces, '/', ':' or control bytes", name)
		}
	}
	return nil
}

// Validate checks s and returns it with defaults filled in.
func (s Spec) Validate() (Spec, error) {
	if err := ValidName(s.Name); err != nil {
		return s, err
	}
	if err := validIfName(s.Parent); err != nil {
		return s, fmt.Errorf("parent: %w", err)
	}
	if s.IfName == "" {
		s.IfName = DefaultIfName
	}
	if err := validIfName(s.IfName); err != nil {
		return s, fmt.Errorf("job interface: %w", err)
	}
	switch s.Kind {
	case IPVlan, MACVlan:
	default:
		return s, fmt.Errorf("job network %s: kind %q: want %q or %q", s.Name, s.Kind, IPVlan, MACVlan)
	}
	if !s.Addr.IsValid() || !s.Addr.Addr().Is4() {
		return s, fmt.Errorf("job network %s: address %v: want an IPv4 address with a prefix length", s.Name, s.Addr)
	}
	a := s.Addr.Addr()
	if a.IsUnspecified() || a.IsLoopback() || a.IsMulticast() || a.IsLinkLocalUnicast() || s.Addr.Bits() == 0 || s.Addr.Bits() > 32 {
		return s, fmt.Errorf("job network %s: address %v is not a unicast host address", s.Name, s.Addr)
	}
	if s.Addr.Bits() < 31 && (a == s.Addr.Masked().Addr() || a == broadcast(s.Addr)) {
		return s, fmt.Errorf("job network %s: address %v is its subnet's network or broadcast address", s.Name, s.Addr)
	}
	if s.Gateway.IsValid() {
		if !s.Gateway.Is4() || !s.Addr.Contains(s.Gateway) || s.Gateway == a {
			return s, fmt.Errorf("job network %s: gateway %v must be another IPv4 address inside %v", s.Name, s.Gateway, s.Addr.Masked())
		}
	}
	return s, nil
}

// broadcast is the last address of p's subnet.
func broadcast(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	host := ^uint32(0) >> p.Bits()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3]) | host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Path is the bind-mount path of the namespace name; name must be valid.
func Path(name string) string { return filepath.Join(NetnsDir, name) }

// tempLinkName is the name agents before 2026-11-29 gave the interface in the parent's namespace between
// its creation and its move into the job's (derived from the job's name): Create and Delete remove one
// that such an agent's crash left. The interface is now made inside the job's namespace.
func tempLinkName(name string) string {
	h := fnv.New32a()
	h.Write([]byte(name))
	return fmt.Sprintf("ftj%08x", h.Sum32())
}
