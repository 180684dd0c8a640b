package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/ring"
)

// This host's part in coordinated snapshots and whole-run rollbacks (package coordinated): it serves
// each phase on its jobs of the run and coordinates the cuts and rollbacks it is asked for or schedules.
// Only jobs with an address of their own take part: a job on its host's address cannot be killed
// silently, and its restored sockets would meet the killed ones' in the host's tables.

// cutRecords are the cuts this host was told of.
func (a *Agent) cutRecords() coordinated.Records {
	return coordinated.Records{Dir: filepath.Join(a.cfg.StateDir, "cuts"), Host: a.cfg.Name, Log: a.log}
}

// coordinator coordinates the cuts and rollbacks this host drives.
func (a *Agent) coordinator() *coordinated.Coordinator {
	return &coordinated.Coordinator{Self: a.cfg.Name, Members: coordMembers{a}, Records: a.cutRecords(),
		Underway: coordinated.Underway{Dir: filepath.Join(a.cfg.StateDir, "cuts-under-way")}, Log: a.log}
}

// coordMembers is the cluster as a coordinator sees it.
type coordMembers struct{ a *Agent }

func (m coordMembers) Alive() []string { return m.a.aliveMembers() }

func (m coordMembers) Coordinate(ctx context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	if host == m.a.cfg.Name {
		return m.a.serveCoordinate(ctx, host, req)
	}
	return m.a.peers().Coordinate(ctx, host, req)
}

// CoordinatedSnapshot takes a cut of a run across the cluster, with this agent as its coordinator (root
// only: it freezes every job of the run, on every host).
func (a *Agent) CoordinatedSnapshot(ctx context.Context, req coordinated.RunRequest, uid uint32) (*coordinated.Cut, error) {
	if uid != 0 {
		return nil, errors.New("a coordinated snapshot stops jobs on every host of a run: it is for root (the operator)")
	}
	return a.coordinator().Snapshot(ctx, req.Run, req.UID)
}

// Rollback rolls a run back to its newest cut this host knows: every job of the run is stopped, then
// each is restored from its part of the cut where it runs (root only).
func (a *Agent) Rollback(ctx context.Context, req coordinated.RunRequest, uid uint32) (*coordinated.Rollback, error) {
	if uid != 0 {
		return nil, errors.New("a rollback kills and restores jobs on every host of a run: it is for root (the operator)")
	}
	run := req.Run
	cut, err := a.cutRecords().Load(run, req.UID)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	id := fmt.Sprintf("%s-rollback-%s", run, start.UTC().Format("20060102T150405.000"))
	var jobs []string
	for _, p := range cut.Parts {
		jobs = append(jobs, p.Job)
	}
	a.failures.Update(id, func(f *Failure) {
		f.Kind, f.Node, f.Protector, f.LastBeat, f.Detected, f.Jobs = coordinated.KindRollback, a.cfg.Name, a.cfg.Name, start, start, jobs
	})
	a.saveFailures() // on disk before any job stops: a restarted agent ends it, saying how far it went (closeLeftFailovers)
	emit := func(st coordinated.Stage) {
		a.failures.Update(id, func(f *Failure) { f.Stages = append(f.Stages, cutStage(st)) })
		a.saveFailures()
	}
	err = a.coordinator().RollBack(ctx, cut, "", a.holdsCutPart, emit)
	res := &coordinated.Rollback{Run: run, Cut: cut.ID, Event: id, Parts: cut.Parts, Stopped: time.Since(start)}
	a.failures.Update(id, func(f *Failure) {
		f.Done, f.Error = true, errString(err)
	})
	a.saveFailures()
	a.pushView(ctx)
	if err != nil {
		return nil, err
	}
	return res, nil
}

// cutStage is a rollback's stage in the event log.
func cutStage(st coordinated.Stage) Stage {
	return Stage{Name: st.Name, Host: strings.Join(st.Hosts, ","), Start: st.Start, End: st.End, Detail: st.Detail, Error: errString(st.Err)}
}

