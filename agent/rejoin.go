package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/shim"
)

// A failed host comes back (repaired and booted, or cut off and reconnected): its agent finds itself
// failed in the view. The jobs it ran were restored elsewhere by its protector (a majority granted them a
// higher incarnation), or wait there for `ftctl restore`: the copies this host may still have records of
// must never run again, so the agent drops them and removes what is left of them here. Once it runs
// nothing, it asks an alive node of the ring to admit it back, as a spare under its next member
// incarnation (ring.View.Rejoin), which the node validates, puts in a new view and pushes to everyone.
//
// The agent asks (the ring does not admit a host on its first heartbeat): heartbeats go only to the ring
// successor and say nothing about whether the host dropped its old jobs, and a failed member must not
// become a member again by merely being heard. The request is authenticated (the member's certificate),
// checked against the admitting node's own view, and answered only once the host proved idle.

// rejoinPeriod is how often a failed agent checks whether it may rejoin, and asks.
const rejoinPeriod = time.Second

// rejoinTimeout bounds one request: the admitting node pings this host back before it answers.
const rejoinTimeout = 15 * time.Second

// watchRejoin drops the jobs of this host's failed incarnation and asks to rejoin, for as long as the view
// lists this host as failed.
func (a *Agent) watchRejoin(ctx context.Context) {
	last := ""
	tickgrid.Every(ctx, rejoinPeriod, func() {
		self, ok := a.View().Member(a.cfg.Name)
		if !ok || self.State != ring.StateFailed {
			last = ""
			return
		}
		if left := a.dropFailedJobs(self); left > 0 {
			return // reported; tried again next time
		}
		err := a.askRejoin(ctx, self.Incarnation)
		if err == nil {
			last = ""
			return
		}
		// Refusals repeat every second until the cause goes (a recovery of this host's jobs ends): log
		// each cause once.
		if msg := err.Error(); msg != last {
			a.log.Warn("rejoin as a spare not possible yet; asking again", "incarnation", self.Incarnation, "err", err)
			last = msg
		}
	})
}

// dropFailedJobs ends every job this host still has as running while the view lists it as failed: the
// cluster has given them to another host (or to the operator). A copy still running (a host that was
// cut off and did not fence itself) is killed; the records say lost, so that their job addresses are not
// handed out again (addressHeld: the moved copies hold them), and their job networks and cgroups go. It
// returns how many jobs it could not end.
func (a *Agent) dropFailedJobs(self ring.Member) int {
	left := 0
	var running []Job
	for _, j := range a.Jobs(0) {
		if j.State == JobRunning {
			running = append(running, j)
		}
	}
	// Every job address off the wire first, as a self-fence does: this host reaches its peers again (it
	// learnt the view from one), and a killed copy's sockets would send their FIN or reset to peers whose
	// connections the restored copies go on with.
	for _, j := range running {
		a.withdrawJobNet(context.Background(), j.ID, j.Net)
	}
	for _, j := range running {
		if a.ownCopyRuns(j) {
			// Its root is the init of the job's PID namespace: the kernel kills the whole namespace with it.
			// Not the cgroup: on hosts that share a kernel (the lab) it is the restored copy's too.
			a.supersede(j) // the job goes on elsewhere: this kill is not its end
			if err := shim.Signal(j.PID, j.Cgroup, unix.SIGKILL); err != nil && !errors.Is(err, shim.ErrJobGone) {
				a.log.Error("this host was declared failed and its job restored elsewhere, but its copy here could not be killed", "job", j.ID, "pid", j.PID, "err", err)
				left++
				continue
			}
		}
		a.log.Warn("dropping a job of this host's failed incarnation: the cluster declared this host failed and its protector restored the job elsewhere (or keeps its replica for ftctl restore); its copy here never runs again",
			"job", j.ID, "job_incarnation", j.Incarnation, "member_incarnation", self.Incarnation, "restored_on", a.restoredOn(j.ID))
		a.markFenced(j.ID)
		a.finishRunning(j.ID, JobLost, nil)
	}
	return left
}

