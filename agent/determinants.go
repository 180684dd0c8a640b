package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/procstate"
	"github.com/ftkit/ftkit/internal/tickgrid"
)

// Receive-order determinants (package intercept): this host records the receive calls of its jobs
// (ebpfprobes.RecvOrder), numbers them per job and ships them to each job's protector; as a protector it
// keeps those of the jobs it protects (intercept.Store) and serves them to the target of a recovery; as
// the target it lets the recovery watch the restored job's calls (the gate's events).

// detState is the agent's part of it. rec is nil when the recorder could not be loaded: the jobs of this
// host then have no determinants, and their recoveries replay without them (checked all the same).
type detState struct {
	log   *slog.Logger
	rec   *ebpfprobes.RecvOrder
	store *intercept.Store

	mu       sync.Mutex
	byCgroup map[uint64]*detStream
	byJob    map[string]*detStream
	wake     chan struct{}
	// setWake switches the recorder's wakeup for every call (nil without a recorder); waking mirrors it.
	// alwaysWake keeps it on (log.receive_order_ship_every = 0: every call shipped at once).
	setWake    func(on bool) error
	waking     bool
	alwaysWake bool
	pause      time.Duration // recordPause: how long calls gather between two reads while polled
	// pessimistic: each job's processes are held after each consuming receive call until its determinant
	// is at the protector (log.pessimistic).
	pessimistic bool
	// streams are the open determinant streams, by protector, and noStream the protectors that serve none
	// (agents of an earlier version: they get requests); only shipOrder uses them.
	streams  map[string]*clusterapi.DeterminantStream
	noStream map[string]bool
}

