package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
)

// TestPrintFailure: the offsets count from the last heartbeat, or, for a node never heard (a ring change
// made it the protector's predecessor just before it failed), from when the detection's silence began;
// they were printed from the zero time (+9223372036.855s).
func TestPrintFailure(t *testing.T) {
	t0 := time.Date(2026, 11, 29, 4, 6, 50, 0, time.UTC)
	stages := []agent.Stage{
		{Name: agent.StageDetected, Host: "node3", Start: t0, End: t0.Add(time.Second)},
		{Name: agent.StageClaimed, Host: "spare2", Start: t0.Add(time.Second), End: t0.Add(1500 * time.Millisecond)},
	}
	for _, tc := range []struct {
		name string
		f    agent.Failure
		want []string
	}{
		{"from the last beat", agent.Failure{ID: "f1", Node: "spare1", Target: "spare2", LastBeat: t0, Stages: stages, Done: true},
			[]string{"+  1.000s  detected", "+  1.500s  spare claimed", "total from the last heartbeat: 1.5s"}},
		{"never heard", agent.Failure{ID: "f2", Node: "spare1", Target: "spare2", Stages: stages, Done: true},
			[]string{"+  1.000s  detected", "+  1.500s  spare claimed", "total from the last heartbeat: 1.5s"}},
		{"taken over", agent.Failure{ID: "f3", Node: "node2", Target: "spare1", LastBeat: t0, Stages: stages, Done: true,
			Error: "recovery on spare1: the recovery's target failed", TakenOver: "spare1-x"},
			[]string{"NOT RECOVERED", "error: recovery on spare1", "taken over by the recovery of failure spare1-x"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			printFailure(&b, &tc.f)
			for _, w := range tc.want {
				if !strings.Contains(b.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, b.String())
				}
			}
		})
	}
}
