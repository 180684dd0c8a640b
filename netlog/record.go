package netlog

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/ftkit/ftkit/tcpflow"
)

// RecordHeaderLen is the size of the fixed part of a ring-buffer record. The eBPF side must
// emit the header packed (no padding between len and cgroup_id at offset 20): a naturally
// aligned C struct would be 40 bytes and is rejected by DecodeRecord's length check.
//
//	off size field
//	  0    4 saddr      IPv4, network byte order (as in the IP header)
//	  4    4 daddr      IPv4, network byte order
//	  8    2 sport      network byte order
//	 10    2 dport      network byte order
//	 12    4 seq        TCP sequence of the first payload byte, host (little-endian) order
//	 16    4 len        payload length, little-endian
//	 20    8 cgroup_id  little-endian
//	 28    8 ktime_ns   little-endian
//	 36  len payload
//
// A parked record (ParkedFlag set in len) carries no payload: its segment's bytes wait in a clone in the
// park (package netlog/park), in the queue of the CPU named by the 4 bytes after the header.
//
//	36    4 cpu        little-endian: the park queue holding the clone
const RecordHeaderLen = 36

// ParkedFlag marks a parked record in the len field; the other bits are the parked payload's length.
const ParkedFlag = 1 << 31

// parkedRecordLen is the size of a parked record: the header and the queue.
const parkedRecordLen = RecordHeaderLen + 4

// MaxPayload bounds a record's payload: 512 KiB covers BIG TCP GSO packets with room to spare.
// Anything larger is not a packet and is rejected before a caller sizes buffers from it.
const MaxPayload = 1 << 20

// ErrBadRecord is wrapped by every DecodeRecord error.
var ErrBadRecord = errors.New("malformed ring-buffer record")

// Record is one captured TCP segment as the eBPF probe reports it.
type Record struct {
	// Conn is the segment's connection seen from the sending socket: Local sent the payload,
	// Remote receives it. A log is kept by the sender, so this is also its own socket's view.
	Conn     tcpflow.Tuple
	Seq      uint32 // TCP sequence number of Payload[0]
	CgroupID uint64
	KtimeNs  uint64
	// Payload aliases the buffer DecodeRecord was given; Store.Append copies it, so the
	// buffer may be reused once Append returns.
	Payload []byte
	// Parked, when not 0, is the length of the segment's payload, which is not in the record but in a
	// clone in park queue Queue (Payload is empty).
	Parked uint32
	Queue  uint32
}

// DecodeRecord parses one ring-buffer record (layout at RecordHeaderLen). It does not copy
// the payload. A record whose len field disagrees with the buffer size is rejected.
func DecodeRecord(b []byte) (Record, error) {
	if len(b) < RecordHeaderLen {
		return Record{}, fmt.Errorf("%w: %d bytes, shorter than the %d-byte header (probe and consumer disagree on the layout?)", ErrBadRecord, len(b), RecordHeaderLen)
	}
	n := binary.LittleEndian.Uint32(b[16:20])
	var parked, queue uint32
	if n&ParkedFlag != 0 {
		parked, n = n&^ParkedFlag, 0
		if parked == 0 || parked > MaxPayload {
			return Record{}, fmt.Errorf("%w: parked payload length %d: want 1..%d", ErrBadRecord, parked, MaxPayload)
		}
		if len(b) != parkedRecordLen {
			return Record{}, fmt.Errorf("%w: a parked record of %d bytes, want %d", ErrBadRecord, len(b), parkedRecordLen)
		}
		queue = binary.LittleEndian.Uint32(b[RecordHeaderLen:])
		b = b[:RecordHeaderLen]
	}
	if n > MaxPayload {
		return Record{}, fmt.Errorf("%w: payload length %d exceeds %d", ErrBadRecord, n, MaxPayload)
	}
	if uint64(len(b)) != RecordHeaderLen+uint64(n) {
		return Record{}, fmt.Errorf("%w: len field says %d payload bytes but the buffer holds %d after the %d-byte header (packed layout expected)", ErrBadRecord, n, len(b)-RecordHeaderLen, RecordHeaderLen)
	}
	return Record{
		Conn: tcpflow.Tuple{
			Local:  netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[0:4])), binary.BigEndian.Uint16(b[8:10])),
			Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[10:12])),
		},
		Seq:      binary.LittleEndian.Uint32(b[12:16]),
		CgroupID: binary.LittleEndian.Uint64(b[20:28]),
		KtimeNs:  binary.LittleEndian.Uint64(b[28:36]),
		Payload:  b[RecordHeaderLen:],
		Parked:   parked,
		Queue:    queue,
	}, nil
}

// AppendRecord appends r in the ring-buffer layout to dst; it is the inverse of
// DecodeRecord, for tests and tools that replay captures. Only IPv4 endpoints fit.
func AppendRecord(dst []byte, r Record) ([]byte, error) {
	src, dstAddr := r.Conn.Local.Addr().Unmap(), r.Conn.Remote.Addr().Unmap()
	if !src.Is4() || !dstAddr.Is4() {
		return dst, fmt.Errorf("encode record for %v: the ring-buffer layout holds IPv4 addresses only", r.Conn)
	}
	if len(r.Payload) > MaxPayload || r.Parked > MaxPayload {
		return dst, fmt.Errorf("encode record for %v: payload of %d bytes exceeds %d", r.Conn, max(len(r.Payload), int(r.Parked)), MaxPayload)
	}
	if r.Parked > 0 && len(r.Payload) > 0 {
		return dst, fmt.Errorf("encode record for %v: a parked record carries no payload", r.Conn)
	}
	var h [RecordHeaderLen]byte
	s4, d4 := src.As4(), dstAddr.As4()
	copy(h[0:4], s4[:])
	copy(h[4:8], d4[:])
	binary.BigEndian.PutUint16(h[8:10], r.Conn.Local.Port())
	binary.BigEndian.PutUint16(h[10:12], r.Conn.Remote.Port())
	binary.LittleEndian.PutUint32(h[12:16], r.Seq)
	binary.LittleEndian.PutUint32(h[16:20], uint32(len(r.Payload)))
	binary.LittleEndian.PutUint64(h[20:28], r.CgroupID)
	binary.LittleEndian.PutUint64(h[28:36], r.KtimeNs)
	if r.Parked > 0 {
		binary.LittleEndian.PutUint32(h[16:20], r.Parked|ParkedFlag)
		dst = append(dst, h[:]...)
		return binary.LittleEndian.AppendUint32(dst, r.Queue), nil
	}
	dst = append(dst, h[:]...)
	return append(dst, r.Payload...), nil
}
