package agent

import (
	"context"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/testenv"
)

// sigScript is a member that records the signals passed to it.
type sigScript struct {
	clusterapi.Service
	mu   sync.Mutex
	seen []clusterapi.SignalRequest
}

func (s *sigScript) Signal(_ context.Context, peer string, req clusterapi.SignalRequest) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if peer == "node1" {
		s.seen = append(s.seen, req)
	}
	return nil
}

// TestSignalPassedToWhereTheJobWent: a signal for a job migrated away (MovedTo) or, lost here, restored by
// a failover (the newest recovery naming it) goes to that host's agent with the caller's uid; a job lost
// without a recovery of it goes nowhere (refused as before). Until then ftwrap's Ctrl-C for a job that left
// its host was refused ("job ID is moved"), and nothing stopped the job through ftwrap.
func TestSignalPassedToWhereTheJobWent(t *testing.T) {
	ta := newTestAgent(t)
	script := &sigScript{}
	withScriptedNode2(t, ta, script)

	moved := ta.addJob(t, Job{ID: "moved-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: JobMoved, MovedTo: "node2"})
	failed := ta.addJob(t, Job{ID: "failed-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: JobLost, Fenced: true})
	lost := ta.addJob(t, Job{ID: "lost-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: JobLost})
	t0 := time.Now().UTC()
	ta.AddFailures([]*Failure{
		{ID: "node1-1", Node: "node1", Protector: "node2", Target: "node3", Detected: t0, Jobs: []string{failed.ID}},
		// Its target failed in turn: the job went on from there, to node2.
		{ID: "node3-1", Node: "node3", Protector: "node2", Target: "node2", Detected: t0.Add(time.Minute), Jobs: []string{failed.ID}},
	})
	ctx, cancel := context.WithTimeout(t.Context(), failAfter)
	defer cancel()
	for _, j := range []*Job{moved, failed} {
		host, err := ta.SignalElsewhere(ctx, *j, asOwner.Uid, int(syscall.SIGINT))
		if host != "node2" || err != nil {
			t.Errorf("signal for %s (%s): passed to %q, %v; want node2", j.ID, j.State, host, err)
		}
	}
	if host, err := ta.SignalElsewhere(ctx, *lost, asOwner.Uid, int(syscall.SIGINT)); host != "" || err != nil {
		t.Errorf("signal for a job lost without a recovery: passed to %q, %v; want nowhere", host, err)
	}
	script.mu.Lock()
	defer script.mu.Unlock()
	want := []clusterapi.SignalRequest{{Job: moved.ID, UID: asOwner.Uid, Signal: 2}, {Job: failed.ID, UID: asOwner.Uid, Signal: 2}}
	if !slices.Equal(script.seen, want) {
		t.Errorf("node2 got %+v, want %+v", script.seen, want)
	}
}

// TestServeSignalChecksOwner: a signal a member passes reaches the job only for its owner or root, only
// from an alive member, and only a copy running here (never passed on again).
func TestServeSignalChecksOwner(t *testing.T) {
	ta := newTestAgent(t)
	cmd := testenv.StartSleep(t)
	j := ta.addJob(t, Job{ID: "sig-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: JobRunning, PID: cmd.Process.Pid})
	ta.addJob(t, Job{ID: "moved-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: JobMoved, MovedTo: "node1"})
	refusals := []struct {
		name, peer string
		req        clusterapi.SignalRequest
		want       string
	}{
		{"another uid", "node2", clusterapi.SignalRequest{Job: j.ID, UID: asOther.Uid, Signal: 15}, "no such job"},
		{"not a member", "intruder", clusterapi.SignalRequest{Job: j.ID, UID: asOwner.Uid, Signal: 15}, "not an alive member"},
		{"a bad signal", "node2", clusterapi.SignalRequest{Job: j.ID, UID: asOwner.Uid, Signal: 65}, "1 to 64"},
		{"a job that moved on", "node2", clusterapi.SignalRequest{Job: "moved-00000001", UID: asOwner.Uid, Signal: 15}, "is moved"},
	}
	for _, tt := range refusals {
		if err := ta.serveSignal(tt.peer, tt.req); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v; want a refusal about %q", tt.name, err, tt.want)
		}
	}
	testenv.StillRuns(t, cmd)
	if err := ta.serveSignal("node2", clusterapi.SignalRequest{Job: j.ID, UID: asOwner.Uid, Signal: 15}); err != nil {
		t.Fatalf("the owner's signal: %v", err)
	}
	testenv.WaitSignalled(t, cmd, syscall.SIGTERM)
}
