package agent

import (
	"context"
	"math"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt/interval"
	"github.com/ftkit/ftkit/internal/sitecmd"
	"github.com/ftkit/ftkit/internal/tickgrid"
)

// Exit statuses of the health command.
const (
	healthOK      = 0
	healthFailing = 1
)

// watchHealth runs the health command every interval and drains this host when it predicts a failure.
func (a *Agent) watchHealth(ctx context.Context) {
	h := a.cfg.Health
	if len(h.Command) == 0 {
		return
	}
	argv := make([]string, len(h.Command))
	for i, s := range h.Command {
		argv[i] = strings.ReplaceAll(s, "{host}", a.cfg.Name)
	}
	cmd := sitecmd.Command{Name: "health command", Argv: argv, Timeout: h.Timeout.Duration}
	// A prediction that comes back within lead_time of the drain it started drains nothing again: a
	// command flapping at its threshold otherwise drained the host at every other run, drains running at
	// once. An exit 0 still ends the prediction at once (the operator fixed the host).
	var lastDrain time.Time
	misses := 0 // runs in a row that did not answer
	tickgrid.Every(ctx, h.Interval.Duration, func() {
		r := cmd.Run(ctx)
		why := strings.Join(strings.Fields(r.Output), " ")
		if r.Exit == healthOK || r.Exit == healthFailing {
			misses = 0
			a.setAnswering(true)
		} else if misses++; misses >= healthMisses {
			a.setAnswering(false)
		}
		switch r.Exit {
		case healthOK:
			if a.predicted.Swap(false) {
				a.log.Info("health command says this host is healthy again: snapshots back on their interval", "output", why)
			}
		case healthFailing:
			if a.predicted.Swap(true) {
				return // drained already; the jobs that stayed are snapshotted on the shorter interval
			}
			if !lastDrain.IsZero() && time.Since(lastDrain) < h.LeadTime.Duration {
				a.log.Warn("health command predicts a failure of this host again, within the lead time of the drain it started: not drained again; the jobs that stayed are snapshotted on the shorter interval",
					"output", why, "drained_at", lastDrain, "lead_time", h.LeadTime)
				return
			}
			lastDrain = time.Now()
			a.log.Error("health command predicts a failure of this host: draining it", "output", why, "lead_time", h.LeadTime)
			go a.drain(context.WithoutCancel(ctx), nil, "health command predicts a failure: "+why)
		default:
			a.log.Warn("health command failed; nothing changes", "exit", r.Exit, "err", r.Err, "output", why, "in_a_row", misses)
		}
	})
}

// healthMisses is how many runs of the health command in a row may fail to answer (any exit but 0 and 1, a
// timeout, a program refused or not found) before interval auto stops counting on its predictions: one
// failed run is no reason to snapshot more often, a command that no longer answers predicts nothing.
const healthMisses = 3

// setAnswering records whether the health command answers, and when that changes, logs it and puts the
// interval policies on the MTBF that follows (unpredictedMTBF).
func (a *Agent) setAnswering(ok bool) {
	if a.answering.Swap(ok) == ok {
		return
	}
	m := a.unpredictedMTBF()
	if ok {
		a.log.Info("health command answers: interval auto counts only the failures it does not predict",
			"mtbf", m, "checkpoint_mtbf", a.cfg.Checkpoint.MTBF, "recall", a.cfg.Health.Recall)
	} else {
		a.log.Warn("health command no longer answers: interval auto counts every failure",
			"mtbf", m, "failed_runs_in_a_row", healthMisses)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, p := range a.policies {
		p.SetMTBF(m)
	}
}

// unpredictedMTBF is the MTBF the automatic checkpoint interval is computed for: with a failure predictor
// that answers (a.answering), only the failures it misses (checkpoint.mtbf / (1 - recall)), at most the
// longest time.Duration (some 292 years): a host's MTBF of years and a recall near 1 go beyond it, and a
// float64 beyond it converts to a negative duration, which the automatic policy refuses. A predictor that
// has not answered yet, or no longer does, catches nothing: then checkpoint.mtbf itself.
func (a *Agent) unpredictedMTBF() time.Duration {
	m := a.cfg.Checkpoint.MTBF.Duration
	if len(a.cfg.Health.Command) == 0 || !a.answering.Load() {
		return m
	}
	u := float64(m) / (1 - a.cfg.Health.Recall)
	if u >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(u)
}

// jobInterval is the time between two snapshots of a job: its policy's, and while this host is predicted
// to fail at most Daly's interval for a failure one lead time away.
func (a *Agent) jobInterval(id string) time.Duration {
	p := a.policyFor(id)
	iv := p.Interval()
	if a.predicted.Load() {
		iv = min(iv, max(interval.Daly(p.Cost(), a.cfg.Health.LeadTime.Duration), a.cfg.Checkpoint.MinInterval.Duration))
	}
	return iv
}
