package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/fence"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/ring"
)

// Self-fencing: a node cut off from the ring (not dead) still runs its jobs, while its protector restores
// them on a spare. So a node that has heard from neither ring neighbour for fence_timeout kills its jobs;
// the protector lets the restored copies go live only after fence_timeout plus a margin (fence.Timing), or
// once a fence command confirmed this host is off. The node keeps its cluster address: fail-over moves a
// host's address for jobs without one of their own, and the agent needs it to rejoin and learn that it was
// replaced. A job with a job address (Job.Net) loses its network too once it is killed: its address leaves
// the wire at once (jobnet.Delete removes the interface first), ready to come up on the spare.

// StageSelfFenced names the one stage of a self-fence event in the failure log (ftctl events).
const StageSelfFenced = "self-fenced"

// contactClock holds when this node last reached its protector, on the monotonic clock.
type contactClock struct {
	mu   sync.Mutex
	name string // the protector the time belongs to
	at   time.Time
}

func (c *contactClock) set(name string, at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.name != name || at.After(c.at) {
		c.name, c.at = name, at
	}
}

func (c *contactClock) get(name string) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.name != name {
		return time.Time{}
	}
	return c.at
}

// selfFence checks, every fence.Timing.Check, whether this node is cut off: whether it heard from its
// predecessor (its beats) or reached its protector (which acknowledged its own beats) within the fence
// timeout; and, if it heard only one of them (in a ring of two, if its protector is silent), whether it
// reaches a majority of the other members.
func (a *Agent) selfFence(ctx context.Context) {
	t := a.cfg.FenceTiming()
	var prot contactClock
	var (
		silence neighbourSilence
		members askedMembers
		told    time.Time // where the protector's silence last logged as keeping this node's jobs began
		fenced  bool
		// tried holds the jobs the fence killed (zero), and those whose kill failed with when to try again:
		// the protector restores them elsewhere whatever happened here.
		tried map[string]time.Time
	)
	// A restarted agent goes on with the silence its previous process measured (this boot's only): the
	// protector waits from the last beat it received, not from this process's start. The time it was away
	// counts as a stall of its own (the vouch below): it heard nobody then, and nobody may have declared it.
	contact := newContactStore(filepath.Join(a.cfg.StateDir, fenceContactFile))
	var restarted time.Time
	if w, err := contact.load(time.Now()); err != nil {
		a.log.Warn("self-fence: the silence counts from this agent's start", "err", err)
	} else if !w.heard.IsZero() {
		silence, restarted = w, time.Now()
		a.log.Info("self-fence: going on with the silence the previous agent measured", "since_ms", time.Since(w.heard).Milliseconds())
	}
	tickgrid.Every(ctx, t.Check(), func() {
		now := time.Now()
		a.loops.Mark(loopSelfFence, now)
		v := a.View()
		p, okP := v.Protector(a.cfg.Name)
		s, okS := v.Predecessor(a.cfg.Name)
		// In a ring of two nodes, losing the only neighbour cannot be told from its failure by the ring alone:
		// with other members (spares), they tell, as when only the protector is silent (below); with none,
		// fencing would kill the survivor's jobs too, and a fence command covers such rings.
		two := okP && okS && p.Name == s.Name
		if !okP || !okS || two && len(a.grantMembers(a.cfg.Name)) <= 2 {
			silence = neighbourSilence{}
			a.selfFenced.Store(false)
			return
		}
		// The contact counts from when the newest beat the protector's host acknowledged was sent: the link
		// was up then or later, which is what the protector's wait (from the last beat it received) assumes.
		if to, at, ok := a.beating.last(); ok {
			prot.set(to, at)
		}
		c := fence.Contact{Protector: prot.get(p.Name)}
		if _, at, ok := a.watchdog.Last(s.Name); ok {
			c.Predecessor = at
		}
		d, protSilence, predSilence, fresh := silence.check(now, p.Name, s.Name, c, t.Timeout)
		if fresh {
			fenced = false
		}
		if err := contact.save(now, silence); err != nil {
			a.log.Warn("self-fence", "err", err)
		}
		// In a ring of two, the protector is the predecessor too: its silence alone is no isolation. A vouch
		// is awaited from the last contact with the protector (from, or c.Protector if later), which is what
		// its ReadyAt counts from: not from a later one with the predecessor (silence.since after a change of
		// neighbours or a restart), which held the kill past it.
		cut, quiet, from := d.Fence && !two, d.Silence, silence.protSince
		cause := fmt.Sprintf("no contact with %s and %s for %s", p.Name, s.Name, d.Silence.Round(time.Millisecond))
		// The one neighbour silent while the other is heard: the protector, or the predecessor. The first node
		// of a segment cut off hears its protector (the segment's next node) and not its predecessor: the far
		// side replaces that protector, which fenced, and the new one there declares this node.
		lone, role, loneName, loneHeard := protSilence, "protector", p.Name, silence.protHeard
		if !two && predSilence > protSilence {
			lone, role, loneName, loneHeard = predSilence, "predecessor", s.Name, silence.predHeard
		}
		if !cut && (two || d.Silence < lone) && lone >= t.AskMembersAfter(a.cfg.ProbeTimeout()) {
			// Only one neighbour is silent: a partition that cuts off two or more neighbours of the ring leaves
			// each hearing one, and the far side declares this node if it holds a majority. In a ring of two,
			// the protector and the spares declare it if it reaches too few of them.
			members.ask(ctx, a, now.Add(-min(a.cfg.ProbeTimeout(), lone)))
			switch ans, ok := members.since(now.Add(-lone)); {
			case !ok && fenced && lone >= t.Timeout:
				// Fenced on both silences, and one neighbour is back: no question went out while both were
				// silent, so the fence holds until the members answer (unfenced, jobs could start here meanwhile).
				cut, quiet, from = true, lone, silence.protSince
				cause = fmt.Sprintf("no contact with its %s %s for %s, the other members not answered yet", role, loneName, lone.Round(time.Millisecond))
			case !ok || lone < t.Timeout:
			case ans.minority():
				cut, quiet, from = true, lone, silence.protSince
				cause = fmt.Sprintf("no contact with its %s %s for %s, and no answer from %d of the %d other members (%s): their side may declare this node failed",
					role, loneName, lone.Round(time.Millisecond), len(ans.silent), ans.others, strings.Join(ans.silent, "; "))
			case !loneHeard.Equal(told):
				told = loneHeard // once a silence: questions go out while it lasts
				msg := "no contact with the protector for fence_timeout, but this node reaches a majority of the other members: not fencing (the protector failed, or is the one cut off)"
				if role == "predecessor" {
					msg = "no contact with the predecessor for fence_timeout, but this node reaches a majority of the other members: not fencing (the predecessor failed, or is the one cut off)"
				}
				a.log.Warn(msg, "protector", p.Name, "predecessor", s.Name, "silence_ms", lone.Milliseconds(), "others", ans.others, "silent", ans.silent)
			}
		}
		if !cut {
			a.selfFenced.Store(false)
			if fenced {
				// Rejoin: learn at once whether this node was replaced while away (its neighbours do not
				// push views to a failed member, and its own watchdog finds nothing to confirm). In the background:
				// an exchange with a member that does not answer takes its timeout (3 s and more), and cut off
				// again meanwhile, this node must still fence by fence_timeout.
				a.log.Info("contact with the ring is back after self-fencing; exchanging views", "protector", p.Name, "predecessor", s.Name)
				go a.pushView(ctx)
			}
			fenced = false
			return
		}
		if fenced {
			// Still cut off: a job that runs here since the fence (a restore or a start that began before
			// it) goes too; the protector counts every copy here as gone.
			var late []Job
			for _, j := range a.runningJobs() {
				if at, ok := tried[j.ID]; !ok || !at.IsZero() && !now.Before(at) {
					late = append(late, j)
				}
			}
			_, failed := a.fenceJobs(late, quiet, cause+"; the jobs began to run after this host fenced itself, or their kill failed before")
			tried = triedJobs(tried, late, failed, now)
			return
		}
		// Only a host with jobs fences (and records it): a spare or an idle node has nothing to run twice.
		running := a.runningJobs()
		if len(running) == 0 {
			return
		}
		if a.stalls.Since(now.Add(-quiet), now) || restarted.After(now.Add(-quiet)) {
			// This agent stalled within the silence (a starved or paused host, or it was restarted within it):
			// the silence may be its own absence only, as when a whole machine or cluster pauses. Its protector
			// knows whether it declared this node failed (and refuses to vouch then), and a stalled protector
			// declared nobody.
			sent := time.Now()
			vouched, reason := a.askVouch(ctx, p.Name, t.VouchBy(sent, from, c.Protector))
			if vouched {
				a.log.Warn("cut off for fence_timeout, but this agent stalled meanwhile and its protector vouches for it: not fencing",
					"cause", cause, "vouch_ms", time.Since(sent).Milliseconds())
				prot.set(p.Name, sent)
				return
			}
			cause += "; this agent stalled meanwhile, and " + reason
		}
		var failed []string
		fenced, failed = a.fenceJobs(running, quiet, cause)
		a.selfFenced.Store(fenced)
		tried = triedJobs(map[string]time.Time{}, running, failed, now)
	})
}

