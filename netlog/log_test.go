package netlog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
	"golang.org/x/sys/unix"
)

func newTestLog(t testing.TB, opt Options) *Log {
	t.Helper()
	if opt.Logger == nil {
		opt.Logger = slog.New(slog.NewTextHandler(t.Output(), nil))
	}
	l, err := NewLog(opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func testConn(i int) tcpflow.Tuple {
	return tcpflow.Tuple{
		Local:  netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, 1}), uint16(40000+i)),
		Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, 2}), 5201),
	}
}

// decoded runs a record through the ring-buffer encoding, as the consumer will see it.
func decoded(t testing.TB, c tcpflow.Tuple, seq uint32, p []byte) Record {
	b, err := AppendRecord(nil, Record{Conn: c, Seq: seq, Payload: p, CgroupID: 7})
	if err != nil {
		t.Fatal(err)
	}
	r, err := DecodeRecord(b)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestLogBasics(t *testing.T) {
	l := newTestLog(t, Options{SlabSize: 1024})
	a, b := testConn(1), testConn(2)
	sa, sb := testStream(1, 5000), testStream(2, 3000)
	for off := 0; off < len(sa); off += 700 {
		if err := l.Append(decoded(t, a, 100+uint32(off), sa[off:min(off+700, len(sa))])); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Append(decoded(t, b, 0xFFFFFF00, sb)); err != nil {
		t.Fatal(err)
	}
	if err := l.Append(Record{Conn: b, Seq: 5}); err != nil { // a pure ACK
		t.Fatal(err)
	}
	// An IPv4-mapped IPv6 spelling names the same connection.
	mapped := tcpflow.Tuple{Local: netip.MustParseAddrPort("[::ffff:10.0.0.1]:40002"), Remote: netip.MustParseAddrPort("[::ffff:10.0.0.2]:5201")}
	bb, err := l.Bounds(mapped)
	if err != nil || bb.Contiguous-bb.First != 3000 {
		t.Fatalf("bounds via mapped address: %+v %v", bb, err)
	}
	got, err := l.Range(b, bb.First, bb.Contiguous)
	if err != nil || !bytes.Equal(got, sb) {
		t.Fatalf("range of b: %v", err)
	}
	abs, err := l.Unwrap(a, 100)
	if err != nil || abs != AnchorEpoch|100 {
		t.Fatalf("unwrap: %d %v", abs, err)
	}
	var w bytes.Buffer
	if n, err := l.WriteRange(context.Background(), &w, a, abs+1000, abs+4000); err != nil || n != 3000 || !bytes.Equal(w.Bytes(), sa[1000:4000]) {
		t.Fatalf("write range: %d %v", n, err)
	}
	if conns := l.Conns(); len(conns) != 2 || conns[0] != a || conns[1] != b {
		t.Fatalf("conns %v", conns)
	}
	st := l.Stats()
	ca, _ := l.ConnStats(a)
	cb, _ := l.ConnStats(b)
	if st.Conns != 2 || st.RetainedBytes != 8000 || st.RetainedBytes != ca.RetainedBytes+cb.RetainedBytes || st.RAMBytes != ca.RAMBytes+cb.RAMBytes {
		t.Fatalf("log stats %+v, conn stats %+v %+v", st, ca, cb)
	}
	// Trim takes the receiver's 32-bit inq_seq.
	if abs, err := l.Trim(a, 100+2500); err != nil || abs != AnchorEpoch|2600 {
		t.Fatalf("trim: %d %v", abs, err)
	}
	if _, err := l.Range(a, AnchorEpoch|2599, AnchorEpoch|2700); !errors.Is(err, ErrTrimmed) {
		t.Fatalf("range below trim: %v", err)
	}
	// A conflict names the connection and keeps the log usable.
	bad := bytes.Clone(sa[3000:3100])
	bad[0]++
	if err := l.Append(decoded(t, a, 3100, bad)); !errors.Is(err, ErrConflict) {
		t.Fatalf("conflict: %v", err)
	} else {
		t.Logf("conflict error reads: %v", err)
	}
	if _, err := l.Range(testConn(9), 0, 1); !errors.Is(err, ErrUnknownConn) {
		t.Fatalf("unknown conn: %v", err)
	}
	// SetBase on a new connection, then Remove.
	c := testConn(3)
	if abs, err := l.SetBase(c, 77); err != nil || abs != AnchorEpoch|77 {
		t.Fatalf("set base: %d %v", abs, err)
	}
	if _, err := l.SetBase(c, 78); !errors.Is(err, ErrAnchored) {
		t.Fatalf("second set base: %v", err)
	}
	if err := l.Remove(a); err != nil {
		t.Fatal(err)
	}
	if st := l.Stats(); st.Conns != 2 || st.RetainedBytes != 3000 {
		t.Fatalf("after remove: %+v", st)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Append(decoded(t, a, 1, []byte{1})); !errors.Is(err, ErrClosed) {
		t.Fatalf("append after close: %v", err)
	}
}

// TestLogConcurrent runs the real topology: one ring-buffer consumer appending segments of
// several connections (with retransmissions), readers checking every byte they get against
// the streams, and a GC goroutine trimming, aging (compress + spill) and removing. Run with
// -race.
func TestLogConcurrent(t *testing.T) {
	const (
		conns = 3
		size  = 3 << 20
		slab  = 64 << 10
	)
	l := newTestLog(t, Options{SlabSize: slab, CompressAfter: time.Nanosecond, SpillDir: fastSpillDir(t), SpillAboveRAM: 4 * slab})
	streams := make([][]byte, conns)
	isns := make([]uint32, conns)
	for i := range streams {
		streams[i] = textStream(size)
		streams[i][i] = byte(i) // distinct streams
		isns[i] = uint32(0xFFFFFFFF - i*1_000_003)
	}
	var done atomic.Bool
	var trims, ages, spilled atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, 16)
	fail := func(err error) {
		select {
		case errc <- err:
		default:
		}
	}

	wg.Add(1)
	go func() { // the ring-buffer consumer
		defer wg.Done()
		defer done.Store(true)
		r := rand.New(rand.NewPCG(1, 2))
		offs := make([]int, conns)
		for k := 0; ; k++ {
			if k%32 == 31 { // let a GC pass run in between, however the scheduler feels
				for seen := ages.Load(); ages.Load() == seen && len(errc) == 0; {
					time.Sleep(100 * time.Microsecond)
				}
			}
			i := r.IntN(conns)
			if offs[i] >= size {
				if offs[0] >= size && offs[1] >= size && offs[2] >= size {
					return
				}
				continue
			}
			n := min(size-offs[i], []int{1448, 65160, 9000}[r.IntN(3)])
			off := offs[i]
			if r.IntN(10) == 0 && off > 100000 { // retransmission
				off -= r.IntN(100000)
				n = min(n, offs[i]-off)
			} else {
				offs[i] += n
			}
			if err := l.Append(decoded(t, testConn(i), isns[i]+uint32(off), streams[i][off:off+n])); err != nil {
				fail(fmt.Errorf("append conn %d at %d: %w", i, off, err))
				return
			}
		}
	}()

	for reader := 0; reader < 2; reader++ {
		wg.Add(1)
		go func() { // query API: whatever it gets must be the stream's bytes
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(reader), 9))
			for !done.Load() {
				i := r.IntN(conns)
				b, err := l.Bounds(testConn(i))
				if errors.Is(err, ErrUnknownConn) {
					continue
				}
				if err != nil || b.Contiguous == b.First {
					continue
				}
				from := b.First + uint64(r.IntN(int(b.Contiguous-b.First)))
				to := min(b.Contiguous, from+uint64(r.IntN(3*slab)))
				got, err := l.Range(testConn(i), from, to)
				if errors.Is(err, ErrTrimmed) {
					continue // GC overtook us
				}
				if err != nil {
					fail(fmt.Errorf("range conn %d [%d, %d): %w", i, from, to, err))
					return
				}
				off := int(from - (AnchorEpoch | uint64(isns[i])))
				if !bytes.Equal(got, streams[i][off:off+len(got)]) {
					fail(fmt.Errorf("range conn %d [%d, %d) differs from the stream", i, from, to))
					return
				}
				_ = l.Stats()
			}
		}()
	}

	wg.Add(1)
	go func() { // GC: trim behind the contiguous point, age, spill
		defer wg.Done()
		for !done.Load() {
			for i := 0; i < conns; i++ {
				b, err := l.Bounds(testConn(i))
				if err != nil || b.Contiguous-b.First < 4*slab {
					continue
				}
				if _, err := l.Trim(testConn(i), Wire(b.Contiguous-2*slab)); err != nil {
					fail(err)
					return
				}
				trims.Add(1)
			}
			r, err := l.Age(context.Background(), time.Now().Add(time.Second))
			if err != nil {
				fail(fmt.Errorf("age: %w", err))
				return
			}
			spilled.Add(int64(r.Spilled))
			ages.Add(1)
			time.Sleep(time.Millisecond)
		}
	}()
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	// Everything retained at the end is the streams' tails, from every form of storage.
	if _, err := l.Age(context.Background(), time.Now().Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < conns; i++ {
		b, err := l.Bounds(testConn(i))
		if err != nil {
			t.Fatal(err)
		}
		if b.Last != (AnchorEpoch|uint64(isns[i]))+size || b.Contiguous != b.Last {
			t.Fatalf("conn %d bounds %+v", i, b)
		}
		got, err := l.Range(testConn(i), b.First, b.Last)
		if err != nil || !bytes.Equal(got, streams[i][size-len(got):]) {
			t.Fatalf("conn %d final range: %v", i, err)
		}
	}
	st := l.Stats()
	if trims.Load() < 10 || ages.Load() < 10 || spilled.Load() == 0 {
		t.Fatalf("GC ran only %d trims and %d age passes spilling %d slabs: the test did not interleave", trims.Load(), ages.Load(), spilled.Load())
	}
	t.Logf("final stats: %+v; %d trims, %d age passes, %d slabs spilled during the run", st, trims.Load(), ages.Load(), spilled.Load())
	if st.Conflicts != 0 || st.DuplicateBytes == 0 {
		t.Fatalf("stats %+v", st)
	}
	for i := 0; i < conns; i++ {
		if err := l.Remove(testConn(i)); err != nil {
			t.Fatal(err)
		}
	}
	if st := l.Stats(); st.RetainedBytes != 0 || st.RAMBytes != 0 || st.CompressedBytes != 0 || st.SpilledBytes != 0 {
		t.Fatalf("after removing everything: %+v", st)
	}
}

// TestLogHoldDuringTrim: a Hold granted while a Trim is under way is either seen by it or taken after it
// (the holder then finds the bytes gone at once). Before, Trim read the holds, let go of the log's lock and
// only then trimmed the store: a Hold granted in between, with its bytes still there, was trimmed past, and
// the recovery's later check of the re-sent bytes found them trimmed and refused a good recovery. The test
// stops the Trim at the store's lock (held for reading) and takes the Hold there if the log lets it.
func TestLogHoldDuringTrim(t *testing.T) {
	l := newTestLog(t, Options{SlabSize: 1024})
	c := testConn(1)
	const base, hold, trimTo = 100, 1000, 2500
	if err := l.Append(decoded(t, c, base, testStream(1, 4000))); err != nil {
		t.Fatal(err)
	}
	first, _ := l.Unwrap(c, base)
	st, err := l.Store(c)
	if err != nil {
		t.Fatal(err)
	}
	st.mu.RLock()
	trimmed := make(chan error, 1)
	go func() {
		_, err := l.Trim(c, base+trimTo)
		trimmed <- err
	}()
	// Wait for the Trim to wait for the store's lock: a writer waiting makes TryRLock fail.
	for st.mu.TryRLock() {
		st.mu.RUnlock()
		runtime.Gosched()
	}
	var release func()
	heldFirst := l.mu.TryLock() // the Trim holds the log's lock no more: a Hold would be granted now
	if heldFirst {
		l.mu.Unlock()
		release = l.Hold(c, base+hold)
		if st.floor > first+hold {
			t.Fatalf("the store was trimmed to offset %d before the Trim was let go", st.floor-first)
		}
	}
	st.mu.RUnlock()
	if err := <-trimmed; err != nil {
		t.Fatal(err)
	}
	if !heldFirst {
		release = l.Hold(c, base+hold) // after the Trim: the holder finds the bytes gone, and knows
	}
	defer release()
	b, err := l.Bounds(c)
	if err != nil {
		t.Fatal(err)
	}
	if heldFirst && b.Floor > first+hold {
		t.Errorf("a Hold at offset %d, granted with its bytes still logged, was trimmed past: the trim point is offset %d", hold, b.Floor-first)
	}
	if !heldFirst && b.Floor != first+trimTo {
		t.Errorf("trimmed to offset %d, want %d", b.Floor-first, trimTo)
	}
}

// TestLogHold: a held connection's bytes from the held sequence number on survive the receiver's trims
// and the release of finished connections until the hold is released (a recovery checking the bytes its
// restored job re-sent lost them to the peer's next snapshot: CI run 12, TestCompareSmall).
func TestLogHold(t *testing.T) {
	tests := []struct {
		name      string
		base      uint32 // wire sequence number of the first byte
		hold      uint32 // offset of the held byte from base
		trimTo    uint32 // offset the receiver's snapshot trims to
		wantFirst uint32 // offset of the first byte kept while held
	}{
		{"trim past the hold stops at it", 100, 1000, 2500, 1000},
		{"trim before the hold goes ahead", 100, 2000, 1500, 1500},
		{"hold across the sequence wrap", 0xFFFFFF00, 0x80, 0x200, 0x80},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := newTestLog(t, Options{SlabSize: 1024})
			c := testConn(1)
			release := l.Hold(c, tc.base+tc.hold) // before the connection sent anything
			data := testStream(1, 4000)
			if err := l.Append(decoded(t, c, tc.base, data)); err != nil {
				t.Fatal(err)
			}
			first, _ := l.Unwrap(c, tc.base)
			if _, err := l.Trim(c, tc.base+tc.trimTo); err != nil {
				t.Fatal(err)
			}
			if b, err := l.Bounds(c); err != nil || b.First != first+uint64(tc.wantFirst) {
				t.Fatalf("first byte kept at offset %d (%v), want %d", b.First-first, err, tc.wantFirst)
			}
			// A finished connection is not released while held either.
			act, err := l.Activity(c)
			if err != nil {
				t.Fatal(err)
			}
			if removed, _, err := l.RemoveIdle(c, act.LastAppend); removed || err != nil {
				t.Fatalf("held connection released: %v %v", removed, err)
			}
			release()
			release() // twice is harmless
			if _, err := l.Trim(c, tc.base+tc.trimTo); err != nil {
				t.Fatal(err)
			}
			if b, _ := l.Bounds(c); b.First != first+uint64(tc.trimTo) {
				t.Fatalf("after release the trim stopped at offset %d, want %d", b.First-first, tc.trimTo)
			}
			if removed, _, err := l.RemoveIdle(c, act.LastAppend); !removed || err != nil {
				t.Fatalf("released connection kept: %v %v", removed, err)
			}
		})
	}
}