// pinnedSnapshots are job's snapshots that retention keeps whatever their age: those a recorded cut names,
// and those of cuts dumped here and not yet committed.
func (a *Agent) pinnedSnapshots(job string) []string {
	return append(a.cutRecords().Pinned(job), a.uncommitted.Pinned(job)...)
}

// openUncommitted reads back the pins of the cuts this host dumped that a previous agent thawed and that were
// not committed when it stopped, and keeps them in the state directory from now on.
func (a *Agent) openUncommitted() {
	if err := a.uncommitted.Open(filepath.Join(a.cfg.StateDir, uncommittedFile)); err != nil {
		a.log.Error("the snapshots of coordinated snapshots a previous agent thawed are not pinned: retention may delete them before their commit names them", "err", err)
	}
}

// uncommittedFile, in the state directory, keeps the pins of coordinated.Uncommitted.
const uncommittedFile = "uncommitted-cuts.json"

// holdsCutPart reports whether this host holds p's snapshot.
func (a *Agent) holdsCutPart(p clusterapi.CutPart) bool {
	_, err := a.store.Manifest(p.Job, p.Snapshot)
	return err == nil
}

// serveCoordinate runs one phase for a coordinator (peer; this agent itself when it coordinates).
func (a *Agent) serveCoordinate(ctx context.Context, peer string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	if peer != a.cfg.Name {
		if m, ok := a.member(peer); !ok || m.State != ring.StateAlive {
			return clusterapi.CoordinateReply{}, &clusterapi.Error{Code: clusterapi.CodeRefused,
				Message: fmt.Sprintf("coordinate from %s: not an alive member in this host's view", peer)}
		}
	}
	switch req.Phase {
	case clusterapi.CoordList:
		rep := clusterapi.CoordinateReply{Owners: map[string]uint32{}}
		for _, j := range a.runJobs(req.Run, req.UID) {
			rep.Jobs = append(rep.Jobs, j.ID)
			rep.Owners[j.ID] = j.UID
		}
		return rep, a.checkRunJobs(req.Run, req.UID)
	case clusterapi.CoordFreeze:
		return a.coordFreeze(ctx, peer, req)
	case clusterapi.CoordDump:
		if err := a.checkCoordinator(peer, req); err != nil {
			return clusterapi.CoordinateReply{}, err
		}
		return a.coordDump(ctx, req)
	case clusterapi.CoordThaw, clusterapi.CoordAbort:
		if err := a.checkCoordinator(peer, req); err != nil {
			return clusterapi.CoordinateReply{}, err
		}
		return a.coordThaw(ctx, peer, req, req.Phase == clusterapi.CoordThaw)
	case clusterapi.CoordCommit:
		if err := a.checkCoordinator(peer, req); err != nil {
			return clusterapi.CoordinateReply{}, err
		}
		for _, p := range req.Parts {
			if err := a.checkPart(req.Run, *req.UID, p, nil); err != nil {
				return clusterapi.CoordinateReply{}, &clusterapi.Error{Code: clusterapi.CodeRefused, Message: "cut not recorded: " + err.Error()}
			}
		}
		if err := a.cutRecords().Save(coordinated.Cut{Run: req.Run, UID: *req.UID, ID: req.Cut, Taken: time.Now().UTC(), Parts: req.Parts}); err != nil {
			return clusterapi.CoordinateReply{}, err
		}
		a.uncommitted.Done(coordinated.HoldKey(req), req.Cut, peer) // the record pins them now
		return clusterapi.CoordinateReply{}, nil
	case clusterapi.CoordPrepare:
		if err := a.refuseOlderCut(req); err != nil {
			return clusterapi.CoordinateReply{}, err
		}
		_, err := a.rollbackParts(ctx, req.Run, *req.UID, req.Parts)
		return clusterapi.CoordinateReply{}, err
	case clusterapi.CoordStop:
		return clusterapi.CoordinateReply{}, a.rollbackStop(ctx, req.Run, *req.UID, req.Parts)
	case clusterapi.CoordRestore:
		return clusterapi.CoordinateReply{}, a.rollbackRestore(ctx, req.Run, *req.UID, req.Parts)
	}
	return clusterapi.CoordinateReply{}, fmt.Errorf("no phase %q", req.Phase)
}

