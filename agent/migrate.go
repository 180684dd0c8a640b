package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
)

// A planned migration moves one running job to another node of the ring (seed 001's proactive
// migration, `ftctl migrate`): the job is frozen and dumped here, the dump is shipped to the target
// (while the job could still be thawed here), its address leaves this host, its processes are killed
// without a word on the wire, and the target restores it through the recovery a failure would run, from
// a snapshot nothing happened after. A pre-copy (a snapshot of the running job shipped first, the final
// dump then sent as a diff against it) was measured and left out: on the lab's link the diff costs as much
// CPU as the transfer it saves (100 MiB: 281 ms shipped either way; 1 GiB: 5.3 s against 2.8 s). The peers never stop: what they sent while
// the job was frozen or moving is in their logs and is replayed; their retransmissions find the address
// on the target. Only a job with an address of its own can move (its connections name that address).

// KindMigration marks a planned migration in the event log (Failure.Kind), which is not a failure.
const KindMigration = "migration"

// The stages a migration adds to the recovery's: the job frozen and dumped; the dump shipped to the
// target; the job taken off its host (its address off the wire, its processes killed).
const (
	StageDumped  = "frozen+dumped"
	StageShipped = "shipped"
	StageLeft    = "left host"
)

// MigrateRequest asks the agent to move one of its running jobs to another node of the ring.
type MigrateRequest struct {
	Job string `json:"job"`
	To  string `json:"to"`
}

// Migration is the outcome of a migration: where the job runs now, and how long it was stopped (from its
// freeze to its restored process running on the target, and to the end of its replay).
type Migration struct {
	Job      string        `json:"job"`
	From     string        `json:"from"`
	To       string        `json:"to"` // where it runs: the target, or From if the target failed and it came back here
	Snapshot string        `json:"snapshot"`
	Event    string        `json:"event"` // its timeline in `ftctl events`
	Frozen   time.Duration `json:"frozen_ns"`
	Replayed time.Duration `json:"replayed_ns"`
	Error    string        `json:"error,omitempty"` // why the target failed, when the job came back here instead
}

// ErrNotMovable means a job cannot be migrated as it is; the error says why and what to do.
var ErrNotMovable = errors.New("job cannot be migrated")

// Migrate moves job req.Job to member req.To (root only). The job runs on exactly one host throughout:
// the target claims the job's next incarnation from a majority before it restores it. If the target
// fails, the job is restored here again from the same snapshot; only if that fails too is it lost, and
// the error says so.
func (a *Agent) Migrate(ctx context.Context, req MigrateRequest, uid uint32) (*Migration, error) {
	if uid != 0 {
		return nil, fmt.Errorf("%w: moving a job between hosts is for root (the operator)", ErrNotMovable)
	}
	j, avail, err := a.movable(ctx, req)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	id := fmt.Sprintf("%s-migrate-%s", j.ID, start.UTC().Format("20060102T150405.000"))
	a.failures.Update(id, func(f *Failure) {
		f.Kind, f.Node, f.Protector, f.Target, f.LastBeat, f.Detected, f.Jobs = KindMigration, a.cfg.Name, a.cfg.Name, req.To, start, start, []string{j.ID}
	})
	emit := a.migrationStages(id)
	res := &Migration{Job: j.ID, From: a.cfg.Name, To: req.To, Event: id}
	stage := func(name string, from time.Time, detail string, err error) {
		emit(Stage{Name: name, Job: j.ID, Host: a.cfg.Name, Start: from, End: time.Now(), Detail: detail, Error: errString(err)})
	}
	frozen, m, deleteNet, err := a.stopForMigration(ctx, j, id, req.To, avail, a.migrationBase(ctx, j.ID, req.To), stage)
	if m != nil {
		res.Snapshot = m.ID
	}
	if err != nil {
		deleteNet()
		a.endMigration(id, err)
		return nil, err
	}
	// The job has left this host: its restore on the target, or here again, goes on if the caller goes
	// (an interrupted `ftctl migrate`), or the job would run nowhere.
	ctx = context.WithoutCancel(ctx)
	rreq := a.migrationRequest(id, j.ID, m.ID)
	times := func(s Stage) {
		switch s.Name {
		case StageRestored:
			res.Frozen = s.End.Sub(frozen)
		case StageReplayed:
			res.Replayed = s.End.Sub(frozen)
		}
		emit(s)
	}
	err = a.remoteRecover(ctx, req.To, rreq, times)
	// The job's address went off the wire as it left; its network goes once the target is done (while it
	// restored, the deletion slowed its network preparation in the lab, whose hosts share a kernel), and
	// before the job could come back here (afterFailedMove makes it again).
	deleteNet()
	if err := a.endMove(ctx, res, rreq, times, err, j, m); err != nil {
		return nil, err
	}
	return res, nil
}

