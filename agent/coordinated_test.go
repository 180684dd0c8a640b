package agent

import (
	"context"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/detect"
)

// TestHoldEndsWhenCoordinatorFails: a host holds a run's jobs frozen, and its snapshot lock, from the
// freeze of a cut to its coordinator's thaw. A view that declares the coordinator failed ends the hold at
// once (the old code waited coordinated.HoldMax, a minute, and a rollback's stop waited with it); a view that fails
// another member does not.
func TestHoldEndsWhenCoordinatorFails(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	uid := uint32(0)
	j, r := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: "ftj-test"}})
	freeze := clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: "cut-1", Phase: clusterapi.CoordFreeze}
	rep, err := ta.serveCoordinate(t.Context(), "node2", freeze)
	if err != nil || !slices.Equal(rep.Jobs, []string{j.ID}) {
		t.Fatalf("freeze from node2: %+v, %v", rep, err)
	}
	frozen := func() string {
		b, _ := os.ReadFile(filepath.Join(j.Cgroup, "cgroup.freeze"))
		return string(b)
	}
	held := func() bool {
		if ta.ckptMu.TryLock() {
			ta.ckptMu.Unlock()
			return false
		}
		return true
	}
	if frozen() != "1" || !held() || r.held != 1 {
		t.Fatalf("after the freeze: cgroup.freeze %q, snapshot lock held %v, priority raised %d times; want 1, true, 1", frozen(), held(), r.held)
	}

	ta.failMember(t, "node3")
	if frozen() != "1" || !held() {
		t.Fatalf("node3 failed, not the coordinator: cgroup.freeze %q, snapshot lock held %v; want 1, true", frozen(), held())
	}

	ta.failMember(t, "node2")
	if frozen() != "0" || held() || r.held != 0 {
		t.Fatalf("coordinator node2 failed: cgroup.freeze %q, snapshot lock held %v, priority raised %d times; want 0 (thawed), false, 0", frozen(), held(), r.held)
	}
	if left := ta.coord.Len(); left != 0 {
		t.Errorf("%d holds left after the coordinator's failure", left)
	}
}

// TestRollbackStopEndsLingeringNet: a rollback's stop takes off the wire the network a part's ended copy
// left lingering (its closed connections not yet acknowledged), not only the networks of the parts' running
// jobs. The old code left it to this host's restore phase, and a part restored meanwhile on another host
// could send to the address and meet the old sockets' resets. A lingering network of a job outside the
// run stays.
func TestRollbackStopEndsLingeringNet(t *testing.T) {
	ta := newTestAgent(t)
	uid := uint32(0)
	const id, other = "farm-node3-1", "other-1"
	name := jobNetName(ta.cfg.Name, id)
	ta.addJob(t, Job{ID: id, UID: uid, State: JobExited, Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: name}})
	snap := ta.addSnapshot(t, Job{ID: id, UID: uid, Node: ta.cfg.Name, Spec: JobSpec{Run: "farm"}})
	ta.lingering.add(name, id, netip.Prefix{})
	ta.lingering.add(jobNetName(ta.cfg.Name, other), other, netip.Prefix{})

	parts := []clusterapi.CutPart{{Job: id, Host: ta.cfg.Name, Snapshot: snap}}
	if err := ta.rollbackStop(t.Context(), "farm", uid, parts); err != nil {
		t.Fatal(err)
	}
	if ta.lingering.has(name) {
		t.Errorf("the ended part's network %s still lingers after the rollback's stop", name)
	}
	if !ta.lingering.has(jobNetName(ta.cfg.Name, other)) {
		t.Errorf("the lingering network of %s, a job of no part, was ended by the rollback's stop", other)
	}
}

// TestCommitOfAnotherUsersJob: a member commits a cut of its run "farm" of root whose part names goneJob,
// a job of uid 1000 in no run, whose replica (with its record) this host holds. The commit is refused.
// Before, it was saved, and this host then treated uid 1000's job as a part of root's run: after a
// failure of its host it skipped message logging for it and rolled back root's run instead, a diverged
// replay of it took it off with no exit record and no reset of its peers, and its snapshot was pinned.
func TestCommitOfAnotherUsersJob(t *testing.T) {
	for _, recovery := range []string{coordinated.RecoveryCoordinated, coordinated.RecoveryAuto} {
		t.Run(recovery, func(t *testing.T) {
			ta := newTestAgent(t)
			root := uint32(0)
			commit := clusterapi.CoordinateRequest{Run: "farm", UID: &root, Cut: "cut-20261203T100000.000", Phase: clusterapi.CoordCommit,
				Parts: []clusterapi.CutPart{{Job: goneJob, Host: "node2", Snapshot: ta.goneSnap, Recovery: recovery}}}
			if err := commit.Validate(); err != nil {
				t.Fatal(err)
			}
			_, err := ta.serveCoordinate(t.Context(), "node2", commit)
			_, rollback := ta.coordinatedJobs([]RecoverJob{{Job: goneJob, Snapshot: ta.goneSnap}})
			rollsBack := ta.cutRecords().RollsBack(goneJob)
			pinned := ta.cutRecords().Pinned(goneJob)
			if err == nil || slices.Contains(rollback, goneJob) || rollsBack || len(pinned) > 0 {
				t.Errorf("commit from node2 naming uid 1000's job %s in root's run: err %v; its recovery skips message logging %v, a diverged replay leaves it silently %v, snapshots pinned %v",
					goneJob, err, slices.Contains(rollback, goneJob), rollsBack, pinned)
			}
		})
	}
}

