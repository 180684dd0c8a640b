package agent

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/ring"
	"golang.org/x/sys/unix"
)

// A job has exactly one live incarnation in the cluster: every restore, manual or automatic, first claims
// the next incarnation of the job from a majority of the non-failed members of this host's view (package
// grant), and a second restore of the same incarnation is refused with where the job runs.

// grantMessage asks a member to grant incarnation Incarnation of Job to Holder, a restore attempt on the
// asking member, or with Release to give it back; grantReply is the answer.
type (
	grantMessage = clusterapi.GrantRequest
	grantReply   = clusterapi.GrantReply
)

// grantTimeout bounds waiting for one member's answer; members are asked at once, so a claim takes at most
// this long (a crashed member that is still in the view costs exactly this).
const grantTimeout = 3 * time.Second

// grantAttempts: a claim that split the members with a concurrent restore of the same incarnation gives
// its grants back and tries again after a random pause, this many times in all.
const grantAttempts = 3

// localGrant answers m for a restore that runs on host (peer, for a member's request).
func (a *Agent) localGrant(m grantMessage, host string) (grantReply, error) {
	now := time.Now()
	if m.Release {
		if err := a.grants.Release(m.Job, m.Incarnation, m.Holder, host, now); err != nil {
			return grantReply{}, err
		}
		a.log.Info("incarnation given back", "job", m.Job, "incarnation", m.Incarnation, "holder", m.Holder, "host", host)
		// Granted says given back (clusterapi.GrantReply): an empty reply is no answer to the asker
		// (answerOf), whose contended claim then never tried again.
		return grantReply{Granted: true}, nil
	}
	_, err := a.grants.Grant(grant.Request{Job: m.Job, Incarnation: m.Incarnation, Holder: m.Holder, Host: host}, now)
	var ce *grant.ConflictError
	switch {
	case errors.As(err, &ce):
		a.log.Warn("incarnation refused", "job", m.Job, "incarnation", m.Incarnation, "holder", m.Holder, "host", host, "held", ce.Record)
		return grantReply{Conflict: &ce.Record}, nil
	case err != nil:
		return grantReply{}, err
	}
	a.log.Info("incarnation granted", "job", m.Job, "incarnation", m.Incarnation, "holder", m.Holder, "host", host)
	return grantReply{Granted: true}, nil
}

// askGrant sends m to member (this host's own registry for itself).
func (a *Agent) askGrant(ctx context.Context, member string, m grantMessage) grant.Answer {
	if member == a.cfg.Name {
		r, err := a.localGrant(m, a.cfg.Name)
		return answerOf(member, r, err)
	}
	qctx, cancel := context.WithTimeout(ctx, grantTimeout)
	defer cancel()
	r, err := a.peers().Grant(qctx, member, m) // the client validates a conflict record from the wire
	return answerOf(member, r, err)
}

// answerOf turns a member's reply (or refusal) into an answer; a conflict record is validated before its
// strings end up in an error message.
func answerOf(member string, r grantReply, err error) grant.Answer {
	switch {
	case err != nil:
		return grant.Answer{Member: member, Err: errors.New(shorten(err.Error(), 300))}
	case r.Conflict != nil:
		if err := r.Conflict.Validate(); err != nil {
			return grant.Answer{Member: member, Err: fmt.Errorf("invalid refusal: %w", err)}
		}
		return grant.Answer{Member: member, Conflict: r.Conflict}
	case r.Granted:
		return grant.Answer{Member: member, Granted: true}
	}
	return grant.Answer{Member: member, Err: errors.New("empty answer")}
}

