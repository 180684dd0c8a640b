package intercept

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ftkit/ftkit/tcpflow"
)

// Receive positions. Keeping the order and amounts of a restored thread's receive calls is not enough for
// a program that decides from which bytes have arrived when it checks (an MPI library matching a wildcard
// receive, MPI_Waitany, anything that polls): the same reads must also happen between the same two
// readiness calls (epoll_wait, poll, select) as in the original, so that each readiness call reports what
// it reported then. The recorder counts each thread's readiness calls and stamps every receive call with
// the count (Det.Pos); the snapshot keeps each thread's count at the dump. In positions mode the gate
// delivers each receive call's bytes at the last point of the thread's execution before that call where
// the original could not have looked at the connection since: right after the thread's previous receive
// call on the connection, if that was in the same or the previous interval between two readiness calls
// (a call that found nothing is recorded too, for this), otherwise at the exit of the readiness call before
// the one that found them. The thread is stopped there (Stopper: SIGSTOP from the recorder, before it runs
// any code of its own), the bytes are injected, and it goes on. The bytes needed before a thread's first
// readiness call since the dump are in the restored receive queues (Preload), and each thread's first stop
// is armed before the job runs (ArmFirst): no process is ever restored stopped and continued as a whole,
// because a process that forwards the signals it receives to its children (Open MPI's orted forwards
// SIGCONT) would undo a stop of one of them.

// An Event is what the restored job's host records of it while a gate replays: a receive call (Det; Len 0
// for one that found nothing), or (AtPoll) the stop of a thread at its Pos-th readiness call since the
// restore. Stopped: the thread was stopped there by an armed Stop and waits for Stopper.Continue.
type Event struct {
	Det
	AtPoll  bool
	Stopped bool
	StopErr error  // an armed stop that could not stop the thread: why
	Pid     uint32 // the caller's process on this host
}

// A Stop is a point of a restored thread's execution where the gate stops it: the exit of its Polls-th
// readiness call since the restore (a zero Conn), or right after a receive call on Conn made after Polls
// readiness calls that returned Len bytes (0: nothing) and left copied_seq at End.
type Stop struct {
	Polls    uint64
	Conn     tcpflow.Tuple
	End, Len uint32
}

// A Stopper stops the restored job's threads where a gate in positions mode asks (the host's recorder).
type Stopper interface {
	// Arm sets the thread's next stop (its id in the job's PID namespace), replacing any.
	Arm(thread uint32, s Stop) error
	// Disarm removes the thread's stop.
	Disarm(thread uint32) error
	// WaitStopped waits until the process (host pid) is stopped, until ctx ends.
	WaitStopped(ctx context.Context, pid uint32) error
	// Continue lets a stopped process (host pid) go on.
	Continue(pid uint32) error
	// Describe says where the thread is (its readiness calls since the restore, what it waits for), for
	// the error of a replay that timed out.
	Describe(thread uint32) string
}

// point is where a thread is stopped to receive bytes.
type point struct {
	polls uint64 // the thread's readiness calls since the restore, at the point
	after int    // -1: at the exit of readiness call polls (0: before the job runs); else the index in the thread's events of the receive call it follows
	// inject: up to where each connection's bytes are delivered there, in the order the thread reads them
	// next (an epoll set reports connections in the order their bytes arrived).
	inject []injection
}

type injection struct {
	conn tcpflow.Tuple
	end  uint32
}

// add makes the point deliver c's bytes up to at least end.
func (p *point) add(c tcpflow.Tuple, end uint32) {
	for i := range p.inject {
		if in := &p.inject[i]; in.conn == c {
			if seqAfter(end, in.end) {
				in.end = end
			}
			return
		}
	}
	p.inject = append(p.inject, injection{c, end})
}

func (p *point) start() bool { return p.after < 0 && p.polls == 0 }

// threadPlan is one restored thread's replay in positions mode.
type threadPlan struct {
	thread, proc uint32
	events       []Det // its receive calls on gated connections, Pos relative to the restore
	points       []*point
	reads        []Det // events with bytes, in order: what the restored thread must consume
	readAt       []int // the index in events of each of reads
	next         int   // index of the next point to reach
	read         int   // index of the next read to match
	part         bool  // a part of reads[read] was consumed already (a read woke between two segments)
}

// stop is the Stop of point p of t.
func (t *threadPlan) stop(p *point) Stop {
	if p.after < 0 {
		return Stop{Polls: p.polls}
	}
	e := t.events[p.after]
	return Stop{Polls: e.Pos, Conn: e.Conn, End: e.End, Len: e.Len}
}

