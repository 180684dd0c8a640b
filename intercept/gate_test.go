package intercept

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// fakeSockets stands for the restored job's sockets: what was injected and not consumed yet.
type fakeSockets struct {
	mu      sync.Mutex
	queued  map[tcpflow.Tuple][]byte
	next    map[tcpflow.Tuple]uint32 // sequence of the next byte to consume
	changed chan struct{}
}

func (f *fakeSockets) Inject(c tcpflow.Tuple, seq uint32, data []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if want := f.next[c] + uint32(len(f.queued[c])); seq != want {
		return fmt.Errorf("injected at %d, the socket expects %d", seq, want)
	}
	f.queued[c] = append(f.queued[c], data...)
	select {
	case f.changed <- struct{}{}:
	default:
	}
	return nil
}

// program is a deterministic reader: it reads, in a fixed order, up to n bytes of a connection, waiting
// until some are there (recv); it reports each read on events.
func (f *fakeSockets) program(ctx context.Context, reads []Det, events chan<- Event) {
	for _, r := range reads {
		for {
			f.mu.Lock()
			q := f.queued[r.Conn]
			if len(q) > 0 {
				n := min(int(r.Len), len(q))
				f.queued[r.Conn] = q[n:]
				f.next[r.Conn] += uint32(n)
				end := f.next[r.Conn]
				f.mu.Unlock()
				events <- Event{Det: Det{Conn: r.Conn, End: end, Len: uint32(n)}}
				break // like recv: what is there, up to the buffer
			}
			f.mu.Unlock()
			select {
			case <-f.changed:
			case <-time.After(time.Millisecond):
			case <-ctx.Done():
				return
			}
		}
	}
}

func TestGateReplaysOrder(t *testing.T) {
	srcA := Source{Seq: 1000, Data: []byte("aaaaaaaaaaAAAAA")}
	srcB := Source{Seq: 5, Data: []byte("bbbBBBB")}
	sources := map[tcpflow.Tuple]Source{connA: srcA, connB: srcB}
	// The original read 10 of A, 3 of B, 5 of A; then the crash (B's last 4 bytes never read).
	dets := []Det{{Conn: connA, End: 1010, Len: 10}, {Conn: connB, End: 8, Len: 3}, {Conn: connA, End: 1015, Len: 5}}
	g, err := NewGate(dets, sources)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeSockets{queued: map[tcpflow.Tuple][]byte{}, next: map[tcpflow.Tuple]uint32{connA: 1000, connB: 5}, changed: make(chan struct{}, 1)}
	events := make(chan Event, 16)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	// A greedy program that would read all of A first if it could: only the gate keeps it in order.
	var seen []Det
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.program(ctx, []Det{{Conn: connA, Len: 100}, {Conn: connB, Len: 100}, {Conn: connA, Len: 100}}, events)
	}()
	tee := make(chan Event, 16)
	go func() {
		for e := range events {
			seen = append(seen, e.Det)
			tee <- e
		}
	}()
	injected, err := g.Run(ctx, f, tee, nil)
	if err != nil {
		t.Fatal(err)
	}
	if injected != int64(len(srcA.Data)+len(srcB.Data)) {
		t.Fatalf("injected %d bytes, want every source byte", injected)
	}
	<-done
	want := []Det{{Conn: connA, End: 1010, Len: 10}, {Conn: connB, End: 12, Len: 7}}
	if len(seen) < 2 || seen[0] != want[0] || seen[1].Conn != connB || seen[1].End != 8 {
		t.Fatalf("the program read %v; the first two reads must be A up to 1010, then B up to 8", seen)
	}
}

func TestGateDivergence(t *testing.T) {
	sources := map[tcpflow.Tuple]Source{connA: {Seq: 0, Data: make([]byte, 10)}, connB: {Seq: 0, Data: make([]byte, 10)}}
	g, err := NewGate([]Det{{Conn: connA, End: 4, Len: 4}, {Conn: connB, End: 4, Len: 4}}, sources)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeSockets{queued: map[tcpflow.Tuple][]byte{}, next: map[tcpflow.Tuple]uint32{}, changed: make(chan struct{}, 1)}
	events := make(chan Event, 5)
	events <- Event{Det: Det{Conn: connA, End: 3, Len: 3}}                     // part of the first: fine
	events <- Event{Det: Det{Conn: conn("10.9.0.1:1", "10.9.0.9:2"), End: 99}} // another connection: ignored
	events <- Event{Det: Det{Conn: connA, End: 4, Len: 1}}                     // the rest
	events <- Event{Det: Det{Conn: connB, End: 0, Len: 0}}                     // B found nothing: ignored
	events <- Event{Det: Det{Conn: connA, End: 6, Len: 2}}                     // A again, where the original read B
	_, err = g.Run(t.Context(), f, events, nil)
	if !errors.Is(err, ErrDiverged) || !strings.Contains(err.Error(), "determinant 2 of 2") {
		t.Fatalf("err %v, want ErrDiverged at determinant 2", err)
	}
	if got := len(f.queued[connB]); got != 4 {
		t.Fatalf("B holds %d injected bytes, want exactly the 4 of determinant 2", got)
	}
}

