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

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/ring"
)

// A coordinator follows a recovery on its target through the progress stream; when that stream breaks
// (the target's agent restarted mid-way and resumes it, resume.go), it asks the target what became of it.

// recoveryStatusMessage is the target's answer about a recovery, its stages decoded.
type recoveryStatusMessage struct {
	Failure string
	Known   bool
	Done    bool
	Resumed bool
	Error   string
	Stages  []Stage
	Running []string // the asked-about jobs that run there
}

// serveRecoveryStatus answers a member's question about a recovery this host was the target of (it
// knows only those peer coordinated) and the failure's jobs (the protocol bounds the list).
func (a *Agent) serveRecoveryStatus(peer string, q clusterapi.RecoveryStatusRequest) clusterapi.RecoveryStatusReply {
	reply := clusterapi.RecoveryStatusReply{Failure: q.Failure}
	var stages []Stage
	if validRecoveryID(q.Failure) {
		if rec, err := loadRecovery(recoveryPath(a.cfg.StateDir, q.Failure)); err == nil && rec.Coordinator == peer {
			reply.Known, reply.Done, reply.Resumed, reply.Error = true, rec.Done, rec.Resumed, shorten(rec.Error, maxStatusError)
			stages = rec.Stages
		}
	}
	for _, id := range q.Jobs {
		if j, _, err := a.Job(id, 0); err == nil && j.State == JobRunning {
			reply.Running = append(reply.Running, id)
		}
	}
	reply.Stages = fitStages(stages, statusBudget(reply))
	return reply
}

// maxStatusError bounds the error a status answer carries: that of a recovery of many jobs that failed
// names each of them, and with the stages it outgrew what the coordinator reads (clusterapi.MaxMessage).
const maxStatusError = clusterapi.MaxMessage / 4

// statusBudget is how many bytes of stages reply may carry and still fit clusterapi.MaxMessage.
func statusBudget(reply clusterapi.RecoveryStatusReply) int {
	b, err := json.Marshal(reply)
	if err != nil {
		return 0
	}
	return clusterapi.MaxMessage - len(b) - len(`,"stages":`) - 1 // and the line's newline
}

// fitStages encodes the newest of stages that fit in budget bytes: a recovery of a full request's jobs has
// thousands, and an answer with all of them was refused by the coordinator as too long (it then took the
// target for silent). The coordinator already has the older ones from its progress stream, up to where it
// broke.
func fitStages(stages []Stage, budget int) json.RawMessage {
	size, from := len("[]"), len(stages)
	for from > 0 {
		b, err := json.Marshal(stages[from-1])
		if err != nil || size+len(b)+1 > budget {
			break
		}
		size += len(b) + 1 // and its comma
		from--
	}
	if from == len(stages) {
		return nil
	}
	b, err := json.Marshal(stages[from:])
	if err != nil {
		return nil
	}
	return b
}

// recoveryStatus asks target about a recovery of failure and its jobs.
func (a *Agent) recoveryStatus(ctx context.Context, target, failure string, jobs []string) (recoveryStatusMessage, error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	r, err := a.peers().RecoveryStatus(qctx, target, clusterapi.RecoveryStatusRequest{Failure: failure, Jobs: jobs})
	if err != nil {
		return recoveryStatusMessage{}, err
	}
	st := recoveryStatusMessage{Failure: r.Failure, Known: r.Known, Done: r.Done, Resumed: r.Resumed, Error: r.Error, Running: r.Running}
	if len(r.Stages) > 0 {
		if err := json.Unmarshal(r.Stages, &st.Stages); err != nil {
			return st, fmt.Errorf("stages of recovery %s from %s are not the expected JSON: %w", failure, target, err)
		}
	}
	return st, nil
}

// brokenRecoveryWait bounds how long a coordinator whose progress stream broke waits for the target to
// answer again and finish, from the break or from the target's last answer that the recovery goes on: a
// restarted agent resumes the replay (failover.replay_timeout, the same on every member) and re-protects.
func (a *Agent) brokenRecoveryWait() time.Duration {
	return a.cfg.Failover.ReplayTimeout.Duration + 3*time.Minute
}

// brokenSilenceWait bounds how long the target may not answer at all: an agent restarts in seconds; a host
// that stays silent longer is left to failure detection.
func (a *Agent) brokenSilenceWait() time.Duration {
	return max(a.idleTimeout(), 3*a.cfg.Heartbeat.Timeout.Duration) // the idle bound of the stream itself: a minute by default
}