// planPositions builds the plans of threads from events (the gated connections' receive calls since the
// snapshot, in order) and base (each thread's readiness calls at the dump). It fails if positions cannot
// be replayed: two threads of one process receive (a stop of one stops both, and continuing one would
// cancel the other's pending stop), a call's count is below its thread's count at the dump, or a call was
// recorded where readiness calls are not counted (NoPos).
func planPositions(events []Det, base map[uint32]uint64) ([]*threadPlan, error) {
	byThread := map[uint32]*threadPlan{}
	readerOf := map[uint32]uint32{} // process -> its receiving thread
	var plans []*threadPlan
	for _, d := range events {
		t := byThread[d.Thread]
		if t == nil {
			if other, ok := readerOf[d.Proc]; ok {
				return nil, fmt.Errorf("threads %d and %d of process %d both receive: receive positions are replayed for one receiving thread per process", other, d.Thread, d.Proc)
			}
			t = &threadPlan{thread: d.Thread, proc: d.Proc}
			byThread[d.Thread], readerOf[d.Proc] = t, d.Thread
			plans = append(plans, t)
		}
		if t.proc != d.Proc {
			return nil, fmt.Errorf("thread %d is in processes %d and %d", d.Thread, t.proc, d.Proc)
		}
		if d.Pos == NoPos {
			// Recorded where readiness calls are not counted (a copy restored on a host with
			// log.receive_positions off, Store.SinceOn): there are no positions to replay.
			return nil, fmt.Errorf("thread %d's receive call %s was recorded on a host that counts no readiness calls (log.receive_positions off there)", d.Thread, d)
		}
		b := base[d.Thread]
		if d.Len == 0 && d.Pos <= b && len(t.events) == 0 {
			// A call that found nothing before the thread's first readiness call since the dump may be from
			// before the dump (Store.Since cannot tell): not a point to stop at.
			continue
		}
		if d.Pos < b {
			return nil, fmt.Errorf("thread %d's receive call %s comes after %d readiness calls, fewer than the %d at the dump", d.Thread, d, d.Pos, b)
		}
		d.Pos -= b
		t.events = append(t.events, d)
	}
	for _, t := range plans {
		at := map[[2]int]*point{}
		for k, d := range t.events {
			if d.Len == 0 {
				continue
			}
			t.reads = append(t.reads, d)
			t.readAt = append(t.readAt, k)
			key := [2]int{int(max(d.Pos, 1) - 1), -1}
			for j := k - 1; j >= 0; j-- {
				if e := t.events[j]; e.Conn == d.Conn {
					if e.Pos+1 >= d.Pos {
						key = [2]int{int(e.Pos), j}
					}
					break
				}
			}
			p := at[key]
			if p == nil {
				p = &point{polls: uint64(key[0]), after: key[1]}
				at[key] = p
				t.points = append(t.points, p)
			}
			p.add(d.Conn, d.End)
		}
		slices.SortFunc(t.points, func(a, b *point) int {
			return cmp.Or(cmp.Compare(a.polls, b.polls), cmp.Compare(a.after, b.after))
		})
	}
	return plans, nil
}

// UsePositions switches the gate to positions mode, base being each thread's readiness calls at the dump
// (the snapshot's). It fails, leaving the gate as it was, if its determinants cannot be replayed so.
func (g *Gate) UsePositions(base map[uint32]uint64) error {
	plans, err := planPositions(g.all, base)
	if err != nil {
		return err
	}
	preload := map[tcpflow.Tuple]uint32{}
	for _, t := range plans {
		for ; t.next < len(t.points) && t.points[t.next].start(); t.next++ {
			for _, in := range t.points[t.next].inject {
				if cur, ok := preload[in.conn]; !ok || seqAfter(in.end, cur) {
					preload[in.conn] = in.end
				}
			}
		}
	}
	g.plans, g.preload = plans, preload
	return nil
}

// Positions reports whether the gate replays receive positions.
func (g *Gate) Positions() bool { return g != nil && g.plans != nil }

// Preload is, in positions mode, how many of each connection's bytes (from its source's Seq) the restored
// socket must hold before the job runs: what its threads read before their first readiness call since the
// dump. The restore puts them in the images' receive queues; Run delivers the rest.
func (g *Gate) Preload() map[tcpflow.Tuple]uint32 {
	n := make(map[tcpflow.Tuple]uint32, len(g.preload))
	for c, end := range g.preload {
		n[c] = end - g.sources[c].Seq
	}
	return n
}

// ArmFirst arms, in positions mode, each receiving thread's first stop. It is called once the restored
// job's cgroup is known to stops and before any of its processes runs: a thread that got there first
// would run past it.
func (g *Gate) ArmFirst(stops Stopper) error {
	for _, t := range g.plans {
		if err := armNext(stops, t); err != nil {
			return fmt.Errorf("arm the first stop of thread %d: %w", t.thread, err)
		}
	}
	g.armed = true
	return nil
}

// armNext arms t's next stop, or disarms t if it has none left.
func armNext(stops Stopper, t *threadPlan) error {
	if t.next >= len(t.points) {
		return stops.Disarm(t.thread)
	}
	return stops.Arm(t.thread, t.stop(t.points[t.next]))
}

