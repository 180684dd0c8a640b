package netlog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"sync"
	"time"

	"github.com/pierrec/lz4/v4"

	"github.com/ftkit/ftkit/internal/coldcopy"
)

// minBuf is the first allocation for a slab of a connection that has not yet sent a slab's
// worth: small connections (control traffic, barriers) must not cost a MiB each.
const minBuf = 4096

// Store is the log of the bytes one TCP sender transmitted on one connection, keyed by
// absolute sequence number. It is safe for one appending goroutine and any number of
// readers, trimmers and agers at once.
type Store struct {
	env        *env
	own        meter
	standalone bool // owns env (NewStore): report the pool in Stats, close the spill file

	mu     sync.RWMutex
	closed bool
	u      Unwrapper
	base   uint64 // abs of the anchor
	floor  uint64 // bytes below were trimmed or precede the base
	first  uint64 // lowest retained byte, valid when retained > 0
	contig uint64 // [first, contig) is retained
	last   uint64 // one past the highest retained byte
	low    uint64 // lowest byte offered (appended or parked) at or above the floor; 0: none
	// conflictEnd is one past the highest byte of a segment that differed from the logged bytes (0: none).
	conflictEnd uint64
	retained    int64
	bulk        bool // has logged at least a slab: allocate whole slabs from now on
	slab0       uint64
	slabs       []*slab // slabs[i] covers window slab0+i; nil where nothing is held

	// What the agent needs to tell a finished connection from a live one (Activity).
	lastAppend time.Time // when a segment was last offered
	lastKtime  uint64    // the newest transmit time a record carried
	cgroup     uint64    // the sending socket's cgroup, from the last record that named one
}

// NewStore returns an empty standalone store. Stores inside a Log are made by the Log and
// share its pool, meter and spill file.
func NewStore(opt Options) (*Store, error) {
	e, err := newEnv(opt)
	if err != nil {
		return nil, err
	}
	return &Store{env: e, standalone: true}, nil
}

// storeOverhead is what one store of a Log costs whatever it holds: the Store, its entry in the Log's
// map, its slab table (about 450 bytes on amd64 for a store trimmed to nothing: TestLogMetersStoreOverhead).
// It is metered (Stats.OverheadBytes) because a store outlives its bytes: the receivers' snapshots trim a
// connection to nothing, and its store goes only when the connection is released (netlog/release). A job
// that sent a byte on each of a million connections left a million stores the meter counted as nothing,
// so the heap grew past log.memory_mib without the cap ever seeing it.
const storeOverhead = 512

// newLogStore returns a store of a Log, its overhead metered until dropAll.
func newLogStore(e *env) *Store {
	s := &Store{env: e}
	s.add(cOverhead, storeOverhead)
	return s
}

// add updates a counter in the store's meter and in the shared one (the Log's totals, or
// for a standalone store its own totals plus the pool).
func (s *Store) add(c counter, d int64) {
	s.own.field(c).Add(d)
	s.env.meter.field(c).Add(d)
}

// totals is the meter that thresholds are checked against.
func (s *Store) totals() *meter { return &s.env.meter }

// SetBase anchors the store so that seq (e.g. a snapshot's inq_seq) maps to AnchorEpoch|seq,
// and drops anything offered below it. It fails with ErrAnchored once the store has seen a
// segment or a Trim; use Trim then.
func (s *Store) SetBase(seq uint32) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, ErrClosed
	}
	if s.u.Anchored() {
		return 0, fmt.Errorf("set base to seq %d: %w at abs %d (wire %d); use Trim to drop older bytes", seq, ErrAnchored, s.base, Wire(s.base))
	}
	s.base = s.u.Anchor(seq)
	s.floor, s.first, s.contig, s.last = s.base, s.base, s.base, s.base
	return s.base, nil
}

// Unwrap returns the absolute sequence the store gives seq now (see Unwrapper.Peek).
func (s *Store) Unwrap(seq uint32) uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.u.Peek(seq)
}

