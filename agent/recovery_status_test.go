package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/internal/testenv"
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

// TestRecoveryStatusFitsItsReader: the target's answer about a recovery of as many jobs as one request
// names (four stages each: fetched, rewritten, restored, replayed) must fit the bound its reader sets
// (clusterapi.MaxMessage), and keep the outcome and the newest stages. Until the fix it carried every stage:
// the coordinator refused the answer as too long, took the target for silent, and reported the jobs' fate
// unknown (rolling their runs back in auto mode) while the target had restored them.
func TestRecoveryStatusFitsItsReader(t *testing.T) {
	for _, tt := range []struct {
		name   string
		jobs   int
		errLen int
	}{
		{"few jobs", 3, 0},
		{"a full request", clusterapi.MaxRecoverJobs, 0},
		{"a full request that failed", clusterapi.MaxRecoverJobs, 600 << 10}, // some 600 bytes of error per job
	} {
		t.Run(tt.name, func(t *testing.T) {
			a := resumeTestAgent(t)
			rec := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3", Done: true,
				Error: strings.Repeat("e", tt.errLen)}
			at := time.Date(2025, 1, 1, 0, 0, 1, 123456789, time.UTC)
			for i := range tt.jobs {
				job := fmt.Sprintf("rank%d-%08x", i, i)
				for _, name := range []string{"fetched", "rewritten", "restored", "replayed"} {
					rec.Stages = append(rec.Stages, Stage{Name: name, Job: job, Host: "spare1", Start: at, End: at,
						Detail: fmt.Sprintf("512 MB from node2 (snapshot 20250101T000000.000-node2-%08x, incarnation 2); 3 connection(s): 0 bytes injected, 123456 bytes to re-send", i)})
				}
			}
			if err := saveRecovery(a.cfg.StateDir, rec); err != nil {
				t.Fatal(err)
			}
			st := a.serveRecoveryStatus("node3", clusterapi.RecoveryStatusRequest{Failure: rec.Failure})
			b, err := json.Marshal(st)
			if err != nil {
				t.Fatal(err)
			}
			if len(b) > clusterapi.MaxMessage {
				t.Fatalf("status of a recovery of %d jobs is %d bytes: more than the %d its reader takes", tt.jobs, len(b), clusterapi.MaxMessage)
			}
			var stages []Stage
			if err := json.Unmarshal(st.Stages, &stages); err != nil {
				t.Fatalf("stages: %v", err)
			}
			if !st.Known || !st.Done || (tt.errLen > 0) != (st.Error != "") || len(stages) == 0 || stages[len(stages)-1].Job != rec.Stages[len(rec.Stages)-1].Job {
				t.Errorf("status known %v, done %v, error of %d bytes, %d stages; want the outcome and the newest stages", st.Known, st.Done, len(st.Error), len(stages))
			}
			if tt.jobs < 10 && len(stages) != len(rec.Stages) {
				t.Errorf("%d of %d stages answered; want all", len(stages), len(rec.Stages))
			}
		})
	}
}

// doneScript is a recovery's target that answers that the recovery is done, with stages.
type doneScript struct {
	clusterapi.Service
	stages []Stage
}

func (s *doneScript) RecoveryStatus(_ context.Context, _ string, q clusterapi.RecoveryStatusRequest) (clusterapi.RecoveryStatusReply, error) {
	b, err := json.Marshal(s.stages)
	if err != nil {
		return clusterapi.RecoveryStatusReply{}, err
	}
	return clusterapi.RecoveryStatusReply{Failure: q.Failure, Known: true, Done: true, Stages: b, Running: q.Jobs}, nil
}

// TestBrokenStreamRelaysNoStageTwice: the stages a coordinator had from the progress stream before it broke
// are not relayed again from the target's answer, though its bounded failure log dropped the older ones
// (it keeps the first and the newest failurelog.MaxStages-1). They were appended again, out of order:
// `ftctl events` showed them twice and ftkit_recovery_stage_seconds counted them twice.
func TestBrokenStreamRelaysNoStageTwice(t *testing.T) {
	at := time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)
	const jobs = failurelog.MaxStages + 8
	var onTarget []Stage // what the stream brought, all of it, and what the target answers
	for i := range jobs {
		onTarget = append(onTarget, Stage{Name: StageFetched, Job: fmt.Sprintf("job-%d", i), Host: "s1",
			Start: at.Add(time.Duration(i) * time.Second), End: at.Add(time.Duration(i+1) * time.Second)})
	}
	onTarget = append(onTarget, Stage{Name: StageRestored, Job: "job-0", Host: "s1", Start: at.Add(time.Hour), End: at.Add(time.Hour + time.Second)})
	pki := newTestPKI(t)
	port := scriptedPeer(t, pki, "s1", &doneScript{stages: onTarget})
	a, logs := clientAgent(t, pki, map[string]uint16{"s1": port})
	req := RecoverRequest{Failure: "n3-20261207T000000.000", Failed: "n3", Jobs: []RecoverJob{{Job: "job-0"}}}
	a.failures.Update(req.Failure, func(f *Failure) {
		f.Node, f.Protector, f.Target, f.Jobs = "n3", "n1", "s1", []string{"job-0"}
		f.Stages = append([]Stage{{Name: StageDetected, Host: "n1", Start: at, End: at}}, onTarget[:jobs]...)
	})
	var emitted []Stage
	var err error
	testenv.ReturnsWithin(t, failAfter, func() {
		err = a.afterBrokenStream(t.Context(), "s1", req, func(s Stage) { emitted = append(emitted, s) }, errors.New("progress stream ended: a network blip"))
	})
	if err != nil {
		t.Fatalf("the recovery the target finished ended with %v; log:\n%s", err, logs.String())
	}
	if len(emitted) != 1 || emitted[0] != onTarget[jobs] {
		t.Errorf("relayed %d stages (%+v); want only the one the stream had not brought, %+v", len(emitted), emitted[:min(len(emitted), 2)], onTarget[jobs])
	}
}
