package agent

import (
	"bytes"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/detect"
)

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

// A member's beat may list tens of thousands of uncovered jobs (a 1 MiB line): the protector logs the new
// ones it can tell apart, a bounded number of lines, not one per entry, and stays quiet on a repeat.
func TestBeatUncoveredLogBounded(t *testing.T) {
	ta := newTestAgent(t)
	var logs bytes.Buffer
	ta.log = slog.New(slog.NewTextHandler(&logs, nil))
	ta.watchdog = detect.NewWatchdog(detect.Config{Timeout: time.Hour})
	svc := peerService{ta.Agent}
	lines := func() []string {
		out := strings.Split(strings.TrimSpace(logs.String()), "\n")
		logs.Reset()
		if len(out) == 1 && out[0] == "" {
			return nil
		}
		return out
	}

	honest := []detect.Uncovered{{Job: "j-1", Replica: "s1"}, {Job: "j-2", Replica: "s2"}}
	svc.Beat("node2", detect.Beat{From: "node2", Seq: 1, Run: 1, Sent: time.Now(), Uncovered: honest})
	if got := lines(); len(got) != len(honest) || !strings.Contains(got[0], "a job of the member has connections its replica lacks") {
		t.Fatalf("an honest beat with %d uncovered jobs logged %q, want a line each", len(honest), got)
	}
	svc.Beat("node2", detect.Beat{From: "node2", Seq: 2, Run: 1, Sent: time.Now(), Uncovered: honest})
	if got := lines(); len(got) != 0 {
		t.Fatalf("the same uncovered jobs again logged %q, want nothing", got)
	}

	const n = 38000
	many := make([]detect.Uncovered, n)
	for i := range many {
		many[i] = detect.Uncovered{Job: fmt.Sprintf("job-%08d", i), Replica: "snap"}
	}
	svc.Beat("node2", detect.Beat{From: "node2", Seq: 3, Run: 1, Sent: time.Now(), Uncovered: many})
	got := lines()
	if len(got) > maxUncoveredLogged+1 {
		t.Fatalf("a beat of %d new uncovered jobs logged %d lines, want at most %d", n, len(got), maxUncoveredLogged+1)
	}
	if want := fmt.Sprintf("not_logged=%d", n-maxUncoveredLogged); !strings.Contains(got[len(got)-1], want) {
		t.Fatalf("last line %q does not count the jobs not logged (%s)", got[len(got)-1], want)
	}
}

// A member's beat may name ~250,000 jobs in a 1 MiB line, the same one many times, or names no job has: the
// protector keeps each valid name once, at most maxBeatJobs (what one recovery restores), and counts the
// rest for the fail-over to report. Every listed job cost the fail-over a question to every alive member.
func TestBeatJobsBoundedAtReceipt(t *testing.T) {
	ta := newTestAgent(t)
	ta.watchdog = detect.NewWatchdog(detect.Config{Timeout: time.Hour})
	svc := peerService{ta.Agent}

	honest := []string{"j-1", "j-2", "j-3"}
	svc.Beat("node2", detect.Beat{From: "node2", Seq: 1, Run: 1, Sent: time.Now(), Jobs: honest})
	if b, _, _ := ta.watchdog.Last("node2"); !slices.Equal(b.Jobs, honest) || b.Unlisted != 0 {
		t.Fatalf("an honest beat's jobs kept as %q (%d not listed), want %q", b.Jobs, b.Unlisted, honest)
	}

	const extra = 5
	var many, want []string
	for i := range maxBeatJobs + extra {
		j := fmt.Sprintf("job-%06d", i)
		many = append(many, j, j, "../"+j, "") // each once more, and names no job has
		if i < maxBeatJobs {
			want = append(want, j)
		}
	}
	svc.Beat("node2", detect.Beat{From: "node2", Seq: 2, Run: 1, Sent: time.Now(), Jobs: many})
	b, _, _ := ta.watchdog.Last("node2")
	if !slices.Equal(b.Jobs, want) {
		t.Fatalf("a beat of %d entries kept %d jobs, want the first %d valid names once each", len(many), len(b.Jobs), len(want))
	}
	if b.Unlisted != extra {
		t.Fatalf("a beat naming %d jobs past the bound counted %d not listed", extra, b.Unlisted)
	}
}

// A member's beat may say it is busy with a 1 MiB string, which a busy suspicion logs every heartbeat
// timeout: the protector keeps a bounded prefix (still busy, so its grace holds), and the known values whole.
func TestBeatBusyBoundedAtReceipt(t *testing.T) {
	ta := newTestAgent(t)
	ta.watchdog = detect.NewWatchdog(detect.Config{Timeout: time.Hour})
	svc := peerService{ta.Agent}
	for i, tc := range []struct {
		busy, want string
	}{
		{detect.BusyCheckpoint, detect.BusyCheckpoint},
		{detect.BusyRestore, detect.BusyRestore},
		{"", ""},
		{strings.Repeat("x", 1<<19), strings.Repeat("x", maxBusy)},
		{strings.Repeat("x", maxBusy-1) + "é", strings.Repeat("x", maxBusy-1)}, // not cut inside a character
	} {
		svc.Beat("node2", detect.Beat{From: "node2", Seq: uint64(i + 1), Run: 1, Sent: time.Now(), Busy: tc.busy})
		if b, _, _ := ta.watchdog.Last("node2"); b.Busy != tc.want {
			t.Errorf("a beat busy with %d bytes kept %d bytes (%.40q), want %q", len(tc.busy), len(b.Busy), b.Busy, tc.want)
		}
	}
}
