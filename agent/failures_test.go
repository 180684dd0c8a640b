package agent

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/ring"
)

// TestViewMessageFitsWithManyFailures: however many failures with however many stages the log was given,
// the view message an agent sends fits the body a peer reads (at most maxMessage bytes), and it
// carries the newest failures: all that the log keeps when they look like real recoveries, fewer when
// every text is as long, and as expensive to encode, as can be.
func TestViewMessageFitsWithManyFailures(t *testing.T) {
	tests := []struct {
		name         string
		failures     int
		stages, jobs int
		text         string
		ident        string // names of jobs and hosts
		wantAll      bool   // every failure the log keeps (100) is in the message
	}{
		// Five stages per job, two jobs, short details: what recoveries write.
		{"realistic recoveries", 300, 12, 2, "restored 1 job(s) from snapshot 20261122T100000.000-0001 in 812 ms", "rank1-0123abcd", true},
		// "<&>" is escaped by encoding/json to six bytes a character; every name and text is longer than
		// the log keeps: a single failure must still fit.
		{"every text as long as can be", 300, 60, 400, strings.Repeat("<&>", 700), strings.Repeat("<", 200), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := failurelog.Open(t.TempDir(), "")
			if err != nil {
				t.Fatal(err)
			}
			t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
			for i := range tt.failures {
				id := fmt.Sprintf("node2-%04d", i)
				l.Update(id, func(f *Failure) {
					f.Node, f.Detected, f.Error = "node2", t0.Add(time.Duration(i)*time.Second), tt.text
					for j := range tt.jobs {
						f.Jobs = append(f.Jobs, fmt.Sprintf("%d-%s", j, tt.ident))
					}
				})
				for range tt.stages {
					l.Update(id, func(f *Failure) {
						f.Stages = append(f.Stages, Stage{Name: StageRestored, Job: tt.ident, Host: tt.ident,
							Start: t0, End: t0.Add(time.Second), Detail: tt.text, Error: tt.text})
					})
				}
			}
			var ms []ring.Member
			for i := range 3 {
				ms = append(ms, ring.Member{Name: fmt.Sprintf("node%d", i+1), Role: ring.RoleNode, State: ring.StateAlive,
					Address: netip.MustParseAddrPort(fmt.Sprintf("10.0.0.%d:7946", i+1))})
			}
			v, err := ring.New(ms)
			if err != nil {
				t.Fatal(err)
			}
			a := &Agent{failures: l}
			a.members.view = v
			// The message as the protocol carries it: a body of at most maxMessage bytes.
			b, err := json.Marshal(a.viewMessage())
			if err != nil {
				t.Fatal(err)
			}
			size := len(b)
			if size > maxMessage {
				t.Fatalf("a view message of %d bytes, more than the %d a peer reads", size, maxMessage)
			}
			var msg viewMessage
			if err := json.Unmarshal(b, &msg); err != nil {
				t.Fatal(err)
			}
			var got struct{ Failures []*Failure }
			if got.Failures, err = decodeFailures(msg.Failures); err != nil {
				t.Fatalf("a view message of %d bytes cannot be read back: %v", size, err)
			}
			newest := fmt.Sprintf("node2-%04d", tt.failures-1)
			if len(got.Failures) == 0 || got.Failures[len(got.Failures)-1].ID != newest {
				t.Fatalf("view message (%d bytes) carries %d failures; want the newest, %s", size, len(got.Failures), newest)
			}
			if tt.wantAll && len(got.Failures) != 100 {
				t.Errorf("view message (%d bytes) carries %d failures, want all 100 the log keeps", size, len(got.Failures))
			}
			t.Logf("view message: %d bytes, %d failures", size, len(got.Failures))
		})
	}
}

