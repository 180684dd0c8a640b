package agent

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt/interval"
)

// TestAutoIntervalKeepsTheFloor: a job asking for interval auto gets no snapshot more often than
// checkpoint.min_interval, however small its dump: the floor that bounds what a local user costs the host.
// Before, the automatic policy was clamped at 1 s only: a 5 ms dump and a one-hour MTBF gave a snapshot
// every 8.5 s on an agent whose floor is a minute.
func TestAutoIntervalKeepsTheFloor(t *testing.T) {
	cfg := Config{}
	cfg.Checkpoint.Interval = Interval{Auto: true}
	cfg.Checkpoint.MinInterval = Duration{Duration: time.Minute}
	cfg.Checkpoint.MTBF = Duration{Duration: time.Hour}
	a := &Agent{cfg: cfg, log: slog.New(slog.DiscardHandler), byID: map[string]*Job{}, policies: map[string]*interval.Policy{}}
	p := a.policyFor("job-00000001")
	p.Observe(5 * time.Millisecond)
	if got := a.jobInterval("job-00000001"); got < time.Minute {
		t.Errorf("interval auto for a 5 ms dump = %s, below checkpoint.min_interval %s", got, cfg.Checkpoint.MinInterval)
	}
}

// TestHealthFlapDrainsOnce: a health command that flaps between "failure predicted" and "healthy" (a
// temperature hovering at its threshold) drains the host once per lead time, and its jobs that stayed keep
// the short interval for the lead time the prediction covers. Before, every exit 0 cleared the prediction
// and the next exit 1 started another drain, one per two runs, while the last was still moving jobs.
func TestHealthFlapDrainsOnce(t *testing.T) {
	ta := newTestAgent(t)
	dir := t.TempDir()
	count := filepath.Join(dir, "runs")
	prog := filepath.Join(dir, "health")
	// Exits 1, 0, 1, 0, ... and counts its runs.
	script := "#!/bin/sh\necho x >> " + count + "\nn=$(wc -l < " + count + ")\nif [ $((n % 2)) = 1 ]; then echo 'ECC errors'; exit 1; fi\nexit 0\n"
	if err := os.WriteFile(prog, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.cfg.Health = HealthConfig{Command: []string{prog}, Interval: Duration{Duration: 40 * time.Millisecond},
		Timeout: Duration{Duration: 40 * time.Millisecond}, LeadTime: Duration{Duration: time.Hour}}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); ta.watchHealth(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(count)
		if strings.Count(string(b), "\n") >= 6 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the health command ran %d times in 10 s", strings.Count(string(b), "\n"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-done
	time.Sleep(200 * time.Millisecond) // the drains started record their events at once
	drains := 0
	for _, f := range ta.failures.List() {
		if f.Kind == KindDrain {
			drains++
		}
	}
	if drains != 1 {
		t.Errorf("a health command flapping 1, 0, 1, 0, ... within its lead time drained the host %d times, want once", drains)
	}
	if !ta.predicted.Load() {
		t.Errorf("an exit 0 within the lead time of a prediction cleared it")
	}
}
