package netlog

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

func newTestStore(t testing.TB, opt Options) *Store {
	t.Helper()
	if opt.Logger == nil {
		opt.Logger = slog.New(slog.NewTextHandler(t.Output(), nil))
	}
	s, err := NewStore(opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// testStream returns n pseudo-random bytes; byte i is the sender's byte at offset i.
func testStream(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9E3779B97F4A7C15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

type op struct {
	trim     bool // Trim at off instead of appending
	off, n   int  // relative to the base sequence
	flip     []int
	conflict [2]int // expected ConflictError [From, To) relative, when flip is set
}

func seg(off, n int) op { return op{off: off, n: n} }

func TestStoreOverlaps(t *testing.T) {
	const slab = 256
	tests := []struct {
		name                  string
		ops                   []op
		first, contig, last   int
		retained, appended    int
		dup, below, conflicts int
		holes                 [][2]int // ranges expected to fail with ErrHole, [From, To) relative
	}{
		{name: "single segment", ops: []op{seg(0, 100)}, contig: 100, last: 100, retained: 100, appended: 100},
		{name: "exact duplicate", ops: []op{seg(0, 100), seg(0, 100)}, contig: 100, last: 100, retained: 100, appended: 100, dup: 100},
		{name: "duplicate prefix", ops: []op{seg(0, 100), seg(0, 40)}, contig: 100, last: 100, retained: 100, appended: 100, dup: 40},
		{name: "duplicate suffix", ops: []op{seg(0, 100), seg(60, 40)}, contig: 100, last: 100, retained: 100, appended: 100, dup: 40},
		{name: "overlap then extend", ops: []op{seg(0, 100), seg(50, 100)}, contig: 150, last: 150, retained: 150, appended: 150, dup: 50},
		{name: "new prefix overlapping old", ops: []op{seg(50, 100), seg(0, 100)}, first: 0, contig: 150, last: 150, retained: 150, appended: 150, dup: 50},
		{name: "contained", ops: []op{seg(0, 300), seg(100, 100)}, contig: 300, last: 300, retained: 300, appended: 300, dup: 100},
		{name: "containing", ops: []op{seg(100, 100), seg(0, 300)}, contig: 300, last: 300, retained: 300, appended: 300, dup: 100},
		{name: "spanning several slabs", ops: []op{seg(10, 1000), seg(100, 800), seg(500, 1000)}, first: 10, contig: 1500, last: 1500, retained: 1490, appended: 1490, dup: 800 + 510},
		{name: "GSO-sized segment over many slabs", ops: []op{seg(0, 65536), seg(1448, 1448), seg(65536-100, 200)}, contig: 65636, last: 65636, retained: 65636, appended: 65636, dup: 1448 + 100},
		{name: "out-of-order fills a hole", ops: []op{seg(0, 100), seg(200, 100), seg(100, 100)}, contig: 300, last: 300, retained: 300, appended: 300},
		{name: "hole left open", ops: []op{seg(0, 100), seg(200, 100)}, contig: 100, last: 300, retained: 200, appended: 200,
			holes: [][2]int{{100, 200}}},
		{name: "hole across slab boundaries", ops: []op{seg(0, 100), seg(900, 100)}, contig: 100, last: 1000, retained: 200, appended: 200,
			holes: [][2]int{{100, 900}}},
		{name: "one segment fills several holes", ops: []op{seg(0, 10), seg(20, 10), seg(40, 10), seg(600, 10), seg(0, 700)}, contig: 700, last: 700, retained: 700, appended: 700, dup: 40},
		{name: "arrival before the first byte, not touching", ops: []op{seg(500, 100), seg(100, 100)}, first: 100, contig: 200, last: 600, retained: 200, appended: 200,
			holes: [][2]int{{200, 500}}},
		{name: "arrival before the first byte, touching", ops: []op{seg(500, 100), seg(300, 200)}, first: 300, contig: 600, last: 600, retained: 300, appended: 300},
		{name: "retransmission from before the anchor", ops: []op{seg(0, 100), seg(-50, 100)}, first: -50, contig: 100, last: 100, retained: 150, appended: 150, dup: 50},
		{name: "conflicting byte", ops: []op{seg(0, 100), {off: 50, n: 100, flip: []int{60}, conflict: [2]int{60, 61}}},
			contig: 100, last: 100, retained: 100, appended: 100, conflicts: 1},
		{name: "conflicts across slabs", ops: []op{seg(0, 1000), {off: 0, n: 1200, flip: []int{70, 600, 999}, conflict: [2]int{70, 1000}}},
			contig: 1000, last: 1000, retained: 1000, appended: 1000, conflicts: 1},
		{name: "conflict in a later overlap of the segment", ops: []op{seg(0, 10), seg(20, 10), {off: 0, n: 30, flip: []int{25}, conflict: [2]int{25, 26}}},
			contig: 10, last: 30, retained: 20, appended: 20, conflicts: 1, holes: [][2]int{{10, 20}}},
		{name: "flip in a hole is not a conflict", ops: []op{seg(0, 10), seg(20, 10), {off: 0, n: 30, flip: []int{15}}},
			contig: 30, last: 30, retained: 30, appended: 30, dup: 20},
		{name: "trim then retransmission below it", ops: []op{seg(0, 600), {trim: true, off: 300}, seg(200, 200)},
			first: 300, contig: 600, last: 600, retained: 300, appended: 600, dup: 100, below: 100},
		{name: "trim inside a hole", ops: []op{seg(0, 100), seg(700, 100), {trim: true, off: 300}},
			first: 700, contig: 800, last: 800, retained: 100, appended: 200, holes: [][2]int{{300, 700}}},
		{name: "trim past everything", ops: []op{seg(0, 600), {trim: true, off: 1000}, seg(990, 20)},
			first: 1000, contig: 1010, last: 1010, retained: 10, appended: 610, below: 10},
	}
	for _, isn := range []uint32{1000, math.MaxUint32 - 400} { // the second crosses the wrap
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				s := newTestStore(t, Options{SlabSize: slab})
				stream := testStream(uint64(len(tt.name)), 70000)
				const pre = 1000 // stream offset of the base sequence; ops may go below it
				want := bytes.Clone(stream)
				// The store anchors on the first segment: relative offset 0 is where the
				// anchor's epoch puts isn, whichever offset came first.
				first := tt.ops[0].off
				base := (AnchorEpoch | uint64(isn+uint32(int32(first)))) - uint64(int64(first))
				for i, o := range tt.ops {
					seq := isn + uint32(int32(o.off))
					if o.trim {
						if _, err := s.Trim(seq); err != nil {
							t.Fatal(err)
						}
						continue
					}
					p := bytes.Clone(stream[pre+o.off : pre+o.off+o.n])
					for _, f := range o.flip {
						p[f-o.off] ^= 0x5A
					}
					err := s.Append(seq, p)
					if o.conflict != [2]int{} {
						var ce *ConflictError
						if !errors.As(err, &ce) || !errors.Is(err, ErrConflict) {
							t.Fatalf("op %d: err = %v, want a ConflictError", i, err)
						}
						if want := [2]uint64{base + uint64(int64(o.conflict[0])), base + uint64(int64(o.conflict[1]))}; [2]uint64{ce.From, ce.To} != want {
							t.Fatalf("op %d: conflict [%d, %d), want %v (base %d)", i, ce.From, ce.To, want, base)
						}
						if ce.Existing == ce.Offered {
							t.Fatalf("op %d: conflict reports equal bytes %#x", i, ce.Existing)
						}
						continue
					}
					if err != nil {
						t.Fatalf("op %d: %v", i, err)
					}
					for _, f := range o.flip { // stored where it filled a hole
						want[pre+f] ^= 0x5A
					}
				}
				rel := func(v int) uint64 { return base + uint64(int64(v)) }
				b := s.Bounds()
				if b.Base != AnchorEpoch|uint64(isn+uint32(int32(first))) || b.First != rel(tt.first) || b.Contiguous != rel(tt.contig) || b.Last != rel(tt.last) || b.Retained != int64(tt.retained) {
					t.Fatalf("bounds %+v (relative first %d contig %d last %d), want first %d contig %d last %d retained %d",
						b, int64(b.First-base), int64(b.Contiguous-base), int64(b.Last-base), tt.first, tt.contig, tt.last, tt.retained)
				}
				st := s.Stats()
				if st.AppendedBytes != int64(tt.appended) || st.DuplicateBytes != int64(tt.dup) || st.BelowFloorBytes != int64(tt.below) ||
					st.Conflicts != int64(tt.conflicts) || st.RetainedBytes != int64(tt.retained) {
					t.Fatalf("stats %+v, want appended %d dup %d below %d conflicts %d retained %d", st, tt.appended, tt.dup, tt.below, tt.conflicts, tt.retained)
				}
				got, err := s.Bytes(b.First, b.Contiguous)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want[pre+tt.first:pre+tt.contig]) {
					t.Fatal("contiguous range differs from the stream")
				}
				var w bytes.Buffer
				if n, err := s.WriteRange(context.Background(), &w, b.First, b.Contiguous); err != nil || n != int64(len(got)) || !bytes.Equal(w.Bytes(), got) {
					t.Fatalf("WriteRange: n %d err %v, equal %v", n, err, bytes.Equal(w.Bytes(), got))
				}
				for _, h := range tt.holes {
					_, err := s.Bytes(rel(h[0]), rel(h[1]+5))
					var re *RangeError
					if !errors.As(err, &re) || !errors.Is(err, ErrHole) {
						t.Fatalf("hole %v: err = %v, want ErrHole", h, err)
					}
					if re.From != rel(h[0]) || re.To != rel(h[1]) {
						t.Fatalf("hole reported as [%d, %d), want %v", int64(re.From-base), int64(re.To-base), h)
					}
				}
				if _, err := s.Bytes(b.Last, b.Last+1); !errors.Is(err, ErrHole) {
					t.Fatalf("byte past the end: err = %v, want ErrHole", err)
				}
				if b.Floor > 0 {
					_, err := s.Bytes(b.Floor-1, b.Floor+1)
					var re *RangeError
					if !errors.As(err, &re) || !errors.Is(err, ErrTrimmed) || re.From != b.Floor-1 || re.To != b.Floor {
						t.Fatalf("range across the trim point: err = %v, want ErrTrimmed [floor-1, floor)", err)
					}
				}
			})
		}
	}
}

