//go:build linux

package recvdigest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ftkit/ftkit/netlog"
)

// fakeSource hands out batches of raw records like the receive tap: each record in a buffer that is
// overwritten after fn returns, blocking while there is none, ctx.Err() once ctx is done.
type fakeSource struct {
	batches chan [][]byte
	fail    chan error
}

func newFakeSource() *fakeSource {
	return &fakeSource{batches: make(chan [][]byte), fail: make(chan error, 1)}
}

func (s *fakeSource) ReadBatch(ctx context.Context, max int, fn func(raw []byte) error) (int, error) {
	select {
	case <-ctx.Done():
		return 0, ctx.Err()
	case err := <-s.fail:
		return 0, err
	case batch := <-s.batches:
		n := 0
		ring := make([]byte, 0, 1<<16)
		for _, raw := range batch {
			ring = append(ring[:0], raw...)
			if err := fn(ring); err != nil {
				return n, err
			}
			clear(ring) // the ring's space goes back to the kernel
			n++
		}
		return n, nil
	}
}

// waitFor polls cond; the bound only serves as a failure timeout.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestRecorderFeedsTheBook(t *testing.T) {
	const base = 4*B + 99
	stream := randomBytes(70, 2*B+500)
	var raws [][]byte
	for off := 0; off < len(stream); off += 1448 {
		raw, err := netlog.AppendRecord(nil, netlog.Record{Conn: testConn, Seq: base + uint32(off), Payload: stream[off:min(off+1448, len(stream))]})
		if err != nil {
			t.Fatal(err)
		}
		raws = append(raws, raw)
	}
	bad := []byte("short") // shorter than a header: counted, skipped, not fatal
	src := newFakeSource()
	book := NewBook(BookOptions{})
	rec := NewRecorder(src, book, nil)
	defer rec.Close()
	half := len(raws) / 2
	src.batches <- raws[:half]
	src.batches <- [][]byte{bad}
	src.batches <- raws[half:]
	waitFor(t, "every record read", func() bool { return rec.Stats().Records == uint64(len(raws)+1) })
	if st := rec.Stats(); st.BadRecords != 1 {
		t.Errorf("stats %+v, want 1 bad record", st)
	}
	equalPieces(t, received(t, book, testConn, base), piecesOf(base, stream))
	if err := rec.Err(); err != nil {
		t.Errorf("Err = %v after a bad record", err)
	}
	rec.Close()
	select {
	case <-rec.Done():
	default:
		t.Error("Done not closed after Close")
	}
	if err := rec.Err(); err != nil {
		t.Errorf("Err = %v after Close, want nil", err)
	}
}

func TestRecorderStopsWhenTheSourceFails(t *testing.T) {
	src := newFakeSource()
	rec := NewRecorder(src, NewBook(BookOptions{}), nil)
	defer rec.Close()
	gone := errors.New("ring buffer gone")
	src.fail <- gone
	select {
	case <-rec.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the recorder kept running after its source failed")
	}
	if err := rec.Err(); !errors.Is(err, gone) {
		t.Fatalf("Err = %v, want the source's error", err)
	}
}

// TestRecorderRefusesParkedRecords: the receive tap never parks a segment, so a record with netlog's
// parked flag is not one of its records (tap and netlog disagree on the layout). It carries no payload,
// and the Book took it for the record that starts a flow: the flow's record was wiped and restarted at the
// parked record's sequence number, and a restored peer's re-sent bytes were refused as unverified.
func TestRecorderRefusesParkedRecords(t *testing.T) {
	const base = 4*B + 99
	stream := randomBytes(71, B+500)
	first, err := netlog.AppendRecord(nil, netlog.Record{Conn: testConn, Seq: base, Payload: stream[:B]})
	if err != nil {
		t.Fatal(err)
	}
	parked, err := netlog.AppendRecord(nil, netlog.Record{Conn: testConn, Seq: base + 3*B, Parked: 1448, Queue: 1})
	if err != nil {
		t.Fatal(err)
	}
	rest, err := netlog.AppendRecord(nil, netlog.Record{Conn: testConn, Seq: base + B, Payload: stream[B:]})
	if err != nil {
		t.Fatal(err)
	}
	src := newFakeSource()
	book := NewBook(BookOptions{})
	rec := NewRecorder(src, book, nil)
	defer rec.Close()
	src.batches <- [][]byte{first, parked, rest}
	waitFor(t, "every record read", func() bool { return rec.Stats().Records == 3 })
	if st := rec.Stats(); st.BadRecords != 1 {
		t.Errorf("stats %+v, want the parked record counted as bad", st)
	}
	if st := book.Stats(); st.Resets != 0 {
		t.Errorf("book stats %+v: the parked record restarted the flow", st)
	}
	equalPieces(t, received(t, book, testConn, base), piecesOf(base, stream))
}
