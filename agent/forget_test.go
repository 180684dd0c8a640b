package agent

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/jobnet"
)

// saveEndedAt saves the record of ta's job id as that of a job that ended at ended: a record without its
// end (Ended), written then (its file's modification time).
func (ta *testAgent) saveEndedAt(t *testing.T, id string, ended time.Time) {
	t.Helper()
	ta.mu.Lock()
	j := ta.byID[id]
	ta.mu.Unlock()
	if err := ta.jobs.save(j); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(ta.jobs.path(id), ended, ended); err != nil {
		t.Fatal(err)
	}
}

// forgettingN1 is member n1 (clientAgent) in a cluster where n2 listens on port, with a store of job
// records and checkpoint.keep_ended an hour.
func forgettingN1(t *testing.T, pki *testPKI, port uint16) *Agent {
	t.Helper()
	n1, _ := clientAgent(t, pki, map[string]uint16{"n2": port})
	n1.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	n1.jobs = jobStore{dir: filepath.Join(n1.cfg.StateDir, "jobs")}
	if err := os.MkdirAll(n1.jobs.dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return n1
}

// keepRecord saves rec, a's record of its job, and keeps it in memory as a's record.
func keepRecord(t *testing.T, a *Agent, rec *Job) {
	t.Helper()
	if err := a.jobs.save(rec); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	a.byID[rec.ID] = rec
	a.mu.Unlock()
}

// addN1Snapshots adds n snapshots of n1's job to a's store, as the replicas a holds of n1's.
func addN1Snapshots(t *testing.T, a *Agent, job string, n int) {
	t.Helper()
	h := &testAgent{Agent: &Agent{store: storeOf(t, a, "n1")}}
	for range n {
		h.addSnapshot(t, Job{ID: job, Node: "n1"})
	}
}

// TestForgetEndedJobs: once checkpoint.keep_ended has passed, an ended job's snapshots taken here before
// it ended go, and its record with them unless something still needs it. Before, nothing ever deleted an
// ended job's snapshots, here or on its protectors, nor its record: a cluster's disks filled with the
// snapshots of every job that ever ran.
func TestForgetEndedJobs(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	t0 := time.Now()
	const (
		movedJob = "moved-00000001" // its address may be in use on the host it moved to
		backJob  = "back-00000001"  // snapshotted after it ended here: a copy came back, say
		toldJob  = "told-00000001"  // its replicas are on node2, which does not answer
		lostJob  = "lost-00000001"  // its process vanished; not known to run elsewhere
	)
	ended := map[string]time.Time{doneJob: t0.Add(time.Minute), movedJob: t0.Add(time.Minute), backJob: t0.Add(-time.Minute), toldJob: t0.Add(time.Minute),
		lostJob: t0.Add(time.Minute)}
	ta.addJob(t, Job{ID: movedJob, State: JobMoved, MovedTo: "node2", Net: &JobNet{Kind: jobnet.MACVlan, Name: "n", Addr: netip.MustParsePrefix("10.9.0.5/24")}})
	ta.addJob(t, Job{ID: backJob, State: JobExited})
	ta.addJob(t, Job{ID: toldJob, State: JobExited, Replica: &Replica{Holders: []string{"node2"}}})
	ta.addJob(t, Job{ID: lostJob, State: JobLost}) // its owner may restore it: kept 7 times as long
	ta.mu.Lock()
	ta.byID[doneJob].Replica = &Replica{Holders: []string{"node9"}} // no longer a member: nobody to tell
	ta.mu.Unlock()
	snaps := map[string][]string{}
	for _, id := range []string{doneJob, movedJob, backJob, toldJob, lostJob} {
		for range 2 {
			snaps[id] = append(snaps[id], ta.addSnapshot(t, Job{ID: id, Node: ta.cfg.Name}))
		}
		ta.saveEndedAt(t, id, ended[id])
	}
	for _, p := range []string{ta.shimLog(doneJob), ta.supersededMark(doneJob, 0), ta.refusalMark(doneJob, 1)} {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	ta.forgetDue(t.Context(), t0.Add(30*time.Minute)) // keep_ended has not passed for any
	for id, want := range snaps {
		if got, _ := ta.store.List(id, ""); len(got) != len(want) {
			t.Errorf("before keep_ended: %s has snapshots %v, want %v", id, got, want)
		}
	}

	ta.forgetDue(t.Context(), t0.Add(2*time.Hour))
	record := func(id string) (*Job, bool) {
		ta.mu.Lock()
		defer ta.mu.Unlock()
		j, ok := ta.byID[id]
		if ok {
			c := *j
			return &c, true
		}
		return nil, false
	}
	for _, tc := range []struct {
		id        string
		snapshots int
		record    bool
		forgotten bool
		forget    []string
	}{
		{id: doneJob},
		{id: movedJob, record: true, forgotten: true},
		{id: backJob, snapshots: 2, record: true},
		{id: toldJob, record: true, forget: []string{"node2"}},
		{id: lostJob, snapshots: 2, record: true},
	} {
		if got, _ := ta.store.List(tc.id, ""); len(got) != tc.snapshots {
			t.Errorf("%s: snapshots %v, want %d of them", tc.id, got, tc.snapshots)
		}
		j, ok := record(tc.id)
		_, statErr := os.Stat(ta.jobs.path(tc.id))
		if ok != tc.record || (statErr == nil) != tc.record {
			t.Errorf("%s: record in memory %v, on disk %v; want %v", tc.id, ok, statErr == nil, tc.record)
		}
		if ok && (j.Forgotten != tc.forgotten || !slices.Equal(j.Forget, tc.forget) || (tc.id != lostJob && !j.Ended.Equal(ended[tc.id]))) {
			t.Errorf("%s: forgotten %v, forget %v, ended %v; want %v, %v, %v", tc.id, j.Forgotten, j.Forget, j.Ended, tc.forgotten, tc.forget, ended[tc.id])
		}
	}
	ta.forgetDue(t.Context(), t0.Add(8*time.Hour))
	if got, _ := ta.store.List(lostJob, ""); len(got) != 0 {
		t.Errorf("a lost job after 7 times keep_ended: snapshots %v, want none", got)
	}
	ta.forgetDue(t.Context(), t0.Add(8*time.Hour))
	if got, _ := ta.store.List(lostJob, ""); len(got) != 0 {
		t.Errorf("a lost job after 7 times keep_ended: snapshots %v, want none", got)
	}
	for _, p := range []string{ta.shimLog(doneJob), ta.supersededMark(doneJob, 0), ta.refusalMark(doneJob, 1), filepath.Join(ta.store.Root(), doneJob)} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s left: %v", p, err)
		}
	}
	if got, _ := ta.store.List(ownersJob, ""); !slices.Equal(got, []string{ta.ownSnap}) {
		t.Errorf("a running job's snapshots: %v, want [%s]", got, ta.ownSnap)
	}
	if got, _ := ta.store.List(goneJob, ""); !slices.Equal(got, []string{ta.goneSnap}) {
		t.Errorf("a replica of another host's job: %v, want [%s]", got, ta.goneSnap)
	}
}

