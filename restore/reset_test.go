package restore

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestRSTSegment: the reset is a bare RST at the given sequence number between the connection's ports,
// and its checksum verifies (the one's-complement sum over pseudo-header and segment is all ones); where
// given, it equals the one an independent implementation (Python's struct over RFC 793's pseudo-header)
// computed.
func TestRSTSegment(t *testing.T) {
	for _, tc := range []struct {
		conn tcpflow.Tuple
		seq  uint32
		sum  uint16 // 0: only verified
	}{
		{tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}, 0x01020304, 0xe03f},
		{tcpflow.Tuple{Local: netip.MustParseAddrPort("10.244.160.12:33888"), Remote: netip.MustParseAddrPort("10.244.160.11:7660")}, 1653159582, 0x1e6d},
		{tcpflow.Tuple{Local: netip.MustParseAddrPort("[::ffff:192.0.2.1]:1"), Remote: netip.MustParseAddrPort("192.0.2.255:65535")}, 0xffffffff, 0},
	} {
		c := tc.conn.Unmap()
		b := rstSegment(c, tc.seq)
		if len(b) != 20 || binary.BigEndian.Uint16(b[0:]) != c.Local.Port() || binary.BigEndian.Uint16(b[2:]) != c.Remote.Port() ||
			binary.BigEndian.Uint32(b[4:]) != tc.seq || binary.BigEndian.Uint32(b[8:]) != 0 || b[12] != 0x50 || b[13] != 0x04 {
			t.Errorf("%s: segment % x: want a bare RST at %d between the connection's ports", c, b, tc.seq)
		}
		if sum := binary.BigEndian.Uint16(b[16:]); tc.sum != 0 && sum != tc.sum {
			t.Errorf("%s: checksum 0x%04x, want 0x%04x", c, sum, tc.sum)
		}
		// Summing again with the checksum in place gives 0xffff, whose complement is 0.
		if got := c.Checksum(b); got != 0 {
			t.Errorf("%s: checksum 0x%04x does not verify (re-sum 0x%04x)", c, binary.BigEndian.Uint16(b[16:]), got)
		}
	}
}
