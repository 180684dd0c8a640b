package recvdigest

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/tcpflow"
)

// segment is a record of stream bytes [off, off+n).
type segment struct{ off, n int }

// splitStream cuts [0, size) into consecutive segments of random sizes, mostly small with some large ones
// (GRO super-packets), as a receive tap reports them.
func splitStream(r *rand.Rand, size int) []segment {
	var out []segment
	for off := 0; off < size; {
		n := 1 + r.IntN(3000)
		if r.IntN(20) == 0 {
			n = 1 + r.IntN(200<<10)
		}
		n = min(n, size-off)
		out = append(out, segment{off, n})
		off += n
	}
	return out
}

func record(conn tcpflow.Tuple, base uint32, stream []byte, s segment) netlog.Record {
	// A fresh copy, overwritten after Add, like the ring buffer's memory the tap hands out.
	p := slices.Clone(stream[s.off : s.off+s.n])
	return netlog.Record{Conn: conn, Seq: base + uint32(s.off), Payload: p}
}

func addAll(b *Book, conn tcpflow.Tuple, base uint32, stream []byte, segs []segment) {
	for _, s := range segs {
		rec := record(conn, base, stream, s)
		b.Add(rec)
		clear(rec.Payload) // the Book must have copied what it keeps
	}
}

func received(t *testing.T, b *Book, conn tcpflow.Tuple, from uint32) []Piece {
	t.Helper()
	r, ok := b.Received(conn, from)
	if !ok {
		t.Fatalf("flow %v unknown", conn)
	}
	if err := r.Validate(); err != nil {
		t.Fatalf("the Book's own record does not validate: %v", err)
	}
	return r.Pieces
}

func equalPieces(t *testing.T, got, want []Piece) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Fatalf("pieces differ:\n got %d: %v\nwant %d: %v", len(got), head(got), len(want), head(want))
	}
}

func head(ps []Piece) []Piece { return ps[:min(len(ps), 8)] }

var testBases = []struct {
	name string
	base uint32
}{
	{"mid-block", 7*B + 12345},
	{"block-aligned", 9 * B},
	{"across the wrap", 1<<32 - 3*B - 999},
	{"last byte before the wrap", 1<<32 - 1},
}

func TestBookInOrder(t *testing.T) {
	for i, tb := range testBases {
		t.Run(tb.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(i), 1))
			stream := randomBytes(uint64(i), 7*B+321)
			b := NewBook(BookOptions{})
			addAll(b, testConn, tb.base, stream, splitStream(r, len(stream)))
			equalPieces(t, received(t, b, testConn, tb.base), piecesOf(tb.base, stream))
			st := b.Stats()
			if st.Bytes != uint64(len(stream)) || st.DuplicateBytes != 0 || st.Holes != 0 || st.HeldBytes != 0 || st.Flows != 1 || st.Pieces != len(piecesOf(tb.base, stream)) {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

func TestBookDuplicatesAndOverlaps(t *testing.T) {
	for i, tb := range testBases {
		t.Run(tb.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(i), 2))
			stream := randomBytes(uint64(i)+10, 5*B+77)
			var segs []segment
			fed := 0
			for _, s := range splitStream(r, len(stream)) {
				segs = append(segs, s)
				switch r.IntN(4) {
				case 0: // retransmitted as is
					segs = append(segs, s)
				case 1: // re-sent from earlier, overlapping the bytes before
					back := min(s.off, r.IntN(5000))
					segs = append(segs, segment{s.off - back, back + s.n})
				}
			}
			for _, s := range segs {
				fed += s.n
			}
			b := NewBook(BookOptions{})
			addAll(b, testConn, tb.base, stream, segs)
			equalPieces(t, received(t, b, testConn, tb.base), piecesOf(tb.base, stream))
			if st := b.Stats(); st.Bytes != uint64(len(stream)) || st.DuplicateBytes != uint64(fed-len(stream)) || st.Holes != 0 {
				t.Errorf("stats %+v; want %d bytes, %d duplicate", st, len(stream), fed-len(stream))
			}
		})
	}
}

