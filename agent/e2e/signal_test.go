package e2e

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// A job's root is the init of its own PID namespace: it gets a signal from outside only if it handles it.
// It says when its handler is in place.
const trapTERM = `trap 'exit 7' TERM; echo ready; while :; do sleep 0.1; done`

// waitReady waits until the job has printed its first line.
func waitReady(t *testing.T, j agent.Job) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if b, _ := os.ReadFile(j.StdoutPath()); strings.HasPrefix(string(b), "ready\n") {
			return
		}
	}
	t.Fatalf("job %s did not get ready", j.ID)
}

// waitJobEnd long-polls the agent until the job is no longer running.
func waitJobEnd(t *testing.T, c *agentapi.Client, id string) agent.Job {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
		j, err := c.Wait(context.Background(), id, 10*time.Second)
		if err != nil {
			t.Fatalf("wait for job %s: %v", id, err)
		}
		if j.State != agent.JobRunning {
			return j
		}
	}
	t.Fatalf("job %s still runs", id)
	return agent.Job{}
}

// The signal endpoint reaches the job through a pidfd checked against the job's cgroup: in a real cgroup
// for a started job and for one CRIU restored on another host, and it refuses a job that has ended.
func TestSignalJob(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()
	n1, n2 := c.Client("node1"), c.Client("node2")

	started, err := n1.StartJob(ctx, agent.JobSpec{Name: "trap", Argv: []string{"/bin/sh", "-c", trapTERM}})
	if err != nil {
		t.Fatal(err)
	}
	waitReady(t, started)
	if err := n1.Signal(ctx, started.ID, syscall.SIGTERM); err != nil {
		t.Fatalf("signal a running job: %v", err)
	}
	if j := waitJobEnd(t, n1, started.ID); j.Exit == nil || j.Exit.Code != 7 {
		t.Fatalf("the job did not handle SIGTERM: %+v", j.Exit)
	}
	if err := n1.Signal(ctx, started.ID, syscall.SIGTERM); err == nil || !strings.Contains(err.Error(), "is exited") {
		t.Fatalf("signal to an exited job: %v", err)
	}

	moved, err := n1.StartJob(ctx, agent.JobSpec{Name: "moved", Argv: []string{"/bin/sh", "-c", trapTERM}})
	if err != nil {
		t.Fatal(err)
	}
	waitReady(t, moved)
	r, err := n1.Checkpoint(ctx, moved.ID)
	if err != nil || len(r.Results) != 1 || !r.Results[0].Shipped {
		t.Fatalf("checkpoint: %+v, %v", r, err)
	}
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	// An agent killed during a snapshot's freeze leaves its job's cgroup frozen (as node2's would be had the
	// job run there before): node2 restores into that very cgroup, and must thaw it, not hang in it (it did).
	frozen := c.JobCgroup("node2", moved.ID)
	if err := os.MkdirAll(frozen, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(frozen, "cgroup.freeze"), []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	restored, err := n2.Restore(ctx, agent.RestoreRequest{Snapshot: r.Results[0].Manifest.ID, Job: moved.ID})
	if err != nil {
		t.Fatalf("restore on node2: %v", err)
	}
	if restored.Node != "node2" || restored.State != agent.JobRunning {
		t.Fatalf("restored job %+v", restored)
	}
	if err := n2.Signal(ctx, moved.ID, syscall.SIGTERM); err != nil {
		t.Fatalf("signal the restored job: %v", err)
	}
	if j := waitJobEnd(t, n2, moved.ID); j.Exit == nil || j.Exit.Code != 7 {
		t.Fatalf("the restored job did not handle SIGTERM: %+v", j.Exit)
	}
	if err := n2.Signal(ctx, moved.ID, syscall.SIGTERM); err == nil || errors.Is(err, agent.ErrNoJob) {
		t.Fatalf("signal to the restored job after its end: %v", err)
	}
}

// TestFtwrapCtrlCReachesTheJob: ftwrap forwards Ctrl-C (SIGINT) to the job, whose program starts with every
// signal at its default action, so a shell can trap it. Until 2026-12-07 every job started with SIGINT and
// SIGHUP ignored (the shim's own, kept across exec): `trap ... INT` did nothing, and Ctrl-C never reached
// the job.
func TestFtwrapCtrlCReachesTheJob(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	cmd := ftwrap(c, "node1", "--name", "ctrlc", "--", "/bin/sh", "-c", `trap 'exit 5' INT; echo ready; while :; do sleep 0.1; done`)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() }) // reaped by the Wait above
	var j agent.Job
	for deadline := time.Now().Add(30 * time.Second); j.ID == ""; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("job ctrlc did not appear on node1")
		}
		jobs, _ := c.Client("node1").Jobs(context.Background())
		for _, got := range jobs {
			if got.Spec.Name == "ctrlc" {
				j = got
			}
		}
	}
	waitReady(t, j)
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 5 {
			t.Fatalf("ftwrap after Ctrl-C: %v; want exit status 5, the job's trap of SIGINT", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("ftwrap and its job still run a minute after Ctrl-C; want the job's trap of SIGINT to end it with status 5")
	}
	if end := waitJobEnd(t, c.Client("node1"), j.ID); end.Exit == nil || end.Exit.Code != 5 {
		t.Fatalf("the job ended %s %+v; want its trap's exit 5", end.State, end.Exit)
	}
}
