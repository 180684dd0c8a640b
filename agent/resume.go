package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ackclamp"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/intercept/record"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/restore/recovery"
	"github.com/ftkit/ftkit/tcpflow"
)

// A recovery's last steps (waiting for the restored jobs to re-send what their peers had, verifying those
// bytes, re-protecting the jobs) run while the restored jobs already run under their shims. An agent that
// dies there (SIGKILL, OOM) must not leave them half done: the target keeps the in-progress recovery in
// its state directory, and a restarted agent resumes it from there, with the ACK clamp it re-opened from
// bpffs (the restored sockets kept their ACK clock meanwhile). The coordinator, whose progress stream
// broke, asks the target for the outcome (clusterapi.OpRecoveryStatus, recovery_status.go).

// recoveriesDir holds one record per recovery this host is or was the target of (root only, 0700).
const recoveriesDir = "recoveries"

// doneRecoveryKeep is how long the record of a finished recovery is kept for its coordinator to ask.
const doneRecoveryKeep = 24 * time.Hour

// maxRecoveryRecord bounds a recovery record read back. It keeps every re-sent connection's peer record
// (up to recvdigest.MaxPieces pieces, 256 KiB of JSON each), so it outgrows a recovery request (4 MiB) once
// a recovery re-sends some 16 GiB: bounded by that, the record was unreadable, and the recovery neither
// resumed after an agent restart nor answered for to its coordinator. This admits 4096 full connections.
const maxRecoveryRecord = 1 << 30

// Phases of a job in a recovery record.
const (
	phaseRestoring = recovery.PhaseRestoring
	phaseRestored  = recovery.PhaseRestored
	phaseReplayed  = recovery.PhaseReplayed
)

// recoveryRecord is what a restarted target needs to finish a recovery, and its outcome so far.
type recoveryRecord struct {
	Failure     string        `json:"failure"`
	Coordinator string        `json:"coordinator"`
	Jobs        []recoveryJob `json:"jobs,omitempty"`
	Stages      []Stage       `json:"stages,omitempty"`
	Resumed     bool          `json:"resumed,omitempty"`
	Done        bool          `json:"done,omitempty"`
	Error       string        `json:"error,omitempty"`
	Updated     time.Time     `json:"updated"`
	// Asked are the jobs the recovery was asked to restore: those Jobs no longer holds (their fetch, plan or
	// restore failed, or the agent died before restoring them) do not run here.
	Asked []string `json:"asked,omitempty"`
}

type recoveryJob struct {
	Job        string         `json:"job"`
	Snapshot   string         `json:"snapshot"`
	Phase      string         `json:"phase"`
	RestoredAt time.Time      `json:"restored_at,omitzero"`
	Conns      []recoveryConn `json:"conns,omitempty"` // those with bytes to re-send
	// Deferred are the connections whose receive bytes a gate delivers (its receive order replayed).
	Deferred []recovery.DeferredConn `json:"deferred,omitempty"`
	// Fins are the connections whose peers closed them after the snapshot: their FINs go to the job.
	Fins []recovery.FinConn `json:"fins,omitempty"`
}

// recoveryConn is a restored connection's replay: from the snapshot's write_seq OutqSeq, Resend bytes the
// peer already has, and what checking them needs.
type recoveryConn struct {
	tcpflow.Tuple
	OutqSeq    uint32           `json:"outq_seq"`
	Resend     uint32           `json:"resend"`
	SentPrefix *ckpt.SentPrefix `json:"sent_prefix,omitempty"`
	recovery.Check
}