func TestStoreSetBase(t *testing.T) {
	s := newTestStore(t, Options{SlabSize: 256})
	inq := uint32(math.MaxUint32 - 10)
	base, err := s.SetBase(inq)
	if err != nil {
		t.Fatal(err)
	}
	if base != AnchorEpoch|uint64(inq) {
		t.Fatalf("base %#x", base)
	}
	if _, err := s.SetBase(5); !errors.Is(err, ErrAnchored) {
		t.Fatalf("second SetBase: %v, want ErrAnchored", err)
	}
	stream := testStream(7, 200)
	// A retransmission straddling the base: only the part at or after it is kept.
	if err := s.Append(inq-50, stream[50:150]); err != nil {
		t.Fatal(err)
	}
	b := s.Bounds()
	if b.Floor != base || b.First != base || b.Contiguous != base+50 || b.Retained != 50 {
		t.Fatalf("bounds %+v", b)
	}
	if st := s.Stats(); st.BelowFloorBytes != 50 {
		t.Fatalf("below-floor bytes %d, want 50", st.BelowFloorBytes)
	}
	got, err := s.Bytes(base, base+50)
	if err != nil || !bytes.Equal(got, stream[100:150]) {
		t.Fatalf("read back: %v", err)
	}
	if _, err := s.Bytes(base-1, base+1); !errors.Is(err, ErrTrimmed) {
		t.Fatalf("before the base: %v, want ErrTrimmed", err)
	}
}

