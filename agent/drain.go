package agent

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/ftkit/ftkit/ring"
)

// KindDrain marks a drain of a host in the event log (Failure.Kind): every job moved off it, by an
// operator (`ftctl drain`) or because its health command predicted a failure.
const KindDrain = "drain"

// Stages of a drain, one per job: moved to another node, or (no address of its own) snapshotted where it is.
const (
	StageMoved       = "moved"
	StageSnapshotted = "snapshotted"
)

// DrainRequest asks the agent to move every job off its host: to the nodes in To, in turn, or (none
// given) to every other alive node of the ring in ring order from this host's protector on.
type DrainRequest struct {
	To []string `json:"to,omitempty"`
}

// MaxDrainTargets bounds a drain request's list.
const MaxDrainTargets = 1024

// DrainResult says where each job went.
type DrainResult struct {
	Node  string      `json:"node"`
	Event string      `json:"event"`
	Moved []Migration `json:"moved,omitempty"`
	// Snapshotted are the jobs that cannot move (they use the host's address): snapshotted at once instead,
	// and while a failure is predicted, again at Daly's interval for it.
	Snapshotted []string `json:"snapshotted,omitempty"`
	Failed      []string `json:"failed,omitempty"` // "job: why", for every job that neither moved nor was snapshotted
}

// Drain moves every running job off this host (root only); see DrainRequest.
func (a *Agent) Drain(ctx context.Context, req DrainRequest, uid uint32) (*DrainResult, error) {
	if uid != 0 {
		return nil, fmt.Errorf("%w: draining a host is for root (the operator)", ErrNotMovable)
	}
	if len(req.To) > MaxDrainTargets {
		return nil, fmt.Errorf("drain to %d hosts: at most %d", len(req.To), MaxDrainTargets)
	}
	if _, err := drainTargets(a.View(), a.cfg.Name, req.To); err != nil {
		return nil, err
	}
	return a.drain(ctx, req.To, "asked by an operator"), nil
}

