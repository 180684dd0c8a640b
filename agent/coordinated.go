package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/ring"
)

// Coordinated snapshots ("cuts") and whole-run rollback (issue 11): for a program message logging cannot
// replay exactly (it decides from the clock, or from which messages had arrived), the run's jobs, on
// every host, are frozen before any is dumped and thawed only once all are: every byte between them is
// then in exactly one snapshot's socket queues, which the coordinator checks from the snapshots'
// sequence numbers before it records the cut. A rollback stops every job of the run (its address off the
// wire first, so its peers see nothing) before any is restored from the cut, each on its host. Only jobs
// with an address of their own take part: a job on its host's address cannot be killed silently, and its
// restored sockets would meet the killed ones' in the host's tables.

// KindRollback marks a whole-run rollback in the event log (Failure.Kind; Node: the coordinator).
const KindRollback = "rollback"

// Stages of a rollback.
const (
	StageStopped    = "stopped"
	StageRolledBack = "restored from the cut"
)

// coordHoldMax is how long a host keeps a run's jobs frozen for a coordinator that does not come back
// (crashed, cut off): then it thaws them by itself and the cut is given up.
const coordHoldMax = time.Minute

// cutAttempts is how often a coordinated snapshot is tried when its check finds a byte in no snapshot
// (acknowledged by a receiver after its dump, before its sender's).
const cutAttempts = 3

// Cut is a coordinated snapshot of a run (the jobs of user UID named Run): one replicated snapshot per job.
type Cut struct {
	Run    string               `json:"run"`
	UID    uint32               `json:"uid"`
	ID     string               `json:"id"`
	Taken  time.Time            `json:"taken"`
	Frozen time.Duration        `json:"frozen_ns"` // the longest any host held its jobs frozen
	Parts  []clusterapi.CutPart `json:"parts"`
}

// RunRequest names a run for a coordinated snapshot or a rollback: its name, and its user when users'
// runs of that name would be ambiguous (nil: the one user whose run has that name).
type RunRequest struct {
	Run string  `json:"run"`
	UID *uint32 `json:"uid,omitempty"`
}

// Rollback is the outcome of a whole-run rollback.
type Rollback struct {
	Run     string               `json:"run"`
	Cut     string               `json:"cut"`
	Event   string               `json:"event"`
	Stopped time.Duration        `json:"stopped_ns"` // from the first stop to the last restored job running
	Parts   []clusterapi.CutPart `json:"parts"`
}

// ErrNoCut means a run has no coordinated snapshot this host knows of.
var ErrNoCut = errors.New("no coordinated snapshot")

// coordHolds are the runs whose jobs this host holds frozen for a coordinator, by run.
type coordHolds struct {
	mu sync.Mutex
	m  map[string]*coordHold
}

type coordHold struct {
	cut         string
	coordinator string        // the member whose freeze this is: when it is declared failed, the hold ends
	frozen      time.Time     // when the freeze began
	frozenFor   time.Duration // from the freeze to the thaw (endHold)
	jobs        []Job
	dumped      []*ckpt.Manifest
	timer       *time.Timer
	release     func() // gives back the agent's snapshot lock, once
}

// CoordinatedSnapshot takes a cut of run across the cluster, with this agent as its coordinator (root
// only: it freezes every job of the run, on every host).
func (a *Agent) CoordinatedSnapshot(ctx context.Context, req RunRequest, uid uint32) (*Cut, error) {
	if uid != 0 {
		return nil, errors.New("a coordinated snapshot stops jobs on every host of a run: it is for root (the operator)")
	}
	run := req.Run
	if !jobNameRE.MatchString(run) {
		return nil, fmt.Errorf("run %q: use up to 48 letters, digits, '.', '_' or '-'", run)
	}
	var errs []error
	for range cutAttempts {
		cut, err := a.takeCut(ctx, run, req.UID)
		var torn *tornCutError
		if !errors.As(err, &torn) {
			return cut, err
		}
		a.log.Warn("coordinated snapshot not consistent; taking it again", "run", run, "err", err)
		errs = append(errs, err)
	}
	return nil, fmt.Errorf("run %s: %d coordinated snapshots in a row were not consistent: %w", run, cutAttempts, errors.Join(errs...))
}