func TestBookReorderFilled(t *testing.T) {
	for i, tb := range testBases {
		t.Run(tb.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(i), 3))
			stream := randomBytes(uint64(i)+20, 4*B+5)
			segs := splitStream(r, len(stream))
			// Swap neighbours and move some records a few places later, as two CPUs may deliver them,
			// keeping the first record first (it starts the run).
			for j := 1; j+1 < len(segs); j += 2 {
				if r.IntN(2) == 0 {
					segs[j], segs[j+1] = segs[j+1], segs[j]
				}
			}
			for j := 1; j+4 < len(segs); j += 7 {
				s := segs[j]
				segs = slices.Insert(slices.Delete(segs, j, j+1), j+3, s)
			}
			b := NewBook(BookOptions{MaxReorderBytes: 1 << 20})
			addAll(b, testConn, tb.base, stream, segs)
			equalPieces(t, received(t, b, testConn, tb.base), piecesOf(tb.base, stream))
			if st := b.Stats(); st.Holes != 0 || st.HeldBytes != 0 || st.Bytes != uint64(len(stream)) {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

// The tap's record without payload at the SYN says where a flow begins. In the lab (ftbench compare, CI)
// a rank's first 2048-byte message reached the ring after its second: the Book started the flow at the
// second one, dropped the first as a duplicate, and a later recovery could not verify the re-sent bytes of
// that block ("the receiver's record and the sender's disagree on where the connection's bytes begin").
func TestBookStartRecordAnchorsTheFlow(t *testing.T) {
	for i, tb := range testBases {
		t.Run(tb.name, func(t *testing.T) {
			stream := randomBytes(uint64(i)+70, 3*B+100)
			b := NewBook(BookOptions{})
			b.Add(netlog.Record{Conn: testConn, Seq: tb.base}) // the SYN's record
			b.Add(netlog.Record{Conn: testConn, Seq: tb.base}) // a retransmitted SYN's: the same start
			addAll(b, testConn, tb.base, stream, []segment{{2048, 4096}, {0, 2048}, {6144, len(stream) - 6144}})
			equalPieces(t, received(t, b, testConn, tb.base), piecesOf(tb.base, stream))
			if st := b.Stats(); st.Holes != 0 || st.HeldBytes != 0 || st.DuplicateBytes != 0 || st.Resets != 0 || st.Bytes != uint64(len(stream)) {
				t.Errorf("stats %+v", st)
			}
		})
	}
	t.Run("new connection on the same 4-tuple", func(t *testing.T) {
		b := NewBook(BookOptions{})
		b.Add(netlog.Record{Conn: testConn, Seq: 1000})
		b.Add(netlog.Record{Conn: testConn, Seq: 1000, Payload: []byte("old connection")})
		b.Add(netlog.Record{Conn: testConn, Seq: 5000}) // a SYN elsewhere, even within a window
		b.Add(netlog.Record{Conn: testConn, Seq: 5003, Payload: []byte("later")})
		b.Add(netlog.Record{Conn: testConn, Seq: 5000, Payload: []byte("new")})
		equalPieces(t, received(t, b, testConn, 5000), piecesOf(5000, []byte("newlater")))
		if st := b.Stats(); st.Resets != 1 || st.Pieces != 1 || st.HeldBytes != 0 {
			t.Errorf("stats %+v", st)
		}
	})
}

func TestBookReorderOverflowMakesAHole(t *testing.T) {
	const base = 5*B + 100
	stream := randomBytes(30, 3*B)
	var segs []segment
	for off := 0; off < len(stream); off += 1000 {
		segs = append(segs, segment{off, min(1000, len(stream)-off)})
	}
	const lost = 70 // the record [70000, 71000) never reaches the tap in time
	b := NewBook(BookOptions{MaxReorderBytes: 10000})
	for j, s := range segs {
		if j == lost {
			continue
		}
		b.Add(record(testConn, base, stream, s))
		held := b.Stats().HeldBytes
		switch {
		case j > lost && j <= lost+10 && held != (j-lost)*1000:
			t.Fatalf("after record %d: %d bytes held, want %d", j, held, (j-lost)*1000)
		case j > lost+10 && held != 0:
			t.Fatalf("after record %d: %d bytes held, want the gap accepted", j, held)
		}
	}
	gapFrom, gapTo := lost*1000, lost*1000+1000
	want := append(piecesOf(base, stream[:gapFrom]), piecesOf(base+uint32(gapTo), stream[gapTo:])...)
	equalPieces(t, received(t, b, testConn, base), want)
	st := b.Stats()
	if st.Holes != 1 || st.HeldBytes != 0 || st.Bytes != uint64(len(stream)-1000) {
		t.Errorf("stats %+v; want 1 hole", st)
	}
	// The late record is behind the new run: skipped, the hole stays a hole.
	b.Add(record(testConn, base, stream, segs[lost]))
	equalPieces(t, received(t, b, testConn, base), want)
	if st := b.Stats(); st.DuplicateBytes != 1000 || st.Holes != 1 {
		t.Errorf("stats after the late record %+v", st)
	}
}

// TestBookHeldRetransmissions checks that bytes waiting after a gap count once however often they are
// retransmitted, so retransmissions do not push a flow over its reorder bound and make a hole early.
func TestBookHeldRetransmissions(t *testing.T) {
	const base = 3 * B
	stream := randomBytes(31, 4000)
	b := NewBook(BookOptions{MaxReorderBytes: 2000})
	add := func(off, n int) { b.Add(record(testConn, base, stream, segment{off, n})) }
	add(0, 1000)
	for range 5 {
		add(2000, 1000) // the gap [1000, 2000) is still open
	}
	add(2500, 1000) // overlaps the held bytes by half
	if st := b.Stats(); st.HeldBytes != 1500 || st.Holes != 0 || st.DuplicateBytes != 4500 {
		t.Fatalf("stats %+v; want 1500 bytes held once, no hole", st)
	}
	add(1000, 1000)
	add(3500, 500)
	equalPieces(t, received(t, b, testConn, base), piecesOf(base, stream))
	if st := b.Stats(); st.HeldBytes != 0 || st.Holes != 0 || st.Bytes != 4000 {
		t.Errorf("stats %+v", st)
	}
}

func TestBookTotalReorderBound(t *testing.T) {
	b := NewBook(BookOptions{MaxReorderBytes: 1 << 20, MaxTotalReorderBytes: 5000})
	conns := testConns(3)
	for _, c := range conns {
		b.Add(netlog.Record{Conn: c, Seq: 1000, Payload: make([]byte, 10)})
	}
	// Each flow holds 2000 bytes after a gap: the third goes over the total and accepts its gap.
	for i, c := range conns {
		b.Add(netlog.Record{Conn: c, Seq: 2000, Payload: make([]byte, 2000)})
		st := b.Stats()
		if st.HeldBytes > 5000 {
			t.Fatalf("after flow %d: %d bytes held, more than the total bound", i, st.HeldBytes)
		}
		if wantHoles := uint64(max(0, i-1)); st.Holes != wantHoles {
			t.Fatalf("after flow %d: %d holes, want %d", i, st.Holes, wantHoles)
		}
	}
}

func testConns(n int) []tcpflow.Tuple {
	out := make([]tcpflow.Tuple, n)
	for i := range out {
		out[i] = tcpflow.Tuple{
			Local:  netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 1, byte(i + 1)}), uint16(40000+i)),
			Remote: testConn.Remote,
		}
	}
	return out
}