// TestServeForget: a host drops the replicas of an ended job that the asking host took before the job
// ended, and no others.
func TestServeForget(t *testing.T) {
	ta := newTestAgent(t)
	const job = "far-00000001"
	took := func(node string) string {
		s, err := ckpt.Open(ta.store.Root(), ckpt.Options{Node: node})
		if err != nil {
			t.Fatal(err)
		}
		saved := ta.store
		ta.store = s
		defer func() { ta.store = saved }()
		return ta.addSnapshot(t, Job{ID: job, Node: node})
	}
	node2a, node2b, node3 := took("node2"), took("node2"), took("node3")
	ta.detStore = intercept.NewStore(0, 0)
	for _, n := range []string{"node2", "node3"} {
		ta.detStore.Add(n, intercept.Batch{Job: job, Stream: 1, FromStart: true, Dets: []intercept.Det{{End: 10, Len: 10}}})
	}
	after := time.Now().Add(time.Minute)

	if rep, err := ta.serveForget("node2", clusterapi.ForgetRequest{Job: job, Ended: after.Add(-time.Hour)}); err != nil || rep.Deleted != 0 || rep.Kept != 2 || ta.detStore.Len(job, "node2") != 1 {
		t.Errorf("forget of snapshots taken after the end: %+v, %v, %d determinants; want none deleted, 2 kept, the determinant kept", rep, err, ta.detStore.Len(job, "node2"))
	}
	ta.addJob(t, Job{ID: job, State: JobRunning, PID: os.Getpid()})
	if rep, err := ta.serveForget("node2", clusterapi.ForgetRequest{Job: job, Ended: after}); err != nil || rep.Deleted != 0 || rep.Kept != 2 {
		t.Errorf("forget of a job that runs here: %+v, %v; want none deleted, 2 kept", rep, err)
	}
	ta.mu.Lock()
	delete(ta.byID, job)
	ta.mu.Unlock()
	if rep, err := ta.serveForget("node2", clusterapi.ForgetRequest{Job: job, Ended: after}); err != nil || rep.Deleted != 2 || rep.Kept != 0 {
		t.Errorf("forget: %+v, %v; want 2 deleted", rep, err)
	}
	if got, _ := ta.store.List(job, ""); !slices.Equal(got, []string{node3}) {
		t.Errorf("left %v, want only node3's %s (not %s, %s)", got, node3, node2a, node2b)
	}
	if n2, n3 := ta.detStore.Len(job, "node2"), ta.detStore.Len(job, "node3"); n2 != 0 || n3 != 1 {
		t.Errorf("determinants left: node2's %d, node3's %d; want 0 and 1", n2, n3)
	}
}

