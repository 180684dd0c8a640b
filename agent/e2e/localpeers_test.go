package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestLocalPeers crashes a node whose two jobs talk to each other over the node's own address (or, in the
// last case, each on an address of its own), a connection no sender-side log sees (it never crosses the
// cluster interface): both of its ends come back from the two jobs' snapshots. Snapshotted together
// (semi-coordinated mode; the checkpoint names one job, and the other is frozen with it), the jobs are restored on the spare and finish with the failure-free result
// (with job addresses the recovery refused them before 2026-11-30: it asked the cluster who held the other
// job's address, and nobody did). Snapshotted one after the other (uncoordinated mode), the
// snapshots disagree on the bytes between the jobs; restored as they were, the two waited forever for bytes
// neither held while the recovery reported success (this test's first run, on the code before the check).
// Now the recovery refuses both jobs by name, loudly.
func TestLocalPeers(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	for _, tc := range []struct {
		name     string
		mode     agent.Mode
		jobAddrs bool // each job on an address of its own instead of the host's
	}{
		{"semi-coordinated", agent.SemiCoordinated, false},
		{"uncoordinated", agent.Uncoordinated, false},
		{"semi-coordinated, job addresses", agent.SemiCoordinated, true},
		{"uncoordinated, job addresses", agent.Uncoordinated, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each row has its own lab
			testLocalPeers(t, tc.mode, tc.jobAddrs)
		})
	}
	t.Run("one job, loopback", func(t *testing.T) { t.Parallel(); testLoopbackInJob(t) })
	t.Run("semi-coordinated, a peer in no job", func(t *testing.T) { t.Parallel(); testPeerInNoJob(t) })
}

// node1Lab is a lab of two nodes and a spare whose recovery timeline is logged if the test fails, and its
// node1.
func node1Lab(t *testing.T, opts labcluster.Options) (*labcluster.Cluster, lab.Host) {
	c := newCluster(t, 2, 1, opts)
	logEventsOnFailure(t, c)
	h, err := c.Lab.Host("node1")
	if err != nil {
		t.Fatal(err)
	}
	return c, h
}

// testPeerInNoJob: rank 0 is a job, rank 1 a plain process of the same host (not started under ftkit), on
// the host's address. Semi-coordinated mode freezes the host's jobs together, but rank 1 is in none of them:
// the job's replica is flagged UNRECOVERABLE when it is made (until 2026-11-30 only uncoordinated mode
// flagged such a peer, and semi-coordinated mode learned of it at the recovery's refusal), and the recovery
// refuses the job by name.
func testPeerInNoJob(t *testing.T) {
	c, h := node1Lab(t, labcluster.Options{Interval: "1h", Mode: agent.SemiCoordinated})
	const port = 7480
	peers := netip.AddrPortFrom(h.Addr.Addr(), port).String() + "," + netip.AddrPortFrom(h.Addr.Addr(), port+1).String()
	j, got := ringWithPlainRank1(t, c, "node1", peers)
	ctx := context.Background()
	wantPairFlagged(t, got, "the peer is a process of this host in no job snapshotted with this one")
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node1", 2*time.Minute)
	var refusal string
	for _, s := range f.Stages {
		if s.Name == agent.StageRestored && s.Job == j.ID {
			refusal = s.Error
		}
	}
	if f.Error == "" || !strings.Contains(refusal, "in no job restored with it") || !strings.Contains(refusal, "must run as a job of that host") {
		t.Errorf("recovery of node1: error %q, job's restored stage %q; want the job refused, its peer in no job", f.Error, refusal)
	}
	if procs, _ := copies(t, c, j); procs != 0 {
		t.Errorf("job %s: %d process(es) run after its recovery was refused", j.ID, procs)
	}
}

// wantPairFlagged checks that job's replica flags both connections of the ring's pair (each rank connects
// to the other), each saying why.
func wantPairFlagged(t *testing.T, job agent.Job, why string) {
	t.Helper()
	bad := job.Replica.Unrecoverable
	if len(bad) != 2 {
		t.Errorf("replica %s: unrecoverable %q, want both connections to rank 1 flagged", job.Replica.Snapshot, bad)
	}
	for _, b := range bad {
		if !strings.Contains(b, why) {
			t.Errorf("replica %s: unrecoverable %q, want it to say %q", job.Replica.Snapshot, b, why)
		}
	}
}

