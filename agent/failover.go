package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/fence"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
)

// failover recovers the jobs of a confirmed-failed predecessor (RADIC): pick each job's newest verified
// replica, claim a spare first-come-first-served (or, with none free, restore on this protector: RADIC's
// basic mode), hand the failed node's place in the ring and its addresses to the target in a new view,
// and have the target restore the jobs with the peers' logged bytes replayed.
func (a *Agent) failover(ctx context.Context, s detect.Suspect, declared time.Time) {
	// Before its replicas are chosen: from here none of its snapshots commits, and those that did count.
	inc := a.incarnationOf(s.Name)
	forget, err := a.declared.declare(s.Name, inc, s.Since)
	if err != nil {
		a.log.Warn("not failing over: the node answered after its silence began (back from a stall, it asked this protector to vouch for it)",
			"node", s.Name, "err", err)
		return
	}
	defer forget()
	id := failureID(s.Name, declared)
	defer func() {
		// A fail-over that ended before the view changed restored nothing: the node, if it runs, is a member
		// as before (awaitFence abandons a recovery of a node that beats again), and may be vouched for. One
		// that changed it keeps its declaration (declaredFailed.inView), though the node be alive in the view
		// now: that view may have lost the tie-break with another failure's of the same epoch.
		if m, ok := a.member(s.Name); ok && m.State == ring.StateAlive && m.Incarnation == inc {
			if !a.declared.undeclare(s.Name, inc) && a.failures.GiveBack(id) {
				// Nothing was restored: the recoveries it took over go with the node's next fail-over.
				a.log.Warn("the fail-over ended before the view changed: the recoveries it took over are left to the node's next fail-over", "node", s.Name, "failure", id)
				a.saveFailures()
			}
			// And it is watched again: a suspicion is reported once, until a beat or Clear, so one left
			// standing kept a node that stays silent (no replica of its jobs reachable, its fence command
			// failed) from being suspected, and the fail-over tried, ever again. Tried again after a timeout,
			// then twice as long each time (at most failoverRetryMax): each try is a failure in the log. A
			// protector in a minority tries again after every timeout (majorityReached cleared it): the
			// partition may heal at any time, and it declared nothing.
			if !errors.Is(err, errNoMajorityReached) {
				now := time.Now()
				timeout := a.cfg.Heartbeat.Timeout.Duration
				a.watchdog.Clear(s.Name, now.Add(a.declared.retryAfter(s.Name, timeout, now)-timeout))
			}
		}
	}()
	s.Jobs = a.replicas.since(s.Name, s.LastBeat, s.Jobs)
	// A node that fails while it restores the jobs of an earlier failure this host coordinates (a spare
	// that died mid-restore) takes those jobs down with it, whether or not its beats named them yet.
	taken := a.failures.TakeOver(a.cfg.Name, s.Name, id)
	for job, from := range taken {
		if !slices.Contains(s.Jobs, job) {
			s.Jobs = append(s.Jobs, job)
		}
		a.log.Warn("the failed node was restoring a job of an earlier failure: this recovery takes it over", "node", s.Name, "job", job, "from", from)
	}
	a.recordFailure(s, declared)
	a.log.Error("node failed", "node", s.Name, "jobs", s.Jobs, "detection_ms", declared.Sub(s.LastBeat).Milliseconds(), "failure", id)
	err = a.runFailover(ctx, id, s, declared, taken)
	a.failures.Update(id, func(f *Failure) {
		f.Done = true
		if err != nil {
			f.Error = err.Error()
		}
	})
	a.saveFailures()
	a.pushView(ctx)
	if err != nil {
		a.log.Error("recovery failed or incomplete: the error says which jobs do not run", "node", s.Name, "failure", id, "err", err)
		return
	}
	a.log.Info("recovery complete", "node", s.Name, "failure", id)
}

// failureID names the failure of node declared at that time.
func failureID(node string, declared time.Time) string {
	return node + "-" + declared.UTC().Format("20060102T150405.000")
}

// recordFailure starts the timeline of a confirmed failure (failureID names it).
func (a *Agent) recordFailure(s detect.Suspect, declared time.Time) {
	id := failureID(s.Name, declared)
	// The silence of a suspicion cleared before counts from its clearing; with no beat heard since
	// watching began (a ring change made s this host's predecessor moments before), from then.
	silence, start := s.Silence, s.LastBeat
	if start.IsZero() {
		start = declared.Add(-silence)
	}
	silence = max(silence, declared.Sub(start))
	detail := fmt.Sprintf("no heartbeat for %s; direct probe and the other neighbour confirmed", silence.Round(time.Millisecond))
	if s.InGrace {
		detail = fmt.Sprintf("no heartbeat for %s while %s, and its host did not answer a TCP handshake either; direct probe and the other neighbour confirmed",
			silence.Round(time.Millisecond), busyDoing(s.Busy))
	}
	a.failures.Update(id, func(f *Failure) {
		f.Node, f.Protector, f.LastBeat, f.Detected, f.Jobs = s.Name, a.cfg.Name, s.LastBeat, declared, s.Jobs
		f.Stages = append(f.Stages, Stage{Name: StageDetected, Host: a.cfg.Name, Start: start, End: declared, Detail: detail})
		if !a.cfg.Failover.Automatic {
			f.Done, f.Error = true, "automatic fail-over is off: restore the jobs with ftctl restore"
		}
	})
	a.saveFailures()
}

// busyDoing says what a beat's Busy field means.
func busyDoing(busy string) string {
	switch busy {
	case detect.BusyCheckpoint:
		return "checkpointing"
	case detect.BusyRestore:
		return "restoring"
	}
	return "busy (" + busy + ")"
}

