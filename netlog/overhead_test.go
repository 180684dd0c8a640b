package netlog

import (
	"context"
	"log/slog"
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

// TestSpillCountsStoreOverhead: the controller measures the log's memory with every store's overhead
// (Stats.LiveBytes) and asks Age to spill down to the low watermark (Options.SpillAboveRAM); Age measured
// only the slabs. With many small stores the log stayed above the watermark, up to its cap, which pauses
// the consumer, while sealed slabs that could go to disk stayed in memory.
func TestSpillCountsStoreOverhead(t *testing.T) {
	const slab = 4096
	tests := []struct {
		name      string
		small     int   // stores trimmed to nothing: their overhead only
		threshold int64 // SpillAboveRAM
		spill     bool
	}{
		{name: "slabs and overhead under the threshold", small: 8, threshold: 64 * slab},
		{name: "slabs under the threshold, overhead puts the log above it", small: 200, threshold: 16 * slab, spill: true},
		{name: "overhead alone above the threshold", small: 200, threshold: 4 * slab, spill: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := newTestLog(t, Options{SlabSize: slab, PoolSlabs: -1, SpillDir: fastSpillDir(t), SpillAboveRAM: tc.threshold,
				Logger: slog.New(slog.DiscardHandler)})
			stream := textStream(12*slab + 100) // 12 sealed slabs, one partial
			for off := 0; off < len(stream); off += 1448 {
				if err := l.Append(decoded(t, testConn(0), uint32(off), stream[off:min(off+1448, len(stream))])); err != nil {
					t.Fatal(err)
				}
			}
			for i := 1; i <= tc.small; i++ {
				if err := l.Append(decoded(t, testConn(i), 1000, []byte{1})); err != nil {
					t.Fatal(err)
				}
				if _, err := l.Trim(testConn(i), 1001); err != nil {
					t.Fatal(err)
				}
			}
			before := l.Stats()
			r, err := l.Age(context.Background(), time.Now())
			if err != nil {
				t.Fatal(err)
			}
			after := l.Stats()
			if !tc.spill {
				if r.Spilled != 0 {
					t.Errorf("live memory %d under the threshold %d: %d slabs spilled, want none", before.LiveBytes(), tc.threshold, r.Spilled)
				}
				return
			}
			// What spilling can free is the sealed slabs: the log must end at the threshold or with them all on disk.
			if after.LiveBytes() > tc.threshold && r.Spilled < 12 {
				t.Errorf("live memory %d (%d in stores' overhead) above the spill threshold %d after Age: %d of 12 sealed slabs spilled",
					after.LiveBytes(), after.OverheadBytes, tc.threshold, r.Spilled)
			}
		})
	}
}
