package netlog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"
)

// fastSpillDir returns a directory on tmpfs when there is one: the randomized tests fsync
// on every Age pass and must not depend on how busy the shared disk is. The spill tests in
// age_test.go use a real disk.
func fastSpillDir(t testing.TB) string {
	dir, err := os.MkdirTemp("/dev/shm", "netlog-test-")
	if err != nil {
		return t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// model is the naive reference: one byte and one flag per stream offset. Offsets are
// positions in the test stream; the harness maps them to the store's abs.
type model struct {
	data  []byte
	have  []bool
	floor int
}

func newModel(n int) *model { return &model{data: make([]byte, n), have: make([]bool, n)} }

// appendSeg mirrors Store.Append: it returns the conflicting [from, to) or ok.
func (m *model) appendSeg(off int, p []byte) (from, to int, conflict bool) {
	if off < m.floor {
		if off+len(p) <= m.floor {
			return 0, 0, false
		}
		p = p[m.floor-off:]
		off = m.floor
	}
	from, to = -1, -1
	for i, b := range p {
		if m.have[off+i] && m.data[off+i] != b {
			if from < 0 {
				from = off + i
			}
			to = off + i + 1
		}
	}
	if from >= 0 {
		return from, to, true
	}
	for i, b := range p {
		m.data[off+i], m.have[off+i] = b, true
	}
	return 0, 0, false
}

func (m *model) trim(off int) {
	if off <= m.floor {
		return
	}
	for i := m.floor; i < off && i < len(m.have); i++ {
		m.have[i] = false
	}
	m.floor = off
}

// rangeErr returns the error Store.Bytes should give for [x, y), as (from, to, kind).
func (m *model) rangeErr(x, y int) (int, int, error) {
	if x == y {
		return 0, 0, nil
	}
	if x < m.floor {
		return x, min(y, m.floor), ErrTrimmed
	}
	for i := x; i < y; i++ {
		if i >= len(m.have) || !m.have[i] {
			j := i
			for j < y && (j >= len(m.have) || !m.have[j]) {
				j++
			}
			return i, j, ErrHole
		}
	}
	return 0, 0, nil
}

func (m *model) bounds() (first, contig, last, retained int, any bool) {
	first, last = -1, -1
	for i, h := range m.have {
		if h {
			if first < 0 {
				first = i
			}
			last = i + 1
			retained++
		}
	}
	if first < 0 {
		return m.floor, m.floor, m.floor, 0, false
	}
	contig = first
	for contig < len(m.have) && m.have[contig] {
		contig++
	}
	return first, contig, last, retained, true
}

// harness drives a Store and the model with the same operations and compares them.
type harness struct {
	t      testing.TB
	s      *Store
	m      *model
	stream []byte
	isn    uint32 // wire sequence of stream offset 0
	base   uint64 // abs of stream offset 0, known once the store anchored
	based  bool
	now    time.Time
}

func (h *harness) abs(off int) uint64 { return h.base + uint64(int64(off)) }

func (h *harness) appendSeg(off, n int, flip int) {
	p := bytes.Clone(h.stream[off : off+n])
	if flip >= 0 {
		p[flip%n] ^= 0xA5
	}
	if !h.based {
		h.base = (AnchorEpoch | uint64(h.isn+uint32(off))) - uint64(off)
		h.based = true
	}
	err := h.s.Append(h.isn+uint32(off), p)
	from, to, conflict := h.m.appendSeg(off, p)
	if conflict {
		var ce *ConflictError
		if !errors.As(err, &ce) || ce.From != h.abs(from) || ce.To != h.abs(to) {
			h.t.Fatalf("append [%d, %d) flip %d: err %v, want conflict [%d, %d)", off, off+n, flip, err, from, to)
		}
		return
	}
	if err != nil {
		h.t.Fatalf("append [%d, %d): %v", off, off+n, err)
	}
}

func (h *harness) trim(off int) {
	if !h.based {
		return // trimming an unanchored store anchors it; the harness anchors on data
	}
	got, err := h.s.Trim(h.isn + uint32(off))
	if err != nil || got != h.abs(off) {
		h.t.Fatalf("trim at %d: abs %d err %v, want abs %d", off, got, err, h.abs(off))
	}
	h.m.trim(off)
}

func (h *harness) check(x, y int) {
	if !h.based {
		return
	}
	got, err := h.s.Bytes(h.abs(x), h.abs(y))
	from, to, kind := h.m.rangeErr(x, y)
	if kind == nil {
		if err != nil {
			h.t.Fatalf("range [%d, %d): %v, want the bytes", x, y, err)
		}
		if !bytes.Equal(got, h.m.data[x:y]) {
			h.t.Fatalf("range [%d, %d): bytes differ from the model", x, y)
		}
		return
	}
	var re *RangeError
	if !errors.As(err, &re) || re.Kind != kind || re.From != h.abs(from) || re.To != h.abs(to) {
		h.t.Fatalf("range [%d, %d): err %v, want %v [%d, %d)", x, y, err, kind, from, to)
	}
}

func (h *harness) checkBounds() {
	if !h.based {
		return
	}
	first, contig, last, retained, any := h.m.bounds()
	b := h.s.Bounds()
	if any {
		if b.First != h.abs(first) || b.Contiguous != h.abs(contig) || b.Last != h.abs(last) || b.Retained != int64(retained) {
			h.t.Fatalf("bounds %s, model first %d contig %d last %d retained %d", h.rel(b), first, contig, last, retained)
		}
	} else if b.Retained != 0 {
		h.t.Fatalf("bounds %s, model holds nothing", h.rel(b))
	}
	if st := h.s.Stats(); st.RetainedBytes != int64(retained) {
		h.t.Fatalf("stats retained %d, model %d", st.RetainedBytes, retained)
	}
}

func (h *harness) rel(b Bounds) string {
	return fmt.Sprintf("{first %d contig %d last %d retained %d floor %d}", int64(b.First-h.base), int64(b.Contiguous-h.base),
		int64(b.Last-h.base), b.Retained, int64(b.Floor-h.base))
}

func (h *harness) age() {
	h.now = h.now.Add(time.Hour)
	if _, err := h.s.Age(context.Background(), h.now); err != nil {
		h.t.Fatalf("age: %v", err)
	}
}

// TestStoreMatchesModel sends random streams as a TCP sender would: segments of random size
// in roughly increasing order, reordered within a window, with retransmissions of older
// ranges re-cut at different boundaries, occasional corrupted retransmissions, trims behind
// the contiguous point, and Age passes that compress and spill. Every read is checked
// against the naive model, errors and their ranges included.
func TestStoreMatchesModel(t *testing.T) {
	for seed := uint64(1); seed <= 16; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 42))
			slab := 1 << (8 + r.IntN(5)) // 256 B .. 4 KiB
			opt := Options{SlabSize: slab, PoolSlabs: r.IntN(3) - 1}
			if seed%3 != 0 {
				opt.CompressAfter = time.Minute
			}
			if seed%2 == 0 {
				opt.SpillDir = fastSpillDir(t)
				opt.SpillAboveRAM = int64(slab * (2 + r.IntN(8)))
			}
			n := 256<<10 + r.IntN(256<<10)
			// Half the seeds are redundant text-like streams so lz4 actually compresses.
			stream := testStream(seed, n)
			if seed%4 < 2 {
				for i := range stream {
					stream[i] = "abcdefgh"[int(stream[i])%3+i%5]
				}
			}
			h := &harness{t: t, s: newTestStore(t, opt), m: newModel(n), stream: stream,
				isn: uint32(0xFFFFFFFF - r.IntN(n)), now: time.Now()} // crosses the wrap
			runRandomSession(h, r)
		})
	}
}

