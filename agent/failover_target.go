package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/restore/recovery"
	"github.com/ftkit/ftkit/ring"
	"golang.org/x/sys/unix"
)

// maxCandidates bounds the replicas a recovery request may list per job.
const maxCandidates = clusterapi.MaxCandidates

// maxRecoverRequest bounds a recovery request; maxRecoverJobs the jobs it names.
const (
	maxRecoverRequest = clusterapi.MaxRecoverRequest
	maxRecoverJobs    = clusterapi.MaxRecoverJobs
)

// recoverLimit bounds how long a caller follows a recovery on another host; the stream itself must not
// fall silent for longer than the idle timeout (the target sends a keepalive line in between stages).
const recoverLimit = 30 * time.Minute

// errTargetFailed ends the wait on a recovery whose target the membership view declared failed: its jobs
// died with it, and the target's own failure is being handled.
var errTargetFailed = errors.New("the recovery's target failed")

func targetFailed(name string) error {
	return fmt.Errorf("%w: %s was declared failed", errTargetFailed, name)
}

// recoverJobIDs lists the jobs a recovery request names.
func recoverJobIDs(req RecoverRequest) []string {
	ids := make([]string, 0, len(req.Jobs))
	for _, j := range req.Jobs {
		ids = append(ids, j.Job)
	}
	return ids
}

// followedTargets are the recoveries this agent follows on other hosts, by target: a target that fails
// mid-recovery falls silent, and its progress stream would otherwise be given up on only after the idle
// timeout (a minute).
type followedTargets struct {
	mu   sync.Mutex
	next uint64
	m    map[uint64]followedTarget
}

type followedTarget struct {
	name   string
	cancel context.CancelCauseFunc
}

// follow registers a recovery on target whose context cancel ends; stop unregisters it.
func (f *followedTargets) follow(target string, cancel context.CancelCauseFunc) (stop func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.m == nil {
		f.m = map[uint64]followedTarget{}
	}
	f.next++
	id := f.next
	f.m[id] = followedTarget{target, cancel}
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.m, id)
	}
}

// failed ends the followed recoveries whose target v declares failed.
func (f *followedTargets) failed(v ring.View) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, t := range f.m {
		if m, ok := v.Member(t.name); ok && m.State == ring.StateFailed {
			t.cancel(targetFailed(t.name))
		}
	}
}

// remoteRecover has target run the recovery and relays its stages. It ends as soon as the membership view
// declares target failed (errTargetFailed).
func (a *Agent) remoteRecover(ctx context.Context, target string, req RecoverRequest, emit func(Stage)) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	defer a.targets.follow(target, cancel)()
	if m, ok := a.member(target); ok && m.State == ring.StateFailed { // declared before it was followed
		cancel(targetFailed(target))
	}
	end, err := a.peers().Recover(ctx, target, req, recoverLimit, func(m clusterapi.RecoverProgress) {
		if len(m.Stage) == 0 {
			return // a keepalive
		}
		var s Stage
		if err := json.Unmarshal(m.Stage, &s); err != nil {
			a.log.Warn("recovery stage from the target is not the expected JSON; left out", "target", target, "err", err)
			return
		}
		emit(s)
	})
	var broken *clusterapi.StreamError
	switch cause := context.Cause(ctx); {
	case err != nil && errors.Is(cause, errTargetFailed):
		return fmt.Errorf("recovery on %s: %w: job(s) %s do NOT run there", target, cause, strings.Join(recoverJobIDs(req), ", "))
	case errors.As(err, &broken):
		return a.afterBrokenStream(ctx, target, req, emit, fmt.Errorf("recovery on %s: progress stream ended: %w", target, broken.Err))
	case clusterapi.Refusal(err) != nil:
		return fmt.Errorf("recovery on %s: %w", target, err)
	case err != nil && ctx.Err() == nil:
		// No answer: the target may have died after its claim (during the fence wait), long before this
		// host declares it failed, or have the request and run it. Ended now, the recovery was done before
		// the target's own failure could take it over (failurelog.Log.TakeOver), and its jobs ran nowhere.
		return a.afterBrokenStream(ctx, target, req, emit, fmt.Errorf("ask %s to recover: %w", target, err))
	case err != nil:
		return fmt.Errorf("ask %s to recover: %w", target, err)
	case end.Error != "":
		return fmt.Errorf("recovery on %s: %s", target, end.Error)
	}
	return nil
}

