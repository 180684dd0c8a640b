package e2e

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestCoordinatedRollback: a two-rank ringstencil on job addresses (rank 0 on node1, rank 1 on node2) is a
// run. node3, which runs none of it, takes a coordinated snapshot of the run: both ranks frozen before
// either is dumped, thawed once both are, the cut checked and recorded. The ranks run on well past it;
// then node1 rolls the whole run back: both ranks are killed without a word on the wire and restored from
// the cut on their hosts (new processes, incarnation + 1, their addresses), re-execute what they had
// done since, and the run ends with the failure-free checksum. A run with a job on its host's address is
// refused before anything stops.
func TestCoordinatedRollback(t *testing.T) {
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
	if _, err := c.Client("node3").Cut(ctx, "mixed"); err == nil || !strings.Contains(err.Error(), "host address") {
		t.Errorf("coordinated snapshot of a run with a job on its host's address: %v, want a refusal naming the host address", err)
	}
	if j, err := c.Client("node2").Job(ctx, other.ID); err != nil || j.State != agent.JobRunning || j.PID != other.PID {
		t.Errorf("the refused run's job: %+v %v, want it running as before", j, err)
	}
	if _, err := c.Client("node3").Rollback(ctx, "ring1"); err == nil || !strings.Contains(err.Error(), agent.ErrNoCut.Error()) {
		t.Errorf("rollback of a run without a coordinated snapshot: %v, want %q", err, agent.ErrNoCut)
	}

	cut, err := c.Client("node3").Cut(ctx, "ring1")
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
	rg.waitProgress(t, 3*progressEvery, 2*time.Minute) // well past the cut

	before := []agent.Job{rg.job(t, "node1", 0), rg.job(t, "node2", 1)}
	rb, err := c.Client("node1").Rollback(ctx, "ring1")
	if err != nil {
		t.Fatalf("rollback of run ring1: %v", err)
	}
	t.Logf("rolled back to %s: stopped %s", rb.Cut, rb.Stopped)
	for r, host := range []string{"node1", "node2"} {
		j := rg.job(t, host, r)
		if j.State != agent.JobRunning || j.Restored != parts[j.ID] || j.Incarnation != before[r].Incarnation+1 || j.PID == before[r].PID ||
			j.Net == nil || j.Net.Addr != before[r].Net.Addr {
			t.Fatalf("rank %d on %s after the rollback: %+v, want a new process from %s, incarnation %d, address %s", r, host, j, parts[j.ID], before[r].Incarnation+1, before[r].Net.Addr)
		}
		requireInJobNet(t, c, j)
	}
	f := findEvent(t, c, rb.Event)
	logTimeline(t, f)
	if f.Kind != agent.KindRollback || !f.Done || f.Error != "" || len(f.Stages) != 2 {
		t.Errorf("event %s: %+v, want a completed rollback with its two stages", rb.Event, f)
	}
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	checkRanks(t, rg.wait(t, 3*time.Minute), want)
	if err := c.Client("node2").Signal(ctx, other.ID, 9); err != nil {
		t.Error(err)
	}
}
