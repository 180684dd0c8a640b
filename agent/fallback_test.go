package agent

import (
	"log/slog"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt/interval"
)

// TestReleaseOneSnapshotBehind: the log is released to the replicated snapshot before the newest, so that
// the newest failing verification on its holder leaves an older one restorable; under log pressure to the
// newest itself.
func TestReleaseOneSnapshotBehind(t *testing.T) {
	s := testStore(t, "node1")
	a := &Agent{store: s, log: slog.New(slog.DiscardHandler)}
	a.cfg.Name = "node1"
	const job = "counter-1a2b3c4d"
	first := testSnapshot(t, s, job, "one")
	unshipped := testSnapshot(t, s, job, "two")
	third := testSnapshot(t, s, job, "three")
	for _, m := range []string{first.ID, third.ID} {
		if _, err := s.AddReplica(job, m, "node2"); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name   string
		of     string
		urgent bool
		want   string // "" for none
	}{
		{"first snapshot releases nothing", first.ID, false, ""},
		{"an unreplicated snapshot in between is skipped", third.ID, false, first.ID},
		{"under log pressure the newest is the floor", third.ID, true, third.ID},
		{"the one before an unshipped snapshot", unshipped.ID, false, first.ID},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := s.Manifest(job, tt.of)
			if err != nil {
				t.Fatal(err)
			}
			got := ""
			if b := a.releaseBase(m, tt.urgent); b != nil {
				got = b.ID
			}
			if got != tt.want {
				t.Errorf("release base of %s = %q, want %q", tt.of, got, tt.want)
			}
		})
	}
	if f := a.restoreFloor(job); f == nil || f.ID != first.ID {
		t.Errorf("restore floor = %v, want %s (the replicated snapshot before the newest)", f, first.ID)
	}
	if f := a.restoreFloor("other-00000000"); f != nil {
		t.Errorf("restore floor of a job without snapshots = %s, want none", f.ID)
	}
}

// TestPolicyAppliesIntervalFloor: a job record that asks for an interval below this agent's floor (a
// restored job's record comes from another node) gets the agent's interval instead.
func TestPolicyAppliesIntervalFloor(t *testing.T) {
	cfg := Config{}
	cfg.Checkpoint.Interval = Interval{Fixed: time.Minute}
	cfg.Checkpoint.MinInterval = Duration{Duration: time.Second}
	a := &Agent{cfg: cfg, log: slog.New(slog.DiscardHandler), byID: map[string]*Job{}, policies: map[string]*interval.Policy{}}
	a.byID["fast-00000001"] = &Job{ID: "fast-00000001", Spec: JobSpec{Interval: "1ms"}}
	a.byID["slow-00000001"] = &Job{ID: "slow-00000001", Spec: JobSpec{Interval: "5s"}}
	if got := a.policyFor("fast-00000001").Interval(); got != time.Minute {
		t.Errorf("a job asking for 1ms below a 1s floor runs every %s, want the agent's 1m", got)
	}
	if got := a.policyFor("slow-00000001").Interval(); got != 5*time.Second {
		t.Errorf("a job asking for 5s runs every %s", got)
	}
}