// TestEndedRunsCutForgotten: every member keeps the newest cut of each coordinated run, and a run that goes
// on replaces it at its interval; nothing replaced the last cut of a run that ended, which pinned its jobs'
// snapshots (and kept their records) for good. Once the run runs here no more and its cut is keep_ended
// old, the cut goes, and the ended jobs are forgotten as others are.
func TestEndedRunsCutForgotten(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	ta.failMember(t, "node2") // nobody else to ask whether the run goes on
	const run, job, other = "mpi-3f9a2c", "mpi-3f9a2c-node1-0a0b0c0d", "mpi-77aa00"
	t0 := time.Now()
	ta.addJob(t, Job{ID: job, State: JobExited, UID: 1000, Spec: JobSpec{Run: run, Recovery: coordinated.RecoveryCoordinated}})
	ta.addJob(t, Job{ID: other + "-node1-00000001", State: JobRunning, PID: os.Getpid(), UID: 1000, Spec: JobSpec{Run: other, Recovery: coordinated.RecoveryCoordinated}})
	snap := ta.addSnapshot(t, Job{ID: job, UID: 1000, Node: ta.cfg.Name, Spec: JobSpec{Run: run}})
	ta.saveEndedAt(t, job, t0.Add(time.Minute)) // it ended after its snapshot
	for _, r := range []string{run, other} {
		if err := ta.cutRecords().Save(coordinated.Cut{Run: r, UID: 1000, ID: "cut-20261203T100000.000", Taken: t0,
			Parts: []clusterapi.CutPart{{Job: job, Host: ta.cfg.Name, Snapshot: snap, Recovery: coordinated.RecoveryCoordinated}}}); err != nil {
			t.Fatal(err)
		}
	}
	ta.forgetDue(t.Context(), t0.Add(2*time.Hour))
	if runs := ta.cutRecords().Runs(); !slices.Equal(runs, []coordinated.Run{{Name: other, UID: 1000}}) {
		t.Errorf("cut records %v, want only that of %s, which runs here", runs, other)
	}
	// The cut of the run that goes on still pins (the test's cut names the ended job for it too).
	if snaps, _ := ta.store.List(job, ""); len(snaps) != 1 {
		t.Errorf("snapshots %v; want the one a cut of a running run names", snaps)
	}
	if _, err := ta.cutRecords().Remove(other, 1000, "cut-20261203T100000.000"); err != nil {
		t.Fatal(err)
	}
	ta.forgetDue(t.Context(), t0.Add(3*time.Hour))
	if snaps, _ := ta.store.List(job, ""); len(snaps) != 0 {
		t.Errorf("snapshots %v; want none once no cut names them", snaps)
	}
	if _, err := os.Stat(ta.jobs.path(job)); !os.IsNotExist(err) {
		t.Errorf("the ended job's record: %v; want it gone", err)
	}
}

