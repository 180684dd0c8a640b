package netlog

// Sequence arithmetic.
//
// An absolute sequence number (written "abs" in this package) is a uint64 whose low 32 bits
// are the on-the-wire TCP sequence number and whose high bits count how often the 32-bit
// space wrapped since the connection's anchor. Keeping the wire value in the low bits means
// Wire(abs) is the number tcpdump and CRIU's tcp-stream image show, with no per-connection
// offset to carry around.
//
// The anchor (the first sequence seen, or one set explicitly with Unwrapper.Anchor) is
// placed in epoch 1, i.e. abs = 1<<32 | seq. Epoch 0 stays free so that retransmissions of
// bytes sent just before the anchor (up to 2^31 behind it) still unwrap to a valid abs.

// AnchorEpoch is the abs of wire sequence 0 in the anchor's epoch.
const AnchorEpoch uint64 = 1 << 32

// Wire returns the 32-bit TCP sequence number of an absolute sequence.
func Wire(abs uint64) uint32 { return uint32(abs) }

// UnwrapNear returns the absolute sequence whose low 32 bits are seq and which lies within
// [ref-2^31, ref+2^31) of ref. A sequence exactly 2^31 away is taken to be behind ref
// (older data), the direction retransmissions come from. ref must be at least 2^31, which
// every abs produced by an Unwrapper is.
func UnwrapNear(ref uint64, seq uint32) uint64 {
	delta := int32(seq - uint32(ref)) // two's-complement distance modulo 2^32
	return uint64(int64(ref) + int64(delta))
}

// Unwrapper turns a connection's 32-bit sequence numbers into absolute ones. Its reference
// point is the highest absolute sequence observed; TCP never has more than 2^30 bytes in
// flight (window scale 14), so every sequence the sender emits, retransmissions included,
// lies well within 2^31 of it. The zero value is unanchored: the first Unwrap anchors it.
// An Unwrapper is not safe for concurrent use; Store guards its own.
type Unwrapper struct {
	ref      uint64
	anchored bool
}

// Anchored reports whether the unwrapper has a reference point yet.
func (u *Unwrapper) Anchored() bool { return u.anchored }

// Anchor sets the reference point so that seq maps to AnchorEpoch|seq and returns that abs.
// It is meant for a fresh connection whose base is known (a snapshot's inq_seq); on an
// anchored unwrapper it only moves the reference, which changes how later values unwrap.
func (u *Unwrapper) Anchor(seq uint32) uint64 {
	u.ref = AnchorEpoch | uint64(seq)
	u.anchored = true
	return u.ref
}

// Unwrap returns the absolute sequence of seq, anchoring the unwrapper at seq if it has no
// reference yet. It does not move the reference: call Observe with the end of accepted data.
func (u *Unwrapper) Unwrap(seq uint32) uint64 {
	if !u.anchored {
		return u.Anchor(seq)
	}
	return UnwrapNear(u.ref, seq)
}

// Peek is Unwrap without side effects: on an unanchored unwrapper it returns the abs seq
// would get if it became the anchor.
func (u *Unwrapper) Peek(seq uint32) uint64 {
	if !u.anchored {
		return AnchorEpoch | uint64(seq)
	}
	return UnwrapNear(u.ref, seq)
}

// Observe advances the reference point to abs if abs is ahead of it.
func (u *Unwrapper) Observe(abs uint64) {
	if abs > u.ref {
		u.ref = abs
	}
}

// Ref returns the current reference point (0 when unanchored).
func (u *Unwrapper) Ref() uint64 { return u.ref }