func TestStoreEmptyAndInvalid(t *testing.T) {
	s := newTestStore(t, Options{})
	if err := s.Append(5, nil); err != nil {
		t.Fatal(err)
	}
	if b := s.Bounds(); b.Anchored {
		t.Fatal("an empty segment anchored the store")
	}
	if _, err := s.Bytes(10, 5); err == nil {
		t.Fatal("reversed range accepted")
	}
	if got, err := s.Bytes(10, 10); err != nil || len(got) != 0 {
		t.Fatalf("empty range: %v %v", got, err)
	}
	if _, err := s.Bytes(AnchorEpoch, AnchorEpoch+1); !errors.Is(err, ErrHole) {
		t.Fatalf("read from an empty store: %v, want ErrHole", err)
	}
	if err := s.TrimAbs(AnchorEpoch); err == nil {
		t.Fatal("TrimAbs on an unanchored store accepted")
	}
	for _, bad := range []Options{{SlabSize: 1000}, {SlabSize: 128}, {SpillAboveRAM: 1}, {CompressAfter: -1}, {PoolKeep: -time.Second}} {
		if _, err := NewStore(bad); err == nil {
			t.Fatalf("options %+v accepted", bad)
		}
	}
	s.Close()
	if err := s.Append(1, []byte{1}); !errors.Is(err, ErrClosed) {
		t.Fatalf("append after close: %v", err)
	}
}