// triedJobs records in tried the jobs a fence just went through: killed (zero), or, those in failed, to be
// tried again a kill bound later (each try is an event: not at every check).
func triedJobs(tried map[string]time.Time, jobs []Job, failed []string, now time.Time) map[string]time.Time {
	for _, j := range jobs {
		tried[j.ID] = time.Time{}
	}
	for _, id := range failed {
		tried[id] = now.Add(fence.KillBound)
	}
	return tried
}

// neighbourSilence measures how long this node has heard from neither ring neighbour, and from its
// protector, across changes of neighbours: new ones are no contact yet, so the silence goes on from the last
// contact with the old ones. The protector that declares this node waits from the last beat it received
// (fence.Timing.ReadyAt), and a node cut off from its neighbours may still adopt a view, from a member it
// reaches, in which one of them failed: restarting the silence there fenced it up to fence_timeout after its
// copies elsewhere went live.
type neighbourSilence struct {
	prot, pred string
	since      time.Time // when watching began, or the last contact before the neighbours changed
	heard      time.Time // the last contact with either neighbour (or since), as of the last check
	protSince  time.Time // as since, for the protector alone
	protHeard  time.Time // as heard, for the protector alone
	predSince  time.Time // as since, for the predecessor alone
	predHeard  time.Time // as heard, for the predecessor alone
}

