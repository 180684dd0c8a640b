package record

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/procstate"
	"github.com/ftkit/ftkit/tcpflow"
)

func newTestRecorder() *Recorder { return newRecorder(Options{ShipEvery: DefaultShipEvery}) }

// TestWatchOrderJobEnds: a job that ends while a recovery watches it closes the watcher once; the watcher's
// stop afterwards must not close it again (it did: a panic).
func TestWatchOrderJobEnds(t *testing.T) {
	d := newTestRecorder()
	s := &stream{job: "j", cgroup: 7, watchers: map[chan intercept.Event]bool{}}
	d.byJob["j"], d.byCgroup[7] = s, s
	ch, stop := d.watch("j")
	if got := d.unwatch("j"); got != s {
		t.Fatalf("unwatch returned %p, want the job's stream", got)
	}
	if _, open := <-ch; open {
		t.Fatal("the watcher of an ended job is still open")
	}
	stop() // must not panic
	if len(d.byJob) != 0 || len(d.byCgroup) != 0 {
		t.Fatalf("streams left: %v %v", d.byJob, d.byCgroup)
	}
}

// TestWatchOrderNeverRegistered: a watch for a job whose restore never registered it leaves nothing behind.
func TestWatchOrderNeverRegistered(t *testing.T) {
	d := newTestRecorder()
	_, stop := d.watch("j")
	if d.byJob["j"] == nil {
		t.Fatal("no placeholder stream while watching")
	}
	stop()
	stop() // twice is fine
	if len(d.byJob) != 0 {
		t.Fatalf("placeholder left: %v", d.byJob)
	}
}

// TestWatchOrderWakesOnlyWhileWatched: the recorder wakes the agent for every call only while some recovery
// watches a restored job's calls (the gate waits for each); otherwise it is polled, which costs the job's
// receive calls less.
func TestWatchOrderWakesOnlyWhileWatched(t *testing.T) {
	d := newTestRecorder()
	var sets []bool
	d.setWake = func(on bool) error { sets = append(sets, on); return nil }
	_, stopA := d.watch("a")
	_, stopB := d.watch("b")
	if len(sets) != 1 || !sets[0] || !d.waking {
		t.Fatalf("after two watches: wakeup switched %v, want on once", sets)
	}
	stopA()
	if len(sets) != 1 {
		t.Fatalf("one watcher left: wakeup switched %v, want still on", sets)
	}
	stopB()
	if len(sets) != 2 || sets[1] || d.waking {
		t.Fatalf("no watcher left: wakeup switched %v, want off", sets)
	}
	s := &stream{job: "j", cgroup: 7, watchers: map[chan intercept.Event]bool{}}
	d.byJob["j"], d.byCgroup[7] = s, s
	_, stop := d.watch("j")
	d.unwatch("j") // the job ended while watched
	if len(sets) != 4 || sets[3] {
		t.Fatalf("watched job ended: wakeup switched %v, want on then off", sets)
	}
	stop()
}

// TestWatchOrderAlwaysWakes: with log.receive_order_ship_every = 0 the recorder wakes the agent for every
// call from the start, and a recovery's watcher leaving does not switch that off.
func TestWatchOrderAlwaysWakes(t *testing.T) {
	d := newTestRecorder()
	d.waking, d.alwaysWake = true, true
	var sets []bool
	d.setWake = func(on bool) error { sets = append(sets, on); return nil }
	_, stop := d.watch("a")
	stop()
	if len(sets) != 0 || !d.waking {
		t.Fatalf("wakeup switched %v, want it left on", sets)
	}
}

