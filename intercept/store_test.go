package intercept

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/tcpflow"
)

// snap is a snapshot of job "j" on node "n1" whose connections A and B had consumed up to a and b.
func snap(id string, a, b uint32) *ckpt.Manifest {
	return &ckpt.Manifest{ID: id, Job: "j", Node: "n1", Info: ckpt.Info{Conns: []ckpt.Conn{
		{Tuple: connA, InqSeq: a + 5, InqLen: 5},
		{Tuple: connB, InqSeq: b, InqLen: 0},
	}}}
}

func TestStoreSince(t *testing.T) {
	d := func(c, end uint32) Det {
		if c == 0 {
			return Det{Conn: connA, End: end, Len: 1}
		}
		return Det{Conn: connB, End: end, Len: 1}
	}
	stream := []Det{d(0, 10), d(1, 10), d(0, 20), d(1, 20), d(0, 30)}
	connectingStream := []Det{d(0, 10), d(1, 0xffffff00), d(0, 20)}
	for _, tc := range []struct {
		name    string
		batches []Batch
		m       *ckpt.Manifest
		want    []Det
		err     string
	}{
		{"after an anchor", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream}}, snap("s", 20, 10), stream[3:], ""},
		{"every one consumed after", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream}}, snap("s", 0, 0), stream, ""},
		{"nothing after", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream}}, snap("s", 30, 20), []Det{}, ""},
		{"in two batches", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream[:2]}, {Job: "j", Stream: 1, First: 2, Dets: stream[2:]}}, snap("s", 20, 10), stream[3:], ""},
		// A batch sent again (its answer was not seen) adds only what the record lacks.
		{"sent again in part", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream[:3]}, {Job: "j", Stream: 1, First: 1, Dets: stream[1:]}}, snap("s", 0, 0), stream, ""},
		{"sent again whole", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream}, {Job: "j", Stream: 1, First: 2, Dets: stream[2:4]}}, snap("s", 0, 0), stream, ""},
		{"a hole starts over", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream[:2]}, {Job: "j", Stream: 1, First: 3, Dets: stream[3:]}}, snap("s", 10, 0), nil, "none is from before"},
		{"hole, anchor after it", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream[:2]}, {Job: "j", Stream: 1, First: 3, Dets: stream[3:]}}, snap("s", 20, 20), stream[4:], ""},
		{"mid-stream attach", []Batch{{Job: "j", Stream: 2, First: 0, FromStart: false, Dets: stream}}, snap("s", 0, 0), nil, "none is from before"},
		{"restored from another snapshot", []Batch{{Job: "j", Stream: 2, FromStart: true, Base: "old", Dets: stream}}, snap("s", 0, 0), nil, "none is from before"},
		{"restored from this snapshot", []Batch{{Job: "j", Stream: 2, FromStart: true, Base: "s", Dets: stream}}, snap("s", 0, 0), stream, ""},
		{"new stream replaces", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: stream}, {Job: "j", Stream: 2, FromStart: false, Dets: stream[:1]}}, snap("s", 0, 0), nil, "none is from before"},
		{"other node", nil, snap("s", 0, 0), nil, "no determinants"},
		// A socket still connecting at the dump (InqSeq the kernel's 0) anchors nothing: its stream's
		// sequence numbers are unrelated to 0, and one "before" 0 would cut the record after it.
		{"a connect pending at the dump", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: connectingStream}},
			&ckpt.Manifest{ID: "s", Job: "j", Node: "n1", Info: ckpt.Info{Conns: []ckpt.Conn{
				{Tuple: connA, InqSeq: 15, InqLen: 5}, {Tuple: connB, Connecting: true}}}},
			connectingStream[1:], ""},
		// A call that found nothing at the dump's copied_seq may come after the dump: not an anchor.
		{"found nothing at the dump's copied_seq", []Batch{{Job: "j", Stream: 1, FromStart: true, Dets: append(slices.Clone(stream[:4]), Det{Conn: connA, End: 20}, stream[4])}}, snap("s", 20, 10), []Det{stream[3], {Conn: connA, End: 20}, stream[4]}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStore(0, 0)
			for _, b := range tc.batches {
				s.Add("n1", b)
			}
			s.Add("n2", Batch{Job: "j", Stream: 9, FromStart: true, Dets: stream}) // never read for n1's snapshots
			got, err := s.Since(tc.m)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tc.want) || (len(got) > 0 && !reflect.DeepEqual(got, tc.want)) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestStoreTrimKeepsAnchor(t *testing.T) {
	s := NewStore(0, 0)
	dets := []Det{{Conn: connA, End: 10, Len: 10}, {Conn: connA, End: 20, Len: 10}, {Conn: connA, End: 30, Len: 10}, {Conn: connA, End: 40, Len: 10}}
	s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: dets})
	s.Trim(snap("s2", 30, 0))
	if n := s.Len("j", "n1"); n != 2 {
		t.Fatalf("%d determinants kept, want 2 (the anchor and the one after)", n)
	}
	got, err := s.Since(snap("s2", 30, 0))
	if err != nil || len(got) != 1 || got[0] != dets[3] {
		t.Fatalf("since the trimmed snapshot: %v, %v", got, err)
	}
	// An older snapshot can no longer be replayed: its determinants are gone, and Since says so.
	if _, err := s.Since(snap("s1", 10, 0)); err == nil {
		t.Fatal("a replay from before the trim was allowed")
	}
	// The stream goes on after the trim.
	s.Add("n1", Batch{Job: "j", Stream: 1, First: 4, Dets: []Det{{Conn: connA, End: 50, Len: 10}}})
	if got, err := s.Since(snap("s2", 30, 0)); err != nil || len(got) != 2 {
		t.Fatalf("after more: %v, %v", got, err)
	}
}

