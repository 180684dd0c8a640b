package netlog

import (
	"sort"
	"time"
)

// span is a run of present bytes [lo, hi) as offsets inside a slab's window.
type span struct{ lo, hi uint32 }

// slab holds the bytes of one aligned window [idx*size, (idx+1)*size) of absolute sequence
// space, in exactly one of three forms: raw (buf), lz4 (comp) or spilled (spill). Which
// bytes are present is in spans, never inferred from the data, so a hole is never mistaken
// for zeros.
type slab struct {
	idx   uint64
	spans []span // sorted, disjoint, not adjacent (adjacent runs are merged)
	valid uint32 // total length of spans

	// bufLo is the window offset of the first byte held (raw, compressed or spilled);
	// rawLen is how many bytes are held from there. A slab of a small connection holds
	// only the part of the window that was written, grown by doubling.
	bufLo  uint32
	rawLen uint32
	buf    []byte    // raw form, len(buf) == rawLen
	comp   []byte    // lz4 block of the rawLen bytes
	spill  *spillRef // spilled form
	crc    uint32    // CRC-32C of the raw bytes, set when compressed

	sealedAt time.Time // when every byte above the trim point became present; zero until then
	busy     bool      // Age is reading buf or comp outside the lock: do not recycle buf
	dropped  bool      // trimmed or closed; an Age result for it must be discarded
	noComp   bool      // lz4 did not shrink it: do not try again
}

// coverEnd returns the end of the span containing off, or off if off is not present.
func (sl *slab) coverEnd(off uint32) uint32 {
	sp := sl.spans
	if n := len(sp); n > 0 && sp[n-1].lo <= off { // common case: the tail span
		if off < sp[n-1].hi {
			return sp[n-1].hi
		}
		return off
	}
	i := sort.Search(len(sp), func(k int) bool { return sp[k].hi > off })
	if i < len(sp) && sp[i].lo <= off {
		return sp[i].hi
	}
	return off
}

// firstSpanAfter returns the index of the first span ending after off.
func (sl *slab) firstSpanAfter(off uint32) int {
	sp := sl.spans
	if n := len(sp); n == 0 || sp[n-1].hi <= off {
		return len(sp)
	}
	return sort.Search(len(sp), func(k int) bool { return sp[k].hi > off })
}

// gapBytes returns how many bytes of [lo, hi) are not present.
func (sl *slab) gapBytes(lo, hi uint32) uint32 {
	missing := hi - lo
	for i := sl.firstSpanAfter(lo); i < len(sl.spans) && sl.spans[i].lo < hi; i++ {
		missing -= min(hi, sl.spans[i].hi) - max(lo, sl.spans[i].lo)
	}
	return missing
}

// addSpan marks [lo, hi) present, merging with touching spans.
func (sl *slab) addSpan(lo, hi uint32) {
	sp := sl.spans
	n := len(sp)
	if n == 0 || lo > sp[n-1].hi {
		sl.spans = append(sp, span{lo, hi})
		return
	}
	if lo >= sp[n-1].lo { // extends the tail span: the contiguous-append case
		sp[n-1].hi = max(sp[n-1].hi, hi)
		return
	}
	i := sort.Search(n, func(k int) bool { return sp[k].hi >= lo })
	j := sort.Search(n, func(k int) bool { return sp[k].lo > hi })
	if i == j {
		sp = append(sp, span{})
		copy(sp[i+1:], sp[i:])
		sp[i] = span{lo, hi}
		sl.spans = sp
		return
	}
	sp[i] = span{min(lo, sp[i].lo), max(hi, sp[j-1].hi)}
	sl.spans = append(sp[:i+1], sp[j:]...)
}

// clipBelow removes every present byte below off and returns how many were removed.
func (sl *slab) clipBelow(off uint32) uint32 {
	var removed uint32
	k := 0
	for _, s := range sl.spans {
		switch {
		case s.hi <= off:
			removed += s.hi - s.lo
		case s.lo < off:
			removed += off - s.lo
			sl.spans[k] = span{off, s.hi}
			k++
		default:
			sl.spans[k] = s
			k++
		}
	}
	sl.spans = sl.spans[:k]
	sl.valid -= removed
	return removed
}