// serveRecover runs a recovery a member asked for and reports its stages through progress: a refusal
// before the first, then the stages, keepalives in between, and the end.
func (a *Agent) serveRecover(ctx context.Context, peer string, req RecoverRequest, progress func(clusterapi.RecoverProgress) error) error {
	if m, ok := a.member(req.Failed); ok && !req.Migration && m.State != ring.StateFailed {
		// The coordinator pushed its view before asking; one that has not arrived is fetched.
		if err := a.exchangeView(ctx, peer); err != nil {
			a.log.Warn("could not exchange views with a recovery's coordinator", "coordinator", peer, "err", err)
		}
	}
	if err := a.checkRecoverRequest(req, peer); err != nil {
		return err
	}
	req.Source = peer
	send := func(m clusterapi.RecoverProgress) {
		progress(m) // a failed write means the caller is gone: the recovery goes on
	}
	send(clusterapi.RecoverProgress{}) // accepted: the stream starts
	// Stages may take minutes (a fetch, a replay): an empty line now and then tells the caller that the
	// recovery goes on, so that it can give up on a silent stream quickly.
	stop, stopped := make(chan struct{}), make(chan struct{})
	keepalive := sync.OnceFunc(func() { close(stop); <-stopped })
	defer keepalive()
	go func() {
		defer close(stopped)
		t := time.NewTicker(a.idleTimeout() / 4)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				send(clusterapi.RecoverProgress{})
			}
		}
	}()
	err := a.recoverJobs(ctx, req, func(s Stage) {
		b, jerr := json.Marshal(s)
		if jerr == nil {
			send(clusterapi.RecoverProgress{Stage: b})
		}
	})
	keepalive() // the keepalives have stopped: the end is the last line
	send(clusterapi.RecoverProgress{Done: true, Error: errString(err)})
	return nil
}

// checkRecoverRequest refuses a recovery request unless this host was claimed for its failure by the
// member that sends it, and it names only the failed node's addresses (which this host then takes over).
func (a *Agent) checkRecoverRequest(req RecoverRequest, peer string) error {
	if err := a.checkRecordFree(req.Failure, peer); err != nil {
		return err
	}
	if req.Migration {
		return a.checkMigration(req, peer)
	}
	cl, ok := a.claims.Current()
	switch {
	case !ok || cl.Failure != req.Failure:
		return fmt.Errorf("%s was not claimed for failure %s", a.cfg.Name, req.Failure)
	case cl.By != peer || cl.Failed != req.Failed:
		return fmt.Errorf("%s was claimed for failure %s by %s for node %s, not by %s for node %s", a.cfg.Name, req.Failure, cl.By, cl.Failed, peer, req.Failed)
	case len(req.Jobs) == 0 || len(req.Jobs) > maxRecoverJobs:
		return fmt.Errorf("recovery request names %d jobs: 1 to %d", len(req.Jobs), maxRecoverJobs)
	}
	failed, ok := a.member(req.Failed)
	if !ok {
		return fmt.Errorf("%q is not a cluster member", req.Failed)
	}
	if failed.State != ring.StateFailed {
		// Its jobs run there: a restore here would be a second copy.
		return fmt.Errorf("%s is %s in this host's view (epoch %d), not failed: its jobs are not restored here", req.Failed, failed.State, a.View().Epoch)
	}
	for _, ip := range req.Addrs {
		if !slices.Contains(failed.Addrs, ip.Unmap()) {
			return fmt.Errorf("address %s is not one of the failed node %s's addresses %v", ip, req.Failed, failed.Addrs)
		}
	}
	return checkTakenFrom(a.View(), req.Jobs)
}