// migrationStages records the stages of migration id in its event.
func (a *Agent) migrationStages(id string) func(Stage) {
	return func(st Stage) {
		a.failures.Update(id, func(f *Failure) { f.Stages = append(f.Stages, st) })
		a.saveFailures()
		a.log.Info("migration stage", "migration", id, "stage", st.Name, "job", st.Job, "host", st.Host,
			"ms", st.Duration().Milliseconds(), "detail", st.Detail, "err", st.Error)
	}
}

// migrationRequest asks a migration's target to restore job from snapshot, the dump it left this host with.
func (a *Agent) migrationRequest(id, job, snapshot string) RecoverRequest {
	return RecoverRequest{Failure: id, Failed: a.cfg.Name, Source: a.cfg.Name, Migration: true,
		Jobs: []RecoverJob{{Job: job, Snapshot: snapshot, Source: a.cfg.Name, Candidates: []Candidate{{Snapshot: snapshot, Source: a.cfg.Name}}}}}
}

// endMove ends the migration of job j, which left this host with dump m, once its restore on the target
// returned err: the job is restored here again if that failed (res says where it runs). An error only if
// the job runs nowhere.
func (a *Agent) endMove(ctx context.Context, res *Migration, rreq RecoverRequest, emit func(Stage), err error, j Job, m *ckpt.Manifest) error {
	target := res.To
	if err != nil {
		res.Error = err.Error()
		if err := a.afterFailedMove(ctx, res, rreq, emit); err != nil {
			a.endMigration(res.Event, err)
			return err
		}
	}
	var outcome error
	if res.Error != "" {
		outcome = fmt.Errorf("not moved as asked: %s failed (%s); the job runs on %s", target, res.Error, res.To)
	}
	a.endMigration(res.Event, outcome)
	if res.To != a.cfg.Name && m != nil {
		a.renewPeerSnapshots(ctx, j, m)
	}
	a.pushView(ctx) // the failure log travels with views: every member's `ftctl events` shows the move
	return nil
}

// afterFailedMove brings the job back here from the snapshot it left with when its target failed (res.Error
// says how), and sets res.To to where the job runs. The claim of the job's next incarnation decides: refused,
// the target's copy started (and its recovery failed later, at its re-protection say), so the job runs there.
// An error only if the job runs nowhere.
func (a *Agent) afterFailedMove(ctx context.Context, res *Migration, rreq RecoverRequest, emit func(Stage)) error {
	a.log.Error("migration target failed: restoring the job here again", "job", res.Job, "target", res.To, "err", res.Error)
	// A claim of the job by a target the view declares failed is superseded once the target has surely
	// fenced itself (declared before now: fence_timeout and its margin from now), or the job would be left
	// to a dead host: a migration is no failure the target's fail-over takes over. Unless the target
	// re-protected the job: its protector's fail-over of the target restores it from that newer replica.
	fenced := ""
	if m, ok := a.member(res.To); ok && m.State == ring.StateFailed && !a.protectedOn(res.Event, res.To) {
		ready := a.cfg.FenceTiming().ReadyAt(time.Now())
		a.log.Warn("the migration's target was declared failed: restoring the job here once the target has surely fenced itself",
			"job", res.Job, "target", res.To, "wait_ms", time.Until(ready).Milliseconds())
		if sleepUntil(ctx, ready) == nil {
			fenced = res.To
		}
	}
	err := a.recoverJobsFenced(ctx, rreq, fenced, emit)
	if cur, _, jerr := a.Job(res.Job, 0); jerr == nil && cur.State == JobRunning {
		res.To = a.cfg.Name // back here (an error after the restore, at its re-protection, leaves it running)
		return nil
	}
	if errors.Is(err, ErrJobAlive) {
		return nil // res.To runs it
	}
	return fmt.Errorf("job %s is lost: its migration to %s failed (%s) and its restore here failed too (%w); restore it with `ftctl restore --snapshot %s`",
		res.Job, res.To, res.Error, err, res.Snapshot)
}

