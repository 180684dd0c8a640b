package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab/labcluster"
)

func TestCheckpointShipsToProtector(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx := context.Background()
	cmd := ftwrap(c, "node1", "--name", "counter", "--", "sh", "-c", `i=0; while true; do echo $i; i=$((i+1)); sleep 0.05; done`)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	var jobID string
	for deadline := time.Now().Add(5 * time.Second); jobID == "" && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if jobs, err := c.Client("node1").Jobs(ctx); err == nil && len(jobs) == 1 {
			jobID = jobs[0].ID
		}
	}
	if jobID == "" {
		t.Fatal("job did not appear on node1")
	}
	// The job's first snapshot, taken as it started, comes before the one this test takes.
	waitProtected(t, c, "node1", jobID, 2*time.Minute)
	time.Sleep(300 * time.Millisecond)
	reply, err := c.Client("node1").Checkpoint(ctx, jobID)
	if err != nil || len(reply.Results) != 1 {
		t.Fatalf("checkpoint: %+v, %v", reply, err)
	}
	r := reply.Results[0]
	if !r.Shipped || len(r.Manifest.Replicas) != 1 || r.Manifest.Replicas[0] != "node2" {
		t.Fatalf("snapshot not replicated on node2 (node1's protector): %+v", r)
	}
	m := r.Manifest
	if m.Stats.FrozenTime <= 0 || m.Stats.PagesWritten == 0 || len(m.OpenFiles) == 0 {
		t.Errorf("manifest lacks CRIU stats or open files: %+v", m.Info)
	}
	t.Logf("snapshot %s: %d bytes, frozen %s, dump %s", m.ID, m.TotalSize(), m.Stats.FrozenTime, m.DumpDuration)
	// The protector lists the replica, verified, newest first (the job's first snapshot, taken as it
	// started, may be listed after it).
	ms, err := c.Client("node2").Snapshots(ctx, jobID)
	if err != nil || len(ms) == 0 || ms[0].ID != m.ID || ms[0].Node != "node1" {
		t.Fatalf("node2's snapshots of %s: %+v, %v", jobID, ms, err)
	}
}
