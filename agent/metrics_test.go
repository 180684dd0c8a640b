package agent

import (
	"testing"
	"time"

	"github.com/ftkit/ftkit/metrics"
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
