package restore

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// PeerHeader is what InjectFromPeer writes into the TCP headers of the segments it sends as a local
// socket's peer. The answers to "which values does the receiving socket accept" were measured on Linux 6.18
// (TestInjectFromPeer, docs/tcp-relocation.md "Injecting the peer's bytes").
type PeerHeader struct {
	// Seq is the peer's sequence number of the first payload byte. The local socket queues a segment only
	// at its rcv_nxt (later ones wait in its out-of-order queue, earlier ones are duplicates it ACKs and
	// drops), so deliver in order from rcv_nxt.
	Seq uint32
	// Ack must lie in [snd_una-min(max_window, bytes_acked), snd_nxt] of the local socket; anything else
	// is dropped, data and all: after snd_nxt as an ACK of unsent data, before that range as too old (RFC
	// 5961 5.2, with a challenge ACK to the peer). A socket fresh from TCP_REPAIR has bytes_acked 0, so
	// until the peer's first real ACK only ack >= snd_una passes. An ack above snd_una frees the local
	// socket's send queue up to it: give what the real peer has acknowledged (or received), never more,
	// or bytes the peer lacks are lost for good.
	Ack uint32
	// Window is the raw 16-bit window field. The local socket scales it by its snd_wscale and takes it as
	// the peer's receive window (the segments advance snd_wl1), so give the peer's real window >> the
	// local socket's snd_wscale: too small stalls the local socket's sending, too large makes it send
	// what the peer drops.
	Window uint16
	// TS adds the timestamp option (TSval, TSecr). When the connection negotiated timestamps, a segment
	// without the option is accepted on 6.18 (Linux does not drop it as RFC 7323 3.2 says it SHOULD),
	// but it is cleaner with one. TSval must pass PAWS: not below ts_recent-1, the last TSval the local
	// socket took from the peer (any value passes on a socket fresh from TCP_REPAIR: its ts_recent is 0).
	// It also becomes the new ts_recent, and the real peer's later segments must not fall behind it, or
	// PAWS drops them: give a value of the peer's TS clock read no later than now (its TCP_TIMESTAMP, or
	// the TSval of its latest segment), never an invented one ahead of it. TSecr is echoed; 0 is safe.
	TS           bool
	TSval, TSecr uint32
	// MaxPayload bounds each segment's payload; 0 means DefaultInjectPayload. Longer payloads are split.
	MaxPayload int
}

// Segment payload limits. An IPv4 datagram is at most 65535 bytes, the headers with the timestamp option
// take 52; lo's MTU (65536) is larger. DefaultInjectPayload is the MSS of a 1500-byte-MTU path with
// timestamps, what the receiving socket usually sees: large segments are accepted too (measured: 200 KB
// in 64 KiB segments), but each occupies a 128 KiB buffer of the receiver's receive memory, twice its
// payload, which lowers the window the socket offers its real peer.
const (
	MaxInjectPayload     = 65535 - 20 - 32
	DefaultInjectPayload = 1448
)