// TestForgetAsksAgainWhileTheHolderKeeps: a job failed over from n1 to n2, its protector, which restored it
// from n1's replicas and runs it. Once keep_ended passed on n1, n1 told n2 to drop them; n2 kept them (the
// job runs there) and n1 removed its record anyway, so nobody asked again and n1's replicas stayed on n2's
// disk for good, even after the job ended there. n1 now asks at each pass until n2 keeps none.
func TestForgetAsksAgainWhileTheHolderKeeps(t *testing.T) {
	pki := newTestPKI(t)
	const job = "moved-0000000a"
	n2, port := servedAgent(t, pki, "n2")
	addN1Snapshots(t, n2, job, 2) // n1's replicas on n2, from which n2 restored the job it now runs
	n2.mu.Lock()
	n2.byID[job] = &Job{ID: job, Node: "n2", State: JobRunning}
	n2.mu.Unlock()

	n1 := forgettingN1(t, pki, port)
	ended := time.Now().Add(time.Minute)
	rec := &Job{ID: job, Node: "n1", State: JobMoved, MovedTo: "n2", Ended: ended, Replica: &Replica{Holders: []string{"n2"}}}
	keepRecord(t, n1, rec)
	n1Record := func() (*Job, bool) {
		n1.mu.Lock()
		defer n1.mu.Unlock()
		j, ok := n1.byID[job]
		if !ok {
			return nil, false
		}
		c := *j
		return &c, true
	}

	n1.forgetDue(t.Context(), ended.Add(2*time.Hour))
	if got, _ := n2.store.List(job, "n1"); len(got) != 2 {
		t.Errorf("n1's replicas on n2, which runs the job: %v; want both kept", got)
	}
	if j, ok := n1Record(); !ok || !slices.Equal(j.Forget, []string{"n2"}) || j.Forgotten {
		t.Errorf("n1's record after n2 kept its replicas: %+v, %v; want it kept, n2 to ask again", j, ok)
	}

	n2.mu.Lock()
	n2.byID[job].State = JobExited // the job ended on n2 too
	n2.mu.Unlock()
	n1.forgetDue(t.Context(), ended.Add(3*time.Hour))
	if got, _ := n2.store.List(job, "n1"); len(got) != 0 {
		t.Errorf("n1's replicas on n2 after the job ended there: %v; want none", got)
	}
	if j, ok := n1Record(); ok {
		t.Errorf("n1's record once n2 kept nothing: %+v; want it gone", j)
	}
	if _, err := os.Stat(n1.jobs.path(job)); !os.IsNotExist(err) {
		t.Errorf("n1's record on disk: %v; want it gone", err)
	}
}

// TestForgetTellsFormerProtectors: n1's job was protected by n2, then by n3 (the ring changed, or n2 did not
// answer once). Retention deleted n1's snapshots that n2 held copies of, and with them the only record that
// n2 held any: once the job ended, n1 told n3 alone, and n2 kept its copies for good. Each protector change
// left a job's last replicas on the old protector's disk. The holders a newer replica replaces are now told too.
func TestForgetTellsFormerProtectors(t *testing.T) {
	pki := newTestPKI(t)
	const job = "churn-0000000b"
	n2, port := servedAgent(t, pki, "n2")
	addN1Snapshots(t, n2, job, 1) // n1's replica on n2

	n1 := forgettingN1(t, pki, port)
	n1.cfg.Checkpoint.Keep = 1
	n1.replicaConns = map[string]replicaConns{}
	rec := &Job{ID: job, Node: "n1", State: JobRunning, PID: os.Getpid()}
	n1.mu.Lock()
	n1.byID[job] = rec
	n1.mu.Unlock()
	h1 := &testAgent{Agent: n1}
	for _, holder := range []string{"n2", "n3"} { // the protector changed from n2 to n3
		id := h1.addSnapshot(t, Job{ID: job, Node: "n1"})
		m, err := n1.store.AddReplica(job, id, holder)
		if err != nil {
			t.Fatal(err)
		}
		n1.recordReplica(t.Context(), m, nil)
		n1.pruneOwn(t.Context(), job)
	}
	if got, _ := n1.store.List(job, "n1"); len(got) != 1 {
		t.Fatalf("n1's snapshots after retention: %v; want only the newest", got)
	}
	ended := time.Now().Add(time.Minute)
	n1.mu.Lock()
	rec.State, rec.Ended = JobExited, ended
	n1.mu.Unlock()
	if err := n1.jobs.save(rec); err != nil {
		t.Fatal(err)
	}
	n1.forgetDue(t.Context(), ended.Add(2*time.Hour))
	if got, _ := n2.store.List(job, "n1"); len(got) != 0 {
		t.Errorf("n1's replicas on n2, its former protector, after the job was forgotten: %v; want none", got)
	}
}