// TestStoreTrimReleasesSlabs checks that Trim gives slab memory back and that a contiguous
// stream reuses pooled slabs instead of allocating.
func TestStoreTrimReleasesSlabs(t *testing.T) {
	const slab = 4096
	s := newTestStore(t, Options{SlabSize: slab, PoolSlabs: 2})
	stream := testStream(3, 64*slab)
	isn := uint32(math.MaxUint32 - 3*slab) // wrap inside the test
	for off := 0; off < len(stream); off += 1448 {
		end := min(off+1448, len(stream))
		if err := s.Append(isn+uint32(off), stream[off:end]); err != nil {
			t.Fatal(err)
		}
	}
	st := s.Stats()
	// The first slab is partial (the ISN is mid-window), the last one too.
	if st.RAMSlabs != 65 || st.RAMBytes > 65*slab || st.RetainedBytes != int64(len(stream)) {
		t.Fatalf("after append: %+v", st)
	}
	abs, err := s.Trim(isn + uint32(60*slab))
	if err != nil {
		t.Fatal(err)
	}
	st = s.Stats()
	// The 60 full slabs freed are pooled (the first, partial one is not): the next ones reuse them.
	if st.RetainedBytes != 4*slab || st.RAMSlabs > 5 || st.RAMBytes > 5*slab || st.PooledBytes != 60*slab {
		t.Fatalf("after trim: %+v", st)
	}
	// A buffer stays pooled until an Age finds it unused for PoolKeep; then the pool is released
	// down to PoolSlabs.
	now := time.Now()
	for i, want := range []int64{60 * slab, 60 * slab, 2 * slab, 2 * slab} {
		if _, err := s.Age(t.Context(), now.Add(time.Duration(i)*DefaultPoolKeep/2)); err != nil {
			t.Fatal(err)
		}
		if got := s.Stats().PooledBytes; got != want {
			t.Fatalf("pooled after Age #%d: %d bytes, want %d", i+1, got, want)
		}
	}
	if b := s.Bounds(); b.First != abs || b.Contiguous != abs+4*slab || b.Floor != abs {
		t.Fatalf("bounds after trim: %+v (trim abs %d)", b, abs)
	}
	got, err := s.Bytes(abs, abs+4*slab)
	if err != nil || !bytes.Equal(got, stream[60*slab:]) {
		t.Fatalf("read after trim: %v", err)
	}
	if _, err := s.Trim(isn + uint32(len(stream))); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.RAMBytes != 0 || st.RAMSlabs != 0 || st.RetainedBytes != 0 {
		t.Fatalf("after trimming everything: %+v", st)
	}
}