// detStream is one job's determinants on this host, numbered from 0 when the agent began recording it.
type detStream struct {
	job       string
	cgroup    uint64
	stream    uint64
	first     uint64 // index of pending[0]
	fromStart bool   // recording began before the job's processes ran here
	base      string // the snapshot the job was restored from here
	pending   []intercept.Det
	readAt    time.Time // when pending[0] was read off the recorder
	lost      uint64    // the recorder's count of this job's lost calls, when last read
	watchers  map[chan intercept.Event]bool
	// held are the job's processes the recorder stopped after a receive call (pessimistic), each until
	// the determinants up to its call's are at the protector. holdMu orders their release with a
	// snapshot, which must not dump a process stopped so (releaseForDump).
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

// newDetState loads the recorder if record (the host logs its jobs' traffic); a host that does not still
// keeps the determinants of the jobs it protects. shipEvery is log.receive_order_ship_every (0: the agent
// is woken for every call).
func newDetState(log *slog.Logger, record, positions, pessimistic bool, cgroupParent string, ringBytes int, shipEvery time.Duration) *detState {
	d := &detState{log: log, store: intercept.NewStore(0), byCgroup: map[uint64]*detStream{}, byJob: map[string]*detStream{}, wake: make(chan struct{}, 1),
		streams: map[string]*clusterapi.DeterminantStream{}, noStream: map[string]bool{}}
	if !record {
		return d
	}
	// Polled while calls keep coming (read a pause late, shipped in batches: log.receive_order_ship_every);
	// woken for every call only while a recovery's gate waits for each restored call (wakeForWatchers),
	// or always if asked, which costs about 1.5 us more per receive call (docs/ebpf-logging.md).
	// A held process waits for its call to be read: woken for every call, not a pause late.
	alwaysWake := shipEvery == 0 || pessimistic
	d.pause = recordPause(shipEvery)
	rec, err := ebpfprobes.NewRecvOrder(ebpfprobes.RecvOrderOptions{CgroupParent: cgroupParent, RingBufferSize: ringBytes, WakeEveryEvent: alwaysWake, Positions: positions, PollInterval: d.pause, Logger: log})
	if err != nil {
		log.Error("the receive-order recorder could not be loaded: restored jobs re-read their sockets in any order (a program that reads the first socket with data then fails its recovery, loudly)", "err", err)
		return d
	}
	d.rec, d.setWake = rec, rec.SetWakeEveryEvent
	d.waking, d.alwaysWake, d.pessimistic = alwaysWake, alwaysWake, pessimistic
	return d
}

// wakeForWatchers has the recorder wake the agent for every call while some recovery watches a restored
// job's calls, and poll otherwise. Called with d.mu held, after watchers changed.
func (d *detState) wakeForWatchers() {
	if d.setWake == nil {
		return
	}
	watched := d.alwaysWake
	for _, s := range d.byJob {
		if len(s.watchers) > 0 {
			watched = true
			break
		}
	}
	if watched == d.waking {
		return
	}
	if err := d.setWake(watched); err != nil {
		d.log.Warn("the receive-order recorder's wakeup could not be switched: a replay's gate may see each call up to a poll interval late", "err", err)
		return
	}
	d.waking = watched
}

// watch starts recording job j's receive calls (its cgroup's). fromStart: none of its processes ran on this
// host yet (a start, a restore from base); false when the agent adopts a running job.
func (a *Agent) watchOrder(j *Job, fromStart bool, base string) {
	d := a.det
	if d == nil || d.rec == nil {
		return
	}
	id, err := ebpfprobes.CgroupID(j.Cgroup)
	if err != nil {
		a.log.Error("the job's receive order is not recorded: its recovery cannot replay it", "job", j.ID, "err", err)
		return
	}
	if fromStart {
		// Its threads' readiness calls count from 0 here. A cgroup of that path may have held the job
		// before (the lab's hosts share one kernel, and a job restored where it ran keeps its path): its
		// counts and stops must go.
		if err := d.rec.Forget(id); err != nil {
			a.log.Error("the job's receive positions cannot be reset: a replay of them would stop its threads at the wrong calls", "job", j.ID, "err", err)
		}
	}
	if d.pessimistic {
		if err := d.rec.SetPessimistic(id, true); err != nil {
			a.log.Error("the job is not held after its receive calls: a crash can take determinants its sends depended on", "job", j.ID, "err", err)
		}
		if !fromStart {
			// Adopted by a restarted agent: a process the previous one held waits for a release that died
			// with it.
			if err := continueStopped(j.Cgroup); err != nil {
				a.log.Error("could not continue the job's held processes: they stay stopped", "job", j.ID, "err", err)
			}
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	s := &detStream{job: j.ID, cgroup: id, stream: rand.Uint64(), fromStart: fromStart, base: base, watchers: map[chan intercept.Event]bool{}}
	if old := d.byJob[j.ID]; old != nil {
		delete(d.byCgroup, old.cgroup)
		s.watchers = old.watchers // a recovery watching the job it restores
	}
	d.byCgroup[id] = s
	d.byJob[j.ID] = s
}

// unwatchOrder stops recording job id (it ended here).
func (a *Agent) unwatchOrder(id string) {
	d := a.det
	if d == nil || d.rec == nil {
		return
	}
	if s := d.unwatch(id); s != nil {
		d.rec.Forget(s.cgroup)
		if d.pessimistic {
			d.rec.SetPessimistic(s.cgroup, false)
		}
		a.releaseHeld(s, true)
	}
}

// unwatch forgets job id's stream and closes its watchers; it returns the stream, nil if none.
func (d *detState) unwatch(id string) *detStream {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.byJob[id]
	if s == nil {
		return nil
	}
	delete(d.byCgroup, s.cgroup)
	delete(d.byJob, id)
	s.dropWatchers()
	d.wakeForWatchers()
	return s
}

// WatchOrder delivers job's receive calls, and the stops of its threads, as this host records them, until stop. The channel is closed if
// calls were lost (the watcher fell behind, or the recorder lost some): the watcher must not go on.
func (a *Agent) WatchOrder(job string) (<-chan intercept.Event, func()) {
	d := a.det
	if d == nil || d.rec == nil {
		ch := make(chan intercept.Event)
		close(ch)
		return ch, func() {}
	}
	return d.watch(job)
}

// watch adds a watcher of job's receive calls (WatchOrder).
func (d *detState) watch(job string) (<-chan intercept.Event, func()) {
	ch := make(chan intercept.Event, 1<<14)
	d.mu.Lock()
	s := d.byJob[job]
	if s == nil {
		// Restore registers the job when it creates its cgroup; until then its calls wait here.
		s = &detStream{job: job, stream: rand.Uint64(), watchers: map[chan intercept.Event]bool{}}
		d.byJob[job] = s
	}
	s.watchers[ch] = true
	d.wakeForWatchers()
	d.mu.Unlock()
	return ch, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if s.watchers[ch] {
			delete(s.watchers, ch)
			close(ch)
			d.wakeForWatchers()
		}
		if s.cgroup == 0 && len(s.watchers) == 0 && d.byJob[job] == s {
			delete(d.byJob, job) // the restore never registered the job here
		}
	}
}

// recordOrder reads the recorder until ctx ends: each call goes to its job's stream and watchers.
func (a *Agent) recordOrder(ctx context.Context) {
	d := a.det
	buf := make([]ebpfprobes.RecvEvent, 0, 4096)
	var lostTotal uint64 // the recorder's count of lost calls, all jobs, when last read
	for {
		evs, err := d.rec.ReadBatch(ctx, buf[:0])
		if err != nil {
			if ctx.Err() == nil {
				a.log.Error("the receive-order recorder stopped: jobs' receive order is no longer recorded", "err", err)
			}
			return
		}
		now := time.Now()
		d.mu.Lock()
		var release []uint32
		for _, e := range evs {
			if pid := a.take(e, now); pid != 0 {
				release = append(release, pid)
			}
		}
		// After the drain: a count that moved means that job's record has a hole here. The recorder's total
		// is one read; each job's only when it moved.
		cnt, cerr := d.rec.Counters()
		lostMoved := cerr != nil || cnt.Lost != lostTotal
		if cerr == nil {
			lostTotal = cnt.Lost
		}
		for _, s := range d.byJob {
			if s.cgroup == 0 || !lostMoved {
				continue
			}
			if lost, err := d.rec.Lost(s.cgroup); err == nil && lost != s.lost {
				s.lost = lost
				s.first += uint64(len(s.pending)) + 1
				s.pending, s.fromStart = nil, false
				s.dropWatchers()
				a.metrics.DeterminantsHole()
				a.log.Warn("the receive-order recorder lost calls of a job (its ring was full): a recovery from its current snapshot replays without determinants", "job", s.job, "lost_total", lost)
			}
		}
		d.wakeForWatchers() // a watcher that fell behind or lost calls is gone
		waking := d.waking
		d.mu.Unlock()
		a.continueHeld("", release) // no job, or no determinant: nothing to wait for
		select {
		case d.wake <- struct{}{}:
		default:
		}
		if !waking && len(evs) < cap(buf) {
			// Polled: let calls gather for a while, so that a job receiving all the time costs a batch (a
			// counter read, the lock, a wakeup of the shipper) per pause instead of per few calls: that cost
			// a job reading a million messages a second 1.4 us a call. The ring holds far more than a pause's calls.
			select {
			case <-ctx.Done():
			case <-time.After(tickgrid.Until(time.Now(), d.pause)):
			}
		}
	}
}

// take files one recorded call, with d.mu held: to the watchers of its job, and as its job's determinant. It
// returns a held process that nothing is to wait for (no job, no determinant), to be continued at once.
func (a *Agent) take(e ebpfprobes.RecvEvent, now time.Time) (release uint32) {
	d := a.det
	held := e.Held && e.StopErr == 0
	if e.Held && e.StopErr != 0 {
		a.log.Warn("a receive call of a pessimistic job could not be held: its determinant may be lost in a crash after a send that depends on it", "pid", e.Pid, "err", e.StopErr)
	}
	if held {
		release = e.Pid
	}
	if e.Flags&(unix.MSG_PEEK|unix.MSG_ERRQUEUE|unix.MSG_OOB) != 0 {
		return release // consumed nothing of the stream; the read after a peek is the determinant
	}
	if !e.PollStop && e.Conn.Validate() != nil {
		// A read on a socket already closed (unhashed: its local port reads 0) still consumes its queue, of
		// a connection no recovery restores; as a determinant it would make its job's every batch refused.
		return release
	}
	s := d.byCgroup[e.Cgroup]
	if s == nil {
		return release
	}
	det := intercept.Det{Conn: e.Conn, End: e.CopiedSeq, Len: e.Len, Thread: e.Thread, Proc: e.Proc, Pos: e.Polls}
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
		s.first += uint64(len(s.pending)) + 1
		s.pending, s.fromStart = nil, false
		a.metrics.DeterminantsHole()
	}
	if len(s.pending) == 0 {
		s.readAt = now
	}
	s.pending = append(s.pending, det)
	if held {
		s.held = append(s.held, heldProc{pid: e.Pid, upTo: s.first + uint64(len(s.pending))})
	}
	return 0
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

func (s *detStream) dropWatchers() {
	for w := range s.watchers {
		close(w)
		delete(s.watchers, w)
	}
}

// DefaultShipEvery is log.receive_order_ship_every's default: shipping rounds fall at most once in each
// interval of its grid, right after the recorder's read there, what the recorder gave going in one batch per
// job. A batch is a write and a read on each agent (a determinant stream to the protector; it was a cluster
// request until 2026-11-28, and on 2 vCPUs a round cost about 1 ms of CPU over the two agents). Measured
// (bench receive-order, docs/receive-order.md): a round per call cost stencil2d 13.8%, rounds 2 ms apart
// 6.0-6.8%, 20 ms apart 3.0-5.2%; since the agents' wakeups were cut
// (2026-11-27), 20 ms 1.8% and 2 ms 8.8%, and on a machine with CPUs half as fast 6.1% and 15%. The price:
// a determinant reaches the protector up to this much later, which widens the window in which a crash takes
// determinants that a send already depended on (an orphan: the recovery then fails loudly). A site whose
// programs answer messages within milliseconds lowers it.
const DefaultShipEvery = 20 * time.Millisecond

// maxShipEvery bounds log.receive_order_ship_every: beyond it nearly every crash takes determinants with it.
const maxShipEvery = time.Second

// shipOrder sends each job's new determinants to its protector as they come, at most one round in each
// interval of log.receive_order_ship_every's grid (tickgrid), until ctx ends.
func (a *Agent) shipOrder(ctx context.Context) {
	d := a.det
	defer d.closeStreams(true)
	var retry <-chan time.Time // armed while a round left determinants behind (no protector answered)
	var last time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-retry:
		}
		if every := a.cfg.Log.ReceiveOrderShipEvery.Duration; tickgrid.Slot(time.Now(), every) == tickgrid.Slot(last, every) && !d.anyHeld() {
			// A round was made in this interval already: the next at the grid's next instant, where the
			// recorder reads too (one wakeup). The recorder's read at an instant is shipped at once.
			select {
			case <-ctx.Done():
				return
			case <-time.After(tickgrid.Until(time.Now(), every)):
			}
		}
		last = time.Now()
		d.mu.Lock()
		var todo []*detStream
		for _, s := range d.byJob {
			if len(s.pending) > 0 && s.cgroup != 0 {
				todo = append(todo, s)
			}
		}
		d.mu.Unlock()
		retry = nil
		for _, s := range todo {
			if !a.shipStream(ctx, s) {
				retry = time.After(tickgrid.Until(time.Now(), shipRetry))
			}
		}
		d.closeStreams(false)
	}
}

