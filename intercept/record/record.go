// Package record is the member's side of receive-order determinants (package intercept): it reads the
// receive calls of this host's jobs off the recorder (ebpfprobes.RecvOrder), numbers them per job, ships
// them to each job's protector, holds a pessimistic job's processes until their determinants are stored,
// and lets a recovery watch a restored job's calls (the gate's events) and stop its threads (Stopper).
//
// The protector's side is intercept.Store; the agent wires both to the cluster protocol.
package record

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/internal/tickgrid"
)

// Peers is what shipping needs of the cluster protocol's client.
type Peers interface {
	DeterminantStream(ctx context.Context, peer string) (*clusterapi.DeterminantStream, error)
	Determinants(ctx context.Context, peer string, req clusterapi.DeterminantsRequest) error
}

// detStream is an open determinant stream (clusterapi.DeterminantStream).
type detStream interface {
	Send(ctx context.Context, req clusterapi.DeterminantsRequest) error
	Stale() bool
	Close() error
}

// Metrics counts what shipping did (metrics.Metrics).
type Metrics interface {
	DeterminantsShipped(n int, lag time.Duration) // n sent to a protector, lag after the oldest was read
	DeterminantsHole()                            // a job's record starts over (calls lost)
}

// Options configure a Recorder.
type Options struct {
	Logger *slog.Logger
	// Record loads the recorder (the host logs its jobs' traffic and log.receive_order is on). Without it
	// the Recorder records nothing and every method is a no-op.
	Record bool
	// Positions also counts each thread's readiness calls (log.receive_positions); Pessimistic holds a
	// job's processes after each receive call until its determinant is stored (log.pessimistic).
	Positions, Pessimistic bool
	CgroupParent           string // the agents' cgroup: calls of tasks below it are recorded
	RingBytes              int    // the recorder's ring buffer
	// ShipEvery is log.receive_order_ship_every: at most one shipping round in each interval of its grid
	// (0: the agent is woken for every call and ships it at once).
	ShipEvery time.Duration
	// Protector names job's protector now, false if it has none.
	Protector func(job string) (string, bool)
	// Peers is the client of the other members, asked for at each round.
	Peers   func() Peers
	Metrics Metrics
}

// A Recorder records this host's jobs' receive calls and ships them. rec is nil when the recorder could
// not be loaded (or Options.Record was false): the jobs of this host then have no determinants, and their
// recoveries replay without them (checked all the same).
type Recorder struct {
	log *slog.Logger
	rec *ebpfprobes.RecvOrder
	// lostOf is the recorder's count of a job cgroup's lost calls (rec.Lost; a test's stands in), and
	// read, lostTotal, unhold and forget are rec.ReadBatch, rec.LostTotal, rec.SetPessimistic(cgroup, false)
	// and rec.Forget.
	lostOf    func(cgroup uint64) (uint64, error)
	forget    func(cgroup uint64) error
	read      func(ctx context.Context, dst []ebpfprobes.RecvEvent) ([]ebpfprobes.RecvEvent, error)
	lostTotal func() (uint64, error)
	unhold    func(cgroup uint64) error
	shipEvery time.Duration
	protector func(job string) (string, bool)
	peers     func() Peers
	metrics   Metrics

	mu       sync.Mutex
	byCgroup map[uint64]*stream
	byJob    map[string]*stream
	wake     chan struct{}
	// setWake switches the recorder's wakeup for every call (nil without a recorder); waking mirrors it.
	// alwaysWake keeps it on (log.receive_order_ship_every = 0: every call shipped at once).
	setWake    func(on bool) error
	waking     bool
	alwaysWake bool
	pause      time.Duration // recordPause: how long calls gather between two reads while polled
	// counts: the recorder counts readiness calls (rec.Positions()), so a call's Polls is its position.
	counts bool
	// pessimistic: each job's processes are held after each consuming receive call until its determinant
	// is at the protector (log.pessimistic).
	pessimistic bool
	// streams are the open determinant streams, by protector, and noStream the protectors that serve none
	// (agents of an earlier version: they get requests); only Ship uses them. open opens a stream (a
	// test's stands in for the cluster protocol).
	streams  map[string]detStream
	noStream map[string]bool
	open     func(ctx context.Context, peer string) (detStream, error)
	// answerEvery is how long a job's batches go unanswered at most (answerEvery, the const).
	answerEvery time.Duration
}