// check decides at now, with neighbours prot and pred last heard at c, and returns how long the protector
// alone, and the predecessor alone, have been silent; fresh: nothing was measured before (the first check,
// or the first since the ring had no two neighbours), so the silences start now.
func (w *neighbourSilence) check(now time.Time, prot, pred string, c fence.Contact, timeout time.Duration) (d fence.Decision, protSilence, predSilence time.Duration, fresh bool) {
	if prot != w.prot || pred != w.pred {
		w.prot, w.pred, w.since, w.protSince, w.predSince = prot, pred, w.heard, w.protHeard, w.predHeard
		if w.since.IsZero() {
			w.since, w.protSince, w.predSince, fresh = now, now, now, true
		}
		if w.predSince.IsZero() {
			w.predSince = w.since
		}
	}
	d = fence.Decide(now, w.since, c, timeout)
	w.heard = now.Add(-d.Silence)
	w.protHeard = w.protSince
	if c.Protector.After(w.protHeard) {
		w.protHeard = c.Protector
	}
	w.predHeard = w.predSince
	if c.Predecessor.After(w.predHeard) {
		w.predHeard = c.Predecessor
	}
	return d, now.Sub(w.protHeard), now.Sub(w.predHeard), fresh
}

// askedMembers is what this node found when it last asked whether it reaches the other members, while its
// protector was silent (a question at a time).
type askedMembers struct {
	mu     sync.Mutex
	asking bool
	last   membersAnswer
}

