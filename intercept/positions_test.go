package intercept

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// pollWorld is one thread's sockets and its host's stops: what the gate injected and not consumed yet, and
// the stop armed for the thread (as ebpfprobes.RecvOrder does it).
type pollWorld struct {
	mu     sync.Mutex
	queued map[tcpflow.Tuple][]byte
	next   map[tcpflow.Tuple]uint32 // sequence of the next byte to consume
	armed  *Stop
	cont   chan uint32
}

func newPollWorld(next map[tcpflow.Tuple]uint32) *pollWorld {
	return &pollWorld{queued: map[tcpflow.Tuple][]byte{}, next: next, cont: make(chan uint32, 1)}
}

func (w *pollWorld) Inject(c tcpflow.Tuple, seq uint32, data []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if want := w.next[c] + uint32(len(w.queued[c])); seq != want {
		return fmt.Errorf("injected at %d, the socket expects %d", seq, want)
	}
	w.queued[c] = append(w.queued[c], data...)
	return nil
}

func (w *pollWorld) Arm(thread uint32, s Stop) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.armed = &s
	return nil
}

func (w *pollWorld) Disarm(thread uint32) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.armed = nil
	return nil
}

func (w *pollWorld) Continue(pid uint32) error { w.cont <- pid; return nil }

func (w *pollWorld) WaitStopped(ctx context.Context, pid uint32) error { return nil }

func (w *pollWorld) Describe(thread uint32) string { return "" }

// stopped reports whether the armed stop is s (and disarms nothing: the gate re-arms).
func (w *pollWorld) stopped(s Stop) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.armed != nil && *w.armed == s
}

// program is a libevent-like loop of thread 7 of process 1: polls readiness calls, numbered from first;
// after each it reads every connection that was ready at the call, in a fixed order, with a 64-byte buffer
// until a read finds nothing. arrive(k), if set, delivers the peers' bytes before readiness call k. Every
// receive call and armed stop goes to emit; a stopped thread waits for Continue. It returns what it read
// at which call: its output.
func (w *pollWorld) program(ctx context.Context, first, polls int, conns []tcpflow.Tuple, arrive func(k int), emit func(Event)) []string {
	var trace []string
	var count uint64
	stop := func(e Event) {
		e.Thread, e.Proc, e.Pid = 7, 1, 1001
		s := Stop{Polls: e.Pos}
		if !e.AtPoll {
			s = Stop{Polls: e.Pos, Conn: e.Conn, End: e.End, Len: e.Len}
		}
		e.Stopped = w.stopped(s)
		if e.AtPoll && !e.Stopped {
			return // the recorder reports a readiness call only where it stops the thread
		}
		emit(e)
		if e.Stopped {
			select {
			case <-w.cont:
			case <-ctx.Done():
			}
		}
	}
	for k := first; k < first+polls; k++ {
		if arrive != nil {
			arrive(k)
		}
		w.mu.Lock()
		var ready []tcpflow.Tuple
		for _, c := range conns {
			if len(w.queued[c]) > 0 {
				ready = append(ready, c)
			}
		}
		w.mu.Unlock()
		count++
		stop(Event{Det: Det{Pos: count}, AtPoll: true})
		for _, c := range ready {
			for {
				w.mu.Lock()
				n := min(64, len(w.queued[c]))
				w.queued[c] = w.queued[c][n:]
				w.next[c] += uint32(n)
				end := w.next[c]
				w.mu.Unlock()
				trace = append(trace, fmt.Sprintf("call %d: %d bytes of %s", k, n, c))
				stop(Event{Det: Det{Conn: c, End: end, Len: uint32(n), Pos: count}})
				if n == 0 {
					break
				}
			}
		}
	}
	return trace
}