func TestStoreBounded(t *testing.T) {
	s := NewStore(3, 0)
	var dets []Det
	for i := range 5 {
		dets = append(dets, Det{Conn: connA, End: uint32(10 * (i + 1)), Len: 10})
	}
	s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: dets})
	if n := s.Len("j", "n1"); n != 3 {
		t.Fatalf("%d kept, want 3", n)
	}
	if _, err := s.Since(snap("s", 0, 0)); err == nil {
		t.Fatal("a replay past dropped determinants was allowed")
	}
	if got, err := s.Since(snap("s", 30, 0)); err != nil || len(got) != 2 {
		t.Fatalf("since a kept anchor: %v, %v", got, err)
	}
}

// TestStoreBoundedInAll: beyond its bound in all, a store forgets whole the records that received nothing
// for longest (a member sending batches of made-up jobs grew a protector's memory without bound); a record
// being added to is kept, and a trimmed or dropped record frees its share.
func TestStoreBoundedInAll(t *testing.T) {
	s := NewStore(0, 10)
	add := func(job string, first uint64, n int) {
		var dets []Det
		for i := range n {
			dets = append(dets, Det{Conn: connA, End: uint32(10 * (int(first) + i + 1)), Len: 10})
		}
		s.Add("n1", Batch{Job: job, Stream: 1, First: first, FromStart: first == 0, Dets: dets})
	}
	add("a", 0, 4)
	add("b", 0, 4)
	add("a", 4, 1) // a was added to after b
	add("c", 0, 4) // 13 in all: b, untouched longest, goes
	if a, b, c := s.Len("a", "n1"), s.Len("b", "n1"), s.Len("c", "n1"); a != 5 || b != 0 || c != 4 {
		t.Fatalf("kept a %d, b %d, c %d; want 5, 0 (forgotten), 4", a, b, c)
	}
	if _, err := s.Since(&ckpt.Manifest{Job: "b", Node: "n1"}); err == nil {
		t.Error("a forgotten record still answers")
	}
	s.Drop("a", "n2") // another host's record of a: none
	if a := s.Len("a", "n1"); a != 5 {
		t.Fatalf("after dropping n2's record of a: kept %d of n1's, want 5", a)
	}
	s.Drop("a", "n1")
	add("d", 0, 6) // 10 in all with a gone: nothing else goes
	if c, d := s.Len("c", "n1"), s.Len("d", "n1"); c != 4 || d != 6 {
		t.Errorf("after a was dropped: kept c %d, d %d; want 4 and 6", c, d)
	}
	add("e", 0, 12) // alone over the bound: kept (maxPerJob bounds it), every other record goes
	if c, d, e := s.Len("c", "n1"), s.Len("d", "n1"), s.Len("e", "n1"); c != 0 || d != 0 || e != 12 {
		t.Errorf("after a record larger than the bound: c %d, d %d, e %d; want 0, 0, 12", c, d, e)
	}
}