func runRandomSession(h *harness, r *rand.Rand) {
	n := len(h.stream)
	var pending [][2]int // cut but not yet sent, for reordering
	sent := 0
	trimAt := 0
	for step := 0; sent < n || len(pending) > 0; step++ {
		switch k := r.IntN(20); {
		case k < 10 && sent < n: // cut the next segment
			size := 1 + r.IntN(3000)
			if r.IntN(8) == 0 {
				size = 1 + r.IntN(16000) // a GSO super-packet
			}
			size = min(size, n-sent)
			pending = append(pending, [2]int{sent, size})
			sent += size
		case k < 14 && len(pending) > 0: // transmit one pending segment, not always the oldest
			i := r.IntN(min(len(pending), 3))
			sg := pending[i]
			pending = append(pending[:i], pending[i+1:]...)
			h.appendSeg(sg[0], sg[1], -1)
		case k < 16 && sent > 0: // retransmit an older range re-cut at new boundaries
			from := max(0, sent-r.IntN(20000)-1)
			size := min(1+r.IntN(5000), sent-from)
			flip := -1
			if r.IntN(10) == 0 {
				flip = r.IntN(size)
			}
			h.appendSeg(from, size, flip)
		case k == 16 && h.based: // GC behind the contiguous point, sometimes into a hole
			_, contig, _, _, _ := h.m.bounds()
			if contig > trimAt {
				trimAt += r.IntN(contig - trimAt + 1)
				if r.IntN(10) == 0 {
					trimAt = min(trimAt+r.IntN(2000), n)
				}
				h.trim(trimAt)
			}
		case k == 17:
			h.age()
		default: // read a random range, often across holes or the trim point
			x := r.IntN(n)
			y := min(n, x+r.IntN(20000))
			h.check(x, y)
		}
		if step%64 == 0 {
			h.checkBounds()
		}
	}
	h.checkBounds()
	h.age()
	first, contig, _, _, _ := h.m.bounds()
	h.check(first, contig)
	// Slabs with holes cannot be spilled (a rejected conflicting segment leaves holes), so
	// only sealed memory must have gone below the threshold.
	if st := h.s.Stats(); h.s.env.opt.SpillAboveRAM > 0 && st.RAMBytes+st.CompressedBytes+st.PooledBytes-h.unsealedRAM() > h.s.env.opt.SpillAboveRAM {
		h.t.Fatalf("memory %d (%d in unsealed slabs) stays above the spill threshold %d: %+v",
			st.MemoryBytes(), h.unsealedRAM(), h.s.env.opt.SpillAboveRAM, st)
	}
}