// TestStoreSmallConnection checks that a connection sending a few bytes does not cost a slab.
func TestStoreSmallConnection(t *testing.T) {
	s := newTestStore(t, Options{}) // 1 MiB slabs
	if err := s.Append(12345, []byte("barrier")); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.RAMBytes != minBuf {
		t.Fatalf("a 7-byte connection holds %d bytes of RAM, want %d", st.RAMBytes, minBuf)
	}
	big := testStream(1, 100000)
	if err := s.Append(12345+7, big); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if st.RAMBytes != 131072 {
		t.Fatalf("after 100 KB: %d bytes of RAM, want 131072", st.RAMBytes)
	}
	got, err := s.Bytes(AnchorEpoch|12345, AnchorEpoch|12345+100007)
	if err != nil || string(got[:7]) != "barrier" || !bytes.Equal(got[7:], big) {
		t.Fatalf("read back: %v", err)
	}
}

func TestAppendAllocations(t *testing.T) {
	s := newTestStore(t, Options{})
	p := testStream(9, 1448)
	seq := uint32(0)
	for i := 0; i < 2000; i++ { // reach the bulk regime and a full slab
		s.Append(seq, p)
		seq += 1448
	}
	allocs := testing.AllocsPerRun(1000, func() {
		s.Append(seq, p)
		seq += 1448
	})
	// One 1 MiB slab per 724 segments; everything else must not allocate.
	if allocs > 0.01 {
		t.Fatalf("%.4f allocations per 1448-byte append", allocs)
	}
}

// TestStoreNoteParked: a parked segment anchors the store and moves its reference on without storing a
// byte, so that a trim far past everything stored, and the segments after it, unwrap right; Trimmed says
// whether a parked segment's bytes are below the trim point. Sequences start near the 32-bit wrap.
func TestStoreNoteParked(t *testing.T) {
	s := newTestStore(t, Options{})
	const base = math.MaxUint32 - 1000
	parked := func(off, n int) Record {
		return Record{Seq: uint32(base + off), Parked: uint32(n), CgroupID: 7, KtimeNs: uint64(off)}
	}
	steps := []struct {
		name        string
		note        *Record
		trim        int // trim at base+trim when not 0
		append      [2]int
		end         int  // the segment Trimmed asks about ends at base+end
		wantTrimmed bool // for end
		wantSeen    int  // Bounds.Seen, relative to base
	}{
		{name: "first parked segment anchors", note: ptr(parked(0, 64<<10)), end: 64 << 10, wantSeen: 64 << 10},
		// 3 GiB parked in 64 KiB segments, trimmed as they go: more than the 2^31 an unwrap reaches from a
		// reference that did not move.
		{name: "a long parked stretch", note: nil, end: 3 << 30, wantSeen: 3 << 30},
		{name: "trimmed up to a parked end", trim: 3<<30 - 64<<10, end: 3<<30 - 64<<10, wantTrimmed: true, wantSeen: 3 << 30},
		{name: "the last parked segment is not", end: 3 << 30, wantSeen: 3 << 30},
		{name: "a segment stored after it", append: [2]int{3 << 30, 3<<30 + 100}, end: 3<<30 + 100, wantSeen: 3<<30 + 100},
	}
	for _, st := range steps {
		switch {
		case st.note != nil:
			if err := s.NoteParked(*st.note); err != nil {
				t.Fatalf("%s: %v", st.name, err)
			}
		case st.name == "a long parked stretch":
			for off := 64 << 10; off < 3<<30; off += 64 << 10 {
				if err := s.NoteParked(parked(off, 64<<10)); err != nil {
					t.Fatal(err)
				}
				if off%(1<<30) == 0 {
					if _, err := s.Trim(uint32(base + off)); err != nil {
						t.Fatal(err)
					}
				}
			}
		}
		if st.trim != 0 {
			if _, err := s.Trim(uint32(base + st.trim)); err != nil {
				t.Fatalf("%s: %v", st.name, err)
			}
		}
		if st.append[1] != 0 {
			if err := s.Append(uint32(base+st.append[0]), make([]byte, st.append[1]-st.append[0])); err != nil {
				t.Fatalf("%s: %v", st.name, err)
			}
		}
		b := s.Bounds()
		if got := s.Trimmed(uint32(base + st.end)); got != st.wantTrimmed {
			t.Errorf("%s: Trimmed(base+%d) = %v, want %v (bounds %+v)", st.name, st.end, got, st.wantTrimmed, b)
		}
		if want := AnchorEpoch | base + uint64(st.wantSeen); b.Seen != want || !b.Anchored {
			t.Errorf("%s: Seen %#x, want %#x (bounds %+v)", st.name, b.Seen, want, b)
		}
	}
	if a := s.Activity(); a.CgroupID != 7 || a.LastAppend.IsZero() {
		t.Errorf("activity %+v: want the parked records' cgroup and a time", a)
	}
	if s.Stats().RetainedBytes != 100 {
		t.Errorf("retained %d bytes, want only the 100 stored", s.Stats().RetainedBytes)
	}
	s.Close()
	if !s.Trimmed(base) {
		t.Error("a closed store still needs bytes")
	}
	if err := s.NoteParked(parked(0, 1)); !errors.Is(err, ErrClosed) {
		t.Errorf("NoteParked on a closed store: %v, want ErrClosed", err)
	}
}