// TestPeerTimelinesDoNotSteer: timelines a member sends in other members' names (buggy, restored from an
// old disk, its clock far ahead, or malicious) change nothing this agent does: its own recovery under
// way on spare1 is not marked done (the jobs would not be taken over when spare1 fails) and no made-up one
// in its name feeds a take-over; another protector's recovery under way is not marked done (its failed
// node would be admitted back mid-recovery); and made-up timelines by the hundred, dated after every real
// one, do not push this agent's own out of its log.
func TestPeerTimelinesDoNotSteer(t *testing.T) {
	ta := newTestAgent(t) // node1
	now := time.Now()
	ta.failures.Update("node2-1", func(f *Failure) {
		f.Node, f.Protector, f.Target, f.Detected, f.Jobs = "node2", "node1", "spare1", now, []string{"a"}
	})
	send := func(peer string, fs ...*Failure) {
		ta.serveView(peer, viewMessage{Failures: mustJSON(fs)})
	}
	send("node3", &Failure{ID: "node4-1", Node: "node4", Protector: "node3", Target: "spare2", Detected: now, Updated: now})
	if _, ok := ta.recoveryUnderWay("node4"); !ok {
		t.Fatal("node3's timeline of its recovery of node4 was not merged from node3")
	}

	future := now.Add(24 * 365 * time.Hour) // wins every merge by its stamp
	send("node5",
		&Failure{ID: "node2-1", Node: "node2", Protector: "node1", Target: "spare1", Jobs: []string{"a"}, Done: true, Updated: future},
		&Failure{ID: "node9-1", Node: "node9", Protector: "node1", Target: "spare1", Jobs: []string{"alien"}, Updated: future},
		&Failure{ID: "node4-1", Node: "node4", Protector: "node3", Target: "spare2", Done: true, Updated: future})
	for i := range 3 {
		var fs []*Failure
		for j := range failurelog.MaxFailures {
			fs = append(fs, &Failure{ID: fmt.Sprintf("made-up-%d-%d", i, j), Node: "node7", Protector: "node5", Done: true,
				Detected: future.Add(time.Duration(i*failurelog.MaxFailures+j) * time.Second), Updated: future})
		}
		send("node5", fs...)
	}

	if taken := ta.failures.TakeOver("node1", "spare1", "spare1-1"); len(taken) != 1 || taken["a"] != "node2" {
		t.Errorf("spare1's failure takes over %v; want job a of node2, whose recovery this agent coordinates, only", taken)
	}
	if _, ok := ta.recoveryUnderWay("node4"); !ok {
		t.Error("node4's recovery, which node3 coordinates, is over as node5 says it: node4 would be admitted back mid-recovery")
	}
}

// A peer's view pushes each carrying its timeline with a newer update time do not each rewrite the whole
// failure log on disk (up to ~11 MB, fsynced): a recovery under way that this host did not know of is on
// disk before the reply, later updates are written together by the next flush.
func TestMergedFailuresSavesCoalesced(t *testing.T) {
	ta := newTestAgent(t)
	onDisk := func() *Failure {
		t.Helper()
		l, err := failurelog.Open(ta.cfg.StateDir, ta.cfg.Name)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range l.List() {
			if f.ID == "node3-1" {
				return f
			}
		}
		return nil
	}
	start := time.Now()
	timeline := func(stages int) *Failure {
		f := &Failure{ID: "node3-1", Node: "node3", Protector: "node2", Target: "node4", Detected: start,
			Updated: start.Add(time.Duration(stages) * time.Second)}
		for i := range stages {
			f.Stages = append(f.Stages, Stage{Name: fmt.Sprintf("stage-%d", i), Host: "node4", Start: start, End: start})
		}
		return f
	}

	if err := ta.mergeFailures("node2", []*Failure{timeline(1)}); err != nil {
		t.Fatal(err)
	}
	if f := onDisk(); f == nil || len(f.Stages) != 1 {
		t.Fatalf("a recovery under way merged from its protector is not on disk at once: %+v", f)
	}
	const pushes = 20
	for i := 2; i <= pushes; i++ {
		if err := ta.mergeFailures("node2", []*Failure{timeline(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if f := onDisk(); f == nil || len(f.Stages) != 1 {
		t.Fatalf("%d updates of a known timeline rewrote the failure log each (%+v on disk), want them written together later",
			pushes-1, f)
	}
	if !ta.failures.Unsaved() {
		t.Fatal("the merged updates are not marked unsaved")
	}
	ta.flushMergedFailures()
	if f := onDisk(); f == nil || len(f.Stages) != pushes {
		t.Fatalf("after the flush the log on disk holds %+v, want the newest update (%d stages)", f, pushes)
	}
	if ta.failures.Unsaved() {
		t.Fatal("still marked unsaved after the flush")
	}
}