// sendDeterminants ships req to peer on the determinant stream there, opened as needed, and closes the
// stream when it breaks. A peer that serves no streams (an agent of an earlier version) gets a request.
func (a *Agent) sendDeterminants(ctx context.Context, peer string, req clusterapi.DeterminantsRequest) error {
	d := a.det
	if d.noStream[peer] {
		return a.peers().Determinants(ctx, peer, req)
	}
	st := d.streams[peer]
	if st == nil || st.Stale() {
		d.closeStream(peer)
		var err error
		if st, err = a.peers().DeterminantStream(ctx, peer); err != nil {
			if e := clusterapi.Refusal(err); e != nil && e.Code == clusterapi.CodeUnknownOp {
				a.log.Info("a protector serves no determinant streams (an earlier version): it gets a request per batch", "protector", peer)
				d.noStream[peer] = true
				return a.peers().Determinants(ctx, peer, req)
			}
			return err
		}
		d.streams[peer] = st
	}
	err := st.Send(ctx, req)
	if err != nil && clusterapi.Refusal(err) == nil {
		d.closeStream(peer)
	}
	return err
}

// closeStreams closes the determinant streams that fell silent (all of them with all): a job's protector
// changed, or its jobs stopped receiving.
func (d *detState) closeStreams(all bool) {
	for peer, st := range d.streams {
		if all || st.Stale() {
			d.closeStream(peer)
		}
	}
}