// restoredOn is the host that the newest known failure of this host restored job on ("" if unknown, or if
// that recovery says it failed to restore the job: then it runs nowhere, and its owner may restore it).
func (a *Agent) restoredOn(job string) string {
	target, failed := a.recoveredTo(job)
	if failed {
		return ""
	}
	return target
}

// recoveredTo is the target of the newest known failure of this host that was to restore job ("" if none),
// and whether that recovery's stages say the job was not restored there (its fetch, rewrite or restore
// failed). A recovery of many jobs keeps only its newest stages (failurelog.MaxStages): one whose stages
// say nothing of the job counts as restored, as before.
func (a *Agent) recoveredTo(job string) (target string, failed bool) {
	var best *Failure
	for _, f := range a.failures.List() {
		if f.Node != a.cfg.Name || f.Target == "" {
			continue
		}
		for _, id := range f.Jobs {
			if id == job && (best == nil || f.Detected.After(best.Detected)) {
				best = f
			}
		}
	}
	if best == nil {
		return "", false
	}
	failed = slices.ContainsFunc(best.Stages, func(s Stage) bool {
		return s.Job == job && s.Error != "" && (s.Name == StageFetched || s.Name == StageRewritten || s.Name == StageRestored)
	})
	return best.Target, failed
}

// ownCopyRuns reports whether this host's copy of job j runs: its root process (j.PID) is alive, in the
// job's cgroup, and in this host's network namespace or the job network this host made for it. The PID
// alone does not tell: it may have been reused.
func (a *Agent) ownCopyRuns(j Job) bool {
	if j.PID <= 0 || j.Cgroup == "" {
		return false
	}
	in, err := cgroupv2.Of(j.PID)
	if err != nil {
		return false // gone
	}
	if want, err := cgroupv2.HierarchyPath(j.Cgroup); err != nil || in != want {
		return false
	}
	var want, got unix.Stat_t
	ns := "/proc/self/ns/net"
	if j.Net != nil {
		ns = jobnet.Path(jobNetName(a.cfg.Name, j.ID))
	}
	if unix.Stat(fmt.Sprintf("/proc/%d/ns/net", j.PID), &got) != nil {
		return false
	}
	if err := unix.Stat(ns, &want); err != nil {
		if j.Net != nil && errors.Is(err, unix.ENOENT) && inUnnamedNetns(got) {
			// The network's name is gone (`ip netns del`, a cleanup script), not the network: the job's
			// processes hold it, its address still on the wire. A live process in this agent's own cgroup
			// for the job, in a network of no name, is this host's copy.
			a.log.Warn("a job's network has lost its name; its processes, in the job's cgroup, still hold it", "job", j.ID, "net", jobNetName(a.cfg.Name, j.ID), "pid", j.PID)
			return true
		}
		return false
	}
	return want.Dev == got.Dev && want.Ino == got.Ino
}

// inUnnamedNetns reports whether the network namespace ns is neither this host's nor one of those named in
// /run/netns (another job's, another lab host's).
func inUnnamedNetns(ns unix.Stat_t) bool {
	same := func(p string) bool {
		var st unix.Stat_t
		return unix.Stat(p, &st) == nil && st.Dev == ns.Dev && st.Ino == ns.Ino
	}
	if same("/proc/self/ns/net") {
		return false
	}
	named, _ := filepath.Glob(jobnet.Path("*"))
	return !slices.ContainsFunc(named, same)
}

// finishRunning finishes job id if it is still running (watchJobs may have finished it meanwhile).
func (a *Agent) finishRunning(id string, state JobState, st *shim.ExitStatus) {
	a.mu.Lock()
	j, ok := a.byID[id]
	running := ok && j.State == JobRunning
	a.mu.Unlock()
	if running {
		a.finish(j, state, st)
	}
}

