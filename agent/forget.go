package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/ring"
)

// Ended jobs. A job that ended on this host (exited, lost, moved elsewhere) keeps its snapshots, here and
// as replicas on the hosts that protected it, and its record for checkpoint.keep_ended: an operator may
// look at them, or restore one. Then this host deletes its own and tells the holders of its replicas to
// delete theirs (clusterapi.OpForget), and the record goes. Without this a cluster's disks fill with the
// snapshots of every job that ever ran.
//
// A lost job (its process vanished) that this host does not know to have been restored elsewhere keeps
// them 7 times as long: its owner may want to restore it.
//
// What stays: a snapshot a coordinated cut of the job's run still names (a cut of a run that no longer
// runs on any alive member goes once it is keep_ended old: forgetStaleCuts) (a rollback of the run restarts
// the ended part from it), and every snapshot of a job a cut not yet committed dumped, until the commit;
// a snapshot taken after the job ended (a copy of it that came back here since);
// and the record of a job whose address may still be in use (addressHeld), of one whose network lingers,
// or of one whose holders could not all be told yet or kept some (one the job runs on now keeps them
// until it ends there) (Job.Forget, tried again at each pass).

// forgetEnded runs forgetDue until ctx ends; keep_ended 0 keeps everything.
func (a *Agent) forgetEnded(ctx context.Context) {
	keep := a.cfg.Checkpoint.KeepEnded.Duration
	if keep <= 0 {
		return
	}
	tickgrid.Every(ctx, min(max(keep/4, time.Second), time.Hour), func() { a.forgetDue(ctx, time.Now()) })
}

// endedJob is an ended job's record due to be forgotten: ended is Job.Ended, or else when its record last
// changed, which the end of the job did (finish, leave), or a later mark of its end (Fenced).
type endedJob struct {
	rec   *Job // a.byID's, to tell whether the record was replaced meanwhile
	job   Job
	ended time.Time
}

// forgetDue forgets the ended jobs whose keep_ended has passed at now, and first the stale cuts that
// would pin their snapshots.
func (a *Agent) forgetDue(ctx context.Context, now time.Time) {
	a.forgetStaleCuts(ctx, now)
	for _, e := range a.dueToForget(now) {
		if ctx.Err() != nil {
			return
		}
		a.forgetJob(ctx, e)
	}
}

// forgetStaleCuts forgets the cuts of runs that no longer run on any alive member and whose newest cut is
// keep_ended old: one that ended would otherwise pin its last cut's snapshots (and their jobs' records) for
// good. A run that goes on elsewhere keeps its cut whatever its age: its interval may be longer than
// keep_ended, or its cuts keep failing, and a rollback of it needs the snapshots and replicas the cut pins
// here. So does a run that a member could not be asked about; the next pass asks again.
func (a *Agent) forgetStaleCuts(ctx context.Context, now time.Time) {
	keep := a.cfg.Checkpoint.KeepEnded.Duration
	recs := a.cutRecords()
	for _, c := range recs.All() {
		if c.Taken.IsZero() || now.Sub(c.Taken) < keep || len(a.runJobs(c.Run, &c.UID)) > 0 {
			continue
		}
		if _, _, err := a.coordinator().RunHosts(ctx, c.Run, &c.UID); !errors.Is(err, coordinated.ErrNoRun) {
			if err != nil {
				a.log.Debug("kept a stale cut: whether its run still runs is not known", "run", c.Run, "uid", c.UID, "cut", c.ID, "err", err)
			}
			continue
		}
		// Only the cut looked at: a commit of a newer one since (the run goes on elsewhere) stays.
		removed, err := recs.Remove(c.Run, c.UID, c.ID)
		if err != nil {
			a.log.Warn("could not forget a stale cut", "run", c.Run, "uid", c.UID, "err", err)
			continue
		}
		if !removed {
			continue
		}
		a.log.Info("forgot the cut of a run that ended here (checkpoint.keep_ended)", "run", c.Run, "uid", c.UID, "cut", c.ID, "taken", c.Taken)
	}
}

