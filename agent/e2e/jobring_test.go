package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// startRun starts one ringstencil run with a placement: rank r on hosts[r], each job started through its
// host's agent with the run's placement (hosts, spares), as ftctl mpirun does for an allocation.
func startRun(t *testing.T, c *labcluster.Cluster, name string, hosts, spares []string, port int, args []string) *ring {
	t.Helper()
	var peers []string
	for _, host := range hosts {
		h, err := c.Lab.Host(host)
		if err != nil {
			t.Fatal(err)
		}
		peers = append(peers, netip.AddrPortFrom(h.Addr.Addr(), uint16(port)).String())
	}
	rg := &ring{c: c, jobDir: labcluster.JobsDir(c.Lab.State().ID)}
	placement := &agent.Placement{Hosts: hosts, Spares: spares}
	for r, host := range hosts {
		argv := append([]string{bins.Ringstencil, "--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ",")}, args...)
		j, err := c.Client(host).StartJob(context.Background(), agent.JobSpec{Name: fmt.Sprintf("%s%d", name, r), Argv: argv, Placement: placement})
		if err != nil {
			t.Fatal(err)
		}
		rg.jobs = append(rg.jobs, j)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for r, j := range rg.jobs {
				b, _ := os.ReadFile(j.StdoutPath())
				e, _ := os.ReadFile(j.StderrPath())
				t.Logf("run %s rank %d (job %s): stdout %q stderr %q", name, r, j.ID, tail(string(b)), tail(string(e)))
			}
		}
	})
	return rg
}

// snapshotTo snapshots job j on host and requires the replica to be on holder, and on none of others.
func snapshotTo(t *testing.T, c *labcluster.Cluster, host string, j agent.Job, holder string, others ...string) {
	t.Helper()
	id := replicate(t, c, host, holder, j)
	for _, o := range others {
		if ids := replicaIDs(t, c, o, j.ID, host); slices.Contains(ids, id) {
			t.Errorf("snapshot %s of %s on %s went to %s too; its run's protector is %s", id, j.ID, host, o, holder)
		}
	}
}