// checkTakenFrom refuses a job to be restored from snapshots of another node than the failed one unless
// that node failed too (the failed node was restoring its jobs when it failed): a running job's snapshots
// never are.
func checkTakenFrom(v ring.View, jobs []RecoverJob) error {
	for _, rj := range jobs {
		if rj.TakenFrom == "" {
			continue
		}
		if m, ok := v.Member(rj.TakenFrom); !ok || m.State != ring.StateFailed {
			return fmt.Errorf("job %s: the request would restore it from snapshots of %s, which is not a failed member", rj.Job, rj.TakenFrom)
		}
	}
	return nil
}

// checkMigration refuses a migration unless it comes from the alive node of the ring the jobs run on,
// for its own jobs and from its own snapshots, to this host as an alive node of the ring; it takes over no
// host address (a job moves with its own).
func (a *Agent) checkMigration(req RecoverRequest, peer string) error {
	v := a.View()
	self, _ := v.Member(a.cfg.Name)
	from, ok := v.Member(peer)
	switch {
	case req.Failed != peer:
		return fmt.Errorf("migration refused: %s may move only its own jobs, not %s's", peer, req.Failed)
	case !ok || from.Role != ring.RoleNode || from.State != ring.StateAlive:
		return fmt.Errorf("migration refused: %s is not an alive node of the ring", peer)
	case self.Role != ring.RoleNode || self.State != ring.StateAlive:
		return fmt.Errorf("migration refused: %s is not an alive node of the ring (role %s, state %s)", a.cfg.Name, self.Role, self.State)
	case len(req.Addrs) > 0:
		return fmt.Errorf("migration refused: it would take over host addresses %v", req.Addrs)
	case len(req.Jobs) == 0 || len(req.Jobs) > maxRecoverJobs:
		return fmt.Errorf("migration names %d jobs: 1 to %d", len(req.Jobs), maxRecoverJobs)
	}
	for _, rj := range req.Jobs {
		if rj.TakenFrom != "" {
			// Snapshots of another node, which restoring would take its job from: the job must run on
			// the node that moves it (a member could otherwise copy a live job of a node it protects).
			return fmt.Errorf("migration refused: job %s is to be restored from snapshots of %s, not of %s, which moves it", rj.Job, rj.TakenFrom, peer)
		}
		cands, err := rj.CandidateList(peer)
		if err != nil {
			return err
		}
		for _, c := range cands {
			if c.Source != peer {
				return fmt.Errorf("migration refused: job %s's snapshot %s is to come from %s, not from %s, which moves it", rj.Job, c.Snapshot, c.Source, peer)
			}
			if id, err := ckpt.ParseID(c.Snapshot); err != nil || id.Node != peer {
				return fmt.Errorf("migration refused: job %s's snapshot %s was not taken by %s, which moves it (a migration dumps the job anew)", rj.Job, c.Snapshot, peer)
			}
		}
	}
	return nil
}

// recoverJobs is the target's part of a fail-over (restore/recovery.Run): it restores a failed node's jobs
// on this host, keeping the recovery on disk as it goes so that an agent restarted mid-way resumes it
// (resume.go).
func (a *Agent) recoverJobs(ctx context.Context, req RecoverRequest, emit func(Stage)) error {
	fenced := req.Failed
	if req.Migration {
		fenced = "" // the jobs' node is alive: it froze them and moves them
	}
	return a.recoverJobsFenced(ctx, req, fenced, emit)
}

// recoverJobsFenced is recoverJobs superseding the incarnations claimed by restores on fenced, a member
// declared failed ("" none): recoveryActions.Claim.
func (a *Agent) recoverJobsFenced(ctx context.Context, req RecoverRequest, fenced string, emit func(Stage)) (err error) {
	defer a.setBusy(detect.BusyRestore)()
	track := a.trackRecovery(req)
	emit = track.wrap(emit)
	defer func() { track.done(ctx, err) }()
	iface, own, err := hostInterface(a.cfg.Cluster.Listen.Addr())
	if err != nil {
		return err
	}
	defer a.warmLocalLog(req)()
	deps := a.recoveryDeps(track, recovery.HostNetwork{Iface: iface, Bits: own.Bits(), Routes: a.routeEdits}, fenced)
	act := deps.Jobs.(*recoveryActions)
	if !req.Migration {
		act.by = req.Source // a restore where the job's placement sends it is admitted first
	}
	defer act.endRestores() // the jobs it claimed are restored, or undone
	return recovery.Run(ctx, req, deps, func(s recovery.Stage) {
		emit(Stage{Name: s.Name, Job: s.Job, Host: a.cfg.Name, Start: s.Start, End: s.End, Detail: s.Detail, Error: errString(s.Err)})
	})
}