// takeCut is one attempt: list, freeze, dump, thaw (and replicate), check, commit.
func (a *Agent) takeCut(ctx context.Context, run string, owner *uint32) (*Cut, error) {
	hosts, uid, err := a.runHosts(ctx, run, owner)
	if err != nil {
		return nil, err
	}
	cut := &Cut{Run: run, UID: uid, ID: "cut-" + time.Now().UTC().Format("20060102T150405.000"), Taken: time.Now().UTC()}
	req := func(phase clusterapi.CoordPhase) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: run, UID: &uid, Cut: cut.ID, Phase: phase}
	}
	abort := func(why error) error {
		a.onHosts(context.WithoutCancel(ctx), hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordAbort) })
		return fmt.Errorf("coordinated snapshot of run %s given up, its jobs thawed: %w", run, why)
	}
	if _, err := a.onHosts(ctx, hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordFreeze) }); err != nil {
		return nil, abort(err)
	}
	dumped, err := a.onHosts(ctx, hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordDump) })
	if err != nil {
		return nil, abort(err)
	}
	// Thawing replicates the dumps: a cut is recorded only once every part of it is on a protector.
	replicated, err := a.onHosts(ctx, hosts, func(string) clusterapi.CoordinateRequest { return req(clusterapi.CoordThaw) })
	for _, rep := range replicated {
		cut.Frozen = max(cut.Frozen, rep.Frozen)
	}
	if err != nil {
		return nil, fmt.Errorf("coordinated snapshot of run %s not recorded: %w", run, err)
	}
	var parts []clusterapi.CutPart
	for _, h := range hosts {
		parts = append(parts, dumped[h].Parts...)
		if len(replicated[h].Parts) != len(dumped[h].Parts) {
			return nil, fmt.Errorf("coordinated snapshot of run %s not recorded: %s replicated %d of its %d parts", run, h, len(replicated[h].Parts), len(dumped[h].Parts))
		}
	}
	if err := checkCut(parts); err != nil {
		return nil, err
	}
	for i := range parts {
		parts[i].Conns = nil // checked; the record names the snapshots, which hold them
	}
	cut.Parts = parts
	// Every alive member keeps the record, so that any of them can roll the run back.
	members := a.aliveMembers()
	commit := req(clusterapi.CoordCommit)
	commit.Parts = parts
	if _, err := a.onHosts(ctx, members, func(string) clusterapi.CoordinateRequest { return commit }); err != nil {
		a.log.Warn("coordinated snapshot recorded on some members only", "run", run, "cut", cut.ID, "err", err)
	}
	a.log.Info("coordinated snapshot of a run", "run", run, "cut", cut.ID, "jobs", len(parts), "hosts", len(hosts), "frozen_ms", cut.Frozen.Milliseconds())
	return cut, nil
}

// runHosts asks every alive member which jobs of run (of user owner; nil: of the one user who has a run
// of that name) it runs, and returns the members that run some and the run's user.
func (a *Agent) runHosts(ctx context.Context, run string, owner *uint32) ([]string, uint32, error) {
	listed, err := a.listRun(ctx, run, owner)
	if err != nil {
		return nil, 0, err
	}
	users := map[uint32]bool{}
	var hosts []string
	for _, h := range a.aliveMembers() {
		if len(listed[h].Jobs) > 0 {
			hosts = append(hosts, h)
		}
		for _, u := range listed[h].Owners {
			users[u] = true
		}
	}
	switch {
	case len(hosts) == 0:
		return nil, 0, fmt.Errorf("%w: run %s has no running job on an alive member (a job joins a run with its spec's run, `ftctl mpirun` sets it)", ErrNoJob, run)
	case len(users) > 1:
		return nil, 0, fmt.Errorf("%w: runs named %s of users %v: name the user (--uid)", ErrNotMovable, run, slices.Sorted(maps.Keys(users)))
	}
	var uid uint32
	for u := range users {
		uid = u
	}
	return hosts, uid, nil
}

// listRun asks every alive member which jobs of run (of user owner, nil: of any user) it runs.
func (a *Agent) listRun(ctx context.Context, run string, owner *uint32) (map[string]clusterapi.CoordinateReply, error) {
	listed, err := a.onHosts(ctx, a.aliveMembers(), func(string) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: run, UID: owner, Cut: "list", Phase: clusterapi.CoordList}
	})
	if err != nil {
		return nil, fmt.Errorf("list the jobs of run %s: %w", run, err)
	}
	return listed, nil
}