// gatedMembers routes a coordinator's phases to two test agents' serveCoordinate. A freeze on the
// coordinator's own host goes at once; a freeze on the other host waits until both coordinators' own
// freezes are done: one of the interleavings of onHosts' parallel requests.
type gatedMembers struct {
	self    string
	agents  map[string]*testAgent
	ownDone *sync.WaitGroup
	once    *sync.Once
}

func (m gatedMembers) Alive() []string { return []string{"node1", "node2"} }

func (m gatedMembers) Coordinate(ctx context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	if req.Phase == clusterapi.CoordFreeze {
		if host == m.self {
			defer m.once.Do(m.ownDone.Done)
		} else {
			m.ownDone.Wait()
		}
	}
	return m.agents[host].serveCoordinate(ctx, m.self, req)
}

// TestConcurrentCutsDoNotDeadlock: two runs that share two hosts, with different coordinators, whose
// freezes meet in opposite orders. Each host's freeze takes the host's snapshot lock until the thaw. The
// second freeze on each host gives up within its bound (or its context) and asks its coordinator to try
// again. Before, it waited on the lock regardless of its context, until the other hold expired
// (coordinated.HoldMax, a minute), with run A's jobs frozen on node1 and run B's on node2.
func TestConcurrentCutsDoNotDeadlock(t *testing.T) {
	uid := uint32(0)
	a1, a2 := newTestAgent(t), newTestAgent(t)
	a2.cfg.Name = "node2"
	agents := map[string]*testAgent{"node1": a1, "node2": a2}
	for name, ta := range agents {
		for _, run := range []string{"runa", "runb"} {
			frozenJob(t, ta, Job{ID: run + "-" + name, UID: uid, Spec: JobSpec{Run: run}, Net: &JobNet{Name: "ftj-" + run}})
		}
	}
	var ownDone sync.WaitGroup
	ownDone.Add(2)
	coord := func(self string) *coordinated.Coordinator {
		return &coordinated.Coordinator{Self: self, Log: slog.New(slog.DiscardHandler),
			Members: gatedMembers{self: self, agents: agents, ownDone: &ownDone, once: &sync.Once{}}}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	done := make(chan string, 2)
	go func() { coord("node1").Snapshot(ctx, "runa", &uid); done <- "runa" }()
	go func() { coord("node2").Snapshot(ctx, "runb", &uid); done <- "runb" }()
	deadline := time.After(failAfter)
	for left := 2; left > 0; left-- {
		select {
		case <-done:
		case <-deadline:
			t.Errorf("two cuts that met on two hosts still blocked %s after they started (their context ended after 3 s); holds: node1 %d, node2 %d",
				failAfter, a1.coord.Len(), a2.coord.Len())
			a1.coord.EndOf(func(string) bool { return true }) // as HoldMax would, after a minute
			a2.coord.EndOf(func(string) bool { return true })
			for ; left > 0; left-- {
				<-done
			}
			return
		}
	}
	if n1, n2 := a1.coord.Len(), a2.coord.Len(); n1 != 0 || n2 != 0 {
		t.Errorf("holds left: node1 %d, node2 %d; want none", n1, n2)
	}
}

// TestSnapshotBeforeCommitKeepsCutsSnapshot: with checkpoint.keep = 1, a job in auto mode is snapshotted
// on its schedule after its cut's thaw (which gives back the snapshot lock) and before the cut's commit;
// retention after that snapshot's replication must keep the cut's. Before, it deleted it, and the commit
// then recorded a cut naming a snapshot this host no longer held (the run's previous cut unpinned with it).
func TestSnapshotBeforeCommitKeepsCutsSnapshot(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.Keep = 1
	ta.members.view = testView(t, "node1", "node2")
	uid := uint32(0)
	spec := JobSpec{Run: "farm", Recovery: coordinated.RecoveryAuto}
	j, _ := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: spec, Net: &JobNet{Name: "ftj-test"}})
	const cut = "cut-20261203T100000.000"
	cutSnap, req := thawedCut(t, ta, j.ID, spec, cut)

	// The schedule's snapshot, replicated, then pruned as replicate does.
	later := replicatedSnapshot(t, ta, j.ID, spec)
	ta.pruneOwn(t.Context(), j.ID)

	commit := req(clusterapi.CoordCommit)
	commit.Parts = []clusterapi.CutPart{{Job: j.ID, Host: ta.cfg.Name, Snapshot: cutSnap.ID, Recovery: spec.Recovery}}
	if _, err := ta.serveCoordinate(t.Context(), "node2", commit); err != nil {
		t.Fatalf("commit: %v", err)
	}
	rec, err := ta.cutRecords().Load("farm", &uid)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range rec.Parts {
		if _, err := ta.store.Manifest(p.Job, p.Snapshot); err != nil {
			left, _ := ta.store.List(j.ID, "")
			t.Errorf("cut %s recorded naming snapshot %s of job %s, which retention deleted after snapshot %s (left: %v): %v", rec.ID, p.Snapshot, p.Job, later.ID, left, err)
		}
	}
	// Once committed, the record pins it; the pin of the uncommitted cut is gone.
	if pins := ta.uncommitted.Pinned(j.ID); len(pins) != 0 {
		t.Errorf("snapshots %v still pinned as uncommitted after the commit", pins)
	}
}