// runFailover restores the jobs of failure id. taken are jobs of earlier failures that s was restoring
// when it failed, each with the node whose replicas it comes back from if s has none.
func (a *Agent) runFailover(ctx context.Context, id string, s detect.Suspect, declared time.Time, taken map[string]string) error {
	inc := a.incarnationOf(s.Name) // the incarnation this fail-over fails (a rejoin makes the next one)
	if len(s.Jobs) == 0 {
		// Nothing to restore: the node only leaves the ring.
		fail := func() error {
			_, err := a.updateView(func(cur ring.View) (ring.View, error) { return cur.Fail(s.Name) })
			if err == nil {
				a.declared.inView(s.Name, inc)
			}
			return err
		}
		if err := a.majorityReached(ctx, s.Name); err != nil {
			return err
		}
		if err := fail(); err != nil {
			return err
		}
		go a.keepFailedInView(ctx, s.Name, inc, fail)
		return nil
	}
	var jobs []RecoverJob
	var direct []string // jobs only their run's rollback can recover
	var runs []jobRun
	var need spare.Need
	var errs []error
	if s.Unlisted > 0 {
		// Past what one recovery restores: they were never to be restored, and must not go unnoticed.
		errs = append(errs, fmt.Errorf("the beats of %s named %d more jobs than one recovery restores (%d): they are not restored; restore them with ftctl restore",
			s.Name, s.Unlisted, maxBeatJobs))
	}
	ownAddrs := true // every job has an address of its own: the failed host's stays where it is
	uncovered := map[string]string{}
	for _, u := range s.Uncovered {
		uncovered[u.Job] = u.Replica
	}
	for _, job := range s.Jobs {
		// The failed node ships to the next node of the ring when its protector does not answer, so
		// another member may hold a newer replica than this host: restoring an older one would need log
		// data the peers have already dropped. The newest anywhere comes first; the others follow, for
		// when a holder fails to serve.
		held, err := a.heldReplicas(ctx, job, s.Name)
		if from, ok := taken[job]; ok {
			earlier, ferr := a.heldReplicas(ctx, job, from, s.Name)
			// The failed node's replicas stay first: its copy of the job began from one of from's snapshots,
			// so each of them is newer, whatever the two hosts' clocks say (sortHeld).
			if held = append(held, earlier...); len(held) > 0 {
				sortHeld(held)
				err = nil
			} else {
				err = errors.Join(err, ferr)
			}
		}
		if err != nil {
			err = fmt.Errorf("job %s: %w", job, err)
		} else {
			err = lacksConns(job, recoveryCandidates(held)[0].Snapshot, uncovered)
		}
		if err != nil {
			if a.cutRecords().RollsBackAlone(job) {
				// Message logging cannot restore it, its run's coordinated snapshot can (the run's connections
				// opened since are rolled back with both their ends).
				a.log.Warn("message logging cannot recover the job: its run rolls back to its coordinated snapshot", "job", job, "err", err)
				direct = append(direct, job)
				need.Jobs++
				continue
			}
			errs = append(errs, err)
			continue
		}
		cands := recoveryCandidates(coveringReplicas(job, held, uncovered)) // the target falls back to the next ones
		if held[0].holder != a.cfg.Name {
			a.log.Warn("the newest replica is on another member", "job", job, "snapshot", cands[0].Snapshot, "holder", cands[0].Source)
		}
		jobs = append(jobs, RecoverJob{Job: job, Snapshot: cands[0].Snapshot, Source: cands[0].Source, Candidates: cands, TakenFrom: taken[job]})
		ownAddrs = ownAddrs && slices.ContainsFunc(held, func(h heldReplica) bool { return h.jobAddr })
		runs = append(runs, jobRun{job: job, spares: held[0].spares})
		need.Jobs++
		need.MemoryBytes += held[0].m.TotalSize()
	}
	if len(jobs) == 0 && len(direct) == 0 {
		return errors.Join(append(errs, errors.New("no job of the failed node can be restored"))...)
	}
	target, absorb, basic := a.claimSpare(ctx, id, s.Name, need, a.runSparesOf(s.Name, runs), prefetchOf(jobs))
	v := a.View()
	// Before the failed node's address and jobs come up elsewhere, its old copies must be gone.
	failedMember, _ := v.Member(s.Name)
	if err := a.awaitFence(ctx, id, s, declared, failedMember.Address.String()); err != nil {
		return errors.Join(append(errs, err)...)
	}
	if err := a.majorityReached(ctx, s.Name); err != nil {
		return errors.Join(append(errs, err)...)
	}
	if err := a.replaceInView(s.Name, target, absorb, ownAddrs); err != nil {
		return fmt.Errorf("new membership view: %w", err)
	}
	// From here the jobs may run elsewhere: the declaration stands whatever view wins (undeclare).
	a.declared.inView(s.Name, inc)
	a.failures.Update(id, func(f *Failure) { f.Target, f.Basic = target, basic })
	a.pushView(ctx) // peers must know who holds the failed node's addresses before replay starts
	go a.keepFailedInView(ctx, s.Name, inc, func() error { return a.replaceInView(s.Name, target, absorb, ownAddrs) })
	failed, _ := v.Member(s.Name)
	req := RecoverRequest{Failure: id, Failed: s.Name, Addrs: failed.Addrs, Jobs: jobs, Source: a.cfg.Name}
	if ownAddrs {
		// The jobs move with their own addresses; the failed host keeps its own, to be repaired and
		// come back without two hosts on one address.
		req.Addrs = nil
		a.log.Info("every job of the failed node has a job address: its host address is not taken over", "node", s.Name, "addrs", failed.Addrs)
	}
	emit := func(st Stage) {
		a.failures.Update(id, func(f *Failure) { f.Stages = append(f.Stages, st) })
		a.saveFailures()
		a.log.Info("recovery stage", "failure", id, "stage", st.Name, "job", st.Job, "host", st.Host,
			"ms", st.Duration().Milliseconds(), "detail", st.Detail, "err", st.Error)
	}
	// Jobs whose runs roll back as a whole (coordinated mode) skip message logging; in auto mode a failed
	// one falls back to that rollback.
	var coordinated []string
	req.Jobs, coordinated = a.coordinatedJobs(jobs)
	coordinated = append(coordinated, direct...)
	var err error
	if len(req.Jobs) > 0 {
		if target == a.cfg.Name {
			err = a.recoverJobs(ctx, req, emit)
		} else {
			err = a.remoteRecover(ctx, target, req, emit)
		}
	}
	if by := a.takenOverBy(id); by != "" && errors.Is(err, errTargetFailed) {
		// The target's own recovery restores the jobs (and rolls back what must be): nothing more here.
		return errors.Join(append(errs, fmt.Errorf("%w; the recovery of its failure %s takes the job(s) over", err, by))...)
	}
	if err != nil || len(coordinated) > 0 {
		ids := slices.Clone(direct)
		for _, j := range jobs {
			ids = append(ids, j.Job)
		}
		err = a.rollbackAfterFailure(ctx, s.Name, target, ids, coordinated, err, emit)
	}
	return errors.Join(append(errs, err)...)
}

