package agent

import (
	"testing"
	"time"
)

func TestFailureLogMergeKeepsNewest(t *testing.T) {
	dir := t.TempDir()
	l, err := openFailureLog(dir)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	l.update("n2-1", func(f *Failure) {
		f.Node, f.Detected = "node2", t0
		f.Stages = append(f.Stages, Stage{Name: StageDetected, Start: t0.Add(-time.Second), End: t0})
	})
	older := &Failure{ID: "n2-1", Node: "node2", Detected: t0, Updated: t0.Add(-time.Hour)}
	newer := &Failure{ID: "n2-1", Node: "node2", Detected: t0, Updated: time.Now().Add(time.Hour), Done: true,
		Stages: []Stage{{Name: StageDetected}, {Name: StageRestored}}}
	other := &Failure{ID: "n4-1", Node: "node4", Detected: t0.Add(time.Minute), Updated: t0}
	tests := []struct {
		name       string
		in         *Failure
		wantStages int
		wantDone   bool
	}{
		{"an older copy does not replace ours", older, 1, false},
		{"a newer copy does", newer, 2, true},
		{"nil is ignored", nil, 2, true},
	}
	for _, tt := range tests {
		l.merge(tt.in)
		got := l.list()[0]
		if len(got.Stages) != tt.wantStages || got.Done != tt.wantDone {
			t.Errorf("%s: %d stages, done %v; want %d, %v", tt.name, len(got.Stages), got.Done, tt.wantStages, tt.wantDone)
		}
	}
	l.merge(other)
	// A copy handed out is not the stored one.
	l.list()[0].Stages[0].Name = "changed"
	if err := l.save(); err != nil {
		t.Fatal(err)
	}
	back, err := openFailureLog(dir)
	if err != nil {
		t.Fatal(err)
	}
	got := back.list()
	if len(got) != 2 || got[0].ID != "n2-1" || got[1].ID != "n4-1" || got[0].Stages[0].Name != StageDetected {
		t.Fatalf("after reload: %+v", got)
	}
}
