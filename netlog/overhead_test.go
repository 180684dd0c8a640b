package netlog

import (
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestLogMetersStoreOverhead: a store costs memory of its own (the Store, its map entry), whatever it
// holds. A job that opens many connections and sends a byte on each, whose receivers' snapshots then trim
// everything (or whose bytes are still parked: NoteParked), left stores the meter counted as 0 bytes:
// the log's memory (LiveBytes, what the cap is checked against) stayed at 0 while the heap grew with every
// connection, without bound, until the sending job ended.
func TestLogMetersStoreOverhead(t *testing.T) {
	const n = 20000
	l := newTestLog(t, Options{SlabSize: 4096})
	conn := func(i int) tcpflow.Tuple {
		return tcpflow.Tuple{
			Local:  netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 16), 1}), uint16(i)),
			Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, 2}), 5201),
		}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range n {
		c := conn(i)
		if err := l.Append(Record{Conn: c, Seq: 1000, Payload: []byte{1}, CgroupID: 7}); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Trim(c, 1001); err != nil { // the receiver's snapshot has the byte
			t.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	st := l.Stats()
	if st.Conns != n {
		t.Fatalf("%d stores, want %d", st.Conns, n)
	}
	// What a store trimmed to nothing costs (about 450 bytes on amd64, 2026-12-07), for storeOverhead; not
	// asserted: other tests' garbage counts too.
	heap := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d empty stores: heap grew by %d bytes (%d each), the log meters %d (live %d)", n, heap, heap/n, st.MemoryBytes(), st.LiveBytes())
	if st.LiveBytes() < n*storeOverhead {
		t.Fatalf("the log meters %d bytes of live memory for %d stores trimmed to nothing: the cap (log.memory_mib) does not see them", st.LiveBytes(), n)
	}
	runtime.KeepAlive(l)

	// Freed stores give their overhead back, whichever way they go.
	for i := range n {
		var err error
		if i%2 == 0 {
			err = l.Remove(conn(i))
		} else {
			var ok bool
			if ok, _, err = l.RemoveIdle(conn(i), time.Now()); err == nil && !ok {
				t.Fatalf("store %d not removed", i)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if st := l.Stats(); st.LiveBytes() != 0 || st.MemoryBytes() != st.PooledBytes {
		t.Fatalf("after removing every store the log still meters %d live bytes (%+v)", st.LiveBytes(), st)
	}
}
