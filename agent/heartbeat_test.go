package agent

import "testing"

func TestJudge(t *testing.T) {
	for _, tt := range []struct {
		name string
		p    probed
		want verdict
		why  string
	}{
		{"agent answers", probed{agentAlive: true, why: "its agent answered a direct probe", hostAnswers: true}, verdictCleared, "its agent answered a direct probe"},
		{"nothing answers: crashed or cut off", probed{}, verdictFailed, ""},
		{"nothing answers, with a fence command", probed{fenceCommand: true}, verdictFailed, ""},
		// The agent hung, stopped or starved on a live host: its jobs may run on, and it will not fence itself.
		{"host answers, agent does not", probed{hostAnswers: true}, verdictUnresponsive, ""},
		{"host answers, agent does not, fence command", probed{hostAnswers: true, fenceCommand: true}, verdictFailed, ""},
		{"busy, host answers", probed{inGrace: true, hostAnswers: true}, verdictBusy, ""},
		{"busy, agent answers", probed{inGrace: true, agentAlive: true}, verdictBusy, ""},
		{"busy, host answers, fence command", probed{inGrace: true, hostAnswers: true, fenceCommand: true}, verdictBusy, ""},
		{"busy, nothing answers", probed{inGrace: true}, verdictFailed, ""},
		{"beat during confirmation", probed{heard: true, hostAnswers: true}, verdictCleared, "it sent a heartbeat during confirmation"},
		{"this agent stalled", probed{stalled: true}, verdictCleared, "this agent itself stalled while measuring the silence or probing (starved host?); not evidence"},
		{"this agent stalled, host answers", probed{stalled: true, hostAnswers: true}, verdictCleared, "this agent itself stalled while measuring the silence or probing (starved host?); not evidence"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, why := judge(tt.p)
			if got != tt.want || why != tt.why {
				t.Errorf("judge(%+v) = %d, %q; want %d, %q", tt.p, got, why, tt.want, tt.why)
			}
		})
	}
}