// endMigration closes migration id's record.
func (a *Agent) endMigration(id string, err error) {
	a.failures.Update(id, func(f *Failure) {
		f.Done = true
		if err != nil {
			f.Error = err.Error()
		}
	})
	a.saveFailures()
}

// movable returns the job req names if it can move to req.To now, or why not, and the memory req.To
// reports available (nil: not reported). A target that cannot hold the job's newest snapshot here is
// refused before the job is frozen; the dump itself is checked again before it is shipped.
func (a *Agent) movable(ctx context.Context, req MigrateRequest) (Job, *int64, error) {
	j, _, err := a.Job(req.Job, 0)
	if err != nil {
		return Job{}, nil, err
	}
	switch {
	case j.State != JobRunning:
		return Job{}, nil, fmt.Errorf("%w: job %s is %s, not running", ErrNotMovable, j.ID, j.State)
	case j.Net == nil:
		return Job{}, nil, fmt.Errorf("%w: job %s uses %s's host address, which cannot move without the host; start it with an address of its own (job_address, `ftctl mpirun --job-addresses`)",
			ErrNotMovable, j.ID, a.cfg.Name)
	case req.To == a.cfg.Name:
		return Job{}, nil, fmt.Errorf("%w: job %s already runs on %s", ErrNotMovable, j.ID, req.To)
	}
	t, ok := a.member(req.To)
	if !ok || t.Role != ring.RoleNode || t.State != ring.StateAlive {
		return Job{}, nil, fmt.Errorf("%w: %q is not an alive node of the ring (role %q, state %q): a job moves only to a node that is watched (add a spare to the ring first)",
			ErrNotMovable, req.To, t.Role, t.State)
	}
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	rep, err := a.Ping(pctx, req.To)
	if err != nil {
		return Job{}, nil, fmt.Errorf("%w: %s does not answer: %w", ErrNotMovable, req.To, err)
	}
	if rep.MemAvailable == nil {
		a.log.Info("the migration's target does not report its available memory (an older agent): the job's size is not checked against it",
			"job", j.ID, "target", req.To)
		return j, nil, nil
	}
	if err := targetHolds(j.ID, req.To, rep.MemAvailable, 0, "nothing"); err != nil { // a negative answer
		return Job{}, nil, err
	}
	// The job's size before it is frozen: its newest snapshot here (none yet: the dump's is checked).
	if ids, err := a.store.List(j.ID, a.cfg.Name); err == nil && len(ids) > 0 { // newest first
		if m, err := a.store.Manifest(j.ID, ids[0]); err == nil {
			if err := targetHolds(j.ID, req.To, rep.MemAvailable, m.TotalSize(), "its newest snapshot, "+m.ID); err != nil {
				return Job{}, nil, fmt.Errorf("%w (if it has shrunk since, snapshot it first: `ftctl checkpoint --job %s`)", err, j.ID)
			}
		}
	}
	return j, rep.MemAvailable, nil
}

// targetHolds checks that target, which reported avail bytes of available memory (nil: not reported), can
// hold need bytes of job (what says which) with the headroom a spare's claim asks for. Restored on a node
// without the memory, the job gets the OOM killer to kill processes there (another user's job, maybe), or
// its restore fails and it is restored here again, stopped twice as long.
func targetHolds(job, target string, avail *int64, need int64, what string) error {
	switch {
	case avail == nil:
		return nil
	case *avail < 0:
		return fmt.Errorf("%w: %s reports %d bytes of available memory, not an amount; check its agent", ErrNotMovable, target, *avail)
	}
	if required, ok := spare.Holds(*avail, need); !ok {
		return fmt.Errorf("%w: %s has %s of memory available, job %s needs %s (%s) plus 10%% headroom (%s): move it to a node with more free memory",
			ErrNotMovable, target, mib(*avail), job, mib(need), what, mib(required))
	}
	return nil
}