// Append logs payload p whose first byte has TCP sequence seq. Bytes already logged are
// compared, not stored again; bytes below the trim point are dropped. If any offered byte
// differs from a logged one, nothing of p is stored and a *ConflictError is returned. Where the logged
// bytes cannot be read back (a spilled slab), p's new bytes are stored and the read error returned.
// p is copied; the caller may reuse it.
func (s *Store) Append(seq uint32, p []byte) error {
	if len(p) == 0 {
		return nil // pure ACKs and FINs carry no bytes and must not anchor the store
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.appendLocked(seq, p)
}

// AppendRecord is Append for a captured segment: it also notes the record's sending cgroup
// (Activity).
func (s *Store) AppendRecord(rec Record) error {
	if len(rec.Payload) == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.noteCgroup(rec.CgroupID)
		s.lastKtime = max(s.lastKtime, rec.KtimeNs)
	}
	return s.appendLocked(rec.Seq, rec.Payload)
}

// noteCgroup notes the cgroup of a record's sending socket (0: none, a flow protected by port or tuple).
// The caller holds s.mu for writing.
func (s *Store) noteCgroup(id uint64) {
	if id != 0 {
		s.cgroup = id
	}
}

// NoteParked notes a segment whose bytes wait elsewhere, in the park (Record.Parked), until they are
// appended or trimmed: it anchors the store as an append would, moves its reference on (so that the
// sequences after a long parked stretch unwrap right), and counts as activity. It stores nothing.
func (s *Store) NoteParked(rec Record) error {
	if rec.Parked == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	s.lastAppend = time.Now()
	s.noteCgroup(rec.CgroupID)
	s.lastKtime = max(s.lastKtime, rec.KtimeNs)
	if !s.u.Anchored() {
		s.base = s.u.Anchor(rec.Seq)
	}
	a := s.u.Unwrap(rec.Seq)
	if end := a + uint64(rec.Parked); end > s.floor {
		s.offered(max(a, s.floor))
		s.u.Observe(end)
	}
	return nil
}

// offered notes that byte a, at or above the floor, was offered: a First above the lowest such one is a
// hole at the bottom (Bounds.Low). The caller holds s.mu for writing.
func (s *Store) offered(a uint64) {
	if s.low == 0 || a < s.low {
		s.low = a
	}
}

// Holds reports whether the store holds every byte of [from, end), wire sequences, that is above the trim
// point (Log.Holds).
func (s *Store) Holds(from, end uint32) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if !s.u.Anchored() {
		return false
	}
	a := s.u.Peek(from)
	b := a + uint64(end-from)
	return s.check(min(max(a, s.floor), b), b) == nil
}

// Trimmed reports whether every byte before wire sequence end is below the trim point: no replay
// can need them. A closed store needs nothing.
func (s *Store) Trimmed(end uint32) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.closed || (s.u.Anchored() && s.u.Peek(end) <= s.floor)
}

func (s *Store) appendLocked(seq uint32, p []byte) error {
	if s.closed {
		return ErrClosed
	}
	// Every offered segment counts, retransmissions and bytes below the trim point too: each
	// one is a transmission the receiver may not have had when it snapshotted.
	s.lastAppend = time.Now()
	if !s.u.Anchored() {
		s.base = s.u.Anchor(seq)
	}
	return s.appendAbs(s.u.Unwrap(seq), p)
}

func (s *Store) appendAbs(a uint64, p []byte) error {
	b := a + uint64(len(p))
	if b <= s.floor {
		s.add(cBelow, int64(len(p)))
		return nil
	}
	if a < s.floor {
		d := s.floor - a
		s.add(cBelow, int64(d))
		p = p[d:]
		a = s.floor
	}
	s.offered(a)
	var unread error
	if s.retained > 0 && a < s.last {
		if err := s.compare(a, p); errors.Is(err, ErrConflict) {
			s.add(cConflicts, 1)
			// Up to the highest byte seen (and a FIN), too: the bytes logged past the segment may be
			// another connection's, which a receiver of the new one, restored from the segment's end,
			// would be served.
			s.conflictEnd = max(s.conflictEnd, b, s.u.Ref()+2)
			return err
		} else if err != nil {
			// A logged slab that cannot be read back (the spill disk) was not compared; its own reads
			// fail. The segment's bytes the log lacks are stored all the same: rejected, they were a hole.
			unread = fmt.Errorf("log segment [%d, %d): its new bytes are stored, its overlap with the log is unchecked: %w", a, b, err)
		}
	}
	s.u.Observe(b)
	if err := s.write(a, p); err != nil {
		return err
	}
	return unread
}

