package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/interval"
)

// policyFor returns the interval policy of a job (of the whole host in semi-coordinated mode, where all
// jobs are dumped together), creating it from the job's or the agent's interval setting.
func (a *Agent) policyFor(jobID string) *interval.Policy {
	a.mu.Lock()
	defer a.mu.Unlock()
	key := jobID
	if a.cfg.Checkpoint.Mode == SemiCoordinated {
		key = ""
	}
	if p, ok := a.policies[key]; ok {
		return p
	}
	iv := a.cfg.Checkpoint.Interval
	if j, ok := a.byID[jobID]; ok && key != "" && j.Spec.Interval != "" {
		iv.UnmarshalText([]byte(j.Spec.Interval)) // validated when the job was created
	}
	cfg := interval.Config{Fixed: iv.Fixed, MTBF: a.cfg.Checkpoint.MTBF.Duration, InitialCost: time.Second}
	p, err := interval.New(cfg)
	if err != nil { // the configuration was validated; fall back to a safe fixed period
		a.log.Error("interval policy", "err", err)
		p, _ = interval.New(interval.Config{Fixed: time.Minute})
	}
	a.policies[key] = p
	return p
}

// schedule takes periodic snapshots: each job when its interval has passed since its last snapshot (or
// its start); in semi-coordinated mode all jobs at once on the host's interval.
func (a *Agent) schedule(ctx context.Context) {
	last := map[string]time.Time{}
	every(ctx, 100*time.Millisecond, func() {
		var due []string
		now := time.Now()
		for _, j := range a.Jobs(0) {
			if j.State != JobRunning {
				delete(last, j.ID)
				continue
			}
			key := j.ID
			if a.cfg.Checkpoint.Mode == SemiCoordinated {
				key = ""
			}
			if _, ok := last[key]; !ok {
				last[key] = now
			}
			if now.Sub(last[key]) >= a.policyFor(j.ID).Interval() {
				due = append(due, j.ID)
			}
		}
		if len(due) == 0 {
			return
		}
		keys := due
		if a.cfg.Checkpoint.Mode == SemiCoordinated {
			due, keys = nil, []string{""} // every running job of the host, frozen together
		}
		if _, err := a.Checkpoint(ctx, due, 0); err != nil {
			a.log.Warn("periodic snapshot failed; retrying at the next interval", "err", err)
		}
		for _, k := range keys { // success or not: a failing job is not retried in a tight loop
			last[k] = time.Now()
		}
	})
}

// semiCoordinated freezes every job's cgroup, dumps them all while frozen, and thaws them: one
// consistent snapshot of the host, so traffic between its jobs never needs to be logged.
func (a *Agent) semiCoordinated(ctx context.Context, jobs []Job) ([]*ckpt.Manifest, error) {
	start := time.Now()
	var frozen []string
	defer func() {
		for _, cg := range frozen {
			if err := setFrozen(cg, false); err != nil {
				a.log.Error("thaw job cgroup (the job stays frozen until this is fixed)", "cgroup", cg, "err", err)
			}
		}
	}()
	for _, j := range jobs {
		if err := setFrozen(j.Cgroup, true); err != nil {
			return nil, fmt.Errorf("freeze job %s: %w", j.ID, err)
		}
		frozen = append(frozen, j.Cgroup)
	}
	for _, cg := range frozen {
		if err := waitFrozen(ctx, cg); err != nil {
			return nil, err
		}
	}
	var out []*ckpt.Manifest
	for _, j := range jobs {
		m, err := a.snapshot(ctx, j, true)
		if err != nil {
			return out, fmt.Errorf("semi-coordinated snapshot of job %s: %w", j.ID, err)
		}
		out = append(out, m)
	}
	a.policyFor("").Observe(time.Since(start))
	a.log.Info("host snapshot (semi-coordinated)", "jobs", len(jobs), "frozen_ms", time.Since(start).Milliseconds())
	return out, nil
}

// setFrozen writes cgroup v2's cgroup.freeze.
func setFrozen(cgroup string, on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	return os.WriteFile(filepath.Join(cgroup, "cgroup.freeze"), []byte(v), 0)
}

// waitFrozen waits until cgroup.events says every task of the cgroup is frozen.
func waitFrozen(ctx context.Context, cgroup string) error {
	for {
		b, err := os.ReadFile(filepath.Join(cgroup, "cgroup.events"))
		if err != nil {
			return err
		}
		if strings.Contains(string(b), "frozen 1") {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cgroup %s did not freeze: %w", cgroup, ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// every runs fn each period until ctx ends: the shape of the agent's background loops.
func every(ctx context.Context, period time.Duration, fn func()) {
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		fn()
	}
}