func shorten(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// grantMembers are the members whose majority decides: the non-failed members of this host's view, this
// host included, without replaced: the node whose snapshot is restored, which the restore presumes gone.
// Counting it as failed also makes a manual restore, whose view may not know of the failure yet, and the
// fail-over, whose view does, count the same members, so that their majorities overlap; and a cluster
// of two can restore the jobs of the one that failed.
func (a *Agent) grantMembers(replaced string) []string {
	out := []string{a.cfg.Name}
	for _, m := range a.View().Members {
		if m.State != ring.StateFailed && m.Name != a.cfg.Name && m.Name != replaced {
			out = append(out, m.Name)
		}
	}
	return out
}

// askAll sends m to every member at once and waits for every answer (each bounded by grantTimeout).
func (a *Agent) askAll(ctx context.Context, members []string, m grantMessage) []grant.Answer {
	answers := make([]grant.Answer, len(members))
	var wg sync.WaitGroup
	for i, name := range members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i] = a.askGrant(ctx, name, m)
		}()
	}
	wg.Wait()
	return answers
}

// newHolder names one restore attempt: what a member records as holding the incarnation.
func newHolder(kind string) string {
	var b [6]byte
	crand.Read(b[:])
	return kind + ":" + hex.EncodeToString(b[:])
}

// claimIncarnation obtains incarnation n of job for holder from a majority of grantMembers(replaced), with
// no member refusing. If it does not win, it gives back what it got and returns an error that wraps
// grant.ErrConflict (with where the job runs) or grant.ErrNoMajority.
func (a *Agent) claimIncarnation(ctx context.Context, job string, n uint64, holder, replaced string) error {
	for attempt := 1; ; attempt++ {
		members := a.grantMembers(replaced)
		t := grant.Count(len(members), a.askAll(ctx, members, grantMessage{Job: job, Incarnation: n, Holder: holder}))
		if t.Won() {
			a.log.Info("incarnation claimed", "job", job, "incarnation", n, "holder", holder,
				"granted_by", t.Granted, "members", len(members), "silent", len(t.Silent))
			return nil
		}
		// Only those that granted hold anything to give back: with none, nil would ask every member, the
		// replaced node among them, whose silence would count as a give-back unanswered and stop the retry.
		answered := len(t.Granted) == 0 || a.giveBack(ctx, job, n, holder, t.Granted)
		err := t.Err(job, n)
		if !t.Contended(n) || attempt == grantAttempts {
			return err
		}
		// A give-back whose answer did not come may still be applied, after the next attempt's grant under
		// the same holder: that member would record the winning grant as given back and grant the
		// incarnation to a rival whose majority meets this one only there.
		if !answered {
			a.log.Warn("incarnation contended, but a give-back went unanswered: not trying again under the same holder",
				"job", job, "incarnation", n, "holder", holder, "err", err)
			return err
		}
		// Two restores split the members and neither won: both give back and try again at random times.
		pause := 200*time.Millisecond + rand.N(600*time.Millisecond)
		a.log.Warn("incarnation contended; trying again", "job", job, "incarnation", n, "holder", holder, "pause", pause, "err", err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (%v)", err, ctx.Err())
		case <-time.After(pause):
		}
	}
}

// giveBack releases incarnation n of job held by holder at members (every non-failed member if nil),
// best effort: a member that misses it keeps refusing others that incarnation, which is safe. It reports
// whether every member answered: a member that did not may still apply the give-back later (it serves
// each request to its end, whether the asker still waits or not), and then releases whatever grant it
// holds for holder.
func (a *Agent) giveBack(ctx context.Context, job string, n uint64, holder string, members []string) (answered bool) {
	if members == nil {
		members = a.grantMembers("")
	}
	if len(members) == 0 {
		return true
	}
	answered = true
	ctx = context.WithoutCancel(ctx) // giving back must not be cut short by the failed restore's context
	for _, ans := range a.askAll(ctx, members, grantMessage{Job: job, Incarnation: n, Holder: holder, Release: true}) {
		if ans.Err != nil {
			answered = false
			a.log.Warn("could not give an incarnation back; that member keeps refusing it to other restores", "job", job,
				"incarnation", n, "member", ans.Member, "err", ans.Err)
		}
	}
	return answered
}