// replicatedSnapshot commits a snapshot of ta's job id (uid 0, spec) and records its replica on node2.
func replicatedSnapshot(t *testing.T, ta *testAgent, id string, spec JobSpec) *ckpt.Manifest {
	t.Helper()
	m, err := ta.store.AddReplica(id, ta.addSnapshot(t, Job{ID: id, UID: 0, Node: ta.cfg.Name, Spec: spec}), "node2")
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// thawedCut takes ta through the freeze, dump and thaw of cut, coordinated by node2, of run "farm" (uid 0)
// whose part here is job id (spec). The dump phase is as coordDump leaves it (the test agent has no CRIU):
// a snapshot, replicated, in the cut's hold. The thaw's shipping is cut short (no protector answers here),
// as if it were done. It returns the cut's snapshot and the cut's request of a phase.
func thawedCut(t *testing.T, ta *testAgent, id string, spec JobSpec, cut string) (*ckpt.Manifest, func(clusterapi.CoordPhase) clusterapi.CoordinateRequest) {
	t.Helper()
	uid := uint32(0)
	req := func(p clusterapi.CoordPhase) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: cut, Phase: p}
	}
	if _, err := ta.serveCoordinate(t.Context(), "node2", req(clusterapi.CoordFreeze)); err != nil {
		t.Fatal(err)
	}
	cutSnap := replicatedSnapshot(t, ta, id, spec)
	hold := ta.coord.Get(coordinated.HoldKey(req(clusterapi.CoordFreeze)), cut)
	hold.Dumped = append(hold.Dumped, cutSnap)
	done, cancel := context.WithCancel(t.Context())
	cancel()
	ta.serveCoordinate(done, "node2", req(clusterapi.CoordThaw))
	return cutSnap, req
}

// TestRollbackToOlderCutRefused: a cut's commit reached this host but not the member that now coordinates
// the run's rollback, which still records the cut before it. The prepare phase refuses the rollback to that
// older cut, before anything stops. Before, it went ahead, and this host kept the newer record: a later
// rollback coordinated here would restore that cut, of an execution the first rollback had superseded (the
// restore's claim is forced), silently.
func TestRollbackToOlderCutRefused(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2")
	uid := uint32(0)
	spec := JobSpec{Run: "farm", Recovery: coordinated.RecoveryCoordinated}
	j := ta.addJob(t, Job{ID: "farm-node1-1", UID: uid, State: JobRunning, PID: os.Getpid(), Spec: spec, Net: &JobNet{Name: "ftj-test"}})
	older := ta.addSnapshot(t, Job{ID: j.ID, UID: uid, Node: ta.cfg.Name, Spec: spec})
	newer := ta.addSnapshot(t, Job{ID: j.ID, UID: uid, Node: ta.cfg.Name, Spec: spec})
	const oldCut, newCut = "cut-20261203T100000.000", "cut-20261203T100500.000"
	part := func(snap string) []clusterapi.CutPart {
		return []clusterapi.CutPart{{Job: j.ID, Host: ta.cfg.Name, Snapshot: snap, Recovery: spec.Recovery}}
	}
	if err := ta.cutRecords().Save(coordinated.Cut{Run: "farm", UID: uid, ID: newCut, Parts: part(newer)}); err != nil {
		t.Fatal(err)
	}
	prepare := clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: oldCut, Phase: clusterapi.CoordPrepare, Parts: part(older)}
	for i := range prepare.Parts {
		prepare.Parts[i].Target = ta.cfg.Name
	}
	if _, err := ta.serveCoordinate(t.Context(), "node2", prepare); err == nil {
		t.Errorf("rollback to cut %s prepared on a host that records the newer cut %s of the run", oldCut, newCut)
	}
	prepare.Cut, prepare.Parts[0].Snapshot = newCut, newer
	if _, err := ta.serveCoordinate(t.Context(), "node2", prepare); err != nil {
		t.Errorf("rollback to the recorded cut %s refused: %v", newCut, err)
	}
}