// TestGatePositions runs a polling program, then replays it from a snapshot taken after its third
// readiness call: with positions, the restored program reads the same bytes at the same calls, although
// every byte is available to the gate from the start.
func TestGatePositions(t *testing.T) {
	conns := []tcpflow.Tuple{connA, connB}
	type arrival struct {
		c tcpflow.Tuple
		n int
	}
	schedule := map[int][]arrival{
		2:  {{connA, 100}},            // read 64, 36, nothing at call 2: before the snapshot
		5:  {{connB, 10}},             // call 5 finds B only
		6:  {{connA, 20}, {connB, 5}}, // call 6 finds both
		9:  {{connA, 70}},             // 64, 6, nothing
		11: {{connB, 3}, {connA, 1}},  // the last
	}
	orig := newPollWorld(map[tcpflow.Tuple]uint32{connA: 0, connB: 0})
	sent := map[tcpflow.Tuple][]byte{}
	arrive := func(k int) {
		for _, a := range schedule[k] {
			b := []byte(strings.Repeat(fmt.Sprint(k%10), a.n))
			sent[a.c] = append(sent[a.c], b...)
			orig.mu.Lock()
			orig.queued[a.c] = append(orig.queued[a.c], b...)
			orig.mu.Unlock()
		}
	}
	var recorded []Det
	const calls = 12
	full := orig.program(t.Context(), 1, calls, conns, arrive, func(e Event) { recorded = append(recorded, e.Det) })
	// Snapshots after call 3 or 4: A consumed up to 100, B nothing; what the thread read after it is
	// replayed. After call 4, call 5 is the thread's first since the dump: B's 10 bytes must be in the
	// restored queue before it runs.
	for _, tc := range []struct {
		dumpAt  uint64
		preload map[tcpflow.Tuple]uint32
	}{{3, map[tcpflow.Tuple]uint32{}}, {4, map[tcpflow.Tuple]uint32{connB: 10}}} {
		t.Run(fmt.Sprintf("dump after call %d", tc.dumpAt), func(t *testing.T) {
			var dets []Det
			for _, d := range recorded {
				if d.Pos > tc.dumpAt {
					dets = append(dets, d)
				}
			}
			sources := map[tcpflow.Tuple]Source{connA: {Seq: 100, Data: sent[connA][100:]}, connB: {Seq: 0, Data: sent[connB]}}
			want := slices.DeleteFunc(slices.Clone(full), func(s string) bool { var k uint64; fmt.Sscanf(s, "call %d", &k); return k <= tc.dumpAt })

			g, err := NewGate(dets, sources)
			if err != nil {
				t.Fatal(err)
			}
			if err := g.UsePositions(map[uint32]uint64{7: tc.dumpAt}); err != nil {
				t.Fatal(err)
			}
			preload := g.Preload()
			if !maps.Equal(preload, tc.preload) {
				t.Fatalf("preload %v, want %v", preload, tc.preload)
			}
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			re := newPollWorld(map[tcpflow.Tuple]uint32{connA: 100, connB: 0})
			for c, n := range preload { // the restored images' receive queues
				re.queued[c] = sources[c].Data[:n]
			}
			if err := g.ArmFirst(re); err != nil {
				t.Fatal(err)
			}
			events := make(chan Event, 64)
			got := make(chan []string, 1)
			go func() {
				got <- re.program(ctx, int(tc.dumpAt)+1, calls-int(tc.dumpAt), conns, nil, func(e Event) { events <- e })
			}()
			injected, err := g.Run(ctx, re, events, re)
			if err != nil {
				t.Fatal(err)
			}
			if total := len(sources[connA].Data) + len(sources[connB].Data) - int(preload[connB]); injected != int64(total) {
				t.Errorf("injected %d bytes, want %d: every byte of the sources not preloaded", injected, total)
			}
			if trace := <-got; !slices.Equal(trace, want) {
				t.Fatalf("the restored program read\n%s\nthe original\n%s", strings.Join(trace, "\n"), strings.Join(want, "\n"))
			}
		})
	}
}