// checkCoordinator refuses a cut's dump, thaw, abort or commit from any member but the one whose freeze holds
// the run's jobs here for that cut, or, after the thaw, whose cut's snapshots are pinned here until its
// commit: another member (its own cut of the run given the same id, or a member acting for a cut it does not
// coordinate) would otherwise thaw the jobs mid-cut and give back the snapshot lock under the coordinator,
// dump and replicate for it, or unpin the cut's snapshots before the coordinator's commit names them.
func (a *Agent) checkCoordinator(peer string, req clusterapi.CoordinateRequest) error {
	key := coordinated.HoldKey(req)
	coordinator := a.uncommitted.Coordinator(key, req.Cut)
	if h := a.coord.Get(key, req.Cut); h != nil {
		coordinator = h.Coordinator
	}
	if coordinator == "" || coordinator == peer {
		return nil
	}
	return &clusterapi.Error{Code: clusterapi.CodeRefused, Message: fmt.Sprintf(
		"%s of cut %s of run %s from %s refused: %s froze the run's jobs on %s for that cut and alone coordinates it",
		req.Phase, req.Cut, req.Run, peer, coordinator, a.cfg.Name)}
}

// refuseOlderCut refuses a rollback to a cut older than the one this host records for the run. A commit
// that reached some members only leaves them disagreeing about the run's newest cut; a member that missed it
// would roll the run back to the older one, and a later rollback from a member that has the newer would then
// restore an execution already superseded (a rollback's restore is forced past any incarnation), silently.
func (a *Agent) refuseOlderCut(req clusterapi.CoordinateRequest) error {
	rec, err := a.cutRecords().Load(req.Run, req.UID)
	if err != nil || rec.ID <= req.Cut { // ids begin with the time
		return nil
	}
	return &clusterapi.Error{Code: clusterapi.CodeRefused, Message: fmt.Sprintf(
		"run %s not rolled back to cut %s, nothing stopped: %s records a newer cut of it, %s (its commit missed the coordinator's host): roll back from %s (`ftctl rollback --run %s` there)",
		req.Run, req.Cut, a.cfg.Name, rec.ID, a.cfg.Name, req.Run)}
}

// checkPart refuses cut part p of run of uid if its job is another run's or another user's by this host's
// record of it, or else by the record in its snapshot m (nil: the part's snapshot, if this host holds it):
// a member's cut must not make this host treat another user's job as a part of its run (roll it back, skip
// its message logging, pin its snapshots). A part this host knows nothing of is not its to check.
func (a *Agent) checkPart(run string, uid uint32, p clusterapi.CutPart, m *ckpt.Manifest) error {
	j, _, err := a.Job(p.Job, 0)
	if err != nil {
		if m == nil {
			if m, err = a.store.Manifest(p.Job, p.Snapshot); err != nil {
				return nil
			}
		}
		// The record as the snapshot holds it: whether it could be restored here is the restore's to say.
		if j, err = a.snapshotRecord(m); err != nil {
			return fmt.Errorf("part %s of job %s: %w", p.Snapshot, p.Job, err)
		}
	}
	if j.Spec.Run != run || j.UID != uid {
		return fmt.Errorf("job %s is a job of run %q of uid %d, not of run %s of uid %d", p.Job, j.Spec.Run, j.UID, run, uid)
	}
	return nil
}

