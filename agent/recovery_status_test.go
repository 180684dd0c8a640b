package agent

import (
	"context"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/coordinated"
)

func TestRunningSummary(t *testing.T) {
	tests := []struct {
		jobs, running []string
		want          string
	}{
		{[]string{"a", "b"}, []string{"a", "b"}, "job(s) a, b run there"},
		{[]string{"a", "b"}, []string{"b"}, "job(s) b run there; job(s) a do NOT run there"},
		{[]string{"a"}, nil, "job(s) a do NOT run there"},
	}
	for _, tt := range tests {
		if got := runningSummary(tt.jobs, tt.running); got != tt.want {
			t.Errorf("runningSummary(%v, %v) = %q, want %q", tt.jobs, tt.running, got, tt.want)
		}
	}
}

// TestCloseLeftFailovers: a restarted agent ends the timelines of the node-failure recoveries its
// predecessor coordinated and left under way. One that had reached no target restored nothing and says so;
// one whose target does not answer (here: the caller goes at once) says whether its jobs run is unknown.
// Before, nothing ended them: `ftctl events` showed them recovering and ftkit_recoveries{state="running"}
// counted them for good, and jobs restored nowhere were never reported.
func TestCloseLeftFailovers(t *testing.T) {
	ta := newTestAgent(t)
	open := func(id string, fn func(*Failure)) {
		ta.failures.Update(id, func(f *Failure) {
			f.Node, f.Protector, f.Jobs = "node3", "node1", []string{"j-00000001"}
			f.Stages = append(f.Stages, Stage{Name: StageDetected, Host: "node1"})
			fn(f)
		})
	}
	open("no-target", func(f *Failure) {})
	open("on-node2", func(f *Failure) { f.Target = "node2" })
	open("others", func(f *Failure) { f.Protector, f.Target = "node2", "node2" })
	open("ended", func(f *Failure) { f.Target, f.Done = "node2", true })
	open("migration", func(f *Failure) { f.Kind, f.Node, f.Target = KindMigration, "node1", "node2" })

	ctx, cancel := context.WithCancel(t.Context())
	cancel() // the target is not waited for
	n, wait := ta.closeLeftFailovers(ctx)
	wait()
	if n != 1 {
		t.Errorf("followed %d recoveries on their targets, want 1", n)
	}
	byID := map[string]*Failure{}
	for _, f := range ta.failures.List() {
		byID[f.ID] = f
	}
	for _, tt := range []struct {
		id   string
		done bool
		want string // in the error
	}{
		{"no-target", true, "j-00000001 of node3 were NOT restored"},
		{"on-node2", true, "whether job(s) j-00000001 run there is unknown"},
		{"others", false, ""},    // another protector's: its to end
		{"ended", true, ""},      // untouched
		{"migration", false, ""}, // resumeMigrations' to end
	} {
		f := byID[tt.id]
		if f == nil {
			t.Fatalf("timeline %s is gone", tt.id)
		}
		if f.Done != tt.done || (tt.want == "") != (f.Error == "") || !strings.Contains(f.Error, tt.want) {
			t.Errorf("timeline %s: done %v, error %q; want done %v, error saying %q", tt.id, f.Done, f.Error, tt.done, tt.want)
		}
	}
	for _, mf := range metricsFailures([]*Failure{byID["no-target"], byID["on-node2"]}) {
		if !mf.Done || !mf.Failed {
			t.Errorf("metrics report a left recovery as done %v, failed %v; want it failed", mf.Done, mf.Failed)
		}
	}
}

// TestCloseLeftRollbacks: a restarted agent ends the rollbacks its predecessor coordinated and left under
// way. One past its prepare phase may have stopped every job of the run and restored none: its event says
// the run's jobs may run nowhere and how to bring them back; one that ended well but was not marked so is
// closed as rolled back; one that stopped nothing says so. A failure's recovery whose run's rollback was left
// after its stop names the run too. Before, closeLeftFailovers skipped every event with a Kind: `ftctl
// events` showed the rollback under way for good, and a run killed on every host was reported nowhere.
func TestCloseLeftRollbacks(t *testing.T) {
	ta := newTestAgent(t)
	detail := "run farm, cut cut-20260101T000000.000"
	stage := func(name string) Stage { return Stage{Name: name, Host: "node1,node2", Detail: detail} }
	open := func(id string, fn func(*Failure)) {
		ta.failures.Update(id, func(f *Failure) {
			f.Kind, f.Node, f.Protector, f.Jobs = coordinated.KindRollback, "node1", "node1", []string{"j-00000001", "j-00000002"}
			fn(f)
		})
	}
	open("farm-rollback-stopped", func(f *Failure) {
		f.Stages = append(f.Stages, stage(coordinated.StagePrepared), stage(coordinated.StageStopped))
	})
	open("farm-rollback-mid-stop", func(f *Failure) { f.Stages = append(f.Stages, stage(coordinated.StagePrepared)) })
	open("farm-rollback-restored", func(f *Failure) {
		f.Stages = append(f.Stages, stage(coordinated.StagePrepared), stage(coordinated.StageStopped), stage(coordinated.StageRolledBack))
	})
	open("farm-rollback-preparing", func(f *Failure) {})
	open("farm-rollback-others", func(f *Failure) { f.Node, f.Protector = "node2", "node2" })
	ta.failures.Update("failure", func(f *Failure) {
		f.Node, f.Protector, f.Target, f.Jobs = "node3", "node1", "node2", []string{"j-00000003"}
		f.Stages = append(f.Stages, Stage{Name: StageDetected, Host: "node1"}, stage(coordinated.StagePrepared))
	})

	ctx, cancel := context.WithCancel(t.Context())
	cancel() // the target is not waited for
	_, wait := ta.closeLeftFailovers(ctx)
	wait()
	byID := map[string]*Failure{}
	for _, f := range ta.failures.List() {
		byID[f.ID] = f
	}
	for _, tt := range []struct {
		id   string
		done bool
		want []string // in the error
	}{
		{"farm-rollback-stopped", true, []string{"NOT rolled back (run farm, cut cut-20260101T000000.000)", "j-00000001, j-00000002 may run nowhere", "`ftctl rollback --run farm`"}},
		{"farm-rollback-mid-stop", true, []string{"may run nowhere", "`ftctl rollback --run farm`"}},
		{"farm-rollback-restored", true, nil},
		{"farm-rollback-preparing", true, []string{"before any job of the run stopped", "`ftctl rollback --run farm`"}},
		{"farm-rollback-others", false, nil}, // another member's
		{"failure", true, []string{"whether job(s) j-00000003 run there is unknown", "NOT rolled back (run farm", "j-00000003 of node3 and the run's jobs on its other hosts may run nowhere"}},
	} {
		f := byID[tt.id]
		if f == nil {
			t.Fatalf("timeline %s is gone", tt.id)
		}
		if f.Done != tt.done || (len(tt.want) == 0) != (f.Error == "") {
			t.Errorf("timeline %s: done %v, error %q; want done %v, error saying %q", tt.id, f.Done, f.Error, tt.done, tt.want)
		}
		for _, w := range tt.want {
			if !strings.Contains(f.Error, w) {
				t.Errorf("timeline %s: error %q does not say %q", tt.id, f.Error, w)
			}
		}
	}
}