// onHosts runs the phase req(host) on each host at once (this agent's own directly) and returns the
// replies by host; the error names every host that failed.
func (a *Agent) onHosts(ctx context.Context, hosts []string, req func(host string) clusterapi.CoordinateRequest) (map[string]clusterapi.CoordinateReply, error) {
	type result struct {
		host string
		rep  clusterapi.CoordinateReply
		err  error
	}
	out := make(chan result, len(hosts))
	for _, h := range hosts {
		go func() {
			r := req(h)
			var rep clusterapi.CoordinateReply
			var err error
			if h == a.cfg.Name {
				rep, err = a.serveCoordinate(ctx, h, r)
			} else {
				rep, err = a.peers().Coordinate(ctx, h, r)
			}
			if err != nil {
				err = fmt.Errorf("%s on %s: %w", r.Phase, h, err)
			}
			out <- result{h, rep, err}
		}()
	}
	reps := map[string]clusterapi.CoordinateReply{}
	var errs []error
	for range hosts {
		r := <-out
		reps[r.host] = r.rep
		errs = append(errs, r.err)
	}
	return reps, errors.Join(errs...)
}

// tornCutError is a cut whose snapshots do not fit together; another attempt may succeed.
type tornCutError struct{ problems []string }

func (e *tornCutError) Error() string {
	return "the snapshots do not fit together: " + strings.Join(e.problems, "; ")
}

// checkCut checks that parts restore the run's connections whole (ckpt.Match): a connection to a job outside
// the run is refused, since a rollback could not restore its other end; a torn one may fit at another try.
func checkCut(parts []clusterapi.CutPart) error {
	snaps := make([]ckpt.Part, len(parts))
	for i, p := range parts {
		snaps[i] = ckpt.Part{Job: p.Job, Conns: p.Conns}
	}
	var outside, torn []string
	for _, m := range ckpt.Match(snaps, nil) {
		if m.Peer == "" {
			outside = append(outside, fmt.Sprintf("job %s's connection %s -> %s", m.Job, m.Conn.Local, m.Conn.Remote))
		} else {
			torn = append(torn, fmt.Sprintf("%s -> %s: %s", m.Conn.Local, m.Conn.Remote, m.Why))
		}
	}
	if len(outside) > 0 {
		slices.Sort(outside)
		return fmt.Errorf("%w: a rollback could not restore the other end of %s: it is not a job of the run", ErrNotMovable, strings.Join(outside, ", "))
	}
	if len(torn) > 0 {
		slices.Sort(torn)
		return &tornCutError{torn}
	}
	return nil
}

// Rollback rolls run back to its newest cut this host knows: every job of the run is stopped, then each
// is restored from its part of the cut where it runs (rollbackCut; root only).
func (a *Agent) Rollback(ctx context.Context, req RunRequest, uid uint32) (*Rollback, error) {
	if uid != 0 {
		return nil, errors.New("a rollback kills and restores jobs on every host of a run: it is for root (the operator)")
	}
	run := req.Run
	cut, err := a.loadCut(run, req.UID)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	id := fmt.Sprintf("%s-rollback-%s", run, start.UTC().Format("20060102T150405.000"))
	var jobs []string
	for _, p := range cut.Parts {
		jobs = append(jobs, p.Job)
	}
	a.failures.update(id, func(f *Failure) {
		f.Kind, f.Node, f.Protector, f.LastBeat, f.Detected, f.Jobs = KindRollback, a.cfg.Name, a.cfg.Name, start, start, jobs
	})
	emit := func(st Stage) {
		a.failures.update(id, func(f *Failure) { f.Stages = append(f.Stages, st) })
		a.saveFailures()
	}
	err = a.rollbackCut(ctx, cut, "", emit)
	res := &Rollback{Run: run, Cut: cut.ID, Event: id, Parts: cut.Parts, Stopped: time.Since(start)}
	a.failures.update(id, func(f *Failure) {
		f.Done, f.Error = true, errString(err)
	})
	a.saveFailures()
	a.pushView(ctx)
	if err != nil {
		return nil, err
	}
	return res, nil
}

