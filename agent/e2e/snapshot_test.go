package e2e

import (
	"context"
	"os"
	"path/filepath"
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

// TestEndedJobForgotten: once a job has ended for checkpoint.keep_ended, its host deletes its snapshots
// and its record, and its protector, told, deletes its replicas. Before, nothing deleted them, ever.
func TestEndedJobForgotten(t *testing.T) {
	t.Parallel() // each test has its own lab
	const keep = 3 * time.Second
	c := newCluster(t, 3, 0, labcluster.Options{Interval: "1h", KeepEnded: keep})
	ctx := context.Background()
	gate := filepath.Join(t.TempDir(), "end")
	cmd, _, jobID := startWrapped(t, c, "node1", "ends", "sh", "-c", `while [ ! -e "$0" ]; do sleep 0.05; done`, gate)
	waitProtected(t, c, "node1", jobID, 2*time.Minute)
	snapshots := func(host string) int {
		ms, err := c.Client(host).Snapshots(ctx, jobID)
		if err != nil {
			t.Fatalf("snapshots on %s: %v", host, err)
		}
		return len(ms)
	}
	if snapshots("node1") == 0 || snapshots("node2") == 0 {
		t.Fatalf("node1 holds %d snapshots of %s and node2 %d replicas; want some on each", snapshots("node1"), jobID, snapshots("node2"))
	}
	ended := time.Now() // the job cannot end before its gate opens
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("ftwrap: %v", err)
	}
	// A pass every second (a quarter of keep_ended, at least a second) once keep_ended has passed.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(100 * time.Millisecond) {
		_, jerr := c.Client("node1").Job(ctx, jobID)
		n1, n2 := snapshots("node1"), snapshots("node2")
		if jerr != nil && n1 == 0 && n2 == 0 {
			t.Logf("forgotten %s after the job ended (keep_ended %s)", time.Since(ended).Round(time.Millisecond), keep)
			if since := time.Since(ended); since < keep {
				t.Errorf("forgotten %s after the job ended, before keep_ended (%s)", since, keep)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after the job ended: node1's record %v, node1 %d snapshots, node2 %d replicas; want all gone", jerr, n1, n2)
		}
	}
}
