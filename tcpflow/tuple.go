// Package tcpflow names a TCP connection by its 4-tuple, the one type that the log, the probes, the
// snapshot images and the restorer share instead of each copying the four fields.
package tcpflow

import (
	"errors"
	"fmt"
	"net/netip"
)

// ErrInvalid is wrapped by every Validate error.
var ErrInvalid = errors.New("invalid TCP 4-tuple")

// Tuple is a TCP connection's 4-tuple seen from the socket that owns it: Local is that socket's address,
// Remote its peer's. The same connection seen from the peer is Reverse(). A package that keeps one
// direction of a connection (a byte log keyed by the sending socket) says whose socket it is.
//
// Its JSON is two short fields, {"local":"10.0.0.1:40000","remote":"10.0.0.2:5201"}; a struct that
// embeds a Tuple gets them inline.
type Tuple struct {
	Local  netip.AddrPort `json:"local"`
	Remote netip.AddrPort `json:"remote"`
}

// String is "local->remote".
func (t Tuple) String() string { return t.Local.String() + "->" + t.Remote.String() }

// Reverse is the same connection seen from the other end.
func (t Tuple) Reverse() Tuple { return Tuple{Local: t.Remote, Remote: t.Local} }

// Unmap replaces IPv4-mapped IPv6 addresses by their IPv4 form, so that a dual-stack socket's view and
// an IPv4 socket's view of one connection compare equal.
func (t Tuple) Unmap() Tuple {
	return Tuple{
		Local:  netip.AddrPortFrom(t.Local.Addr().Unmap(), t.Local.Port()),
		Remote: netip.AddrPortFrom(t.Remote.Addr().Unmap(), t.Remote.Port()),
	}
}

// IsValid reports whether Validate accepts t.
func (t Tuple) IsValid() bool { return t.Validate() == nil }

// Validate checks a tuple that came from outside (another node, a file): both ends are addresses a
// connected TCP socket can have (set, specified, non-zero port) of one address family. Check it before
// the tuple names a map entry or a log.
func (t Tuple) Validate() error {
	for _, e := range []struct {
		name string
		ap   netip.AddrPort
	}{{"local", t.Local}, {"remote", t.Remote}} {
		if !e.ap.IsValid() || e.ap.Addr().IsUnspecified() || e.ap.Port() == 0 {
			return fmt.Errorf("%w %s: %s address %q is not a TCP endpoint", ErrInvalid, t, e.name, e.ap)
		}
	}
	if t.Local.Addr().Unmap().Is4() != t.Remote.Addr().Unmap().Is4() {
		return fmt.Errorf("%w %s: one end is IPv4, the other IPv6", ErrInvalid, t)
	}
	return nil
}