// settleGone finishes a job record a previous agent left as running whose copy does not run here
// (ownCopyRuns): the host restarted, or the job was killed, while no agent ran. Its exit record says how it ended, if it
// wrote one here; otherwise it is lost. Adopting it instead would let a reused PID pass for the job.
func (a *Agent) settleGone(j *Job) {
	st, err := shim.ReadExit(j.ExitPath())
	if err == nil && (st.Node == "" || st.Node == a.cfg.Name) && !st.Older(j.Incarnation) {
		a.log.Info("a job ended while no agent ran", "job", j.ID)
		a.finish(j, JobExited, st)
		return
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		a.log.Warn("unreadable exit record", "job", j.ID, "err", err)
	}
	if err == nil && st.Older(j.Incarnation) {
		a.log.Warn("the job's directory holds the exit record of an older copy of the job, superseded, whose shim recorded its kill: not this copy's end",
			"job", j.ID, "incarnation", j.Incarnation, "record_incarnation", *st.Incarnation, "node", st.Node, "code", st.Code)
	}
	a.log.Warn("a job's processes are gone since the previous agent stopped (the host restarted, or they were killed); not adopting it", "job", j.ID)
	a.finish(j, JobLost, nil)
}

// askRejoin asks the alive nodes of the ring, in ring order, to admit this host back; the first that
// does answers with the new view, which is adopted.
func (a *Agent) askRejoin(ctx context.Context, incarnation uint64) error {
	var errs []error
	for _, m := range a.View().Ring() {
		if m.Name == a.cfg.Name {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, rejoinTimeout)
		in, err := a.peers().Rejoin(rctx, m.Name, clusterapi.RejoinRequest{Incarnation: incarnation})
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.Name, err))
			continue
		}
		v, err := ring.Decode(in.View)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s answered with a view that is refused: %w", m.Name, err))
			continue
		}
		if self, ok := v.Member(a.cfg.Name); !ok || self.State != ring.StateAlive || self.Incarnation <= incarnation {
			errs = append(errs, fmt.Errorf("%s answered with view %d, in which this host did not rejoin", m.Name, v.Epoch))
			continue
		}
		if _, err := a.adoptPeerView(m.Name, v); err != nil {
			return err
		}
		if err := a.mergeWireFailures(m.Name, in.Failures); err != nil {
			a.log.Warn("failure timelines from peer refused", "peer", m.Name, "err", err)
		}
		a.log.Info("rejoined the cluster as a spare", "admitted_by", m.Name, "epoch", v.Epoch, "incarnation", incarnation+1)
		return nil
	}
	if len(errs) == 0 {
		return errors.New("no alive node in this host's view to ask")
	}
	return errors.Join(errs...)
}

// serveRejoin admits peer back as a spare: this host must be an alive node of the ring; peer a member its
// view lists as failed as the incarnation it says (its certificate proved its name); no recovery of its
// jobs may still be under way; and peer must run no job. The new view is pushed to every member.
func (a *Agent) serveRejoin(ctx context.Context, peer string, req clusterapi.RejoinRequest) (viewMessage, error) {
	refuse := func(format string, args ...any) (viewMessage, error) {
		err := fmt.Errorf("rejoin of %s refused by %s: "+format, append([]any{peer, a.cfg.Name}, args...)...)
		a.log.Warn("rejoin refused", "peer", peer, "err", err)
		return viewMessage{}, &clusterapi.Error{Code: clusterapi.CodeRefused, Message: err.Error()}
	}
	v := a.View()
	if self, ok := v.Member(a.cfg.Name); !ok || self.Role != ring.RoleNode || self.State != ring.StateAlive {
		return refuse("only an alive node of the ring admits a member back, and this host is %s %s", self.State, self.Role)
	}
	m, ok := v.Member(peer)
	switch {
	case !ok:
		return refuse("not a member in view %d (a new host joins with ftctl spare add)", v.Epoch)
	case m.State == ring.StateAlive && m.Incarnation == req.Incarnation+1:
		return a.viewMessage(), nil // admitted already: a retried request
	case m.State != ring.StateFailed || m.Incarnation != req.Incarnation:
		return refuse("view %d lists it %s as incarnation %d, not failed as incarnation %d", v.Epoch, m.State, m.Incarnation, req.Incarnation)
	}
	if id, ok := a.recoveryUnderWay(peer); ok {
		return refuse("the recovery of its jobs (failure %s) is not over", id)
	}
	pctx, cancel := context.WithTimeout(ctx, rejoinTimeout/2)
	r, err := a.peers().Ping(pctx, peer)
	cancel()
	if err != nil {
		return refuse("it does not answer a ping at %s: %v", m.Address, err)
	}
	if len(r.Jobs) > 0 {
		return refuse("it runs jobs %v: a spare must be idle (its agent drops the jobs of its failed incarnation first)", r.Jobs)
	}
	nv, err := a.updateView(func(cur ring.View) (ring.View, error) { return cur.Rejoin(peer, req.Incarnation) })
	if err != nil {
		return refuse("%v", err)
	}
	a.log.Info("member rejoined as a spare", "member", peer, "incarnation", req.Incarnation+1, "epoch", nv.Epoch)
	go func() {
		a.pushView(ctx)
		// A view of the same epoch made elsewhere meanwhile may win the tie-break, peer failed in it again:
		// nobody pushes views to a failed member, and peer, an alive spare in the view it was answered with,
		// never asks again. Admitted again onto the winner, as a protector keeps a failure (keepFailedInView).
		a.keepRejoinedInView(ctx, peer, req.Incarnation)
	}()
	return a.viewMessage(), nil
}

