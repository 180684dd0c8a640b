package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/grant"
)

// RestoreRequest asks an agent to restore a job on its host from a snapshot.
type RestoreRequest struct {
	Snapshot string `json:"snapshot"`         // snapshot id
	Job      string `json:"job,omitempty"`    // job id; found from the snapshot id if empty
	Force    bool   `json:"force,omitempty"`  // restore even if the job's node answers and runs it
	Source   string `json:"source,omitempty"` // member to fetch the snapshot from if this host lacks it
}

// ErrCorruptSnapshot means the snapshot failed verification; the error names the file and the next older
// snapshot that verifies.
var ErrCorruptSnapshot = errors.New("snapshot failed verification")

// ErrRestoreUnderWay means another restore of the job runs on this host: one at a time (lockRestore).
var ErrRestoreUnderWay = errors.New("a restore of the job is under way on this host")

// ErrJobAlive means the job still runs on its node, so restoring it would run it twice.
var ErrJobAlive = errors.New("job still running")

// Restore restores a job on this host from a snapshot: the manual restore of a job whose node is gone
// (the automatic fail-over with log replay is restore/recovery, run by failover_target.go). A caller other than root may restore
// only its own jobs, and learns nothing of a snapshot it does not own: the owner is checked before any byte
// of the snapshot moves, and again from the verified job record. The restore claims the job's next
// incarnation from a majority of the members first, so that it never runs a second copy of a job that a
// fail-over (or another restore) already brought back.
func (a *Agent) Restore(ctx context.Context, req RestoreRequest, uid uint32) (*Job, error) {
	if req.Job == "" {
		req.Job = a.localJobOfSnapshot(req.Snapshot)
	}
	prefer := ""
	var unlock func()
	defer func() {
		if unlock != nil {
			unlock()
		}
	}()
	if req.Job == "" || !a.holdsSnapshot(req.Job, req.Snapshot) {
		if req.Job == "" || uid != 0 {
			loc, holder := a.findJobOfSnapshot(ctx, req.Snapshot, req.Source)
			switch {
			case loc.Job == "":
				return nil, fmt.Errorf("%w: snapshot %s is not held by %s or any member that answers; name the job with --job", ckpt.ErrNotFound, req.Snapshot, a.cfg.Name)
			case uid != 0 && (loc.UID == nil || *loc.UID != uid):
				// Before the fetch: another user's snapshot never reaches this host on this caller's behalf.
				// Before the job is named too: another user's job id is not the caller's to learn.
				return nil, fmt.Errorf("%w: snapshot %s (held by %s) is not of a job of uid %d", ErrNoJob, req.Snapshot, holder, uid)
			case req.Job != "" && loc.Job != req.Job:
				return nil, fmt.Errorf("%w: snapshot %s is of job %s, not %s", ckpt.ErrNotFound, req.Snapshot, loc.Job, req.Job)
			}
			req.Job, prefer = loc.Job, holder
		}
		if _, err := a.store.Manifest(req.Job, req.Snapshot); errors.Is(err, ckpt.ErrNotFound) || errors.Is(err, fs.ErrNotExist) {
			if !req.Force {
				if err := a.refuseIfRunsHere(req.Job); err != nil {
					return nil, err
				}
			}
			// Held from before the fetch too: a forget pass of an ended job meanwhile told the holder to drop
			// the snapshot it was sending, and deleted the one fetched before the lock below.
			if unlock, err = a.lockRestore(ctx, req.Job, "restore"); err != nil {
				return nil, err
			}
			if err := a.fetch(ctx, req.Job, req.Snapshot, req.Source, prefer); err != nil {
				return nil, err
			}
		}
	}
	// A snapshot this host held already skipped the owner check above: it is made here, from the job record
	// in the snapshot, before the verification reads and hashes every image and its failure names the job's
	// other snapshots. The verified record is checked again below.
	if m, err := a.store.Manifest(req.Job, req.Snapshot); uid != 0 && err == nil && !a.ownsSnapshot(m, uid) {
		return nil, fmt.Errorf("%w: snapshot %s is not of a job of uid %d", ErrNoJob, req.Snapshot, uid)
	}
	if unlock == nil {
		if !req.Force {
			// Before the lock, which refuses a job running here in its own words.
			if err := a.refuseIfRunsHere(req.Job); err != nil {
				return nil, err
			}
		}
		// Held from before the verification (seconds for a large snapshot): a forget pass spares only a job
		// being restored (stillEnded), and would delete the snapshot under verification of an ended one.
		var err error
		if unlock, err = a.lockRestore(ctx, req.Job, "restore"); err != nil {
			return nil, err
		}
	}
	m, err := a.store.Verify(ctx, req.Job, req.Snapshot)
	if err != nil {
		return nil, a.corrupt(ctx, req, err)
	}
	j, err := a.snapshotJob(m)
	if err != nil {
		return nil, err
	}
	if j.ID != m.Job {
		return nil, fmt.Errorf("snapshot %s of job %s carries the job record of %q: refusing it", m.ID, m.Job, j.ID)
	}
	if uid != 0 && j.UID != uid {
		return nil, fmt.Errorf("%w: job %s belongs to uid %d", ErrNoJob, j.ID, j.UID)
	}
	if !req.Force {
		if err := a.refuseIfAlive(ctx, j); err != nil {
			return nil, err
		}
	}
	return a.claimAndRestoreLocked(ctx, "restore", m, j, req.Force, nil)
}

