package agent

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/metrics"
	"github.com/ftkit/ftkit/ring"
)

// The failure log comes from other members too: stage names outside the known set become "other" (labels
// stay bounded), and only finished stages have a duration.
func TestMetricsFailures(t *testing.T) {
	t0 := time.Date(2026, 11, 23, 10, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	tests := []struct {
		name string
		f    Failure
		want metrics.Failure
	}{
		{
			name: "done: stages and the whole recovery",
			f: Failure{Detected: t0, Done: true, Stages: []Stage{
				{Name: StageDetected, Start: t0, End: t0},
				{Name: StageFetched, Start: at(1), End: at(3)},
				{Name: StageProtected, Start: at(3), End: at(4.5)},
			}},
			want: metrics.Failure{Done: true, Duration: 4500 * time.Millisecond, Stages: []metrics.Stage{
				{Name: StageDetected}, {Name: StageFetched, Duration: 2 * time.Second, Seq: 1}, {Name: StageProtected, Duration: 1500 * time.Millisecond, Seq: 2},
			}},
		},
		{
			name: "running: an unfinished stage has no duration, no total yet",
			f: Failure{Detected: t0, Stages: []Stage{
				{Name: StageDetected, Start: t0, End: t0},
				{Name: StageRestored, Start: at(2)},
			}},
			want: metrics.Failure{Stages: []metrics.Stage{{Name: StageDetected}}},
		},
		{
			name: "failed, with a stage name this version does not know",
			f: Failure{Detected: t0, Done: true, Error: "no replica", Stages: []Stage{
				{Name: "weird\nname", Start: t0, End: at(1)},
			}},
			want: metrics.Failure{Done: true, Failed: true, Duration: time.Second, Stages: []metrics.Stage{{Name: "other", Duration: time.Second}}},
		},
		{
			// The bounded log dropped 5 stages after the first: the newer ones keep their place in the
			// timeline, so that the histograms do not count them again (metrics: Stage.Seq).
			name: "stages dropped by the bounded log",
			f: Failure{Detected: t0, StagesDropped: 5, Stages: []Stage{
				{Name: StageDetected, Start: t0, End: t0},
				{Name: StageRestored, Start: at(1), End: at(2)},
			}},
			want: metrics.Failure{Stages: []metrics.Stage{{Name: StageDetected}, {Name: StageRestored, Duration: time.Second, Seq: 6}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := metricsFailures([]*Failure{&tt.f})
			if len(got) != 1 {
				t.Fatalf("%d failures", len(got))
			}
			g := got[0]
			if g.Done != tt.want.Done || g.Failed != tt.want.Failed || g.Duration != tt.want.Duration || len(g.Stages) != len(tt.want.Stages) {
				t.Fatalf("got %+v, want %+v", g, tt.want)
			}
			for i := range g.Stages {
				if g.Stages[i] != tt.want.Stages[i] {
					t.Errorf("stage %d: %+v, want %+v", i, g.Stages[i], tt.want.Stages[i])
				}
			}
		})
	}
}

// TestMetricsFencedNotLost: a copy this host killed because the job goes on elsewhere (self-fenced, or a copy
// of this host's failed incarnation dropped at rejoin) is not a lost job: ftkit_jobs{state="lost"} rising is
// the alert for a job that vanished, and every recovered job would fire it on the host it left.
func TestMetricsFencedNotLost(t *testing.T) {
	ta := newTestAgent(t)
	ta.mu.Lock()
	ta.byID[ownersJob].State, ta.byID[ownersJob].Fenced = JobLost, true
	ta.byID[rootsJob].State = JobLost
	ta.mu.Unlock()
	byState := map[string]int{}
	for _, j := range (metricsSource{ta.Agent}).MetricsState().Jobs {
		byState[j.State]++
	}
	if byState["lost"] != 1 || byState["fenced"] != 1 {
		t.Errorf("jobs by state %v, want 1 lost (the one that vanished) and 1 fenced (it runs elsewhere)", byState)
	}
}

// TestMetricsReplicaHoldersFailed: a job whose every replica holder has failed is not replicated, as
// `ftctl status` says (UNPROTECTED (replica holders ... failed)): a failure of this host now loses it.
// It was counted as replicated, with its replica's age, and ftkit_jobs_unreplicated stayed 0.
func TestMetricsReplicaHoldersFailed(t *testing.T) {
	tests := []struct {
		name       string
		holders    []string
		replicated bool
	}{
		{"held by a live member", []string{"node2"}, true},
		{"every holder failed", []string{"node3"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ta := newTestAgent(t)
			v := ta.View()
			v.Members = append(slices.Clone(v.Members), ring.Member{Name: "node3", Address: netip.MustParseAddrPort("127.0.0.3:1"), Role: ring.RoleNode, State: ring.StateFailed})
			v.Epoch++
			if _, err := ta.adoptView(v); err != nil {
				t.Fatal(err)
			}
			ta.mu.Lock()
			ta.byID[ownersJob].Replica = &Replica{Snapshot: ta.ownSnap, Time: time.Now(), Node: ta.cfg.Name, Holders: tt.holders}
			ta.mu.Unlock()
			for _, j := range (metricsSource{ta.Agent}).MetricsState().Jobs {
				if j.ID == ownersJob && j.Replicated != tt.replicated {
					t.Errorf("job replicated on %v: Replicated %v, want %v", tt.holders, j.Replicated, tt.replicated)
				}
			}
		})
	}
}

// TestMetricsSelfFenceIsNoRecovery: a node's record of fencing itself (its jobs killed, to be restored by
// its protector's recovery, a timeline of its own) is no recovery: counted, one node failure was two done
// recoveries in ftkit_recoveries, and ftkit_recovery_seconds took the milliseconds of the kill for the
// duration of one. Its stage still counts, under self-fenced.
func TestMetricsSelfFenceIsNoRecovery(t *testing.T) {
	ta := newTestAgent(t)
	for _, id := range []string{ownersJob, rootsJob} {
		if err := os.WriteFile(filepath.Join(ta.layout().cgroup(id), "cgroup.kill"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if ok, _ := ta.fenceJobs(ta.runningJobs(), 4*time.Second, "no contact with node2 for 4s"); !ok {
		t.Fatal("fenceJobs found no job to kill")
	}
	mfs, err := metrics.New(metricsSource{ta.Agent}).Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			key := mf.GetName()
			for _, l := range m.GetLabel() {
				key += "{" + l.GetValue() + "}"
			}
			if h := m.GetHistogram(); h != nil {
				got[key] = float64(h.GetSampleCount())
			} else {
				got[key] = m.GetGauge().GetValue()
			}
		}
	}
	for key, want := range map[string]float64{
		"ftkit_recoveries{done}":                                0,
		"ftkit_recoveries{running}":                             0,
		"ftkit_recovery_seconds":                                0,
		"ftkit_recovery_stage_seconds{" + StageSelfFenced + "}": 1,
	} {
		if got[key] != want {
			t.Errorf("%s = %v, want %v", key, got[key], want)
		}
	}
}