// rollbackCut stops every job of cut's run, on every host, then restores each from its part where it runs
// now (the alive members are asked), or on its host if it runs nowhere; a part whose host is not alive and
// that runs nowhere is restored on target (a spare in place of a failed host; "": refused). emit gets the
// stages.
func (a *Agent) rollbackCut(ctx context.Context, cut *Cut, target string, emit func(Stage)) error {
	alive := a.aliveMembers()
	listed, err := a.listRun(ctx, cut.Run, &cut.UID)
	if err != nil {
		// A job of the run nobody could ask about could run on: a restored copy would be a second one.
		return fmt.Errorf("run %s not rolled back: where its jobs run is not known: %w", cut.Run, err)
	}
	where := map[string]string{} // job -> the host it runs on now
	for h, rep := range listed {
		for _, j := range rep.Jobs {
			where[j] = h
		}
	}
	held := func(p clusterapi.CutPart) bool { _, err := a.store.Manifest(p.Job, p.Snapshot); return err == nil }
	byHost, hosts, err := placeParts(cut, where, alive, target, a.cfg.Name, held)
	if err != nil {
		return err
	}
	stage := func(name string, from time.Time, err error) {
		emit(Stage{Name: name, Host: strings.Join(hosts, ","), Start: from, End: time.Now(), Detail: fmt.Sprintf("run %s, cut %s", cut.Run, cut.ID), Error: errString(err)})
	}
	phase := func(p clusterapi.CoordPhase) func(string) clusterapi.CoordinateRequest {
		return func(h string) clusterapi.CoordinateRequest {
			return clusterapi.CoordinateRequest{Run: cut.Run, UID: &cut.UID, Cut: cut.ID, Phase: p, Parts: byHost[h]}
		}
	}
	// Every job stops before any is restored: a restored job must never exchange with a live old one.
	start := time.Now()
	_, err = a.onHosts(ctx, hosts, phase(clusterapi.CoordStop))
	stage(StageStopped, start, err)
	if err == nil {
		from := time.Now()
		_, err = a.onHosts(ctx, hosts, phase(clusterapi.CoordRestore))
		stage(StageRolledBack, from, err)
	}
	if err != nil {
		return fmt.Errorf("rollback of run %s to cut %s failed: %w; `ftctl status` on its hosts shows which jobs run", cut.Run, cut.ID, err)
	}
	a.log.Info("run rolled back to its coordinated snapshot", "run", cut.Run, "cut", cut.ID, "jobs", len(cut.Parts), "hosts", hosts, "ms", time.Since(start).Milliseconds())
	return nil
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
		return a.coordDump(ctx, req)
	case clusterapi.CoordThaw, clusterapi.CoordAbort:
		return a.coordThaw(ctx, holdKey(req), req.Cut, req.Phase == clusterapi.CoordThaw)
	case clusterapi.CoordCommit:
		return clusterapi.CoordinateReply{}, a.saveCut(Cut{Run: req.Run, UID: *req.UID, ID: req.Cut, Taken: time.Now().UTC(), Parts: req.Parts})
	case clusterapi.CoordStop:
		return clusterapi.CoordinateReply{}, a.rollbackStop(ctx, req.Run, *req.UID, req.Parts)
	case clusterapi.CoordRestore:
		return clusterapi.CoordinateReply{}, a.rollbackRestore(ctx, req.Run, *req.UID, req.Parts)
	}
	return clusterapi.CoordinateReply{}, fmt.Errorf("no phase %q", req.Phase)
}

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
// the thaw of coordinator, its failure (endHoldsOfFailed), or coordHoldMax.
func (a *Agent) coordFreeze(ctx context.Context, coordinator string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	if err := a.checkRunJobs(req.Run, req.UID); err != nil {
		return clusterapi.CoordinateReply{}, err
	}
	for _, j := range a.runJobs(req.Run, req.UID) {
		if err := a.waitPagesIn(ctx, j.ID); err != nil { // before the freeze: a dump needs every page in
			return clusterapi.CoordinateReply{}, err
		}
	}
	a.ckptMu.Lock() // no scheduled snapshot, migration or drain of these jobs until they thaw
	hold := &coordHold{cut: req.Cut, coordinator: coordinator, jobs: a.runJobs(req.Run, req.UID), release: sync.OnceFunc(a.ckptMu.Unlock), frozen: time.Now()}
	a.coord.mu.Lock()
	key := holdKey(req)
	if h, ok := a.coord.m[key]; ok {
		a.coord.mu.Unlock()
		hold.release()
		return clusterapi.CoordinateReply{}, fmt.Errorf("a coordinated snapshot of run %s is under way here (%s)", req.Run, h.cut)
	}
	if a.coord.m == nil {
		a.coord.m = map[string]*coordHold{}
	}
	a.coord.m[key] = hold
	hold.timer = time.AfterFunc(coordHoldMax, func() {
		if a.endHold(key, req.Cut) != nil {
			a.log.Error("coordinator of a coordinated snapshot did not come back: the run's jobs thawed here", "run", req.Run, "cut", req.Cut, "after", coordHoldMax)
		}
	})
	a.coord.mu.Unlock()
	var cgroups []string
	for _, j := range hold.jobs {
		if err := setFrozen(j.Cgroup, true); err != nil {
			a.endHold(key, req.Cut)
			return clusterapi.CoordinateReply{}, fmt.Errorf("freeze job %s: %w", j.ID, err)
		}
		cgroups = append(cgroups, j.Cgroup)
	}
	if err := waitFrozen(ctx, cgroups, freezeTimeout); err != nil {
		a.endHold(key, req.Cut)
		return clusterapi.CoordinateReply{}, err
	}
	var rep clusterapi.CoordinateReply
	for _, j := range hold.jobs {
		rep.Jobs = append(rep.Jobs, j.ID)
	}
	return rep, nil
}