// TestStoreAtBoundMovesLittle: a record at its bound drops its oldest determinants for every batch without
// moving the ones it keeps, except now and then to the front of its array. The old code moved the whole
// record for every batch (8.9 ms a batch of 100 at the default bound).
func TestStoreAtBoundMovesLittle(t *testing.T) {
	const bound, batch, adds = 1000, 10, 2000
	s := NewStore(bound, 0)
	var first uint64
	add := func() {
		dets := make([]Det, batch)
		for i := range dets {
			dets[i] = Det{Conn: connA, End: uint32(first) + uint32(i) + 1, Len: 1}
		}
		s.Add("n1", Batch{Job: "j", Stream: 1, First: first, FromStart: first == 0, Dets: dets})
		first += batch
	}
	for first < bound {
		add()
	}
	rec := func() []keptDet { return s.recs[storeKey{"j", "n1"}].kept() }
	moves := 0
	for range adds {
		oldest := &rec()[batch] // the oldest determinant kept once the next batch is in
		add()
		if &rec()[0] != oldest {
			moves++
		}
	}
	// Each move copies the bound's determinants: at most one for each quarter of the bound added.
	if most := adds*batch/(bound/4) + 1; moves > most {
		t.Errorf("the kept determinants moved %d times in %d batches, want at most %d", moves, adds, most)
	}
	got := rec()
	if len(got) != bound || got[0].end != uint32(first)-bound+1 || got[bound-1].end != uint32(first) {
		t.Errorf("kept %d determinants, ends %d..%d, want %d, %d..%d", len(got), got[0].end, got[len(got)-1].end, bound, first-bound+1, first)
	}
	if n := s.Len("j", "n1"); n != bound {
		t.Errorf("Len %d, want %d", n, bound)
	}
}

// TestStoreConnTable: a record keeps each determinant's connection as an index into its table. Since gives
// back every determinant as it was added, and the table of a job that opens connection after connection
// stays near the determinants kept instead of growing for good.
func TestStoreConnTable(t *testing.T) {
	const bound, conns = 100, 5000
	s := NewStore(bound, 0)
	var want []Det
	for i := range conns {
		c := conn("10.9.0.1:5000", fmt.Sprintf("10.9.0.2:%d", 10000+i))
		// Two calls on the new connection between calls on A, whose copied_seq anchors the replay.
		dets := []Det{
			{Conn: c, End: 100, Len: 100, Thread: uint32(i), Proc: 7, Pos: uint64(i)},
			{Conn: connA, End: uint32(10 * (i + 1)), Len: 10, Thread: 1, Proc: 7, Pos: uint64(i)},
			{Conn: c, End: 150, Len: 50, Thread: uint32(i), Proc: 7, Pos: uint64(i) + 1},
		}
		s.Add("n1", Batch{Job: "j", Stream: 1, First: uint64(3 * i), FromStart: i == 0, Dets: dets})
		want = append(want, dets...)
	}
	r := s.recs[storeKey{"j", "n1"}]
	if n := len(r.conns); n > 4*bound {
		t.Errorf("the connection table holds %d connections for %d determinants kept", n, len(r.kept()))
	}
	// A snapshot taken after A's last-but-one call: Since is the last four determinants.
	got, err := s.Since(snap("s", 10*(conns-1), 0))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want[len(want)-4:]) {
		t.Errorf("Since gave\n%v\nwant\n%v", got, want[len(want)-4:])
	}
}