func TestBookEvictsLeastRecentlyUpdated(t *testing.T) {
	b := NewBook(BookOptions{MaxFlows: 3})
	conns := testConns(5)
	add := func(c tcpflow.Tuple, seq uint32) { b.Add(netlog.Record{Conn: c, Seq: seq, Payload: []byte("data")}) }
	add(conns[0], 0)
	add(conns[1], 0)
	add(conns[2], 0)
	add(conns[0], 4) // flow 0 updated last: flow 1 is now the least recently updated
	add(conns[3], 0)
	add(conns[4], 0)
	st := b.Stats()
	if st.Flows != 3 || st.Evictions != 2 || st.Pieces != 3 {
		t.Errorf("stats %+v; want 3 flows, 2 evictions, 3 pieces", st)
	}
	for i, kept := range []bool{true, false, false, true, true} {
		if _, ok := b.Received(conns[i], 0); ok != kept {
			t.Errorf("flow %d kept = %v, want %v", i, ok, kept)
		}
	}
}

func TestBookMaxPiecesPerFlow(t *testing.T) {
	const base = 2 * B
	stream := randomBytes(40, 10*B+100)
	b := NewBook(BookOptions{MaxPiecesPerFlow: 4})
	addAll(b, testConn, base, stream, []segment{{0, len(stream)}})
	all := piecesOf(base, stream)
	equalPieces(t, received(t, b, testConn, 0), all[len(all)-4:])
	if st := b.Stats(); st.Pieces != 4 || st.TrimmedPieces != uint64(len(all)-4) {
		t.Errorf("stats %+v", st)
	}
}

