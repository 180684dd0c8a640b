package netlog

import (
	"context"
	"fmt"
	"hash/crc32"
	"time"

	"github.com/pierrec/lz4/v4"
)

// AgeReport says what one Age pass did.
type AgeReport struct {
	Compressed      int   // slabs now held as lz4 blocks
	CompressedFrom  int64 // their raw size
	CompressedTo    int64 // their compressed size
	Incompressible  int   // sealed slabs lz4 could not shrink by 1/8 (kept raw, not retried)
	Spilled         int   // slabs written to the spill file and freed from memory
	SpilledBytes    int64 // bytes written to the spill file
	SpillFreedBytes int64 // memory those slabs held
}

func (r *AgeReport) add(o AgeReport) {
	r.Compressed += o.Compressed
	r.CompressedFrom += o.CompressedFrom
	r.CompressedTo += o.CompressedTo
	r.Incompressible += o.Incompressible
	r.Spilled += o.Spilled
	r.SpilledBytes += o.SpilledBytes
	r.SpillFreedBytes += o.SpillFreedBytes
}

// ager holds the buffers one Age pass reuses across slabs and stores.
type ager struct {
	c    lz4.Compressor
	cbuf []byte
}

// Age compresses the store's sealed slabs per Options.CompressAfter and CompressAboveRAM,
// then spills the oldest ones if memory exceeds Options.SpillAboveRAM. Compression and file
// I/O run outside the store's lock, so the appender is held up only to swap a slab's form.
// now is passed in so callers (and tests) control the clock.
func (s *Store) Age(ctx context.Context, now time.Time) (AgeReport, error) {
	if s.standalone {
		s.env.pool.shrink(now)
	}
	var a ager
	r, err := s.compress(ctx, now, &a)
	if err != nil {
		return r, err
	}
	if over := s.env.spillExcess(s.totals()); over > 0 {
		s.env.pool.drain()
		if over = s.env.spillExcess(s.totals()); over > 0 {
			sr, err := s.spillSlabs(ctx, over)
			r.add(sr)
			if sr.Spilled > 0 {
				s.env.log.Info("netlog spilled slabs to disk", "slabs", sr.Spilled, "bytes", sr.SpilledBytes, "freed", sr.SpillFreedBytes)
			}
			return r, err
		}
	}
	return r, nil
}

// spillExcess returns how many bytes of memory are above the spill threshold (<= 0: none). The stores'
// overhead counts, as in the memory the controller measures (Stats.LiveBytes) and asks to spill down to
// the threshold: without it a log of many small stores stayed above its low watermark, up to its cap.
func (e *env) spillExcess(m *meter) int64 {
	if e.opt.SpillAboveRAM <= 0 {
		return 0
	}
	return m.ram.Load() + m.comp.Load() + m.pooled.Load() + m.overhead.Load() - e.opt.SpillAboveRAM
}

type candidate struct {
	sl  *slab
	raw []byte // the slab's buf, captured under the lock (the field itself may be cleared)
}

func (s *Store) compress(ctx context.Context, now time.Time, a *ager) (AgeReport, error) {
	var r AgeReport
	after, above := s.env.opt.CompressAfter, s.env.opt.CompressAboveRAM
	if after <= 0 && above <= 0 {
		return r, nil
	}
	var pressure int64
	if above > 0 {
		pressure = s.totals().ram.Load() - above
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return r, nil
	}
	var cands []candidate
	for _, sl := range s.slabs { // oldest first
		if sl == nil || sl.buf == nil || sl.busy || sl.noComp || sl.sealedAt.IsZero() {
			continue
		}
		aged := after > 0 && now.Sub(sl.sealedAt) >= after
		if !aged && pressure <= 0 {
			continue
		}
		sl.busy = true
		cands = append(cands, candidate{sl, sl.buf})
		pressure -= int64(len(sl.buf))
	}
	s.mu.Unlock()

	for i, c := range cands {
		if err := ctx.Err(); err != nil {
			s.unbusy(cands[i:])
			return r, fmt.Errorf("age netlog store: %w", err)
		}
		comp, crc, ok := a.compressOne(c.raw)
		s.mu.Lock()
		c.sl.busy = false
		switch {
		case c.sl.dropped:
			// Trimmed meanwhile; its buffer was not pooled because it was busy.
		case !ok:
			c.sl.noComp = true
			r.Incompressible++
		default:
			s.add(cRAM, -int64(len(c.raw)))
			s.add(cRAMSlabs, -1)
			s.add(cComp, int64(len(comp)))
			s.add(cCompRaw, int64(len(c.raw)))
			s.add(cCompSlabs, 1)
			if uint32(len(c.raw)) == s.env.size {
				s.env.pool.put(c.raw, now)
			}
			c.sl.buf, c.sl.comp, c.sl.crc = nil, comp, crc
			r.Compressed++
			r.CompressedFrom += int64(len(c.raw))
			r.CompressedTo += int64(len(comp))
		}
		s.mu.Unlock()
	}
	return r, nil
}