// mib formats n bytes for an operator.
func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// migrationBase indexes, while job still runs, the newest snapshot of it taken here that target holds a
// replica of (or takes the index kept from that snapshot's transfer): the base the dump will be sent as a
// diff against (the protector offers its newest). Nil if
// there is none or it cannot be read: the transfer then indexes whatever base target offers, or sends
// the dump whole.
func (a *Agent) migrationBase(ctx context.Context, job, target string) *ship.BaseIndex {
	ids, err := a.store.List(job, a.cfg.Name)
	if err != nil {
		return nil
	}
	for _, id := range ids { // newest first
		m, err := a.store.Manifest(job, id)
		if err != nil || !slices.Contains(m.Replicas, target) {
			continue
		}
		if b := a.diffs.Base(job); b != nil && b.ID() == id {
			return b // kept from its transfer: nothing to read
		}
		b, err := ship.IndexBase(ctx, a.store, job, id, 0)
		if err != nil {
			a.log.Warn("could not index the base of a migration's transfer ahead; the transfer will", "job", job, "snapshot", id, "err", err)
			return nil
		}
		return b
	}
	return nil
}

// stopForMigration freezes and dumps job j, ships the dump to target (as a diff against base if target
// offers it) if target's available memory (avail, nil: not reported) holds it, then takes the job off this
// host for migration id. Until the dump is on the target the job can still be thawed, and runs on as
// before. It returns when the job was frozen, and the deletion of the job's network (leave), which the
// caller must call.
func (a *Agent) stopForMigration(ctx context.Context, j Job, id, target string, avail *int64, base *ship.BaseIndex, stage func(string, time.Time, string, error)) (frozen time.Time, m *ckpt.Manifest, deleteNet func(), err error) {
	a.ckptMu.Lock() // no scheduled snapshot of the job in between
	defer a.ckptMu.Unlock()
	deleteNet = func() {}
	// Not before the job's cut still to commit is recorded (or given up), as shipToProtector waits: a target
	// that is the job's protector prunes its older replicas of the job when the dump arrives, the cut's among
	// them, which nothing pins there before the commit. Waited for under the snapshot lock (no other cut of
	// the job thaws in between) and before the freeze: the job runs on meanwhile.
	if err := a.uncommitted.Settle(ctx, j.ID, "", func() {
		a.log.Info("migration waits for the commit of the job's coordinated snapshot", "job", j.ID, "target", target)
	}); err != nil {
		return frozen, nil, deleteNet, fmt.Errorf("job %s not moved, it runs on here: %w", j.ID, err)
	}
	defer a.raised()() // the job is frozen from the dump until it has left, or thawed
	m, frozen, err = a.dumpFrozen(ctx, j)
	detail := ""
	if m != nil {
		detail = fmt.Sprintf("snapshot %s, %d MB", m.ID, m.TotalSize()>>20)
	}
	stage(StageDumped, frozen, detail, err)
	if err != nil {
		return frozen, m, deleteNet, jobStaysError{err}
	}
	start := time.Now()
	// The dump's size is known now, the job still frozen here: a target that cannot hold it is not sent it.
	if err := targetHolds(j.ID, target, avail, m.TotalSize(), "its dump, "+m.ID); err != nil {
		a.thaw(j)
		err = fmt.Errorf("job %s not moved, it runs on here: %w", j.ID, err)
		stage(StageShipped, start, "", err)
		return frozen, m, deleteNet, err
	}
	sent, err := a.shipTo(ctx, target, m, ship.SendOptions{JustCommitted: true, Base: base}) // dumped and committed just above
	if err != nil {
		a.thaw(j)
		err = fmt.Errorf("job %s not moved, it runs on here: %w", j.ID, err)
		stage(StageShipped, start, "", err)
		return frozen, m, deleteNet, err
	}
	stage(StageShipped, start, fmt.Sprintf("%d MB on the wire", sent.WireBytes>>20), nil)
	start = time.Now()
	// Not cancelled half-way: a job taken off this host goes on on the target.
	deleteNet, err = a.leave(context.WithoutCancel(ctx), j, target, id, m.ID)
	stage(StageLeft, start, "", err)
	if err != nil {
		err = jobStaysError{err}
	}
	return frozen, m, deleteNet, err
}

// jobStaysError is a migration's failure that any target would meet (the job's dump, the kill of its copy
// here), its message unchanged: a drain tries no other target for the job, each try freezing and dumping it
// again for nothing.
type jobStaysError struct{ error }

func (e jobStaysError) Unwrap() error { return e.error }

