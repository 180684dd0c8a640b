package e2e

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// counterArgv prints 0, 1, 2, ... one line every 50 ms, forever: a second live copy of it shows as a
// repeated line in its output file.
var counterArgv = []string{"sh", "-c", `i=0; while :; do echo $i; i=$((i+1)); sleep 0.05; done`}

// poll calls ok until it returns true; timeout only bounds a failure.
func poll(t *testing.T, timeout time.Duration, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(50 * time.Millisecond) {
		if ok() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, timeout)
		}
	}
}

// counterLines reads the counter's output file; every line must be the previous one plus one, from 0.
func counterLines(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("counter output: %v", err)
	}
	lines := strings.Split(string(b), "\n")
	lines = lines[:len(lines)-1] // after the last newline: "" or a line being written
	for i, l := range lines {
		if n, err := strconv.Atoi(l); err != nil || n != i {
			t.Fatalf("counter output line %d is %q, want %d: a repeated or lost line (two live copies write to it?)\n%s", i+1, l, i, tail(string(b)))
		}
	}
	return len(lines)
}

// startCounter starts the counter on host and waits until it has printed something and its first snapshot,
// which the agent takes as the job starts, is replicated: a test's own snapshot is then the job's newest
// everywhere (ci137: the agent's first snapshot waited behind the test's, and reached node2 after it).
func startCounter(t *testing.T, c *labcluster.Cluster, host, name string) agent.Job {
	t.Helper()
	j, err := c.Client(host).StartJob(context.Background(), agent.JobSpec{Name: name, Argv: counterArgv, Env: []string{"PATH=/usr/bin:/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	poll(t, 30*time.Second, "counter output", func() bool {
		b, _ := os.ReadFile(j.StdoutPath())
		return len(b) > 0
	})
	waitProtected(t, c, host, j.ID, time.Minute)
	return j
}

// replicate snapshots job j on host now and waits until holder lists the replica; it returns its id.
func replicate(t *testing.T, c *labcluster.Cluster, host, holder string, j agent.Job) string {
	t.Helper()
	ctx := context.Background()
	reply, err := c.Client(host).Checkpoint(ctx, j.ID)
	if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint of %s on %s: %+v %v", j.ID, host, reply, err)
	}
	id := reply.Results[0].Manifest.ID
	poll(t, 30*time.Second, "replica "+id+" on "+holder, func() bool {
		ms, err := c.Client(holder).Snapshots(ctx, j.ID)
		return err == nil && slices.ContainsFunc(ms, func(m *ckpt.Manifest) bool { return m.ID == id })
	})
	return id
}