func TestPlanPositions(t *testing.T) {
	d := func(c tcpflow.Tuple, end, n uint32, thread, proc uint32, pos uint64) Det {
		return Det{Conn: c, End: end, Len: n, Thread: thread, Proc: proc, Pos: pos}
	}
	for _, tc := range []struct {
		name   string
		events []Det
		base   map[uint32]uint64
		points []string // thread: polls/after -> injections
		err    string
	}{
		{
			name:   "a read found by the first call after the restore: before the job runs",
			events: []Det{d(connA, 10, 10, 1, 1, 6)},
			base:   map[uint32]uint64{1: 5},
			points: []string{"1: 0/-1 A10"},
		},
		{
			name:   "a read later: at the exit of the call before the one that found it",
			events: []Det{d(connA, 10, 10, 1, 1, 9)},
			base:   map[uint32]uint64{1: 5},
			points: []string{"1: 3/-1 A10"},
		},
		{
			name:   "a second read of the connection in the same interval: right after the first",
			events: []Det{d(connA, 10, 10, 1, 1, 2), d(connA, 15, 5, 1, 1, 2)},
			points: []string{"1: 1/-1 A10", "1: 2/0 A15"},
		},
		{
			name:   "the connection read in the previous interval, found empty: right after that read",
			events: []Det{d(connA, 10, 10, 1, 1, 2), d(connA, 10, 0, 1, 1, 2), d(connA, 12, 2, 1, 1, 3)},
			points: []string{"1: 1/-1 A10", "1: 2/1 A12"},
		},
		{
			name:   "two connections found by one call; a thread that never polled",
			events: []Det{d(connA, 10, 10, 1, 1, 4), d(connB, 3, 3, 1, 1, 4), d(connB, 9, 6, 2, 2, 0)},
			points: []string{"1: 3/-1 A10 B3", "2: 0/-1 B9"},
		},
		{
			name:   "a call that found nothing before the first readiness call since the dump: maybe before the dump",
			events: []Det{d(connA, 10, 0, 1, 1, 5), d(connA, 12, 2, 1, 1, 5)},
			base:   map[uint32]uint64{1: 5},
			points: []string{"1: 0/-1 A12"},
		},
		{
			name:   "two connections found by one call, B read first: injected in that order",
			events: []Det{d(connB, 3, 3, 1, 1, 4), d(connA, 10, 10, 1, 1, 4), d(connB, 5, 2, 1, 1, 4)},
			points: []string{"1: 3/-1 B3 A10", "1: 4/0 B5"},
		},
		{
			name:   "two receiving threads in one process",
			events: []Det{d(connA, 10, 10, 1, 1, 4), d(connB, 3, 3, 2, 1, 4)},
			err:    "both receive",
		},
		{
			name:   "fewer calls than at the dump",
			events: []Det{d(connA, 10, 10, 1, 1, 4)},
			base:   map[uint32]uint64{1: 5},
			err:    "fewer than",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plans, err := planPositions(tc.events, tc.base)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, p := range plans {
				for _, pt := range p.points {
					s := fmt.Sprintf("%d: %d/%d", p.thread, pt.polls, pt.after)
					for _, in := range pt.inject {
						s += fmt.Sprintf(" %s%d", map[tcpflow.Tuple]string{connA: "A", connB: "B"}[in.conn], in.end)
					}
					got = append(got, s)
				}
			}
			if !slices.Equal(got, tc.points) {
				t.Fatalf("points %q, want %q", got, tc.points)
			}
		})
	}
}

// TestGatePositionsDivergence: a restored thread that stops elsewhere than armed, or reads what the
// original did not, fails the replay.
func TestGatePositionsDivergence(t *testing.T) {
	sources := map[tcpflow.Tuple]Source{connA: {Seq: 0, Data: make([]byte, 10)}, connB: {Seq: 0, Data: make([]byte, 10)}}
	g, err := NewGate([]Det{{Conn: connA, End: 4, Len: 4, Thread: 1, Proc: 1, Pos: 3}, {Conn: connB, End: 4, Len: 4, Thread: 1, Proc: 1, Pos: 3}}, sources)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.UsePositions(nil); err != nil {
		t.Fatal(err)
	}
	w := newPollWorld(map[tcpflow.Tuple]uint32{})
	events := make(chan Event, 4)
	events <- Event{Det: Det{Thread: 1, Proc: 1, Pos: 1}, AtPoll: true, Stopped: true, Pid: 9} // armed at 2
	if _, err := g.Run(t.Context(), w, events, w); err == nil || !strings.Contains(err.Error(), "not armed") {
		t.Fatalf("a run whose first stops were not armed before the job ran: err %v", err)
	}
	if err := g.ArmFirst(w); err != nil {
		t.Fatal(err)
	}
	if w.armed == nil || *w.armed != (Stop{Polls: 2}) {
		t.Fatalf("first stop armed %+v, want at the exit of readiness call 2", w.armed)
	}
	_, err = g.Run(t.Context(), w, events, w)
	if !errors.Is(err, ErrDiverged) {
		t.Fatalf("err %v, want ErrDiverged", err)
	}
	if w.armed != nil {
		t.Fatalf("a failed replay left a stop armed: %+v", w.armed)
	}
}

