package restore

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

// ResetPeer tells the peer of a restored connection that its other end is gone: a TCP RST from the
// connection's local end at seq, the next byte the peer expects. A restored job that is killed because its
// replay failed closes its sockets at its own, older sequence numbers, which the peer ignores (RFC 5961
// accepts a reset only at exactly its rcv_nxt), so without this the survivor waits for ever on a peer that
// will never send again. It sends from the calling thread's network namespace, which must hold the
// connection's local address (the host's after a takeover, or the job's network).
func ResetPeer(conn tcpflow.Tuple, seq uint32) error {
	conn = conn.Unmap()
	if !conn.Local.Addr().Is4() || !conn.Remote.Addr().Is4() {
		return fmt.Errorf("reset %s: IPv4 only", conn)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		return fmt.Errorf("reset %s: raw socket: %w", conn, err)
	}
	defer unix.Close(fd)
	// Bound to the local address: the kernel writes the IP header with it as the source.
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: conn.Local.Addr().As4()}); err != nil {
		return fmt.Errorf("reset %s: bind the raw socket to the connection's address: %w", conn, err)
	}
	if err := unix.Sendto(fd, rstSegment(conn, seq), 0, &unix.SockaddrInet4{Addr: conn.Remote.Addr().As4()}); err != nil {
		return fmt.Errorf("reset %s: send: %w", conn, err)
	}
	return nil
}

// rstSegment is a 20-byte TCP header with only RST set, at seq, checksummed over the IPv4 pseudo-header.
func rstSegment(conn tcpflow.Tuple, seq uint32) []byte {
	b := make([]byte, 20)
	binary.BigEndian.PutUint16(b[0:], conn.Local.Port())
	binary.BigEndian.PutUint16(b[2:], conn.Remote.Port())
	binary.BigEndian.PutUint32(b[4:], seq)
	b[12] = 5 << 4 // data offset: 5 words, no options
	b[13] = 0x04   // RST
	binary.BigEndian.PutUint16(b[16:], conn.Checksum(b))
	return b
}
