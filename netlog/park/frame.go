package park

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/ftkit/ftkit/tcpflow"
)

// ErrNotTCP is wrapped by ParseFrame's errors: the frame is not an IPv4 TCP segment.
var ErrNotTCP = errors.New("park: not an IPv4 TCP frame")

// Frame is what a clone's headers say, and its payload.
type Frame struct {
	Conn tcpflow.Tuple // Local sent it
	// Seq is the sequence number of the payload's first byte: a SYN's own number is before it, as in the
	// log's records (bpf/tcplog.c), which the clones are matched with.
	Seq uint32
	// Payload is the TCP payload, or what of it the read held (Free).
	Payload []byte
}

// ParseFrame parses an Ethernet frame (one optional 802.1Q tag) holding an IPv4 TCP segment. With whole
// set, the frame must hold the payload the IP header announces (a GSO segment's whole payload; BIG TCP's
// length 0 means the frame's end); else it may stop anywhere after the TCP header. It never reads past b.
func ParseFrame(b []byte, whole bool) (Frame, error) {
	const eth = 14
	if len(b) < eth {
		return Frame{}, fmt.Errorf("%w: %d bytes", ErrNotTCP, len(b))
	}
	nh := eth
	proto := binary.BigEndian.Uint16(b[12:14])
	if proto == 0x8100 {
		if len(b) < eth+4 {
			return Frame{}, fmt.Errorf("%w: VLAN tag cut short", ErrNotTCP)
		}
		proto = binary.BigEndian.Uint16(b[16:18])
		nh += 4
	}
	if proto != 0x0800 || len(b) < nh+20 {
		return Frame{}, fmt.Errorf("%w: ethertype %#04x, %d bytes", ErrNotTCP, proto, len(b))
	}
	ip := b[nh:]
	ihl := int(ip[0]&0x0f) * 4
	if ip[0]>>4 != 4 || ihl < 20 || ip[9] != 6 {
		return Frame{}, fmt.Errorf("%w: IP version %d, header %d bytes, protocol %d", ErrNotTCP, ip[0]>>4, ihl, ip[9])
	}
	if binary.BigEndian.Uint16(ip[6:8])&0x3fff != 0 {
		return Frame{}, fmt.Errorf("%w: an IP fragment", ErrNotTCP)
	}
	if len(ip) < ihl+20 {
		return Frame{}, fmt.Errorf("%w: TCP header cut short", ErrNotTCP)
	}
	tcp := ip[ihl:]
	doff := int(tcp[12]>>4) * 4
	if doff < 20 || len(tcp) < doff {
		return Frame{}, fmt.Errorf("%w: TCP header of %d bytes in %d", ErrNotTCP, doff, len(tcp))
	}
	f := Frame{
		Conn: tcpflow.Tuple{
			Local:  netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[12:16])), binary.BigEndian.Uint16(tcp[0:2])),
			Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[16:20])), binary.BigEndian.Uint16(tcp[2:4])),
		},
		Seq:     binary.BigEndian.Uint32(tcp[4:8]),
		Payload: tcp[doff:],
	}
	if tcp[13]&0x02 != 0 { // SYN: the payload of a SYN (TCP Fast Open) starts after the SYN's number
		f.Seq++
	}
	total := int(binary.BigEndian.Uint16(ip[2:4]))
	if total == 0 { // BIG TCP: the frame's length is the segment's
		return f, nil
	}
	if total < ihl+doff {
		return Frame{}, fmt.Errorf("%w: IP length %d below its headers' %d", ErrNotTCP, total, ihl+doff)
	}
	switch end := total - ihl - doff; {
	case end <= len(f.Payload):
		f.Payload = f.Payload[:end] // Ethernet padding after it
	case whole:
		return Frame{}, fmt.Errorf("park: frame cut short: %d of %d payload bytes", len(f.Payload), end)
	}
	return f, nil
}
