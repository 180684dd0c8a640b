package e2e

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// waitProtected waits until host's agent reports the job protected: a snapshot of it has reached a
// protector. timeout is a failure bound only.
func waitProtected(t *testing.T, c *labcluster.Cluster, host, id string, timeout time.Duration) agent.Job {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		j, err := c.Client(host).Job(context.Background(), id)
		if err == nil && j.Protected() {
			return j
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s on %s not protected within %s: %+v (%v)", id, host, timeout, j, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestJobProtectedAtStart: a job's first snapshot is taken as it starts and replicated, long before its
// interval (10 min here); its record says so, and the protector holds that snapshot.
func TestJobProtectedAtStart(t *testing.T) {
	t.Parallel() // each test has its own lab
	tests := []struct {
		name string
		mode agent.Mode
	}{
		{"uncoordinated", agent.Uncoordinated},
		{"semi-coordinated: a new job makes the host snapshot", agent.SemiCoordinated},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, 2, 0, labcluster.Options{Interval: "10m", Mode: tt.mode})
			ctx := context.Background()
			start := time.Now()
			_, _, id := startWrapped(t, c, "node1", "counter", "sh", "-c", `i=0; while true; do echo $i; i=$((i+1)); sleep 0.05; done`)
			if j, err := c.Client("node1").Job(ctx, id); err != nil || j.Spec.Interval != "" {
				t.Fatalf("job %+v, %v: want the agent's 10m interval", j, err)
			}
			// Bound: dumping and shipping a small shell takes well under a second; the interval is 10 min.
			j := waitProtected(t, c, "node1", id, 2*time.Minute)
			t.Logf("protected %s after the start (snapshot %s on %v)", time.Since(start).Round(time.Millisecond), j.Replica.Snapshot, j.Replica.Holders)
			if j.Replica.Node != "node1" || len(j.Replica.Holders) != 1 || j.Replica.Holders[0] != "node2" || j.Replica.Time.Before(j.Created) {
				t.Errorf("replica record %+v: want a snapshot taken on node1 held by node2 (its protector)", j.Replica)
			}
			ms, err := c.Client("node2").Snapshots(ctx, id)
			if err != nil || len(ms) == 0 || ms[0].ID != j.Replica.Snapshot || ms[0].Node != "node1" {
				t.Fatalf("node2's snapshots of %s: %+v, %v; want %s", id, ms, err, j.Replica.Snapshot)
			}
			if ms[0].Mode != tt.mode {
				t.Errorf("snapshot mode %q, want %q", ms[0].Mode, tt.mode)
			}
			// The status lists the job with its replica.
			st, err := c.Client("node1").Status(ctx)
			if err != nil || len(st.Jobs) != 1 || !st.Jobs[0].Protected() {
				t.Errorf("status jobs %+v, %v: want the job protected", st.Jobs, err)
			}
		})
	}
}

// TestAgentRestartThawsFrozenJob: an agent killed while it had the jobs' cgroups frozen for a
// semi-coordinated snapshot leaves them frozen; the restarted agent thaws them, and the job runs on.
func TestAgentRestartThawsFrozenJob(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", Mode: agent.SemiCoordinated, HeartbeatTimeout: restartTimeout})
	ctx := context.Background()
	_, _, id := startWrapped(t, c, "node1", "counter", "sh", "-c", `i=0; while true; do echo $i; i=$((i+1)); sleep 0.05; done`)
	// The first host snapshot (which freezes and thaws the cgroup itself) is done.
	j := waitProtected(t, c, "node1", id, 2*time.Minute)

	// Freeze the cgroup as semiCoordinated does, and kill the agent before it thaws.
	if err := os.WriteFile(filepath.Join(j.Cgroup, "cgroup.freeze"), []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(filepath.Join(j.Cgroup, "cgroup.freeze"), []byte("0"), 0) })
	waitEvents(t, j.Cgroup, "frozen 1", time.Minute)
	if err := c.KillAgent("node1"); err != nil {
		t.Fatal(err)
	}
	frozenOut, err := os.ReadFile(j.StdoutPath())
	if err != nil {
		t.Fatal(err)
	}
	if err := c.StartAgent(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	waitEvents(t, j.Cgroup, "frozen 0", time.Minute)
	// The job computes again: its output grows past what it had written when it was frozen.
	deadline := time.Now().Add(time.Minute)
	for {
		out, err := os.ReadFile(j.StdoutPath())
		if err == nil && len(out) > len(frozenOut) && bytes.HasPrefix(out, frozenOut) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the job's output did not grow after the restart: %d bytes, %d when frozen (%v)", len(out), len(frozenOut), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if log, _ := os.ReadFile(c.LogPath("node1")); !strings.Contains(string(log), "left frozen") {
		t.Errorf("the restarted agent did not log that it thawed a job left frozen")
	}
	if jj, err := c.Client("node1").Job(ctx, id); err != nil || jj.State != agent.JobRunning || jj.PID != j.PID {
		t.Errorf("adopted job %+v, %v: want the same process, running", jj, err)
	}
}

// waitEvents waits until cgroup.events of cgroup contains want ("frozen 1", "frozen 0").
func waitEvents(t *testing.T, cgroup, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(filepath.Join(cgroup, "cgroup.events"))
		if err == nil && strings.Contains(string(b), want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("cgroup %s: no %q within %s: %s (%v)", cgroup, want, timeout, b, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