// TestStopsAndContinueStopped: WaitStopped returns once a stopped process's threads are all stopped, and
// ContinueStopped (an agent resuming a recovery whose positions gate died with the previous agent)
// continues a job's stopped processes, and only those.
func TestStopsAndContinueStopped(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var pids []int
	for range 2 {
		cmd := exec.CommandContext(ctx, "sleep", "60")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		pids = append(pids, cmd.Process.Pid)
	}
	stopped, running := pids[0], pids[1]
	if err := unix.Kill(stopped, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if err := (jobStops{}).WaitStopped(ctx, uint32(stopped)); err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancelShort()
	if err := (jobStops{}).WaitStopped(short, uint32(running)); err == nil || !strings.Contains(err.Error(), "still run") {
		t.Fatalf("WaitStopped of a running process: %v, want it to say its threads still run", err)
	}
	dir := t.TempDir() // stands in for the job's cgroup: only its cgroup.procs is read
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), fmt.Appendf(nil, "%d\n%d\n", stopped, running), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ContinueStopped(dir); err != nil {
		t.Fatal(err)
	}
	for {
		if r, err := procstate.RunningThreads(stopped); err != nil {
			t.Fatal(err)
		} else if len(r) > 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("ContinueStopped did not continue the stopped process")
		case <-time.After(time.Millisecond):
		}
	}
}

// TestStopsDescribe: a replay that timed out names the thread's host id, state and system call, found by
// its id in the job's PID namespace (here the test's own: a thread blocked in a read of a pipe).
func TestStopsDescribe(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	tids := make(chan int)
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread() // the thread blocks in read(2) below, not in the Go scheduler
		defer close(done)
		tids <- unix.Gettid()
		unix.Read(int(r.Fd()), make([]byte, 1))
	}()
	tid := <-tids
	defer func() { w.Write([]byte{0}); <-done; r.Close() }()
	dir := t.TempDir() // stands in for the job's cgroup: only its cgroup.threads is read
	if err := os.WriteFile(filepath.Join(dir, "cgroup.threads"), fmt.Appendf(nil, "%d\n%d\n", os.Getpid(), tid), 0o600); err != nil {
		t.Fatal(err)
	}
	s := jobStops{dir: dir}
	want := fmt.Sprintf("host thread %d (state S, system call %d,", tid, unix.SYS_READ)
	for start := time.Now(); ; time.Sleep(time.Millisecond) {
		got := s.Describe(uint32(tid))
		if strings.Contains(got, want) {
			break
		}
		if time.Since(start) > time.Minute {
			t.Fatalf("Describe = %q, want it to contain %q", got, want)
		}
	}
	if got := s.Describe(1 << 30); !strings.Contains(got, "no thread of the job has id") {
		t.Errorf("Describe of an unknown thread = %q", got)
	}
}

// TestReleaseHeld: a process held after a receive call is continued once the determinants up to its call
// are stored at the protector, not before; stopping sees a stopped process and one with a SIGSTOP pending.
func TestReleaseHeld(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	start := func() int {
		cmd := exec.CommandContext(ctx, "sleep", "60")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd.Process.Pid
	}
	early, late, running := start(), start(), start()
	for _, pid := range []int{early, late} {
		if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		if err := (jobStops{}).WaitStopped(ctx, uint32(pid)); err != nil {
			t.Fatal(err)
		}
		if !stopping(pid) {
			t.Fatalf("stopping(%d) = false for a stopped process", pid)
		}
	}
	if stopping(running) {
		t.Fatalf("stopping(%d) = true for a running process", running)
	}
	a := newTestRecorder()
	s := &stream{job: "j", first: 10, held: []heldProc{{pid: uint32(early), upTo: 10}, {pid: uint32(late), upTo: 12}}}
	a.releaseHeld(s, false)
	isRunning := func(pid int) bool {
		r, err := procstate.RunningThreads(pid)
		return err == nil && len(r) > 0
	}
	for !isRunning(early) {
		if ctx.Err() != nil {
			t.Fatal("the process whose determinants are stored was not continued")
		}
		time.Sleep(time.Millisecond)
	}
	if isRunning(late) || len(s.held) != 1 || s.held[0].pid != uint32(late) {
		t.Fatalf("the process whose determinant is not stored yet was released: held %v", s.held)
	}
	s.first = 12
	a.releaseHeld(s, false)
	for !isRunning(late) {
		if ctx.Err() != nil {
			t.Fatal("the second process was not continued once its determinant was stored")
		}
		time.Sleep(time.Millisecond)
	}
	if len(s.held) != 0 {
		t.Fatalf("held %v after every release", s.held)
	}
}