// stream is one job's determinants on this host, numbered from 0 when the agent began recording it.
type stream struct {
	job       string
	cgroup    uint64
	id        uint64
	first     uint64          // index of pending[0]
	fromStart bool            // recording began before the job's processes ran here
	base      string          // the snapshot the job was restored from here
	pending   []intercept.Det // not answered by the protector yet
	readAt    time.Time       // when pending[0] was read off the recorder
	// sent is how many of pending went on sentOn (the stream to the protector; nil: requests, each
	// answered) without an answer yet, and unsentAt when pending[sent] was read. answeredAt is when the
	// protector last answered.
	sent       int
	sentOn     detStream
	unsentAt   time.Time
	answeredAt time.Time
	lost       uint64 // the recorder's count of this job's lost calls, when last read
	// lostUnread: a loss of the job was seen while calls recorded before it may still be in the ring (the
	// read before did not drain it): once a read has drained them, the record starts over again after them.
	lostUnread bool
	watchers   map[chan intercept.Event]bool
	// refusedBy is the protector that refused the job's last batch for good, "" once one was taken: only
	// the first refusal of a run is logged as an error.
	refusedBy string
	// held are the job's processes the recorder stopped after a receive call (pessimistic), each until
	// the determinants up to its call's are at the protector. holdMu orders their release with a
	// snapshot, which must not dump a process stopped so (ReleaseForDump).
	held   []heldProc
	holdMu sync.Mutex
}

// heldProc is a process held until the determinants before index upTo of its stream are stored.
type heldProc struct {
	pid  uint32
	upTo uint64
}

// maxPendingDets bounds the determinants a job keeps while its protector does not take them: beyond it
// they are dropped (a hole: a replay from the current snapshot is refused, never wrong).
const maxPendingDets = 1 << 20

// New loads the recorder if o.Record.
func New(o Options) *Recorder {
	r := newRecorder(o)
	if !o.Record {
		return r
	}
	// Polled while calls keep coming (read a pause late, shipped in batches: log.receive_order_ship_every);
	// woken for every call only while a recovery's gate waits for each restored call (wakeForWatchers),
	// or always if asked, which costs about 1.5 us more per receive call (docs/ebpf-logging.md).
	// A held process waits for its call to be read: woken for every call, not a pause late.
	alwaysWake := o.ShipEvery == 0 || o.Pessimistic
	rec, err := ebpfprobes.NewRecvOrder(ebpfprobes.RecvOrderOptions{CgroupParent: o.CgroupParent, RingBufferSize: o.RingBytes,
		WakeEveryEvent: alwaysWake, Positions: o.Positions, PollInterval: r.pause, Logger: r.log})
	if err != nil {
		r.log.Error("the receive-order recorder could not be loaded: restored jobs re-read their sockets in any order (a program that reads the first socket with data then fails its recovery, loudly)", "err", err)
		return r
	}
	r.rec, r.setWake, r.lostOf, r.read, r.lostTotal = rec, rec.SetWakeEveryEvent, rec.Lost, rec.ReadBatch, rec.LostTotal
	r.unhold, r.forget = func(cgroup uint64) error { return rec.SetPessimistic(cgroup, false) }, rec.Forget
	r.waking, r.alwaysWake, r.pessimistic, r.counts = alwaysWake, alwaysWake, o.Pessimistic, rec.Positions()
	return r
}

// newRecorder is a Recorder without the recorder loaded.
func newRecorder(o Options) *Recorder {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Recorder{log: log, shipEvery: o.ShipEvery, protector: o.Protector, peers: o.Peers, metrics: o.Metrics,
		byCgroup: map[uint64]*stream{}, byJob: map[string]*stream{}, wake: make(chan struct{}, 1), pause: recordPause(o.ShipEvery),
		streams: map[string]detStream{}, noStream: map[string]bool{}, answerEvery: answerEvery, open: func(ctx context.Context, peer string) (detStream, error) {
			st, err := o.Peers().DeterminantStream(ctx, peer)
			if err != nil {
				return nil, err // not a detStream holding a nil pointer
			}
			return st, nil
		}}
}