func (d *detState) closeStream(peer string) {
	if st := d.streams[peer]; st != nil {
		st.Close()
		delete(d.streams, peer)
	}
}

// shipRetry is how soon a batch no protector took is offered again, new calls or not.
const shipRetry = 100 * time.Millisecond

// shipStream sends one batch of s's pending determinants to its job's protector. It reports whether it
// left none behind for a retry (a batch refused or unanswered, more than a batch pending).
func (a *Agent) shipStream(ctx context.Context, s *detStream) bool {
	a.mu.Lock()
	j, ok := a.byID[s.job]
	var p *Placement
	if ok {
		p = j.Spec.Placement
	}
	a.mu.Unlock()
	prot, ok := a.protectorOf(a.View(), p)
	if !ok {
		a.releaseHeld(s, true) // no protector to wait for: holding the job would stop it for good
		return false
	}
	d := a.det
	d.mu.Lock()
	n := min(len(s.pending), intercept.MaxBatch)
	batch := intercept.Batch{Job: s.job, Stream: s.stream, First: s.first, FromStart: s.fromStart && s.first == 0, Base: s.base, Dets: s.pending[:n:n]}
	readAt := s.readAt
	d.mu.Unlock()
	packed, err := intercept.Pack(batch.Dets)
	if err == nil {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = a.sendDeterminants(sctx, prot.Name, clusterapi.DeterminantsRequest{
			Job: batch.Job, Stream: batch.Stream, First: batch.First, FromStart: batch.FromStart, Base: batch.Base, Packed: packed})
		cancel()
	}
	if err != nil {
		a.log.Debug("determinants not shipped; retrying", "job", s.job, "protector", prot.Name, "err", err)
		return false
	}
	d.mu.Lock()
	if s.first == batch.First { // no hole was made meanwhile
		s.pending = s.pending[n:]
		s.first += uint64(n)
		// The rest keep the oldest read time: their lag is overstated, never understated.
	}
	left := len(s.pending) > 0
	d.mu.Unlock()
	a.metrics.DeterminantsShipped(n, time.Since(readAt))
	a.releaseHeld(s, false)
	return !left
}

