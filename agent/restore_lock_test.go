package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/restore/recovery"
)

// blockingRestoreShim makes ta's shim one whose first run stands for a CRIU restore at work: it says so
// (the returned launched file appears) and fails only once the test makes the returned release file; any later
// run leaves the returned again file and fails at once, as a restore CRIU refused.
func blockingRestoreShim(t *testing.T, ta *testAgent) (launched, release, again string) {
	t.Helper()
	launched, release, again = filepath.Join(ta.dir, "launched"), filepath.Join(ta.dir, "release"), filepath.Join(ta.dir, "again")
	first := filepath.Join(ta.dir, "first")
	script := "#!/bin/sh\ncat >/dev/null\nif mkdir " + first + " 2>/dev/null; then\n" +
		"  touch " + launched + "\n  while [ ! -e " + release + " ]; do sleep 0.01; done\n" +
		"  echo '{\"error\": \"fake shim: first restore not restored\"}'\nelse\n" +
		"  touch " + again + "\n  echo '{\"error\": \"fake shim: second restore not restored\"}'\nfi\n"
	fake := filepath.Join(ta.dir, "fake-shim")
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.SetShim(fake)
	return launched, release, again
}

// waitFile waits until path exists (failAfter at most).
func waitFile(t *testing.T, path string) {
	t.Helper()
	for deadline := time.Now().Add(failAfter); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not appear", path)
		}
	}
}

// TestOneRestoreOfAJobAtATime: two restores of one job on one host at once (a forced manual restore beside a
// fail-over or another forced restore; a repeated or resumed recovery request, whose claim of the same
// incarnation under the same holder succeeds again) both got past the incarnation claim and the "already
// runs" check, which sees the job only once its restore has ended. The second's CRIU restored beside the
// first's, and its failure's cleanup went by the job's id and its cgroup's and network's shared names: it
// removed the cgroup the first restore's CRIU restores into (and unwatched its receive order, unprotected its
// log, deleted its network and guard), and a recovery's gave the first's claim back, so another restore
// anywhere could run a second copy of the job. The second restore is refused before it claims anything.
func TestOneRestoreOfAJobAtATime(t *testing.T) {
	ta := newTestAgent(t)
	ta.failMember(t, "node2") // this agent alone grants
	const id = "twice-00000001"
	snap := ta.addSnapshot(t, Job{ID: id, Node: "node2"}) // root's job: its images' credentials are not read
	m, err := ta.store.Manifest(id, snap)
	if err != nil {
		t.Fatal(err)
	}
	j, err := ta.snapshotJob(m)
	if err != nil {
		t.Fatal(err)
	}
	launched, release, again := blockingRestoreShim(t, ta)
	// Lets the first shim end, on every way out of the test.
	letFirstEnd := sync.OnceFunc(func() { os.WriteFile(release, nil, 0o600) })
	t.Cleanup(letFirstEnd)

	first := make(chan error, 1)
	go func() {
		_, err := ta.claimAndRestore(t.Context(), "restore", m, j, true, nil)
		first <- err
	}()
	waitFile(t, launched) // the first restore's CRIU is at work, in the job's cgroup
	cgroup := ta.layout().cgroup(id)

	_, err = ta.claimAndRestore(t.Context(), "restore", m, j, true, nil)
	if !errors.Is(err, ErrRestoreUnderWay) {
		t.Errorf("a second forced restore during the first: %v, want %v", err, ErrRestoreUnderWay)
	}
	if _, err := os.Stat(again); err == nil {
		t.Error("the second restore's shim ran beside the first's")
	}
	if _, err := os.Stat(cgroup); err != nil {
		t.Errorf("the cgroup the first restore's CRIU restores into, after the second restore: %v", err)
	}

	letFirstEnd()
	if err := <-first; err == nil {
		t.Fatal("the first restore succeeded with a shim that fails")
	}
}