// compare checks p against the bytes already logged over [a, a+len(p)). A conflict anywhere is reported
// before a logged slab that could not be read, which is skipped: it must not hide a conflict elsewhere.
func (s *Store) compare(a uint64, p []byte) error {
	var cerr *ConflictError
	var rerr error
	var scratch *[]byte
	defer func() {
		if scratch != nil {
			s.env.scratch.Put(scratch)
		}
	}()
	pos, rest := a, p
	for len(rest) > 0 {
		idx, off := pos>>s.env.shift, uint32(pos&uint64(s.env.size-1))
		n := min(uint32(len(rest)), s.env.size-off)
		if sl := s.slabAt(idx); sl != nil && len(sl.spans) > 0 {
			data := sl.buf
			if data == nil && sl.gapBytes(off, off+n) < n { // overlaps a compressed or spilled slab
				if scratch == nil {
					scratch = s.env.scratch.Get().(*[]byte)
				}
				var err error
				if data, err = s.env.decode(sl.comp, sl.spill, sl.rawLen, sl.crc, *scratch); err != nil && rerr == nil {
					rerr = fmt.Errorf("compare retransmitted bytes at abs %d with the log: %w", pos, err)
				}
			}
			for i := sl.firstSpanAfter(off); data != nil && i < len(sl.spans) && sl.spans[i].lo < off+n; i++ {
				lo, hi := max(off, sl.spans[i].lo), min(off+n, sl.spans[i].hi)
				have, offered := data[lo-sl.bufLo:hi-sl.bufLo], rest[lo-off:hi-off]
				if bytes.Equal(have, offered) {
					continue
				}
				start := s.windowStart(idx)
				f, l := firstDiff(have, offered), lastDiff(have, offered)
				if cerr == nil {
					cerr = &ConflictError{From: start + uint64(lo) + uint64(f), SegFrom: a, SegTo: a + uint64(len(p)),
						Existing: have[f], Offered: offered[f]}
				}
				cerr.To = start + uint64(lo) + uint64(l) + 1
			}
		}
		pos += uint64(n)
		rest = rest[n:]
	}
	if cerr != nil {
		return cerr
	}
	return rerr
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func lastDiff(a, b []byte) int {
	for i := len(a) - 1; i >= 0; i-- {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func (s *Store) windowStart(idx uint64) uint64 { return idx << s.env.shift }

// slabAt returns the slab of window idx, or nil.
func (s *Store) slabAt(idx uint64) *slab {
	if idx < s.slab0 || idx-s.slab0 >= uint64(len(s.slabs)) {
		return nil
	}
	return s.slabs[idx-s.slab0]
}

// slabFor returns the slab of window idx, creating it (and table entries) if needed.
func (s *Store) slabFor(idx uint64) *slab {
	switch {
	case len(s.slabs) == 0:
		s.slab0 = idx
		s.slabs = append(s.slabs, nil)
	case idx < s.slab0: // bytes older than anything held: rare, so a copy is fine
		grown := make([]*slab, uint64(len(s.slabs))+s.slab0-idx)
		copy(grown[s.slab0-idx:], s.slabs)
		s.slabs, s.slab0 = grown, idx
	case idx-s.slab0 >= uint64(len(s.slabs)):
		for idx-s.slab0 >= uint64(len(s.slabs)) {
			s.slabs = append(s.slabs, nil)
		}
	}
	sl := s.slabs[idx-s.slab0]
	if sl == nil {
		sl = &slab{idx: idx, spans: make([]span, 0, 2)}
		s.slabs[idx-s.slab0] = sl
	}
	return sl
}

// write stores the not-yet-present bytes of p at [a, a+len(p)) and updates the bounds.
func (s *Store) write(a uint64, p []byte) error {
	b := a + uint64(len(p))
	wasEmpty := s.retained == 0
	oldFirst, oldContig := s.first, s.contig
	var stored int64
	pos, rest := a, p
	for len(rest) > 0 {
		idx, off := pos>>s.env.shift, uint32(pos&uint64(s.env.size-1))
		n := min(uint32(len(rest)), s.env.size-off)
		sl := s.slabFor(idx)
		got, err := s.fill(sl, off, rest[:n])
		stored += int64(got)
		if err != nil {
			return err
		}
		pos += uint64(n)
		rest = rest[n:]
	}
	if dup := int64(len(p)) - stored; dup > 0 {
		s.add(cDup, dup)
	}
	if stored == 0 {
		return nil
	}
	s.add(cAppended, stored)
	s.add(cRetained, stored)
	s.retained += stored
	if !s.bulk && s.own.appended.Load() >= int64(s.env.size) {
		s.bulk = true
	}
	switch {
	case wasEmpty:
		s.first, s.last = a, b
		s.contig = s.extend(a)
	case a < oldFirst:
		s.first = a
		s.last = max(s.last, b)
		if b >= oldFirst {
			s.contig = s.extend(oldContig)
		} else {
			s.contig = s.extend(a)
		}
	default:
		s.last = max(s.last, b)
		if a <= oldContig && b > oldContig {
			s.contig = s.extend(oldContig)
		}
	}
	return nil
}

// fill copies the bytes of p (at window offset off) that sl lacks and returns their count.
func (s *Store) fill(sl *slab, off uint32, p []byte) (uint32, error) {
	end := off + uint32(len(p))
	missing := sl.gapBytes(off, end)
	if missing == 0 {
		return 0, nil
	}
	if sl.buf == nil && (sl.comp != nil || sl.spill != nil) {
		// A compressed or spilled slab is sealed: no byte above the trim point is missing,
		// and appendAbs clipped p at the trim point. Reaching here is a bug, not bad input.
		return 0, fmt.Errorf("%w: %d bytes missing in sealed slab %d at offset %d", errInternal, missing, sl.idx, off)
	}
	s.ensureBuf(sl, off, end)
	cur := off
	for i := sl.firstSpanAfter(off); i < len(sl.spans) && sl.spans[i].lo < end; i++ {
		if sp := sl.spans[i]; sp.lo > cur {
			coldcopy.Copy(sl.buf[cur-sl.bufLo:sp.lo-sl.bufLo], p[cur-off:sp.lo-off])
			cur = sp.hi
		} else {
			cur = max(cur, sp.hi)
		}
	}
	if cur < end {
		coldcopy.Copy(sl.buf[cur-sl.bufLo:end-sl.bufLo], p[cur-off:])
	}
	sl.addSpan(off, end)
	sl.valid += missing
	if sl.sealedAt.IsZero() && s.sealed(sl) {
		sl.sealedAt = time.Now()
	}
	return missing, nil
}

// ensureBuf makes sl.buf cover window offsets [lo, hi).
func (s *Store) ensureBuf(sl *slab, lo, hi uint32) {
	have := uint32(len(sl.buf))
	if sl.buf != nil && lo >= sl.bufLo && hi <= sl.bufLo+have {
		return
	}
	nlo, nhi := lo, hi
	if sl.buf != nil {
		nlo, nhi = min(nlo, sl.bufLo), max(nhi, sl.bufLo+have)
	}
	size := s.env.size
	n := max(minBuf, 2*have, nhi-nlo)
	if s.bulk || n >= size/2 {
		n = size
	} else {
		n = nextPow2(n)
	}
	var nb []byte
	var blo uint32
	if n == size {
		nb = s.env.pool.get(size)
	} else {
		nb = make([]byte, n)
		blo = min(nlo, size-n)
	}
	if sl.buf != nil {
		copy(nb[sl.bufLo-blo:], sl.buf)
		s.add(cRAM, -int64(have))
		s.add(cRAMSlabs, -1)
	}
	sl.buf, sl.bufLo, sl.rawLen = nb, blo, n
	s.add(cRAM, int64(n))
	s.add(cRAMSlabs, 1)
}

func nextPow2(n uint32) uint32 {
	p := uint32(1)
	for p < n {
		p <<= 1
	}
	return p
}

// sealed reports whether every byte of sl above the trim point is present.
func (s *Store) sealed(sl *slab) bool {
	start := s.windowStart(sl.idx)
	var floorOff uint32
	if s.floor > start {
		floorOff = uint32(min(s.floor-start, uint64(s.env.size)))
	}
	return sl.valid == s.env.size-floorOff
}

// extend returns the end of the run of present bytes starting at pos (pos if absent).
func (s *Store) extend(pos uint64) uint64 { return s.extendTo(pos, math.MaxUint64) }

// extendTo is extend that may stop once it reaches limit.
func (s *Store) extendTo(pos, limit uint64) uint64 {
	for pos < limit {
		idx := pos >> s.env.shift
		sl := s.slabAt(idx)
		if sl == nil {
			return pos
		}
		off := uint32(pos & uint64(s.env.size-1))
		hi := sl.coverEnd(off)
		if hi == off {
			return pos
		}
		pos = s.windowStart(idx) + uint64(hi)
		if hi < s.env.size {
			return pos
		}
	}
	return pos
}

// nextPresent returns the first present byte at or after pos, or limit if none is below it.
func (s *Store) nextPresent(pos, limit uint64) uint64 {
	if pos >= s.last || s.retained == 0 {
		return limit
	}
	limit = min(limit, s.last)
	for pos < limit {
		idx := pos >> s.env.shift
		if idx < s.slab0 {
			pos = s.windowStart(s.slab0)
			continue
		}
		if sl := s.slabAt(idx); sl != nil {
			off := uint32(pos & uint64(s.env.size-1))
			if i := sl.firstSpanAfter(off); i < len(sl.spans) {
				return min(max(pos, s.windowStart(idx)+uint64(sl.spans[i].lo)), limit)
			}
		}
		pos = s.windowStart(idx + 1)
	}
	return limit
}

// check returns nil if all of [from, to) is retained, else a *RangeError naming the first
// missing run. The caller holds s.mu.
func (s *Store) check(from, to uint64) error {
	if s.closed {
		return ErrClosed
	}
	if from == to {
		return nil
	}
	if from < s.floor {
		return &RangeError{Kind: ErrTrimmed, From: from, To: min(to, s.floor)}
	}
	if e := s.extendTo(from, to); e < to {
		return &RangeError{Kind: ErrHole, From: e, To: s.nextPresent(e, to)}
	}
	return nil
}

// RunEnd is one past the last byte of the run of retained bytes that starts at abs (abs itself if that
// byte is not retained): what a range read from abs can serve, whatever holes lie below abs.
func (s *Store) RunEnd(abs uint64) uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.retained == 0 || abs < s.floor || abs < s.first || abs >= s.last {
		return abs
	}
	return s.extend(abs)
}

// Check reports whether [from, to) can be served, without reading it.
func (s *Store) Check(from, to uint64) error {
	if from > to {
		return fmt.Errorf("check range [%d, %d): from is after to", from, to)
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.check(from, to)
}

// readPart copies bytes from pos into dst, stopping at the end of dst or of pos's slab, and
// returns how many it copied. Compressed and spilled slabs are decoded outside the lock.
func (s *Store) readPart(dst []byte, pos uint64) (int, error) {
	idx := pos >> s.env.shift
	off := uint32(pos & uint64(s.env.size-1))
	n := min(uint32(min(len(dst), math.MaxUint32)), s.env.size-off)
	s.mu.RLock()
	if err := s.check(pos, pos+uint64(n)); err != nil {
		s.mu.RUnlock()
		return 0, err
	}
	sl := s.slabAt(idx)
	if sl.buf != nil {
		copy(dst[:n], sl.buf[off-sl.bufLo:])
		s.mu.RUnlock()
		return int(n), nil
	}
	// comp and spill never change once set, so they can be used after unlocking.
	comp, ref, rawLen, bufLo, crc := sl.comp, sl.spill, sl.rawLen, sl.bufLo, sl.crc
	s.mu.RUnlock()

	scratch := s.env.scratch.Get().(*[]byte)
	defer s.env.scratch.Put(scratch)
	raw, err := s.env.decode(comp, ref, rawLen, crc, *scratch)
	if err != nil {
		// A Trim between unlocking and reading may have released the spilled region.
		s.mu.RLock()
		defer s.mu.RUnlock()
		if cerr := s.check(pos, pos+uint64(n)); cerr != nil {
			return 0, cerr
		}
		return 0, fmt.Errorf("read logged bytes at abs %d: %w", pos, err)
	}
	copy(dst[:n], raw[off-bufLo:])
	return int(n), nil
}

// decode expands a compressed or spilled slab into dst and verifies its checksum.
func (e *env) decode(comp []byte, ref *spillRef, rawLen, crc uint32, dst []byte) ([]byte, error) {
	out := dst[:rawLen]
	if ref != nil {
		e.spillMu.Lock()
		f := e.spill
		e.spillMu.Unlock()
		if f == nil {
			return nil, ErrClosed
		}
		if ref.comp {
			comp = make([]byte, ref.n)
		} else {
			comp = nil
		}
		target := out
		if comp != nil {
			target = comp
		}
		if err := f.readAt(target, ref.off); err != nil {
			return nil, err
		}
		crc = ref.crc
	}
	if comp != nil {
		n, err := lz4.UncompressBlock(comp, out)
		if err != nil || n != int(rawLen) {
			return nil, fmt.Errorf("lz4-decode logged slab: got %d of %d bytes: %v", n, rawLen, err)
		}
	}
	if got := crc32.Checksum(out, castagnoli); got != crc {
		return nil, fmt.Errorf("logged slab checksum mismatch (crc32c %#08x, want %#08x): spill file or memory corrupted", got, crc)
	}
	return out, nil
}

// Bytes returns a copy of the logged bytes [from, to). A range that is not fully retained
// fails with a *RangeError (ErrHole or ErrTrimmed) naming the first missing run.
func (s *Store) Bytes(from, to uint64) ([]byte, error) {
	if err := s.Check(from, to); err != nil {
		return nil, err
	}
	out := make([]byte, to-from)
	for done := 0; done < len(out); {
		n, err := s.readPart(out[done:], from+uint64(done))
		if err != nil {
			return nil, err
		}
		done += n
	}
	return out, nil
}

// WriteRange streams the logged bytes [from, to) to w, one slab at a time, without holding
// the store's lock while w blocks. The whole range is checked first, so a missing range
// writes nothing; only a concurrent Trim of the range can end the stream early.
func (s *Store) WriteRange(ctx context.Context, w io.Writer, from, to uint64) (int64, error) {
	if err := s.Check(from, to); err != nil {
		return 0, err
	}
	bufp := s.env.scratch.Get().(*[]byte)
	defer s.env.scratch.Put(bufp)
	var written int64
	for pos := from; pos < to; {
		if err := ctx.Err(); err != nil {
			return written, fmt.Errorf("stream logged bytes at abs %d: %w", pos, err)
		}
		n, err := s.readPart((*bufp)[:min(to-pos, uint64(s.env.size))], pos)
		if err != nil {
			return written, err
		}
		m, err := w.Write((*bufp)[:n])
		written += int64(m)
		if err != nil {
			return written, fmt.Errorf("stream logged bytes at abs %d: %w", pos, err)
		}
		pos += uint64(n)
	}
	return written, nil
}

// Trim drops every byte before seq (a 32-bit sequence, unwrapped by the store: typically
// the receiver's snapshot inq_seq) and frees the slabs wholly below it. On a store that has
// seen nothing yet it anchors the store at seq. It returns the absolute trim point.
func (s *Store) Trim(seq uint32) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, ErrClosed
	}
	if !s.u.Anchored() {
		s.base = s.u.Anchor(seq)
	}
	abs := s.u.Unwrap(seq)
	s.trimAbs(abs)
	return abs, nil
}

// TrimAbs is Trim with an absolute sequence.
func (s *Store) TrimAbs(abs uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	if !s.u.Anchored() {
		return fmt.Errorf("trim at abs %d: the store has no anchor yet, so abs values mean nothing to it; use Trim or SetBase with a wire sequence", abs)
	}
	s.trimAbs(abs)
	return nil
}

func (s *Store) trimAbs(t uint64) {
	if t <= s.floor {
		return
	}
	s.floor = t
	if s.low != 0 && s.low < t {
		s.low = t
	}
	s.u.Observe(t)
	for len(s.slabs) > 0 && s.windowStart(s.slab0+1) <= t {
		if sl := s.slabs[0]; sl != nil {
			s.drop(sl)
		}
		s.slabs[0] = nil
		s.slabs = s.slabs[1:]
		s.slab0++
	}
	if sl := s.slabAt(t >> s.env.shift); sl != nil {
		removed := int64(sl.clipBelow(uint32(t & uint64(s.env.size-1))))
		s.retained -= removed
		s.add(cRetained, -removed)
		switch {
		case sl.valid == 0: // nothing left above the trim point: free it now, not a slab later
			s.drop(sl)
			s.slabs[sl.idx-s.slab0] = nil
		case sl.sealedAt.IsZero() && s.sealed(sl):
			sl.sealedAt = time.Now()
		}
	}
	for len(s.slabs) > 0 && s.slabs[0] == nil { // keep the table's head on a real slab
		s.slabs = s.slabs[1:]
		s.slab0++
	}
	if len(s.slabs) == 0 {
		s.slabs = nil // let the backing array go
	}
	switch {
	case s.retained == 0:
		s.first, s.contig, s.last = t, t, t
	case t <= s.first:
	case t < s.contig:
		s.first = t
	default:
		s.first = s.nextPresent(t, s.last)
		s.contig = s.extend(s.first)
	}
}

// drop releases a slab's memory and spill region. The caller holds s.mu for writing.
func (s *Store) drop(sl *slab) {
	s.retained -= int64(sl.valid)
	s.add(cRetained, -int64(sl.valid))
	switch {
	case sl.buf != nil:
		s.add(cRAM, -int64(len(sl.buf)))
		s.add(cRAMSlabs, -1)
		if !sl.busy && uint32(len(sl.buf)) == s.env.size {
			s.env.pool.put(sl.buf, time.Now())
		}
	case sl.comp != nil:
		s.add(cComp, -int64(len(sl.comp)))
		s.add(cCompRaw, -int64(sl.rawLen))
		s.add(cCompSlabs, -1)
	case sl.spill != nil:
		s.add(cSpill, -int64(sl.spill.n))
		s.add(cSpillRaw, -int64(sl.rawLen))
		s.add(cSpillSlabs, -1)
		s.env.spillMu.Lock()
		f := s.env.spill
		s.env.spillMu.Unlock()
		if f != nil {
			f.release(sl.spill.off, sl.spill.n)
		}
	}
	sl.buf, sl.comp, sl.spill, sl.spans, sl.valid = nil, nil, nil, nil, 0
	sl.dropped = true
}

// Bounds describes what a store holds, in absolute sequence numbers.
type Bounds struct {
	Anchored   bool
	Base       uint64 // abs of the anchor: the first sequence seen, or the one given to SetBase
	Floor      uint64 // bytes below were trimmed or precede SetBase's base (0: none dropped)
	First      uint64 // lowest retained byte
	Contiguous uint64 // every byte of [First, Contiguous) is retained
	Last       uint64 // one past the highest retained byte
	Retained   int64  // bytes retained; Last-First minus the holes
	// Seen is one past the highest byte offered, retained or not: appended, parked (NoteParked),
	// or trimmed.
	Seen uint64
	// Low is the lowest byte offered (appended or parked) at or above Floor, 0 if none: a First above
	// it is a hole at the bottom, bytes still parked, say.
	Low uint64
	// ConflictEnd is 0, or at least two past the highest byte seen (one past a FIN) once an offered segment
	// differed from the logged bytes (a new connection on the same 4-tuple whose sequence numbers overlap
	// the old one's, or pages that changed after a sendfile): the log cannot vouch for what was sent below
	// it.
	ConflictEnd uint64
}

// Servable says whether a range from abs may be served to a restorer: the log must know that abs is the
// position the restorer means (ErrAmbiguous), and that what it holds from abs on is what was sent
// (ErrConflict). Either failure is a refusal, never bytes of another connection or of another wrap.
func (b Bounds) Servable(abs uint64) error {
	if abs < b.ConflictEnd {
		return fmt.Errorf("%w: below sequence %d (abs %d) a segment differed from the logged bytes (a new connection on the same 4-tuple, or pages changed after a sendfile): the log cannot vouch for bytes from %d on",
			ErrConflict, Wire(b.ConflictEnd), b.ConflictEnd, Wire(abs))
	}
	// The lowest position a restorer may mean: the trim point (its snapshot is no older), else the
	// lowest byte offered. One 2^32 below abs at or above it is as valid a reading of abs's wire sequence.
	lo := b.Floor
	if lo == 0 {
		lo = b.Low
	}
	if lo == 0 {
		lo = b.First
	}
	if abs >= 1<<32 && abs-1<<32 >= lo {
		return fmt.Errorf("%w: sequence %d is abs %d or %d", ErrAmbiguous, Wire(abs), abs-1<<32, abs)
	}
	return nil
}

// Bounds returns the store's live bounds. With nothing retained, First, Contiguous and
// Last all equal the trim point.
func (s *Store) Bounds() Bounds {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return Bounds{Anchored: s.u.Anchored(), Base: s.base, Floor: s.floor,
		First: s.first, Contiguous: s.contig, Last: s.last, Retained: s.retained, Seen: s.u.Ref(), Low: s.low,
		ConflictEnd: s.conflictEnd}
}

// Stats returns the store's memory accounting and counters.
func (s *Store) Stats() Stats {
	st := s.own.snapshot()
	st.Conns = 1
	if s.standalone {
		st.PooledBytes = s.env.meter.pooled.Load()
	}
	return st
}

// Activity is what a store knows about its sender's recent behaviour.
type Activity struct {
	// LastAppend is when a segment was last offered to the store (new, retransmitted or below
	// the trim point alike), by this host's clock, with its monotonic reading; zero if never.
	LastAppend time.Time
	// LastKtimeNs is the newest transmit time of a record (AppendRecord), in the probe's clock
	// (bpf_ktime_get_ns: this host's CLOCK_MONOTONIC); 0 if no record carried one. Unlike
	// LastAppend it does not lag behind the sender while records wait in the ring buffer.
	LastKtimeNs uint64
	// CgroupID is the cgroup v2 id of the sending socket from the last record that carried
	// one (AppendRecord); 0 if none did.
	CgroupID uint64
}

// Activity returns the store's Activity.
func (s *Store) Activity() Activity {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return Activity{LastAppend: s.lastAppend, LastKtimeNs: s.lastKtime, CgroupID: s.cgroup}
}

// Close frees everything the store holds. Later calls fail with ErrClosed.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.dropAll()
	s.mu.Unlock()
	if s.standalone {
		s.env.pool.drain()
		if err := s.env.closeSpill(); err != nil {
			return fmt.Errorf("close netlog store: %w", err)
		}
	}
	return nil
}

// dropAll frees every slab and the store's overhead: it is called once, as the store closes. The caller
// holds s.mu for writing.
func (s *Store) dropAll() {
	for _, sl := range s.slabs {
		if sl != nil {
			s.drop(sl)
		}
	}
	s.slabs = nil
	if o := s.own.overhead.Load(); o != 0 {
		s.add(cOverhead, -o)
	}
}

var errInternal = errors.New("netlog internal error")