// TestForgetTellsTheHostItWasRestoredOn: n1 failed, its job was restored on n2 (a spare, say), which
// fetched n1's snapshot from n1's protector to restore it, and n1 came back. Once keep_ended passed, n1
// told the protector alone: n2 is named by none of n1's snapshots, so the copy it fetched stayed on its disk
// for good, even after the job ended there. The host a failure of n1 restored the job on is told too.
func TestForgetTellsTheHostItWasRestoredOn(t *testing.T) {
	pki := newTestPKI(t)
	const job = "moved-0000000c"
	n2, port := servedAgent(t, pki, "n2")
	addN1Snapshots(t, n2, job, 1) // fetched to restore it
	n2.mu.Lock()
	n2.byID[job] = &Job{ID: job, Node: "n2", State: JobExited} // it ended on n2 since
	n2.mu.Unlock()

	n1 := forgettingN1(t, pki, port)
	t0 := time.Now()
	n1.failures.Update("n1-1", func(f *Failure) {
		*f = Failure{ID: "n1-1", Node: "n1", Protector: "n3", Target: "n2", Detected: t0, Updated: t0, Jobs: []string{job}}
	})
	ended := t0.Add(time.Minute)
	rec := &Job{ID: job, Node: "n1", State: JobLost, Fenced: true, Ended: ended, Replica: &Replica{Node: "n1", Holders: []string{"n3"}}}
	keepRecord(t, n1, rec)
	n1.forgetDue(t.Context(), ended.Add(2*time.Hour))
	if got, _ := n2.store.List(job, "n1"); len(got) != 0 {
		t.Errorf("the copy of n1's snapshot on n2, where a failure of n1 restored the job: %v; want none", got)
	}
}

// TestFailedRestoreKeepsTheLostJobsSnapshots: node1 failed and came back; the recovery of its job on node2
// failed (CRIU refused it), so the job runs nowhere and its owner may restore it from its snapshots. The
// failure named node2 as its target, which was taken for "restored elsewhere": the snapshots and replicas
// went after keep_ended instead of 7 times that. Only a job whose restore did not fail counts as restored.
func TestFailedRestoreKeepsTheLostJobsSnapshots(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	const job = "failed-0000000e"
	t0 := time.Now()
	ended := t0.Add(time.Minute)
	ta.addJob(t, Job{ID: job, State: JobLost, Fenced: true, Ended: ended})
	snap := ta.addSnapshot(t, Job{ID: job, Node: ta.cfg.Name})
	for _, tc := range []struct {
		stages []Stage
		kept   bool
	}{
		{stages: []Stage{{Name: StageRestored, Job: job, Host: "node2", Error: "criu: no"}}, kept: true},
		{stages: []Stage{{Name: StageFetched, Job: job, Host: "node2", Error: "no verified replica"}}, kept: true},
		{stages: []Stage{{Name: StageRestored, Job: "other-0000000e", Host: "node2", Error: "criu: no"}, {Name: StageRestored, Job: job, Host: "node2"}}},
	} {
		ta.failures.Update("node1-1", func(f *Failure) {
			*f = Failure{ID: "node1-1", Node: "node1", Protector: "node2", Target: "node2", Detected: t0, Updated: t0,
				Jobs: []string{job, "other-0000000e"}, Stages: tc.stages}
		})
		due := ta.dueToForget(ended.Add(2 * time.Hour))
		if got := slices.ContainsFunc(due, func(e endedJob) bool { return e.job.ID == job }); got == tc.kept {
			t.Errorf("stages %+v: due to be forgotten %v after twice keep_ended, want %v", tc.stages, got, !tc.kept)
		}
	}
	if got, _ := ta.store.List(job, ""); !slices.Equal(got, []string{snap}) {
		t.Errorf("snapshots %v, want %s", got, snap)
	}
}