// TestDumpStopsWhenItsHoldEnds: the coordinator of a cut is declared failed while this host dumps the run's
// jobs for it. The dump stops, and the jobs thaw and the snapshot lock is given back once it has: no job is
// dumped after the hold's end. Before, the end thawed the jobs and gave the lock back under the dump, which
// went on dumping jobs no longer frozen for the cut, beside the run's rollback (whose stop takes that lock).
func TestDumpStopsWhenItsHoldEnds(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	uid := uint32(0)
	j, _ := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: "ftj-test"}})
	req := func(p clusterapi.CoordPhase) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: "cut-1", Phase: p}
	}
	if _, err := ta.serveCoordinate(t.Context(), "node2", req(clusterapi.CoordFreeze)); err != nil {
		t.Fatal(err)
	}
	held := func() bool {
		if ta.ckptMu.TryLock() {
			ta.ckptMu.Unlock()
			return false
		}
		return true
	}
	// The dump waits for the job's pages, still coming in (a lazy restore's images): it is under way.
	lazy := filepath.Join(ta.cfg.StateDir, "restore", "lazy-1")
	if err := os.MkdirAll(lazy, 0o700); err != nil {
		t.Fatal(err)
	}
	ta.mu.Lock()
	ta.byID[j.ID].LazyWork = lazy
	ta.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		_, err := ta.serveCoordinate(t.Context(), "node2", req(clusterapi.CoordDump))
		done <- err
	}()
	for deadline := time.Now().Add(failAfter); ta.busy.current() != detect.BusyCheckpoint; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the dump did not begin within %s", failAfter)
		}
	}

	ta.failMember(t, "node2")
	// The pages are in: a dump that went on would dump the job now.
	if err := os.Remove(lazy); err != nil {
		t.Fatal(err)
	}
	var err error
	select {
	case err = <-done:
	case <-time.After(failAfter):
		t.Fatalf("the dump did not return within %s of its coordinator's failure", failAfter)
	}
	if !errors.Is(err, coordinated.ErrEnded) {
		t.Errorf("dump after its coordinator was declared failed: %v; want it stopped (%v)", err, coordinated.ErrEnded)
	}
	b, _ := os.ReadFile(filepath.Join(j.Cgroup, "cgroup.freeze"))
	if string(b) != "0" || held() || ta.coord.Len() != 0 {
		t.Errorf("after the dump returned: cgroup.freeze %q, snapshot lock held %v, %d holds; want 0, false, 0", b, held(), ta.coord.Len())
	}
}

// TestCutPhasesOnlyFromItsCoordinator: a hold belongs to the member that froze the run's jobs for its cut.
// Another alive member's dump, thaw or abort of that cut is refused and leaves the hold as it was: the old
// code ended the hold (jobs thawed mid-cut, the snapshot lock given back), dumped or replicated for it at any
// member's word. The coordinator's own thaw still ends it.
func TestCutPhasesOnlyFromItsCoordinator(t *testing.T) {
	uid := uint32(0)
	req := func(p clusterapi.CoordPhase) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: "cut-1", Phase: p}
	}
	for _, phase := range []clusterapi.CoordPhase{clusterapi.CoordDump, clusterapi.CoordThaw, clusterapi.CoordAbort} {
		t.Run(string(phase), func(t *testing.T) {
			ta := newTestAgent(t)
			ta.members.view = testView(t, "node1", "node2", "node3")
			j, _ := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: "ftj-test"}})
			if _, err := ta.serveCoordinate(t.Context(), "node2", req(clusterapi.CoordFreeze)); err != nil {
				t.Fatal(err)
			}
			frozen := func() string {
				b, _ := os.ReadFile(filepath.Join(j.Cgroup, "cgroup.freeze"))
				return string(b)
			}
			_, err := ta.serveCoordinate(t.Context(), "node3", req(phase))
			if e := clusterapi.Refusal(err); e == nil || e.Code != clusterapi.CodeRefused {
				t.Errorf("%s of node2's cut from node3: %v; want a refusal", phase, err)
			}
			if frozen() != "1" || ta.coord.Len() != 1 || ta.coord.Get(coordinated.HoldKey(req(phase)), "cut-1") == nil {
				t.Fatalf("after node3's %s: cgroup.freeze %q, %d holds; want node2's hold kept, its job frozen", phase, frozen(), ta.coord.Len())
			}
			if _, err := ta.serveCoordinate(t.Context(), "node2", req(clusterapi.CoordAbort)); err != nil {
				t.Fatalf("the coordinator's abort: %v", err)
			}
			if frozen() != "0" || ta.coord.Len() != 0 {
				t.Errorf("after node2's abort: cgroup.freeze %q, %d holds; want 0, 0", frozen(), ta.coord.Len())
			}
		})
	}
}

