package agent

import (
	"log/slog"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
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

// TestRestoreFloorIgnoresOtherHostsClock: a job restored here from another host's snapshot runs on with
// that host's snapshots of it still in the store (copies received as its protector, or fetched for the
// restore). A restore after this host fails starts from this host's own snapshots only, so those alone
// make the floor: the other host's, dated by its clock, must not pass for newer than this host's own
// because that clock is ahead (the floor then named a stale snapshot dated in this host's future, the log
// watermark became "now", and peers freed bytes a restore from this host's own snapshot needs).
func TestRestoreFloorIgnoresOtherHostsClock(t *testing.T) {
	const job = "counter-1a2b3c4d"
	start := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		skew    time.Duration // of the job's earlier host's clock
		own     int           // snapshots this host took of the job since its restore, all replicated
		wantOwn int           // index into them of the floor; -1 for none
	}{
		{"earlier host's clock an hour ahead", time.Hour, 2, 0},
		{"earlier host's clock an hour behind", -time.Hour, 2, 0},
		{"clocks agree", 0, 2, 0},
		{"one own snapshot is the floor", time.Hour, 1, 0},
		{"none replicated here yet: the job counts from its start", time.Hour, 0, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			var now time.Time
			open := func(node string) *ckpt.Store {
				s, err := ckpt.Open(dir, ckpt.Options{Node: node, Now: func() time.Time { return now }})
				if err != nil {
					t.Fatal(err)
				}
				return s
			}
			earlier, here := open("node1"), open("spare1")
			// node1 ran the job and shipped its snapshots here; it failed, and the job was restored here.
			for i := range 2 {
				now = start.Add(time.Duration(i) * time.Minute).Add(tt.skew)
				m := testSnapshot(t, earlier, job, "node1")
				if _, err := here.AddReplica(job, m.ID, "node1"); err != nil {
					t.Fatal(err)
				}
			}
			var own []string
			for i := range tt.own {
				now = start.Add(time.Duration(5+i) * time.Minute)
				m := testSnapshot(t, here, job, "spare1")
				if _, err := here.AddReplica(job, m.ID, "node3"); err != nil {
					t.Fatal(err)
				}
				own = append(own, m.ID)
			}
			a := &Agent{store: here, log: slog.New(slog.DiscardHandler)}
			a.cfg.Name = "spare1"
			got := ""
			if f := a.restoreFloor(job); f != nil {
				got = f.ID
			}
			want := ""
			if tt.wantOwn >= 0 {
				want = own[tt.wantOwn]
			}
			if got != want {
				t.Errorf("restore floor = %q, want %q (this host's own replicated snapshot before its newest; none if it has none)", got, want)
			}
		})
	}
}
