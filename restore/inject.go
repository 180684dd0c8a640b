package restore

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// PeerHeader is what InjectFromPeer writes into the TCP headers of the segments it sends as a local
// socket's peer. What the receiving socket accepts was measured on Linux 6.18 by TestInjectFromPeer,
// TestInjectFromPeerLimits and TestInjectIntoRepairedSocket (docs/tcp-relocation.md, "Injecting the
// peer's bytes").
type PeerHeader struct {
	// Seq is the peer's sequence number of the first payload byte. The local socket queues a segment only
	// at its rcv_nxt; a later one waits in its out-of-order queue and is merged once the bytes before it
	// arrive, an earlier one is a duplicate it drops (with a D-SACK).
	Seq uint32
	// Ack must lie in [snd_una-min(max_window, bytes_acked), snd_nxt] of the local socket, or the segment
	// is dropped, data and all, and the socket sends the peer a (rate-limited) challenge ACK: after
	// snd_nxt as an ACK of unsent data, before the range as too old (RFC 5961 5.2). A socket fresh from
	// TCP_REPAIR, as CRIU restores one, has bytes_acked 0: until the real peer has acknowledged something,
	// only snd_una <= ack <= snd_nxt passes. An ack above snd_una frees the local socket's send queue up to
	// it: never acknowledge more than the real peer has received, or bytes it lacks are lost for good. The
	// socket's snd_una (the image's outq_seq - outq_len right after a restore) acknowledges nothing new and
	// stays valid until the real peer has acknowledged max_window bytes beyond it. The peer's rcv_nxt
	// (its agent's FlowState.Ack) is refused while the restored socket has not re-sent up to it.
	Ack uint32
	// Window is the raw 16-bit window field. The local socket scales it by its snd_wscale and takes it as
	// the peer's receive window, replacing what it had (the data segments advance snd_wl1; measured:
	// tcpi_snd_wnd = the last injected field << snd_wscale), so give the peer's real window >> the
	// local socket's snd_wscale: too small stalls the local socket's sending, too large makes it send
	// what the peer drops. The peer's own last window field (FlowState.Window) is in that scale already.
	Window uint16
	// TS adds the timestamp option (TSval, TSecr). When the connection negotiated timestamps, a segment
	// without the option is still accepted on 6.18 (Linux does not drop it as RFC 7323 3.2 says it
	// SHOULD), but then it does not move ts_recent (tcp_replace_ts_recent needs the option). TSval must
	// pass PAWS: not below ts_recent-1, the last TSval the socket took from the peer (a socket fresh from
	// TCP_REPAIR has ts_recent 0: any value passes, measured with 5). An in-order TSval also becomes the new ts_recent, and the real peer's later segments must
	// not fall behind it, or PAWS drops them all (measured with a TSval 2^30 ahead: the peer's
	// retransmission and its new bytes fail PAWS, nothing of it is delivered any more). So give a value of
	// the peer's own TS clock read no later than now: the TSval of its latest segment (its agent's
	// FlowState.TSval) or its TCP_TIMESTAMP, never one ahead of it. TSecr is echoed back only; 0 is safe.
	TS           bool
	TSval, TSecr uint32
	// MaxPayload bounds each segment's payload; 0 means DefaultInjectPayload. Longer payloads are split.
	MaxPayload int
	// Fin sets FIN on the segment with the payload's last byte, or sends one segment of FIN alone if the
	// payload is empty: the peer closed its side there (DeliverFIN).
	Fin bool
}

// Segment payload limits. An IPv4 datagram is at most 65535 bytes, the headers with the timestamp option
// take 52; lo's MTU (65536) is larger. Both limits work; DefaultInjectPayload is the MSS of a 1500-byte
// MTU path with timestamps, what the receiving socket sees from its real peer. A large segment costs more
// receive memory, which the socket's window follows (measured: 65483 bytes as one segment charge 131328
// bytes of receive memory, as 1448-byte segments 104960).
const (
	MaxInjectPayload     = 65535 - 20 - 32
	DefaultInjectPayload = 1448
)