// TestUncommittedPinsOnlyFromItsCoordinator: after a cut's thaw (its hold ended, its snapshots pinned until
// the commit) another alive member sends an abort, or a commit, of that cut. Its coordinator alone commits
// or gives it up: the pins stay, and the other member is refused. Before, checkCoordinator applied only while
// the hold existed, and any member's abort unpinned the cut's snapshots: a scheduled snapshot's retention
// (keep = 1) then deleted the cut's, and the coordinator's commit recorded a cut naming a deleted snapshot.
func TestUncommittedPinsOnlyFromItsCoordinator(t *testing.T) {
	uid := uint32(0)
	const cut = "cut-20261203T100000.000"
	req := func(p clusterapi.CoordPhase) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: cut, Phase: p}
	}
	for _, phase := range []clusterapi.CoordPhase{clusterapi.CoordAbort, clusterapi.CoordCommit} {
		t.Run(string(phase), func(t *testing.T) {
			ta := newTestAgent(t)
			ta.members.view = testView(t, "node1", "node2", "node3")
			spec := JobSpec{Run: "farm"}
			j, _ := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: spec, Net: &JobNet{Name: "ftj-test"}})
			if _, err := ta.serveCoordinate(t.Context(), "node2", req(clusterapi.CoordFreeze)); err != nil {
				t.Fatal(err)
			}
			// The dump phase, as coordDump leaves it (the test agent has no CRIU).
			snap := ta.addSnapshot(t, Job{ID: j.ID, UID: uid, Node: ta.cfg.Name, Spec: spec})
			m, err := ta.store.Manifest(j.ID, snap)
			if err != nil {
				t.Fatal(err)
			}
			hold := ta.coord.Get(coordinated.HoldKey(req(clusterapi.CoordFreeze)), cut)
			hold.Dumped = append(hold.Dumped, m)
			// The thaw; its shipping is cut short (no protector answers here), as if it were done.
			done, cancel := context.WithCancel(t.Context())
			cancel()
			ta.serveCoordinate(done, "node2", req(clusterapi.CoordThaw))
			if pins := ta.uncommitted.Pinned(j.ID); !slices.Equal(pins, []string{snap}) {
				t.Fatalf("after the thaw: pinned %v, want [%s]", pins, snap)
			}

			other := req(phase)
			if phase == clusterapi.CoordCommit {
				other.Parts = []clusterapi.CutPart{{Job: "farm-node3-1", Host: "node3", Snapshot: "20261203T100000.000Z-node3-000001"}}
			}
			_, err = ta.serveCoordinate(t.Context(), "node3", other)
			if e := clusterapi.Refusal(err); e == nil || e.Code != clusterapi.CodeRefused {
				t.Errorf("%s of node2's cut from node3 after its thaw: %v; want a refusal", phase, err)
			}
			if pins := ta.uncommitted.Pinned(j.ID); !slices.Equal(pins, []string{snap}) {
				t.Fatalf("after node3's %s: pinned %v, want node2's cut's [%s] kept", phase, pins, snap)
			}
			if _, err := ta.serveCoordinate(t.Context(), "node2", req(clusterapi.CoordAbort)); err != nil {
				t.Fatalf("the coordinator's abort: %v", err)
			}
			if pins := ta.uncommitted.Pinned(j.ID); len(pins) != 0 {
				t.Errorf("after node2's abort: pinned %v, want none", pins)
			}
		})
	}
}

// TestReplicationStopsWaitingForFailedCoordinatorsCommit: a cut's coordinator fails between the thaw and
// the commit. This host refuses whatever a member it does not see alive sends, so the commit never comes,
// and a replication of the cut's jobs that waits for it (Uncommitted.Settle) must stop waiting once a view
// declares the coordinator failed. Before, it waited out the pin's bound, 11 minutes, the run's next
// snapshots unreplicated meanwhile. The cut's snapshot stays pinned here: its commit may have reached
// other members, and a rollback to it, right after the failure, needs it.
func TestReplicationStopsWaitingForFailedCoordinatorsCommit(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	uid := uint32(0)
	key := coordinated.HoldKey(clusterapi.CoordinateRequest{Run: "farm", UID: &uid})
	const cutSnap, later = "20261203T100000.000Z-node1-000001", "20261203T100001.000Z-node1-000002"
	ta.uncommitted.Add(key, "cut-20261203T100000.000", "node2", []*ckpt.Manifest{{Job: "farm-node1-1", ID: cutSnap}})

	waiting := make(chan struct{})
	settled := make(chan error, 1)
	go func() {
		settled <- ta.uncommitted.Settle(t.Context(), "farm-node1-1", later, func() { close(waiting) })
	}()
	select {
	case <-waiting:
	case err := <-settled:
		t.Fatalf("replication did not wait for the commit of a cut whose coordinator is alive: %v", err)
	}
	ta.failMember(t, "node3") // not the coordinator: the wait goes on
	ta.failMember(t, "node2")
	select {
	case err := <-settled:
		if err != nil {
			t.Fatalf("replication after the coordinator's failure: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("replication still waits for the commit of a cut whose coordinator was declared failed")
	}
	if pins := ta.uncommitted.Pinned("farm-node1-1"); !slices.Equal(pins, []string{cutSnap}) {
		t.Errorf("pinned %v after the coordinator's failure, want %v (kept until the pin's bound)", pins, []string{cutSnap})
	}
}

// TestMigrationWaitsForCutsCommit: a job of a run is migrated between its cut's thaw and the cut's commit.
// The migration ships its dump to the target, which may be the job's protector: receiving it, the
// protector prunes its older replicas of the job (keep = 1), the cut's among them, which nothing pins there
// before the commit. Like a scheduled snapshot's replication (Uncommitted.Settle), the migration waits for
// the commit, before it freezes the job. Before, it froze, dumped and shipped at once, and the cut was
// recorded with its part's only copy on the job's old host.
func TestMigrationWaitsForCutsCommit(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	uid := uint32(0)
	j, r := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: "ftj-test"}})
	key := coordinated.HoldKey(clusterapi.CoordinateRequest{Run: "farm", UID: &uid})
	const cut = "cut-20261203T100000.000"
	ta.uncommitted.Add(key, cut, "node2", []*ckpt.Manifest{{Job: j.ID, ID: "20261203T100000.000Z-node1-000001"}})
	waiting := make(chan struct{})
	once := sync.OnceFunc(func() { close(waiting) })
	ta.log = slog.New(hookHandler{func(rec slog.Record) {
		if rec.Message == "migration waits for the commit of the job's coordinated snapshot" {
			once()
		}
	}})
	stopped := make(chan error, 1)
	go func() {
		_, _, deleteNet, err := ta.stopForMigration(t.Context(), *j, j.ID+"-migrate-x", "node2", nil, nil, func(string, time.Time, string, error) {})
		deleteNet()
		stopped <- err
	}()
	select {
	case <-waiting:
	case err := <-stopped:
		t.Fatalf("migration went ahead while the job's cut %s was not committed (priority changes %q): %v", cut, r.events, err)
	}
	if len(r.events) != 0 {
		t.Errorf("the job was readied for its dump while the migration waited for the commit: %q", r.events)
	}
	ta.uncommitted.Done(key, cut, "node2") // the commit
	select {
	case err := <-stopped:
		if err == nil {
			t.Fatal("a migration without CRIU succeeded")
		}
	case <-time.After(time.Minute):
		t.Fatal("migration still waits after the cut's commit")
	}
}