// keepRejoinedInView makes sure, for keepFailedFor, that the views keep peer, admitted back here after it
// failed as incarnation inc, rejoined: at once (the push of its rejoin may have brought back a view that
// won the tie-break), then every keepFailedEvery.
func (a *Agent) keepRejoinedInView(ctx context.Context, peer string, inc uint64) {
	for end := time.Now().Add(keepFailedFor); time.Now().Before(end); {
		if a.reassertRejoined(ctx, peer, inc) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(keepFailedEvery):
		}
	}
}

// reassertRejoined admits peer back again if the current view lists it failed as incarnation inc (its
// rejoin's view lost a tie-break), and pushes the result; it reports whether it had to and could.
func (a *Agent) reassertRejoined(ctx context.Context, peer string, inc uint64) bool {
	if m, ok := a.View().Member(peer); !ok || m.State != ring.StateFailed || m.Incarnation != inc {
		return false
	}
	nv, err := a.updateView(func(cur ring.View) (ring.View, error) { return cur.Rejoin(peer, inc) })
	if err != nil {
		a.log.Error("a member admitted back here is failed again in the view (another view of the same epoch won), and could not be admitted again", "member", peer, "err", err)
		return false
	}
	a.log.Warn("a member admitted back here was failed again in the view (another view of the same epoch won): admitted again", "member", peer, "epoch", nv.Epoch)
	a.pushView(ctx)
	return true
}

// recoveryUnderWay names a failure of member whose recovery is not over, as this host knows of it; one
// this host learned of longer ago than a recovery may take is over, whatever its record says (its
// coordinator is gone). The age is measured on this host's clock from when the timeline reached it
// (Received), not from its Detected: that is the protector's wall clock, and a protector half an hour
// behind had the member admitted back while its jobs were being restored.
func (a *Agent) recoveryUnderWay(member string) (string, bool) {
	for _, f := range a.failures.List() {
		if f.Node == member && !f.Done && time.Since(f.Received) < recoverLimit {
			return f.ID, true
		}
	}
	return "", false
}

// updateView applies change to the current view and adopts the result, under the view's lock: no other
// view slips in between (change sees the view it replaces).
func (a *Agent) updateView(change func(ring.View) (ring.View, error)) (ring.View, error) {
	a.members.mu.Lock()
	defer a.members.mu.Unlock()
	nv, err := change(a.members.view)
	if err != nil {
		return ring.View{}, err
	}
	if err := ring.Save(a.members.path, nv); err != nil {
		return ring.View{}, fmt.Errorf("save membership view: %w", err)
	}
	a.installView(nv)
	return nv, nil
}
