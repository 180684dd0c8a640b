package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/ring"
)

// TestRecoveryOnTargetDeadBeforeTheRequestIsTakenOver: the claimed spare s1 dies during the fence wait,
// after the claim and before the recovery request (its port is closed), so the request fails at once,
// long before this host, its protector now, declares it failed. The recovery must stay unfinished until
// then: s1's own failure takes over only unfinished recoveries (failurelog.Log.TakeOver), and the wait
// must end as errTargetFailed once the view declares s1 failed, which leaves the jobs to that takeover.
// Until 2026-12-07 the request's error ended the recovery (done, with an error): s1's failure found
// nothing to take over, and n3's jobs were restored nowhere.
func TestRecoveryOnTargetDeadBeforeTheRequestIsTakenOver(t *testing.T) {
	pki := newTestPKI(t)
	a, logs := clientAgent(t, pki, nil) // every other member's port is closed: s1 is dead
	a.wire.Idle = failAfter             // no giving up on s1's silence within the test
	id := recoveryOnSpare(t, a)
	done := make(chan error, 1)
	go func() {
		err := a.remoteRecover(t.Context(), "s1", RecoverRequest{Failure: id, Failed: "n3", Jobs: []RecoverJob{{Job: "job-1"}}}, func(Stage) {})
		a.failures.Update(id, func(f *Failure) { f.Done, f.Error = true, errString(err) }) // as failover does
		done <- err
	}()
	var ended error
	for deadline := time.Now().Add(failAfter); ended == nil && !strings.Contains(logs.String(), "asking the target what became of it"); time.Sleep(5 * time.Millisecond) {
		select {
		case ended = <-done:
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the request to the dead s1 neither ended nor was followed up; log:\n%s", logs.String())
		}
	}
	// This host, s1's protector, declares it failed: its fail-over takes the unfinished recoveries on it.
	taken := a.failures.TakeOver("n1", "s1", "s1-20261207T000010.000")
	if taken["job-1"] != "n3" {
		t.Fatalf("s1's failure took over %v, want job-1 of n3: the recovery ended with %v before s1 was declared failed, and n3's jobs run nowhere", taken, ended)
	}
	failed, err := a.View().Fail("s1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.adoptView(failed); err != nil {
		t.Fatal(err)
	}
	select {
	case ended = <-done:
	case <-time.After(failAfter):
		t.Fatalf("the recovery on s1 did not end once s1 was declared failed; log:\n%s", logs.String())
	}
	if !errors.Is(ended, errTargetFailed) || a.takenOverBy(id) == "" {
		t.Fatalf("the recovery ended with %v (taken over by %q): want errTargetFailed, which leaves the jobs to s1's failure", ended, a.takenOverBy(id))
	}
	if m, _ := a.View().Member("s1"); m.State != ring.StateFailed {
		t.Fatalf("s1 is %s", m.State)
	}
}

// TestSilentTargetTakenOverIsWaitedFor: a target that falls silent is given up on after brokenSilenceWait,
// but not once this host has declared it failed and its failure took the recovery over: the view that
// fails it comes only after its fence wait, and a recovery given up on before reported its jobs lost (or
// rolled their runs back) while the takeover restored them.
func TestSilentTargetTakenOverIsWaitedFor(t *testing.T) {
	pki := newTestPKI(t)
	a, logs := clientAgent(t, pki, nil) // s1's port is closed
	id := recoveryOnSpare(t, a)
	if taken := a.failures.TakeOver("n1", "s1", "s1-20261207T000010.000"); taken["job-1"] != "n3" {
		t.Fatalf("took over %v", taken)
	}
	viewed := make(chan struct{})
	go func() {
		defer close(viewed)
		// Past the silence bound and the 2 s between questions, as a fence wait may be: then the view fails s1.
		time.Sleep(3*a.brokenSilenceWait() + 2*time.Second)
		failed, err := a.View().Fail("s1")
		if err == nil {
			_, err = a.adoptView(failed)
		}
		if err != nil {
			t.Error(err)
		}
	}()
	var ended error
	testenv.ReturnsWithin(t, failAfter, func() {
		ended = a.remoteRecover(t.Context(), "s1", RecoverRequest{Failure: id, Failed: "n3", Jobs: []RecoverJob{{Job: "job-1"}}}, func(Stage) {})
	})
	<-viewed
	if !errors.Is(ended, errTargetFailed) {
		t.Fatalf("the recovery ended with %v: want errTargetFailed, which leaves the jobs to s1's failure; log:\n%s", ended, logs.String())
	}
}