// ringWithPlainRank1 runs the ring stencil with rank 1 a plain process of host (not started under ftkit)
// and rank 0 a job of node1, the two at peers (rank 0's address first). Once rank 0 is protected and rank 1
// has done 50 iterations, it checkpoints node1 and returns rank 0's job as started and as recorded after.
func ringWithPlainRank1(t *testing.T, c *labcluster.Cluster, host, peers string) (started, checkpointed agent.Job) {
	t.Helper()
	args := ringArgs(2000, 16<<10, 10*time.Millisecond)
	out1, err := os.Create(filepath.Join(t.TempDir(), "rank1.out"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out1.Close() })
	plain := exec.Command(bins.Ringstencil, append([]string{"--rank", "1", "--peers", peers}, args...)...)
	plain.Stdout, plain.Stderr = out1, out1
	if err := c.Lab.Start(host, plain); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		plain.Process.Kill()
		plain.Wait()
	})
	ctx := context.Background()
	j, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: "rank0", Argv: append([]string{bins.Ringstencil, "--rank", "0", "--peers", peers}, args...)})
	if err != nil {
		t.Fatal(err)
	}
	waitProtected(t, c, "node1", j.ID, 2*time.Minute)
	poll(t, 2*time.Minute, "50 iterations of rank 1", func() bool {
		b, _ := os.ReadFile(out1.Name())
		return strings.Count(string(b), " iteration ") >= 50/progressEvery
	})
	reply, err := c.Client("node1").Checkpoint(ctx)
	if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint of node1: %+v %v", reply, err)
	}
	got, err := c.Client("node1").Job(ctx, j.ID)
	if err != nil {
		t.Fatal(err)
	}
	return j, got
}

// testLoopbackInJob: both ranks in one job, talking over loopback: both ends of each connection are in the
// job's one snapshot, restored together. (Until 2026-11-30 the recovery asked the cluster for the peer of
// 127.0.0.1 and refused the job: "the peer is not a cluster member".)
func testLoopbackInJob(t *testing.T) {
	args := ringArgs(2000, 16<<10, 10*time.Millisecond)
	want := reference(t, 2, args)
	c := newCluster(t, 2, 1, labcluster.Options{Interval: "1h"})
	logEventsOnFailure(t, c)
	peers := "127.0.0.1:7480,127.0.0.1:7481"
	rank := func(r int) string {
		return fmt.Sprintf("%s --rank %d --peers %s %s > rank%d.out", bins.Ringstencil, r, peers, strings.Join(args, " "), r)
	}
	dir := t.TempDir()
	ctx := context.Background()
	j, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: "pair", Dir: dir, Argv: []string{"/bin/sh", "-c", rank(0) + " & " + rank(1) + "; wait"}})
	if err != nil {
		t.Fatal(err)
	}
	waitProtected(t, c, "node1", j.ID, 2*time.Minute)
	waitCovered(t, c, "node1", j.ID, 2*time.Minute)
	out := func(r int) string {
		b, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("rank%d.out", r)))
		return string(b)
	}
	// Real traffic past the snapshot: the ranks exchanged 100 blocks since they started.
	poll(t, 2*time.Minute, "100 iterations of both ranks", func() bool {
		return strings.Count(out(0), " iteration ") >= 10 && strings.Count(out(1), " iteration ") >= 10
	})
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node1", 2*time.Minute)
	requireStages(t, f)
	if f.Error != "" || f.Target != "spare1" {
		t.Fatalf("recovery on %s: %s", f.Target, f.Error)
	}
	if st, o := waitExit(t, j, 3*time.Minute); st.Code != 0 {
		t.Fatalf("job exited %d: %s", st.Code, o)
	}
	checkRanks(t, []string{out(0), out(1)}, want)
}