// TestCutPinsSurviveAgentRestart: this host's agent restarts between a cut's thaw and its commit. The
// restarted agent snapshots the adopted jobs at once; with checkpoint.keep = 1 that snapshot's retention
// must still keep the cut's, and the replication wait for the commit. Before, the pins lived in memory only:
// the restart lost them, retention deleted the cut's snapshot, and the commit recorded a cut naming it.
func TestCutPinsSurviveAgentRestart(t *testing.T) {
	ta := newTestAgent(t)
	ta.openUncommitted() // as New does
	ta.cfg.Checkpoint.Keep = 1
	ta.members.view = testView(t, "node1", "node2")
	uid := uint32(0)
	spec := JobSpec{Run: "farm", Recovery: coordinated.RecoveryAuto}
	j, _ := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: spec, Net: &JobNet{Name: "ftj-test"}})
	const cut = "cut-20261203T100000.000"
	cutSnap, req := thawedCut(t, ta, j.ID, spec, cut)

	// The restart: what the agent kept in memory is gone; a new one opens the state directory.
	ta.uncommitted = coordinated.Uncommitted{}
	ta.openUncommitted()
	if pins := ta.uncommitted.Pinned(j.ID); !slices.Equal(pins, []string{cutSnap.ID}) {
		t.Errorf("after the restart: pinned %v, want the uncommitted cut's [%s]", pins, cutSnap.ID)
	}
	waited := false
	ctx, stop := context.WithCancel(t.Context())
	stop() // only whether it waits
	ta.uncommitted.Settle(ctx, j.ID, "later", func() { waited = true })
	if !waited {
		t.Error("after the restart, the replication of the job's next snapshot did not wait for the cut's commit (its protector would prune the cut's replica)")
	}

	later := replicatedSnapshot(t, ta, j.ID, spec)
	ta.pruneOwn(t.Context(), j.ID)
	commit := req(clusterapi.CoordCommit)
	commit.Parts = []clusterapi.CutPart{{Job: j.ID, Host: ta.cfg.Name, Snapshot: cutSnap.ID, Recovery: spec.Recovery}}
	if _, err := ta.serveCoordinate(t.Context(), "node2", commit); err != nil {
		t.Fatalf("commit: %v", err)
	}
	if _, err := ta.store.Manifest(j.ID, cutSnap.ID); err != nil {
		t.Errorf("cut %s recorded naming snapshot %s, which retention deleted after the restart's snapshot %s: %v", cut, cutSnap.ID, later.ID, err)
	}
	// The commit unpins it in the file too: a second restart does not pin it again.
	ta.uncommitted = coordinated.Uncommitted{}
	ta.openUncommitted()
	if pins := ta.uncommitted.Pinned(j.ID); len(pins) != 0 {
		t.Errorf("after the commit and another restart: pinned %v, want none", pins)
	}
}

// stoppingMembers serves a coordinator's phases on the test agents until the phase stopAt, where the
// coordinator's agent stops (a restart, not a failure: it keeps its member incarnation, no view declares it
// failed): with after, that phase reached the hosts first. From then on nothing it sends reaches any host
// (it is gone), and its calls return only when gone closes, at the test's end.
type stoppingMembers struct {
	self    string
	agents  map[string]*testAgent
	stopAt  clusterapi.CoordPhase
	after   bool
	stopped chan struct{}
	once    *sync.Once
	gone    chan struct{}
	// dump stands for the dump phase on a host (the test agents have no CRIU).
	dump func(host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error)
}