// giveBackUnlessStarted gives incarnation n of j back after a failed restore, unless a process of the job
// may be running on this host (its cgroup is populated, or the restore was cut short while CRIU may still
// be working): then the incarnation stays claimed, and restoring again needs --force.
func (a *Agent) giveBackUnlessStarted(ctx context.Context, j Job, n uint64, holder string, cause error) {
	if ctx.Err() != nil || errors.Is(cause, context.Canceled) || errors.Is(cause, context.DeadlineExceeded) {
		a.log.Warn("restore cut short; the incarnation stays claimed", "job", j.ID, "incarnation", n, "err", cause)
		return
	}
	if populated(j.Cgroup) {
		a.log.Warn("restore failed but the job's cgroup has processes; the incarnation stays claimed", "job", j.ID, "incarnation", n, "cgroup", j.Cgroup)
		return
	}
	a.giveBack(ctx, j.ID, n, holder, nil)
}

// giveBackOrphanClaims gives back, at start, the incarnations this host claimed for restores that left
// nothing here: a previous agent killed between its claim and the restored job's record (or before the
// recovery or migration that claimed could record it) never gave them back, and every later restore of
// the job, a fail-over's included, was refused as if the job ran here. A claim is kept if a record of the
// job here has its incarnation or a newer one (the restore ran), or if the job's cgroup here may have
// processes or a shim of the job runs (CRIU or the job may run without a record). It runs before anything
// can claim again: a resumed migration or a repeated recovery request claims under the same holder, which
// a late give-back would release under it. Best effort: a member that misses it keeps refusing, as before.
func (a *Agent) giveBackOrphanClaims(ctx context.Context) {
	for job, rec := range a.grants.HeldOn(a.cfg.Name) {
		if cur, _, err := a.Job(job, 0); err == nil && cur.Incarnation >= rec.Incarnation {
			continue
		}
		if populated(a.layout().cgroup(job)) {
			a.log.Warn("an incarnation this host claimed has no record of its restore, but the job's cgroup has processes: it stays claimed",
				"job", job, "incarnation", rec.Incarnation, "holder", rec.Holder)
			continue
		}
		if heldOpen(a.shimLog(job)) {
			a.log.Warn("an incarnation this host claimed has no record of its restore, but a shim of the job runs (CRIU may still restore it): it stays claimed",
				"job", job, "incarnation", rec.Incarnation, "holder", rec.Holder, "shim_log", a.shimLog(job))
			continue
		}
		a.log.Warn("giving back an incarnation a previous agent claimed for a restore that left nothing here",
			"job", job, "incarnation", rec.Incarnation, "holder", rec.Holder, "granted", rec.Granted)
		a.giveBack(ctx, job, rec.Incarnation, rec.Holder, nil)
	}
}

// heldOpen reports whether a process of this host has the file at path open (unknown counts as yes). A
// shim holds its job's log open as its standard error for as long as it lives; one that an agent killed
// mid-restore left has CRIU restore the job into a cgroup that stays empty until the tree is forked, and
// the job runs without a record after.
func heldOpen(path string) bool {
	var want unix.Stat_t
	if err := unix.Stat(path, &want); err != nil {
		return !errors.Is(err, unix.ENOENT)
	}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return true
	}
	for _, p := range procs {
		if _, err := strconv.Atoi(p.Name()); err != nil {
			continue
		}
		dir := filepath.Join("/proc", p.Name(), "fd")
		fds, err := os.ReadDir(dir) // a process gone meanwhile has none
		if err != nil {
			continue
		}
		for _, fd := range fds {
			var st unix.Stat_t
			if unix.Stat(filepath.Join(dir, fd.Name()), &st) == nil && st.Dev == want.Dev && st.Ino == want.Ino {
				return true
			}
		}
	}
	return false
}

// populated reports whether a cgroup v2 directory (or its subtree) has processes; unknown counts as yes.
func populated(cgroup string) bool {
	if cgroup == "" {
		return true
	}
	b, err := os.ReadFile(filepath.Join(cgroup, "cgroup.events"))
	if errors.Is(err, os.ErrNotExist) {
		return false
	}
	if err != nil {
		return true
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "populated "); ok {
			return v != "0"
		}
	}
	return true
}