// TestRunPlacement: two concurrent runs on disjoint hosts of a 5-node ring without ring spares. Run A
// (node1, node2; spare node3) protects its parts on each other, not on their ring successors; node2
// crashes and its part is restored on node3, the run's idle spare, which absorbs node2's address; run B
// (node4, node5) is never touched: same processes, incarnation 0, no claim on its hosts.
func TestRunPlacement(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	args := ringArgs(3000, 16<<10, 20*time.Millisecond)
	want := reference(t, 2, args)
	c := newCluster(t, 5, 0, labcluster.Options{Interval: "1h"})
	argsA, releaseA := gated(t, args, 2990)
	argsB, releaseB := gated(t, args, 2990)
	a := startRun(t, c, "runa", []string{"node1", "node2"}, []string{"node3"}, 7610, argsA)
	a.release = releaseA
	b := startRun(t, c, "runb", []string{"node4", "node5"}, nil, 7611, argsB)
	b.release = releaseB
	hostsA, hostsB := []string{"node1", "node2"}, []string{"node4", "node5"}
	for r, j := range a.jobs {
		waitProtected(t, c, hostsA[r], j.ID, 2*time.Minute)
	}
	for r, j := range b.jobs {
		waitProtected(t, c, hostsB[r], j.ID, 2*time.Minute)
	}
	a.waitProgress(t, progressEvery, 2*time.Minute)
	b.waitProgress(t, progressEvery, 2*time.Minute)

	// Each part's protector is its run's other host, not its ring successor (node2's is node3, node5's node1).
	snapshotTo(t, c, "node2", a.jobs[1], "node1", "node3")
	snapshotTo(t, c, "node1", a.jobs[0], "node2")
	snapshotTo(t, c, "node5", b.jobs[1], "node4", "node1")
	snapshotTo(t, c, "node4", b.jobs[0], "node5")
	if st, err := c.Client("node2").Status(context.Background()); err != nil || st.JobProtectors[a.jobs[1].ID] != "node1" || st.Protector != "node3" {
		t.Errorf("node2's status: job protectors %v, ring protector %q (%v); want node1 for its job, node3 for the ring", st.JobProtectors, st.Protector, err)
	}
	beforeB := []agent.Job{b.job(t, "node4", 0), b.job(t, "node5", 1)}
	before0 := a.job(t, "node1", 0)

	a.waitProgress(t, progressEvery, 2*time.Minute) // traffic past the snapshot, to be replayed
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	if f.Target != "node3" || f.Basic {
		t.Errorf("node2's part restored on %s (basic %v); want node3, the run's spare", f.Target, f.Basic)
	}
	for _, s := range f.Stages {
		if s.Name == agent.StageClaimed && !strings.Contains(s.Detail, "a spare of the run") {
			t.Errorf("claimed stage %q does not say the run's spare was taken", s.Detail)
		}
	}
	// node3 kept its ring position and holds node2's address: node1's rank reaches the moved one there.
	st, err := c.Client("node3").Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	h2, _ := c.Lab.Host("node2")
	for _, m := range st.Members {
		switch {
		case m.Name == "node3" && (m.Role != "node" || !slices.Contains(m.Addrs, h2.Addr.Addr())):
			t.Errorf("node3 after the recovery: %+v; want a node holding node2's address %s", m, h2.Addr.Addr())
		case m.Name == "node2" && m.State != "failed":
			t.Errorf("node2 after the recovery: %+v", m)
		}
	}
	if j := a.job(t, "node3", 1); j.Node != "node3" || j.Restored == "" || j.Spec.Placement == nil || !slices.Equal(j.Spec.Placement.Hosts, hostsA) {
		t.Errorf("run A's rank 1 on node3: %+v; want restored there with its placement", j)
	}
	// After the recovery: the moved part ships to node1 (node3 stands for node2, whose next host is node1),
	// and node1's part ships to node3 (standing for node2), resolved through the view.
	snapshotTo(t, c, "node3", a.job(t, "node3", 1), "node1", "node4")
	snapshotTo(t, c, "node1", a.job(t, "node1", 0), "node3")

	outsA := a.wait(t, 3*time.Minute)
	checkRanks(t, outsA, want)
	if after := a.job(t, "node1", 0); after.PID != before0.PID || after.Restored != "" {
		t.Errorf("run A's rank 0 was disturbed: pid %d -> %d, restored from %q", before0.PID, after.PID, after.Restored)
	}
	outsB := b.wait(t, 3*time.Minute)
	checkRanks(t, outsB, want)
	for r, host := range hostsB {
		after := b.job(t, host, r)
		if after.PID != beforeB[r].PID || after.Restored != "" || after.Incarnation != 0 {
			t.Errorf("run B's rank %d on %s was disturbed: pid %d -> %d, restored from %q, incarnation %d",
				r, host, beforeB[r].PID, after.PID, after.Restored, after.Incarnation)
		}
		// No claim reached run B's hosts: their agents never served one, nor hold one.
		if log, err := os.ReadFile(c.LogPath(host)); err != nil || strings.Contains(string(log), "spare claimed") {
			t.Errorf("%s's agent log (%v) records a claim", host, err)
		}
		if _, err := os.Stat(filepath.Join(labcluster.StateDir(c.Lab.State().ID, host), "claim.json")); err == nil {
			t.Errorf("%s holds a spare claim", host)
		}
	}
}

// TestRunSpareNotTheDetector: the run's spare is an idle node elsewhere in the ring than the failed node's
// successor (as an allocation's spare usually is): the detector (node3, in no run) claims node4 over the
// wire, node4 absorbs node2 and restores the part, fetched from the run's protector node1.
func TestRunSpareNotTheDetector(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	args := ringArgs(3000, 16<<10, 20*time.Millisecond)
	want := reference(t, 2, args)
	c := newCluster(t, 4, 0, labcluster.Options{Interval: "1h"})
	withGate, release := gated(t, args, 2990)
	a := startRun(t, c, "run", []string{"node1", "node2"}, []string{"node4"}, 7612, withGate)
	a.release = release
	for r, j := range a.jobs {
		waitProtected(t, c, fmt.Sprintf("node%d", r+1), j.ID, 2*time.Minute)
	}
	a.waitProgress(t, progressEvery, 2*time.Minute)
	snapshotTo(t, c, "node2", a.jobs[1], "node1", "node3")
	a.waitProgress(t, progressEvery, 2*time.Minute)
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	if f.Protector != "node3" || f.Target != "node4" || f.Basic {
		t.Errorf("detected by %s, restored on %s (basic %v); want detected by node3, restored on node4, the run's spare", f.Protector, f.Target, f.Basic)
	}
	if j := a.job(t, "node4", 1); j.Node != "node4" || j.Restored == "" {
		t.Errorf("the run's rank 1 on node4: %+v", j)
	}
	outs := a.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	if _, err := os.Stat(filepath.Join(labcluster.StateDir(c.Lab.State().ID, "node3"), "claim.json")); err == nil {
		t.Error("the detector, not a spare of the run, holds a claim")
	}
}