// anyHeld reports whether some process waits for its determinants to be shipped.
func (d *detState) anyHeld() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, s := range d.byJob {
		if len(s.held) > 0 {
			return true
		}
	}
	return false
}

// releaseHeld continues s's held processes whose determinants are stored (before s.first), or all.
func (a *Agent) releaseHeld(s *detStream, all bool) {
	s.holdMu.Lock()
	defer s.holdMu.Unlock()
	d := a.det
	d.mu.Lock()
	var pids []uint32
	keep := s.held[:0]
	for _, h := range s.held {
		if all || h.upTo <= s.first {
			pids = append(pids, h.pid)
		} else {
			keep = append(keep, h)
		}
	}
	s.held = keep
	d.mu.Unlock()
	a.continueHeld(s.job, pids)
}

// continueHeld continues processes the recorder held after a receive call (job: theirs, "" if none),
// whether or not its SIGSTOP took effect yet: SIGCONT also discards a pending one.
func (a *Agent) continueHeld(job string, pids []uint32) {
	for _, pid := range pids {
		if err := unix.Kill(int(pid), unix.SIGCONT); err != nil && !errors.Is(err, unix.ESRCH) {
			a.log.Error("could not continue a process held for its determinant: it stays stopped", "job", job, "pid", pid, "err", err)
		}
	}
}