// TestTakeDeterminant: a recorded call becomes its job's determinant, a held one also a hold until its
// determinant is stored; a read on a socket already closed (local port 0) is no determinant (it made the
// protector refuse every later batch of the job) and its process, if held, is released at once; so is a
// held call of a job this host does not record.
func TestTakeDeterminant(t *testing.T) {
	a := newTestRecorder()
	s := &stream{job: "j", cgroup: 7, watchers: map[chan intercept.Event]bool{}}
	a.byJob["j"], a.byCgroup[7] = s, s
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	closed := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:0"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	now := time.Now()
	for i, tc := range []struct {
		e       ebpfprobes.RecvEvent
		release uint32
		pending int
		held    int
	}{
		{ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Len: 10, Pid: 100}, 0, 1, 0},
		{ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 20, Len: 10, Pid: 100, Held: true}, 0, 2, 1},
		{ebpfprobes.RecvEvent{Cgroup: 7, Conn: closed, CopiedSeq: 30, Len: 5, Pid: 100, Held: true}, 100, 2, 1},
		{ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 30, Len: 0, Pid: 100, Held: true, StopErr: unix.ESRCH}, 0, 3, 1},
		{ebpfprobes.RecvEvent{Cgroup: 9, Conn: conn, CopiedSeq: 30, Len: 5, Pid: 101, Held: true}, 101, 3, 1},
	} {
		if got := a.take(tc.e, now); got != tc.release || len(s.pending) != tc.pending || len(s.held) != tc.held {
			t.Fatalf("event %d: release %d, %d pending, %d held; want %d, %d, %d", i, got, len(s.pending), len(s.held), tc.release, tc.pending, tc.held)
		}
	}
	if h := s.held[0]; h.pid != 100 || h.upTo != 2 {
		t.Errorf("hold %+v, want process 100 until determinant 2 is stored", h)
	}
}

// TestTakeStoppedNonConsumingCall: a stop a replay of receive positions armed after a call that found
// nothing (Stop.Len 0) is also met by a call that consumes nothing of the stream (MSG_PEEK, MSG_ERRQUEUE,
// MSG_OOB) at the same copied_seq: the recorder sends the thread SIGSTOP there too (bpf/recvorder.c does
// not look at the flags). No determinant is ever such a call, so the stop was not the gate's; the event
// went to no watcher, and the thread stayed stopped until the replay timed out and the job was killed.
// Its process is released at once; the stop stays armed for the call it was meant for.
func TestTakeStoppedNonConsumingCall(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	for _, tc := range []struct {
		name    string
		e       ebpfprobes.RecvEvent
		release uint32
	}{
		{"peek found nothing, stopped", ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Flags: unix.MSG_PEEK, Pid: 100, Stopped: true}, 100},
		{"error queue empty, stopped", ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Flags: unix.MSG_ERRQUEUE, Pid: 100, Stopped: true}, 100},
		{"peek, not stopped", ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Flags: unix.MSG_PEEK, Pid: 100}, 0},
		{"peek, its stop failed", ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Flags: unix.MSG_PEEK, Pid: 100, StopErr: unix.ESRCH}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newTestRecorder()
			s := &stream{job: "j", cgroup: 7, watchers: map[chan intercept.Event]bool{}}
			a.byJob["j"], a.byCgroup[7] = s, s
			w := make(chan intercept.Event, 1)
			s.watchers[w] = true
			if got := a.take(tc.e, time.Now()); got != tc.release {
				t.Fatalf("release %d, want %d (a process stopped where no gate waits stays stopped)", got, tc.release)
			}
			if len(s.pending) != 0 || len(w) != 0 {
				t.Fatalf("%d determinants, %d events to the gate: a call that consumed nothing is neither", len(s.pending), len(w))
			}
		})
	}
}

func TestRecordPause(t *testing.T) {
	for _, c := range []struct{ ship, want time.Duration }{
		{DefaultShipEvery, DefaultShipEvery}, // reads on the shipping grid
		{2 * time.Millisecond, 2 * time.Millisecond},
		{time.Millisecond, time.Millisecond},
		{100 * time.Microsecond, time.Millisecond}, // never below a millisecond
		{MaxShipEvery, 100 * time.Millisecond},
	} {
		if got := recordPause(c.ship); got != c.want {
			t.Errorf("recordPause(%s) = %s, want %s", c.ship, got, c.want)
		}
	}
}