// afterBrokenStream finds out, once the progress stream of a recovery on target broke, what became of it:
// it asks the target (until it answers again and the recovery ends, bounded) and relays the stages it had
// not seen. The error names the jobs that do not run.
func (a *Agent) afterBrokenStream(ctx context.Context, target string, req RecoverRequest, emit func(Stage), broke error) error {
	jobs := recoverJobIDs(req)
	a.log.Warn("the progress stream of a recovery broke; asking the target what became of it", "target", target, "failure", req.Failure, "jobs", jobs, "err", broke)
	seen := map[string]bool{}
	key := func(s Stage) string {
		return s.Name + "\x00" + s.Job + "\x00" + s.Host + "\x00" + s.Start.UTC().String()
	}
	// The bounded log keeps a timeline's first stage and its newest ones: kept are the latter, if it dropped
	// any between them.
	kept := map[string]bool{}
	for _, f := range a.failures.List() {
		if f.ID == req.Failure {
			for i, s := range f.Stages {
				seen[key(s)] = true
				if i > 0 && f.StagesDropped > 0 {
					kept[key(s)] = true
				}
			}
		}
	}
	relay := func(st recoveryStatusMessage) {
		// The stream brought the target's stages in its order: those the answer lists before the oldest
		// one the log kept were seen too, and dropped. Relayed again, each was shown twice by ftctl events
		// and counted twice in ftkit_recovery_stage_seconds.
		from := max(slices.IndexFunc(st.Stages, func(s Stage) bool { return kept[key(s)] }), 0)
		for _, s := range st.Stages[from:] {
			if k := key(s); !seen[k] {
				seen[k] = true
				emit(s)
			}
		}
	}
	// The wait follows the target: each answer that the recovery goes on there gives it brokenRecoveryWait
	// more, within what the stream itself had (recoverLimit). A stream that broke on a network blip leaves
	// the target fetching and restoring, which may take longer than a resumed replay: given up on at a
	// fixed bound, the recovery was reported failed (its runs rolled back) while its jobs were restored.
	wait := a.brokenRecoveryWait()
	ctx, cancel := context.WithTimeout(ctx, max(recoverLimit, wait))
	defer cancel()
	deadline := time.Now().Add(wait)
	var last *recoveryStatusMessage
	silentSince := time.Now()
	targetFailed := func() error {
		if m, ok := a.member(target); ok && m.State != ring.StateAlive {
			return fmt.Errorf("%w; %w: %s was declared failed: job(s) %s do NOT run there", broke, errTargetFailed, target, strings.Join(jobs, ", "))
		}
		return nil
	}
	for {
		// A target declared failed is not waited for: its jobs died with it, and the next recovery needs
		// this one's outcome now.
		if err := targetFailed(); err != nil {
			return err
		}
		st, err := a.recoveryStatus(ctx, target, req.Failure, jobs)
		// A silent target whose own failure this host has declared, and which took this recovery over, is
		// waited for until the view says it failed (or the bound): given up on, this recovery reported its
		// jobs lost while that failure's restored them, or rolled their runs back as well.
		if err != nil && last == nil && time.Since(silentSince) > a.brokenSilenceWait() && a.takenOverBy(req.Failure) == "" {
			return fmt.Errorf("%w; %s did not answer within %s: whether job(s) %s run there is unknown", broke, target, a.brokenSilenceWait(), strings.Join(jobs, ", "))
		}
		if err == nil {
			last = &st
			relay(st)
			switch {
			case st.Done && st.Error != "":
				return fmt.Errorf("%w; %s finished it%s: %s", broke, target, resumedNote(st), st.Error)
			case st.Done:
				a.log.Info("the recovery completed on its target despite the broken stream", "target", target, "failure", req.Failure, "resumed", st.Resumed)
				return nil
			case !st.Known:
				return fmt.Errorf("%w; %s answers again but has no record of the recovery: %s", broke, target, runningSummary(jobs, st.Running))
			}
			deadline = time.Now().Add(wait)
		}
		select {
		case <-ctx.Done():
		case <-time.After(min(2*time.Second, time.Until(deadline))):
			if time.Now().Before(deadline) {
				continue
			}
		}
		// The view declaring the target failed ends the wait too (followedTargets).
		if err := targetFailed(); err != nil {
			return err
		}
		if last == nil {
			return fmt.Errorf("%w; %s did not answer within %s: whether job(s) %s run there is unknown", broke, target, wait, strings.Join(jobs, ", "))
		}
		return fmt.Errorf("%w; %s did not finish it within %s: %s", broke, target, wait, runningSummary(jobs, last.Running))
	}
}

func resumedNote(st recoveryStatusMessage) string {
	if st.Resumed {
		return " (resumed after its agent restarted)"
	}
	return ""
}

// runningSummary says which of jobs run (by the target's answer) and which do not.
func runningSummary(jobs, running []string) string {
	var yes, no []string
	for _, j := range jobs {
		if slices.Contains(running, j) {
			yes = append(yes, j)
		} else {
			no = append(no, j)
		}
	}
	var parts []string
	if len(yes) > 0 {
		parts = append(parts, "job(s) "+strings.Join(yes, ", ")+" run there")
	}
	if len(no) > 0 {
		parts = append(parts, "job(s) "+strings.Join(no, ", ")+" do NOT run there")
	}
	return strings.Join(parts, "; ")
}