// TestGatePositionsReadOfAnothersBytes: two processes read one connection (a socket shared across a fork):
// thread 1 read [0, 10), thread 2 then [10, 20). Restored, thread 2's bytes are in the queue before the job
// runs, and so are thread 1's before them: thread 2 read all 20. Its call ended where the recorded one did,
// and was taken for it although it consumed thread 1's bytes too; thread 2 ran on with them, and the replay
// failed only at its timeout, thread 1 waiting for bytes no longer there.
func TestGatePositionsReadOfAnothersBytes(t *testing.T) {
	sources := map[tcpflow.Tuple]Source{connA: {Seq: 0, Data: make([]byte, 20)}}
	w := newPollWorld(map[tcpflow.Tuple]uint32{})
	for _, tc := range []struct {
		name string
		e    Det
	}{
		{"all at once", Det{Conn: connA, End: 20, Len: 20, Thread: 2, Proc: 2}},
		{"a part", Det{Conn: connA, End: 15, Len: 15, Thread: 2, Proc: 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := NewGate([]Det{{Conn: connA, End: 10, Len: 10, Thread: 1, Proc: 1, Pos: 3}, {Conn: connA, End: 20, Len: 10, Thread: 2, Proc: 2, Pos: 0}}, sources)
			if err != nil {
				t.Fatal(err)
			}
			if err := g.UsePositions(nil); err != nil {
				t.Fatal(err)
			}
			if err := g.ArmFirst(w); err != nil {
				t.Fatal(err)
			}
			events := make(chan Event, 1)
			events <- Event{Det: tc.e, Pid: 2002}
			close(events)
			if _, err := g.Run(t.Context(), w, events, w); !errors.Is(err, ErrDiverged) {
				t.Fatalf("thread 2 consumed [%d, %d), the original [10, 20): err %v, want ErrDiverged", tc.e.End-tc.e.Len, tc.e.End, err)
			}
		})
	}
}

// TestGatePositionsReadAtAnotherCall: a restored thread that consumes a recorded call's bytes after another
// number of readiness calls than the original is not re-executing it. The run's stops matched, and its
// reads were matched on their bytes alone: the replay passed with reads at other readiness calls than
// recorded, without an error.
func TestGatePositionsReadAtAnotherCall(t *testing.T) {
	sources := map[tcpflow.Tuple]Source{connA: {Seq: 0, Data: make([]byte, 20)}, connB: {Seq: 0, Data: make([]byte, 10)}}
	for _, tc := range []struct {
		name   string
		dets   []Det
		events []Event
	}{
		{
			// Thread 1 read A at call 3, B at call 5; restored, it read A only at call 4.
			name: "one thread reads later than recorded",
			dets: []Det{{Conn: connA, End: 10, Len: 10, Thread: 1, Proc: 1, Pos: 3}, {Conn: connB, End: 5, Len: 5, Thread: 1, Proc: 1, Pos: 5}},
			events: []Event{
				{Det: Det{Thread: 1, Proc: 1, Pos: 2}, AtPoll: true, Stopped: true, Pid: 1001},
				{Det: Det{Conn: connA, End: 10, Len: 10, Thread: 1, Proc: 1, Pos: 4}, Pid: 1001},
				{Det: Det{Thread: 1, Proc: 1, Pos: 4}, AtPoll: true, Stopped: true, Pid: 1001},
				{Det: Det{Conn: connB, End: 5, Len: 5, Thread: 1, Proc: 1, Pos: 5}, Pid: 1001},
			},
		},
		{
			// A socket shared by two processes: thread 2's bytes are in the restored queue before the job
			// runs, thread 1's before them, and thread 1 read its own at call 1 instead of 3.
			name: "bytes another thread's preload exposed, read earlier than recorded",
			dets: []Det{{Conn: connA, End: 10, Len: 10, Thread: 1, Proc: 1, Pos: 3}, {Conn: connA, End: 20, Len: 10, Thread: 2, Proc: 2, Pos: 0}},
			events: []Event{
				{Det: Det{Conn: connA, End: 10, Len: 10, Thread: 1, Proc: 1, Pos: 1}, Pid: 1001},
				{Det: Det{Thread: 1, Proc: 1, Pos: 2}, AtPoll: true, Stopped: true, Pid: 1001},
				{Det: Det{Conn: connA, End: 20, Len: 10, Thread: 2, Proc: 2, Pos: 0}, Pid: 2002},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := NewGate(tc.dets, sources)
			if err != nil {
				t.Fatal(err)
			}
			if err := g.UsePositions(nil); err != nil {
				t.Fatal(err)
			}
			w := newPollWorld(map[tcpflow.Tuple]uint32{connA: 0, connB: 0})
			for c, n := range g.Preload() {
				w.queued[c] = sources[c].Data[:n]
			}
			if err := g.ArmFirst(w); err != nil {
				t.Fatal(err)
			}
			events := make(chan Event, len(tc.events))
			for _, e := range tc.events {
				events <- e
			}
			close(events)
			go func() { // the stopped thread's continues
				for range w.cont {
				}
			}()
			defer close(w.cont)
			if _, err := g.Run(t.Context(), w, events, w); !errors.Is(err, ErrDiverged) {
				t.Fatalf("err %v, want ErrDiverged", err)
			}
		})
	}
}