// Recording reports whether this host records its jobs' receive calls.
func (r *Recorder) Recording() bool { return r != nil && r.rec != nil }

// Run reads the recorder and ships what it read until ctx ends, then closes the recorder.
func (r *Recorder) Run(ctx context.Context) {
	if !r.Recording() {
		return
	}
	defer r.rec.Close()
	var wg sync.WaitGroup
	wg.Go(func() { r.record(ctx) })
	wg.Go(func() { r.ship(ctx) })
	wg.Wait()
}

// wakeForWatchers has the recorder wake the agent for every call while some recovery watches a restored
// job's calls, and poll otherwise. Called with r.mu held, after watchers changed.
func (r *Recorder) wakeForWatchers() {
	if r.setWake == nil {
		return
	}
	watched := r.alwaysWake
	for _, s := range r.byJob {
		if len(s.watchers) > 0 {
			watched = true
			break
		}
	}
	if watched == r.waking {
		return
	}
	if err := r.setWake(watched); err != nil {
		r.log.Warn("the receive-order recorder's wakeup could not be switched: a replay's gate may see each call up to a poll interval late", "err", err)
		return
	}
	r.waking = watched
}

// Watch starts recording job's receive calls (those of its cgroup, directory cgroupDir). fromStart: none
// of its processes ran on this host yet (a start, a restore from snapshot base); false when the agent
// adopts a running job.
func (r *Recorder) Watch(job, cgroupDir string, fromStart bool, base string) {
	if !r.Recording() {
		return
	}
	id, err := cgroupv2.ID(cgroupDir)
	if err != nil {
		r.log.Error("the job's receive order is not recorded: its recovery cannot replay it", "job", job, "err", err)
		return
	}
	if fromStart {
		// Its threads' readiness calls count from 0 here. A cgroup of that path may have held the job
		// before (the lab's hosts share one kernel, and a job restored where it ran keeps its path): its
		// counts and stops must go.
		if err := r.rec.Forget(id); err != nil {
			r.log.Error("the job's receive positions cannot be reset: a replay of them would stop its threads at the wrong calls", "job", job, "err", err)
		}
	}
	if r.Pessimistic() {
		if err := r.rec.SetPessimistic(id, true); err != nil {
			r.log.Error("the job is not held after its receive calls: a crash can take determinants its sends depended on", "job", job, "err", err)
		}
		if !fromStart {
			// Adopted by a restarted agent: a process the previous one held waits for a release that died
			// with it.
			if err := ContinueStopped(cgroupDir); err != nil {
				r.log.Error("could not continue the job's held processes: they stay stopped", "job", job, "err", err)
			}
		}
	}
	r.startStream(job, id, fromStart, base)
}

// startStream starts job's stream for its cgroup id (Watch). Its count of lost calls starts at the recorder's
// count now (the host's unattributed losses included): a count it has already, of losses before the
// stream began, is no hole in it. Started at 0, every stream took any earlier loss of the host for its own
// at the next loss anywhere, and a recovery from its snapshots was refused.
func (r *Recorder) startStream(job string, id uint64, fromStart bool, base string) {
	lost, err := r.lostOf(id)
	if err != nil {
		r.log.Warn("the receive-order recorder's count of the job's lost calls cannot be read: the next loss on the host is taken for one of its own", "job", job, "err", err)
	}
	r.mu.Lock()
	s := &stream{job: job, cgroup: id, id: rand.Uint64(), fromStart: fromStart, base: base, lost: lost, watchers: map[chan intercept.Event]bool{}}
	old := r.byJob[job]
	if old != nil {
		delete(r.byCgroup, old.cgroup)
		s.watchers = old.watchers // a recovery watching the job it restores
	}
	r.byCgroup[id] = s
	r.byJob[job] = s
	held := r.pessimistic
	r.mu.Unlock()
	if old == nil || old.cgroup == 0 {
		return
	}
	// The job's earlier stream here is gone with nothing to ship or answer it: a process it held would stay
	// stopped for good, and an earlier cgroup's holds and counts would stay in the recorder's maps (as
	// Unwatch drops them).
	r.releaseHeld(old, true)
	if old.cgroup != id {
		if r.unhold != nil && held {
			if err := r.unhold(old.cgroup); err != nil {
				r.log.Warn("the job's earlier cgroup is still held after receive calls", "job", job, "cgroup", old.cgroup, "err", err)
			}
		}
		if r.forget != nil {
			if err := r.forget(old.cgroup); err != nil {
				r.log.Warn("the recorder's counts of the job's earlier cgroup are not dropped", "job", job, "cgroup", old.cgroup, "err", err)
			}
		}
	}
}