// TestStoreBoundsRecordsOfEmptyBatches: a member's batches of made-up jobs that carry no determinant each
// made a record that counted nothing against the bound in all, so none was ever forgotten: the protector's
// map grew by one record per batch (OpDeterminantStream3 takes a batch in about 100 bytes of the wire).
func TestStoreBoundsRecordsOfEmptyBatches(t *testing.T) {
	s := NewStore(0, 0)
	empty, err := Pack(nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range DefaultMaxRecords + 100 {
		dets, err := Unpack(empty) // what the wire gives serveDeterminants
		if err != nil {
			t.Fatal(err)
		}
		s.Add("n1", Batch{Job: fmt.Sprintf("made-up-%08x", i), Stream: 1, FromStart: true, Dets: dets})
	}
	s.mu.Lock()
	n := len(s.recs)
	s.mu.Unlock()
	if n > DefaultMaxRecords {
		t.Fatalf("%d records kept of batches without determinants, more than the %d a store keeps", n, DefaultMaxRecords)
	}
	// The newest record is the one kept: a job that just started may ship nothing yet.
	if _, err := s.Since(&ckpt.Manifest{Job: fmt.Sprintf("made-up-%08x", DefaultMaxRecords+99), Node: "n1"}); err != nil {
		t.Errorf("the newest record was forgotten: %v", err)
	}
}

// fourConnSnap is snapshot "s" of job j on n1 whose connections A, B, C and D (returned) had consumed up
// to 1000, 500, 300 and 700 at its dump.
func fourConnSnap() (connC, connD tcpflow.Tuple, m *ckpt.Manifest) {
	connC = conn("10.9.0.1:5000", "10.9.0.4:40002")
	connD = conn("10.9.0.1:5000", "10.9.0.5:40003")
	m = &ckpt.Manifest{ID: "s", Job: "j", Node: "n1", Info: ckpt.Info{Conns: []ckpt.Conn{
		{Tuple: connA, InqSeq: 1000}, {Tuple: connB, InqSeq: 500}, {Tuple: connC, InqSeq: 300}, {Tuple: connD, InqSeq: 700},
	}}}
	return connC, connD, m
}

// TestStoreSinceReusedFourTuple: a connection the snapshot holds closes after the dump and a new one takes
// its 4-tuple. The new one's sequence numbers have nothing to do with the snapshot's, and a call on it that
// consumed "no further" than the dump's copied_seq of the old one is no proof of coming before the dump.
// It was taken for one: the record was cut after it, and the calls of the other connections between the
// dump and it went missing from what the replay was given, with no error (here B's, which the gate would
// then have delivered last, after C's and D's, where the original read it first).
func TestStoreSinceReusedFourTuple(t *testing.T) {
	connC, connD, m := fourConnSnap()
	dets := []Det{
		{Conn: connA, End: 990, Len: 10}, // before the dump: an anchor
		// The dump. Then:
		{Conn: connB, End: 510, Len: 10},
		{Conn: connA, End: 90, Len: 10}, // a new connection on A's 4-tuple (A closed after the dump)
		{Conn: connC, End: 310, Len: 10},
		{Conn: connD, End: 710, Len: 10},
	}
	s := NewStore(0, 0)
	s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: dets})
	got, err := s.Since(m)
	if err != nil {
		return // refused: never wrong
	}
	if !reflect.DeepEqual(got, dets[1:]) {
		t.Fatalf("the determinants since the snapshot:\n%v\nwant every one after the dump:\n%v", got, dets[1:])
	}
}

// TestStoreTrimKeepsReusedFourTupleEvidence: as TestStoreSinceReusedFourTuple, but the snapshot's replica
// arrived (Trim) after the record already held calls past its dump. Trim dropped A's call before the dump,
// the one proof that the later call on A's 4-tuple is of a new connection: the same Since then took that
// call for its anchor and cut B's call after the dump off the replay, with no error. A Trim from a
// snapshot that holds no A drops the proof too, and a later one that does hold A must not be fooled.
func TestStoreTrimKeepsReusedFourTupleEvidence(t *testing.T) {
	connC, connD, m := fourConnSnap()
	dets := []Det{
		{Conn: connA, End: 990, Len: 10},
		{Conn: connB, End: 490, Len: 10}, // the last call before the dump: the anchor Trim keeps
		// The dump. Then:
		{Conn: connB, End: 510, Len: 10},
		{Conn: connA, End: 90, Len: 10}, // a new connection on A's 4-tuple (A closed after the dump)
		{Conn: connC, End: 310, Len: 10},
		{Conn: connD, End: 710, Len: 10},
	}
	for _, tc := range []struct {
		name  string
		trims []*ckpt.Manifest
	}{
		{"trimmed by the snapshot", []*ckpt.Manifest{m}},
		{"trimmed twice", []*ckpt.Manifest{m, m}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStore(0, 0)
			s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: dets})
			for _, tm := range tc.trims {
				s.Trim(tm)
			}
			got, err := s.Since(m)
			if err != nil {
				return // refused: never wrong
			}
			if !reflect.DeepEqual(got, dets[2:]) {
				t.Fatalf("the determinants since the snapshot:\n%v\nwant every one after the dump:\n%v", got, dets[2:])
			}
		})
	}
}