// releaseForDump prepares frozen job j's dump when it is held after receive calls: a process stopped (or
// about to stop) by a hold would be dumped stopped and restored stopped, with nobody to continue it. Each
// such process is continued while frozen (it stays frozen), and restop, called once CRIU is done and
// before the thaw, stops it again: it stops as soon as it is thawed and waits for its release as before.
func (a *Agent) releaseForDump(j Job) (restop func(), err error) {
	d := a.det
	if !d.pessimisticOn() {
		return func() {}, nil
	}
	d.mu.Lock()
	s := d.byJob[j.ID]
	d.mu.Unlock()
	if s == nil {
		return func() {}, nil
	}
	s.holdMu.Lock() // no release while the job is dumped: restop would stop a released process for good
	pids, err := stoppingProcs(j.Cgroup)
	for _, pid := range pids {
		if kerr := unix.Kill(pid, unix.SIGCONT); kerr != nil && !errors.Is(kerr, unix.ESRCH) && err == nil {
			err = fmt.Errorf("continue held process %d for the dump: %w", pid, kerr)
		}
	}
	return sync.OnceFunc(func() {
		defer s.holdMu.Unlock()
		for _, pid := range pids {
			if err := unix.Kill(pid, unix.SIGSTOP); err != nil && !errors.Is(err, unix.ESRCH) {
				a.log.Error("could not hold a process again after its dump: it runs on before its determinant is stored", "job", j.ID, "pid", pid, "err", err)
			}
		}
	}), err
}

// stoppingProcs lists the processes of cgroup dir that are stopped or have a SIGSTOP pending.
func stoppingProcs(dir string) ([]int, error) {
	pids, err := jobProcs(dir)
	return slices.DeleteFunc(pids, func(pid int) bool { return !stopping(pid) }), err
}

// jobProcs lists the processes of the job cgroup dir.
func jobProcs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, fmt.Errorf("list the job's processes: %w", err)
	}
	var pids []int
	for f := range strings.FieldsSeq(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// stopping reports whether process pid is stopped, or a SIGSTOP is pending for it or one of its threads.
func stopping(pid int) bool {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return false
	}
	const stopBit = 1 << (unix.SIGSTOP - 1)
	for _, e := range ents {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, e.Name()))
		if err != nil {
			continue
		}
		for l := range strings.Lines(string(b)) {
			k, v, ok := strings.Cut(l, ":")
			if !ok {
				continue
			}
			v = strings.TrimSpace(v)
			switch k {
			case "State":
				if strings.HasPrefix(v, "T") {
					return true
				}
			case "SigPnd", "ShdPnd":
				if m, err := strconv.ParseUint(v, 16, 64); err == nil && m&stopBit != 0 {
					return true
				}
			}
		}
	}
	return false
}

