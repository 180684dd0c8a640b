package intercept

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/ftkit/ftkit/tcpflow"
)

// A Det is one receive-order determinant: a receive call of a protected job that consumed bytes of one TCP
// connection.
type Det struct {
	// Conn is the connection seen from the receiving socket (Local is the job's end).
	Conn tcpflow.Tuple
	// End is the socket's copied_seq after the call: every byte before it was consumed.
	End uint32
	// Len is how many bytes the call returned (it consumed [End-Len, End)).
	Len uint32
	// Thread and Proc are the caller's thread and process ids in the job's PID namespace, which a restore
	// keeps.
	Thread, Proc uint32
	// Pos is how many readiness calls (epoll_wait, poll, select...) the thread had made before this call,
	// counted since the thread's job was started or restored on its host; NoPos if the host counts none (0
	// from an agent of an earlier version).
	Pos uint64
}

// NoPos is the Pos of a call recorded on a host that counts no readiness calls (log.receive_positions
// off). A 0 there passed for a count: a copy restored from a snapshot with positions on such a host, then
// restored again, had its reads replayed at made-up positions (Store.SinceOn). Older agents, which read
// it as a count, add a snapshot's count to it: that wraps below the count, and their gate refuses positions,
// or, for a thread without one, leaves a stop that is never reached, and their replay times out.
const NoPos = ^uint64(0)

func (d Det) String() string {
	if d.Pos == NoPos {
		return fmt.Sprintf("%s consumed %d bytes up to %d (thread %d, readiness calls not counted)", d.Conn, d.Len, d.End, d.Thread)
	}
	return fmt.Sprintf("%s consumed %d bytes up to %d (thread %d after %d readiness calls)", d.Conn, d.Len, d.End, d.Thread, d.Pos)
}

// seqAfter is serial-number a > b (RFC 1982).
func seqAfter(a, b uint32) bool { return int32(a-b) > 0 }

// Bounds of one encoded batch: a request of the cluster protocol is at most 1 MiB.
const (
	// MaxBatch is the most determinants one Pack holds (detSize bytes each): with the connection table and
	// base64, a page stays well inside 1 MiB.
	MaxBatch = 1 << 14
	// MaxConns is the most connections one Pack names (12 bytes each).
	MaxConns = 1 << 12
)

// ErrFormat marks bytes that are not a Pack's encoding.
var ErrFormat = errors.New("not an encoding of determinants")

// packVersion is the encoding's first byte: an agent of another version refuses the batch instead of
// misreading it.
const packVersion = 2

// detSize is the size of one encoded determinant.
const detSize = 26

// Fits is how many of dets, from the first, one Pack holds: at most MaxBatch, naming at most MaxConns
// connections. A member that reads thousands of connections (a server with as many clients) cuts its batches
// there; one Pack of them all would fail, and fail again each time it is tried.
func Fits(dets []Det) int {
	if len(dets) <= MaxConns {
		return len(dets) // they cannot name more connections than that: no table to build
	}
	seen := make(map[tcpflow.Tuple]struct{}, MaxConns)
	for i, d := range dets[:min(len(dets), MaxBatch)] {
		c := d.Conn.Unmap()
		if _, ok := seen[c]; ok {
			continue
		}
		if len(seen) == MaxConns {
			return i
		}
		seen[c] = struct{}{}
	}
	return min(len(dets), MaxBatch)
}