func TestGateRefusesBadDeterminants(t *testing.T) {
	sources := map[tcpflow.Tuple]Source{connA: {Seq: 100, Data: make([]byte, 10)}}
	for _, dets := range [][]Det{
		{{Conn: connA, End: 111, Len: 11}},                                 // past the peer's bytes
		{{Conn: connA, End: 100, Len: 1}},                                  // consumed nothing new
		{{Conn: connA, End: 105, Len: 5}, {Conn: connA, End: 104, Len: 1}}, // went back
	} {
		if _, err := NewGate(dets, sources); err == nil {
			t.Errorf("determinants %v accepted", dets)
		}
	}
	// A closed event stream (the recorder lost calls) ends the replay.
	g, err := NewGate([]Det{{Conn: connA, End: 105, Len: 5}}, sources)
	if err != nil {
		t.Fatal(err)
	}
	ev := make(chan Event)
	close(ev)
	f := &fakeSockets{queued: map[tcpflow.Tuple][]byte{}, next: map[tcpflow.Tuple]uint32{connA: 100}, changed: make(chan struct{}, 1)}
	if _, err := g.Run(t.Context(), f, ev, nil); err == nil || !strings.Contains(err.Error(), "lost") {
		t.Fatalf("err %v, want the recorder's loss", err)
	}
}

// TestGateRefusesRecordWithMissingCall: the original read A (10), B (3), A (5), B (4), but the record
// lacks the read of B's first 3 bytes (a receive the recorder does not see: splice, TCP_ZEROCOPY_RECEIVE,
// kTLS; or two readers of one socket). B's remaining determinant says it consumed [3, 7), yet the
// connection's previous determinant ended at 0. A gate built from it replays an order the original never
// had (all of B after both reads of A) and reports success.
func TestGateRefusesRecordWithMissingCall(t *testing.T) {
	srcA := Source{Seq: 0, Data: []byte("aaaaaaaaaaAAAAA")}
	srcB := Source{Seq: 0, Data: []byte("bbbBBBB")}
	sources := map[tcpflow.Tuple]Source{connA: srcA, connB: srcB}
	dets := []Det{{Conn: connA, End: 10, Len: 10} /* missing: B [0,3) */, {Conn: connA, End: 15, Len: 5}, {Conn: connB, End: 7, Len: 4}}
	g, err := NewGate(dets, sources)
	if err != nil {
		return // refused: the record provably misses a call
	}
	// It was accepted: show that the replay vouches for an order the original did not have.
	f := &fakeSockets{queued: map[tcpflow.Tuple][]byte{}, next: map[tcpflow.Tuple]uint32{}, changed: make(chan struct{}, 1)}
	events := make(chan Event, 16)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	go f.program(ctx, []Det{{Conn: connA, Len: 100}, {Conn: connA, Len: 100}, {Conn: connB, Len: 100}}, events)
	if _, err := g.Run(ctx, f, events, nil); err == nil {
		t.Fatalf("a record missing B's read of [0, 3) was accepted, and the replay read A, A, then all of B at once: reported as the original's order")
	}
}

// TestGateTwoReadersOfOneSocket: threads 1 and 2 of the job both read A; the original's thread 1 got A's
// first 10 bytes and thread 2 the next 10. The gate matched each restored call on its connection and end
// only: thread 2 took the first 10 bytes, thread 1 the next, and the replay reported the original's order,
// each thread having handled the other's message.
func TestGateTwoReadersOfOneSocket(t *testing.T) {
	sources := map[tcpflow.Tuple]Source{connA: {Seq: 0, Data: make([]byte, 20)}, connB: {Seq: 0, Data: make([]byte, 5)}}
	dets := []Det{
		{Conn: connA, End: 10, Len: 10, Thread: 1, Proc: 1},
		{Conn: connA, End: 20, Len: 10, Thread: 2, Proc: 2},
		{Conn: connB, End: 5, Len: 5, Thread: 1, Proc: 1},
	}
	g, err := NewGate(dets, sources)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeSockets{queued: map[tcpflow.Tuple][]byte{}, next: map[tcpflow.Tuple]uint32{}, changed: make(chan struct{}, 1)}
	events := make(chan Event, 3)
	events <- Event{Det: Det{Conn: connA, End: 10, Len: 10, Thread: 2, Proc: 2}} // the other reader won
	events <- Event{Det: Det{Conn: connA, End: 20, Len: 10, Thread: 1, Proc: 1}}
	events <- Event{Det: Det{Conn: connB, End: 5, Len: 5, Thread: 1, Proc: 1}}
	if _, err := g.Run(t.Context(), f, events, nil); !errors.Is(err, ErrDiverged) || !strings.Contains(err.Error(), "determinant 1 of 3") {
		t.Fatalf("err %v, want ErrDiverged at determinant 1", err)
	}
}