// validRecoveryID keeps a failure id (from the coordinator) usable as a file name.
func validRecoveryID(id string) bool {
	return id != "" && id != "." && id != ".." && !strings.ContainsAny(id, `/\`) && len(id) <= 255 && !strings.HasPrefix(id, ".")
}

func recoveryPath(stateDir, failure string) string {
	return filepath.Join(stateDir, recoveriesDir, failure+".json")
}

func saveRecovery(stateDir string, rec *recoveryRecord) error {
	if !validRecoveryID(rec.Failure) {
		return fmt.Errorf("failure id %q is not usable as a file name", rec.Failure)
	}
	dir := filepath.Join(stateDir, recoveriesDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	rec.Updated = time.Now().UTC()
	if err := atomicfile.WriteJSON(recoveryPath(stateDir, rec.Failure), rec); err != nil {
		return fmt.Errorf("save recovery record of failure %s: %w", rec.Failure, err)
	}
	return nil
}

func loadRecovery(path string) (*recoveryRecord, error) {
	b, err := atomicfile.ReadBounded(path, maxRecoveryRecord)
	if err != nil {
		return nil, err
	}
	var rec recoveryRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("recovery record %s: %w", path, err)
	}
	if want := strings.TrimSuffix(filepath.Base(path), ".json"); rec.Failure != want {
		return nil, fmt.Errorf("recovery record %s names failure %q", path, rec.Failure)
	}
	return &rec, nil
}

// checkRecordFree refuses a recovery request for a failure whose record this host keeps for a recovery
// under way here, or for another coordinator: the request's tracker would start that record anew, and
// the recovery it describes could then neither be resumed after an agent restart nor answered for
// (serveRecoveryStatus). The failure ids of a migration are the mover's to choose. A finished recovery of
// the same coordinator may be asked again.
func (a *Agent) checkRecordFree(failure, peer string) error {
	if !validRecoveryID(failure) {
		return nil // no record is kept (saveRecovery)
	}
	rec, err := loadRecovery(recoveryPath(a.cfg.StateDir, failure))
	if err != nil || (rec.Done && rec.Coordinator == peer) {
		return nil
	}
	state := "under way"
	if rec.Done {
		state = "finished"
	}
	return fmt.Errorf("%s keeps the record of recovery %s of %s, %s: a second request for it is refused (a migration needs a new id)",
		a.cfg.Name, failure, rec.Coordinator, state)
}

// loadRecoveries reads every recovery record of the state directory; an unreadable one is reported and
// skipped (and kept, for the operator to look at).
func loadRecoveries(stateDir string) ([]*recoveryRecord, error) {
	dir := filepath.Join(stateDir, recoveriesDir)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []*recoveryRecord
	var errs []error
	for _, e := range ents {
		if !e.Type().IsRegular() || !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		rec, err := loadRecovery(filepath.Join(dir, e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, rec)
	}
	return out, errors.Join(errs...)
}

// recoveryTracker keeps a running recovery's record on disk as it goes.
type recoveryTracker struct {
	a   *Agent
	mu  sync.Mutex
	rec recoveryRecord
}

func (a *Agent) trackRecovery(req RecoverRequest) *recoveryTracker {
	t := &recoveryTracker{a: a, rec: recoveryRecord{Failure: req.Failure, Coordinator: req.Source, Asked: recoverJobIDs(req)}}
	// On record at once, not from the first stage (a fetch may take minutes): a coordinator whose stream
	// broke meanwhile was told "no record" and took the jobs for lost while they were being restored here,
	// and a second request for the failure was accepted.
	if validRecoveryID(req.Failure) {
		t.mu.Lock()
		t.save()
		t.mu.Unlock()
	}
	return t
}

// save writes the record; call with t.mu held. A record that cannot be written costs only the ability to
// resume after an agent crash, so the recovery goes on.
func (t *recoveryTracker) save() {
	if err := saveRecovery(t.a.cfg.StateDir, &t.rec); err != nil {
		t.a.log.Warn("recovery record not saved: an agent restart could not resume this recovery", "failure", t.rec.Failure, "err", err)
	}
}

// wrap records every stage before passing it on.
func (t *recoveryTracker) wrap(emit func(Stage)) func(Stage) {
	return func(s Stage) {
		t.mu.Lock()
		t.rec.Stages = append(t.rec.Stages, s)
		t.save()
		t.mu.Unlock()
		emit(s)
	}
}

// Persist records the jobs about to be restored, with their replays and what checking them needs.
func (t *recoveryTracker) Persist(jobs []*recovery.Job) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range jobs {
		rj := recoveryJob{Job: r.ID, Snapshot: r.Manifest.ID, Phase: phaseRestoring, Deferred: recovery.Deferred(r),
			Fins: recovery.Fins(r)}
		for _, c := range r.Plan.Conns {
			if c.Resend == 0 {
				continue
			}
			rj.Conns = append(rj.Conns, recoveryConn{Tuple: c.Conn.Tuple, OutqSeq: c.Conn.OutqSeq, Resend: c.Resend,
				SentPrefix: c.Conn.SentPrefix, Check: r.Checks[c.Conn.Tuple]})
		}
		t.rec.Jobs = append(t.rec.Jobs, rj)
		t.a.replays.set(r.ID, true) // before CRIU restores it: no snapshot catches it mid-replay
	}
	t.save()
}

// SetPhase moves a job on; a job that failed is dropped from the record (nothing to resume).
func (t *recoveryTracker) SetPhase(id, phase string, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.rec.Jobs {
		if t.rec.Jobs[i].Job != id {
			continue
		}
		if phase == "" || phase == phaseReplayed {
			t.a.replays.set(id, false)
		}
		if phase == "" {
			t.rec.Jobs = slices.Delete(t.rec.Jobs, i, i+1)
		} else {
			t.rec.Jobs[i].Phase = phase
			if !at.IsZero() {
				t.rec.Jobs[i].RestoredAt = at
			}
		}
		break
	}
	t.save()
}

// done records the outcome; the record stays (without what a resume would need) for the coordinator. An
// agent that is stopping (ctx ended) leaves the record unfinished, for the next agent to resume.
func (t *recoveryTracker) done(ctx context.Context, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, j := range t.rec.Jobs {
		t.a.replays.set(j.Job, false) // verified, or killed: its recovery is over
	}
	if ctx.Err() != nil {
		t.a.log.Warn("agent stopping during a recovery: the next agent resumes it", "failure", t.rec.Failure, "err", err)
		return
	}
	t.rec.Done, t.rec.Error = true, errString(err)
	for i := range t.rec.Jobs {
		t.rec.Jobs[i].Conns = nil // the peers' records: only a resume needs them
	}
	t.save()
}

// pendingRecoveries reads the recoveries a previous agent of this host left unfinished, marks their jobs
// whose replay is not verified yet as replaying, and forgets the records of old finished ones. It runs
// once, after adopt.
func (a *Agent) pendingRecoveries() []*recoveryRecord {
	recs, err := loadRecoveries(a.cfg.StateDir)
	if err != nil {
		a.log.Error("some recovery records could not be read; those recoveries are not resumed", "err", err)
	}
	var pending []*recoveryRecord
	for _, rec := range recs {
		switch {
		case !rec.Done:
			pending = append(pending, rec)
			for _, j := range rec.Jobs {
				a.replays.set(j.Job, j.Phase != phaseReplayed)
			}
		case time.Since(rec.Updated) > doneRecoveryKeep:
			os.Remove(recoveryPath(a.cfg.StateDir, rec.Failure))
		}
	}
	return pending
}

// resumeRecoveries finishes the pending recoveries (pendingRecoveries).
func (a *Agent) resumeRecoveries(ctx context.Context, pending []*recoveryRecord) {
	a.releaseStaleClamps(pending)
	for _, rec := range pending {
		a.resumeRecovery(ctx, rec)
	}
}

// releaseStaleClamps unregisters the clamped flows that no unfinished recovery waits for: the clamp would
// otherwise lower that connection's ACKs forever.
func (a *Agent) releaseStaleClamps(pending []*recoveryRecord) {
	if a.clamp == nil {
		return
	}
	flows, err := a.clamp.Flows()
	if err != nil {
		a.log.Warn("could not list the ACK clamp's flows", "err", err)
		return
	}
	for _, f := range staleClamps(pending, flows) {
		a.log.Warn("releasing a clamped flow no recovery waits for", "local", f.Local, "remote", f.Remote)
		a.clamp.Release(f)
	}
}

// staleClamps is releaseStaleClamps' choice: the clamped flows that no unfinished job of pending waits for.
func staleClamps(pending []*recoveryRecord, flows []ackclamp.ClampedFlow) []tcpflow.Tuple {
	keep := map[tcpflow.Tuple]bool{}
	for _, rec := range pending {
		for _, j := range rec.Jobs {
			if j.Phase == phaseReplayed {
				continue
			}
			for _, c := range j.Conns {
				keep[c.Tuple.Unmap()] = true // the clamp lists a dual-stack socket's flow in its IPv4 form
			}
		}
	}
	var stale []tcpflow.Tuple
	for _, f := range flows {
		if !keep[f.Flow] {
			stale = append(stale, f.Flow)
		}
	}
	return stale
}

// releaseClamps releases the ACK clamp of a restored job's connections that no replay will use.
func (a *Agent) releaseClamps(conns []recoveryConn) {
	if a.clamp == nil {
		return
	}
	for _, c := range conns {
		a.clamp.Release(c.Tuple)
	}
}

// resumeRecovery finishes one recovery from its record: each adopted job waits for its replay, has its
// re-sent bytes verified, and is re-protected; the outcome goes into the record.
func (a *Agent) resumeRecovery(ctx context.Context, rec *recoveryRecord) {
	defer a.setBusy(detect.BusyRestore)()
	a.log.Warn("resuming a recovery the previous agent of this host left unfinished", "failure", rec.Failure, "coordinator", rec.Coordinator)
	t := &recoveryTracker{a: a, rec: *rec}
	t.mu.Lock()
	t.rec.Resumed = true
	t.save()
	t.mu.Unlock()
	stage := t.wrap(func(s Stage) {
		a.log.Info("recovery stage (resumed)", "failure", rec.Failure, "stage", s.Name, "job", s.Job, "detail", s.Detail, "err", s.Error)
	})
	errs := notRestored(rec)
	var protect []string
	for _, rj := range rec.Jobs {
		j, _, jerr := a.Job(rj.Job, 0)
		if jerr == nil && j.State == JobExited && rj.Phase == phaseReplayed {
			// Its replay was verified and it ended since: nothing is left to re-protect, as reprotect finds
			// of a job that ends right after its replay. Not a failure for the coordinator to act on.
			stage(Stage{Name: StageProtected, Job: rj.Job, Host: a.cfg.Name, Start: time.Now(), End: time.Now(),
				Detail: "not needed: the job ended after its replay was verified (resumed after the agent restarted)"})
			continue
		}
		if jerr != nil || j.State != JobRunning {
			state := "unknown here"
			if jerr == nil {
				state = string(j.State)
			}
			unrecorded := a.restoreOutlivedAgent(rj.Job)
			if jerr != nil || unrecorded {
				a.removeOrphanJobNet(ctx, rj.Job, a.recoveredAddr(rj, j, jerr), "an interrupted recovery made it") // one left holds its address
			}
			a.releaseClamps(rj.Conns) // nothing is left to replay on them
			err := fmt.Errorf("job %s (%s when the agent restarted) does not run on %s: its state is %s", rj.Job, rj.Phase, a.cfg.Name, state)
			if unrecorded {
				err = a.killUnrecordedRestore(ctx, rj.Job, rj.Phase)
			}
			stage(Stage{Name: StageReplayed, Job: rj.Job, Host: a.cfg.Name, Start: time.Now(), End: time.Now(), Error: err.Error()})
			errs = append(errs, err)
			continue
		}
		if rj.Phase == phaseReplayed {
			protect = append(protect, rj.Job)
			continue
		}
		r := a.resumedRecoveryJob(rj, j)
		deps, net, err := a.resumedRecoveryDeps(ctx, t, r, j)
		if err != nil {
			// Nothing can check its replay: refused as ReplayAndVerify refuses one, lest it run on unverified
			// (and never re-protected) under a record that says it was killed.
			a.releaseClamps(rj.Conns)
			a.killJob(rj.Job, err)
		}
		if err == nil && len(rj.Deferred) > 0 {
			// The gate that delivered its receive bytes died with the previous agent: the rest at once.
			images := filepath.Join(a.store.Path(j.ID, rj.Snapshot), snapImages)
			// Its peers sent those bytes before the failure and never send them again: a job that lacks them
			// (or stays stopped) waits forever, and one that re-sends nothing has no replay to time out.
			if derr := recovery.DeliverRest(ctx, deps, net, images, rj.Deferred); derr != nil {
				err = fmt.Errorf("the rest of its receive bytes, which the gate of the previous agent had not delivered, could not be delivered: %w", derr)
			}
			// A gate replaying receive positions may have left a thread stopped at one of its stops; with the
			// order given up, nothing is gained by keeping it there.
			if cerr := record.ContinueStopped(a.layout().cgroup(j.ID)); cerr != nil {
				err = errors.Join(err, fmt.Errorf("its processes a gate stopped could not be continued: %w", cerr))
			}
			if err != nil && ctx.Err() == nil {
				recovery.Refuse(deps, r, err)
			}
		}
		if err == nil && len(rj.Fins) > 0 {
			// The previous agent may have died before it delivered them (ReplayAndVerify refuses the job
			// if they cannot be).
			recovery.ResumeFins(ctx, deps, net, r, rj.Fins)
		}
		var detail string
		if err == nil {
			detail, err = recovery.ReplayAndVerify(ctx, deps, r)
		}
		switch {
		case err != nil && ctx.Err() != nil:
			err = fmt.Errorf("job %s: %w", rj.Job, err) // left running, for the next agent
		case err != nil:
			err = fmt.Errorf("job %s is not transparently recoverable (killed): %w", rj.Job, err)
		}
		detail += " (resumed after the agent restarted)"
		stage(Stage{Name: StageReplayed, Job: rj.Job, Host: a.cfg.Name, Start: r.RestoredAt, End: time.Now(), Detail: detail, Error: errString(err)})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		t.SetPhase(rj.Job, phaseReplayed, time.Time{})
		protect = append(protect, rj.Job)
	}
	if len(protect) > 0 {
		start := time.Now()
		detail, err := a.reprotect(ctx, protect)
		stage(Stage{Name: StageProtected, Host: a.cfg.Name, Start: start, End: time.Now(), Detail: detail, Error: errString(err)})
		if err != nil {
			errs = append(errs, fmt.Errorf("re-protect %s: %w", strings.Join(protect, ", "), err))
		}
	}
	err := errors.Join(errs...)
	t.done(ctx, err)
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		a.log.Error("resumed recovery failed", "failure", rec.Failure, "err", err)
		return
	}
	a.log.Info("resumed recovery complete", "failure", rec.Failure)
}

// recoveredAddr is the address an interrupted recovery gave job rj's network on this host: its record's
// here (j, if jerr is nil), else its snapshot's (a failed host's job has no record here); none if neither
// says.
func (a *Agent) recoveredAddr(rj recoveryJob, j Job, jerr error) netip.Prefix {
	if jerr == nil && j.Net != nil {
		return j.Net.Addr
	}
	m, err := a.store.Manifest(rj.Job, rj.Snapshot)
	if err != nil {
		return netip.Prefix{}
	}
	sj, err := a.snapshotJob(m)
	if err != nil {
		return netip.Prefix{}
	}
	return sj.netAddr()
}

// restoreOutlivedAgent reports whether a copy of job id, which has no running record here, may run on
// this host all the same: its cgroup has processes, or a shim of it runs (CRIU may still be restoring it).
// A previous agent killed between CRIU's restore, which the shim runs and which outlives it, and the
// restored job's record left that copy running with nothing to watch it.
func (a *Agent) restoreOutlivedAgent(id string) bool {
	return validJobID(id) && (populated(a.layout().cgroup(id)) || heldOpen(a.shimLog(id)))
}

// unrecordedKillWait bounds how long a resumed recovery waits for an unrecorded copy's CRIU restore to end
// (its shim may still be forking the job's tree into the cgroup) and its processes to go.
const unrecordedKillWait = time.Minute

// killUnrecordedRestore kills the copy of job id that a restore interrupted by the previous agent left
// running without a record (restoreOutlivedAgent): nothing would check its replay, re-protect it or notice
// its end, and its claimed incarnation keeps any other restore of it away. Its shim records the refusal
// in the exit record. It returns the error the recovery reports for the job.
func (a *Agent) killUnrecordedRestore(ctx context.Context, id, phase string) error {
	why := fmt.Errorf("job %s (%s when the agent restarted) was restored on %s by the previous agent, which was killed before it recorded the job: nothing can check its replay", id, phase, a.cfg.Name)
	if held, ok := a.grants.HeldOn(a.cfg.Name)[id]; ok { // the restore's claim: the copy's incarnation
		reason := fmt.Sprintf("killed by ftkit on %s: the job's restore could not reproduce the failure-free run: %v", a.cfg.Name, why)
		if err := writeMark(a.refusalMark(id, held.Incarnation), reason); err != nil {
			a.log.Warn("could not record why the job is killed: its exit record will not say", "job", id, "err", err)
		}
	}
	a.log.Error("killing a restored job the previous agent left running without a record", "job", id, "err", why)
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), unrecordedKillWait)
	defer cancel()
	for {
		kerr := a.killCgroup(id)
		if kerr == nil && !a.restoreOutlivedAgent(id) {
			return fmt.Errorf("%w: killed; the incarnation stays claimed here, restore it with `ftctl restore --force`", why)
		}
		select {
		case <-wctx.Done():
			return fmt.Errorf("%w: it could not be killed (%v) within %s: it may run here unwatched; kill its cgroup %s and its shim by hand", why, kerr, unrecordedKillWait, a.layout().cgroup(id))
		case <-time.After(100 * time.Millisecond): // heldOpen looks through every process's files
		}
	}
}

// notRestored names the jobs of rec that the previous agent did not restore: asked for (or with a failed
// stage) but no longer in the record. The tracker drops a job whose restore failed, and never held one
// that failed before or that the agent died before restoring; left out, the resumed recovery would report
// success to the coordinator for jobs that run nowhere.
func notRestored(rec *recoveryRecord) []error {
	why := map[string]string{}
	ids := slices.Clone(rec.Asked)
	for _, s := range rec.Stages {
		if s.Job != "" && s.Error != "" {
			why[s.Job] = s.Error
			ids = append(ids, s.Job) // a record of an agent that did not keep Asked
		}
	}
	slices.Sort(ids)
	var errs []error
	for _, id := range slices.Compact(ids) {
		if slices.ContainsFunc(rec.Jobs, func(rj recoveryJob) bool { return rj.Job == id }) {
			continue
		}
		if why[id] == "" {
			why[id] = "the previous agent of this host stopped before restoring it"
		}
		errs = append(errs, fmt.Errorf("job %s was not restored: %s", id, why[id]))
	}
	return errs
}

// resumedRecoveryDeps is what a resumed recovery of restored job j (r) needs: the network it runs in
// (to deliver receive bytes, and to reset its peers if it is killed).
func (a *Agent) resumedRecoveryDeps(ctx context.Context, t *recoveryTracker, r *recovery.Job, j Job) (recovery.Deps, recovery.Network, error) {
	if j.Net != nil {
		spec, err := a.jobNetSpec(j.Net)
		if err != nil {
			return recovery.Deps{}, nil, fmt.Errorf("job network of %s: %w", j.ID, err)
		}
		n := recovery.JobNet{Spec: spec, Routes: a.routeEdits}
		r.Net = n
		return a.recoveryDeps(t, nil, ""), n, nil
	}
	iface, own, err := hostInterface(a.cfg.Cluster.Listen.Addr())
	if err != nil {
		return recovery.Deps{}, nil, err
	}
	n := recovery.HostNetwork{Iface: iface, Bits: own.Bits(), Routes: a.routeEdits}
	return a.recoveryDeps(t, n, ""), n, nil
}

// resumedRecoveryJob rebuilds what recovery.ReplayAndVerify needs of a job from its record. A flow the
// clamp no longer holds was released by the previous agent, which releases a flow only once its replay is
// complete: it is not waited for again, but its bytes are still checked.
func (a *Agent) resumedRecoveryJob(rj recoveryJob, j Job) *recovery.Job {
	var flows []ackclamp.ClampedFlow
	listed := false
	if a.clamp != nil {
		var err error
		flows, err = a.clamp.Flows()
		listed = err == nil
	}
	return resumedJob(rj, j, flows, listed)
}

// resumedJob is resumedRecoveryJob with the clamp's flows (listed: the clamp could list them; otherwise
// every connection is waited for).
func resumedJob(rj recoveryJob, j Job, flows []ackclamp.ClampedFlow, listed bool) *recovery.Job {
	r := &recovery.Job{ID: j.ID, Incarnation: j.Incarnation, RestoredAt: rj.RestoredAt, Checks: map[tcpflow.Tuple]recovery.Check{}}
	if r.RestoredAt.IsZero() {
		r.RestoredAt = time.Now()
	}
	var clamped map[tcpflow.Tuple]bool
	if listed {
		clamped = map[tcpflow.Tuple]bool{}
		for _, f := range flows {
			clamped[f.Flow] = true
		}
	}
	for _, c := range rj.Conns {
		if clamped != nil && !clamped[c.Tuple.Unmap()] { // listed in the IPv4 form, as staleClamps keeps them
			r.Replayed = append(r.Replayed, c.Tuple)
		}
		cp := restore.ConnPlan{Resend: c.Resend}
		cp.Conn.Tuple, cp.Conn.OutqSeq, cp.Conn.SentPrefix = c.Tuple, c.OutqSeq, c.SentPrefix
		r.Plan.Conns = append(r.Plan.Conns, cp)
		r.Checks[c.Tuple] = c.Check
	}
	return r
}
