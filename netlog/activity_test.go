package netlog

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestActivity checks what a store reports about its sender: the time of the last offered
// segment, whatever became of its bytes, and the last cgroup a record named.
func TestActivity(t *testing.T) {
	p := testStream(3, 4000)
	tests := []struct {
		name       string
		rec        Record
		wantMoved  bool   // LastAppend advances
		wantCgroup uint64 // CgroupID afterwards
		wantKtime  uint64 // LastKtimeNs afterwards
	}{
		{"first bytes", Record{Seq: 1000, Payload: p[:1000], CgroupID: 7, KtimeNs: 100}, true, 7, 100},
		{"next bytes, another cgroup", Record{Seq: 2000, Payload: p[1000:2000], CgroupID: 9, KtimeNs: 200}, true, 9, 200},
		{"record without a cgroup or time keeps the last ones", Record{Seq: 3000, Payload: p[2000:3000]}, true, 9, 200},
		{"retransmission of logged bytes", Record{Seq: 1500, Payload: p[500:1500], CgroupID: 9, KtimeNs: 300}, true, 9, 300},
		{"an older timestamp does not lower it", Record{Seq: 3000, Payload: p[2000:2500], CgroupID: 9, KtimeNs: 250}, true, 9, 300},
		{"bytes below the trim point", Record{Seq: 1000, Payload: p[:100], CgroupID: 9, KtimeNs: 400}, true, 9, 400},
		{"pure ACK", Record{Seq: 4000, CgroupID: 11, KtimeNs: 500}, false, 9, 400},
	}
	l := newTestLog(t, Options{SlabSize: 1024})
	c := testConn(1)
	if _, err := l.Activity(c); !errors.Is(err, ErrUnknownConn) {
		t.Fatalf("activity of an unknown connection: %v", err)
	}
	var prev time.Time
	for i, tc := range tests {
		if i == 5 {
			if _, err := l.Trim(c, 1200); err != nil {
				t.Fatal(err)
			}
		}
		before := time.Now()
		rec := tc.rec
		rec.Conn = c
		if err := l.Append(rec); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		a, err := l.Activity(c)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if moved := a.LastAppend != prev; moved != tc.wantMoved {
			t.Errorf("%s: LastAppend %v -> %v, want moved=%v", tc.name, prev, a.LastAppend, tc.wantMoved)
		}
		if tc.wantMoved && (a.LastAppend.Before(before) || a.LastAppend.After(time.Now())) {
			t.Errorf("%s: LastAppend %v is not the time of the append (after %v)", tc.name, a.LastAppend, before)
		}
		if a.CgroupID != tc.wantCgroup || a.LastKtimeNs != tc.wantKtime {
			t.Errorf("%s: CgroupID %d, LastKtimeNs %d; want %d, %d", tc.name, a.CgroupID, a.LastKtimeNs, tc.wantCgroup, tc.wantKtime)
		}
		prev = a.LastAppend
	}
}

// TestRemoveIdle checks that a connection is removed only if nothing was offered since the
// caller looked, that its memory goes, and that later bytes start a new store.
func TestRemoveIdle(t *testing.T) {
	p := testStream(4, 10000)
	tests := []struct {
		name        string
		appendAfter bool // a segment arrives between Activity and RemoveIdle
		wantRemoved bool
	}{
		{"idle since the look", false, true},
		{"sent again since the look", true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := newTestLog(t, Options{SlabSize: 1024, PoolSlabs: -1}) // no pool: freed slabs leave the meter
			c, other := testConn(1), testConn(2)
			for _, conn := range []tcpflow.Tuple{c, other} {
				if err := l.Append(Record{Conn: conn, Seq: 100, Payload: p[:8000], CgroupID: 5}); err != nil {
					t.Fatal(err)
				}
			}
			a, err := l.Activity(c)
			if err != nil {
				t.Fatal(err)
			}
			if tc.appendAfter {
				for !time.Now().After(a.LastAppend) { // the clock must tick for the test to mean anything
				}
				if err := l.Append(Record{Conn: c, Seq: 8100, Payload: p[8000:], CgroupID: 5}); err != nil {
					t.Fatal(err)
				}
			}
			removed, freed, err := l.RemoveIdle(c, a.LastAppend)
			if err != nil || removed != tc.wantRemoved {
				t.Fatalf("RemoveIdle: removed %v, %v; want removed %v", removed, err, tc.wantRemoved)
			}
			st := l.Stats()
			if !tc.wantRemoved {
				if st.Conns != 2 || st.RetainedBytes != 8000+10000 || freed != (Stats{}) {
					t.Fatalf("kept connection: log %+v, freed %+v", st, freed)
				}
				return
			}
			if freed.RetainedBytes != 8000 || freed.RAMBytes == 0 {
				t.Errorf("freed %+v, want the connection's 8000 bytes", freed)
			}
			if st.Conns != 1 || st.RetainedBytes != 8000 || st.RAMBytes != freed.RAMBytes {
				t.Errorf("after removal the log holds %+v; want only the other connection (%d bytes of RAM)", st, freed.RAMBytes)
			}
			if _, err := l.Bounds(c); !errors.Is(err, ErrUnknownConn) {
				t.Errorf("removed connection still has bounds: %v", err)
			}
			if removed, _, err := l.RemoveIdle(c, a.LastAppend); removed || !errors.Is(err, ErrUnknownConn) {
				t.Errorf("second RemoveIdle: %v, %v", removed, err)
			}
			// A late segment (still in the ring when the decision was taken) starts a new store.
			if err := l.Append(Record{Conn: c, Seq: 8100, Payload: p[8000:], CgroupID: 5}); err != nil {
				t.Fatal(err)
			}
			if b, err := l.Bounds(c); err != nil || b.Retained != 2000 {
				t.Errorf("late segment: bounds %+v, %v", b, err)
			}
		})
	}
	l := newTestLog(t, Options{})
	l.Close()
	if _, _, err := l.RemoveIdle(testConn(1), time.Now()); !errors.Is(err, ErrClosed) {
		t.Errorf("RemoveIdle on a closed log: %v", err)
	}
}