func TestBookMaxTotalPieces(t *testing.T) {
	b := NewBook(BookOptions{MaxTotalPieces: 10})
	conns := testConns(3)
	stream := randomBytes(41, 4*B)
	for _, c := range conns {
		addAll(b, c, 0, stream, []segment{{0, len(stream)}})
	}
	// 4 pieces each: the third flow pushes the total to 12, so the oldest flow goes.
	st := b.Stats()
	if st.Pieces != 8 || st.Flows != 2 || st.Evictions != 1 {
		t.Errorf("stats %+v; want 8 pieces in 2 flows", st)
	}
	if _, ok := b.Received(conns[0], 0); ok {
		t.Error("the least recently updated flow was kept")
	}
	// One flow is never evicted for its own size: MaxPiecesPerFlow is clamped to the total.
	b = NewBook(BookOptions{MaxTotalPieces: 3})
	addAll(b, testConn, 0, stream, []segment{{0, len(stream)}})
	if st := b.Stats(); st.Pieces != 3 || st.Flows != 1 {
		t.Errorf("one big flow: stats %+v", st)
	}
}

func TestBookSpanBound(t *testing.T) {
	// Holes far apart: the record of a flow never spans more than MaxSpan, so Validate accepts it.
	b := NewBook(BookOptions{MaxReorderBytes: 1})
	seq := uint32(100)
	for range 6 {
		b.Add(netlog.Record{Conn: testConn, Seq: seq, Payload: []byte("ab")})
		seq += 1 << 29 // a hole each time (the reorder buffer holds one byte at most)
	}
	r, _ := b.Received(testConn, 100)
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	// Kept: the pieces at 4*2^29+100 and 5*2^29+100; the one at 3*2^29+100 lies 2^30+2 behind the end.
	if st := b.Stats(); st.Holes != 5 || st.Pieces != 2 || st.TrimmedPieces != 4 {
		t.Errorf("stats %+v; want 5 holes, 2 pieces kept", st)
	}
}

func TestBookReusedFourTuple(t *testing.T) {
	b := NewBook(BookOptions{})
	b.Add(netlog.Record{Conn: testConn, Seq: 1000, Payload: []byte("old connection")})
	// A new connection on the same 4-tuple starts 3 GiB away: no TCP window reaches that far.
	newBase := uint32(1000 + 3<<30)
	b.Add(netlog.Record{Conn: testConn, Seq: newBase, Payload: []byte("new")})
	equalPieces(t, received(t, b, testConn, newBase), piecesOf(newBase, []byte("new")))
	if st := b.Stats(); st.Resets != 1 || st.Pieces != 1 {
		t.Errorf("stats %+v", st)
	}
}