// membersAnswer is one such question's outcome.
type membersAnswer struct {
	at     time.Time // when the pings went out
	others int       // the non-failed members but this node
	silent []string  // those that did not answer, with why
}

// minority reports whether the members that did not answer are a majority of the others: on the far side of
// a partition, they may declare this node failed (its protector's claim of the jobs' next incarnation needs
// a majority of them) and restore its jobs.
func (m membersAnswer) minority() bool { return len(m.silent) >= grant.Majority(m.others) }

// ask pings the other members in the background, unless a question is out already or one went out after
// since (the caller's: a probe timeout ago, or when the protector's silence began if later; so each member
// is pinged at most once a probe timeout while the silence lasts).
func (q *askedMembers) ask(ctx context.Context, a *Agent, since time.Time) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.asking || q.last.at.After(since) {
		return
	}
	q.asking = true
	go func() {
		others := a.grantMembers(a.cfg.Name)[1:]
		at := time.Now()
		silent := a.silentMembers(ctx, others)
		q.mu.Lock()
		defer q.mu.Unlock()
		q.asking, q.last = false, membersAnswer{at: at, others: len(others), silent: silent}
	}()
}

// since returns the newest answer to a question asked after t.
func (q *askedMembers) since(t time.Time) (membersAnswer, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.last, q.last.at.After(t)
}

// refuseWhileFenced refuses to start or restore a job while this host is fenced (selfFenced).
func (a *Agent) refuseWhileFenced() error {
	if a.selfFenced.Load() {
		return errors.New("this host fenced itself: it is cut off from its ring neighbours, whose protector restores its jobs elsewhere; nothing starts here until contact is back")
	}
	return nil
}

// runningJobs lists this host's running jobs.
func (a *Agent) runningJobs() []Job {
	var running []Job
	for _, j := range a.Jobs(0) {
		if j.State == JobRunning {
			running = append(running, j)
		}
	}
	return running
}

// runningJobIDs lists the ids of this host's running jobs.
func (a *Agent) runningJobIDs() []string {
	var ids []string
	for _, j := range a.runningJobs() {
		ids = append(ids, j.ID)
	}
	return ids
}

// askVouch asks protector, by deadline, whether it still holds this node alive (OpVouch); false comes
// with why not, as a clause for the fence event's detail.
func (a *Agent) askVouch(ctx context.Context, protector string, deadline time.Time) (bool, string) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	r, err := a.peers().Vouch(ctx, protector, clusterapi.VouchRequest{Incarnation: a.incarnationOf(a.cfg.Name)})
	switch {
	case err != nil:
		a.metrics.Vouch("unanswered")
		return false, fmt.Sprintf("%s did not vouch for it in time: %v", protector, err)
	case !r.Member:
		a.metrics.Vouch("refused")
		return false, fmt.Sprintf("%s refused to vouch for it: %s", protector, r.Why)
	}
	a.metrics.Vouch("vouched")
	return true, ""
}

// serveVouch answers peer, back from a stall of its own with both ring neighbours silent for its fence
// timeout, whether this node, its protector, still holds it alive; yes binds this node not to declare it
// failed on the silence before (declaredFailed), and its silence counts from now.
func (a *Agent) serveVouch(peer string, req clusterapi.VouchRequest) clusterapi.VouchReply {
	v := a.View()
	no := func(format string, args ...any) clusterapi.VouchReply {
		why := fmt.Sprintf(format, args...)
		a.log.Warn("not vouching for a member back from a stall", "member", peer, "why", why)
		return clusterapi.VouchReply{Why: why}
	}
	if m, ok := v.Member(peer); !ok || m.State != ring.StateAlive || m.Incarnation != req.Incarnation {
		return no("view %d does not list it alive as incarnation %d", v.Epoch, req.Incarnation)
	}
	if pred, ok := v.Predecessor(a.cfg.Name); !ok || pred.Name != peer {
		return no("in view %d this node does not watch it", v.Epoch)
	}
	now := time.Now()
	if err := a.declared.vouch(peer, req.Incarnation, now); err != nil {
		return no("%v", err)
	}
	a.watchdog.Clear(peer, now)
	a.log.Warn("vouched for the predecessor: back from a stall of its own, it had heard from neither ring neighbour for its fence timeout",
		"member", peer, "incarnation", req.Incarnation)
	return clusterapi.VouchReply{Member: true}
}