// drain moves every running job off this host, one after another, to targets (see drainTargets); a job
// that cannot move is snapshotted instead. why goes into the event log.
func (a *Agent) drain(ctx context.Context, to []string, why string) *DrainResult {
	start := time.Now()
	res := &DrainResult{Node: a.cfg.Name, Event: a.cfg.Name + "-drain-" + start.UTC().Format("20060102T150405.000")}
	ids := a.runningJobIDs()
	a.failures.Update(res.Event, func(f *Failure) {
		f.Kind, f.Node, f.Protector, f.LastBeat, f.Detected, f.Jobs = KindDrain, a.cfg.Name, a.cfg.Name, start, start, ids
		f.Stages = append(f.Stages, Stage{Name: "drain", Host: a.cfg.Name, Start: start, End: start, Detail: why})
	})
	a.saveFailures()
	stage := func(name, job string, from time.Time, detail string, err error) {
		a.failures.Update(res.Event, func(f *Failure) {
			f.Stages = append(f.Stages, Stage{Name: name, Job: job, Host: a.cfg.Name, Start: from, End: time.Now(), Detail: detail, Error: errString(err)})
		})
		a.saveFailures()
	}
	// Twice replay_timeout (waitReplayed says why), at most the longest duration: the configuration takes any
	// up to it, and twice one past half of it wrapped negative, which gave up on a replaying job at once.
	replayWait := a.cfg.Failover.ReplayTimeout.Duration
	replayWait += min(replayWait, math.MaxInt64-replayWait)
	next := 0
	for _, id := range ids {
		t0 := time.Now()
		if err := a.waitReplayed(ctx, id, replayWait); err != nil {
			stage(StageMoved, id, t0, "", err)
			res.Failed = append(res.Failed, fmt.Sprintf("%s: %v", id, err))
			continue
		}
		j, _, err := a.Job(id, 0)
		if err != nil || j.State != JobRunning {
			continue // ended meanwhile
		}
		if j.Net == nil {
			_, err := a.Checkpoint(ctx, []string{id}, 0)
			stage(StageSnapshotted, id, t0, "no address of its own: it cannot move", err)
			if err != nil {
				res.Failed = append(res.Failed, fmt.Sprintf("%s: cannot move, and its snapshot failed: %v", id, err))
				continue
			}
			res.Snapshotted = append(res.Snapshotted, id)
			continue
		}
		targets, err := drainTargets(a.View(), a.cfg.Name, to)
		if err != nil {
			stage(StageMoved, id, t0, "", err)
			res.Failed = append(res.Failed, fmt.Sprintf("%s: %v", id, err))
			continue
		}
		// In turn over the targets; one that fails the move is skipped for this job, the next is tried.
		move := a.Migrate
		if a.drainMove != nil {
			move = a.drainMove
		}
		var errs []error
		for range targets {
			target := targets[next%len(targets)]
			next++
			m, err := move(ctx, MigrateRequest{Job: id, To: target}, 0)
			// A move whose target failed after its copy started (its re-protection, say) leaves the job
			// running there (m.To), off this host: moved, with m.Error saying what failed.
			if err == nil && (m.Error == "" || m.To != a.cfg.Name) {
				detail := fmt.Sprintf("to %s, stopped %s (%s)", m.To, m.Frozen.Round(time.Millisecond), m.Event)
				if m.Error != "" {
					detail += "; it runs there, but: " + m.Error
				}
				stage(StageMoved, id, t0, detail, nil)
				res.Moved = append(res.Moved, *m)
				errs = nil
				break
			}
			if err == nil {
				err = fmt.Errorf("%s", m.Error)
			}
			errs = append(errs, fmt.Errorf("%s: %w", target, err))
			if cur, _, jerr := a.Job(id, 0); jerr != nil || cur.State != JobRunning {
				break // it left this host: the migration's own error says where it is
			}
			if stays := (jobStaysError{}); errors.As(err, &stays) {
				break // failed here, whatever the target: another would freeze and dump it again for nothing
			}
		}
		if errs != nil {
			err := fmt.Errorf("not moved: %v", errs)
			stage(StageMoved, id, t0, "", err)
			res.Failed = append(res.Failed, fmt.Sprintf("%s: %v", id, err))
		}
	}
	a.failures.Update(res.Event, func(f *Failure) {
		f.Done = true
		if len(res.Failed) > 0 {
			f.Error = fmt.Sprintf("%d job(s) still here: %v", len(res.Failed), res.Failed)
		}
	})
	a.saveFailures()
	a.pushView(ctx)
	a.log.Info("host drained", "moved", len(res.Moved), "snapshotted", res.Snapshotted, "failed", res.Failed, "event", res.Event)
	return res
}

// drainTargets is where a drain of self moves jobs: the alive nodes of the ring among to, in that order,
// or with to empty every other alive node of the ring in ring order from self's protector on. An error if
// there is none, or to names a host that is not an alive node of the ring.
func drainTargets(v ring.View, self string, to []string) ([]string, error) {
	if len(to) > 0 {
		var out []string
		for _, t := range to {
			m, ok := v.Member(t)
			if !ok || m.Role != ring.RoleNode || m.State != ring.StateAlive || t == self {
				return nil, fmt.Errorf("%w: %q is not another alive node of the ring", ErrNotMovable, t)
			}
			// Each once, wherever repeated: slices.Compact kept a node named twice apart, which a job it
			// failed was frozen and dumped for again, and which got twice the share of the jobs.
			if !slices.Contains(out, t) {
				out = append(out, t)
			}
		}
		return out, nil
	}
	var out []string
	for p, ok := v.Protector(self); ok && p.Name != self && !slices.Contains(out, p.Name); p, ok = v.Protector(p.Name) {
		out = append(out, p.Name)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no other alive node in the ring", ErrNotMovable)
	}
	return out, nil
}