// Unwatch stops recording job (it ended here).
func (r *Recorder) Unwatch(job string) {
	if !r.Recording() {
		return
	}
	if s := r.unwatch(job); s != nil {
		r.rec.Forget(s.cgroup)
		if r.Pessimistic() {
			r.rec.SetPessimistic(s.cgroup, false)
		}
		r.releaseHeld(s, true)
	}
}

// unwatch forgets job's stream and closes its watchers; it returns the stream, nil if none.
func (r *Recorder) unwatch(job string) *stream {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byJob[job]
	if s == nil {
		return nil
	}
	delete(r.byCgroup, s.cgroup)
	delete(r.byJob, job)
	s.dropWatchers()
	r.wakeForWatchers()
	return s
}

// Calls delivers job's receive calls, and the stops of its threads, as this host records them, until
// stop. The channel is closed if calls were lost (the watcher fell behind, or the recorder lost some): the
// watcher must not go on. Without a recorder it is closed at once.
func (r *Recorder) Calls(job string) (<-chan intercept.Event, func()) {
	if !r.Recording() {
		ch := make(chan intercept.Event)
		close(ch)
		return ch, func() {}
	}
	return r.watch(job)
}

// watch adds a watcher of job's receive calls (Calls).
func (r *Recorder) watch(job string) (<-chan intercept.Event, func()) {
	ch := make(chan intercept.Event, 1<<14)
	r.mu.Lock()
	s := r.byJob[job]
	if s == nil {
		// Restore registers the job when it creates its cgroup; until then its calls wait here.
		s = &stream{job: job, id: rand.Uint64(), watchers: map[chan intercept.Event]bool{}}
		r.byJob[job] = s
	}
	s.watchers[ch] = true
	r.wakeForWatchers()
	r.mu.Unlock()
	return ch, func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if s.watchers[ch] {
			delete(s.watchers, ch)
			close(ch)
			r.wakeForWatchers()
		}
		if s.cgroup == 0 && len(s.watchers) == 0 && r.byJob[job] == s {
			delete(r.byJob, job) // the restore never registered the job here
		}
	}
}

// record reads the recorder until ctx ends: each call goes to its job's stream and watchers.
func (r *Recorder) record(ctx context.Context) {
	buf := make([]ebpfprobes.RecvEvent, 0, 4096)
	var lostTotal uint64 // the recorder's count of lost calls, all jobs, when last read
	for {
		evs, err := r.read(ctx, buf[:0])
		if err != nil && ctx.Err() != nil {
			return
		}
		// A call that could not be read (an undecodable event: ReadBatch returns the others of its batch with
		// the error) may have been any job's: every job's record has a hole after this batch, as for a lost
		// call. Quitting on it threw the batch's calls away with their held processes, stopped for good, and
		// left every stream without a hole: protectors' records looked complete, the lost calls bridged.
		undecodable := errors.Is(err, ebpfprobes.ErrBadRecvEvent)
		now := time.Now()
		r.mu.Lock()
		var release []uint32
		for _, e := range evs {
			if pid := r.take(e, now); pid != 0 {
				release = append(release, pid)
			}
		}
		if len(evs) < cap(buf) {
			// This read drained the ring up to where it stood when it began, after the last losses were
			// seen: every call recorded before them is taken now.
			r.holeAfterUnread()
		}
		// After the drain: a count that moved means that job's record has a hole here, and after the calls
		// still in the ring (holeAfterUnread). The recorder's total is a read of memory; each job's a lookup,
		// only when it moved.
		lost, lerr := r.lostTotal()
		lostMoved := lerr != nil || lost != lostTotal
		if lerr == nil {
			lostTotal = lost
		}
		if lostMoved {
			r.noticeLost()
		}
		if err != nil {
			r.holeAll()
		}
		stopped := err != nil && !undecodable
		if stopped {
			r.pessimistic = false // nothing reads the holds any more: a job held now would stay stopped for good
		}
		r.wakeForWatchers() // a watcher that fell behind or lost calls is gone
		waking := r.waking
		r.mu.Unlock()
		r.continueHeld("", release) // no job, or no determinant: nothing to wait for
		select {
		case r.wake <- struct{}{}: // the shipper releases the processes held for determinants now in a hole
		default:
		}
		if undecodable {
			r.log.Error("the receive-order recorder gave a call that cannot be read: every job's record starts over, and a recovery from its current snapshot replays without determinants", "err", err)
		} else if stopped {
			r.log.Error("the receive-order recorder stopped: jobs' receive order is no longer recorded, and their processes are no longer held after receive calls", "err", err)
			r.stopHolding()
			return
		}
		if !waking && len(evs) < cap(buf) {
			// Polled: let calls gather for a while, so that a job receiving all the time costs a batch (a
			// counter read, the lock, a wakeup of the shipper) per pause instead of per few calls: that cost
			// a job reading a million messages a second 1.4 us a call. The ring holds far more than a pause's calls.
			select {
			case <-ctx.Done():
			case <-time.After(tickgrid.Until(time.Now(), r.pause)):
			}
		}
	}
}

