package agent

import (
	"log/slog"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt/interval"
)

// TestAutoIntervalWithAPredictorOfHighRecall: a host's MTBF of five years and a predictor that foresees
// 99% of its failures leave an unpredicted MTBF beyond what a time.Duration holds (some 292 years). Before,
// checkpoint.mtbf / (1 - recall) overflowed to a negative MTBF, the automatic policy was refused, and every
// job asking for interval auto was snapshotted every minute instead of every few days (an error in the log
// per job, nothing at --check-config).
func TestAutoIntervalWithAPredictorOfHighRecall(t *testing.T) {
	cfg := Config{}
	cfg.Checkpoint.Interval = Interval{Auto: true}
	cfg.Checkpoint.MinInterval = Duration{Duration: time.Second}
	cfg.Checkpoint.MTBF = Duration{Duration: 5 * 365 * 24 * time.Hour}
	cfg.Health.Command = []string{"/usr/local/sbin/ftkit-health", "{host}"}
	cfg.Health.Recall = 0.99
	a := &Agent{cfg: cfg, log: slog.New(slog.DiscardHandler), byID: map[string]*Job{}, policies: map[string]*interval.Policy{}}
	if got := a.unpredictedMTBF(); got < cfg.Checkpoint.MTBF.Duration {
		t.Errorf("unpredicted MTBF = %s, want at least checkpoint.mtbf %s", got, cfg.Checkpoint.MTBF)
	}
	// Daly's interval for a dump of 1 s (the policy's first guess) and the configured MTBF alone: about 5 h.
	if got, least := a.policyFor("job-00000001").Interval(), interval.Daly(time.Second, cfg.Checkpoint.MTBF.Duration); got < least {
		t.Errorf("interval auto with recall %v = %s, want at least %s (Daly's for checkpoint.mtbf itself)", cfg.Health.Recall, got, least)
	}
}