// lockForFreeze takes the host's snapshot lock for a cut's freeze, waiting at most freezeLockWait: two cuts
// that share two hosts and freeze them in opposite orders (two coordinators, or an operator's cut beside the
// scheduled one) would each hold one host and wait for the other until the holds expired (HoldMax, a
// minute), both runs frozen meanwhile. The one that gives up has its coordinator try again (CodeRetry).
func (a *Agent) lockForFreeze(ctx context.Context) error {
	deadline := time.Now().Add(freezeLockWait)
	for !a.ckptMu.TryLock() {
		if time.Now().After(deadline) {
			return &clusterapi.Error{Code: clusterapi.CodeRetry, Message: fmt.Sprintf("this host's snapshot lock stayed held for %s (a dump, a migration, or another cut's freeze): try again", freezeLockWait)}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for this host's snapshot lock: %w", ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// freezeLockWait bounds lockForFreeze: a dump of a large job holds the lock for seconds.
const freezeLockWait = 5 * time.Second

// runJobs are this host's running jobs of run of user owner (nil: of any user).
func (a *Agent) runJobs(run string, owner *uint32) []Job {
	var out []Job
	for _, j := range a.Jobs(0) {
		if j.State == JobRunning && j.Spec.Run == run && (owner == nil || j.UID == *owner) {
			out = append(out, j)
		}
	}
	return out
}

// checkRunJobs refuses a run whose jobs here cannot take part in a cut.
func (a *Agent) checkRunJobs(run string, owner *uint32) error {
	for _, j := range a.runJobs(run, owner) {
		if j.Net == nil {
			return fmt.Errorf("%w: job %s of run %s uses %s's host address: coordinated snapshots and rollbacks need jobs with addresses of their own (job_address, `ftctl mpirun --job-addresses`)",
				ErrNotMovable, j.ID, run, a.cfg.Name)
		}
	}
	return nil
}

// coordFreeze freezes this host's jobs of the run and holds them (and the agent's snapshot lock) until
// the thaw of coordinator, its failure (endHoldsOfFailed), or coordinated.HoldMax.
func (a *Agent) coordFreeze(ctx context.Context, coordinator string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	if err := a.checkRunJobs(req.Run, req.UID); err != nil {
		return clusterapi.CoordinateReply{}, err
	}
	for _, j := range a.runJobs(req.Run, req.UID) {
		if err := a.waitPagesIn(ctx, j.ID); err != nil { // before the freeze: a dump needs every page in
			return clusterapi.CoordinateReply{}, err
		}
	}
	// No scheduled snapshot, migration or drain of these jobs until they thaw.
	if err := a.lockForFreeze(ctx); err != nil {
		return clusterapi.CoordinateReply{}, err
	}
	lower := a.raised()
	release := sync.OnceFunc(func() { a.ckptMu.Unlock(); lower() })
	key := coordinated.HoldKey(req)
	hold := &coordinated.Hold[Job]{Cut: req.Cut, Coordinator: coordinator, Jobs: a.runJobs(req.Run, req.UID), Frozen: time.Now()}
	thaw := func() {
		for _, j := range hold.Jobs {
			a.thaw(j)
		}
	}
	end := func() {
		thaw()
		release()
	}
	expired := func() {
		a.log.Error("coordinator of a coordinated snapshot did not come back: the run's jobs thawed here", "run", req.Run, "cut", req.Cut, "after", coordinated.HoldMax)
	}
	if err := a.coord.Begin(key, hold, end, expired); err != nil {
		release()
		return clusterapi.CoordinateReply{}, fmt.Errorf("run %s: %w", req.Run, err)
	}
	var cgroups []string
	for _, j := range hold.Jobs {
		cgroups = append(cgroups, j.Cgroup)
	}
	freeze := func() error {
		if err := hold.Freeze(func() error {
			for _, j := range hold.Jobs {
				if err := setFrozen(j.Cgroup, true); err != nil {
					return fmt.Errorf("freeze job %s: %w", j.ID, err)
				}
			}
			return nil
		}); err != nil {
			return fmt.Errorf("cut %s: %w", req.Cut, err)
		}
		return waitFrozen(ctx, cgroups, freezeTimeout)
	}
	if err := freezeAccepted(ctx, a.acceptWait(), freeze, thaw, a.acceptsWaitingIn(hold.Jobs)); err != nil {
		a.coord.End(key, req.Cut)
		return clusterapi.CoordinateReply{}, fmt.Errorf("run %s: %w", req.Run, err)
	}
	var rep clusterapi.CoordinateReply
	for _, j := range hold.Jobs {
		rep.Jobs = append(rep.Jobs, j.ID)
	}
	return rep, nil
}

// endHoldsOfFailed ends the holds whose coordinator v declares failed, and stops replication waiting for
// the commits of that coordinator's thawed cuts (coordinated.Uncommitted.Orphan).
func (a *Agent) endHoldsOfFailed(v ring.View) {
	failed := func(coordinator string) bool {
		m, ok := v.Member(coordinator)
		return ok && m.State == ring.StateFailed
	}
	for _, h := range a.coord.EndOf(failed) {
		a.log.Warn("coordinator of a coordinated snapshot failed: the run's jobs thawed here", "coordinator", h.Coordinator, "cut", h.Cut, "frozen_for", h.FrozenFor.Round(time.Millisecond))
	}
	if n := a.uncommitted.Orphan(failed); n > 0 {
		a.log.Warn("coordinator of thawed coordinated snapshots failed before committing them here: replication no longer waits for their commits", "cuts", n)
	}
}

// coordDump dumps the frozen jobs of the run, leaving them frozen.
func (a *Agent) coordDump(ctx context.Context, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	hold := a.coord.Get(coordinated.HoldKey(req), req.Cut)
	if hold == nil {
		return clusterapi.CoordinateReply{}, fmt.Errorf("run %s is not frozen here for cut %s (thawed after %s without word from its coordinator?)", req.Run, req.Cut, coordinated.HoldMax)
	}
	defer hold.Pause()() // a dump takes as long as it needs; the wait for the thaw starts again after it
	var rep clusterapi.CoordinateReply
	// The jobs stay frozen for the cut, and the snapshot lock taken, until the dump returns: a hold that ends
	// meanwhile (its coordinator declared failed) stops it, and no job is dumped after the hold's end.
	err := hold.Dump(ctx, func(ctx context.Context) error {
		for _, j := range hold.Jobs {
			m, err := a.snapshot(ctx, j, true, false)
			if err != nil {
				err = fmt.Errorf("dump job %s: %w", j.ID, err)
				if errors.Is(err, criu.ErrInFlight) {
					// A connection reached the frozen job's listen queue after the freeze looked (a job of the run
					// on another host, thawed there to accept, connected to it): the cut's next attempt freezes
					// again and waits there for the job to accept it.
					err = &clusterapi.Error{Code: clusterapi.CodeRetry, Message: err.Error()}
				}
				return err
			}
			hold.Dumped = append(hold.Dumped, m)
			rep.Parts = append(rep.Parts, clusterapi.CutPart{Job: j.ID, Host: a.cfg.Name, Snapshot: m.ID, Recovery: j.Spec.Recovery, Conns: m.Conns})
		}
		return nil
	})
	if errors.Is(err, coordinated.ErrEnded) {
		return clusterapi.CoordinateReply{}, fmt.Errorf("run %s, cut %s: not dumped: %w", req.Run, req.Cut, err)
	}
	if err != nil {
		return clusterapi.CoordinateReply{}, err
	}
	return rep, nil
}

// coordThaw ends the hold of the request's run for its cut, and with replicate ships the dumps to the
// jobs' protectors (the reply names those that arrived).
func (a *Agent) coordThaw(ctx context.Context, peer string, req clusterapi.CoordinateRequest, replicate bool) (clusterapi.CoordinateReply, error) {
	key := coordinated.HoldKey(req)
	if h := a.coord.Get(key, req.Cut); h != nil && replicate {
		// Pinned before the end of the hold gives back the snapshot lock: a snapshot of the same job taken
		// before the commit would otherwise prune the cut's (keep = 1), and the commit name a deleted one.
		if err := a.uncommitted.Add(key, req.Cut, h.Coordinator, h.Dumped); err != nil {
			// Pinned in memory only: an agent restarted before the commit would let retention delete them.
			// The coordinator gives the cut up (its abort unpins them), and takes the next.
			a.coord.End(key, req.Cut)
			return clusterapi.CoordinateReply{}, fmt.Errorf("run %s, cut %s: not replicated: %w", req.Run, req.Cut, err)
		}
	} else if !replicate {
		a.uncommitted.Done(key, req.Cut, peer) // given up: never committed
	}
	var hold *coordinated.Hold[Job]
	if replicate {
		hold = a.coord.End(key, req.Cut)
	} else {
		hold = a.coord.Abort(key, req.Cut, peer) // an abort that overtook its freeze: the freeze holds nothing
	}
	var rep clusterapi.CoordinateReply
	switch {
	case !replicate:
		return rep, nil
	case hold == nil:
		return rep, fmt.Errorf("run %s is not frozen here for cut %s", req.Run, req.Cut)
	}
	rep.Frozen = hold.FrozenFor
	placements := map[string]*Placement{}
	for _, j := range hold.Jobs {
		placements[j.ID] = j.Spec.Placement
	}
	var errs []error
	for _, r := range a.replicate(ctx, hold.Dumped, placements, nil) {
		if !r.Shipped {
			errs = append(errs, fmt.Errorf("snapshot %s of job %s not replicated: %s", r.Manifest.ID, r.Manifest.Job, r.ShipErr))
			continue
		}
		rep.Parts = append(rep.Parts, clusterapi.CutPart{Job: r.Manifest.Job, Host: a.cfg.Name, Snapshot: r.Manifest.ID})
	}
	return rep, errors.Join(errs...)
}

// rollbackParts checks that this host holds every part's snapshot (fetching those of parts it restores and
// lacks), verified, and that each part's job is one of run's of uid; it stops nothing.
func (a *Agent) rollbackParts(ctx context.Context, run string, uid uint32, parts []clusterapi.CutPart) ([]*ckpt.Manifest, error) {
	var ms []*ckpt.Manifest
	for _, p := range parts {
		if err := a.checkPart(run, uid, p, nil); err != nil {
			return nil, fmt.Errorf("nothing stopped: %w", err)
		}
		if err := a.refuseMovingAway(p.Job); err != nil {
			return nil, fmt.Errorf("nothing stopped: %w", err)
		}
		if _, err := a.store.Manifest(p.Job, p.Snapshot); err != nil && p.Target == a.cfg.Name {
			// In place of a failed host, or on the part's own host that failed and rejoined without its copy
			// (a repaired disk): the part comes from a member that holds one (its protector's replica).
			if err := a.fetch(ctx, p.Job, p.Snapshot, p.Source, p.Source); err != nil {
				return nil, fmt.Errorf("nothing stopped: part %s of job %s: %w", p.Snapshot, p.Job, err)
			}
		}
		m, err := a.store.Verify(ctx, p.Job, p.Snapshot)
		if err == nil {
			err = a.checkPart(run, uid, p, m) // the record in a snapshot just fetched, before anything is stopped
		}
		if err != nil {
			return nil, fmt.Errorf("nothing stopped: part %s of job %s: %w", p.Snapshot, p.Job, err)
		}
		ms = append(ms, m)
	}
	return ms, nil
}

// refuseMovingAway refuses a rollback's part of job id while a migration moves the job off this host
// (recorded moved, the migration's event open): the coordinator listed it here before it left, or nowhere
// while the target restores it, and the part's restore here would claim past the target's incarnation (a
// rollback's claim is forced) while the target's copy runs: two copies.
func (a *Agent) refuseMovingAway(id string) error {
	j, _, err := a.Job(id, 0)
	if err != nil || j.State != JobMoved || j.Migration == "" || j.MovedTo == a.cfg.Name {
		return nil
	}
	for _, f := range a.failures.List() {
		if f.ID == j.Migration && !f.Done {
			return fmt.Errorf("job %s is moving to %s (migration %s): its copy there is not stopped, and a restore here would be a second one; roll the run back again once the migration has ended (`ftctl events`)",
				j.ID, j.MovedTo, j.Migration)
		}
	}
	return nil
}

// rollbackStop checks the parts again (rollbackParts; the prepare phase did on every host), then takes
// each part's job off the host as a migration does (address first,
// then shim and processes), and an ended copy's lingering network with it, and drops what the host logged
// of the jobs' connections: after the rollback they send those sequence numbers again.
func (a *Agent) rollbackStop(ctx context.Context, run string, uid uint32, parts []clusterapi.CutPart) error {
	ms, err := a.rollbackParts(ctx, run, uid, parts)
	if err != nil {
		return err
	}
	a.ckptMu.Lock()
	defer a.ckptMu.Unlock()
	var errs []error
	for i, p := range parts {
		// Again under the snapshot lock, which a migration holds until its job has left.
		if err := a.refuseMovingAway(p.Job); err != nil {
			errs = append(errs, err)
			continue
		}
		j, _, err := a.Job(p.Job, 0)
		if err == nil && j.State == JobRunning {
			if err := a.leaveHost(ctx, j, a.cfg.Name); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		// A copy that ended here (a worker that exited on a diverged master's bytes, say) may have left
		// its network lingering, its address on the wire: a part restored on another host before this
		// host's restore claims the name would meet the old sockets' resets.
		a.endLingering(ctx, jobNetName(a.cfg.Name, p.Job), "a rollback takes an ended copy's lingering network off the wire before any part of its run is restored")
		if a.netlog != nil {
			for _, c := range ms[i].Conns {
				a.netlog.node.Log().Remove(c.Tuple)
			}
		}
	}
	return errors.Join(errs...)
}

// rollbackRestore restores each part's job on this host from its snapshot. The job's network is made and
// guarded before CRIU rebuilds its sockets: a peer restored first retransmits to it, or connects to it
// (the cut caught the run before it connected), and must meet dropped packets, never a reset.
func (a *Agent) rollbackRestore(ctx context.Context, run string, uid uint32, parts []clusterapi.CutPart) error {
	var errs []error
	var restored []string
	for _, p := range parts {
		if err := a.rollbackJob(ctx, run, uid, p); err != nil {
			errs = append(errs, fmt.Errorf("job %s: %w", p.Job, err))
			continue
		}
		restored = append(restored, p.Job)
	}
	if len(restored) > 0 {
		// Protected again at once: the snapshots taken since the cut are of an execution that is gone (a
		// restore from one is refused: its incarnation was superseded).
		go func() {
			if _, err := a.Checkpoint(context.WithoutCancel(ctx), restored, 0); err != nil {
				a.log.Warn("snapshot after a rollback failed; the scheduler retries", "jobs", restored, "err", err)
			}
		}()
	}
	return errors.Join(errs...)
}

func (a *Agent) rollbackJob(ctx context.Context, run string, uid uint32, p clusterapi.CutPart) error {
	m, err := a.store.Manifest(p.Job, p.Snapshot) // verified by the stop phase
	if err != nil {
		return err
	}
	j, err := a.snapshotJob(m)
	if err != nil {
		return err
	}
	if j.ID != m.Job || j.Net == nil || j.Spec.Run != run || j.UID != uid {
		return fmt.Errorf("snapshot %s carries the record of job %q (run %q, uid %d, network %v): not a part of run %s of uid %d", m.ID, j.ID, j.Spec.Run, j.UID, j.Net, run, uid)
	}
	// Forced: the run's jobs were stopped, none runs; the claim goes past any incarnation since the cut.
	_, err = a.claimAndRestore(ctx, "rollback", m, j, true, func(work string) error { return a.guardJobNet(ctx, j, m, work) })
	return err
}

// guardJobNet makes job j's network on this host (restoreJob finds it made) and drops every packet of the
// snapshot's connections in it, and every connection request to the job's address, until CRIU's restore of
// the dump in work has rebuilt them and removes the guard (restore.Guard).
func (a *Agent) guardJobNet(ctx context.Context, j Job, m *ckpt.Manifest, work string) error {
	// Before the network is made: restoreJob's own check refuses the restore only after, and leaves it.
	if err := a.checkRestoredAddr(j); err != nil {
		return err
	}
	runID, err := restore.RunID(work)
	if err != nil {
		return err
	}
	n := *j.Net
	n.Name = jobNetName(a.cfg.Name, j.ID)
	n.Kind = a.cfg.JobNetwork.Kind // as restoreJob makes it
	if err := a.createJobNet(ctx, &n); err != nil {
		return err
	}
	if err := jobnet.Do(n.Name, func() error { return restore.Guard(ctx, runID, m.Conns, []netip.Addr{n.Addr.Addr()}) }); err != nil {
		a.deleteJobNet(ctx, j.ID, &n)
		return fmt.Errorf("guard the connections of job %s: %w", j.ID, err)
	}
	return nil
}

// coordinatedJobs splits a failed host's jobs: those whose run rolls back as a whole without trying
// message logging (RecoveryCoordinated, with a cut recorded here), and the others.
func (a *Agent) coordinatedJobs(jobs []RecoverJob) (logging []RecoverJob, rollback []string) {
	cuts := a.cutRecords()
	for _, j := range jobs {
		if cuts.Coordinated(j.Job) {
			rollback = append(rollback, j.Job)
			continue
		}
		logging = append(logging, j)
	}
	return logging, rollback
}

// rollbackAfterFailure recovers the failed host's jobs whose runs roll back as a whole
// (coordinated.Coordinator.AfterFailure; rollback: those in coordinated mode), the failed host's parts on
// target, with the stages in the failure's event.
func (a *Agent) rollbackAfterFailure(ctx context.Context, failed, target string, jobs, rollback []string, mlErr error, emit func(Stage)) error {
	stage := func(st coordinated.Stage) { emit(cutStage(st)) }
	return a.coordinator().AfterFailure(ctx, failed, target, jobs, rollback, mlErr, a.holdsCutPart, stage)
}

// abortLeftCuts gives up the cuts a previous agent coordinated and left under way
// (coordinated.Coordinator.AbortLeft): their hosts hold them, a run's jobs frozen or its snapshots pinned,
// until their bounds otherwise.
func (a *Agent) abortLeftCuts(ctx context.Context) {
	a.coordinator().AbortLeft(ctx)
}

// scheduleCuts takes the coordinated snapshots of the runs of this host's jobs in coordinated or auto
// mode, at their jobs' interval since the run's newest cut (coordinated.Coordinator.Schedule).
func (a *Agent) scheduleCuts(ctx context.Context) {
	a.coordinator().Schedule(ctx, func() map[coordinated.Run]time.Duration {
		due := map[coordinated.Run]time.Duration{}
		for _, j := range a.Jobs(0) {
			if j.State != JobRunning || !j.Spec.RollsBackRun() || j.LazyWork != "" {
				continue
			}
			k, iv := coordinated.Run{Name: j.Spec.Run, UID: j.UID}, a.jobInterval(j.ID)
			if cur, ok := due[k]; !ok || iv < cur {
				due[k] = iv
			}
		}
		return due
	})
}

// aliveMembers are the names of the view's alive members.
func (a *Agent) aliveMembers() []string {
	var out []string
	for _, m := range a.View().Members {
		if m.State == ring.StateAlive {
			out = append(out, m.Name)
		}
	}
	return out
}