// take files one recorded call, with r.mu held: to the watchers of its job, and as its job's determinant.
// It returns a held process that nothing is to wait for (no job, no determinant), to be continued at once.
func (r *Recorder) take(e ebpfprobes.RecvEvent, now time.Time) (release uint32) {
	held := e.Held && e.StopErr == 0
	if e.Held && e.StopErr != 0 {
		r.log.Warn("a receive call of a pessimistic job could not be held: its determinant may be lost in a crash after a send that depends on it", "pid", e.Pid, "err", e.StopErr)
	}
	if held {
		release = e.Pid
	}
	if e.Flags&(unix.MSG_PEEK|unix.MSG_ERRQUEUE|unix.MSG_OOB) != 0 {
		if e.Stopped {
			// A replay's stop after a call that found nothing is met by such a call at the same copied_seq
			// too (the recorder does not look at the flags). No determinant, so no stop, is ever one: the
			// gate waits for the call the stop was armed for, which stops the thread again. Kept stopped,
			// the thread waited for nobody until the replay timed out and the job was killed.
			release = e.Pid
		}
		return release // consumed nothing of the stream; the read after a peek is the determinant
	}
	if !e.PollStop && e.Conn.Validate() != nil {
		// A read on a socket already closed (unhashed: its local port reads 0) still consumes its queue, of
		// a connection no recovery restores; as a determinant it would make its job's every batch refused.
		return release
	}
	s := r.byCgroup[e.Cgroup]
	if s == nil {
		return release
	}
	det := intercept.Det{Conn: e.Conn, End: e.CopiedSeq, Len: e.Len, Thread: e.Thread, Proc: e.Proc, Pos: e.Polls}
	if !r.counts {
		det.Pos = intercept.NoPos // not a count: a replay from this host's record must not take it for one
	}
	ev := intercept.Event{Det: det, AtPoll: e.PollStop, Stopped: e.Stopped, Pid: e.Pid}
	if e.StopErr != 0 && !e.Held {
		ev.StopErr = e.StopErr
	}
	for w := range s.watchers {
		select {
		case w <- ev:
		default:
			delete(s.watchers, w)
			close(w)
		}
	}
	if e.PollStop {
		return 0 // a replay's stop, not a receive call
	}
	if len(s.pending) >= maxPendingDets {
		s.dropPending()
		r.hole()
	}
	if len(s.pending) == 0 {
		s.readAt = now
	}
	if len(s.pending) == s.sent {
		s.unsentAt = now
	}
	s.pending = append(s.pending, det)
	if held {
		s.held = append(s.held, heldProc{pid: e.Pid, upTo: s.first + uint64(len(s.pending))})
	}
	return 0
}