// TestAbandonedTakeOverIsTakenAgain: the spare s1 fails while it restores n3's jobs, and this host, its
// protector, takes n3's recovery over in s1's fail-over; that fail-over ends before the view changes (here
// no replica of the taken job is reachable; a protector in a minority, or s1 beating again, ends it so
// too), and s1 stays a member, to be suspected and failed over again. The retry must take n3's jobs again:
// until the fix the first try's mark stayed on n3's recovery, the retry took nothing (TakeOver skips a
// marked recovery), and n3's recovery, once s1 was failed, ended saying a failure that restored nothing
// took its jobs over, which then ran nowhere.
func TestAbandonedTakeOverIsTakenAgain(t *testing.T) {
	pki := newTestPKI(t)
	a, logs := clientAgent(t, pki, nil) // every other member's port is closed: no replica is reachable
	id := recoveryOnSpare(t, a)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	first := time.Now()
	a.failover(ctx, detect.Suspect{Name: "s1", Since: first.Add(-time.Second)}, first)
	if m, _ := a.View().Member("s1"); m.State != ring.StateAlive {
		t.Fatalf("s1 is %s after a fail-over that could restore nothing; log:\n%s", m.State, logs.String())
	}
	if by := a.takenOverBy(id); by != "" {
		t.Errorf("n3's recovery is still marked taken over by %s, whose fail-over was abandoned", by)
	}
	second := first.Add(time.Second)
	a.failover(ctx, detect.Suspect{Name: "s1", Since: second.Add(-time.Second)}, second)
	retry := failureID("s1", second)
	for _, f := range a.failures.List() {
		if f.ID == retry {
			// The retry took job-1 (and, abandoned as well, gave it back again).
			if !slices.Contains(f.Jobs, "job-1") {
				t.Fatalf("the retried fail-over of s1 has jobs %v: want job-1, taken over again; log:\n%s", f.Jobs, logs.String())
			}
			return
		}
	}
	t.Fatalf("no timeline for the retried fail-over %s; log:\n%s", retry, logs.String())
}

// recoveryOnSpare has a (n1) see spare s1 replace n3 and records n1's recovery of n3's job-1 on s1, still
// under way, whose failure id it returns.
func recoveryOnSpare(t *testing.T, a *Agent) string {
	t.Helper()
	v, err := a.View().Replace("n3", "s1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.adoptView(v); err != nil {
		t.Fatal(err)
	}
	const id = "n3-20261207T000000.000"
	a.failures.Update(id, func(f *Failure) {
		f.Node, f.Protector, f.Target, f.Jobs = "n3", "n1", "s1", []string{"job-1"}
	})
	return id
}

// statusScript is a recovery's target that answers, to every status question, that the recovery is under
// way with one more stage, until its answers run out: then that it is done.
type statusScript struct {
	clusterapi.Service
	mu       sync.Mutex
	underWay int // answers left that say under way
	asked    int
}

func (s *statusScript) RecoveryStatus(_ context.Context, _ string, q clusterapi.RecoveryStatusRequest) (clusterapi.RecoveryStatusReply, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked++
	var stages []Stage
	for i := range s.asked {
		stages = append(stages, Stage{Name: "fetched", Job: fmt.Sprintf("job-%d", i), Host: "s1"})
	}
	b, err := json.Marshal(stages)
	if err != nil {
		return clusterapi.RecoveryStatusReply{}, err
	}
	done := s.underWay == 0
	s.underWay = max(s.underWay-1, 0)
	return clusterapi.RecoveryStatusReply{Failure: q.Failure, Known: true, Done: done, Stages: b, Running: q.Jobs}, nil
}

// TestBrokenStreamFollowsTheTarget: after its progress stream broke, the coordinator waits for as long as
// the target says the recovery goes on (the stream broke on a network blip: the target fetches and
// restores on, which may take longer than a resumed replay), not a fixed replay_timeout + 3 min from the
// break. Until the fix it gave up at that bound while the target went on: the recovery was reported failed
// (its runs rolled back in auto mode) while its jobs were being restored.
func TestBrokenStreamFollowsTheTarget(t *testing.T) {
	pki := newTestPKI(t)
	target := &statusScript{underWay: 3}
	port := scriptedPeer(t, pki, "s1", target)
	a, logs := clientAgent(t, pki, map[string]uint16{"s1": port})
	// A short bound between answers (3 s; the questions come every 2 s): the target answers under way
	// for about 6 s.
	a.cfg.Failover.ReplayTimeout.Duration = 3*time.Second - 3*time.Minute
	req := RecoverRequest{Failure: "n3-20261207T000000.000", Failed: "n3", Jobs: []RecoverJob{{Job: "job-1"}}}
	var emitted int
	var err error
	testenv.ReturnsWithin(t, failAfter, func() {
		err = a.afterBrokenStream(t.Context(), "s1", req, func(Stage) { emitted++ }, errors.New("progress stream ended: a network blip"))
	})
	target.mu.Lock()
	defer target.mu.Unlock()
	if err != nil {
		t.Fatalf("the recovery ended with %v after %d answers, while the target said it went on; log:\n%s", err, target.asked, logs.String())
	}
	if emitted != target.asked {
		t.Errorf("%d stages relayed; want the %d the target answered", emitted, target.asked)
	}
}