// serveDeterminants stores a batch a member shipped as its job's protector.
func (a *Agent) serveDeterminants(peer string, req clusterapi.DeterminantsRequest) error {
	if a.det == nil {
		return errors.New("this agent keeps no determinants")
	}
	b, err := req.Batch()
	if err != nil {
		return err
	}
	if !validJobID(b.Job) {
		return fmt.Errorf("determinants of job %q: not a job id an agent makes", b.Job)
	}
	if b.Base != "" {
		if _, err := ckpt.ParseID(b.Base); err != nil {
			return fmt.Errorf("determinants of job %s: base snapshot: %w", b.Job, err)
		}
	}
	a.det.store.Add(peer, b)
	return nil
}

// serveDeterminantsSince answers what a job consumed after a snapshot this host holds, a page at a time.
func (a *Agent) serveDeterminantsSince(req clusterapi.DeterminantsSinceRequest) (clusterapi.DeterminantsSinceReply, error) {
	dets, err := a.determinantsSince(req.Job, req.Snapshot)
	if err != nil {
		return clusterapi.DeterminantsSinceReply{}, err
	}
	if req.From > uint64(len(dets)) {
		return clusterapi.DeterminantsSinceReply{}, fmt.Errorf("determinants of job %s since %s: page from %d of %d", req.Job, req.Snapshot, req.From, len(dets))
	}
	page := dets[req.From:]
	more := len(page) > intercept.MaxBatch
	if more {
		page = page[:intercept.MaxBatch]
	}
	packed, err := intercept.Pack(page)
	return clusterapi.DeterminantsSinceReply{Packed: packed, More: more}, err
}

// determinantsSince is what job consumed after its snapshot id (which this host holds), from this host's
// store.
func (a *Agent) determinantsSince(job, id string) ([]intercept.Det, error) {
	if a.det == nil {
		return nil, errors.New("this agent keeps no determinants")
	}
	m, err := a.store.Manifest(job, id)
	if err != nil {
		return nil, fmt.Errorf("determinants since snapshot %s of job %s: %w", id, job, err)
	}
	return a.det.store.Since(m)
}

// DeterminantsSince is what job consumed after snapshot m, asked of source (the member the snapshot came
// from, which protects the job), or read here.
func (a *Agent) DeterminantsSince(ctx context.Context, source string, m *ckpt.Manifest) ([]intercept.Det, error) {
	if source == "" || source == a.cfg.Name {
		return a.determinantsSince(m.Job, m.ID)
	}
	dets, err := a.peers().DeterminantsSince(ctx, source, m.Job, m.ID)
	if err != nil {
		var refused *clusterapi.Error
		if errors.As(err, &refused) {
			return nil, fmt.Errorf("%s has no complete determinants: %s", source, refused.Message)
		}
		return nil, err
	}
	return dets, nil
}

// jobStops stops the threads of a job restored here for a replay of its receive positions
// (intercept.Stopper), through this host's recorder.
type jobStops struct {
	rec    *ebpfprobes.RecvOrder
	cgroup uint64 // the job cgroup's id
	dir    string // its directory
}

func (s jobStops) Arm(thread uint32, st intercept.Stop) error {
	return s.rec.Arm(s.cgroup, thread, ebpfprobes.Stop{Polls: st.Polls, Conn: st.Conn, End: st.End, Len: st.Len})
}

func (s jobStops) Disarm(thread uint32) error { return s.rec.Disarm(s.cgroup, thread) }

// Describe says how many readiness calls the thread made since the restore and, from /proc, its state and
// the system call it is in.
func (s jobStops) Describe(thread uint32) string {
	var parts []string
	if s.rec != nil {
		if n, err := s.rec.PollCount(s.cgroup, thread); err == nil {
			parts = append(parts, fmt.Sprintf("%d readiness calls made since the restore", n))
		}
	}
	if tid, err := hostThread(s.dir, thread); err != nil {
		parts = append(parts, err.Error())
	} else {
		parts = append(parts, fmt.Sprintf("host thread %d %s", tid, threadState(tid)))
	}
	return strings.Join(parts, ", ")
}