// runPositions is Run in positions mode; the job runs, its first stops armed (ArmFirst).
func (g *Gate) runPositions(ctx context.Context, events <-chan Event, stops Stopper, inject func(tcpflow.Tuple, uint32) error) error {
	if !g.armed {
		return errors.New("the restored job's first stops were not armed before it ran")
	}
	defer func() {
		// On failure a thread may be left stopped: the job is killed (or rolled back) by the caller.
		for _, t := range g.plans {
			stops.Disarm(t.thread)
		}
	}()
	byThread := map[uint32]*threadPlan{}
	left := 0
	for _, t := range g.plans {
		byThread[t.thread] = t
		left += len(t.reads)
	}
	for left > 0 {
		var e Event
		var ok bool
		select {
		case <-ctx.Done():
			return g.stuck(ctx, stops)
		case e, ok = <-events:
			if !ok {
				return fmt.Errorf("this host's recorder lost receive calls of the restored job (%d of its receive calls not seen yet)", left)
			}
		}
		e.Conn = e.Conn.Unmap()
		t := byThread[e.Thread]
		if !e.AtPoll && e.Len > 0 {
			if _, gated := g.sources[e.Conn]; gated {
				if t == nil || t.read >= len(t.reads) {
					return fmt.Errorf("the restored job's thread %d made a receive call the original did not (%s): %w", e.Thread, e.Det, ErrDiverged)
				}
				d := &t.reads[t.read]
				// Only this thread's calls are matched, in order: one that began before the recorded one
				// consumed bytes another process of the job read in the original (a socket read by two),
				// and ending where the recorded one ends does not make it that call.
				// And it must come after as many readiness calls as the recorded one (its first part: the rest
				// of a split read may follow another): matched on its bytes alone, a read at another call,
				// bytes a preload exposed early or read late, passed for the original's.
				from := e.Conn == d.Conn && e.End-e.Len == d.End-d.Len && (t.part || e.Pos == d.Pos)
				switch {
				case from && e.End == d.End:
					t.read++
					t.part = false
					left--
				case from && seqAfter(d.End, e.End) && seqAfter(e.End, d.End-d.Len):
					// Part of the bytes: a read woke between two injected segments. The rest follows.
					d.Len = d.End - e.End
					t.part = true
					// A stop armed right after this read waits for a call that returns all of it, which now
					// never comes: re-armed for the call that takes the rest, at this one's count.
					if k := t.readAt[t.read]; t.next < len(t.points) && t.points[t.next].after == k {
						t.events[k].Len, t.events[k].Pos = d.Len, e.Pos
						if err := armNext(stops, t); err != nil {
							return err
						}
					}
				default:
					return fmt.Errorf("thread %d's receive call %d of %d: the original %s, the restored job %s: %w", t.thread, t.read+1, len(t.reads), d, e.Det, ErrDiverged)
				}
			}
		}
		if e.StopErr != nil {
			return fmt.Errorf("thread %d of the restored job could not be stopped at %s: %w", e.Thread, e.Det, e.StopErr)
		}
		if !e.Stopped {
			continue
		}
		if t == nil || t.next >= len(t.points) {
			return fmt.Errorf("thread %d stopped where no stop was armed (%s)", e.Thread, e.Det)
		}
		p := t.points[t.next]
		want := t.stop(p)
		if e.AtPoll != (p.after < 0) || e.Pos != want.Polls || (!e.AtPoll && (e.Conn != want.Conn || e.End != want.End || e.Len != want.Len)) {
			return fmt.Errorf("thread %d stopped at %s, armed at %+v: %w", t.thread, e.Det, want, ErrDiverged)
		}
		// The thread stops before it runs any code of its own, but it may not have got there yet: the bytes
		// can be injected at once, and the next stop armed, only once it is there.
		if err := stops.WaitStopped(ctx, e.Pid); err != nil {
			return fmt.Errorf("thread %d of the restored job, stopped at %+v: %w", t.thread, want, err)
		}
		for _, in := range p.inject {
			if err := inject(in.conn, in.end); err != nil {
				return err
			}
		}
		t.next++
		if err := armNext(stops, t); err != nil {
			return err
		}
		if err := stops.Continue(e.Pid); err != nil {
			return fmt.Errorf("continue thread %d of the restored job: %w", t.thread, err)
		}
	}
	return nil
}

// stuck says where the positions replay stood when ctx ended.
func (g *Gate) stuck(ctx context.Context, stops Stopper) error {
	for _, t := range g.plans {
		if t.read < len(t.reads) {
			at := "running"
			if t.next < len(t.points) {
				at = fmt.Sprintf("its stop at %+v not reached", t.stop(t.points[t.next]))
			}
			if d := stops.Describe(t.thread); d != "" {
				at += ", " + d
			}
			return fmt.Errorf("thread %d of the restored job did not make its receive call %d of %d (%s; %s): %w", t.thread, t.read+1, len(t.reads), t.reads[t.read], at, context.Cause(ctx))
		}
	}
	return context.Cause(ctx)
}