// dumpFrozen freezes job j and dumps it, leaving it frozen; on an error it thaws it. A dump CRIU refused for a
// connection waiting in a listen queue is taken again once the thawed job has accepted it (whenAccepted).
// frozen is when the job was frozen for the dump it returns.
func (a *Agent) dumpFrozen(ctx context.Context, j Job) (m *ckpt.Manifest, frozen time.Time, err error) {
	frozen = time.Now()
	if cur, _, err := a.Job(j.ID, 0); err != nil || cur.State != JobRunning || cur.PID != j.PID {
		return nil, frozen, fmt.Errorf("%w: job %s ended or changed before its migration began", ErrNotMovable, j.ID)
	}
	if a.replays.has(j.ID) {
		return nil, frozen, fmt.Errorf("job %s not moved, it runs on here: %w", j.ID, ErrReplaying)
	}
	if err := a.waitPagesIn(ctx, j.ID); err != nil { // before the freeze: the job runs meanwhile
		return nil, frozen, err
	}
	m, err = whenAccepted(ctx, a.acceptWait(), func() (*ckpt.Manifest, error) {
		frozen = time.Now()
		if err := a.freezeJob(ctx, j); err != nil {
			return nil, err
		}
		m, err := a.snapshot(ctx, j, true, true)
		if err != nil {
			a.thaw(j)
			return nil, fmt.Errorf("dump: %w", err)
		}
		return m, nil
	}, a.acceptsWaiting(j))
	if err != nil {
		return nil, frozen, fmt.Errorf("job %s not moved, it runs on here: %w", j.ID, err)
	}
	// A peer on this host stays behind: moved alone, the job could not take up its connection to it. A peer
	// whose sends no log keeps: what it sends while the job moves would be lost, and the target's restore
	// refuses the job once it has left here (until 2026-12-02 the job was lost so).
	bad := unrecoverableConns(m.Conns, a.ownerLookup(ctx), a.onThisHost)
	if len(bad) == 0 {
		bad = a.unloggedConns(ctx, m)
	}
	if len(bad) > 0 {
		a.thaw(j)
		return m, frozen, fmt.Errorf("%w: job %s runs on here: no restore could rebuild %s", ErrNotMovable, j.ID, strings.Join(bad, "; "))
	}
	return m, frozen, nil
}

// freezeJob freezes job j's cgroup and waits until every task of it is frozen; if that fails, j is thawed
// again.
func (a *Agent) freezeJob(ctx context.Context, j Job) error {
	if err := setFrozen(j.Cgroup, true); err != nil {
		return fmt.Errorf("freeze job %s: %w", j.ID, err)
	}
	if err := waitFrozen(ctx, []string{j.Cgroup}, freezeTimeout); err != nil {
		a.thaw(j)
		return err
	}
	return nil
}

func (a *Agent) thaw(j Job) {
	if err := setFrozen(j.Cgroup, false); err != nil {
		a.log.Error("thaw job cgroup (the job stays frozen until this is fixed)", "job", j.ID, "cgroup", j.Cgroup, "err", err)
	}
}

// leaveHost takes frozen job j off this host for good: recorded as moved to target, its address off the
// wire first (so that closing its sockets sends nothing to its peers), then its copy marked superseded (so
// that its shim writes no exit record saying it ended), then its processes killed, and what it held here
// released as for an ended job.
func (a *Agent) leaveHost(ctx context.Context, j Job, target string) error {
	deleteNet, err := a.leave(ctx, j, target, "", "")
	deleteNet()
	return err
}

// leave is leaveHost but for the job network's deletion, which waits for the kernel to unregister its
// interface (20-40 ms) and is left to the caller: deleteNet, which the caller must call, also when err is
// set, and before anything may make the job's network here again. The job's address is off the wire
// when leave returns. migration and snapshot name the migration that moves the job and the dump it leaves
// with ("" for a rollback), for a restarted agent to finish the move (resumeMigrations).
func (a *Agent) leave(ctx context.Context, j Job, target, migration, snapshot string) (deleteNet func(), err error) {
	a.mu.Lock()
	if cur, ok := a.byID[j.ID]; ok {
		cur.State = JobMoved
		cur.MovedTo, cur.Migration, cur.MovedSnapshot = target, migration, snapshot
		if err := a.jobs.save(cur); err != nil {
			a.log.Error("save job record", "job", j.ID, "err", err)
		}
		a.notify()
	}
	a.mu.Unlock()
	net := j.Net
	deleteNet = func() { a.deleteJobNet(context.Background(), j.ID, net) }
	a.withdrawJobNet(ctx, j.ID, net)
	if err := a.killCopy(ctx, j); err != nil {
		// Nothing was killed: the job runs on here, as it was.
		if uerr := a.stayHere(ctx, j); uerr != nil {
			err = errors.Join(err, uerr)
		}
		return func() {}, fmt.Errorf("job %s dumped but its processes could not be killed here, so it is not moved; it runs on here: %w", j.ID, err)
	}
	// Killed: the job goes on on the target from its dump whatever follows.
	return deleteNet, nil
}

