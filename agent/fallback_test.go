package agent

import (
	"log/slog"
	"testing"
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