// holdKey names the hold of a request's run: runs are per user.
func holdKey(req clusterapi.CoordinateRequest) string { return fmt.Sprintf("%d/%s", *req.UID, req.Run) }

// endHold ends the hold key (holdKey) for cut, if there is one: its jobs thaw and the snapshot lock is given
// back. It returns the hold, nil if there was none.
func (a *Agent) endHold(key, cut string) *coordHold {
	a.coord.mu.Lock()
	hold := a.coord.m[key]
	if hold == nil || hold.cut != cut {
		a.coord.mu.Unlock()
		return nil
	}
	delete(a.coord.m, key)
	a.coord.mu.Unlock()
	hold.timer.Stop()
	for _, j := range hold.jobs {
		a.thaw(j)
	}
	hold.release()
	hold.frozenFor = time.Since(hold.frozen)
	return hold
}

// endHoldsOfFailed ends the holds whose coordinator v declares failed. Such a cut never completes, and its
// hold would keep the run's jobs here frozen, and this host's snapshot lock taken (which a rollback's stop
// needs), until coordHoldMax: a task farm's rollback after its coordinator's crash waited 55 s for it.
func (a *Agent) endHoldsOfFailed(v ring.View) {
	a.coord.mu.Lock()
	ended := map[string]*coordHold{}
	for key, h := range a.coord.m {
		if m, ok := v.Member(h.coordinator); ok && m.State == ring.StateFailed {
			ended[key] = h
		}
	}
	a.coord.mu.Unlock()
	for key, h := range ended {
		if a.endHold(key, h.cut) != nil {
			a.log.Warn("coordinator of a coordinated snapshot failed: the run's jobs thawed here", "coordinator", h.coordinator, "cut", h.cut, "frozen_for", time.Since(h.frozen).Round(time.Millisecond))
		}
	}
}

// coordDump dumps the frozen jobs of the run, leaving them frozen.
func (a *Agent) coordDump(ctx context.Context, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	a.coord.mu.Lock()
	hold := a.coord.m[holdKey(req)]
	a.coord.mu.Unlock()
	if hold == nil || hold.cut != req.Cut {
		return clusterapi.CoordinateReply{}, fmt.Errorf("run %s is not frozen here for cut %s (thawed after %s without word from its coordinator?)", req.Run, req.Cut, coordHoldMax)
	}
	hold.timer.Stop() // a dump takes as long as it needs; the wait for the thaw starts again after it
	defer hold.timer.Reset(coordHoldMax)
	var rep clusterapi.CoordinateReply
	for _, j := range hold.jobs {
		m, err := a.snapshot(ctx, j, true, false)
		if err != nil {
			return clusterapi.CoordinateReply{}, fmt.Errorf("dump job %s: %w", j.ID, err)
		}
		hold.dumped = append(hold.dumped, m)
		rep.Parts = append(rep.Parts, clusterapi.CutPart{Job: j.ID, Host: a.cfg.Name, Snapshot: m.ID, Recovery: j.Spec.Recovery, Conns: m.Conns})
	}
	return rep, nil
}

// coordThaw ends the hold of the run for cut (endHold), and with replicate ships the dumps to the jobs'
// protectors (the reply names those that arrived).
func (a *Agent) coordThaw(ctx context.Context, key, cut string, replicate bool) (clusterapi.CoordinateReply, error) {
	hold := a.endHold(key, cut)
	var rep clusterapi.CoordinateReply
	switch {
	case !replicate:
		return rep, nil
	case hold == nil:
		return rep, fmt.Errorf("run %s is not frozen here for cut %s", key, cut)
	}
	rep.Frozen = hold.frozenFor
	placements := map[string]*Placement{}
	for _, j := range hold.jobs {
		placements[j.ID] = j.Spec.Placement
	}
	var errs []error
	for _, r := range a.replicate(ctx, hold.dumped, placements, nil) {
		if !r.Shipped {
			errs = append(errs, fmt.Errorf("snapshot %s of job %s not replicated: %s", r.Manifest.ID, r.Manifest.Job, r.ShipErr))
			continue
		}
		rep.Parts = append(rep.Parts, clusterapi.CutPart{Job: r.Manifest.Job, Host: a.cfg.Name, Snapshot: r.Manifest.ID})
	}
	return rep, errors.Join(errs...)
}

// cutsDir holds the newest cut of each run this host was told of, as <run>.<uid>.json.
func (a *Agent) cutsDir() string { return filepath.Join(a.cfg.StateDir, "cuts") }