// claimAndRestore claims job j's next incarnation (claimForRestore, as holder kind) and restores snapshot m
// under it on this host; prepare, if set, runs on the images' working copy before the restore. The claim
// is given back if nothing ran.
func (a *Agent) claimAndRestore(ctx context.Context, kind string, m *ckpt.Manifest, j Job, force bool, prepare func(work string) error) (*Job, error) {
	unlock, err := a.lockRestore(ctx, j.ID, kind)
	if err != nil {
		return nil, err
	}
	defer unlock()
	return a.claimAndRestoreLocked(ctx, kind, m, j, force, prepare)
}

// claimAndRestoreLocked is claimAndRestore with job j's restore lock held by the caller.
func (a *Agent) claimAndRestoreLocked(ctx context.Context, kind string, m *ckpt.Manifest, j Job, force bool, prepare func(work string) error) (*Job, error) {
	holder := newHolder(kind)
	n, err := a.claimForRestore(ctx, j, m, holder, force)
	if err != nil {
		return nil, err
	}
	j.Incarnation = n
	defer a.setBusy(detect.BusyRestore)()
	work, err := a.workCopy(m)
	if err == nil && prepare != nil {
		if err = prepare(work); err != nil {
			criu.RemoveWorkDir(work)
		}
	}
	if err != nil {
		a.giveBack(ctx, j.ID, n, holder, nil)
		return nil, err
	}
	restored, err := a.restoreJob(ctx, m, j, work, nil)
	if err != nil {
		a.giveBackUnlessStarted(ctx, j, n, holder, err)
		return nil, err
	}
	return restored, nil
}

// claimForRestore claims the incarnation after the snapshot's (j.Incarnation+1) for a manual restore. With
// force, a refusal is overridden by claiming one past the newest incarnation the members recorded: the
// operator has made sure the job runs nowhere.
func (a *Agent) claimForRestore(ctx context.Context, j Job, m *ckpt.Manifest, holder string, force bool) (uint64, error) {
	snapshot, node := m.ID, m.Node
	n := j.Incarnation + 1
	err := a.claimIncarnation(ctx, j.ID, n, holder, node)
	var refused *grant.RefusedError
	if err != nil && force && errors.As(err, &refused) {
		n = max(n, refused.Record.Incarnation) + 1
		a.log.Warn("forced restore overrides the recorded incarnation", "job", j.ID, "recorded", refused.Record, "incarnation", n)
		err = a.claimIncarnation(ctx, j.ID, n, holder, node)
	}
	switch {
	case errors.As(err, &refused):
		return 0, fmt.Errorf("%w: %w; snapshot %s was taken by incarnation %d: restore a snapshot of the running incarnation, or, if the job certainly no longer runs there, restore with --force",
			ErrJobAlive, err, snapshot, j.Incarnation)
	case err != nil:
		return 0, fmt.Errorf("restore of job %s not allowed: %w; retry when more members answer", j.ID, err)
	}
	return n, nil
}