// fenceJobs kills the running jobs of this host (their whole cgroups) and records the fence as an event,
// cause (what cut the host off, for silence) its detail. It reports whether there was any job to kill, and
// which of them it could not kill.
func (a *Agent) fenceJobs(running []Job, silence time.Duration, cause string) (fenced bool, failed []string) {
	start := time.Now()
	if len(running) == 0 {
		return false, nil
	}
	// Every job address off the wire first: the killed jobs' sockets then send nothing (no FIN, no reset) to
	// peers this host may still reach (cut off from the agents only), whose connections the jobs' copies
	// restored elsewhere go on with.
	for _, j := range running {
		a.withdrawJobNet(context.Background(), j.ID, j.Net)
	}
	var killed []string
	for _, j := range running {
		a.supersede(j) // the job goes on elsewhere: this kill is not its end
		if err := a.killCgroup(j.ID); err != nil {
			failed = append(failed, j.ID)
			a.log.Error("self-fence: could not kill job", "job", j.ID, "err", err)
			continue
		}
		killed = append(killed, j.ID)
		a.markFenced(j.ID)
		if j.Net != nil {
			a.deleteJobNet(context.Background(), j.ID, j.Net)
		}
	}
	detail := fmt.Sprintf("%s; killed jobs %s", cause, strings.Join(killed, " "))
	a.log.Error("self-fenced: cut off from the ring; the protector restores the jobs elsewhere",
		"cause", cause, "silence_ms", silence.Milliseconds(), "killed", killed, "failed", failed)
	id := a.cfg.Name + "-fenced-" + start.UTC().Format("20060102T150405.000")
	a.failures.Update(id, func(f *Failure) {
		// LastBeat is the last contact with either neighbour: the timeline counts from it, as a recovery's
		// counts from the failed node's last heartbeat.
		// Jobs lists the ones not killed too: the error names them, and a user sees the error only of an
		// event all of whose jobs are theirs (failuresFor).
		f.Node, f.Protector, f.LastBeat, f.Detected, f.Jobs, f.Done = a.cfg.Name, a.cfg.Name, start.Add(-silence), start, slices.Concat(killed, failed), true
		st := Stage{Name: StageSelfFenced, Host: a.cfg.Name, Start: start.Add(-silence), End: time.Now(), Detail: detail}
		if len(failed) > 0 {
			st.Error = "could not kill " + strings.Join(failed, " ")
			f.Error = st.Error
		}
		f.Stages = append(f.Stages, st)
	})
	a.saveFailures()
	return true, failed
}

// markFenced records in job id's record that its copy here was killed because it goes on elsewhere (Job.Fenced).
func (a *Agent) markFenced(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	j, ok := a.byID[id]
	if !ok {
		return
	}
	j.Fenced = true
	if err := a.jobs.save(j); err != nil {
		a.log.Error("save job record", "job", id, "err", err)
	}
}

// killCgroup SIGKILLs every process of job id's cgroup at once (cgroup.kill), the agent's own cgroup for
// the job and never a path from the job's record.
func (a *Agent) killCgroup(id string) error {
	if !validJobID(id) {
		return fmt.Errorf("job id %q is not one this agent makes", id)
	}
	p := filepath.Join(a.layout().cgroup(id), "cgroup.kill")
	f, err := os.OpenFile(p, os.O_WRONLY|unix.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // the job's cgroup is gone: nothing runs in it
	}
	if err != nil {
		return fmt.Errorf("open %s (cgroup v2 with cgroup.kill, Linux 5.14 or newer, is required): %w", p, err)
	}
	defer f.Close()
	if _, err := f.WriteString("1"); err != nil {
		return fmt.Errorf("kill job cgroup %s: %w", p, err)
	}
	return nil
}