// TestRemoveIdleRacesAppender removes connections while the consumer appends to them through a
// store it holds (as capture's appender does): no append is lost to a removed store unless
// the removal came after it, and the memory meter ends where the surviving stores say. Run
// with -race.
func TestRemoveIdleRacesAppender(t *testing.T) {
	const conns, seg, rounds = 4, 512, 400
	l := newTestLog(t, Options{SlabSize: 1024, PoolSlabs: -1})
	p := testStream(5, seg*rounds)
	var wg sync.WaitGroup
	var removed atomic.Int32
	wg.Add(1)
	go func() { // the consumer
		defer wg.Done()
		stores := map[tcpflow.Tuple]*Store{}
		for r := range rounds {
			if r == 1 {
				// Hold the stores until a removal took one: on a loaded machine the consumer could otherwise
				// finish before the remover first looked, and nothing would be tested.
				for removed.Load() == 0 {
					time.Sleep(50 * time.Microsecond)
				}
			}
			for i := range conns {
				c := testConn(i)
				rec := Record{Conn: c, Seq: uint32(r * seg), Payload: p[r*seg : (r+1)*seg], CgroupID: 3}
				if st := stores[c]; st != nil {
					if err := st.AppendRecord(rec); err == nil {
						continue
					} else if !errors.Is(err, ErrClosed) {
						t.Error(err)
						return
					}
				}
				if err := l.Append(rec); err != nil {
					t.Error(err)
					return
				}
				stores[c], _ = l.Store(c)
			}
		}
	}()
	removals := 0
	for done := false; !done; {
		for _, c := range l.Conns() {
			if a, err := l.Activity(c); err == nil {
				if ok, _, err := l.RemoveIdle(c, a.LastAppend); err != nil && !errors.Is(err, ErrUnknownConn) {
					t.Fatal(err)
				} else if ok {
					removals++
					removed.Add(1)
				}
			}
		}
		done = l.Stats().AppendedBytes >= conns*seg*rounds
		time.Sleep(50 * time.Microsecond)
	}
	wg.Wait()
	if removals == 0 {
		t.Fatal("no removal happened while the consumer appended: the test did not interleave")
	}
	var retained int64
	for _, c := range l.Conns() {
		b, err := l.Bounds(c)
		if err != nil {
			t.Fatal(err)
		}
		retained += b.Retained
		// What a store holds is a contiguous tail of the stream: removal never cut one in two.
		got, err := l.Range(c, b.First, b.Last)
		if err != nil || b.Last != AnchorEpoch|uint64(seg*rounds) {
			t.Fatalf("%v: bounds %+v, %v", c, b, err)
		}
		if string(got) != string(p[len(p)-len(got):]) {
			t.Fatalf("%v: bytes differ from the stream's tail", c)
		}
	}
	if st := l.Stats(); st.RetainedBytes != retained {
		t.Fatalf("log meter says %d bytes retained, its stores %d", st.RetainedBytes, retained)
	}
	if _, err := l.Age(context.Background(), time.Now()); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d removals during %d appends", removals, conns*rounds)
}

// TestLogNoteParkedRacesRemoval: a parked record whose store is removed (RemoveIdle, Remove) between the
// log's lookup and the note goes to a fresh store, as an appended segment does. Before, Log.NoteParked
// returned ErrClosed from the removed store, which the capture consumer takes for a closed log: it
// stopped logging every connection of the node.
func TestLogNoteParkedRacesRemoval(t *testing.T) {
	l := newTestLog(t, Options{})
	c := testConn(1)
	if err := l.NoteParked(Record{Conn: c, Seq: 1000, Parked: 100, CgroupID: 3}); err != nil {
		t.Fatal(err)
	}
	st, err := l.Store(c)
	if err != nil {
		t.Fatal(err)
	}
	st.mu.Lock() // the note below finds st in the log and waits for it
	errc := make(chan error, 1)
	go func() { errc <- l.NoteParked(Record{Conn: c, Seq: 1100, Parked: 100, CgroupID: 3}) }()
	// The removal must come after the note's lookup: once the note waits on st's lock.
	for !waitsInStoreNoteParked() {
		select {
		case err := <-errc:
			t.Fatalf("NoteParked returned %v without waiting for the store's lock", err)
		case <-time.After(time.Millisecond):
		}
	}
	// What RemoveIdle does under the store's lock.
	l.mu.Lock()
	st.closed = true
	delete(l.stores, key(c))
	l.mu.Unlock()
	st.dropAll()
	st.mu.Unlock()
	if err := <-errc; err != nil {
		t.Fatalf("NoteParked raced with a removal: %v, want the note in a fresh store", err)
	}
	if b, err := l.Bounds(c); err != nil || !b.Anchored || b.Seen != AnchorEpoch|1200 {
		t.Errorf("the fresh store: bounds %+v, %v; want anchored, seen up to wire 1200", b, err)
	}
}

// waitsInStoreNoteParked reports whether a goroutine waits for a lock in Store.NoteParked.
func waitsInStoreNoteParked() bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "[sync.Mutex.Lock") && strings.Contains(g, "netlog.(*Store).NoteParked(") {
			return true
		}
	}
	return false
}
