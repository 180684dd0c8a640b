package agent

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/restore/recovery"
)

// TestReplayingJobNotSnapshotted: a job whose recovery replays its peers' bytes into it is dumped by
// nothing until its recovery has verified the replay. CI, 2026-11-27: a scheduled snapshot of a lazily
// restored job came one interval after its restore, while its receive order was still being replayed;
// CRIU's network lock dropped the replay's segments ("send 1448 bytes at seq ...: operation not
// permitted") and the recovery killed the job.
func TestReplayingJobNotSnapshotted(t *testing.T) {
	a := newTestAgent(t)
	tr := a.trackRecovery(RecoverRequest{Failure: "node2-20250101T000001.000", Source: "node3"})
	tr.Persist([]*recovery.Job{testRecoveryJob(ownersJob)})
	tr.SetPhase(ownersJob, phaseRestored, time.Now())

	// Named: refused before any dump, saying why.
	res, err := a.Checkpoint(t.Context(), []string{ownersJob}, 0)
	if !errors.Is(err, ErrReplaying) || len(res) != 0 || !strings.Contains(err.Error(), ownersJob) {
		t.Errorf("checkpoint of the replaying job = %v, %v; want ErrReplaying naming it", res, err)
	}
	j, _, err := a.Job(ownersJob, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.dumpFrozen(t.Context(), j); !errors.Is(err, ErrReplaying) {
		t.Errorf("migration's dump of the replaying job: %v; want ErrReplaying", err)
	}
	if _, err := a.snapshot(t.Context(), j, false, false); !errors.Is(err, ErrReplaying) {
		t.Errorf("snapshot of the replaying job: %v; want ErrReplaying", err)
	}
	// Every job (the scheduler, a peer's request): the others are dumped, the replaying one is left out.
	// The test agent's dumps fail at their start (no CRIU): the error names each job a dump was tried for.
	_, err = a.Checkpoint(t.Context(), nil, 0)
	if err == nil || !strings.Contains(err.Error(), rootsJob) || strings.Contains(err.Error(), ownersJob) {
		t.Errorf("checkpoint of every job: %v; want a dump tried for %s only", err, rootsJob)
	}

	// Verified: it is a job like any other.
	tr.SetPhase(ownersJob, phaseReplayed, time.Time{})
	if _, err := a.Checkpoint(t.Context(), []string{ownersJob}, 0); errors.Is(err, ErrReplaying) || err == nil || !strings.Contains(err.Error(), ownersJob) {
		t.Errorf("checkpoint after the replay was verified: %v; want the dump tried (and failing without CRIU)", err)
	}

	// Killed in its replay (no phase after restored): the recovery's end lets go of it.
	tr2 := a.trackRecovery(RecoverRequest{Failure: "node2-20250101T000002.000", Source: "node3"})
	tr2.Persist([]*recovery.Job{testRecoveryJob(rootsJob)})
	if !a.replays.has(rootsJob) {
		t.Fatalf("%s not replaying once its recovery recorded it", rootsJob)
	}
	tr2.done(t.Context(), errors.New("killed"))
	if a.replays.has(rootsJob) {
		t.Errorf("%s still replaying after its recovery ended", rootsJob)
	}
}

// TestPendingRecoveriesMarkReplaying: a restarted agent knows which jobs a resumed recovery still replays
// before it schedules a snapshot, and only those.
func TestPendingRecoveriesMarkReplaying(t *testing.T) {
	a := resumeTestAgent(t)
	open := &recoveryRecord{Failure: "node2-20250101T000001.000", Coordinator: "node3", Jobs: []recoveryJob{
		{Job: "rank1-abc", Snapshot: "s", Phase: phaseRestored},
		{Job: "rank2-abc", Snapshot: "s", Phase: phaseReplayed},
		{Job: "rank3-abc", Snapshot: "s", Phase: phaseRestoring},
	}}
	finished := &recoveryRecord{Failure: "node4-20250101T000001.000", Coordinator: "node3", Done: true, Updated: time.Now(),
		Jobs: []recoveryJob{{Job: "rank4-abc", Snapshot: "s", Phase: phaseRestored}}}
	for _, rec := range []*recoveryRecord{open, finished} {
		if err := saveRecovery(a.cfg.StateDir, rec); err != nil {
			t.Fatal(err)
		}
	}
	pending := a.pendingRecoveries()
	if len(pending) != 1 || pending[0].Failure != open.Failure {
		t.Fatalf("pending %+v; want the unfinished recovery only", pending)
	}
	for job, want := range map[string]bool{"rank1-abc": true, "rank2-abc": false, "rank3-abc": true, "rank4-abc": false} {
		if got := a.replays.has(job); got != want {
			t.Errorf("%s replaying = %v, want %v", job, got, want)
		}
	}
	a.resumeRecoveries(t.Context(), pending) // none of them runs here: each fails, and the recovery ends
	for _, job := range []string{"rank1-abc", "rank3-abc"} {
		if a.replays.has(job) {
			t.Errorf("%s still replaying after its resumed recovery ended", job)
		}
	}
}

// TestWaitReplayed: a drain waits for a job's replay to be verified before it moves the job, and gives up
// with ErrReplaying after its bound.
func TestWaitReplayed(t *testing.T) {
	a := newTestAgent(t)
	if err := a.waitReplayed(t.Context(), ownersJob, 0); err != nil {
		t.Fatalf("job not replaying: %v; want no wait", err)
	}
	tr := a.trackRecovery(RecoverRequest{Failure: "node2-20250101T000001.000", Source: "node3"})
	tr.Persist([]*recovery.Job{testRecoveryJob(ownersJob)})
	if err := a.waitReplayed(t.Context(), ownersJob, 0); !errors.Is(err, ErrReplaying) {
		t.Errorf("bound reached while replaying: %v; want ErrReplaying", err)
	}
	done := make(chan error)
	go func() { done <- a.waitReplayed(t.Context(), ownersJob, time.Hour) }()
	tr.SetPhase(ownersJob, phaseReplayed, time.Time{})
	if err := <-done; err != nil {
		t.Errorf("replay verified while waiting: %v; want the wait to end without error", err)
	}
}