// FuzzStore decodes the fuzzer's bytes into store operations on a 4 KiB stream and checks
// every result against the model.
func FuzzStore(f *testing.F) {
	f.Add([]byte{0, 0, 0, 100, 0, 1, 0, 0, 50, 100, 3, 0, 0, 200, 200})
	f.Add([]byte{0, 10, 0, 50, 0, 0, 0, 0, 20, 0, 1, 0, 40, 2, 0, 4, 0, 0, 255, 255})
	dir := fastSpillDir(f) // shared: spill files are unlinked on creation
	f.Fuzz(func(t *testing.T, ops []byte) {
		spill := len(ops) > 0 && ops[0]&1 == 1
		opt := Options{SlabSize: 256, CompressAfter: time.Nanosecond}
		if spill {
			opt.SpillDir, opt.SpillAboveRAM = dir, 512
		}
		const n = 4096
		stream := testStream(uint64(len(ops)), n)
		for i := range stream {
			stream[i] %= 4 // compressible
		}
		h := &harness{t: t, s: newTestStore(t, opt), m: newModel(n), stream: stream, isn: 0xFFFFF800, now: time.Now()}
		for k := 0; len(ops) >= 5 && k < 200; k++ { // bounded so minimisation stays quick
			code, a, b := ops[0]%5, int(ops[1])<<8|int(ops[2]), int(ops[3])<<8|int(ops[4])
			ops = ops[5:]
			a %= n
			switch code {
			case 0, 1: // append, code 1 with a flipped byte
				size := 1 + b%min(2000, n-a)
				flip := -1
				if code == 1 {
					flip = b
				}
				h.appendSeg(a, size, flip)
			case 2:
				h.trim(a)
			case 3:
				h.check(min(a, b%n), max(a, b%n))
			case 4:
				h.age()
			}
			if k%16 == 15 { // the model's scan dominates under coverage instrumentation
				h.checkBounds()
			}
		}
		h.checkBounds()
	})
}

func (h *harness) unsealedRAM() int64 {
	h.s.mu.RLock()
	defer h.s.mu.RUnlock()
	var n int64
	for _, sl := range h.s.slabs {
		if sl != nil && sl.sealedAt.IsZero() {
			n += int64(len(sl.buf))
		}
	}
	return n
}