// TestGatePositionsSplitReadStop: the thread's stop right after a read (to deliver the next read's bytes
// there) is armed with the recorded call's Len. Restored, that read woke between two injected segments and
// came as two calls, the second returning the rest: the recorder stops a thread only at a call of exactly
// the armed Len, so the stop never fired, the next bytes were never injected, and the replay failed (at its
// timeout; here when the recorder ends) although the thread re-executed the original.
func TestGatePositionsSplitReadStop(t *testing.T) {
	sources := map[tcpflow.Tuple]Source{connA: {Seq: 0, Data: make([]byte, 15)}}
	// Read [0, 10) and [10, 15) after readiness call 2: the first delivered at the exit of call 1, the
	// second right after the first read.
	g, err := NewGate([]Det{{Conn: connA, End: 10, Len: 10, Thread: 7, Proc: 1, Pos: 2}, {Conn: connA, End: 15, Len: 5, Thread: 7, Proc: 1, Pos: 2}}, sources)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.UsePositions(nil); err != nil {
		t.Fatal(err)
	}
	w := newPollWorld(map[tcpflow.Tuple]uint32{connA: 0})
	if err := g.ArmFirst(w); err != nil {
		t.Fatal(err)
	}
	events := make(chan Event) // unbuffered: a send returns once the gate took the call before it in
	// The restored thread, as the recorder reports it: a call is stopped if it is where the stop is armed.
	call := func(e Event) {
		e.Thread, e.Proc, e.Pid = 7, 1, 1001
		s := Stop{Polls: e.Pos}
		if !e.AtPoll {
			s = Stop{Polls: e.Pos, Conn: e.Conn, End: e.End, Len: e.Len}
		}
		e.Stopped = w.stopped(s)
		if e.AtPoll && !e.Stopped {
			return
		}
		events <- e
		if e.Stopped {
			<-w.cont
		}
	}
	read := func(max int) {
		w.mu.Lock()
		n := min(max, len(w.queued[connA]))
		w.queued[connA] = w.queued[connA][n:]
		w.next[connA] += uint32(n)
		end := w.next[connA]
		w.mu.Unlock()
		call(Event{Det: Det{Conn: connA, End: end, Len: uint32(n), Pos: 2}})
	}
	go func() {
		defer close(events)
		call(Event{Det: Det{Pos: 1}, AtPoll: true})
		// Call 2 found A; its read woke after the first of two segments (6 bytes), the next read took the rest.
		read(6)
		// While the rest is on its way the thread reads a connection the gate does not gate: the gate has
		// seen the first part by the time the rest comes.
		call(Event{Det: Det{Conn: connB, End: 1, Len: 1, Pos: 2}})
		read(64)
		read(64) // the bytes delivered at the stop
	}()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if _, err := g.Run(ctx, w, events, w); err != nil {
		t.Fatalf("a read split in two, its second call stopping where the whole one did: %v", err)
	}
}