// InjectFromPeer delivers payload to the local TCP socket of conn (conn.Local) as if its peer
// (conn.Remote) had sent it: raw IPv4 TCP segments from conn.Remote to conn.Local with ACK|PSH and the
// header fields of h, split at h.MaxPayload, correctly checksummed. It sends from the calling thread's
// network namespace, which must hold conn.Local: the kernel loops the segments back through lo, so a
// firewall rule that drops the real peer's segments on the way in from the network (iifname "eth0") does
// not stop them. When the socket processes them is the kernel's (usually before the send returns); the
// caller sees the bytes arrive in SIOCINQ or the socket's reads.
//
// The caller keeps to three rules. Inject only bytes the real peer has sent (up to its snd_nxt): the
// socket ACKs them, and the peer drops an ACK of bytes it has not sent (with a challenge ACK), window
// update and all, so nothing moves until the peer has sent up to that point by itself, which it cannot
// beyond its send window (measured: the connection stuck for minutes). Keep within the socket's receive window: it grows with in-order data up to the
// receive buffer, bytes beyond it are dropped (TcpExt:BeyondWindow; measured: of 141312 bytes sent at
// once into a 70656-byte window, 86880 were taken). Mind h's Ack and TSval (PeerHeader).
//
// What the socket's ACKs of injected bytes do at the real peer: where the peer's bytes were acknowledged
// before (by the failed original), the ACKs are below the peer's snd_una. Those within
// min(max_window, bytes_acked) of it are old ACKs the peer ignores; older ones it drops with a challenge
// ACK, rate-limited (measured after a CRIU restore: 100000 bytes injected, the peer's max_window 94208,
// TcpExt:TCPACKSkippedChallenge +3, no retransmission, the connection fine afterwards). Where they were not (its segments were lost), they
// acknowledge what it sent: its snd_una catches up, and its retransmission of injected bytes is a
// duplicate the socket drops with a D-SACK (measured: TcpExt:TCPDSACKOldSent). Segments the real peer
// sends beyond the injected point meanwhile wait in the socket's out-of-order queue (TcpExt:TCPOFOQueue)
// and are merged once the injection reaches them.
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
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, InjectedMark); err != nil {
		return fmt.Errorf("inject into %s: mark the raw socket's datagrams (SO_MARK needs CAP_NET_ADMIN): %w", conn, err)
	}
	// IPPROTO_RAW implies IP_HDRINCL: the source must be the peer's address, which is not one of this
	// namespace's, so the IP header is ours (the kernel fills in its length, id and checksum).
	to := &unix.SockaddrInet4{Addr: conn.Local.Addr().As4()}
	return forEachSegment(h, payload, max, func(seg PeerHeader, part []byte) error {
		if err := unix.Sendto(fd, peerDatagram(conn, seg, part), 0, to); err != nil {
			return fmt.Errorf("inject into %s: send %d bytes at seq %d: %w", conn, len(part), seg.Seq, err)
		}
		return nil
	})
}

// forEachSegment calls fn for each piece of payload of at most max bytes, in order, with h's Seq advanced
// to the piece's first byte (mod 2^32).
func forEachSegment(h PeerHeader, payload []byte, max int, fn func(PeerHeader, []byte) error) error {
	if len(payload) == 0 && h.Fin {
		return fn(h, nil)
	}
	for off := 0; off < len(payload); off += max {
		seg := h
		seg.Seq = h.Seq + uint32(off)
		seg.Fin = h.Fin && off+max >= len(payload)
		if err := fn(seg, payload[off:min(off+max, len(payload))]); err != nil {
			return err
		}
	}
	return nil
}

// InjectedMark is the mark (SO_MARK) of every injected datagram: the ACK clamp passes such segments on a
// flow it holds (ackclamp.Clamp.Hold), and drops the peer's own payload segments, whatever their TOS.
const InjectedMark = 0x66746b69

// InjectedTOS is the TOS byte of every injected datagram (DSCP 1, no ECN). The clamp tells injected
// segments by their mark; a clamp an older agent pinned, still attached while its flows replay, tells
// them by this byte.
const InjectedTOS = 0x04

// peerDatagram is an IPv4 datagram from conn.Remote to conn.Local holding peerSegment.
func peerDatagram(conn tcpflow.Tuple, h PeerHeader, payload []byte) []byte {
	tcp := peerSegment(conn, h, payload)
	b := make([]byte, 20, 20+len(tcp))
	b[0] = 0x45 // IPv4, 5 words
	b[1] = InjectedTOS
	binary.BigEndian.PutUint16(b[2:], uint16(20+len(tcp)))
	b[6] = 0x40 // DF
	b[8] = 64   // TTL
	b[9] = unix.IPPROTO_TCP
	src, dst := conn.Remote.Addr().As4(), conn.Local.Addr().As4()
	copy(b[12:], src[:])
	copy(b[16:], dst[:])
	return append(b, tcp...)
}

// peerSegment is the TCP segment (header, options, payload) from conn.Remote to conn.Local with ACK|PSH (and FIN),
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
	if h.Fin {
		b[13] |= 0x01
	}
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