func (a *Agent) cutPath(run string, uid uint32) string {
	return filepath.Join(a.cutsDir(), fmt.Sprintf("%s.%d.json", run, uid))
}

func (a *Agent) saveCut(c Cut) error {
	if !jobNameRE.MatchString(c.Run) {
		return fmt.Errorf("run %q is no run's name", c.Run)
	}
	if old, err := a.loadCut(c.Run, &c.UID); err == nil && old.ID >= c.ID {
		return nil // a newer cut's record arrived first (ids begin with the time)
	}
	if err := os.MkdirAll(a.cutsDir(), privateDir); err != nil {
		return fmt.Errorf("record cut %s of run %s: %w", c.ID, c.Run, err)
	}
	if err := atomicfile.WriteJSON(a.cutPath(c.Run, c.UID), c); err != nil {
		return fmt.Errorf("record cut %s of run %s: %w", c.ID, c.Run, err)
	}
	return nil
}

// loadCut reads the newest cut of run of user owner recorded here (nil: of the one user with a cut of a
// run of that name), and validates it as it came from another member.
func (a *Agent) loadCut(run string, owner *uint32) (*Cut, error) {
	if !jobNameRE.MatchString(run) {
		return nil, fmt.Errorf("run %q: use up to 48 letters, digits, '.', '_' or '-'", run)
	}
	if owner == nil {
		var users []uint32
		for _, k := range a.cutKeys() {
			if k.run == run {
				users = append(users, k.uid)
			}
		}
		switch len(users) {
		case 0:
			return nil, fmt.Errorf("%w of run %s is recorded on %s: take one with `ftctl checkpoint --run %s`", ErrNoCut, run, a.cfg.Name, run)
		case 1:
			owner = &users[0]
		default:
			slices.Sort(users)
			return nil, fmt.Errorf("%w: runs named %s of users %v have coordinated snapshots: name the user (--uid)", ErrNotMovable, run, users)
		}
	}
	b, err := readBounded(a.cutPath(run, *owner), clusterapi.MaxMessage)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w of run %s of uid %d is recorded on %s: take one with `ftctl checkpoint --run %s`", ErrNoCut, run, *owner, a.cfg.Name, run)
	}
	var c Cut
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err == nil && (c.Run != run || c.UID != *owner) {
		err = fmt.Errorf("it names run %s of uid %d", c.Run, c.UID)
	}
	if err == nil {
		err = clusterapi.CoordinateRequest{Run: c.Run, UID: &c.UID, Cut: c.ID, Phase: clusterapi.CoordCommit, Parts: c.Parts}.Validate()
	}
	if err != nil {
		return nil, fmt.Errorf("cut record of run %s on %s: %w", run, a.cfg.Name, err)
	}
	return &c, nil
}

type cutKey struct {
	run string
	uid uint32
}

// cutKeys are the runs with a cut recorded here.
func (a *Agent) cutKeys() []cutKey {
	des, err := os.ReadDir(a.cutsDir())
	if err != nil {
		return nil
	}
	var out []cutKey
	for _, de := range des {
		name, ok := strings.CutSuffix(de.Name(), ".json")
		i := strings.LastIndexByte(name, '.')
		if !ok || i < 0 || !de.Type().IsRegular() {
			continue
		}
		uid, err := strconv.ParseUint(name[i+1:], 10, 32)
		if err != nil || !jobNameRE.MatchString(name[:i]) {
			continue
		}
		out = append(out, cutKey{name[:i], uint32(uid)})
	}
	return out
}