func ptr[T any](v T) *T { return &v }

// TestBoundsServable: a range is served only from a position the restorer can only mean one way, and
// above every byte that differed from the log's.
func TestBoundsServable(t *testing.T) {
	const e = AnchorEpoch
	tests := []struct {
		name string
		b    Bounds
		abs  uint64
		want error
	}{
		{name: "fresh", b: Bounds{Low: e + 1000, First: e + 1000}, abs: e + 5000},
		{name: "trimmed", b: Bounds{Floor: e + 1000, Low: e + 1000, First: e + 1000}, abs: e + 1<<31},
		{name: "below a conflict", b: Bounds{Low: e + 1000, First: e + 1000, ConflictEnd: e + 6000}, abs: e + 5000, want: ErrConflict},
		{name: "at a conflict's end", b: Bounds{Low: e + 1000, First: e + 1000, ConflictEnd: e + 6000}, abs: e + 6000},
		{name: "2^32 above the floor", b: Bounds{Floor: e + 1000, Low: e + 1000, First: e + 1000}, abs: e + 1<<32 + 1000, want: ErrAmbiguous},
		{name: "just under 2^32 above the floor", b: Bounds{Floor: e + 1000, Low: e + 1000, First: e + 1000}, abs: e + 1<<32 + 999},
		{name: "2^32 above the lowest byte offered, never trimmed", b: Bounds{Low: e + 1000, First: e + 1000}, abs: e + 1<<32 + 5000, want: ErrAmbiguous},
		{name: "epoch-0 retransmission", b: Bounds{Low: e - 100, First: e - 100}, abs: e - 50},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.b.Servable(tc.abs); !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
				t.Errorf("Servable(%d) = %v, want %v", tc.abs, err, tc.want)
			}
		})
	}
}

// TestServableAfter4GiB: a log holding more than 2^32 bytes of one connection above its trim point holds
// two positions for one wire sequence. Before, Unwrap chose the newer one silently, and a restore was
// served the bytes sent 2^32 later.
func TestServableAfter4GiB(t *testing.T) {
	l := newTestLog(t, Options{})
	c := testConn(1)
	const seq0 = 1000
	if err := l.Append(decoded(t, c, seq0, bytes.Repeat([]byte{'A'}, 1000))); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Trim(c, seq0); err != nil { // the receiver's previous snapshot
		t.Fatal(err)
	}
	for k := uint32(1); k <= 3; k++ { // a byte every GiB stands for the stream
		if err := l.Append(decoded(t, c, seq0+k<<30, []byte{'x'})); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Append(decoded(t, c, seq0, bytes.Repeat([]byte{'B'}, 1000))); err != nil { // 2^32 bytes on
		t.Fatal(err)
	}
	abs, err := l.Unwrap(c, seq0+10)
	if err != nil {
		t.Fatal(err)
	}
	b, err := l.Bounds(c)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Servable(abs); !errors.Is(err, ErrAmbiguous) {
		t.Errorf("wire sequence %d unwrapped to abs %d with the floor at %d: Servable %v, want %v", seq0+10, abs, b.Floor, err, ErrAmbiguous)
	}
}
