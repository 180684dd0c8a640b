package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestCoordinatedRollback: a two-rank ringstencil on job addresses (rank 0 on node1, rank 1 on node2) is a
// run. node3, which runs none of it, takes a coordinated snapshot of the run: both ranks frozen before
// either is dumped, thawed once both are, the cut checked and recorded. The ranks run on well past it, rank
// 1 moved to node3 meanwhile; then node1 rolls the whole run back: both ranks are killed without a word on
// the wire and restored from the cut where they run (rank 1 on node3, from its part taken on node2; new
// processes, incarnation + 1, their addresses), re-execute what they had done since, and the run ends
// with the failure-free checksum. A run with a job on its host's address is
// refused before anything stops.
func TestCoordinatedRollback(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const port = 7490
	args := ringArgs(1500, 16<<10, 10*time.Millisecond)
	ctx := context.Background()
	want := reference(t, 2, args)
	c := newCluster(t, 3, 0, labcluster.Options{Interval: "1h", JobAddresses: true})
	rg := startJobAddrRing(t, c, port, args, "ring1")
	rg.waitProgress(t, progressEvery, 2*time.Minute)

	other, err := c.Client("node2").StartJob(ctx, agent.JobSpec{Name: "other", Run: "mixed", Argv: []string{"/bin/sleep", "600"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client("node3").Cut(ctx, coordinated.RunRequest{Run: "mixed"}); err == nil || !strings.Contains(err.Error(), "host address") {
		t.Errorf("coordinated snapshot of a run with a job on its host's address: %v, want a refusal naming the host address", err)
	}
	if j, err := c.Client("node2").Job(ctx, other.ID); err != nil || j.State != agent.JobRunning || j.PID != other.PID {
		t.Errorf("the refused run's job: %+v %v, want it running as before", j, err)
	}
	if _, err := c.Client("node3").Rollback(ctx, coordinated.RunRequest{Run: "ring1"}); err == nil || !strings.Contains(err.Error(), coordinated.ErrNoCut.Error()) {
		t.Errorf("rollback of a run without a coordinated snapshot: %v, want %q", err, coordinated.ErrNoCut)
	}

	// Another user names a run of theirs alike: the name alone is ambiguous, and their job is never part of
	// root's run.
	foreign := startWrappedAs(t, c, "node3", "foreign", nobodyID, "/", []string{"--run", "ring1", "--job-address"}, "/bin/sleep", "600")
	t.Cleanup(func() { removeJobNets(t, foreign.ID) })
	if _, err := c.Client("node3").Cut(ctx, coordinated.RunRequest{Run: "ring1"}); err == nil || !strings.Contains(err.Error(), "name the user") {
		t.Errorf("coordinated snapshot of a run name two users have: %v, want a refusal asking for the user", err)
	}
	root := uint32(0)
	cut, err := c.Client("node3").Cut(ctx, coordinated.RunRequest{Run: "ring1", UID: &root})
	if err != nil {
		t.Fatalf("coordinated snapshot of run ring1: %v", err)
	}
	t.Logf("cut %s: frozen %s, parts %+v", cut.ID, cut.Frozen, cut.Parts)
	parts := map[string]string{} // job -> snapshot
	for _, p := range cut.Parts {
		parts[p.Job] = p.Snapshot
	}
	if len(cut.Parts) != 2 || parts[rg.jobs[0].ID] == "" || parts[rg.jobs[1].ID] == "" || cut.Frozen <= 0 {
		t.Fatalf("cut %+v, want one part for each rank", cut)
	}
	for r, host := range []string{"node1", "node2"} {
		snaps, err := c.Client(host).Snapshots(ctx, rg.jobs[r].ID)
		if err != nil || !slices.ContainsFunc(snaps, func(m *ckpt.Manifest) bool { return m.ID == parts[rg.jobs[r].ID] && m.Replicated() }) {
			t.Errorf("rank %d's part %s on %s: not a replicated snapshot there (%v)", r, parts[rg.jobs[r].ID], host, err)
		}
	}
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	// Rank 1 moves to node3 after the cut: the rollback restores it where it runs now, from its part.
	if _, err := c.Client("node2").Migrate(ctx, agent.MigrateRequest{Job: rg.jobs[1].ID, To: "node3"}); err != nil {
		t.Fatalf("migrate rank 1 to node3: %v", err)
	}
	rg.waitProgress(t, 2*progressEvery, 2*time.Minute) // well past the cut

	before := []agent.Job{rg.job(t, "node1", 0), rg.job(t, "node3", 1)}
	rb, err := c.Client("node1").Rollback(ctx, coordinated.RunRequest{Run: "ring1", UID: &root})
	if err != nil {
		t.Fatalf("rollback of run ring1: %v", err)
	}
	t.Logf("rolled back to %s: stopped %s", rb.Cut, rb.Stopped)
	if j := rg.job(t, "node2", 1); j.State == agent.JobRunning {
		t.Errorf("node2 runs rank 1 again after the rollback: %+v (it ran on node3)", j)
	}
	for r, host := range []string{"node1", "node3"} {
		j := rg.job(t, host, r)
		if j.State != agent.JobRunning || j.Restored != parts[j.ID] || j.Incarnation != before[r].Incarnation+1 || j.PID == before[r].PID ||
			j.Net == nil || j.Net.Addr != before[r].Net.Addr {
			t.Fatalf("rank %d on %s after the rollback: %+v, want a new process from %s, incarnation %d, address %s", r, host, j, parts[j.ID], before[r].Incarnation+1, before[r].Net.Addr)
		}
		requireInJobNet(t, c, j)
	}
	if j, err := c.Client("node3").Job(ctx, foreign.ID); err != nil || j.State != agent.JobRunning || j.PID != foreign.PID {
		t.Errorf("the other user's job of a run named alike: %+v %v, want it untouched by root's rollback", j, err)
	}
	f := findEvent(t, c, rb.Event)
	logTimeline(t, f)
	if f.Kind != coordinated.KindRollback || !f.Done || f.Error != "" || len(f.Stages) != 3 {
		t.Errorf("event %s: %+v, want a completed rollback with its three stages (parts checked, stopped, restored)", rb.Event, f)
	}
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	checkRanks(t, rg.wait(t, 3*time.Minute), want)
	if err := c.Client("node2").Signal(ctx, other.ID, 9); err != nil {
		t.Error(err)
	}
}

// TestAutoRollback: a two-rank ping-pong whose rank 1 draws each block's bytes from the wall clock
// (testdata/nondet --clock: message logging cannot recover it), on job addresses, as run "nd" in auto
// mode: its jobs take snapshots of their own for message logging and, every interval, the run a
// coordinated one (scheduled by node1, the first of its hosts). node2 crashes. Message logging restores
// rank 1 on spare1, which re-sends other bytes than rank 0 had received; instead of failing, the
// recovery rolls the whole run back to its cut: rank 0 on node1 and rank 1 on spare1, each from its part.
// The run then completes: rank 0 received exactly what rank 1 sent (one execution's checksum on both
// sides), and the failure's timeline says what happened and why.
func TestAutoRollback(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const port = 7491
	ctx := context.Background()
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h", JobAddresses: true})
	st := c.Lab.State()
	peer := netip.AddrPortFrom(labcluster.JobPool(st, "node1").Addr(), port).String()
	args, release := gated(t, []string{"--iters", "700", "--block", fmt.Sprint(64 << 10), "--delay", "10ms", "--clock", "--progress", "50"}, 680)
	rg := newRing(t, c, 2)
	rg.release = release
	for r, host := range []string{"node1", "node2"} {
		j, err := c.Client(host).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("nd%d", r), JobAddress: true, Run: "nd", Recovery: agent.RecoveryAuto,
			Interval: "3s", Argv: append([]string{bins.Nondet, "--rank", fmt.Sprint(r), "--peer", peer}, args...)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { removeJobNets(t, j.ID) })
		rg.jobs[r] = j
	}
	// A scheduled cut, recorded on every member, and the ranks well past it.
	cut := waitCut(t, c, "spare1", "nd", 2)
	t.Logf("cut %s: %+v", cut.ID, cut.Parts)
	// Traffic after the cut, which the rollback takes back: rank 0 reports 50 more blocks received.
	received := func() int {
		b, _ := os.ReadFile(rg.jobs[0].StdoutPath())
		return strings.Count(string(b), " received ")
	}
	at := received()
	poll(t, 2*time.Minute, "rank 0 to receive 50 blocks after the cut", func() bool { return received() > at })
	// Message logging must be able to try, and fail: rank 1's replica holds its connection. (In a CI run of
	// 2026-12-02 the crash came 1 s after the cut, before rank 1's snapshot holding the connection it opened
	// after the cut was replicated: the recovery rolled back at once, without the replay the test asks for.)
	rg.waitCovered(t, 2*time.Minute)
	if err := c.Lab.Crash(ctx, "node2"); err != nil {
		t.Fatal(err)
	}
	crashJobNet(t, rg.jobs[1].Net.Name)
	f := waitFailure(t, c, "node2", 5*time.Minute)
	logTimeline(t, f)
	if f.Error != "" || f.Target != "spare1" {
		t.Fatalf("recovery of node2: target %s, error %q; want the run rolled back with rank 1 on spare1", f.Target, f.Error)
	}
	if s := stageOf(t, f, agent.StageReplayed); !strings.Contains(s.Error, "not deterministic") {
		t.Errorf("replay stage %+v: want message logging's refusal of rank 1's other bytes (why the run rolled back)", s)
	}
	rolled := stageOf(t, f, coordinated.StageRolledBack)
	if rolled.Error != "" || !strings.Contains(rolled.Detail, "run nd") {
		t.Errorf("rollback stage %+v, want run nd restored from its cut", rolled)
	}
	for r, host := range []string{"node1", "spare1"} {
		j := rg.job(t, host, r)
		if j.State != agent.JobRunning || !slices.ContainsFunc(cut.Parts, func(p clusterapi.CutPart) bool { return p.Snapshot == j.Restored }) {
			t.Errorf("rank %d on %s: %+v, want it running from its part of cut %s", r, host, j, cut.ID)
		}
	}
	outs := rg.wait(t, 3*time.Minute)
	if s0, s1 := checksumOf(t, outs[0]), checksumOf(t, outs[1]); s0 != s1 {
		t.Errorf("rank 0 received checksum %s, rank 1 sent %s: the rolled-back run is not one execution", s0, s1)
	}
}

// TestCutOfALateRank: a two-rank ringstencil in coordinated recovery, on job addresses, whose rank 1 starts
// after the run's first cut (as an MPI launch starts its ranks one host after another), with an interval of
// an hour. node1, which coordinates the run, looks whether its newest cut holds every job of the run (2 s
// after it, then 4 s after that, doubling) and takes a cut with rank 1 at once; the run then ends with the
// failure-free checksum. Before, the next cut came an interval after the first, and until then a failure of
// rank 1's host could not be rolled back (its job is in no cut).
func TestCutOfALateRank(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const port, run = 7492, "late"
	ctx := context.Background()
	args := ringArgs(600, 16<<10, 10*time.Millisecond)
	want := reference(t, 2, args)
	c := newCluster(t, 3, 0, labcluster.Options{Interval: "1h", JobAddresses: true})
	st := c.Lab.State()
	peers := netip.AddrPortFrom(labcluster.JobPool(st, "node1").Addr(), port).String() + "," +
		netip.AddrPortFrom(labcluster.JobPool(st, "node2").Addr(), port).String()
	rg := newRing(t, c, 2)
	start := func(r int, host string) {
		j, err := c.Client(host).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("rank%d", r), JobAddress: true, Run: run, Recovery: agent.RecoveryCoordinated,
			Argv: append([]string{bins.Ringstencil, "--rank", fmt.Sprint(r), "--peers", peers}, args...)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { removeJobNets(t, j.ID) })
		rg.jobs[r] = j
	}
	start(0, "node1")
	first := waitCut(t, c, "node1", run, 1)
	if s, err := c.Client("node1").Status(ctx); err != nil || len(s.Cuts) != 1 || s.Cuts[0].ID != first.ID {
		t.Errorf("node1's status with rank 0 in cut %s alone: cuts %+v, err %v", first.ID, s.Cuts, err)
	}
	if out := ftctlStatus(t, c); !regexp.MustCompile(`(?m)^late +0 +1 +` + first.ID + ` `).MatchString(out) {
		t.Errorf("ftctl status with rank 0 in cut %s: want the run's row:\n%s", first.ID, out)
	}
	start(1, "node2")
	cut := waitCut(t, c, "node1", run, 2)
	t.Logf("first cut %s at %s; cut %s at %s: %+v", first.ID, first.Taken.Format(time.StampMilli), cut.ID, cut.Taken.Format(time.StampMilli), cut.Parts)
	if !slices.ContainsFunc(cut.Parts, func(p clusterapi.CutPart) bool { return p.Job == rg.jobs[1].ID && p.Host == "node2" }) {
		t.Errorf("cut %s: parts %+v, want one of rank 1 on node2", cut.ID, cut.Parts)
	}
	// Each host's status carries the run's newest cut, from which `ftctl status` names the jobs a cut lacks.
	for _, h := range []string{"node1", "node2"} {
		poll(t, time.Minute, "cut "+cut.ID+" in the status of "+h, func() bool {
			s, err := c.Client(h).Status(ctx)
			return err == nil && slices.ContainsFunc(s.Cuts, func(got *coordinated.Cut) bool { return got.ID == cut.ID && len(got.Parts) == 2 })
		})
	}
	if out := ftctlStatus(t, c); !regexp.MustCompile(`(?m)^late +0 +2 +`+cut.ID+` +\S+ +-$`).MatchString(out) || strings.Contains(out, "UNPROTECTED") {
		t.Errorf("ftctl status with both ranks in cut %s: want the run's row with no job in no cut, and no job unprotected:\n%s", cut.ID, out)
	}
	checkRanks(t, rg.wait(t, 3*time.Minute), want)
}

// ftctlStatus is `ftctl status` of the lab.
func ftctlStatus(t *testing.T, c *labcluster.Cluster) string {
	t.Helper()
	out, err := exec.Command(bins.Ftctl, "status", "--lab", c.Lab.State().ID).CombinedOutput()
	if err != nil {
		t.Fatalf("ftctl status: %v\n%s", err, out)
	}
	return string(out)
}

// waitCut waits until host records a coordinated snapshot of root's run with parts parts, and returns it.
func waitCut(t *testing.T, c *labcluster.Cluster, host, run string, parts int) coordinated.Cut {
	t.Helper()
	var cut coordinated.Cut
	path := filepath.Join(labcluster.StateDir(c.Lab.State().ID, host), "cuts", run+".0.json")
	poll(t, 3*time.Minute, "a coordinated snapshot of run "+run+" on "+host, func() bool {
		b, err := os.ReadFile(path)
		return err == nil && json.Unmarshal(b, &cut) == nil && len(cut.Parts) == parts
	})
	return cut
}

// removeRunNets removes, at the test's end, the job networks of the MPI run name's jobs on hosts (their
// restored copies have the same ids): a run that ends as the test does may leave them to the lab's teardown,
// which does not remove job networks.
func removeRunNets(t *testing.T, c *labcluster.Cluster, name string, hosts ...string) {
	t.Helper()
	for _, h := range hosts {
		j := jobNamed(t, c, h, name+"-"+h)
		t.Cleanup(func() { removeJobNets(t, j.ID) })
	}
}

// crashRunHost crashes host of MPI run name (with its job network, which the lab's crash leaves running) and
// returns the record of its recovery, which must have succeeded.
func crashRunHost(t *testing.T, c *labcluster.Cluster, name, host string) *agent.Failure {
	t.Helper()
	j := jobNamed(t, c, host, name+"-"+host)
	if err := c.Lab.Crash(context.Background(), host); err != nil {
		t.Fatal(err)
	}
	crashJobNet(t, j.Net.Name)
	f := waitFailure(t, c, host, 5*time.Minute)
	logTimeline(t, f)
	if f.Error != "" {
		t.Fatalf("recovery of %s failed: %s", host, f.Error)
	}
	return f
}