// TestStoreSinceReusedFourTupleAhead: as TestStoreSinceReusedFourTuple, but the new connection's sequence
// numbers start ahead of where the old one's last call ended (its ISN is unrelated to the old stream), so
// no call on it consumed from before that end. Its first call ended less than 2^31 after that end, yet
// "no further" than the dump's copied_seq (serial numbers: the old one consumed past it after the dump,
// here 20 bytes, and the new one lands within that of the old end plus 2^31): it was taken for the last call
// before the dump. B's call and A's after the dump were cut off, and the gate accepted what was left (C's and
// D's calls) with no error, delivering B's and A's bytes last where the original read them first.
func TestStoreSinceReusedFourTupleAhead(t *testing.T) {
	connC, connD, m := fourConnSnap()
	const isn = 1020 + 1<<31 - 5 // ahead of A's last end (1020) by less than 2^31
	dets := []Det{
		{Conn: connA, End: 1000, Len: 10},
		{Conn: connB, End: 500, Len: 10}, // the last call before the dump: the anchor Trim keeps
		// The dump. Then:
		{Conn: connB, End: 510, Len: 10},
		{Conn: connA, End: 1010, Len: 10},
		{Conn: connA, End: 1020, Len: 10},
		{Conn: connA, End: isn + 10, Len: 10}, // a new connection on A's 4-tuple (A closed after the dump)
		{Conn: connC, End: 310, Len: 10},
		{Conn: connD, End: 710, Len: 10},
	}
	for _, tc := range []struct {
		name  string
		trims []*ckpt.Manifest
	}{
		{"untrimmed", nil},
		{"trimmed by the snapshot", []*ckpt.Manifest{m}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStore(0, 0)
			s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: dets})
			for _, tm := range tc.trims {
				s.Trim(tm)
			}
			got, err := s.Since(m)
			if err != nil {
				t.Logf("refused: %v", err)
				return // refused: never wrong
			}
			if !reflect.DeepEqual(got, dets[2:]) {
				sources := map[tcpflow.Tuple]Source{}
				for _, c := range m.Conns {
					sources[c.Tuple] = Source{Seq: c.InqSeq, Data: make([]byte, 100)}
				}
				_, gerr := NewGate(got, sources)
				t.Fatalf("the determinants since the snapshot:\n%v\nwant every one after the dump:\n%v\n(a gate of them: %v)", got, dets[2:], gerr)
			}
		})
	}
}

// TestGateConsumedPastHalfTheSpace: a connection of the snapshot consumed 2^31 bytes or more after the dump.
// Its later calls end "no further" than the dump's copied_seq in serial numbers, though consumption only
// grows, and nothing in a record tells them from calls 2 GiB before the dump: Since took the first of them
// for the last call before the dump, and cut A's calls and B's off what it gave. The gate accepted what was
// left (C's and D's calls) with no error, and delivered A's and B's bytes last, where the original read them
// first. Only the gate knows how much its sources hold: it refuses.
func TestGateConsumedPastHalfTheSpace(t *testing.T) {
	if testing.Short() {
		t.Skip("maps 2 GiB of address space (never touched)")
	}
	connC, connD, m := fourConnSnap()
	dets := []Det{
		{Conn: connA, End: 1000, Len: 10}, // before the dump: the anchor
		// The dump. Then:
		{Conn: connB, End: 510, Len: 10},
		{Conn: connA, End: 1000 + 1<<30, Len: 1 << 30},
		{Conn: connA, End: 1000 + 1<<31, Len: 1 << 30},
		{Conn: connA, End: 1000 + 1<<31 + 10, Len: 10},
		{Conn: connC, End: 310, Len: 10},
		{Conn: connD, End: 710, Len: 10},
	}
	s := NewStore(0, 0)
	s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: dets})
	got, err := s.Since(m)
	if err != nil {
		return // refused: never wrong
	}
	if reflect.DeepEqual(got, dets[1:]) {
		return
	}
	sources := map[tcpflow.Tuple]Source{
		connA: {Seq: 1000, Data: make([]byte, 1<<31+100)}, // never touched: only address space
		connB: {Seq: 500, Data: make([]byte, 100)},
		connC: {Seq: 300, Data: make([]byte, 100)},
		connD: {Seq: 700, Data: make([]byte, 100)},
	}
	if _, err := NewGate(got, sources); err == nil || !strings.Contains(err.Error(), "2 GiB or more") {
		t.Fatalf("a gate of the determinants Since gave\n%v\n(want every one after the dump:\n%v)\nerr %v, want a refusal", got, dets[1:], err)
	}
}