// TestLostBeforeStreamIsNoHole: a job's stream starts at the recorder's count of its lost calls, the host's
// unattributed losses included (ebpfprobes.RecvOrder.Lost adds them to every job's). Started at 0, a job
// started or adopted after any loss on the host took it for its own at the next loss anywhere: its pending
// determinants went, its record started over, and a recovery from its snapshot was refused for nothing.
// A loss that moves its own count still makes a hole.
func TestLostBeforeStreamIsNoHole(t *testing.T) {
	r := newTestRecorder()
	unattributed := uint64(3) // lost on this host before the job came
	perJob := map[uint64]uint64{}
	r.lostOf = func(cg uint64) (uint64, error) { return perJob[cg] + unattributed, nil }
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}

	r.startStream("j", 7, true, "")
	r.startStream("k", 9, true, "")
	r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Len: 10, Pid: 100}, time.Now())
	s := r.byJob["j"]
	perJob[9]++ // another job loses a call: the total moves
	r.mu.Lock()
	r.noticeLost()
	r.mu.Unlock()
	if len(s.pending) != 1 || s.first != 0 || !s.fromStart {
		t.Fatalf("job j: %d pending from %d, fromStart %v after a loss of job k: a hole it does not have", len(s.pending), s.first, s.fromStart)
	}
	if k := r.byJob["k"]; k.first == 0 || k.fromStart {
		t.Fatalf("job k lost a call and its stream has no hole (first %d, fromStart %v)", k.first, k.fromStart)
	}
	unattributed++ // a loss no job is known for: any job's may have been lost
	r.mu.Lock()
	r.noticeLost()
	r.mu.Unlock()
	if s.first == 0 || s.fromStart {
		t.Fatalf("job j kept its stream (first %d) across a loss that may have been its own", s.first)
	}
}

// TestLostUnreadableMakesHole: the recorder's total of lost calls moved, and a job's own count cannot be
// read. The loss may be the job's: its record must start over. It went on as if nothing was lost, and the
// total, already taken, never called for a look again: the protector's record bridged the lost call.
func TestLostUnreadableMakesHole(t *testing.T) {
	r := newTestRecorder()
	readable := true
	r.lostOf = func(cg uint64) (uint64, error) {
		if !readable {
			return 0, fmt.Errorf("lookup of cgroup %d: no such device", cg)
		}
		return 0, nil
	}
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	r.startStream("j", 7, true, "")
	r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Len: 10, Pid: 100}, time.Now())
	s := r.byJob["j"]
	readable = false
	r.mu.Lock()
	r.noticeLost()
	r.mu.Unlock()
	if s.first == 0 || s.fromStart || len(s.pending) != 0 {
		t.Fatalf("job j: %d pending from %d, fromStart %v after a loss its count could not rule out: no hole", len(s.pending), s.first, s.fromStart)
	}
}

// stoppedSleep starts a process and stops it, as the recorder's hold does to a pessimistic job's process.
func stoppedSleep(ctx context.Context, t *testing.T) int {
	t.Helper()
	cmd := exec.Command("sleep", "60") // killed by the cleanup only: a kill at ctx's end would look like a continue
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	pid := cmd.Process.Pid
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if err := (jobStops{}).WaitStopped(ctx, uint32(pid)); err != nil {
		t.Fatal(err)
	}
	return pid
}

// waitContinued waits until process pid runs again, failing with what once ctx ends.
func waitContinued(ctx context.Context, t *testing.T, pid int, what string) {
	t.Helper()
	for {
		if r, err := procstate.RunningThreads(pid); err == nil && len(r) > 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal(what)
		case <-time.After(time.Millisecond):
		}
	}
}

// unreachable has r's protector never answer: only a hole can release a held process.
func unreachable(r *Recorder) {
	r.protector = func(string) (string, bool) { return "n2", true }
	r.open = func(context.Context, string) (detStream, error) { return nil, errors.New("connection refused") }
}