func TestBookReceivedFrom(t *testing.T) {
	const base = 3*B + 10
	stream := randomBytes(50, 4*B) // pieces [3B+10, 4B) [4B, 5B) [5B, 6B) [6B, 7B) [7B, 7B+10)
	b := NewBook(BookOptions{})
	addAll(b, testConn, base, stream, []segment{{0, len(stream)}})
	all := piecesOf(base, stream)
	tests := []struct {
		from  uint32
		first int // index of the first piece returned
	}{
		{0, 0},
		{base - 5, 0},
		{base, 0},
		{4*B - 1, 0},
		{4 * B, 1},
		{5*B + 7, 2},
		{7*B + 9, 4},
		{7*B + 10, 5},
		{8 * B, 5},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.from), func(t *testing.T) {
			equalPieces(t, received(t, b, testConn, tt.from), all[tt.first:])
		})
	}
	if _, ok := b.Received(testConns(1)[0], 0); ok {
		t.Error("an unknown flow was reported known")
	}
	b.Forget(testConn)
	if _, ok := b.Received(testConn, 0); ok {
		t.Error("a forgotten flow was reported known")
	}
	if st := b.Stats(); st.Flows != 0 || st.Pieces != 0 {
		t.Errorf("after Forget: %+v", st)
	}
}

// TestBookConcurrent is for the race detector: the recorder adds while restorers read.
func TestBookConcurrent(t *testing.T) {
	b := NewBook(BookOptions{MaxFlows: 4})
	conns := testConns(6)
	stream := randomBytes(60, 2*B)
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(i), 4))
			addAll(b, c, uint32(i)*B, stream, splitStream(r, len(stream)))
		})
		wg.Go(func() {
			for range 200 {
				if r, ok := b.Received(c, 0); ok {
					if err := r.Validate(); err != nil {
						t.Error(err)
						return
					}
				}
				b.Stats()
			}
		})
	}
	wg.Wait()
	// An evicted flow comes back with its next record, so evictions depend on the interleaving.
	if st := b.Stats(); st.Flows != 4 || st.Evictions < 2 {
		t.Errorf("stats %+v; want 4 flows, at least 2 evictions", st)
	}
}

// TestBookBoundsAreSharedByJobs: the flows and pieces of the Book are shared by every protected job of the
// host, so at a bound the job holding the most pays, not the one that waited longest: a job that opens many
// short connections (or connects to itself) or receives a lot must not evict another job's idle flow, whose
// record a restored peer's check of re-sent bytes then lacks (the restored job is killed).
func TestBookBoundsAreSharedByJobs(t *testing.T) {
	const victim, greedy = 2, 1
	add := func(b *Book, c tcpflow.Tuple, cg uint64, seq uint32, p []byte) {
		b.Add(netlog.Record{Conn: c, Seq: seq, CgroupID: cg, Payload: p})
	}
	t.Run("flows", func(t *testing.T) {
		b := NewBook(BookOptions{MaxFlows: 4})
		conns := testConns(20)
		add(b, conns[0], victim, 0, []byte("data"))
		for _, c := range conns[1:] {
			b.Add(netlog.Record{Conn: c, Seq: 100, CgroupID: greedy}) // a SYN of one short connection after another
		}
		if _, ok := b.Received(conns[0], 0); !ok {
			t.Fatal("another job's connections evicted the idle flow of a job holding one")
		}
		if st := b.Stats(); st.Flows != 4 || st.Evictions != 16 {
			t.Errorf("stats %+v; want 4 flows, 16 evictions", st)
		}
		// The greedy job keeps its most recently updated flows.
		for i, c := range conns[1:] {
			if _, ok := b.Received(c, 0); ok != (i >= 16) {
				t.Errorf("greedy flow %d kept = %v", i, ok)
			}
		}
	})
	t.Run("pieces", func(t *testing.T) {
		b := NewBook(BookOptions{MaxTotalPieces: 10})
		conns := testConns(4)
		stream := randomBytes(42, 4*B)
		add(b, conns[0], victim, 0, stream)
		for _, c := range conns[1:] {
			add(b, c, greedy, 0, stream) // 4 pieces each
		}
		equalPieces(t, received(t, b, conns[0], 0), piecesOf(0, stream))
		if st := b.Stats(); st.Pieces > 10 {
			t.Errorf("stats %+v: more pieces than the bound", st)
		}
		// One job with one flow over the bound keeps that flow's newest pieces, not another job's flow.
		b = NewBook(BookOptions{MaxTotalPieces: 6})
		add(b, conns[0], victim, 0, stream[:2*B])
		add(b, conns[1], greedy, 0, stream)
		add(b, conns[1], greedy, 4*B, stream)
		equalPieces(t, received(t, b, conns[0], 0), piecesOf(0, stream[:2*B]))
		if got := received(t, b, conns[1], 0); len(got) != 4 || got[3].End() != 8*B {
			t.Errorf("greedy flow: %v; want its newest 4 pieces", got)
		}
	})
}