// corrupt turns a verification failure into an error that names the next older snapshot that verifies.
func (a *Agent) corrupt(ctx context.Context, req RestoreRequest, verr error) error {
	ids, _ := a.store.List(req.Job, "")
	older := false
	for _, id := range ids {
		if id == req.Snapshot {
			older = true
			continue
		}
		if older {
			if _, err := a.store.Verify(ctx, req.Job, id); err == nil {
				return fmt.Errorf("%w: %v; the next older verified snapshot is %s: restore that one with `ftctl restore --snapshot %s`", ErrCorruptSnapshot, verr, id, id)
			}
		}
	}
	return fmt.Errorf("%w: %v; no older snapshot of job %s verifies on %s", ErrCorruptSnapshot, verr, req.Job, a.cfg.Name)
}

// refuseIfAlive asks the job's node whether it still runs the job.
func (a *Agent) refuseIfAlive(ctx context.Context, j Job) error {
	if j.Node == a.cfg.Name {
		return a.refuseIfRunsHere(j.ID)
	}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	r, err := a.Ping(pctx, j.Node)
	if err != nil {
		return nil // the node does not answer: that is the case manual restore is for
	}
	if slices.Contains(r.Jobs, j.ID) {
		return fmt.Errorf("%w: job %s still runs on %s, which answers; stop it first, or force", ErrJobAlive, j.ID, j.Node)
	}
	return nil
}

// refuseIfRunsHere refuses a restore of job id while a copy of it runs on this host.
func (a *Agent) refuseIfRunsHere(id string) error {
	if cur, _, err := a.Job(id, 0); err == nil && cur.State == JobRunning {
		return fmt.Errorf("%w: job %s runs on this host (pid %d)", ErrJobAlive, id, cur.PID)
	}
	return nil
}

// lockRestore reserves job id for one restore on this host (what names it), until unlock; a second, or one of
// a job that runs here already, is refused before it claims anything. Two at once (a forced restore beside a fail-over, a recovery request repeated
// while the first still restores: its claim under the same holder succeeds again) both pass the incarnation
// claim and the "already runs" check, which sees the job only once restored, and the loser's cleanup goes by
// the job's id and its cgroup's, network's and guard's names, the winner's too: it would remove the cgroup
// the winner's CRIU restores into, stop its log protection and receive-order watch, delete its network and
// guard, and give back the incarnation the winner holds under the shared holder.
func (a *Agent) lockRestore(ctx context.Context, id, what string) (unlock func(), err error) {
	a.mu.Lock()
	for ended := a.ending[id]; ended != nil; ended = a.ending[id] {
		// An earlier copy of the job has just ended here and what it held is being given back by the job's
		// id: a restore let in now would have its new cgroup, network and watches taken down with the old.
		a.mu.Unlock()
		a.log.Info("waiting for the earlier copy of the job that ended here to give back what it held before restoring it", "job", id, "restore", what)
		select {
		case <-ended:
		case <-ctx.Done():
			return nil, fmt.Errorf("restore of job %s: waiting for its earlier copy's end here to give back what it held: %w", id, context.Cause(ctx))
		}
		a.mu.Lock()
	}
	defer a.mu.Unlock()
	if other, ok := a.restoring[id]; ok {
		return nil, fmt.Errorf("%w: job %s is being restored on %s already (%s); refused, nothing touched: wait for that restore to end (`ftctl events`, `ftctl jobs`)",
			ErrRestoreUnderWay, id, a.cfg.Name, other)
	}
	// restoreJob refuses it too, but only after the claim: a recovery's failed restore then deletes the
	// running copy's network and guard, and a forced restore's claim stays held by a copy that never runs.
	if cur := a.byID[id]; cur != nil && cur.State == JobRunning {
		// Worded as the incarnation grants word it (grant.RefusedError), which it stands in for here.
		return nil, fmt.Errorf("%w: job %s already runs as incarnation %d on %s (pid %d): no second copy is started beside it", ErrJobAlive, id, cur.Incarnation, a.cfg.Name, cur.PID)
	}
	if a.restoring == nil {
		a.restoring = map[string]string{}
	}
	a.restoring[id] = what
	return sync.OnceFunc(func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		delete(a.restoring, id)
	}), nil
}