// noticeLost makes a hole in the stream of each job whose count of lost calls moved; r.mu is held.
func (r *Recorder) noticeLost() {
	for _, s := range r.byJob {
		if s.cgroup == 0 {
			continue
		}
		lost, err := r.lostOf(s.cgroup)
		if err == nil && lost == s.lost {
			continue
		}
		// A count that cannot be read may hide a loss of the job's own: a hole, never a record that bridges
		// it (the total, already taken, would not call for another look). s.lost stays: the next read that
		// works may make one more hole, refused for nothing at worst.
		if err == nil {
			s.lost = lost
		}
		s.dropPending()
		s.dropWatchers()
		r.hole()
		// Calls still in the ring may have been recorded before the lost one: those go too, once read
		// (holeAfterUnread). Kept, they began the new record with the lost call inside it, and the
		// protector's record bridged it.
		s.lostUnread = true
		r.log.Warn("the receive-order recorder lost calls of a job (its ring was full), or its count of them cannot be read: a recovery from its current snapshot replays without determinants", "job", s.job, "lost_total", lost, "err", err)
	}
}

// holeAfterUnread makes a hole again in the stream of each job that lost calls while calls recorded before
// them were still in the ring (noticeLost), once a read has drained those; r.mu is held.
func (r *Recorder) holeAfterUnread() {
	for _, s := range r.byJob {
		if s.lostUnread {
			s.lostUnread = false
			s.dropPending()
			s.dropWatchers()
		}
	}
}

// holeAll makes a hole in the stream of every job (a call of any of them may be gone); r.mu is held.
func (r *Recorder) holeAll() {
	for _, s := range r.byJob {
		if s.cgroup == 0 {
			continue
		}
		s.dropPending()
		s.dropWatchers()
		r.hole()
	}
}

// stopHolding has the recorder hold no job's processes after their receive calls any more, and continues
// those it holds: nothing reads its calls once record stops.
func (r *Recorder) stopHolding() {
	r.mu.Lock()
	var all []*stream
	for _, s := range r.byJob {
		if s.cgroup != 0 {
			all = append(all, s)
		}
	}
	r.mu.Unlock()
	for _, s := range all {
		if r.unhold != nil {
			if err := r.unhold(s.cgroup); err != nil {
				r.log.Error("the job's processes are still held after their receive calls, with nothing to release them: they stop for good at their next receive call", "job", s.job, "err", err)
			}
		}
		r.releaseHeld(s, true)
	}
}

// dropPending forgets s's pending determinants and leaves a hole after them: its protector's record starts
// over with the next.
func (s *stream) dropPending() {
	s.first += uint64(len(s.pending)) + 1
	s.pending, s.sent, s.fromStart = nil, 0, false
}

func (r *Recorder) hole() {
	if r.metrics != nil {
		r.metrics.DeterminantsHole()
	}
}

// recordPause is how long the recorder's calls gather between two reads while no recovery watches: the
// shipping interval (at most 100 ms), on whose grid the shipper's rounds fall, so that each read is shipped at
// once and an agent wakes once per interval for both. Every wakeup of an agent costs more than its own work:
// the Go runtime's sysmon, woken by the first system call after the process was idle, polls at 20 us
// intervals for the next millisecond. At 1 ms, a stencil's halo exchange every 12 ms cost each agent about
// 400 wakeups a second for this reader alone; at half the interval, reads between two rounds waited for
// the next round anyway, so a determinant could take one and a half intervals to leave.
func recordPause(shipEvery time.Duration) time.Duration {
	return min(max(shipEvery, time.Millisecond), 100*time.Millisecond)
}

func (s *stream) dropWatchers() {
	for w := range s.watchers {
		close(w)
		delete(s.watchers, w)
	}
}

// Positions reports whether this host counts its jobs' readiness calls (receive positions).
func (r *Recorder) Positions() bool { return r.Recording() && r.rec.Positions() }

// Pessimistic reports whether this host holds its jobs' processes after their receive calls
// (log.pessimistic).
func (r *Recorder) Pessimistic() bool {
	if !r.Recording() {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pessimistic
}

// PollsAtDump reads the readiness-call counts of the threads of the job whose cgroup is cgroupDir, for its
// snapshot; the cgroup must be frozen (the counts are then those at the dump). ok is false if this host
// records no positions.
func (r *Recorder) PollsAtDump(cgroupDir string) (counts map[uint32]uint64, ok bool, err error) {
	if !r.Positions() {
		return nil, false, nil
	}
	id, err := cgroupv2.ID(cgroupDir)
	if err != nil {
		return nil, false, err
	}
	counts, err = r.rec.PollCounts(id)
	return counts, err == nil, err
}