// TestStoreSinceOnSpareThatFailed: job j, snapshotted on n1 (s), was restored from s on spare n2, which
// replayed n1's determinants and read on, then failed before a snapshot of its own: s is restored again.
// n2's record, which starts at s, is the order to replay once it has gone past n1's; Since(s) read only
// n1's, and n2's reads after it were never replayed (the peers had taken in what n2 sent after them).
func TestStoreSinceOnSpareThatFailed(t *testing.T) {
	a := func(end uint32) Det { return Det{Conn: connA, End: end, Len: 1} }
	b := func(end uint32) Det { return Det{Conn: connB, End: end, Len: 1} }
	n1 := []Det{a(10), b(10), a(20), b(20)} // s was dumped after a(10): n1's since s are n1[1:]
	for _, tc := range []struct {
		name string
		n2   *Batch // nil: n2 shipped nothing here
		want []Det
		err  string
	}{
		{"went past n1's", &Batch{Job: "j", Stream: 5, FromStart: true, Base: "s", Dets: []Det{b(10), a(20), b(20), a(30), b(30)}},
			[]Det{b(10), a(20), b(20), a(30), b(30)}, ""},
		{"still replaying n1's", &Batch{Job: "j", Stream: 5, FromStart: true, Base: "s", Dets: []Det{b(10), a(20)}}, n1[1:], ""},
		{"shipped nothing here", nil, n1[1:], ""},
		{"gone apart", &Batch{Job: "j", Stream: 5, FromStart: true, Base: "s", Dets: []Det{b(10), b(20), b(30)}}, nil, "went apart"},
		{"restored from another snapshot", &Batch{Job: "j", Stream: 5, FromStart: true, Base: "other", Dets: []Det{b(10)}}, nil, "not of that copy"},
		{"attached mid-stream", &Batch{Job: "j", Stream: 5, Base: "s", Dets: []Det{b(10)}}, nil, "not of that copy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStore(0, 0)
			s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: n1})
			if tc.n2 != nil {
				s.Add("n2", *tc.n2)
			}
			m := snap("s", 10, 0)
			got, err := s.SinceOn(m, "n2")
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			if own, err := s.SinceOn(m, "n1"); err != nil || !reflect.DeepEqual(own, n1[1:]) {
				t.Fatalf("on the snapshot's own host: %v, %v; want %v", own, err, n1[1:])
			}
		})
	}
}

// posDet is a read of thread 1 of process 1 on c, consumed up to end, after its pos-th readiness call.
func posDet(c tcpflow.Tuple, end uint32, pos uint64) Det {
	return Det{Conn: c, End: end, Len: 10, Thread: 1, Proc: 1, Pos: pos}
}

