package e2e

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestUnprotectedPeerOnMember: rank 0 is a job on node1, rank 1 a plain process of node2, a member host
// (not started under ftkit): nothing logs what rank 1 sends. The job's replica is flagged UNRECOVERABLE
// when it is made, naming both connections and why (until 2026-11-30 nothing said so before node1
// failed; ftkit_jobs_unrecoverable counts it), and the recovery of node1 refuses the job, naming node2's
// log. With rank 1 a job of node2, the same replica is not flagged.
func TestUnprotectedPeerOnMember(t *testing.T) {
	t.Parallel()
	t.Run("a plain process", testUnprotectedPeerOnMember)
	t.Run("a job (not flagged)", testProtectedPeerOnMember)
}

// node1node2Ring is a lab with metrics whose ring stencil's rank 0 is on node1 and rank 1 on node2: the lab
// and the ranks' addresses.
func node1node2Ring(t *testing.T) (*labcluster.Cluster, string) {
	c, _ := node1Lab(t, labcluster.Options{Interval: "1h", MetricsListen: metricsAddr})
	const port = 7480
	return c, hostPort(t, c, "node1", port) + "," + hostPort(t, c, "node2", port+1)
}

func testProtectedPeerOnMember(t *testing.T) {
	c, peers := node1node2Ring(t)
	args := ringArgs(2000, 16<<10, 10*time.Millisecond)
	ctx := context.Background()
	var j agent.Job
	for rank, host := range []string{"node1", "node2"} {
		argv := append([]string{bins.Ringstencil, "--rank", strconv.Itoa(rank), "--peers", peers}, args...)
		r, err := c.Client(host).StartJob(ctx, agent.JobSpec{Name: "rank" + strconv.Itoa(rank), Argv: argv})
		if err != nil {
			t.Fatal(err)
		}
		if rank == 0 {
			j = r
		}
	}
	waitProtected(t, c, "node1", j.ID, 2*time.Minute)
	// Snapshots of rank 0 until one holds both connections to rank 1.
	poll(t, 2*time.Minute, "a replica of rank 0 holding its two connections", func() bool {
		reply, err := c.Client("node1").Checkpoint(ctx)
		if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
			t.Fatalf("checkpoint of node1: %+v %v", reply, err)
		}
		return len(reply.Results[0].Manifest.Conns) == 2
	})
	got, err := c.Client("node1").Job(ctx, j.ID)
	if err != nil {
		t.Fatal(err)
	}
	if bad := got.Replica.Unrecoverable; len(bad) != 0 {
		t.Errorf("replica %s: unrecoverable %q, want none: rank 1 is a job of node2, whose log knows its connections", got.Replica.Snapshot, bad)
	}
	if n := scrape(t, c, "node1")["ftkit_jobs_unrecoverable"]; n != 0 {
		t.Errorf("node1's ftkit_jobs_unrecoverable = %v, want 0", n)
	}
	if b, err := os.ReadFile(c.LogPath("node2")); err != nil || strings.Contains(string(b), "not started under ftkit") {
		t.Errorf("node2's log (err %v) names a process of node2 not started under ftkit; rank 1 is a job:\n%s", err, b)
	}
}

func testUnprotectedPeerOnMember(t *testing.T) {
	c, peers := node1node2Ring(t)
	j, got := ringWithPlainRank1(t, c, "node2", peers)
	ctx := context.Background()
	wantPairFlagged(t, got, "the peer is a process of node2 not started under ftkit")
	if n := scrape(t, c, "node1")["ftkit_jobs_unrecoverable"]; n != 1 {
		t.Errorf("node1's ftkit_jobs_unrecoverable = %v, want 1", n)
	}
	// node2's operator is told too, once per connection, from node2's end, with the process that holds it.
	poll(t, time.Minute, "node2's log naming both connections of its plain process", func() bool {
		b, _ := os.ReadFile(c.LogPath("node2"))
		n := 0
		for line := range strings.Lines(string(b)) {
			if strings.Contains(line, "a process of this host not started under ftkit talks to a job of another member") &&
				strings.Contains(line, "member=node1") {
				if !strings.Contains(line, "command=ringstencil") || !strings.Contains(line, " pid=") || !strings.Contains(line, " uid=0") {
					t.Fatalf("node2's line does not name the plain process (ringstencil, pid, uid 0): %s", line)
				}
				if n == 0 {
					t.Logf("node2: %s", line)
				}
				n++
			}
		}
		if n > 2 {
			t.Fatalf("node2's log names its plain process's connections %d times, want 2:\n%s", n, b)
		}
		return n == 2
	})
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node1", 2*time.Minute)
	var refusal string
	for _, s := range f.Stages {
		if s.Job == j.ID && s.Error != "" {
			refusal = s.Error
		}
	}
	if f.Error == "" || !strings.Contains(refusal, "log of node2") {
		t.Errorf("recovery of node1: error %q, job's refusal %q; want the job refused, naming node2's log", f.Error, refusal)
	}
	if procs, _ := copies(t, c, j); procs != 0 {
		t.Errorf("job %s: %d process(es) run after its recovery was refused", j.ID, procs)
	}
}