// keepFailedInView makes sure, for keepFailedFor, that the views keep failed node failed: two protectors
// that handle two failures at once each make a view of the same epoch, and the one with the larger hash
// wins everywhere, the other failure undone (its node alive again, its replacement a free spare). Each
// protector finds its change lost once the views have converged, and applies it again (reapply) onto the
// winner, at the next epoch, which every member adopts.
func (a *Agent) keepFailedInView(ctx context.Context, failed string, inc uint64, reapply func() error) {
	for end := time.Now().Add(keepFailedFor); time.Now().Before(end); {
		select {
		case <-ctx.Done():
			return
		case <-time.After(keepFailedEvery):
		}
		if a.reassertFailed(ctx, failed, inc, reapply) {
			return
		}
	}
}

// reassertFailed applies a failure's view change again if the current view lists failed node alive as
// incarnation inc (reapply), and pushes it; it reports whether it had to and could. A node that rejoined
// since is a later incarnation, alive rightly.
func (a *Agent) reassertFailed(ctx context.Context, failed string, inc uint64, reapply func() error) bool {
	if m, ok := a.View().Member(failed); !ok || m.State == ring.StateFailed || m.Incarnation != inc {
		return false
	}
	if err := reapply(); err != nil {
		a.log.Error("a failed node is alive again in the view (another failure's view of the same epoch won), and could not be failed again", "node", failed, "err", err)
		return false
	}
	a.log.Warn("a failed node was alive again in the view (another failure's view of the same epoch won): failed again", "node", failed, "epoch", a.View().Epoch)
	a.pushView(ctx)
	return true
}

// How long, and how often, a protector checks that the views keep the node it failed over failed.
const (
	keepFailedFor   = time.Minute
	keepFailedEvery = 2 * time.Second
)

// replaceInView records in this host's view that target stands for failed node: absorbing it (basic mode,
// or a node of the ring that was idle as a spare of the run: it keeps its ring position and takes the
// failed node's addresses), or in its place, with its addresses or without (ownAddrs: the jobs move with
// addresses of their own, and the host keeps its own to come back with, ring.View.Rejoin). The change
// goes onto the view as it is now, not as it was before the fence wait (seconds): a view adopted meanwhile
// (a spare added, another failure) has an epoch at or above the older one's, and a change made to that was
// dropped as stale while the fail-over went on, the failed node alive in every view.
func (a *Agent) replaceInView(failed, target string, absorb, ownAddrs bool) error {
	_, err := a.updateView(func(cur ring.View) (ring.View, error) {
		switch {
		case absorb:
			return cur.Absorb(failed, target)
		case ownAddrs:
			return cur.ReplaceKeepingAddrs(failed, target)
		default:
			return cur.Replace(failed, target)
		}
	})
	return err
}

// errNoMajorityReached: the protector does not reach a majority of the members, and does not declare.
var errNoMajorityReached = errors.New("cannot reach a majority of the members")

// majorityReached returns an error unless this host reaches (a ping answered within the probe timeout) a
// majority of grantMembers(failed): those whose majority the restore's incarnation claim needs, this host
// counted, the failed node not. A protector cut off in a minority would otherwise declare failed a node
// that may run on (it still hears its other neighbour, so it did not fence itself), its restore would fail
// for lack of a majority, and once the partition heals the view would reach the node, which then kills
// jobs that run nowhere else. Refused, the suspicion is cleared so the node is suspected again after
// another heartbeat timeout, and the fail-over retried.
func (a *Agent) majorityReached(ctx context.Context, failed string) error {
	members := a.grantMembers(failed)
	silent := a.silentMembers(ctx, members)
	reached, need := len(members)-len(silent), grant.Majority(len(members))
	if reached >= need {
		return nil
	}
	a.log.Warn("cannot reach a majority of the members: not declaring the node failed; a partition?",
		"node", failed, "reached", reached, "members", len(members), "need", need, "silent", silent)
	a.watchdog.Clear(failed, time.Now())
	return fmt.Errorf("%w (reached %d of %d, %d needed; silent: %s): %s was not declared failed; it is suspected again after a heartbeat timeout, "+
		"and failed over once this host reaches a majority (check the network between the members)",
		errNoMajorityReached, reached, len(members), need, strings.Join(silent, "; "), failed)
}