// killCopy kills this host's copy of job j, which has left it, marked superseded first (its shim records
// no end), and once its processes are gone gives back what it held here but its network (the caller's,
// whose address is off the wire already). An error if it could not be killed: then nothing is given back.
func (a *Agent) killCopy(ctx context.Context, j Job) error {
	a.supersede(j)
	if err := a.killCgroup(j.ID); err != nil {
		return err
	}
	// Processes slow to go (in an uninterruptible sleep) send nothing: their address is off the wire.
	if err := waitEmpty(context.WithoutCancel(ctx), a.layout().cgroup(j.ID)); err != nil { // the cgroup killCgroup killed
		a.log.Warn("a migrated job's processes were killed but have not all gone yet", "job", j.ID, "err", err)
	}
	j.Net = nil // the caller's
	a.releaseJob(&j)
	return nil
}

// stayHere undoes leave for a job that could not be killed: recorded as running again, its copy no
// longer marked superseded, its address back on its network, thawed.
func (a *Agent) stayHere(ctx context.Context, j Job) error {
	a.mu.Lock()
	if cur, ok := a.byID[j.ID]; ok && cur.State == JobMoved {
		cur.State, cur.MovedTo, cur.Migration, cur.MovedSnapshot = JobRunning, "", "", ""
		if err := a.jobs.save(cur); err != nil {
			a.log.Error("save job record", "job", j.ID, "err", err)
		}
		a.notify()
	}
	a.mu.Unlock()
	var errs []error
	if err := os.Remove(a.supersededMark(j.ID, j.Incarnation)); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("unmark its copy superseded: %w", err))
	}
	if j.Net != nil {
		if err := a.createJobNet(context.WithoutCancel(ctx), j.Net); err != nil { // puts the address back
			errs = append(errs, fmt.Errorf("put its address back: %w", err))
		}
	}
	if err := setFrozen(j.Cgroup, false); err != nil {
		errs = append(errs, fmt.Errorf("thaw it: %w", err))
	}
	return errors.Join(errs...)
}

// waitEmpty waits until no process is left in cgroup (cgroup.events: populated 0).
func waitEmpty(ctx context.Context, cgroup string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		b, err := os.ReadFile(filepath.Join(cgroup, "cgroup.events"))
		if err != nil || strings.Contains(string(b), "populated 0") {
			return nil // gone, or empty
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cgroup %s still holds processes: %w", cgroup, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// renewPeerSnapshots asks the nodes of job j's peers to snapshot now: what j sent before it moved is in
// this host's log, but a recovery of a peer asks the holder of j's address, the target, which logged only
// what j sent since. Once the peers' snapshots are replicated, no recovery needs the bytes left here.
func (a *Agent) renewPeerSnapshots(ctx context.Context, j Job, m *ckpt.Manifest) {
	var asked []string
	for _, c := range m.Conns {
		owner := a.memberByIP(c.Remote.Addr())
		if owner == "" || slices.Contains(asked, owner) || (j.Net != nil && c.Remote.Addr().Unmap() == j.Net.Addr.Addr()) {
			continue
		}
		asked = append(asked, owner)
		if owner == a.cfg.Name {
			go a.Checkpoint(context.WithoutCancel(ctx), nil, 0)
			continue
		}
		a.requestSnapshot(ctx, owner)
	}
	if len(asked) > 0 {
		a.log.Info("moved job's peers asked to snapshot: the log of what it sent before the move stays here", "job", j.ID, "nodes", asked)
	}
}

// protectedOn reports whether event's timeline has a re-protection on host that succeeded.
func (a *Agent) protectedOn(event, host string) bool {
	for _, f := range a.failures.List() {
		if f.ID == event {
			return slices.ContainsFunc(f.Stages, func(s Stage) bool { return s.Name == StageProtected && s.Host == host && s.Error == "" })
		}
	}
	return false
}