// Holds: nothing for an unknown connection; for a known one, whether [from, end) is all there (a hole in it
// says no, one below from does not: a reader from a restore point above a lost segment waited for it, 5 s
// per connection); WaitHolds returns once what poke appends fills the gap, or false when its context ends
// first.
func TestLogHolds(t *testing.T) {
	l := newTestLog(t, Options{SlabSize: 1024})
	c := testConn(1)
	if l.Holds(c, 100, 100) {
		t.Error("an unknown connection holds bytes")
	}
	p := testStream(1, 3000)
	for _, r := range [][2]int{{0, 1000}, {2000, 3000}} { // a hole at [1000, 2000)
		if err := l.Append(decoded(t, c, 100+uint32(r[0]), p[r[0]:r[1]])); err != nil {
			t.Fatal(err)
		}
	}
	for _, tt := range []struct {
		from, end uint32
		want      bool
	}{
		{100, 100, true}, {100, 1100, true}, {100, 1101, false}, {100, 3100, false},
		{1099, 1101, false}, {1500, 2500, false}, {2099, 2101, false}, // a hole inside [from, end)
		{2100, 2101, true}, {2100, 3100, true}, {2500, 3100, true}, // the hole below from
		{2500, 3101, false},
	} {
		if got := l.Holds(c, tt.from, tt.end); got != tt.want {
			t.Errorf("Holds([%d, %d)) = %v, want %v", tt.from, tt.end, got, tt.want)
		}
	}
	// A reader whose context has ended gets Holds's answer: no wait, no poke, for bytes above the hole.
	done, stop := context.WithCancel(t.Context())
	stop()
	if !l.WaitHolds(done, c, 2100, 3100, time.Millisecond, func() { t.Error("poked for bytes the log holds") }) {
		t.Error("WaitHolds above the hole waited for the hole below it")
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // a failure bound only
	defer cancel()
	pokes := 0
	fill := func() {
		if pokes++; pokes == 2 {
			if err := l.Append(decoded(t, c, 1100, p[1000:2000])); err != nil {
				t.Error(err)
			}
		}
	}
	if !l.WaitHolds(ctx, c, 100, 3100, time.Millisecond, fill) || pokes != 2 {
		t.Errorf("WaitHolds after the gap was filled on the second poke: %d pokes", pokes)
	}
	if l.WaitHolds(done, c, 100, 3101, time.Millisecond, func() {}) {
		t.Error("WaitHolds reported a byte the log does not hold")
	}
}

// TestLogHoldsParkedBelow: bytes parked before the lowest stored ones are a hole too. A parked segment is
// taken into the log only when a reader wakes the consumer, so a short segment stored at once, right
// after it, made the store start there: Holds said yes for a range whose first bytes were still parked,
// no reader woke the consumer, and the read of the range was refused ("range not logged": every restored
// job's re-sent bytes failed their check in CI on 8991361).
func TestLogHoldsParkedBelow(t *testing.T) {
	l := newTestLog(t, Options{SlabSize: 1024})
	c := testConn(2)
	p := testStream(2, 5000)
	parked := func(from, to int) Record {
		return Record{Conn: c, Seq: 100 + uint32(from), Parked: uint32(to - from)}
	}
	store := func(from, to int) {
		t.Helper()
		if err := l.Append(decoded(t, c, 100+uint32(from), p[from:to])); err != nil {
			t.Fatal(err)
		}
	}
	check := func(when string, from, end int, want bool) {
		t.Helper()
		if got := l.Holds(c, 100+uint32(from), 100+uint32(end)); got != want {
			b, _ := l.Bounds(c)
			t.Errorf("%s: Holds([%d, %d)) = %v, want %v (bounds %+v)", when, from, end, got, want, b)
		}
	}
	if err := l.NoteParked(parked(0, 2000)); err != nil {
		t.Fatal(err)
	}
	store(2000, 2100) // a short segment, stored at once
	check("[0, 2000) parked, [2000, 2100) stored", 0, 2100, false)
	check("[0, 2000) parked below from, [2000, 2100) stored", 2000, 2100, true)
	store(0, 2000) // taken
	check("all stored", 0, 2100, true)

	// After a trim, the same within what is left.
	if _, err := l.Trim(c, 100+2100); err != nil {
		t.Fatal(err)
	}
	if err := l.NoteParked(parked(2100, 4000)); err != nil {
		t.Fatal(err)
	}
	store(4000, 4100)
	check("trimmed, [2100, 4000) parked", 2100, 4100, false)
	store(2100, 4000)
	check("trimmed, all stored", 2100, 4100, true)
	check("trimmed, all stored, from below the trim point (never to come)", 0, 4100, true)
	// A parked segment wholly below the trim point is no hole.
	if err := l.NoteParked(parked(1000, 2000)); err != nil {
		t.Fatal(err)
	}
	check("a parked retransmission of trimmed bytes", 2100, 4100, true)
}

// TestSpillFileFreesBlocks: a spilled slab released while others stay spilled gives its blocks back.
// Before, regions were written back to back, and the block two neighbours shared stayed allocated after
// both were punched: the spill file grew by a block per spilled slab for as long as anything stayed spilled.
func TestSpillFileFreesBlocks(t *testing.T) {
	const slab = 64 << 10
	quiet := slog.New(slog.DiscardHandler)
	l := newTestLog(t, Options{SlabSize: slab, CompressAfter: time.Nanosecond, SpillDir: fastSpillDir(t), SpillAboveRAM: 1, Logger: quiet})
	kept, busy := testConn(1), testConn(2)
	stream := textStream(2 * slab)
	now := time.Now()
	age := func() {
		now = now.Add(time.Second)
		if _, err := l.Age(context.Background(), now); err != nil {
			t.Fatal(err)
		}
	}
	appendSlab := func(c tcpflow.Tuple, seq uint32) {
		for off := 0; off < slab; off += 1448 {
			if err := l.Append(decoded(t, c, seq+uint32(off), stream[off%slab:min(off+1448, slab)])); err != nil {
				t.Fatal(err)
			}
		}
	}
	appendSlab(kept, 0) // a connection nobody trims: its sealed slab stays spilled
	appendSlab(kept, slab)
	age()
	const rounds = 200
	for i := range rounds {
		seq := uint32(i * slab)
		appendSlab(busy, seq)
		appendSlab(busy, seq+slab)
		age()
		if _, err := l.Trim(busy, seq+slab); err != nil { // the receiver's snapshot frees the spilled one
			t.Fatal(err)
		}
	}
	st := l.Stats()
	var fs unix.Stat_t
	if err := unix.Fstat(int(l.env.spill.f.Fd()), &fs); err != nil {
		t.Fatal(err)
	}
	if st.SpilledBytes == 0 {
		t.Fatalf("nothing spilled: %+v", st)
	}
	if allocated := fs.Blocks * 512; allocated > 4*st.SpilledBytes+64<<10 {
		t.Errorf("spill file: %d bytes referenced (%d slabs), %d bytes allocated (apparent size %d) after %d slabs spilled and released",
			st.SpilledBytes, st.SpilledSlabs, allocated, fs.Size, rounds)
	}
}

// TestLogReusedTupleAfterConflicts: a new connection of the same cgroup on a reused 4-tuple, whose
// segments conflicted with the old connection's bytes still logged (TestRangeRefusesAReusedTuple in
// netlog/node). Its receiver, restored from a snapshot that holds every byte it was sent, asks from the
// end of the last conflicting segment: the old connection's bytes lie there, and must not be served.
func TestLogReusedTupleAfterConflicts(t *testing.T) {
	l := newTestLog(t, Options{SlabSize: 1024})
	c := testConn(1)
	old, next := testStream(1, 20000), testStream(2, 3000)
	if err := l.Append(Record{Conn: c, Seq: 1000, CgroupID: 7, Payload: old}); err != nil {
		t.Fatal(err)
	}
	for off := 0; off < len(next); off += 1000 {
		if err := l.Append(Record{Conn: c, Seq: 5000 + uint32(off), CgroupID: 7, Payload: next[off : off+1000]}); !errors.Is(err, ErrConflict) {
			t.Fatalf("the new connection's segment at %d: %v, want a conflict", 5000+off, err)
		}
	}
	if abs, _, err := l.UnwrapServable(c, 8000); !errors.Is(err, ErrConflict) {
		got, rerr := l.Range(c, abs, abs+100)
		t.Errorf("range from 8000 for the new connection's receiver: err %v, want ErrConflict; it reads the old connection's bytes: %v (%v)",
			err, bytes.Equal(got, old[7000:7100]), rerr)
	}
}
