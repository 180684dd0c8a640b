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
	"github.com/ftkit/ftkit/internal/testenv"
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
	a.answering.Store(true) // the health command answers
	if got := a.unpredictedMTBF(); got < cfg.Checkpoint.MTBF.Duration {
		t.Errorf("unpredicted MTBF = %s, want at least checkpoint.mtbf %s", got, cfg.Checkpoint.MTBF)
	}
	// Daly's interval for a dump of 1 s (the policy's first guess) and the configured MTBF alone: about 5 h.
	if got, least := a.policyFor("job-00000001").Interval(), interval.Daly(time.Second, cfg.Checkpoint.MTBF.Duration); got < least {
		t.Errorf("interval auto with recall %v = %s, want at least %s (Daly's for checkpoint.mtbf itself)", cfg.Health.Recall, got, least)
	}
}

// TestAutoIntervalKeepsTheFloor: a job asking for interval auto gets no snapshot more often than
// checkpoint.min_interval, however small its dump: the floor that bounds what a local user costs the host.
// Before, the automatic policy was clamped at 1 s only: a 5 ms dump and a one-hour MTBF gave a snapshot
// every 6.0 s on an agent whose floor is a minute.
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
// temperature hovering at its threshold) drains the host once per lead time. Before, every exit 1 after an
// exit 0 started another drain, one per two runs, while the last was still moving jobs.
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
	// A timeout far above a run's time: a run cut short answers nothing (no prediction, no drain), and a
	// loaded host (a CI beside other work) took the script past 40 ms.
	ta.cfg.Health = HealthConfig{Command: []string{prog}, Interval: Duration{Duration: 40 * time.Millisecond},
		Timeout: Duration{Duration: 5 * time.Second}, LeadTime: Duration{Duration: time.Hour}}
	logs := &testenv.SyncBuffer{}
	ta.log = slog.New(slog.NewTextHandler(logs, nil))
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
	// Each drain is started right after this line, in the loop that has returned now.
	if drains := strings.Count(logs.String(), "health command predicts a failure of this host: draining it"); drains != 1 {
		t.Errorf("a health command flapping 1, 0, 1, 0, ... within its lead time drained the host %d times, want once", drains)
	}
}

// TestAutoIntervalCountsOnAPredictorOnlyWhileItAnswers: interval auto is computed for checkpoint.mtbf /
// (1 - recall) only while the health command answers (exit 0 or 1): a command that fails at every run
// (exit 2 here; a timeout, a program refused or not found alike) predicts nothing, and its jobs are
// snapshotted for every failure again once it stops answering. Before, a configured command stretched the
// interval whatever it did: with recall 0.9, by sqrt(10), some 3.2 times, for a predictor that never ran.
func TestAutoIntervalCountsOnAPredictorOnlyWhileItAnswers(t *testing.T) {
	dir := t.TempDir()
	count := filepath.Join(dir, "runs")
	exit := filepath.Join(dir, "exit")
	prog := filepath.Join(dir, "health")
	// Exits with the status in file exit and counts its runs.
	script := "#!/bin/sh\necho x >> " + count + "\nread n < " + exit + "\nexit $n\n"
	if err := os.WriteFile(prog, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	setExit := func(n string) { // whole, at once: a run reading it empty would exit 1 (read fails), a prediction
		if err := os.WriteFile(exit+".new", []byte(n+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(exit+".new", exit); err != nil {
			t.Fatal(err)
		}
	}
	runs := func() int { b, _ := os.ReadFile(count); return strings.Count(string(b), "\n") }
	cfg := Config{}
	cfg.Checkpoint.Interval = Interval{Auto: true}
	cfg.Checkpoint.MinInterval = Duration{Duration: time.Second}
	cfg.Checkpoint.MTBF = Duration{Duration: 10 * time.Hour}
	cfg.Health = HealthConfig{Command: []string{prog}, Recall: 0.9, Interval: Duration{Duration: 20 * time.Millisecond},
		Timeout: Duration{Duration: 5 * time.Second}, LeadTime: Duration{Duration: time.Hour}}
	a := &Agent{cfg: cfg, log: slog.New(slog.DiscardHandler), byID: map[string]*Job{}, policies: map[string]*interval.Policy{}}
	const job = "job-00000001"
	raw := interval.Daly(time.Second, 10*time.Hour)        // the policy's first cost estimate is 1 s
	stretched := interval.Daly(time.Second, 100*time.Hour) // for mtbf / (1 - 0.9)
	if got := a.jobInterval(job); got != raw {
		t.Errorf("interval auto before the health command ever ran = %s, want %s (Daly's for checkpoint.mtbf); %s assumes a predictor that catches 90%% of the failures",
			got, raw, stretched)
	}
	setExit("2")
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { defer close(done); a.watchHealth(ctx) }()
	// waitFor polls until the job's interval is want, failing after 10 s.
	waitFor := func(want time.Duration, what string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); a.jobInterval(job) != want; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: interval auto = %s after %d runs, want %s", what, a.jobInterval(job), runs(), want)
			}
		}
	}
	for deadline := time.Now().Add(10 * time.Second); runs() < 6; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the health command ran %d times in 10 s", runs())
		}
	}
	if got, m := a.jobInterval(job), a.unpredictedMTBF(); got != raw || m != 10*time.Hour {
		t.Errorf("health command failing at each of %d runs (exit 2): interval auto = %s for an MTBF of %s, want %s for checkpoint.mtbf 10h",
			runs(), got, m, raw)
	}
	setExit("0")
	waitFor(stretched, "health command answering (exit 0)")
	setExit("2")
	waitFor(raw, "health command failing again (exit 2)")
}