// silentMembers pings every member of members but this host at once and returns those that did not answer
// within the probe timeout, each with why.
func (a *Agent) silentMembers(ctx context.Context, members []string) []string {
	errs := make([]error, len(members))
	var wg sync.WaitGroup
	for i, m := range members {
		if m == a.cfg.Name {
			continue
		}
		wg.Go(func() { errs[i] = a.probePing(ctx, m) })
	}
	wg.Wait()
	var silent []string
	for i, err := range errs {
		if err != nil {
			silent = append(silent, members[i]+": "+shorten(err.Error(), 200))
		}
	}
	return silent
}

// takenOverBy is the failure whose recovery took failure id's jobs over ("" if none did).
func (a *Agent) takenOverBy(id string) string {
	for _, f := range a.failures.List() {
		if f.ID == id {
			return f.TakenOver
		}
	}
	return ""
}

// StageFenced names the stage in which the protector makes sure the failed node's old copies are gone.
const StageFenced = "fenced"

// awaitFence returns once the failed node s can no longer run its jobs: the fence command confirmed its
// host is off, or enough time has passed since its last heartbeat for it to have fenced itself
// (fence.Timing.ReadyAt, on this host's monotonic clock: s.LastBeat and declared are this process's
// readings). The result is the "fenced" stage of the timeline.
func (a *Agent) awaitFence(ctx context.Context, id string, s detect.Suspect, declared time.Time, address string) error {
	start := time.Now()
	t := a.cfg.FenceTiming()
	var detail []string
	if len(a.cfg.Failover.FenceCommand) > 0 {
		cmd := fence.Command{Argv: a.cfg.Failover.FenceCommand, Timeout: a.cfg.Failover.FenceCommandTimeout.Duration}
		r := cmd.Run(ctx, s.Name, address)
		detail = append(detail, r.Detail())
		if r.Off {
			a.log.Info("fence command confirmed the failed host is off", "node", s.Name, "ms", r.Took.Milliseconds(), "output", r.Output)
		} else {
			a.log.Warn("fence command did not confirm the failed host is off; waiting for it to fence itself",
				"node", s.Name, "err", r.Err, "output", r.Output)
		}
		if r.Off {
			a.fenceStage(id, start, strings.Join(detail, "; "), "")
			return nil
		}
		if err := a.agentHungOnLiveHost(ctx, s.Name); err != nil {
			err = fmt.Errorf("the fence command did not power %s off, and %w", s.Name, err)
			a.fenceStage(id, start, strings.Join(detail, "; "), err.Error())
			return err
		}
	}
	// The reference is the last beat that arrived, or this host's last vouch for s if later (s counts it as
	// contact from when it asked); with neither since watching started (a ring change just made s our
	// predecessor), when watching started, which is later and so waits longer. A beat from before watching
	// started (s was our predecessor before a ring change, and is again) is no reference either: s may have
	// had contact with its protector in between, and counts its silence from that.
	ref := s.LastBeat
	if v := a.declared.lastVouch(s.Name); v.After(ref) {
		ref = v
	}
	if s.Watched.After(ref) {
		ref = s.Watched
	}
	if from := declared.Add(-s.Silence); ref.IsZero() || from.Sub(ref) > a.cfg.Heartbeat.Timeout.Duration+t.Timeout {
		ref = from
	}
	ready := t.ReadyAt(ref)
	detail = append(detail, fmt.Sprintf("waited until fence_timeout %s + margin %s had passed since the last heartbeat of %s (%s after it)",
		t.Timeout, t.Margin().Round(time.Millisecond), s.Name, ready.Sub(ref).Round(time.Millisecond)))
	if wait := time.Until(ready); wait > 0 {
		a.log.Info("waiting for the failed node to have fenced itself", "node", s.Name, "wait_ms", wait.Milliseconds())
	}
	err := sleepUntil(ctx, ready)
	if err == nil {
		err = a.beatsAgain(ctx, s)
	}
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("waiting for %s to fence itself: %w; its jobs were not restored, restore them with ftctl restore", s.Name, err)
		}
		a.fenceStage(id, start, strings.Join(detail, "; "), err.Error())
		return err
	}
	a.fenceStage(id, start, strings.Join(detail, "; "), "")
	return nil
}

// agentHungOnLiveHost returns an error if name's host answers a TCP handshake while its agent does not
// answer a probe: the host is up and reachable, so it is not cut off and will not fence itself, and its
// agent will not either (judge does not declare such a node without a fence command).
func (a *Agent) agentHungOnLiveHost(ctx context.Context, name string) error {
	if a.hostAnswers(ctx, name) != nil {
		return nil
	}
	if err := a.probePing(ctx, name); err != nil {
		return fmt.Errorf("its host answers while its agent does not (%v): its jobs may still run there, so they are not restored elsewhere; "+
			"power the host off, then restore them with ftctl restore", err)
	}
	return nil
}