// TestRecordUnreadableCallMakesHole: the recorder returns a batch with an error, an undecodable event in it
// (ebpfprobes.RecvOrder.ReadBatch returns the batch's other events with it) or a broken ring. record quit on
// any error: the batch's calls were thrown away, a pessimistic job's process held at one of them stayed
// stopped for good, and no stream got a hole, so that the protectors' records bridged the lost call. Now an
// undecodable call makes a hole in every job's record (it may have been any job's) and the recorder goes
// on; a broken ring does the same, then stops holding the jobs and continues the held.
func TestRecordUnreadableCallMakesHole(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	for _, tc := range []struct {
		name   string
		err    error
		goesOn bool
	}{
		{"undecodable", fmt.Errorf("recvorder: %w: kind 7", ebpfprobes.ErrBadRecvEvent), true},
		{"broken ring", fmt.Errorf("recvorder: read ring buffer record of 64 bytes: %w", io.ErrUnexpectedEOF), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			pid := stoppedSleep(ctx, t)
			r := newTestRecorder()
			unreachable(r)
			r.pessimistic = true
			r.lostOf = func(uint64) (uint64, error) { return 0, nil }
			r.lostTotal = func() (uint64, error) { return 0, nil }
			var unheld []uint64
			r.unhold = func(cg uint64) error { unheld = append(unheld, cg); return nil }
			r.startStream("j", 7, true, "")
			r.startStream("k", 9, true, "")
			r.mu.Lock()
			r.take(ebpfprobes.RecvEvent{Cgroup: 9, Conn: conn, CopiedSeq: 10, Len: 10, Pid: 1}, time.Now()) // read before
			r.mu.Unlock()
			watcher, stopWatch := r.watch("j")
			defer stopWatch()
			readAgain := make(chan struct{})
			reads := 0
			r.read = func(ctx context.Context, dst []ebpfprobes.RecvEvent) ([]ebpfprobes.RecvEvent, error) {
				if reads++; reads == 1 {
					return append(dst,
						ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Len: 10, Pid: uint32(pid), Held: true},
						ebpfprobes.RecvEvent{Cgroup: 9, Conn: conn, CopiedSeq: 20, Len: 10, Pid: 1}), tc.err
				}
				if reads == 2 {
					close(readAgain)
				}
				<-ctx.Done()
				return dst, ctx.Err()
			}
			recorded := make(chan struct{})
			shipCtx, stopShip := context.WithCancel(ctx)
			shipped := make(chan struct{})
			go func() { defer close(recorded); r.record(ctx) }()
			go func() { defer close(shipped); r.ship(shipCtx) }()
			defer func() { stopShip(); <-shipped }()
			select {
			case <-readAgain:
				if !tc.goesOn {
					t.Fatal("the recorder read on past a broken ring")
				}
			case <-recorded:
				if tc.goesOn {
					t.Fatalf("the recorder stopped at one undecodable call (%v): the jobs' receive order is no longer recorded", tc.err)
				}
			}
			r.mu.Lock()
			for _, job := range []string{"j", "k"} {
				if s := r.byJob[job]; s.first == 0 || s.fromStart || len(s.pending) != 0 {
					t.Errorf("job %s: %d determinants pending from %d, fromStart %v after a call that could not be read: no hole", job, len(s.pending), s.first, s.fromStart)
				}
			}
			r.mu.Unlock()
		drain:
			for {
				select {
				case _, open := <-watcher:
					if !open {
						break drain
					}
				default:
					t.Error("the watcher of job j is still open after a call that could not be read: it must not go on")
					break drain
				}
			}
			waitContinued(ctx, t, pid, "the process held at a call of the batch stays stopped")
			if !tc.goesOn {
				slices.Sort(unheld)
				r.mu.Lock()
				pessimistic := r.pessimistic
				r.mu.Unlock()
				if !slices.Equal(unheld, []uint64{7, 9}) || pessimistic {
					t.Errorf("the recorder stopped and holds jobs still: unheld %v, pessimistic %v; want jobs 7 and 9 no longer held", unheld, pessimistic)
				}
			}
			cancel()
			<-recorded
		})
	}
}