func (m stoppingMembers) Alive() []string { return []string{"node1", "node2"} }

func (m stoppingMembers) Coordinate(ctx context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	select {
	case <-m.stopped:
		<-m.gone
		return clusterapi.CoordinateReply{}, errors.New("the coordinator's agent stopped")
	default:
	}
	serve := func() (clusterapi.CoordinateReply, error) {
		if req.Phase == clusterapi.CoordDump {
			return m.dump(host, req)
		}
		return m.agents[host].serveCoordinate(ctx, m.self, req)
	}
	if req.Phase != m.stopAt {
		return serve()
	}
	if m.after {
		done, cancel := context.WithCancel(ctx)
		cancel() // the thaw's shipping cut short (no protector answers here)
		m.agents[host].serveCoordinate(done, m.self, req)
	}
	m.once.Do(func() { close(m.stopped) })
	<-m.gone
	return clusterapi.CoordinateReply{}, errors.New("the coordinator's agent stopped")
}

// TestRestartedCoordinatorGivesUpItsCut: the agent coordinating a cut restarts mid-cut. It keeps its member
// incarnation, so no view declares it failed, and the cut lived only in the memory of its Snapshot call:
// before, a host of the run stopped after its dump and before the thaw kept the run's jobs frozen, and its
// snapshot lock taken, until its hold's bound (10 minutes), and one stopped after the thaw kept the cut's
// snapshots pinned, its replications waiting for the commit, for 11. The restarted agent gives the cut up
// on its hosts (AbortLeft) from the record the coordinator keeps in its state directory until the commit.
func TestRestartedCoordinatorGivesUpItsCut(t *testing.T) {
	for _, tc := range []struct {
		name  string
		at    clusterapi.CoordPhase
		after bool
	}{
		{"after the dump", clusterapi.CoordThaw, false},
		{"after the thaw", clusterapi.CoordThaw, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			uid := uint32(0)
			a1, a2 := newTestAgent(t), newTestAgent(t)
			a2.cfg.Name = "node2"
			a2.openUncommitted()
			for _, ta := range []*testAgent{a1, a2} {
				ta.members.view = testView(t, "node1", "node2")
			}
			agents := map[string]*testAgent{"node1": a1, "node2": a2}
			spec := JobSpec{Run: "farm"}
			j, _ := frozenJob(t, a2, Job{ID: "farm-node2-1", UID: uid, Spec: spec, Net: &JobNet{Name: "ftj-test"}})
			var snap string
			m := stoppingMembers{self: "node1", agents: agents, stopAt: tc.at, after: tc.after,
				stopped: make(chan struct{}), once: &sync.Once{}, gone: make(chan struct{}),
				dump: func(host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
					// As coordDump leaves the hold: the dump added, its clock paused and started again.
					ta := agents[host]
					hold := ta.coord.Get(coordinated.HoldKey(req), req.Cut)
					if hold == nil {
						return clusterapi.CoordinateReply{}, errors.New("not held")
					}
					hold.Pause()()
					snap = ta.addSnapshot(t, Job{ID: j.ID, UID: uid, Node: host, Spec: spec})
					man, err := ta.store.Manifest(j.ID, snap)
					if err != nil {
						return clusterapi.CoordinateReply{}, err
					}
					hold.Dumped = append(hold.Dumped, man)
					return clusterapi.CoordinateReply{Parts: []clusterapi.CutPart{{Job: j.ID, Host: host, Snapshot: snap}}}, nil
				}}
			c := a1.coordinator()
			c.Members = m
			taken := make(chan struct{})
			go func() {
				defer close(taken)
				c.Snapshot(t.Context(), "farm", &uid)
			}()
			t.Cleanup(func() { close(m.gone); <-taken })
			select {
			case <-m.stopped:
			case <-time.After(failAfter):
				t.Fatalf("the cut did not reach its %s phase", tc.at)
			}
			frozen := func() string {
				b, _ := os.ReadFile(filepath.Join(j.Cgroup, "cgroup.freeze"))
				return string(b)
			}
			if tc.after {
				if pins := a2.uncommitted.Pinned(j.ID); !slices.Equal(pins, []string{snap}) {
					t.Fatalf("after the thaw: pinned on node2 %v, want [%s]", pins, snap)
				}
			} else if frozen() != "1" || a2.coord.Len() != 1 {
				t.Fatalf("after the dump: cgroup.freeze %q, %d holds on node2; want 1, 1", frozen(), a2.coord.Len())
			}

			// The restarted agent: a new coordinator on the same state directory, whose calls reach the hosts.
			restarted := a1.coordinator()
			restarted.Members = stoppingMembers{self: "node1", agents: agents, stopped: make(chan struct{})}
			restarted.AbortLeft(t.Context())

			if frozen() != "0" || a2.coord.Len() != 0 || !a2.ckptMu.TryLock() {
				t.Errorf("node2 after the coordinator's restart: cgroup.freeze %q, %d holds; want its jobs thawed, no hold, its snapshot lock free (the old code held them until the hold's bound, %s)",
					frozen(), a2.coord.Len(), clusterapi.MaxCoordStep)
			} else {
				a2.ckptMu.Unlock()
			}
			if pins := a2.uncommitted.Pinned(j.ID); len(pins) != 0 {
				t.Errorf("node2 after the coordinator's restart: pinned %v; want none (the old code pinned them, its replications waiting, for 11 minutes)", pins)
			}
			// Given up once: a second restart sends nothing.
			again := a1.coordinator()
			again.Members = stoppingMembers{self: "node1", stopped: make(chan struct{})} // no agents: a call would panic
			again.AbortLeft(t.Context())
		})
	}
}