// prepareCandidate fetches (unless this host has it) and verifies one snapshot and lays out a working copy
// of its images; it returns the job record the snapshot carries too. by is the member that asked for the
// fail-over ("" for a migration): a job whose placement names this host is admitted here first.
func (a *Agent) prepareCandidate(ctx context.Context, job string, c Candidate, by string) (*recovery.Job, Job, error) {
	source := a.cfg.Name
	if from, ok := a.takePrefetched(job, c.Snapshot); ok {
		source = from // here already: fetched while the protector awaited the fence
	}
	m, err := a.verifyUnlessFresh(ctx, job, c.Snapshot)
	if err != nil && c.Source != "" && c.Source != a.cfg.Name {
		// Missing here, or a damaged copy (which the holder's copy replaces once it verifies).
		source = c.Source
		if err := a.fetchOnce(ctx, source, job, c.Snapshot); err != nil {
			return nil, Job{}, err
		}
		m, err = a.verifyUnlessFresh(ctx, job, c.Snapshot)
	}
	if err != nil {
		return nil, Job{}, fmt.Errorf("%w: %v", ErrCorruptSnapshot, err)
	}
	j, err := a.snapshotJob(m)
	if err != nil {
		return nil, Job{}, err
	}
	if j.ID != job {
		return nil, Job{}, fmt.Errorf("snapshot %s of job %s carries the job record of %q", m.ID, job, j.ID)
	}
	if by != "" {
		if err := a.admitPlacedRestore(ctx, by, j); err != nil {
			return nil, Job{}, err
		}
	}
	work, err := a.workCopy(m)
	if err != nil {
		return nil, Job{}, err
	}
	runID, err := restore.RunID(work)
	if err != nil {
		criu.RemoveWorkDir(work)
		return nil, Job{}, err
	}
	return &recovery.Job{ID: j.ID, Incarnation: j.Incarnation, Manifest: m, Work: work, RunID: runID, Source: source}, j, nil
}

// reprotect snapshots the restored jobs and ships the snapshot to this host's protector.
func (a *Agent) reprotect(ctx context.Context, ids []string) (string, error) {
	res, err := a.Checkpoint(ctx, ids, 0)
	if err != nil && a.allEnded(ids) {
		// A job that finished right after its replay (CRIU: "Unable to detach ... No such process") needs
		// no protection: its recovery is complete.
		return fmt.Sprintf("not needed: job(s) %s ended before their snapshot", strings.Join(ids, ", ")), nil
	}
	detail := ""
	for _, s := range res {
		if !s.Shipped && err == nil {
			err = errors.New(s.ShipErr)
		}
		detail = fmt.Sprintf("snapshot %s shipped", s.Manifest.ID)
	}
	var placement *Placement // the restored jobs are of one run (one target per failed node)
	if len(ids) > 0 {
		if j, _, jerr := a.Job(ids[0], 0); jerr == nil {
			placement = j.Spec.Placement
		}
	}
	if p, ok := a.protectorOf(a.View(), placement); ok {
		detail += " to " + p.Name
	}
	return detail, err
}

// allEnded says whether every job of ids has ended (its process is gone), waiting a little for the shim
// to record an exit that has just happened.
func (a *Agent) allEnded(ids []string) bool {
	for _, id := range ids {
		for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			j, _, err := a.Job(id, 0)
			if err != nil || j.State != JobRunning || unix.Kill(j.PID, 0) == unix.ESRCH {
				break
			}
			if time.Now().After(deadline) {
				return false
			}
		}
	}
	return true
}