// TestHeldInHoleReleased: a pessimistic job's process is held until its call's determinant is stored.
// When the recorder loses calls (its ring was full), the job's pending determinants go in a hole: nothing
// the process waits for will be stored. Only an answer of the protector released it, and the job had
// nothing left to send, so none came: the process stayed stopped for good (and with it the job).
func TestHeldInHoleReleased(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	pid := stoppedSleep(ctx, t)
	r := newTestRecorder()
	unreachable(r)
	lost := uint64(0)
	r.lostOf = func(uint64) (uint64, error) { return lost, nil }
	r.startStream("j", 7, true, "")
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	shipped := make(chan struct{})
	go func() { defer close(shipped); r.ship(ctx) }()
	defer func() { cancel(); <-shipped }()
	r.mu.Lock()
	r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Len: 10, Pid: uint32(pid), Held: true}, time.Now())
	lost++ // read in the same batch: the job lost a call
	r.noticeLost()
	r.mu.Unlock()
	r.wake <- struct{}{} // as record does after each batch
	waitContinued(ctx, t, pid, "the process held for a determinant that went in a hole stays stopped")
}

// TestStreamReplacedReleasesHeld: a job registered again on this host (Watch) while its earlier stream
// here held a process: that stream is gone, with nothing to ship its determinants or release the process,
// which stayed stopped for good; an earlier cgroup stayed held and counted in the recorder's maps.
func TestStreamReplacedReleasesHeld(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	for _, tc := range []struct {
		name      string
		newCgroup uint64
		dropped   []uint64 // cgroups whose holds and counts must go
	}{
		{"same cgroup", 7, nil},
		{"new cgroup", 8, []uint64{7}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			pid := stoppedSleep(ctx, t)
			r := newTestRecorder()
			r.pessimistic = true
			r.lostOf = func(uint64) (uint64, error) { return 0, nil }
			var unheld, forgot []uint64
			r.unhold = func(cg uint64) error { unheld = append(unheld, cg); return nil }
			r.forget = func(cg uint64) error { forgot = append(forgot, cg); return nil }
			r.startStream("j", 7, true, "")
			r.mu.Lock()
			r.take(ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: 10, Len: 10, Pid: uint32(pid), Held: true}, time.Now())
			r.mu.Unlock()
			r.startStream("j", tc.newCgroup, true, "")
			waitContinued(ctx, t, pid, "the process held by the job's replaced stream stays stopped")
			if !slices.Equal(unheld, tc.dropped) || !slices.Equal(forgot, tc.dropped) {
				t.Errorf("recorder maps: unheld %v, forgot %v; want %v", unheld, forgot, tc.dropped)
			}
		})
	}
}