// hostThread is the host id of the thread of the job cgroup dir whose id in the job's PID namespace is ns.
func hostThread(dir string, ns uint32) (int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.threads"))
	if err != nil {
		return 0, fmt.Errorf("list the job's threads: %w", err)
	}
	for f := range strings.FieldsSeq(string(b)) {
		status, err := os.ReadFile("/proc/" + f + "/status")
		if err != nil {
			continue // it exited
		}
		for l := range strings.Lines(string(status)) {
			if ids, ok := strings.CutPrefix(l, "NSpid:"); ok {
				if fs := strings.Fields(ids); len(fs) > 0 && fs[len(fs)-1] == strconv.FormatUint(uint64(ns), 10) {
					return strconv.Atoi(f)
				}
				break
			}
		}
	}
	return 0, fmt.Errorf("no thread of the job has id %d in its PID namespace", ns)
}

// threadState is a thread's state, the system call it is in and where it sleeps, from /proc.
func threadState(tid int) string {
	dir := fmt.Sprintf("/proc/%d", tid)
	state, err := procstate.Of(tid)
	if err != nil {
		state = "?"
	}
	call := "?"
	if b, err := os.ReadFile(dir + "/syscall"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			call = f[0] // a number, or "running"
		}
	}
	wchan, _ := os.ReadFile(dir + "/wchan")
	return fmt.Sprintf("(state %s, system call %s, waiting in %q)", state, call, wchan)
}

func (s jobStops) Continue(pid uint32) error {
	if err := unix.Kill(int(pid), unix.SIGCONT); err != nil {
		return fmt.Errorf("continue process %d: %w", pid, err)
	}
	return nil
}

// WaitStopped waits until every thread of process pid is stopped (a group stop reaches each thread in
// turn), until ctx ends (the replay's timeout: a process something continued never stops).
func (s jobStops) WaitStopped(ctx context.Context, pid uint32) error {
	for {
		running, err := procstate.RunningThreads(int(pid))
		if err != nil {
			return err
		}
		if len(running) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("process %d was sent SIGSTOP, and its threads %v still run (something continued it): %w", pid, running, context.Cause(ctx))
		case <-time.After(50 * time.Microsecond):
		}
	}
}

// continueStopped continues each process of the job cgroup dir whose threads are all stopped.
func continueStopped(dir string) error {
	pids, err := jobProcs(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, pid := range pids {
		if running, err := procstate.RunningThreads(pid); err != nil || len(running) > 0 {
			continue // gone, or not stopped
		}
		if err := unix.Kill(pid, unix.SIGCONT); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("continue process %d: %w", pid, err))
		}
	}
	return errors.Join(errs...)
}

// pessimisticOn reports whether this host holds its jobs' processes after their receive calls
// (log.pessimistic).
func (d *detState) pessimisticOn() bool { return d != nil && d.rec != nil && d.pessimistic }

// positions reports whether this host counts its jobs' readiness calls (receive positions).
func (d *detState) positions() bool { return d != nil && d.rec != nil && d.rec.Positions() }

// stopsOf is the Stopper of job id, restored here; nil if this host records no positions or does not
// know the job.
func (a *Agent) stopsOf(id string) intercept.Stopper {
	d := a.det
	if !d.positions() {
		return nil
	}
	d.mu.Lock()
	s := d.byJob[id]
	d.mu.Unlock()
	if s == nil || s.cgroup == 0 {
		return nil
	}
	return jobStops{rec: d.rec, cgroup: s.cgroup, dir: a.layout().cgroup(id)}
}

// pollsAtDump reads the readiness-call counts of job j's threads for its snapshot; j's cgroup must be
// frozen (the counts are then those at the dump). ok is false if this host records no positions.
func (a *Agent) pollsAtDump(j Job) (counts map[uint32]uint64, ok bool, err error) {
	if !a.det.positions() {
		return nil, false, nil
	}
	id, err := ebpfprobes.CgroupID(j.Cgroup)
	if err != nil {
		return nil, false, err
	}
	counts, err = a.det.rec.PollCounts(id)
	return counts, err == nil, err
}
