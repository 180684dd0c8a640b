package hostnet

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// Loopback is in every network namespace: both functions find it, and an address held nowhere is an
// error that says what to set.
func TestLoopback(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1")
	addrs, err := Addrs()
	if err != nil {
		t.Fatalf("Addrs: %v", err)
	}
	if !slices.Contains(addrs, lo) {
		t.Skipf("SKIPPED: no %s in this network namespace (%v)", lo, addrs)
	}
	name, prefix, err := Interface(lo)
	if err != nil || name != "lo" || prefix != netip.MustParsePrefix("127.0.0.1/8") {
		t.Errorf("Interface(%s) = %q, %v, %v; want lo, 127.0.0.1/8", lo, name, prefix, err)
	}
	if _, _, err := Interface(netip.MustParseAddr("192.0.2.213")); err == nil || !strings.Contains(err.Error(), "log.interface") {
		t.Errorf("Interface of an address held nowhere: %v; want an error naming log.interface", err)
	}
}