// TestSpareWithoutPositionsPlansNone: job j, snapshotted with receive positions on n1 (its thread had made
// 5 readiness calls at the dump), was restored on n2, whose agent counts no readiness calls
// (log.receive_positions off), read its two connections there and failed before a snapshot of its own; it
// is restored from the snapshot again, on a spare that counts. n2's record is the order to replay
// (intercept.Store.SinceOn), and it holds no positions: each call's Pos was a 0 that passed for a count, the
// snapshot's count was added to it, and the gate replayed every read at made-up positions (the first of
// each connection before the job ran), saying "receive order and positions replayed". It must replay the
// order alone.
func TestSpareWithoutPositionsPlansNone(t *testing.T) {
	connA := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	connB := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.3:40001")}
	n2 := newTestRecorder() // its recorder counts no readiness calls
	s := &stream{job: "j", cgroup: 7, fromStart: true, base: "s", watchers: map[chan intercept.Event]bool{}}
	n2.byJob["j"], n2.byCgroup[7] = s, s
	for _, e := range []ebpfprobes.RecvEvent{
		{Cgroup: 7, Conn: connA, CopiedSeq: 15, Len: 10, Thread: 1, Proc: 1, Pid: 100},
		{Cgroup: 7, Conn: connB, CopiedSeq: 10, Len: 10, Thread: 1, Proc: 1, Pid: 100},
		{Cgroup: 7, Conn: connA, CopiedSeq: 25, Len: 10, Thread: 1, Proc: 1, Pid: 100},
		{Cgroup: 7, Conn: connB, CopiedSeq: 20, Len: 10, Thread: 1, Proc: 1, Pid: 100},
	} {
		n2.take(e, time.Now())
	}
	st := intercept.NewStore(0, 0)
	// n1's record: A up to 5 before the dump, then nothing (it failed right after).
	st.Add("n1", intercept.Batch{Job: "j", Stream: 1, FromStart: true, Dets: []intercept.Det{{Conn: connA, End: 5, Len: 5, Thread: 1, Proc: 1, Pos: 5}}})
	st.Add("n2", intercept.Batch{Job: "j", Stream: s.id, FromStart: s.fromStart, Base: s.base, Dets: s.pending})
	m := &ckpt.Manifest{ID: "s", Job: "j", Node: "n1", Info: ckpt.Info{Positions: true, Polls: map[uint32]uint64{1: 5},
		Conns: []ckpt.Conn{{Tuple: connA, InqSeq: 5}, {Tuple: connB, InqSeq: 0}}}}
	dets, err := st.SinceOn(m, "n2")
	if err != nil {
		t.Fatal(err)
	}
	if len(dets) != 4 {
		t.Fatalf("%d determinants since the snapshot, want n2's 4: %v", len(dets), dets)
	}
	g, err := intercept.NewGate(dets, map[tcpflow.Tuple]intercept.Source{connA: {Seq: 5, Data: make([]byte, 20)}, connB: {Seq: 0, Data: make([]byte, 20)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.UsePositions(m.Polls); err == nil {
		t.Fatalf("positions replayed from a record of a host that counts none (preload %v)", g.Preload())
	}
	if g.Positions() {
		t.Fatal("the gate is in positions mode after refusing them")
	}
}

// TestLostAfterUnreadCallsMakesHoleAfterThem: the ring overflowed, and the read after which the agent saw
// the loss did not drain it (a full batch: a 64 MiB ring holds hundreds of thousands of calls, a read takes
// 4096). The calls still in the ring were recorded before the lost one. The hole went after the calls read,
// and the ring's rest, read next, began the new record with the lost call inside it: the protector's record
// bridged it, taken for complete.
func TestLostAfterUnreadCallsMakesHoleAfterThem(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:5001"), Remote: netip.MustParseAddrPort("10.0.0.1:40000")}
	r := newTestRecorder()
	var lost atomic.Uint64
	r.lostOf = func(uint64) (uint64, error) { return lost.Load(), nil }
	r.lostTotal = func() (uint64, error) { return lost.Load(), nil }
	r.startStream("j", 7, true, "")
	call := func(end uint32) ebpfprobes.RecvEvent {
		return ebpfprobes.RecvEvent{Cgroup: 7, Conn: conn, CopiedSeq: end, Len: 1, Pid: 100}
	}
	const beforeLoss = 5000 // the ring's rest at the loss: the calls after the first read's, then the lost one
	readAgain := make(chan struct{})
	reads := 0
	r.read = func(ctx context.Context, dst []ebpfprobes.RecvEvent) ([]ebpfprobes.RecvEvent, error) {
		switch reads++; reads {
		case 1: // a full batch; the ring overflows meanwhile, after the calls it still holds
			for n := cap(dst); len(dst) < n; {
				dst = append(dst, call(uint32(len(dst)+1)))
			}
			lost.Store(1)
			return dst, nil
		case 2: // the rest recorded before the loss, then a call after it
			for end := uint32(cap(dst) + 1); end <= beforeLoss; end++ {
				dst = append(dst, call(end))
			}
			return append(dst, call(beforeLoss+2)), nil // beforeLoss+1 was lost
		case 3:
			close(readAgain)
		}
		<-ctx.Done()
		return dst, ctx.Err()
	}
	recorded := make(chan struct{})
	go func() { defer close(recorded); r.record(ctx) }()
	defer func() { cancel(); <-recorded }()
	select {
	case <-readAgain:
	case <-ctx.Done():
		t.Fatal("the recorder did not read three times")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byJob["j"]
	for i, d := range s.pending {
		if d.End <= beforeLoss && i+1 < len(s.pending) && s.pending[i+1].End > beforeLoss+1 {
			t.Fatalf("the job's record holds the call that ended at %d and then the one at %d, from %d, without the lost call between them: a hole bridged", d.End, s.pending[i+1].End, s.first)
		}
	}
}