// dueToForget lists the ended jobs whose keep_ended has passed at now, but for those whose snapshots are
// gone already and whose record stays (Forgotten).
func (a *Agent) dueToForget(now time.Time) []endedJob {
	keep := a.cfg.Checkpoint.KeepEnded.Duration
	a.mu.Lock()
	var cands []endedJob
	for _, j := range a.byID {
		if j.State != JobRunning && !j.Forgotten {
			cands = append(cands, endedJob{rec: j, job: *j})
		}
	}
	a.mu.Unlock()
	var due []endedJob
	for _, e := range cands {
		e.ended = e.job.Ended
		if e.ended.IsZero() {
			st, err := os.Stat(a.jobs.path(e.job.ID))
			if err != nil {
				continue
			}
			e.ended = st.ModTime()
		}
		if now.Sub(e.ended) >= keep*lostFactor(e.job, a.restoredOn) {
			due = append(due, e)
		}
	}
	slices.SortFunc(due, func(x, y endedJob) int { return x.ended.Compare(y.ended) })
	return due
}

// stillEnded reports whether e's record is still this host's record of the job: a copy of the job that came
// back here since (a restore, a migration) replaces it. One being restored here is not ended either: its
// record is replaced only once it runs, and the restore reads a snapshot the forget would delete.
func (a *Agent) stillEnded(e endedJob) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	cur := a.byID[e.job.ID]
	_, restoring := a.restoring[e.job.ID]
	return cur == e.rec && cur.State != JobRunning && !restoring
}

// whyAddress keeps an ended job's record for good (addressHeld).
const whyAddress = "its address may be in use"

// lostFactor is how many times keep_ended a job's snapshots stay: a lost job not known to run elsewhere
// (its process vanished, not moved by a failover this host knows of: killed with its shim, say) may be
// waiting for its owner to restore it (ftctl restore), who gets a week at the default.
func lostFactor(j Job, restoredOn func(string) string) time.Duration {
	if j.State == JobLost && !(j.Fenced && restoredOn(j.ID) != "") {
		return 7
	}
	return 1
}