// gateStops is where a gate of dets with positions (polls: the dump's counts) delivers A's bytes from 10 and
// B's from 0: each stop as "polls/after" and the reads delivered there ("A20": A's up to 20).
func gateStops(t *testing.T, dets []Det, polls map[uint32]uint64) []string {
	t.Helper()
	g, err := NewGate(dets, map[tcpflow.Tuple]Source{connA: {Seq: 10, Data: make([]byte, 30)}, connB: {Seq: 0, Data: make([]byte, 30)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.UsePositions(polls); err != nil {
		t.Fatalf("positions refused: %v", err)
	}
	var got []string
	for _, p := range g.plans {
		for _, pt := range p.points {
			s := fmt.Sprintf("%d/%d", pt.polls, pt.after)
			for _, in := range pt.inject {
				s += fmt.Sprintf(" %s%d", map[tcpflow.Tuple]string{connA: "A", connB: "B"}[in.conn], in.end)
			}
			got = append(got, s)
		}
	}
	return got
}

// TestStoreSinceOnSparePositions: job j, snapshotted on n1 (s) after its thread had made polls readiness
// calls, was restored from s on spare n2, whose recorder counted the thread's readiness calls from 0 at the
// restore; n2 read past n1's record and failed before a snapshot of its own: s is restored again with
// receive positions, from n2's record. The gate takes s's count at the dump off every Pos: n2's returned
// as recorded had it taken off too, and positions were refused (polls 100) or, worse, the reads were
// delivered at the wrong readiness calls with no error (polls 1).
func TestStoreSinceOnSparePositions(t *testing.T) {
	for _, polls := range []uint64{100, 1} {
		for _, tc := range []struct {
			name string
			n2   []Det    // Pos counted from n2's restore
			want []string // each read at the exit of the readiness call before the one that found it, from the dump
		}{
			// n2's thread read B after its first readiness call since the restore, A after its second...
			{"went past n1's", []Det{posDet(connB, 10, 1), posDet(connA, 20, 2), posDet(connB, 20, 3), posDet(connA, 30, 4)},
				[]string{"0/-1 B10", "1/-1 A20", "2/-1 B20", "3/-1 A30"}},
			{"still replaying n1's", []Det{posDet(connB, 10, 1)}, []string{"0/-1 B10", "1/-1 A20"}},
		} {
			t.Run(fmt.Sprintf("%s, %d readiness calls at the dump", tc.name, polls), func(t *testing.T) {
				s := NewStore(0, 0)
				// n1: A up to 10 before the dump, then B and A one readiness call apart, as n2 replayed them.
				s.Add("n1", Batch{Job: "j", Stream: 1, FromStart: true, Dets: []Det{posDet(connA, 10, polls), posDet(connB, 10, polls+1), posDet(connA, 20, polls+2)}})
				s.Add("n2", Batch{Job: "j", Stream: 5, FromStart: true, Base: "s", Dets: tc.n2})
				m := snap("s", 10, 0)
				m.Positions, m.Polls = true, map[uint32]uint64{1: polls}
				dets, err := s.SinceOn(m, "n2")
				if err != nil {
					t.Fatal(err)
				}
				if got := gateStops(t, dets, m.Polls); !slices.Equal(got, tc.want) {
					t.Fatalf("stops %q, want %q", got, tc.want)
				}
			})
		}
	}
}

// TestStoreSinceRestoredHerePositions: job j, snapshotted on n1 (s) after its thread had made polls
// readiness calls, was restored from s on n1 itself (a rollback, a manual restore), whose recorder counted
// the thread's readiness calls from 0 at that restore; the copy read on and n1 failed before a snapshot of
// its own: s is restored on a spare with receive positions, from n1's record, the copy's (Since: it began
// with the copy, restored from s). The gate takes s's count at the dump off every Pos, as it must off those
// of s's own run: the copy's, returned as recorded, had it taken off too, and positions were refused
// (polls 100) or the reads were delivered at the wrong readiness calls with no error (polls 1).
func TestStoreSinceRestoredHerePositions(t *testing.T) {
	for _, polls := range []uint64{100, 1} {
		t.Run(fmt.Sprintf("%d readiness calls at the dump", polls), func(t *testing.T) {
			s := NewStore(0, 0)
			// The copy's thread read B after its first readiness call since the restore, A after its second...
			s.Add("n1", Batch{Job: "j", Stream: 5, FromStart: true, Base: "s", Dets: []Det{posDet(connB, 10, 1), posDet(connA, 20, 2), posDet(connB, 20, 3), posDet(connA, 30, 4)}})
			m := snap("s", 10, 0)
			m.Positions, m.Polls = true, map[uint32]uint64{1: polls}
			for _, ran := range []string{"", "n1"} {
				dets, err := s.SinceOn(m, ran)
				if err != nil {
					t.Fatal(err)
				}
				got := gateStops(t, dets, m.Polls)
				if want := []string{"0/-1 B10", "1/-1 A20", "2/-1 B20", "3/-1 A30"}; !slices.Equal(got, want) {
					t.Fatalf("ran %q: stops %q, want %q", ran, got, want)
				}
			}
		})
	}
}