// compressOne returns raw as an exactly sized lz4 block and the CRC of raw, or ok=false when
// lz4 saves less than an eighth (random or already-compressed payloads).
func (a *ager) compressOne(raw []byte) (comp []byte, crc uint32, ok bool) {
	if need := lz4.CompressBlockBound(len(raw)); len(a.cbuf) < need {
		a.cbuf = make([]byte, need)
	}
	n, err := a.c.CompressBlock(raw, a.cbuf)
	if err != nil || n == 0 || n > len(raw)-len(raw)/8 {
		return nil, 0, false
	}
	return append([]byte(nil), a.cbuf[:n]...), crc32.Checksum(raw, castagnoli), true
}

func (s *Store) unbusy(cands []candidate) {
	s.mu.Lock()
	for _, c := range cands {
		c.sl.busy = false
	}
	s.mu.Unlock()
}

type spillCand struct {
	candidate
	comp []byte
	crc  uint32
	ref  spillRef
}

// spillSlabs writes sealed slabs, oldest first, to the spill file until at least need bytes
// of memory can be freed, fsyncs once, then frees them. If the write or fsync fails, every
// slab stays in memory.
func (s *Store) spillSlabs(ctx context.Context, need int64) (AgeReport, error) {
	var r AgeReport
	f, err := s.env.getSpill()
	if err != nil {
		return r, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return r, nil
	}
	var cands []spillCand
	for _, sl := range s.slabs {
		if need <= 0 {
			break
		}
		if sl == nil || sl.busy || sl.sealedAt.IsZero() || (sl.buf == nil && sl.comp == nil) {
			continue
		}
		sl.busy = true
		cands = append(cands, spillCand{candidate: candidate{sl, sl.buf}, comp: sl.comp, crc: sl.crc})
		need -= int64(len(sl.buf) + len(sl.comp))
	}
	s.mu.Unlock()
	if len(cands) == 0 {
		return r, nil
	}

	release := func(upto int) {
		for _, c := range cands[:upto] {
			f.release(c.ref.off, c.ref.n)
		}
	}
	for i := range cands {
		c := &cands[i]
		if err := ctx.Err(); err != nil {
			release(i)
			s.unbusy(candidatesOf(cands))
			return r, fmt.Errorf("spill netlog slabs: %w", err)
		}
		data := c.comp
		c.ref = spillRef{comp: data != nil, crc: c.crc}
		if data == nil {
			data = c.raw
			c.ref.crc = crc32.Checksum(data, castagnoli)
		}
		off, err := f.write(data)
		if err != nil {
			release(i)
			s.unbusy(candidatesOf(cands))
			return r, err
		}
		c.ref.off, c.ref.n = off, len(data)
	}
	if err := f.sync(); err != nil {
		release(len(cands))
		s.unbusy(candidatesOf(cands))
		return r, err
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range cands {
		c := &cands[i]
		sl := c.sl
		sl.busy = false
		if sl.dropped {
			f.release(c.ref.off, c.ref.n)
			continue
		}
		c.ref.rawLen = sl.rawLen
		ref := c.ref
		freed := int64(len(sl.buf) + len(sl.comp))
		if sl.buf != nil {
			s.add(cRAM, -int64(len(sl.buf)))
			s.add(cRAMSlabs, -1) // not pooled: spilling exists to give memory back
		} else {
			s.add(cComp, -int64(len(sl.comp)))
			s.add(cCompRaw, -int64(sl.rawLen))
			s.add(cCompSlabs, -1)
		}
		s.add(cSpill, int64(ref.n))
		s.add(cSpillRaw, int64(sl.rawLen))
		s.add(cSpillSlabs, 1)
		sl.buf, sl.comp, sl.spill = nil, nil, &ref
		r.Spilled++
		r.SpilledBytes += int64(ref.n)
		r.SpillFreedBytes += freed
	}
	return r, nil
}

func candidatesOf(cs []spillCand) []candidate {
	out := make([]candidate, len(cs))
	for i, c := range cs {
		out[i] = c.candidate
	}
	return out
}