// Pack encodes dets compactly: the version byte, a table of the IPv4 connections they name (u16 count, then
// local address, local port, remote address, remote port: 12 bytes each), then the determinants (u32 count,
// then the connection's index in the table, End, Len, Thread, Proc and Pos: detSize bytes each), all
// big-endian.
func Pack(dets []Det) ([]byte, error) {
	if len(dets) > MaxBatch {
		return nil, fmt.Errorf("pack %d determinants: at most %d at a time", len(dets), MaxBatch)
	}
	idx := map[tcpflow.Tuple]uint16{}
	var conns []tcpflow.Tuple
	for _, d := range dets {
		c := d.Conn.Unmap()
		if _, ok := idx[c]; ok {
			continue
		}
		if !c.Local.Addr().Is4() || !c.Remote.Addr().Is4() {
			return nil, fmt.Errorf("pack determinant of %s: IPv4 connections only", c)
		}
		if len(conns) == MaxConns {
			return nil, fmt.Errorf("pack determinants: more than %d connections in one batch", MaxConns)
		}
		idx[c] = uint16(len(conns))
		conns = append(conns, c)
	}
	b := make([]byte, 0, 1+2+12*len(conns)+4+detSize*len(dets))
	b = append(b, packVersion)
	b = binary.BigEndian.AppendUint16(b, uint16(len(conns)))
	for _, c := range conns {
		b = append(b, c.Local.Addr().AsSlice()...)
		b = binary.BigEndian.AppendUint16(b, c.Local.Port())
		b = append(b, c.Remote.Addr().AsSlice()...)
		b = binary.BigEndian.AppendUint16(b, c.Remote.Port())
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(dets)))
	for _, d := range dets {
		b = binary.BigEndian.AppendUint16(b, idx[d.Conn.Unmap()])
		b = binary.BigEndian.AppendUint32(b, d.End)
		b = binary.BigEndian.AppendUint32(b, d.Len)
		b = binary.BigEndian.AppendUint32(b, d.Thread)
		b = binary.BigEndian.AppendUint32(b, d.Proc)
		b = binary.BigEndian.AppendUint64(b, d.Pos)
	}
	return b, nil
}

// Unpack decodes Pack's encoding, which may come from another host: every count is bounded and checked
// against the bytes that follow, every connection must be a valid one, and nothing may follow the last
// determinant.
func Unpack(b []byte) ([]Det, error) {
	bad := func(format string, args ...any) ([]Det, error) {
		return nil, fmt.Errorf("%w: %s", ErrFormat, fmt.Sprintf(format, args...))
	}
	if len(b) < 3 {
		return bad("%d bytes, shorter than the version and connection count", len(b))
	}
	if b[0] != packVersion {
		return bad("version %d, this agent reads %d (agents of one version must run together)", b[0], packVersion)
	}
	b = b[1:]
	nc := int(binary.BigEndian.Uint16(b))
	b = b[2:]
	if nc > MaxConns {
		return bad("%d connections, more than %d", nc, MaxConns)
	}
	if len(b) < 12*nc+4 {
		return bad("%d connections announced, %d bytes follow", nc, len(b))
	}
	conns := make([]tcpflow.Tuple, nc)
	for i := range conns {
		e := b[12*i:]
		c := tcpflow.Tuple{
			Local:  netip.AddrPortFrom(netip.AddrFrom4([4]byte(e[0:4])), binary.BigEndian.Uint16(e[4:6])),
			Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte(e[6:10])), binary.BigEndian.Uint16(e[10:12])),
		}
		if err := c.Validate(); err != nil {
			return bad("connection %d: %v", i, err)
		}
		conns[i] = c
	}
	b = b[12*nc:]
	nd := binary.BigEndian.Uint32(b)
	b = b[4:]
	if nd > MaxBatch {
		return bad("%d determinants, more than %d", nd, MaxBatch)
	}
	if uint64(len(b)) != detSize*uint64(nd) {
		return bad("%d determinants announced, %d bytes follow (want %d)", nd, len(b), detSize*nd)
	}
	dets := make([]Det, nd)
	for i := range dets {
		e := b[detSize*i:]
		ci := int(binary.BigEndian.Uint16(e))
		if ci >= nc {
			return bad("determinant %d names connection %d of %d", i, ci, nc)
		}
		dets[i] = Det{Conn: conns[ci], End: binary.BigEndian.Uint32(e[2:6]), Len: binary.BigEndian.Uint32(e[6:10]),
			Thread: binary.BigEndian.Uint32(e[10:14]), Proc: binary.BigEndian.Uint32(e[14:18]), Pos: binary.BigEndian.Uint64(e[18:26])}
	}
	return dets, nil
}