// InjectFromPeer delivers payload to the local TCP socket of conn (conn.Local) as if its peer
// (conn.Remote) had sent it: raw IPv4 TCP segments from conn.Remote to conn.Local with ACK|PSH and the
// header fields of h, split at h.MaxPayload, correctly checksummed. It sends from the calling thread's
// network namespace, which must hold conn.Local: the kernel loops the segments back through lo, so a
// firewall rule that drops the real peer's segments on the way in from the network (iifname "eth0") does
// not stop them. Only ordering and the window are the caller's: send each byte once it is the next one
// the socket expects or will be soon; bytes beyond rcv_nxt plus the socket's receive window are dropped
// (an in-sequence segment is taken whole even if it overshoots the window, as long as the window is not
// zero and the receive memory allows).
//
// What the local socket then does at the real peer: it ACKs the injected bytes. Where the peer had those
// bytes acknowledged already (the failed original's), these ACKs are old or duplicates there and change
// nothing (the peer's tcp_ack ignores an ack below its snd_una, and a too-old one gets a rate-limited
// challenge ACK); where the peer had not (its bytes were lost on the way), they acknowledge what it sent,
// its snd_una catches up, and its retransmissions become duplicates the local socket drops with a D-SACK.
// Segments the real peer sends beyond the injected point meanwhile go to the local socket's out-of-order
// queue and are merged once the injection reaches them.
func InjectFromPeer(conn tcpflow.Tuple, h PeerHeader, payload []byte) error {
	conn = conn.Unmap()
	if !conn.Local.Addr().Is4() || !conn.Remote.Addr().Is4() {
		return fmt.Errorf("inject into %s: IPv4 only", conn)
	}
	max := h.MaxPayload
	switch {
	case max == 0:
		max = DefaultInjectPayload
	case max < 1 || max > MaxInjectPayload:
		return fmt.Errorf("inject into %s: MaxPayload %d is outside 1..%d (an IPv4 datagram's limit less the headers)", conn, max, MaxInjectPayload)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return fmt.Errorf("inject into %s: raw socket: %w", conn, err)
	}
	defer unix.Close(fd)
	// IPPROTO_RAW implies IP_HDRINCL: the source must be the peer's address, which is not one of this
	// namespace's, so the IP header is ours (the kernel fills in its length, id and checksum).
	to := &unix.SockaddrInet4{Addr: conn.Local.Addr().As4()}
	for off := 0; off < len(payload); off += max {
		end := min(off+max, len(payload))
		seg := h
		seg.Seq = h.Seq + uint32(off)
		if err := unix.Sendto(fd, peerDatagram(conn, seg, payload[off:end]), 0, to); err != nil {
			return fmt.Errorf("inject into %s: send bytes %d..%d (seq %d): %w", conn, off, end, seg.Seq, err)
		}
	}
	return nil
}

// peerDatagram is an IPv4 datagram from conn.Remote to conn.Local holding peerSegment.
func peerDatagram(conn tcpflow.Tuple, h PeerHeader, payload []byte) []byte {
	tcp := peerSegment(conn, h, payload)
	b := make([]byte, 20, 20+len(tcp))
	b[0] = 0x45 // IPv4, 5 words
	binary.BigEndian.PutUint16(b[2:], uint16(20+len(tcp)))
	b[6] = 0x40 // DF
	b[8] = 64   // TTL
	b[9] = unix.IPPROTO_TCP
	src, dst := conn.Remote.Addr().As4(), conn.Local.Addr().As4()
	copy(b[12:], src[:])
	copy(b[16:], dst[:])
	return append(b, tcp...)
}

// peerSegment is the TCP segment (header, options, payload) from conn.Remote to conn.Local with ACK|PSH,
// checksummed over the IPv4 pseudo-header.
func peerSegment(conn tcpflow.Tuple, h PeerHeader, payload []byte) []byte {
	hl := 20
	if h.TS {
		hl += 12 // NOP, NOP, kind 8 length 10: the layout Linux sends
	}
	b := make([]byte, hl, hl+len(payload))
	binary.BigEndian.PutUint16(b[0:], conn.Remote.Port())
	binary.BigEndian.PutUint16(b[2:], conn.Local.Port())
	binary.BigEndian.PutUint32(b[4:], h.Seq)
	binary.BigEndian.PutUint32(b[8:], h.Ack)
	b[12] = byte(hl/4) << 4
	b[13] = 0x18 // ACK|PSH
	binary.BigEndian.PutUint16(b[14:], h.Window)
	if h.TS {
		b[20], b[21], b[22], b[23] = 1, 1, 8, 10
		binary.BigEndian.PutUint32(b[24:], h.TSval)
		binary.BigEndian.PutUint32(b[28:], h.TSecr)
	}
	b = append(b, payload...)
	binary.BigEndian.PutUint16(b[16:], conn.Reverse().Checksum(b))
	return b
}