// TestStaleCutKeptWhileItsRunRunsElsewhere: n1 runs no job of a run that goes on on n2, and keeps its
// newest cut (n1 is the protector of n2's part, say, or a job of the run moved away from it). The run's
// interval is longer than keep_ended (a job's interval has no upper bound), or its cuts keep failing: the
// old code forgot the cut once it was keep_ended old, unpinning the snapshots and replicas a rollback of
// the running run needs, and leaving n1 unable to roll it back. The cut now stays while any alive member
// runs the run, or cannot be asked, and goes once the run runs nowhere.
func TestStaleCutKeptWhileItsRunRunsElsewhere(t *testing.T) {
	pki := newTestPKI(t)
	const run, job = "mpi-5e1d00", "mpi-5e1d00-n2-0a0b0c0d"
	n2, port := servedAgent(t, pki, "n2")
	n2.mu.Lock()
	n2.byID[job] = &Job{ID: job, Node: "n2", State: JobRunning, UID: 1000, Spec: JobSpec{Run: run, Recovery: coordinated.RecoveryCoordinated},
		Net: &JobNet{Kind: jobnet.MACVlan, Name: "n", Addr: netip.MustParsePrefix("10.9.0.7/24")}}
	n2.mu.Unlock()

	n1 := &testAgent{}
	n1.Agent, _ = clientAgent(t, pki, map[string]uint16{"n2": port})
	n1.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	t0 := time.Now()
	const cutID = "cut-20261203T100000.000"
	if err := n1.cutRecords().Save(coordinated.Cut{Run: run, UID: 1000, ID: cutID, Taken: t0,
		Parts: []clusterapi.CutPart{{Job: job, Host: "n2", Snapshot: "20261203T100000.000Z-n2-000001", Recovery: coordinated.RecoveryCoordinated}}}); err != nil {
		t.Fatal(err)
	}
	kept := func(when string) {
		t.Helper()
		uid := uint32(1000)
		if c, err := n1.cutRecords().Load(run, &uid); err != nil || c.ID != cutID {
			t.Fatalf("%s: n1's cut of the run: %+v, %v; want %s kept", when, c, err, cutID)
		}
		if pinned := n1.cutRecords().Pinned(job); !slices.Equal(pinned, []string{"20261203T100000.000Z-n2-000001"}) {
			t.Fatalf("%s: pinned %v; want the cut's part", when, pinned)
		}
	}

	// n3 and the spares do not answer: whether they run the run is not known.
	n1.forgetDue(t.Context(), t0.Add(2*time.Hour))
	kept("the run runs on n2, the other members cannot be asked")
	for _, m := range []string{"n3", "s1", "s2"} {
		n1.failMember(t, m)
	}
	n1.forgetDue(t.Context(), t0.Add(3*time.Hour))
	kept("the run runs on n2")

	n2.mu.Lock()
	n2.byID[job].State = JobExited // the run ended
	n2.mu.Unlock()
	n1.forgetDue(t.Context(), t0.Add(4*time.Hour))
	if runs := n1.cutRecords().Runs(); len(runs) != 0 {
		t.Errorf("cut records %v once the run runs nowhere; want none", runs)
	}
}

