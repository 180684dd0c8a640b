package netlog

import "sync/atomic"

// Stats is the memory accounting and traffic counters of a Store or of a whole Log.
// Byte counts are exact at the moment of reading, but a Log's fields are read one by one
// while appends go on, so they may be mutually off by one segment.
type Stats struct {
	Conns int // stores in the Log (1 for a Store)

	RetainedBytes      int64 // logical bytes held, in any form, above the trim points
	RAMBytes           int64 // raw slab buffers in memory, partially filled ones included
	PooledBytes        int64 // freed slab buffers kept for reuse (Log-wide)
	CompressedBytes    int64 // lz4 blocks held in memory
	CompressedRawBytes int64 // what those blocks expand to
	SpilledBytes       int64 // bytes in the spill file that are still referenced
	SpilledRawBytes    int64 // what the spilled bytes expand to
	// OverheadBytes is what the stores of a Log cost whatever they hold (storeOverhead each): a store
	// trimmed to nothing, or holding only parked notes, is still a Store and a map entry.
	OverheadBytes int64

	RAMSlabs, CompressedSlabs, SpilledSlabs int64

	AppendedBytes   int64 // new bytes stored by Append
	DuplicateBytes  int64 // retransmitted bytes already held (verified equal, not stored again)
	BelowFloorBytes int64 // bytes offered below the trim point or base, dropped
	Conflicts       int64 // segments rejected because their bytes differed from the log
}

// MemoryBytes is the RAM the log holds: raw slabs, pooled slabs, compressed blocks and the stores'
// own overhead.
func (s Stats) MemoryBytes() int64 {
	return s.RAMBytes + s.PooledBytes + s.CompressedBytes + s.OverheadBytes
}

// LiveBytes is the RAM holding logged data: MemoryBytes less the pooled buffers, which new data fills
// before anything is allocated. This is the number to compare with a memory cap: while it stays under
// the cap, the log never holds more than the larger of the cap and its previous peak.
func (s Stats) LiveBytes() int64 { return s.RAMBytes + s.CompressedBytes + s.OverheadBytes }

// meter holds Stats as atomics so a Log's totals can be read without visiting every store.
type meter struct {
	retained, ram, pooled, comp, compRaw, spill, spillRaw atomic.Int64
	overhead                                              atomic.Int64
	ramSlabs, compSlabs, spillSlabs                       atomic.Int64
	appended, dup, below, conflicts                       atomic.Int64
}

func (m *meter) snapshot() Stats {
	return Stats{
		RetainedBytes:      m.retained.Load(),
		RAMBytes:           m.ram.Load(),
		PooledBytes:        m.pooled.Load(),
		CompressedBytes:    m.comp.Load(),
		CompressedRawBytes: m.compRaw.Load(),
		SpilledBytes:       m.spill.Load(),
		SpilledRawBytes:    m.spillRaw.Load(),
		OverheadBytes:      m.overhead.Load(),
		RAMSlabs:           m.ramSlabs.Load(),
		CompressedSlabs:    m.compSlabs.Load(),
		SpilledSlabs:       m.spillSlabs.Load(),
		AppendedBytes:      m.appended.Load(),
		DuplicateBytes:     m.dup.Load(),
		BelowFloorBytes:    m.below.Load(),
		Conflicts:          m.conflicts.Load(),
	}
}

// counter names one meter field; a store updates its own meter and its Log's with one call.
type counter int

const (
	cRetained counter = iota
	cRAM
	cComp
	cCompRaw
	cSpill
	cSpillRaw
	cRAMSlabs
	cCompSlabs
	cSpillSlabs
	cAppended
	cDup
	cBelow
	cConflicts
	cOverhead
)

func (m *meter) field(c counter) *atomic.Int64 {
	switch c {
	case cRetained:
		return &m.retained
	case cRAM:
		return &m.ram
	case cComp:
		return &m.comp
	case cCompRaw:
		return &m.compRaw
	case cSpill:
		return &m.spill
	case cSpillRaw:
		return &m.spillRaw
	case cRAMSlabs:
		return &m.ramSlabs
	case cCompSlabs:
		return &m.compSlabs
	case cSpillSlabs:
		return &m.spillSlabs
	case cAppended:
		return &m.appended
	case cDup:
		return &m.dup
	case cBelow:
		return &m.below
	case cOverhead:
		return &m.overhead
	default:
		return &m.conflicts
	}
}
