// Package netlog is the sender-side log of the TCP bytes a node transmitted, keyed by
// absolute sequence number, from which a crashed receiver's restored sockets are refilled.
//
// Records come from the eBPF probe's ring buffer (DecodeRecord). TCX egress sees GSO
// super-packets, retransmissions and overlapping segments, so a Store deduplicates by byte
// range: bytes already held are compared, never overwritten, and a mismatch is reported as a
// *ConflictError. Bytes live in slabs aligned on absolute sequence numbers (1 MiB by
// default): contiguous appends copy into the current slab in O(1) without allocating, and
// Trim (driven by the receiver's snapshot inq_seq) frees every slab wholly below the trim
// point. Age compresses sealed slabs with lz4 and, past a memory threshold, spills them to an
// unlinked file (write, fsync, then free); reads reassemble from all three forms and verify
// a CRC-32C. A missing range is an error naming it (ErrHole, ErrTrimmed), never zeros.
//
// Absolute sequence numbers keep the wire sequence in their low 32 bits (see Wire and
// Unwrapper); Bounds.Base is the connection's anchor, so abs-Base is the offset from the
// first byte seen.
package netlog