// TestAbortBeforeItsFreezeArrives: a coordinator gives a cut up (a host of the run failed) while this
// host's freeze of it is still under way (waiting for the snapshot lock, for pages); its abort arrives
// first. The freeze that follows must not hold the run: nothing would end the hold before
// coordinated.HoldMax. Before, the abort found no hold and was lost, and the freeze then kept the run's jobs
// frozen, and the snapshot lock the rollback after that failure needs, for a minute. Another coordinator's
// freeze of a cut of that name, and a later cut, still hold it.
func TestAbortBeforeItsFreezeArrives(t *testing.T) {
	uid := uint32(0)
	req := func(cut string, p clusterapi.CoordPhase) clusterapi.CoordinateRequest {
		return clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: cut, Phase: p}
	}
	for _, tc := range []struct {
		name, from, cut string
		held            bool
	}{
		{"the aborted cut", "node2", "cut-1", false},
		{"another coordinator's", "node3", "cut-1", true},
		{"the next cut", "node2", "cut-2", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.members.view = testView(t, "node1", "node2", "node3")
			j, _ := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: "ftj-test"}})
			if _, err := ta.serveCoordinate(t.Context(), "node2", req("cut-1", clusterapi.CoordAbort)); err != nil {
				t.Fatalf("abort: %v", err)
			}
			_, err := ta.serveCoordinate(t.Context(), tc.from, req(tc.cut, clusterapi.CoordFreeze))
			b, _ := os.ReadFile(filepath.Join(j.Cgroup, "cgroup.freeze"))
			held := ta.coord.Len() == 1
			if held != tc.held || (string(b) == "1") != tc.held || (err == nil) != tc.held {
				t.Errorf("freeze of %s from %s after node2's abort of cut-1: %v, cgroup.freeze %q, %d holds; want held %v", tc.cut, tc.from, err, b, ta.coord.Len(), tc.held)
			}
			if held {
				ta.coord.End(coordinated.HoldKey(req(tc.cut, clusterapi.CoordFreeze)), tc.cut)
			}
			if !ta.ckptMu.TryLock() {
				t.Fatal("the snapshot lock stays taken")
			}
			ta.ckptMu.Unlock()
		})
	}
}

// TestRollbackGuardRefusesAnAddressHeldByAnotherJob: a rollback makes the part's job network (its guard)
// before restoreJob, whose check of the address refuses the restore only after, and then returns without
// deleting what it did not make. A part whose address another job of this host holds now (it ended here
// after the cut, and the address went to a new job) left its network on the wire with that job's address.
func TestRollbackGuardRefusesAnAddressHeldByAnotherJob(t *testing.T) {
	ta := newTestAgent(t)
	addr := netip.MustParsePrefix("10.9.0.5/24")
	ta.addJob(t, Job{ID: "new-00000001", State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: jobNetName(ta.cfg.Name, "new-00000001"), Addr: addr}})
	var made []string
	ta.nets = jobNetOps{
		create: func(_ context.Context, n *JobNet) error { made = append(made, n.Name); return nil },
		delete: func(context.Context, string) error { return nil },
	}
	part := Job{ID: "farm-00000001", Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: jobNetName("node2", "farm-00000001"), Addr: addr}}
	m := &ckpt.Manifest{Job: part.ID, ID: "20261206T120000.000Z-node2-000001"}
	err := ta.guardJobNet(t.Context(), part, m, dumpWithRunID(t))
	if err == nil || !strings.Contains(err.Error(), "held by job new-00000001") {
		t.Errorf("guard of a part whose address another running job holds: %v, want a refusal naming that job", err)
	}
	if len(made) > 0 {
		t.Errorf("the refused part's network %v was made, with the address job new-00000001 holds", made)
	}
}

// dumpWithRunID is a dump directory whose inventory.img is as CRIU 4.2.1 writes it (nftables lock, a run
// id): guardJobNet gets as far as making the network.
func dumpWithRunID(t *testing.T) string {
	t.Helper()
	work := t.TempDir()
	inv, err := hex.DecodeString("163131584e000000080210011a18080110011801200128013002380340044806500758086005200128013000580162006a24" +
		"37663035613163352d656235632d343031302d383739342d633762343435396136333533")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "inventory.img"), inv, 0o600); err != nil {
		t.Fatal(err)
	}
	return work
}