// TestRepeatedRecoveryKeepsTheFirstsClaim: a recovery request that reaches the target again while the first
// still restores the job there (a migration resumed by its source's restarted agent before the target had
// recorded anything) claims the same incarnation under the same holder ("failover:" + failure), which the
// members grant again. Its restore then failed ("already runs", or its address held by the first's), and its
// give-back released the first's claim at every member while the first's copy ran: a manual restore or a
// fail-over elsewhere could then claim that incarnation and run the job twice. The second claim is refused
// while the first recovery holds the job, and it gives back nothing.
func TestRepeatedRecoveryKeepsTheFirstsClaim(t *testing.T) {
	ta := newTestAgent(t)
	ta.failMember(t, "node2") // this agent alone grants
	const id, holder = "twice-00000001", "failover:20261206T120000Z-node2"
	m := &ckpt.Manifest{Job: id, ID: "20261206T120000.000Z-node2-000001", Node: "node2"}
	newRecovery := func() (*recoveryActions, *recovery.Job) {
		act := &recoveryActions{a: ta.Agent, records: map[*recovery.Job]Job{}, fenced: "node2"}
		j := &recovery.Job{ID: id, Manifest: m, Holder: holder}
		act.records[j] = Job{ID: id, Cgroup: ta.layout().cgroup(id)} // no process in it yet: CRIU is at work
		return act, j
	}
	first, fj := newRecovery()
	n, err := first.Claim(t.Context(), fj, 1)
	if err != nil {
		t.Fatalf("the first request's claim: %v", err)
	}
	fj.Incarnation = n

	second, sj := newRecovery()
	n2, err := second.Claim(t.Context(), sj, 1)
	if err == nil {
		// What recovery.Run does once its restore of the job fails.
		sj.Incarnation = n2
		second.GiveBackUnlessStarted(t.Context(), sj, errors.New("job twice-00000001 already runs on node1"))
	}
	if !errors.Is(err, ErrRestoreUnderWay) {
		t.Errorf("the repeated request's claim while the first restores the job: %v, want %v", err, ErrRestoreUnderWay)
	}
	if rec, _ := ta.grants.Lookup(id); rec.Released || rec.Incarnation != n {
		t.Errorf("the first recovery's claim after the repeated request: %+v, want incarnation %d held", rec, n)
	}

	first.endRestores() // the first recovery ended: the job may be restored here again
	third, tj := newRecovery()
	if _, err := third.Claim(t.Context(), tj, 1); err != nil {
		t.Errorf("a claim once the first recovery ended: %v", err)
	}
	third.endRestores()

	// The first restored the job, which runs here: a request repeated now passed the claim again, and its
	// restore's refusal ("already runs") had recovery.Run delete the running copy's network and guard.
	ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Incarnation: n})
	late, lj := newRecovery()
	defer late.endRestores()
	if _, err := late.Claim(t.Context(), lj, 1); !errors.Is(err, ErrJobAlive) {
		t.Errorf("a repeated request's claim of a job that runs here: %v, want %v", err, ErrJobAlive)
	}
}

// errHookCtx runs hook at its first Err: hashing a snapshot's file (ckpt.Store.Verify) asks it before each
// read, so the hook runs while the snapshot is being verified.
type errHookCtx struct {
	context.Context
	hook func()
}

func (c errHookCtx) Err() error {
	c.hook()
	return c.Context.Err()
}

// TestManualRestoreHoldsTheJobWhileVerifying: a manual restore of an ended job verifies its snapshot (seconds
// for a large one, every image hashed) before it restores it. The old code took the job's restore lock only
// after the verification, so a forget pass during it (stillEnded spares only a job in a.restoring) took the
// job for ended and deleted the snapshot being verified: the restore failed, and the snapshot was gone. The
// lock is taken before the verification.
func TestManualRestoreHoldsTheJobWhileVerifying(t *testing.T) {
	ta := newTestAgent(t)
	ta.failMember(t, "node2") // this agent alone grants
	ta.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	const id = "ended-0000000a"
	snap := ta.addSnapshot(t, Job{ID: id, Node: ta.cfg.Name})
	ended := time.Now().Add(time.Minute)
	ta.addJob(t, Job{ID: id, State: JobExited, Ended: ended})
	ctx := errHookCtx{Context: t.Context(), hook: sync.OnceFunc(func() {
		ta.forgetDue(t.Context(), ended.Add(2*time.Hour)) // keep_ended passed while the snapshot is verified
	})}
	_, err := ta.Restore(ctx, RestoreRequest{Snapshot: snap, Job: id}, 0)
	if errors.Is(err, ErrCorruptSnapshot) {
		t.Errorf("restore with a forget pass during its verification: %v", err)
	}
	if got, _ := ta.store.List(id, ""); !slices.Equal(got, []string{snap}) {
		t.Errorf("snapshots after a forget pass during the restore's verification: %v; want [%s]", got, snap)
	}
}
