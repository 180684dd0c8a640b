package agentconfig

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"
)

// HealthConfig is the site's failure predictor (seed 001): a command the agent runs every Interval whose
// exit status says whether this host is about to fail (ECC error counts, temperatures, SMART, a BMC's
// event log: the site decides). Exit 0: healthy. Exit 1: a failure is predicted within LeadTime; the
// command's output says why. Anything else (another status, a timeout, a program others may change) means
// the check itself failed, which is logged and changes nothing.
//
// On a prediction the agent drains its host: every job with an address of its own moves to
// another node of the ring, and the others are snapshotted at once and then at Daly's interval for a
// failure LeadTime away, until the command says healthy again. With a predictor, the failures left to
// the checkpoint interval are the ones it misses: the automatic interval uses checkpoint.mtbf /
// (1 - Recall), as the thesis does for its precautionary checkpoints, while the command answers (exit 0
// or 1; the agent falls back to checkpoint.mtbf when it does not).
type HealthConfig struct {
	Command  []string `toml:"command"` // absolute path first; {host} is this host's member name
	Interval Duration `toml:"interval"`
	Timeout  Duration `toml:"timeout"`
	LeadTime Duration `toml:"lead_time"`
	Recall   float64  `toml:"recall"` // the predictor's recall, in [0, 1)
}

// minHealthInterval bounds health.interval: the agent runs the command, as root, every interval, each run
// bounded by a timeout of at most the interval, so a few microseconds (a typo for "30s") fork it back to back
// and kill every run before it answers. The e2e tests' fastest predictor runs every 200 ms.
const minHealthInterval = 100 * time.Millisecond

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
	} else if h.Interval.Duration < minHealthInterval {
		errs = append(errs, fmt.Errorf("interval %s: use at least %s (the agent runs the command as root every interval; did you mean s?)", h.Interval, minHealthInterval))
	}
	if h.LeadTime.Duration <= 0 {
		errs = append(errs, fmt.Errorf("lead_time %s must be positive", h.LeadTime))
	}
	if !(h.Recall >= 0 && h.Recall < 1) {
		errs = append(errs, fmt.Errorf("recall %v must be in [0, 1)", h.Recall))
	}
	return errors.Join(errs...)
}
