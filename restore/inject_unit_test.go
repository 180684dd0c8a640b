package restore

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestPeerSegment: a segment injected as the peer goes from the peer's port to the local socket's, carries
// seq, ack, ACK|PSH, the window, the timestamp option in Linux's layout when asked, and the payload; its
// checksum equals the one an independent implementation computed (Python's struct over RFC 793's
// pseudo-header, peer address as the source) and verifies. The IPv4 header goes from the peer to the local
// address.
func TestPeerSegment(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:7000"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	for _, tc := range []struct {
		name    string
		h       PeerHeader
		payload string
		sum     uint16
	}{
		{"timestamps", PeerHeader{Seq: 0x01020304, Ack: 0xa0b0c0d0, Window: 512, TS: true, TSval: 123456789, TSecr: 987654321}, "hello", 0x87bb},
		{"no options, odd length", PeerHeader{Seq: 0xfffffffe, Ack: 1, Window: 65535}, "odd", 0x10ca},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := peerSegment(conn, tc.h, []byte(tc.payload))
			hl := 20
			if tc.h.TS {
				hl = 32
			}
			if len(b) != hl+len(tc.payload) || binary.BigEndian.Uint16(b[0:]) != 40000 || binary.BigEndian.Uint16(b[2:]) != 7000 ||
				binary.BigEndian.Uint32(b[4:]) != tc.h.Seq || binary.BigEndian.Uint32(b[8:]) != tc.h.Ack ||
				int(b[12]>>4)*4 != hl || b[13] != 0x18 || binary.BigEndian.Uint16(b[14:]) != tc.h.Window ||
				string(b[hl:]) != tc.payload {
				t.Errorf("segment % x: want %+v from the peer's port with %q", b, tc.h, tc.payload)
			}
			if tc.h.TS && (!bytes.Equal(b[20:24], []byte{1, 1, 8, 10}) ||
				binary.BigEndian.Uint32(b[24:]) != tc.h.TSval || binary.BigEndian.Uint32(b[28:]) != tc.h.TSecr) {
				t.Errorf("options % x: want NOP NOP TS %d %d", b[20:32], tc.h.TSval, tc.h.TSecr)
			}
			if sum := binary.BigEndian.Uint16(b[16:]); sum != tc.sum {
				t.Errorf("checksum 0x%04x, want 0x%04x", sum, tc.sum)
			}
			if got := conn.Reverse().Checksum(b); got != 0 {
				t.Errorf("checksum does not verify (re-sum 0x%04x)", got)
			}
			ip := peerDatagram(conn, tc.h, []byte(tc.payload))
			if ip[0] != 0x45 || ip[9] != 6 || netip.AddrFrom4([4]byte(ip[12:16])) != conn.Remote.Addr() ||
				netip.AddrFrom4([4]byte(ip[16:20])) != conn.Local.Addr() || int(binary.BigEndian.Uint16(ip[2:])) != len(ip) ||
				!bytes.Equal(ip[20:], b) {
				t.Errorf("datagram % x: want IPv4/TCP from %s to %s around the segment", ip[:20], conn.Remote.Addr(), conn.Local.Addr())
			}
		})
	}
	if err := InjectFromPeer(conn, PeerHeader{MaxPayload: MaxInjectPayload + 1}, []byte("x")); err == nil {
		t.Error("MaxPayload over an IPv4 datagram's limit accepted")
	}
	if b := peerSegment(conn, PeerHeader{Seq: 5, Fin: true}, nil); len(b) != 20 || b[13] != 0x19 || conn.Reverse().Checksum(b) != 0 {
		t.Errorf("a FIN alone: segment % x, want 20 bytes with ACK|PSH|FIN (0x19), checksummed", b)
	}
}

// TestForEachSegmentFin: the FIN rides the segment with the payload's last byte, or goes alone.
func TestForEachSegmentFin(t *testing.T) {
	for _, tc := range []struct {
		n    int
		want string // each piece's length and FIN
	}{
		{3000, "[1448 false 1448 false 104 true]"},
		{1448, "[1448 true]"},
		{0, "[0 true]"},
	} {
		var got []any
		err := forEachSegment(PeerHeader{Seq: 1, Fin: true}, make([]byte, tc.n), 1448, func(h PeerHeader, part []byte) error {
			got = append(got, len(part), h.Fin)
			return nil
		})
		if err != nil || fmt.Sprint(got) != tc.want {
			t.Errorf("%d bytes with a FIN: pieces %v (err %v), want %s", tc.n, got, err, tc.want)
		}
	}
}

// TestForEachSegment: a payload is cut into pieces of at most max bytes, in order, each with the sequence
// number of its first byte, across the 2^32 wrap; an empty payload sends nothing.
func TestForEachSegment(t *testing.T) {
	payload := make([]byte, 3000)
	for i := range payload {
		payload[i] = byte(i)
	}
	for _, tc := range []struct {
		seq   uint32
		max   int
		n     int
		sizes []int
	}{
		{1000, 1448, 3000, []int{1448, 1448, 104}},
		{0xffffff00, 1000, 3000, []int{1000, 1000, 1000}}, // the second piece starts at seq 0xffffff00+1000, past the wrap
		{7, MaxInjectPayload, 3000, []int{3000}},
		{7, 1, 3, []int{1, 1, 1}},
		{7, 1448, 0, nil},
	} {
		var sizes []int
		var joined []byte
		err := forEachSegment(PeerHeader{Seq: tc.seq, Ack: 9}, payload[:tc.n], tc.max, func(h PeerHeader, part []byte) error {
			if want := tc.seq + uint32(len(joined)); h.Seq != want || h.Ack != 9 {
				t.Errorf("seq %d max %d: piece at offset %d has seq %d ack %d, want seq %d ack 9", tc.seq, tc.max, len(joined), h.Seq, h.Ack, want)
			}
			sizes = append(sizes, len(part))
			joined = append(joined, part...)
			return nil
		})
		if err != nil || !bytes.Equal(joined, payload[:tc.n]) || fmt.Sprint(sizes) != fmt.Sprint(tc.sizes) {
			t.Errorf("seq %d max %d: pieces %v (err %v), want %v covering the payload in order", tc.seq, tc.max, sizes, err, tc.sizes)
		}
	}
}