// forgetJob deletes ended job e's snapshots taken here before it ended, tells the holders of their
// replicas, and then deletes its record if nothing keeps it.
func (a *Agent) forgetJob(ctx context.Context, e endedJob) {
	id := e.job.ID
	log := a.log.With("job", id, "ended", e.ended.UTC().Format(time.RFC3339))
	if !a.stillEnded(e) {
		return
	}
	if pins := a.uncommitted.Pinned(id); len(pins) > 0 {
		// A cut dumped the job before it ended and is not committed yet: its snapshots here are pinned until
		// the commit, and the protectors' copies only from it on, so a forget now would delete them before the
		// cut names them. The next pass after the commit (or its bound) forgets the job.
		log.Debug("ended job not forgotten yet: a coordinated snapshot of it awaits its commit", "snapshots", pins)
		return
	}
	holders := slices.Clone(e.job.Forget)
	if e.job.Replica != nil {
		holders = append(holders, e.job.Replica.Holders...)
	}
	target, _ := a.recoveredTo(id)
	if m, ok := a.member(target); ok && m.State == ring.StateAlive {
		// A failure of this host restored the job there (or tried), from a copy of this host's snapshot that
		// it fetched (a spare) or held: none of this host's snapshots names it, and nothing else would tell
		// it. Not one that failed since: it may never answer, and would keep the record for good.
		holders = append(holders, m.Name)
	}
	deleted, kept, err := deleteSnapshotsBefore(a.store, id, a.cfg.Name, e.ended, a.cutRecords().Pinned(id), func(m *ckpt.Manifest) {
		holders = append(holders, m.Replicas...)
	})
	if err != nil {
		log.Warn("could not delete an ended job's snapshots; trying again later", "err", err)
	}
	slices.Sort(holders)
	holders = slices.Compact(holders)
	var untold, keeping []string
	for _, h := range holders {
		if h == a.cfg.Name {
			continue
		}
		if _, ok := a.member(h); !ok {
			continue // no longer a member: nobody to tell
		}
		rep, terr := a.peers().Forget(ctx, h, clusterapi.ForgetRequest{Job: id, Ended: e.ended})
		if terr != nil {
			log.Warn("could not tell a holder of an ended job's replicas to drop them; telling it again later", "holder", h, "err", terr)
			untold = append(untold, h)
			continue
		}
		log.Debug("holder dropped an ended job's replicas", "holder", h, "deleted", rep.Deleted, "kept", rep.Kept)
		if rep.Kept > 0 {
			// It keeps some (the job runs there now, restored from them, say): it drops them only when asked
			// once they are no longer needed, and nobody else ever asks, so they would stay on its disk for good.
			keeping = append(keeping, h)
		}
	}
	keepRecord := ""
	switch {
	case err != nil || kept > 0:
		keepRecord = "snapshots kept"
	case len(untold) > 0:
		keepRecord = "holders to tell"
	case len(keeping) > 0:
		keepRecord = "holders keep replicas"
	case addressHeld(&e.job):
		keepRecord = whyAddress
	case e.job.Net != nil && a.lingering.has(e.job.Net.Name):
		keepRecord = "its network lingers"
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if cur := a.byID[id]; cur != e.rec || cur.State == JobRunning {
		return
	}
	if keepRecord != "" {
		// Forgotten for good only if nothing but the address keeps it: the rest is tried again at each pass.
		e.rec.Ended, e.rec.Forget, e.rec.Forgotten = e.ended, slices.Concat(untold, keeping), keepRecord == whyAddress
		if serr := a.jobs.save(e.rec); serr != nil {
			log.Warn("save job record", "err", serr)
		}
		log.Info("ended job's snapshots forgotten; its record stays", "deleted", deleted, "kept", kept, "why", keepRecord)
		return
	}
	if rerr := a.removeRecord(id); rerr != nil {
		log.Warn("could not remove an ended job's record", "err", rerr)
		return
	}
	delete(a.byID, id)
	delete(a.policies, id) // else one stayed for every job that ever ran here
	a.notify()
	log.Info("ended job forgotten: its snapshots, replicas and record are gone (checkpoint.keep_ended)", "deleted", deleted)
}

// removeRecord removes job id's record and the files beside it (its shims' log, its copies' marks); a.mu
// held, under which a restore of the job saves its new record.
func (a *Agent) removeRecord(id string) error {
	marks, _ := filepath.Glob(filepath.Join(a.jobs.dir, id+".*.superseded"))
	refused, _ := filepath.Glob(filepath.Join(a.jobs.dir, id+".*.refused"))
	var errs []error
	for _, p := range append(append(marks, refused...), a.shimLog(id), a.jobs.path(id)) {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// deleteSnapshotsBefore deletes job's snapshots in store taken on node before ended, but the pinned ones
// (a coordinated cut names them), calling seen with each one's manifest first. It returns how many it
// deleted and kept.
func deleteSnapshotsBefore(store *ckpt.Store, job, node string, ended time.Time, pinned []string, seen func(*ckpt.Manifest)) (deleted, kept int, err error) {
	ids, err := store.List(job, node)
	if err != nil {
		return 0, 0, err
	}
	var errs []error
	for _, sid := range ids {
		parsed, perr := ckpt.ParseID(sid)
		if perr != nil || !parsed.Time.Before(ended) || slices.Contains(pinned, sid) {
			kept++
			continue
		}
		if seen != nil {
			if m, merr := store.Manifest(job, sid); merr == nil {
				seen(m)
			}
		}
		if derr := store.Delete(job, sid); derr != nil && !errors.Is(derr, ckpt.ErrNotFound) {
			errs = append(errs, derr)
			kept++
			continue
		}
		deleted++
	}
	// The job's directory, if nothing is left in it (a replica of another node's snapshot of it may be).
	os.Remove(filepath.Join(store.Root(), job))
	return deleted, kept, errors.Join(errs...)
}

// serveForget deletes the replicas of peer's ended job that peer took before it ended (req, validated),
// but those a coordinated cut names, and all of them if the job runs here, or is being restored here: a
// copy restored here from them may still need them until its own snapshot is replicated. With none of them
// left, the job's receive-order determinants from peer go too.
func (a *Agent) serveForget(peer string, req clusterapi.ForgetRequest) (clusterapi.ForgetReply, error) {
	a.mu.Lock()
	j, ok := a.byID[req.Job]
	_, restoring := a.restoring[req.Job] // from them, maybe: the job runs here once restored
	runs := ok && j.State == JobRunning || restoring
	a.mu.Unlock()
	if runs {
		ids, err := a.store.List(req.Job, peer)
		return clusterapi.ForgetReply{Kept: len(ids)}, err
	}
	deleted, kept, err := deleteSnapshotsBefore(a.store, req.Job, peer, req.Ended, a.cutRecords().Pinned(req.Job), nil)
	if err != nil {
		return clusterapi.ForgetReply{}, fmt.Errorf("drop the replicas of %s's job %s: %w", peer, req.Job, err)
	}
	if kept == 0 && a.detStore != nil {
		a.detStore.Drop(req.Job, peer) // its receive order: no replica of peer's is left to restore
	}
	if deleted > 0 {
		a.log.Info("ended job's replicas dropped at its host's request", "job", req.Job, "host", peer, "deleted", deleted, "kept", kept)
	}
	return clusterapi.ForgetReply{Deleted: deleted, Kept: kept}, nil
}