// TestBookNewConnOfAnotherJob: a record of another cgroup on a flow's 4-tuple is another socket's (a
// socket's cgroup is fixed when it is made): a new connection on a reused 4-tuple, whose bytes must not be
// taken for duplicates of the old connection's, nor the old connection's pieces served as its record.
func TestBookNewConnOfAnotherJob(t *testing.T) {
	const first, second = 2, 1
	old, reused := randomBytes(1, 2*B), randomBytes(2, B)
	b := NewBook(BookOptions{})
	b.Add(netlog.Record{Conn: testConn, Seq: 0, CgroupID: first, Payload: old})
	// The other job's connection has no start record (the consumer was gone at its SYN): its bytes land
	// within a window of the old connection's.
	b.Add(netlog.Record{Conn: testConn, Seq: B, CgroupID: second, Payload: reused})
	equalPieces(t, received(t, b, testConn, B), piecesOf(B, reused))
}

// TestBookNewConnBeforeTheRecordedStart: a new connection on a reused 4-tuple of the same job, whose SYN
// the tap missed (its consumer was gone), with an ISN a little behind the old connection's recorded first
// byte. Its bytes are no retransmission of the old one's (nothing of a connection precedes its SYN): they
// must not be dropped as duplicates, nor the old connection's pieces served as its record, which made the
// check of its restored sender's re-sent bytes call the program nondeterministic.
func TestBookNewConnBeforeTheRecordedStart(t *testing.T) {
	const start, newStart = 100*B + 7, 100*B + 7 - 10000
	old, reused := randomBytes(3, 3*B), randomBytes(4, 2*B)
	b := NewBook(BookOptions{})
	b.Add(netlog.Record{Conn: testConn, Seq: start}) // the old connection's SYN
	addAll(b, testConn, start, old, []segment{{0, len(old)}})
	addAll(b, testConn, newStart, reused, []segment{{0, 5000}, {5000, len(reused) - 5000}})
	equalPieces(t, received(t, b, testConn, newStart), piecesOf(newStart, reused))
	from := uint32(newStart + B + 100)
	n, err := Verify(Received{Conn: testConn, Pieces: received(t, b, testConn, from)}, from, newStart+uint32(len(reused)),
		Prefix{Known: true, Len: from - BlockStart(from), CRC: crcOf(newStart, reused, BlockStart(from), from)}, resentOf(newStart, reused))
	if err != nil || n != uint64(newStart+uint32(len(reused))-from) {
		t.Errorf("Verify of the new connection's re-sent bytes: %d, %v", n, err)
	}

	// Retransmissions of the old connection's bytes after its start stay duplicates, and so does a
	// keepalive's garbage byte just before the first (sent at snd_una-1 before any data).
	b = NewBook(BookOptions{})
	b.Add(netlog.Record{Conn: testConn, Seq: start})
	b.Add(netlog.Record{Conn: testConn, Seq: start - 1, Payload: []byte{0}})
	addAll(b, testConn, start, old, []segment{{0, len(old)}, {0, 3000}, {B, 100}})
	equalPieces(t, received(t, b, testConn, start), piecesOf(start, old))
	if st := b.Stats(); st.Resets != 0 || st.DuplicateBytes != 3101 {
		t.Errorf("stats %+v", st)
	}
}