func testLocalPeers(t *testing.T, mode agent.Mode, jobAddrs bool) {
	args := ringArgs(2000, 16<<10, 10*time.Millisecond)
	want := reference(t, 2, args)
	c, h := node1Lab(t, labcluster.Options{Interval: "1h", Mode: mode, JobAddresses: jobAddrs})
	const port = 7480
	addrs := []netip.Addr{h.Addr.Addr(), h.Addr.Addr()}
	if jobAddrs {
		// The agent hands out its pool's addresses in order, the first free one to each job.
		first := labcluster.JobPool(c.Lab.State(), "node1").Addr()
		addrs = []netip.Addr{first, first.Next()}
	}
	peers := []string{netip.AddrPortFrom(addrs[0], port).String(), netip.AddrPortFrom(addrs[1], port+1).String()}
	rg := newRing(t, c, 2)
	ctx := context.Background()
	for r := range 2 {
		argv := append([]string{bins.Ringstencil, "--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ",")}, args...)
		j, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("local%d", r), Argv: argv, JobAddress: jobAddrs})
		if err != nil {
			t.Fatal(err)
		}
		rg.jobs[r] = j
		if jobAddrs {
			t.Cleanup(func() { removeJobNets(t, j.ID) })
			if j.Net == nil || j.Net.Addr.Addr() != addrs[r] {
				t.Fatalf("rank %d's job network %+v, want the address %s", r, j.Net, addrs[r])
			}
		}
	}
	for _, j := range rg.jobs {
		waitProtected(t, c, "node1", j.ID, 2*time.Minute)
		waitCovered(t, c, "node1", j.ID, 2*time.Minute)
	}
	rg.waitProgress(t, 50, 2*time.Minute)
	if mode == agent.SemiCoordinated {
		// Rank 0 alone is named: rank 1, its peer on the same host, is dumped with it in one freeze. Until
		// 2026-11-30 rank 0 was dumped alone, torn against rank 1's older snapshot: flagged, and the
		// recovery below refused both jobs.
		reply, err := c.Client("node1").Checkpoint(ctx, rg.jobs[0].ID)
		if err != nil || reply.Error != "" || len(reply.Results) != 2 || !reply.Results[0].Shipped || !reply.Results[1].Shipped {
			t.Fatalf("checkpoint of rank 0: %+v %v", reply, err)
		}
		for _, res := range reply.Results {
			if got := rg.job(t, "node1", slices.IndexFunc(rg.jobs, func(j agent.Job) bool { return j.ID == res.Manifest.Job })).Replica.Snapshot; got != res.Manifest.ID {
				t.Errorf("job %s's replica is %s, want the snapshot of rank 0's checkpoint, %s", res.Manifest.Job, got, res.Manifest.ID)
			}
		}
		rg.waitProgress(t, 50, 2*time.Minute)
	} else {
		// One job, then the other 50 iterations later: rank 1's snapshot holds as received what rank 0's
		// had as acknowledged long before, and rank 0's lacks what rank 1 sent in between.
		for r, j := range rg.jobs {
			reply, err := c.Client("node1").Checkpoint(ctx, j.ID)
			if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
				t.Fatalf("checkpoint of rank %d: %+v %v", r, reply, err)
			}
			rg.waitProgress(t, 50, 2*time.Minute)
		}
	}
	// Dumped apart, each job's replica says at once that a failure of its host cannot be recovered.
	for r := range rg.jobs {
		bad := rg.job(t, "node1", r).Replica.Unrecoverable
		if flagged := len(bad) > 0 && strings.Contains(bad[0], "another process of this host"); flagged != (mode == agent.Uncoordinated) || mode == agent.SemiCoordinated && len(bad) > 0 {
			t.Errorf("rank %d's replica (mode %s): unrecoverable %q", r, mode, bad)
		}
	}
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	if jobAddrs {
		for _, j := range rg.jobs {
			crashJobNet(t, j.Net.Name)
		}
	}
	f := waitFailure(t, c, "node1", 2*time.Minute)
	if mode == agent.SemiCoordinated {
		requireStages(t, f)
		if f.Error != "" || f.Target != "spare1" {
			t.Fatalf("recovery on %s: %s", f.Target, f.Error)
		}
		checkRanks(t, rg.wait(t, 3*time.Minute), want)
		return
	}
	if f.Error == "" {
		t.Fatal("the recovery of node1 reported success")
	}
	// Each job's refusal says why and how to avoid it (the failure's own error is truncated).
	for _, j := range rg.jobs {
		var refusal string
		for _, s := range f.Stages {
			if s.Name == agent.StageRestored && s.Job == j.ID {
				refusal = s.Error
			}
		}
		for _, want := range []string{"job " + j.ID + " is not transparently recoverable", "in neither snapshot", `checkpoint.mode = "semi-coordinated"`} {
			if !strings.Contains(refusal, want) {
				t.Errorf("job %s's restored stage: error %q, want it to say %q", j.ID, refusal, want)
			}
		}
	}
	for _, j := range rg.jobs {
		if procs, _ := copies(t, c, j); procs != 0 {
			t.Errorf("job %s: %d process(es) run after its recovery was refused", j.ID, procs)
		}
	}
}