// errRestartedMidRecovery is the cause given for the progress stream a coordinator's restart lost.
var errRestartedMidRecovery = errors.New("this host's agent restarted during the recovery")

// closeLeftFailovers finds out what became of the recoveries of node failures this host coordinated that a
// previous agent left under way (at start): nothing else ends their timelines, which stayed "recovering" in
// ftctl events and ftkit_recoveries{state="running"} for good, and a recovery that never reached a target
// (jobs restored nowhere) was never reported as failed. One with a target asks it, as a broken progress
// stream does; one without was never asked of anyone. It returns how many it follows, and a wait for their
// end (tests).
func (a *Agent) closeLeftFailovers(ctx context.Context) (n int, wait func()) {
	var wg sync.WaitGroup
	for _, f := range a.failures.List() {
		// Only this host's own failure recoveries and rollbacks: migrations are resumed apart
		// (resumeMigrations), and another member's timeline is its own to end.
		if (f.Kind != "" && f.Kind != coordinated.KindRollback) || f.Protector != a.cfg.Name || f.Done {
			continue
		}
		end := func(err error) {
			// A whole-run rollback the previous agent left mid-way (of this failure's runs, or the
			// operator's) may have stopped jobs of the run on every host and restored none: nothing else
			// says so.
			err = errors.Join(err, leftRollbacks(f, a.cfg.Name))
			a.failures.Update(f.ID, func(f *Failure) {
				f.Done = true
				if err != nil {
					f.Error = err.Error()
				}
			})
			a.saveFailures()
			if err != nil {
				a.log.Error("a recovery a previous agent left under way failed or is incomplete: the error says which jobs do not run", "failure", f.ID, "node", f.Node, "err", err)
			}
		}
		if f.Kind == coordinated.KindRollback {
			end(nil) // an operator's rollback has no target to ask: its stages say how far it went
			continue
		}
		if f.Target == "" {
			end(fmt.Errorf("not recovered: ftagent on %s restarted before the recovery reached a target: job(s) %s of %s were NOT restored; restore them with `ftctl restore`",
				a.cfg.Name, strings.Join(f.Jobs, ", "), f.Node))
			continue
		}
		req := RecoverRequest{Failure: f.ID, Failed: f.Node, Source: a.cfg.Name}
		for _, j := range f.Jobs {
			req.Jobs = append(req.Jobs, RecoverJob{Job: j})
		}
		emit := func(st Stage) {
			a.failures.Update(f.ID, func(f *Failure) { f.Stages = append(f.Stages, st) })
			a.saveFailures()
		}
		a.log.Warn("a recovery a previous agent left under way: asking its target what became of it", "failure", f.ID, "node", f.Node, "target", f.Target)
		n++
		broke := fmt.Errorf("recovery on %s: progress stream ended: %w", f.Target, errRestartedMidRecovery)
		wg.Go(func() { end(a.afterBrokenStream(ctx, f.Target, req, emit, broke)) })
	}
	return n, wg.Wait
}

// leftRollbacks names the whole-run rollbacks in f's stages that a previous agent on self left unfinished:
// past their prepare phase (the stop phase follows it at once, so any job of the run may have been killed)
// with no restore that succeeded. An operator's rollback (KindRollback) with no prepare phase that succeeded
// stopped nothing. nil: none.
func leftRollbacks(f *Failure, self string) error {
	var runs []string // the stages' details: "run R, cut C"
	prepared, restored := false, false
	for _, s := range f.Stages {
		switch {
		case s.Name == coordinated.StagePrepared && s.Error == "":
			prepared = true
			if !slices.Contains(runs, s.Detail) {
				runs = append(runs, s.Detail)
			}
		case s.Name == coordinated.StageRolledBack && s.Error == "":
			restored = true
			runs = slices.DeleteFunc(runs, func(d string) bool { return d == s.Detail })
		}
	}
	jobs := "job(s) " + strings.Join(f.Jobs, ", ")
	if f.Kind != coordinated.KindRollback {
		jobs += " of " + f.Node + " and the run's jobs on its other hosts"
	}
	if f.Kind == coordinated.KindRollback && !prepared && !restored {
		run := f.ID[:max(strings.LastIndex(f.ID, "-rollback-"), 0)] // Agent.Rollback's id: RUN-rollback-TIME
		return fmt.Errorf("not rolled back: ftagent on %s restarted before any job of the run stopped: %s run on as before; roll the run back again with `ftctl rollback --run %s`", self, jobs, run)
	}
	var errs []error
	for _, d := range runs {
		run, _, _ := strings.Cut(strings.TrimPrefix(d, "run "), ", cut ")
		errs = append(errs, fmt.Errorf("NOT rolled back (%s): ftagent on %s restarted after the rollback's stop phase began and before its restore ended: %s may run nowhere; `ftctl status` on its hosts shows which run; `ftctl rollback --run %s` stops those and restores every job of the run from the cut again (a job whose host is not alive: `ftctl restore`)",
			d, self, jobs, run))
	}
	return errors.Join(errs...)
}