// liveIncarnations counts the copies of job id that run anywhere in the lab: each restore (or start) runs
// the job as the init of a PID namespace of its own, so the distinct PID namespaces of the processes in the
// job's cgroups, one per host, are its live copies.
func liveIncarnations(t *testing.T, c *labcluster.Cluster, id string) int {
	t.Helper()
	ns := map[string]bool{}
	for _, h := range c.Lab.State().Hosts {
		cgroup := c.JobCgroup(h.Name, id)
		err := filepath.WalkDir(cgroup, func(p string, d fs.DirEntry, err error) error {
			if p == cgroup && errors.Is(err, fs.ErrNotExist) {
				return nil // the job never ran on h
			}
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return err
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			for _, f := range strings.Fields(string(b)) {
				if l, err := os.Readlink("/proc/" + f + "/ns/pid"); err == nil {
					ns[l] = true
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("processes of cgroup %s: %v", cgroup, err)
		}
	}
	return len(ns)
}

// runningOn lists the live agents whose job list has id running.
func runningOn(t *testing.T, c *labcluster.Cluster, id string) []string {
	t.Helper()
	var hosts []string
	for _, h := range c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		jobs, err := c.Client(h.Name).Jobs(context.Background())
		if err != nil {
			t.Fatalf("jobs of %s: %v", h.Name, err)
		}
		for _, j := range jobs {
			if j.ID == id && j.State == agent.JobRunning {
				hosts = append(hosts, h.Name)
			}
		}
	}
	return hosts
}

// requireOneIncarnation waits until the counter has printed lines more lines (time for a second copy to
// show), then requires exactly one live copy, one agent running it, and an output without a repeat.
func requireOneIncarnation(t *testing.T, c *labcluster.Cluster, j agent.Job, lines int) {
	t.Helper()
	before := counterLines(t, j.StdoutPath())
	poll(t, 60*time.Second, "counter progress after the recovery", func() bool {
		b, _ := os.ReadFile(j.StdoutPath())
		return strings.Count(string(b), "\n") >= before+lines
	})
	if n := liveIncarnations(t, c, j.ID); n != 1 {
		t.Errorf("%d live copies of job %s in the lab, want exactly 1", n, j.ID)
	}
	if hosts := runningOn(t, c, j.ID); len(hosts) != 1 {
		t.Errorf("job %s is running on %v, want exactly one host", j.ID, hosts)
	}
	n := counterLines(t, j.StdoutPath())
	t.Logf("counter output: %d lines, each once", n)
}

// timelineText is everything a failure's timeline says: its error, and each stage's detail and error.
func timelineText(f *agent.Failure) string {
	var b strings.Builder
	b.WriteString(f.Error)
	for _, s := range f.Stages {
		fmt.Fprintf(&b, "\n%s %s %s %s", s.Name, s.Job, s.Detail, s.Error)
	}
	return b.String()
}

// TestManualRestoreDuringFailover follows docs/operations.md#restoring-by-hand with automatic fail-over on: node1 is
// crashed and its job restored by hand on spare1, while node2 detects the failure and recovers node1's jobs
// on spare1 too. Exactly one of the two may run the job; the other must say where it runs. The hand restore
// comes surely first (detection slowed down), surely after the fail-over, or at once as in the docs (the
// two race; either may win).
func TestManualRestoreDuringFailover(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	tests := []struct {
		name string
		// first: which restore must win ("manual", "failover", or "" for either).
		first            string
		heartbeatTimeout time.Duration
	}{
		{name: "by hand before the fail-over", first: "manual", heartbeatTimeout: 10 * time.Second},
		{name: "by hand after the fail-over", first: "failover"},
		{name: "by hand at once, as in the README", first: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // each row has its own lab
			c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h", HeartbeatTimeout: tt.heartbeatTimeout})
			ctx := context.Background()
			j := startCounter(t, c, "node1", "counter")
			snap := replicate(t, c, "node1", "node2", j)
			if err := c.Lab.Crash(ctx, "node1"); err != nil {
				t.Fatal(err)
			}
			var f *agent.Failure
			if tt.first == "failover" {
				f = waitFailure(t, c, "node1", 5*time.Minute)
			}
			start := time.Now()
			// As in docs/operations.md: `ftctl restore --host spare1 --snapshot ID`, the job found from the snapshot.
			restored, rerr := c.Client("spare1").Restore(ctx, agent.RestoreRequest{Snapshot: snap})
			t.Logf("manual restore on spare1 after %s: %+v %v", time.Since(start).Round(time.Millisecond), restored, rerr)
			if f == nil {
				f = waitFailure(t, c, "node1", 5*time.Minute)
			}
			logTimeline(t, f)
			text := timelineText(f)
			switch {
			case rerr == nil && tt.first != "failover":
				// The manual restore won: the fail-over restored nothing and says where the job runs.
				if restored.Node != "spare1" || restored.Incarnation != 1 || restored.Restored != snap {
					t.Errorf("manual restore: %+v, want incarnation 1 on spare1 from %s", restored, snap)
				}
				// Refused either once the job ran (its incarnation claimed) or while the manual restore still
				// held the job's restore lock (lockRestore): both say where the job is restored.
				if want, under := "already runs as incarnation 1 on spare1", "is being restored on spare1 already"; !(strings.Contains(text, want) || strings.Contains(text, under)) || f.Error == "" {
					t.Errorf("the fail-over's timeline says neither %q nor %q:\n%s", want, under, text)
				}
				if slices.ContainsFunc(f.Stages, func(s agent.Stage) bool { return s.Name == agent.StageRestored }) {
					t.Errorf("the fail-over restored the job a second time:\n%s", text)
				}
			case rerr != nil && tt.first != "manual":
				// The fail-over claimed the job first: the manual restore was refused, naming where it runs (on
				// spare1 itself, once restored there, before the snapshot is even verified: "runs on this host").
				want, under := "already runs as incarnation 1 on "+f.Target, "is being restored on "+f.Target+" already"
				here := "runs on this host"
				if !strings.Contains(rerr.Error(), want) && !strings.Contains(rerr.Error(), under) && (f.Target != "spare1" || !strings.Contains(rerr.Error(), here)) {
					t.Errorf("manual restore refused with %q, want it to say %q or %q (or, on %s, %q)", rerr, want, under, f.Target, here)
				}
				if f.Error != "" {
					t.Errorf("both restores failed: the job runs nowhere; fail-over: %s", f.Error)
				}
			default:
				t.Errorf("want the %s restore to win; manual restore: %v; fail-over: %q", tt.first, rerr, f.Error)
			}
			requireOneIncarnation(t, c, j, 20)
		})
	}
}

// blockConnections makes host from refuse to open TCP connections to host to's agent (connections
// already open go on), until the returned function or the test's end removes the rule.
func blockConnections(t *testing.T, c *labcluster.Cluster, from, to string) func() {
	t.Helper()
	dst, err := c.Lab.Host(to)
	if err != nil {
		t.Fatal(err)
	}
	chains := fmt.Sprintf(`	chain out {
		type filter hook output priority 0; policy accept;
		ip daddr %s tcp dport %d tcp flags & (syn | ack) == syn reject with tcp reset
	}`, dst.Addr.Addr(), labcluster.AgentPort)
	undo, err := c.Lab.Filter(from, "ftkit_e2e_block_"+to, chains)
	if err != nil {
		t.Fatal(err)
	}
	remove := func() {
		if err := undo(); err != nil {
			t.Errorf("remove the block of %s -> %s: %v", from, to, err)
		}
	}
	t.Cleanup(remove)
	return remove
}

// TestFailoverFallsBackToNextReplica: the newest replica of node1's job is on node3 (node1 could not reach
// its protector node2 when it took it), node2 holds an older one. When node1 fails, spare1 cannot fetch
// from node3: it must take the next candidate, node2's replica, and say why the first one failed.
func TestFailoverFallsBackToNextReplica(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx := context.Background()
	j := startCounter(t, c, "node1", "fallback")
	older := replicate(t, c, "node1", "node2", j)
	unblock := blockConnections(t, c, "node1", "node2") // the heartbeat stream to node2 stays open
	newer := replicate(t, c, "node1", "node3", j)
	unblock()
	blockConnections(t, c, "spare1", "node3")
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node1", 5*time.Minute)
	requireStages(t, f)
	if f.Target != "spare1" {
		t.Errorf("recovered on %s, want spare1", f.Target)
	}
	var fetched *agent.Stage
	for i := range f.Stages {
		if f.Stages[i].Name == agent.StageFetched {
			fetched = &f.Stages[i]
		}
	}
	if fetched == nil || !strings.Contains(fetched.Detail, "from node2 (snapshot "+older) ||
		!strings.Contains(fetched.Detail, newer+" from node3: ") {
		t.Errorf("the fetch stage does not say that %s from node3 failed and %s came from node2: %+v", newer, older, fetched)
	}
	jj, err := c.Client("spare1").Job(ctx, j.ID)
	if err != nil || jj.Restored != older || jj.Incarnation != 1 {
		t.Errorf("job on spare1: %+v %v; want incarnation 1 restored from %s", jj, err, older)
	}
	requireOneIncarnation(t, c, j, 20)
}

// TestRestoreChecksOwnerBeforeFetch: a user other than root asking another host to restore root's job is
// refused before the snapshot moves: the host it asked never holds a copy. (A job of another user cannot
// be snapshotted here: CRIU refuses to dump an unprivileged task whose /proc does not belong to it.)
func TestRestoreChecksOwnerBeforeFetch(t *testing.T) {
	t.Parallel() // each test has its own lab
	const nobody = 65534
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()
	j := startCounter(t, c, "node1", "roots")
	snap := replicate(t, c, "node1", "node2", j)
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"--snapshot", snap}, {"--snapshot", snap, "--job", j.ID}} {
		cmd := exec.Command(bins.Ftctl, append([]string{"restore", "--socket", labcluster.Socket(c.Lab.State().ID, "spare1")}, args...)...)
		cmd.Dir = "/"
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "no such job") {
			t.Errorf("nobody restoring root's snapshot (%v): %v, %q; want a refusal", args, err, out)
		}
		if ms, err := c.Client("spare1").Snapshots(ctx, j.ID); err != nil || len(ms) != 0 {
			t.Fatalf("spare1 holds %d snapshot(s) of root's job after nobody's refused restore (%v): it was fetched before the owner was checked", len(ms), err)
		}
	}
	// root may.
	restored, err := c.Client("spare1").Restore(ctx, agent.RestoreRequest{Snapshot: snap})
	if err != nil || restored.Incarnation != 1 {
		t.Fatalf("root's restore: %+v %v", restored, err)
	}
	requireOneIncarnation(t, c, j, 10)
}