// beatsAgain refuses to go on with the recovery of s if s beat again after its last beat before the
// declaration, with jobs of the recovery still running, and its agent answers: it runs and reaches this
// host, so it has contact and will not fence itself (the fence wait assumed it would), and its jobs run on
// there. An agent stalled past the heartbeat timeout but not the fence timeout, or a short partition, looks
// like that. A node told so by a refused vouch killed its jobs on that answer: the recovery goes on once
// that kill is surely over. One that beat again but does not answer now had contact until that beat: the
// fence wait starts again from it.
func (a *Agent) beatsAgain(ctx context.Context, s detect.Suspect) error {
	t := a.cfg.FenceTiming()
	ref := s.LastBeat
	// A set: both lists may be long (maxBeatJobs), and compared entry by entry they cost their product.
	recovering := make(map[string]struct{}, len(s.Jobs))
	for _, j := range s.Jobs {
		recovering[j] = struct{}{}
	}
	for {
		b, at, ok := a.watchdog.Last(s.Name)
		if !ok || !at.After(ref) {
			return nil
		}
		var running []string
		for _, j := range b.Jobs {
			if _, ok := recovering[j]; ok {
				running = append(running, j)
			}
		}
		if len(running) == 0 {
			return nil // back without the jobs (a restarted host): nothing runs twice
		}
		if r, ok := a.declared.refusedSince(s.Name, s.LastBeat); ok {
			return sleepUntil(ctx, r.Add(fence.KillBound))
		}
		if _, alive := a.reaches(ctx, s.Name); alive {
			return fmt.Errorf("%s beat again after it was declared failed, running %s, and its agent answers: it did not fence itself; "+
				"the recovery is abandoned and its jobs run on there (a stall or a short partition, not a failure)", s.Name, strings.Join(running, " "))
		}
		a.log.Warn("the failed node beat again after it was declared failed, and does not answer now: waiting for it to have fenced itself since that beat",
			"node", s.Name, "running", running)
		if err := sleepUntil(ctx, t.ReadyAt(at)); err != nil {
			return err
		}
		ref = at
	}
}

