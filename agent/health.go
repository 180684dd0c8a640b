package agent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt/interval"
	"github.com/ftkit/ftkit/internal/sitecmd"
	"github.com/ftkit/ftkit/internal/tickgrid"
)

// HealthConfig is the site's failure predictor (seed 001): a command the agent runs every Interval whose
// exit status says whether this host is about to fail (ECC error counts, temperatures, SMART, a BMC's
// event log: the site decides). Exit 0: healthy. Exit 1: a failure is predicted within LeadTime; the
// command's output says why. Anything else (another status, a timeout, a program others may change) means
// the check itself failed, which is logged and changes nothing.
//
// On a prediction the agent drains its host (drain.go): every job with an address of its own moves to
// another node of the ring, and the others are snapshotted at once and then at Daly's interval for a
// failure LeadTime away, until the command says healthy again. With a predictor, the failures left to
// the checkpoint interval are the ones it misses: the automatic interval uses checkpoint.mtbf /
// (1 - Recall), as the thesis does for its precautionary checkpoints.
type HealthConfig struct {
	Command  []string `toml:"command"` // absolute path first; {host} is this host's member name
	Interval Duration `toml:"interval"`
	Timeout  Duration `toml:"timeout"`
	LeadTime Duration `toml:"lead_time"`
	Recall   float64  `toml:"recall"` // the predictor's recall, in [0, 1)
}

func (h HealthConfig) validate() error {
	if len(h.Command) == 0 {
		return nil
	}
	var errs []error
	if !filepath.IsAbs(h.Command[0]) {
		errs = append(errs, fmt.Errorf("command %q: give the program by absolute path", h.Command[0]))
	}
	for _, a := range h.Command {
		if strings.ContainsAny(strings.ReplaceAll(a, "{host}", ""), "{}") {
			errs = append(errs, fmt.Errorf("command argument %q: the only placeholder is {host}", a))
		}
	}
	if h.Interval.Duration <= 0 || h.Timeout.Duration <= 0 || h.Timeout.Duration > h.Interval.Duration {
		errs = append(errs, fmt.Errorf("timeout (%s) must be positive and at most the interval (%s)", h.Timeout, h.Interval))
	}
	if h.LeadTime.Duration <= 0 {
		errs = append(errs, fmt.Errorf("lead_time %s must be positive", h.LeadTime))
	}
	if !(h.Recall >= 0 && h.Recall < 1) {
		errs = append(errs, fmt.Errorf("recall %v must be in [0, 1)", h.Recall))
	}
	return errors.Join(errs...)
}

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
	tickgrid.Every(ctx, h.Interval.Duration, func() {
		r := cmd.Run(ctx)
		why := strings.Join(strings.Fields(r.Output), " ")
		switch r.Exit {
		case healthOK:
			if a.predicted.Swap(false) {
				a.log.Info("health command says this host is healthy again: snapshots back on their interval", "output", why)
			}
		case healthFailing:
			if a.predicted.Swap(true) {
				return // drained already; the jobs that stayed are snapshotted on the shorter interval
			}
			a.log.Error("health command predicts a failure of this host: draining it", "output", why, "lead_time", h.LeadTime)
			go a.drain(context.WithoutCancel(ctx), nil, "health command predicts a failure: "+why)
		default:
			a.log.Warn("health command failed; nothing changes", "exit", r.Exit, "err", r.Err, "output", why)
		}
	})
}

// unpredictedMTBF is the MTBF the automatic checkpoint interval is computed for: with a failure predictor,
// only the failures it misses (checkpoint.mtbf / (1 - recall)).
func (a *Agent) unpredictedMTBF() time.Duration {
	m := a.cfg.Checkpoint.MTBF.Duration
	if len(a.cfg.Health.Command) == 0 {
		return m
	}
	return time.Duration(float64(m) / (1 - a.cfg.Health.Recall))
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