// rollbackStop checks that this host holds every part's snapshot (fetching those of parts it restores in
// place of a failed host), then takes each part's job off the host
// as a migration does (address first, then shim and processes), and drops what the host logged of the
// jobs' connections: after the rollback they send those sequence numbers again.
func (a *Agent) rollbackStop(ctx context.Context, run string, uid uint32, parts []clusterapi.CutPart) error {
	var ms []*ckpt.Manifest
	for _, p := range parts {
		if j, _, err := a.Job(p.Job, 0); err == nil && (j.Spec.Run != run || j.UID != uid) {
			return fmt.Errorf("nothing stopped: job %s here is not a job of run %s of uid %d", p.Job, run, uid)
		}
		if _, err := a.store.Manifest(p.Job, p.Snapshot); err != nil && p.Target == a.cfg.Name && p.Target != p.Host {
			// In place of a failed host: its part comes from a member that holds a copy.
			if err := a.fetch(ctx, p.Job, p.Snapshot, p.Source, p.Source); err != nil {
				return fmt.Errorf("nothing stopped: part %s of job %s: %w", p.Snapshot, p.Job, err)
			}
		}
		m, err := a.store.Verify(ctx, p.Job, p.Snapshot)
		if err != nil {
			return fmt.Errorf("nothing stopped: part %s of job %s: %w", p.Snapshot, p.Job, err)
		}
		ms = append(ms, m)
	}
	a.ckptMu.Lock()
	defer a.ckptMu.Unlock()
	var errs []error
	for i, p := range parts {
		j, _, err := a.Job(p.Job, 0)
		if err == nil && j.State == JobRunning {
			if err := a.leaveHost(ctx, j, a.cfg.Name); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		if a.netlog != nil {
			for _, c := range ms[i].Conns {
				a.netlog.node.Log().Remove(c.Tuple)
			}
		}
	}
	return errors.Join(errs...)
}

// rollbackRestore restores each part's job on this host from its snapshot. The job's network is made and guarded before CRIU rebuilds its sockets:
// a peer restored first retransmits to it, and must meet dropped packets, never a reset.
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
// snapshot's connections in it until CRIU's restore of the dump in work has rebuilt them and removes the
// guard (restore.Guard).
func (a *Agent) guardJobNet(ctx context.Context, j Job, m *ckpt.Manifest, work string) error {
	runID, err := restore.RunID(work)
	if err != nil {
		return err
	}
	n := *j.Net
	n.Name = jobNetName(a.cfg.Name, j.ID)
	if err := a.createJobNet(ctx, &n); err != nil {
		return err
	}
	if err := jobnet.Do(n.Name, func() error { return restore.Guard(ctx, runID, m.Conns) }); err != nil {
		a.deleteJobNet(ctx, j.ID, &n)
		return fmt.Errorf("guard the connections of job %s: %w", j.ID, err)
	}
	return nil
}

// pinnedSnapshots are job's snapshots that a cut recorded here names: retention keeps them.
func (a *Agent) pinnedSnapshots(job string) []string {
	var out []string
	for _, c := range a.cuts() {
		for _, p := range c.Parts {
			if p.Job == job {
				out = append(out, p.Snapshot)
			}
		}
	}
	return out
}

// cuts are the cuts recorded here, one per run.
func (a *Agent) cuts() []*Cut {
	var out []*Cut
	for _, k := range a.cutKeys() {
		if c, err := a.loadCut(k.run, &k.uid); err == nil {
			out = append(out, c)
		} else {
			a.log.Warn("unreadable cut record", "run", k.run, "uid", k.uid, "err", err)
		}
	}
	return out
}

// cutWith is the recorded cut one of whose parts is job's, or nil.
func (a *Agent) cutWith(job string) (*Cut, clusterapi.CutPart) {
	for _, c := range a.cuts() {
		for _, p := range c.Parts {
			if p.Job == job {
				return c, p
			}
		}
	}
	return nil, clusterapi.CutPart{}
}

// coordinatedJobs splits a failed host's jobs: those whose run rolls back as a whole without trying
// message logging (RecoveryCoordinated, with a cut recorded here), and the others.
func (a *Agent) coordinatedJobs(jobs []RecoverJob) (logging []RecoverJob, coordinated []string) {
	for _, j := range jobs {
		if c, p := a.cutWith(j.Job); c != nil && p.Recovery == RecoveryCoordinated {
			coordinated = append(coordinated, j.Job)
			continue
		}
		logging = append(logging, j)
	}
	return logging, coordinated
}

// rollbackAfterFailure recovers the failed host's jobs whose runs roll back as a whole: those in
// coordinated mode, and, if message logging failed (mlErr), those in auto mode. Each such run rolls back
// to its cut, the failed host's parts on target. It returns what is left unrecovered (nil if every
// job of the failed host runs again).
func (a *Agent) rollbackAfterFailure(ctx context.Context, failed, target string, jobs, coordinated []string, mlErr error, emit func(Stage)) error {
	runs := map[string]*Cut{}
	var order []string
	rolled := map[string]bool{}
	for _, j := range jobs {
		c, p := a.cutWith(j)
		switch {
		case c == nil:
			continue
		case slices.Contains(coordinated, j), mlErr != nil && p.Recovery == RecoveryAuto:
		default:
			continue
		}
		if _, ok := runs[c.Run]; !ok {
			runs[c.Run] = c
			order = append(order, c.Run)
		}
	}
	if len(order) == 0 {
		return mlErr
	}
	var errs []error
	for _, run := range order {
		c := runs[run]
		why := "coordinated mode"
		if mlErr != nil {
			why = "message logging failed: " + mlErr.Error()
		}
		a.log.Warn("rolling a whole run back to its coordinated snapshot", "run", run, "cut", c.ID, "failed", failed, "target", target, "why", why)
		if err := a.rollbackCut(ctx, c, target, emit); err != nil {
			errs = append(errs, err)
			continue
		}
		for _, p := range c.Parts {
			rolled[p.Job] = true
		}
	}
	// A job neither message logging nor a rollback brought back keeps message logging's error.
	for _, j := range jobs {
		if !rolled[j] && (mlErr != nil || slices.Contains(coordinated, j)) {
			return errors.Join(append(errs, mlErr)...)
		}
	}
	return errors.Join(errs...)
}

// scheduleCuts takes the coordinated snapshots of the runs of this host's jobs in coordinated or auto
// mode, at their jobs' interval since the run's newest cut. Of the hosts that run a part of a run, the
// first by name coordinates; the others only take part.
func (a *Agent) scheduleCuts(ctx context.Context) {
	tried := map[cutKey]time.Time{} // the last attempt this host coordinated or declined
	tickgrid.Every(ctx, time.Second, func() {
		now := time.Now()
		due := map[cutKey]time.Duration{}
		for _, j := range a.Jobs(0) {
			if j.State != JobRunning || !j.Spec.rollsBackRun() || j.LazyWork != "" {
				continue
			}
			k, iv := cutKey{j.Spec.Run, j.UID}, a.jobInterval(j.ID)
			if cur, ok := due[k]; !ok || iv < cur {
				due[k] = iv
			}
		}
		for k, iv := range due {
			last := tried[k]
			if c, err := a.loadCut(k.run, &k.uid); err == nil && c.Taken.After(last) {
				last = c.Taken
			}
			if now.Sub(last) < iv {
				continue
			}
			tried[k] = now
			hosts, _, err := a.runHosts(ctx, k.run, &k.uid)
			if err != nil || slices.Min(hosts) != a.cfg.Name {
				continue // another host coordinates (or the run cannot be listed now: next interval)
			}
			if _, err := a.CoordinatedSnapshot(ctx, RunRequest{Run: k.run, UID: &k.uid}, 0); err != nil {
				a.log.Warn("scheduled coordinated snapshot failed; retrying at the next interval", "run", k.run, "uid", k.uid, "err", err)
			}
		}
		for k := range tried {
			if _, ok := due[k]; !ok {
				delete(tried, k)
			}
		}
	})
}

// rollsBack reports whether job's run rolls back as a whole when the job's message-logging recovery fails
// (auto mode, and a cut of the run is recorded here).
func (a *Agent) rollsBack(job string) bool {
	c, p := a.cutWith(job)
	return c != nil && p.Recovery == RecoveryAuto
}

// rollsBackAlone reports whether job's run can roll back as a whole without message logging (coordinated or
// auto mode, and a cut of the run is recorded here).
func (a *Agent) rollsBackAlone(job string) bool {
	c, p := a.cutWith(job)
	return c != nil && (p.Recovery == RecoveryAuto || p.Recovery == RecoveryCoordinated)
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

// placeParts decides where each part of cut is restored: where its job runs now (where: job -> host), else
// on its host if alive, else on target (if not ""). A part restored off its host is fetched from self if
// held says this host has it, else from any holder. A job of the run that is not in the cut refuses the
// rollback (it started after the cut). It returns the parts by host and the hosts in order.
func placeParts(cut *Cut, where map[string]string, alive []string, target, self string, held func(clusterapi.CutPart) bool) (map[string][]clusterapi.CutPart, []string, error) {
	where = maps.Clone(where)
	byHost := map[string][]clusterapi.CutPart{}
	var hosts []string
	for _, p := range cut.Parts {
		on, ok := where[p.Job]
		delete(where, p.Job)
		switch {
		case ok:
			p.Target = on
		case slices.Contains(alive, p.Host):
			p.Target = p.Host
		case target != "":
			p.Target = target
		default:
			return nil, nil, fmt.Errorf("run %s not rolled back: job %s runs nowhere and %s, whose snapshot is its part of cut %s, is not alive", cut.Run, p.Job, p.Host, cut.ID)
		}
		p.Source = ""
		if p.Target != p.Host && held(p) {
			p.Source = self
		}
		if _, ok := byHost[p.Target]; !ok {
			hosts = append(hosts, p.Target)
		}
		byHost[p.Target] = append(byHost[p.Target], p)
	}
	if len(where) > 0 {
		return nil, nil, fmt.Errorf("%w: run %s not rolled back: jobs %v of the run started after its cut %s (take a new one)", ErrNotMovable, cut.Run, slices.Sorted(maps.Keys(where)), cut.ID)
	}
	return byHost, hosts, nil
}