// TestForgetWaitsForCutsCommit: a cut dumped a job, which ended before the cut's commit (keep_ended shorter
// than the wait for the commit, or a coordinator that failed after the thaw, whose cut stays pinned for a
// rollback should its commit have reached other members). The old code's forget honoured only recorded cuts:
// it deleted the cut's snapshot here and told its protector to delete its copy, which nothing pins before
// the commit, and the cut was then recorded naming snapshots that no longer existed anywhere. The forget
// now waits for the commit.
func TestForgetWaitsForCutsCommit(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	const run, job, cut = "mpi-6a2b00", "mpi-6a2b00-node1-0a0b0c0d", "cut-20261203T100000.000"
	uid := uint32(1000)
	t0 := time.Now()
	ta.addJob(t, Job{ID: job, State: JobExited, UID: uid, Spec: JobSpec{Run: run, Recovery: coordinated.RecoveryCoordinated}})
	snap := ta.addSnapshot(t, Job{ID: job, UID: uid, Node: ta.cfg.Name, Spec: JobSpec{Run: run}})
	m, err := ta.store.Manifest(job, snap)
	if err != nil {
		t.Fatal(err)
	}
	key := coordinated.HoldKey(clusterapi.CoordinateRequest{Run: run, UID: &uid, Cut: cut})
	if err := ta.uncommitted.Add(key, cut, "node2", []*ckpt.Manifest{m}); err != nil {
		t.Fatal(err)
	}
	ta.saveEndedAt(t, job, t0.Add(time.Minute)) // it ended after the dump

	ta.forgetDue(t.Context(), t0.Add(2*time.Hour))
	if snaps, _ := ta.store.List(job, ""); !slices.Equal(snaps, []string{snap}) {
		t.Fatalf("snapshots %v before the cut's commit; want the cut's %s kept", snaps, snap)
	}
	if _, err := os.Stat(ta.jobs.path(job)); err != nil {
		t.Fatalf("the ended job's record before the cut's commit: %v; want it kept", err)
	}

	ta.uncommitted.Done(key, cut, "node2") // given up by its coordinator
	ta.forgetDue(t.Context(), t0.Add(3*time.Hour))
	if snaps, _ := ta.store.List(job, ""); len(snaps) != 0 {
		t.Errorf("snapshots %v once the cut was given up; want none", snaps)
	}
}

// TestForgetSparesARestoreUnderWay: a restore of an ended job is under way on this host (its owner
// restores the lost job, a recovery restores it here), from a snapshot of it this host holds. The job is
// not running yet (its record is replaced once it is restored), and the old code took it for ended: the
// forget deleted the snapshot the restore reads, here and on its holders, and a restore that failed
// could not be tried again; one that succeeded ran with no replica left. The forget waits for the restore.
func TestForgetSparesARestoreUnderWay(t *testing.T) {
	for _, tc := range []struct {
		name  string
		serve bool // the holder's side (serveForget), else the host's own (forgetDue)
	}{
		{name: "own snapshots"},
		{name: "a host's replicas", serve: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
			const job = "lost-0000000f"
			t0 := time.Now()
			ended := t0.Add(time.Minute)
			var snap string
			if tc.serve {
				addN1Snapshots(t, ta.Agent, job, 1)
				got, _ := ta.store.List(job, "n1")
				snap = got[0]
			} else {
				ta.addJob(t, Job{ID: job, State: JobExited, Ended: ended})
				snap = ta.addSnapshot(t, Job{ID: job, Node: ta.cfg.Name})
			}
			unlock, err := ta.lockRestore(t.Context(), job, "restore")
			if err != nil {
				t.Fatal(err)
			}
			forget := func() {
				if !tc.serve {
					ta.forgetDue(t.Context(), ended.Add(2*time.Hour))
					return
				}
				if rep, err := ta.serveForget("n1", clusterapi.ForgetRequest{Job: job, Ended: time.Now().Add(time.Hour)}); err != nil {
					t.Fatal(err)
				} else if unlock != nil && (rep.Deleted != 0 || rep.Kept != 1) {
					t.Errorf("forget during a restore: %+v; want none deleted, 1 kept", rep)
				}
			}
			forget()
			if got, _ := ta.store.List(job, ""); !slices.Equal(got, []string{snap}) {
				t.Errorf("snapshots while the job is being restored here: %v; want [%s]", got, snap)
			}
			unlock()
			unlock = nil
			forget()
			if got, _ := ta.store.List(job, ""); len(got) != 0 {
				t.Errorf("snapshots once the restore ended: %v; want none", got)
			}
		})
	}
}

// TestForgetDropsTheIntervalPolicy: a job forgotten here (its record gone) takes its checkpoint interval
// policy with it. Before, the agent kept one for every job that ever ran on the host, for as long as it ran.
func TestForgetDropsTheIntervalPolicy(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.KeepEnded = Duration{Duration: time.Hour}
	t0 := time.Now()
	ta.policyFor(doneJob) // its snapshots were scheduled while it ran
	ta.saveEndedAt(t, doneJob, t0)
	ta.forgetDue(t.Context(), t0.Add(2*time.Hour))
	ta.mu.Lock()
	_, record := ta.byID[doneJob]
	_, policy := ta.policies[doneJob]
	ta.mu.Unlock()
	if record || policy {
		t.Errorf("job forgotten: record kept %v, interval policy kept %v; want neither", record, policy)
	}
}