// sleepUntil waits until t or until ctx ends.
func sleepUntil(ctx context.Context, t time.Time) error {
	tm := time.NewTimer(time.Until(t))
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (a *Agent) fenceStage(id string, start time.Time, detail, errText string) {
	a.failures.Update(id, func(f *Failure) {
		f.Stages = append(f.Stages, Stage{Name: StageFenced, Host: a.cfg.Name, Start: start, End: time.Now(), Detail: detail, Error: errText})
	})
	a.saveFailures()
}

// newestReplica is the newest snapshot of job taken on node that this host holds and that verifies (or
// arrived verified moments ago: verifyUnlessFresh; hashing a 1 GiB replica again took 0.6 s of a fail-over).
func (a *Agent) newestReplica(ctx context.Context, job, node string) (*ckpt.Manifest, error) {
	ids, err := a.store.List(job, node)
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, id := range ids {
		m, err := a.verifyUnlessFresh(ctx, job, id)
		if err == nil {
			return m, nil
		}
		errs = append(errs, err)
		a.log.Error("replica failed verification; trying an older one", "job", job, "snapshot", id, "err", err)
	}
	return nil, errors.Join(append(errs, fmt.Errorf("%w: no verified replica of job %s from %s", ckpt.ErrNotFound, job, node))...)
}

// heldReplica is a member's newest verified replica of a job.
type heldReplica struct {
	holder string
	m      *ckpt.Manifest
	spares []string // of the job's run, as the replica's job record names them
	// jobAddr: the replica's job record has a job address (known for replicas this host holds).
	jobAddr bool
}

// jobRun is a failed node's job and the spares of its run (none without a placement).
type jobRun struct {
	job    string
	spares []string
}

// runSparesOf is where the failed node's jobs are restored first: the spares of their run. One target
// takes all of a node's jobs (its addresses move with them), so with jobs of different runs the first
// job's run decides: a site runs one run per host (Slurm: --exclusive).
func (a *Agent) runSparesOf(failed string, runs []jobRun) []string {
	var first *jobRun
	for i, r := range runs {
		if len(r.spares) == 0 {
			continue
		}
		if first == nil {
			first = &runs[i]
		} else if !slices.Equal(r.spares, first.spares) {
			a.log.Warn("the failed node ran jobs of different runs: all are restored on the spares of the first one's run; run one run per host (Slurm: --exclusive)",
				"failed", failed, "job", first.job, "spares", first.spares, "other_job", r.job, "other_spares", r.spares)
		}
	}
	if first == nil {
		return nil
	}
	return first.spares
}

// runSpares are the spares of the run a replica's job belongs to, from the job record the replica carries
// (none for a job without a placement, or with a record a restore would refuse anyway).
func (a *Agent) runSpares(m *ckpt.Manifest) []string {
	j, err := a.snapshotJob(m)
	if err == nil {
		err = j.Spec.Placement.Validate()
	}
	if err != nil {
		a.log.Warn("the job record of a replica is unusable; its run's spares are unknown", "job", m.Job, "snapshot", m.ID, "err", err)
		return nil
	}
	if j.Spec.Placement == nil {
		return nil
	}
	return j.Spec.Placement.Spares
}

// heldReplicas collects the newest verified replica of job from node held by this host and by each other
// alive member but skip (members the caller knows are gone, which would cost a request timeout), newest
// first (this host first among equals: no transfer when it is the target). An error only if nobody holds
// one.
func (a *Agent) heldReplicas(ctx context.Context, job, node string, skip ...string) ([]heldReplica, error) {
	var held []heldReplica
	var errs []error
	if m, err := a.newestReplica(ctx, job, node); err == nil {
		j, jerr := a.snapshotJob(m)
		held = append(held, heldReplica{holder: a.cfg.Name, m: m, spares: a.runSpares(m), jobAddr: jerr == nil && j.Net != nil})
	} else {
		errs = append(errs, fmt.Errorf("%s: %w", a.cfg.Name, err))
	}
	remote, err := a.remoteReplica(ctx, job, node, skip...)
	held = append(held, remote...)
	if len(held) == 0 {
		return nil, errors.Join(append(errs, err)...)
	}
	sortHeld(held)
	return held, nil
}

// sortHeld orders replicas newest first, keeping the given order among equals. Ids start with the UTC time
// of the dump by their host's clock, so only those of one host are compared: replicas of different hosts
// (a job taken over from a node that was restoring it, runFailover) keep the order of their hosts' first
// replicas in held, which the caller gives newest copy first. Ordered by the ids, the earlier host's stale
// snapshots came first whenever its clock was ahead of the failed node's.
func sortHeld(held []heldReplica) {
	rank := map[string]int{}
	for _, h := range held {
		if _, ok := rank[h.m.Node]; !ok {
			rank[h.m.Node] = len(rank)
		}
	}
	slices.SortStableFunc(held, func(x, y heldReplica) int {
		return cmp.Or(cmp.Compare(rank[x.m.Node], rank[y.m.Node]), strings.Compare(y.m.ID, x.m.ID))
	})
}

// recoveryCandidates is the ordered list a recovery request carries for one job.
func recoveryCandidates(held []heldReplica) []Candidate {
	out := make([]Candidate, 0, len(held))
	for _, h := range held {
		out = append(out, Candidate{Snapshot: h.m.ID, Source: h.holder})
	}
	return out
}

// remoteReplica asks the other alive members but skip for their newest verified replica of job from node;
// the error says why none had one (nil if some did). They are asked at once, each only once it answered a
// ping within the probe timeout: a member a partition cut off cannot serve its replica anyway, and asked
// in turn, each such member held the recovery for the whole bound of the question (30 s by default).
func (a *Agent) remoteReplica(ctx context.Context, job, node string, skip ...string) ([]heldReplica, error) {
	var asked []string
	for _, mb := range a.View().Members {
		if mb.Name != a.cfg.Name && mb.Name != node && mb.State == ring.StateAlive && !slices.Contains(skip, mb.Name) {
			asked = append(asked, mb.Name)
		}
	}
	held := make([]*heldReplica, len(asked))
	errs := make([]error, len(asked))
	var wg sync.WaitGroup
	for i, name := range asked {
		wg.Go(func() {
			if err := a.probePing(ctx, name); err != nil {
				errs[i] = fmt.Errorf("%s does not answer: %w", name, err)
				return
			}
			// The answer names the snapshot the target will ask for: the client checks it is this job's, from node.
			r, err := a.peers().Replica(ctx, name, clusterapi.ReplicaRequest{Job: job, Node: node})
			if err != nil {
				errs[i] = fmt.Errorf("%s: %w", name, err)
				return
			}
			held[i] = &heldReplica{holder: name, m: r.Manifest, spares: r.RunSpares}
		})
	}
	wg.Wait()
	var out []heldReplica
	for _, h := range held {
		if h != nil {
			out = append(out, *h)
		}
	}
	if len(out) == 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// claimSpare claims the first free spare that can host the failed node's jobs: one of their run's spares
// (runSpares, the run's order) first, then the ring's spares. With none, it returns this host and
// basic=true: the jobs restart here (RADIC's basic mode) and the operator is told. absorb says the target
// is a node of the ring (a run's idle host, or this one in basic mode), which takes the failed node's
// addresses and keeps its place, rather than a ring spare that replaces the failed node.
func (a *Agent) claimSpare(ctx context.Context, failure, failed string, need spare.Need, runSpares []string, prefetch []spare.Prefetch) (target string, absorb, basic bool) {
	start := time.Now()
	claimed := func(name, detail string) {
		a.failures.Update(failure, func(f *Failure) {
			f.Stages = append(f.Stages, Stage{Name: StageClaimed, Host: name, Start: start, End: time.Now(),
				Detail: fmt.Sprintf("%s%d job(s), %d MB", detail, need.Jobs, need.MemoryBytes>>20)})
		})
	}
	var refusals []string
	runBusy := ""
	if len(runSpares) > 0 {
		for _, t := range spare.RunOrder(a.View(), runSpares, failed, nil) {
			cl := spare.Claim{Failure: failure, By: a.cfg.Name, Failed: failed, Need: need, At: start, Spares: runSpares, Prefetch: prefetch}
			var err error
			if t.Name == a.cfg.Name {
				err = a.serveClaim(a.cfg.Name, cl) // this host is an idle host of the run
			} else {
				err = a.requestClaim(ctx, t.Name, cl)
			}
			if err == nil {
				claimed(t.Name, "a spare of the run: ")
				return t.Name, t.Node, false
			}
			refusals = append(refusals, fmt.Sprintf("%s: %v", t.Name, err))
		}
		runBusy = "the run's own spares were busy or gone (" + strings.Join(refusals, "; ") + "); "
		if len(refusals) == 0 {
			runBusy = fmt.Sprintf("none of the run's own spares %v is alive; ", runSpares)
		}
		a.log.Warn("no spare of the failed node's run is free: trying the ring's spares", "failed", failed, "why", runBusy)
		refusals = nil
	}
	for _, name := range spare.Order(a.View().Spares(), nil) {
		err := a.requestClaim(ctx, name, spare.Claim{Failure: failure, By: a.cfg.Name, Failed: failed, Need: need, At: start, Prefetch: prefetch})
		if err == nil {
			claimed(name, runBusy)
			return name, false, false
		}
		refusals = append(refusals, fmt.Sprintf("%s: %v", name, err))
	}
	detail := "no spare registered"
	if len(refusals) > 0 {
		detail = "no spare free (" + strings.Join(refusals, "; ") + ")"
	}
	a.log.Error("no spare available: restoring the failed node's jobs on its protector (basic mode); add spares with `ftctl spare add`",
		"failed", failed, "why", runBusy+detail)
	a.failures.Update(failure, func(f *Failure) {
		f.Stages = append(f.Stages, Stage{Name: StageClaimed, Host: a.cfg.Name, Start: start, End: time.Now(),
			Detail: "basic mode on the protector: " + runBusy + detail})
	})
	return a.cfg.Name, true, true
}

func (a *Agent) requestClaim(ctx context.Context, name string, cl spare.Claim) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	return a.peers().Claim(ctx, name, cl)
}

// serveClaim answers a claim: a spare accepts one failed node at a time and only if its memory suffices.
// Only an alive node of the ring may claim it, for another node of the ring. A ring spare accepts any such
// claim; an alive node of the ring accepts only a claim for a run that names it among its spares, and only
// while it runs no job (in a Slurm cluster every host is a node: a run's spares are its idle hosts).
func (a *Agent) serveClaim(peer string, cl spare.Claim) error {
	// Who claims and when are this host's to say: the claim's age (idleForRun) is read on this host's clock,
	// and a claimer's clock that lags freed the claim before its recovery request came.
	cl.By, cl.At = peer, time.Now()
	err := func() error {
		if err := cl.Validate(); err != nil {
			return err
		}
		v := a.View()
		self, ok := v.Member(a.cfg.Name)
		runSpare := self.Role == ring.RoleNode && slices.Contains(cl.Spares, a.cfg.Name)
		if !ok || self.State != ring.StateAlive || (self.Role != ring.RoleSpare && !runSpare) {
			return fmt.Errorf("%w: %s is not a free spare (role %s)", spare.ErrBusy, a.cfg.Name, self.Role)
		}
		cl.SpareIncarnation = self.Incarnation
		if by, ok := v.Member(peer); !ok || by.Role != ring.RoleNode || by.State != ring.StateAlive {
			return fmt.Errorf("claim refused: %s is not an alive node of the ring (role %s, state %s); only a failed node's protector claims a spare", peer, by.Role, by.State)
		}
		if failed, ok := v.Member(cl.Failed); !ok || failed.Role != ring.RoleNode || cl.Failed == peer || cl.Failed == a.cfg.Name {
			return fmt.Errorf("claim refused: %q is not another node of the ring", cl.Failed)
		}
		a.releaseAbandonedClaim(v)
		if runSpare {
			if err := a.idleForRun(v, cl); err != nil {
				return err
			}
		}
		avail, err := spare.MemAvailable()
		if err != nil {
			return err
		}
		return a.claims.Claim(cl, avail)
	}()
	if err != nil {
		return err
	}
	a.log.Info("spare claimed", "by", peer, "failed", cl.Failed, "failure", cl.Failure, "jobs", cl.Need.Jobs, "run_spare", len(cl.Spares) > 0)
	if peer != a.cfg.Name {
		go a.prefetch(cl)
	}
	return nil
}

// releaseAbandonedClaim frees this node from a claim whose recovery ended before the view changed (the
// failed node beat again, and its jobs ran on: beatsAgain): the failure's timeline, which the protector
// pushes to every member, says done, and the node is an alive member still, so no job came here. It also
// frees it from a claim taken by an earlier incarnation of this host: that one failed, its jobs were
// dropped before it rejoined, and no recovery request of that claim can come to the new one (a rejoined
// spare kept it forever, busy for every later failure). And from a claim whose claimer failed or left
// before its recovery came here: only the claimer may send its recovery request (checkRecoverRequest), and
// the failed node's next protector claims with a failure id of its own; once that node is failed in the
// view, the check below never frees the claim, and the spare stayed busy until it rejoined. And from a
// claim whose claimer's timeline names another target: the claimer did not get this host's answer (it
// timed out after the claim was persisted here) and took the next spare, so no request comes here. And
// from a claim whose recovery request did not come within the time a recovery may take (claimUnnamed).
//
// Never while a job runs or is being restored here: the failed node may be alive in the view because its
// replacement's view lost the same-epoch tie-break (until its protector applies it again) while its jobs,
// restored, run here; freed, the spare took a second failure's jobs on top of the first's.
func (a *Agent) releaseAbandonedClaim(v ring.View) {
	cur, ok := a.claims.Current()
	if !ok {
		return
	}
	if len(a.runningJobIDs()) > 0 || a.busy.current() == detect.BusyRestore {
		return
	}
	if self, ok := v.Member(a.cfg.Name); ok && cur.SpareIncarnation < self.Incarnation {
		if err := a.claims.Release(cur.Failure); err != nil {
			a.log.Error("release the claim of an earlier incarnation", "failure", cur.Failure, "err", err)
			return
		}
		a.log.Info("claim released: it was taken by an earlier incarnation of this host", "failure", cur.Failure, "failed", cur.Failed,
			"claimed_as", cur.SpareIncarnation, "incarnation", self.Incarnation)
		return
	}
	if by, ok := v.Member(cur.By); cur.By != a.cfg.Name && (!ok || by.State != ring.StateAlive) {
		if err := a.claims.Release(cur.Failure); err != nil {
			a.log.Error("release the claim of a failed claimer", "failure", cur.Failure, "by", cur.By, "err", err)
			return
		}
		a.log.Info("claim released: its claimer failed or left before its recovery came here", "failure", cur.Failure,
			"failed", cur.Failed, "by", cur.By, "by_state", by.State)
		return
	}
	for _, f := range a.failures.List() {
		// The claimer chose another target (this host's answer to its claim was lost): its recovery
		// request goes there only, and the claim, kept, had this spare refuse every later failure.
		if f.ID == cur.Failure && f.Protector == cur.By && f.Target != "" && f.Target != a.cfg.Name {
			if err := a.claims.Release(cur.Failure); err != nil {
				a.log.Error("release the claim of a recovery that went elsewhere", "failure", cur.Failure, "err", err)
				return
			}
			a.log.Info("claim released: its claimer recovers the failed node elsewhere", "failure", cur.Failure,
				"failed", cur.Failed, "by", cur.By, "target", f.Target)
			return
		}
	}
	if a.claimUnnamed(cur) {
		if err := a.claims.Release(cur.Failure); err != nil {
			a.log.Error("release a claim whose recovery never came", "failure", cur.Failure, "err", err)
			return
		}
		a.log.Warn("claim released: its claimer never sent its recovery here within the time a recovery may take", "failure", cur.Failure,
			"failed", cur.Failed, "by", cur.By, "claimed", cur.At)
		return
	}
	if m, ok := v.Member(cur.Failed); !ok || m.State != ring.StateAlive {
		return
	}
	for _, f := range a.failures.List() {
		// The claimer's own timeline, not one another member sent under the same id (failurelog.Log.Merge).
		if f.ID == cur.Failure && f.Protector == cur.By && f.Done {
			if err := a.claims.Release(cur.Failure); err != nil {
				a.log.Error("release the claim of an abandoned recovery", "failure", cur.Failure, "err", err)
				return
			}
			a.log.Info("claim released: its recovery was abandoned and the node it was for is a member still", "failure", cur.Failure, "failed", cur.Failed)
			return
		}
	}
}

// claimUnnamed says whether cur is older than a recovery may take while no recovery request of it came
// here. A protector sends its recovery request right after its view change, which follows the claim by the
// fence wait; a claim still without one after recoverLimit (by this host's clock) is not a fail-over's, and
// kept, an alive member could hold every ring spare with claims for failures it never declared. Whatever
// the claimer's timeline of it says: one it never finishes (or one that ended before its view change, the
// node failed over by another protector since) kept the spare busy for as long as the claimer lived.
func (a *Agent) claimUnnamed(cur spare.Claim) bool {
	if cur.By == a.cfg.Name || time.Since(cur.At) <= recoverLimit {
		return false
	}
	_, err := os.Stat(recoveryPath(a.cfg.StateDir, cur.Failure))
	return errors.Is(err, fs.ErrNotExist)
}

// prefetchOf names the snapshot each job will be restored from first, and its holder, for the claimed
// spare to fetch while the fence is awaited.
func prefetchOf(jobs []RecoverJob) []spare.Prefetch {
	var out []spare.Prefetch
	for _, j := range jobs {
		if len(j.Candidates) > 0 {
			out = append(out, spare.Prefetch{Job: j.Job, Snapshot: j.Candidates[0].Snapshot, Source: j.Candidates[0].Source})
		}
	}
	return out
}

// idleForRun refuses a run's claim while this node runs or restores jobs. A claim this node served
// earlier (it took a failed node's jobs, which have ended since) is released first once its recovery is
// over: its record here says done, or none came within the time a recovery may take.
func (a *Agent) idleForRun(v ring.View, cl spare.Claim) error {
	running := a.runningJobIDs()
	if busy := a.busy.current(); len(running) > 0 || busy == detect.BusyRestore {
		return fmt.Errorf("%w: %s runs jobs %v (busy %q): a node is a run's spare only while idle", spare.ErrBusy, a.cfg.Name, running, busy)
	}
	cur, ok := a.claims.Current()
	if !ok || cur.Failure == cl.Failure {
		return nil
	}
	if f, known := v.Member(cur.Failed); !known || f.State != ring.StateFailed {
		return nil // still in use: the holder refuses with its reason
	}
	rec, err := loadRecovery(recoveryPath(a.cfg.StateDir, cur.Failure))
	if (err == nil && rec.Done) || (errors.Is(err, fs.ErrNotExist) && time.Since(cur.At) > recoverLimit) {
		if err := a.claims.Release(cur.Failure); err != nil {
			return err
		}
		a.log.Info("earlier claim released: its recovery is over and this node is idle", "failure", cur.Failure, "failed", cur.Failed)
	}
	return nil
}

// lacksConns refuses to restore job from its newest replica when the failed node's last heartbeat said
// that replica (or a newer one) lacked connections the job had opened since (newconns.go): restored, the
// job would connect or accept again while its peers' ends are established, and their next segments would
// be answered with resets; the recovery would seem to succeed while the survivors fail.
func lacksConns(job, newest string, uncovered map[string]string) error {
	lacking, ok := uncovered[job]
	if !ok || newest > lacking {
		return nil
	}
	return fmt.Errorf("job %s not restored: its newest replica %s lacks connections the job opened after it "+
		"(its node's last heartbeat said so; the snapshot that would have held them was not replicated before "+
		"the failure): a restore would reset them under its peers; start the job again", job, newest)
}

// coveringReplicas drops from held (newest first, its first passed lacksConns) the replicas of job that lack
// the connections the failed node's last heartbeat named: the replica it named, and those older. The target
// tries the candidates in order, so one that failed there (a damaged copy, a holder that did not answer)
// had it restore an older replica, which resets connections under its peers, the recovery reported done.
func coveringReplicas(job string, held []heldReplica, uncovered map[string]string) []heldReplica {
	lacking, ok := uncovered[job]
	if !ok {
		return held
	}
	// Compared as lacksConns compares the newest: the ids start with the UTC time of the dump.
	return slices.DeleteFunc(slices.Clone(held), func(h heldReplica) bool { return h.m.ID <= lacking })
}
