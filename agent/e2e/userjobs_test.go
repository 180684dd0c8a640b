package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
	"golang.org/x/sys/unix"
)

// startInDir starts ftwrap for a job on host as uid (root if 0), working in dir, and returns the job once
// the agent lists it.
func startInDir(t *testing.T, c *labcluster.Cluster, host, name string, uid uint32, dir string, argv ...string) agent.Job {
	t.Helper()
	return startWrappedAs(t, c, host, name, uid, dir, nil, argv...)
}

// startWrappedAs is startInDir with more flags of ftwrap.
func startWrappedAs(t *testing.T, c *labcluster.Cluster, host, name string, uid uint32, dir string, flags []string, argv ...string) agent.Job {
	t.Helper()
	cmd := ftwrap(c, host, append(append(append([]string{"--name", name}, flags...), "--"), argv...)...)
	cmd.Dir = dir
	if uid != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		jobs, _ := c.Client(host).Jobs(context.Background())
		for _, j := range jobs {
			if j.Spec.Name == name {
				return j
			}
		}
	}
	t.Fatalf("job %s did not appear on %s", name, host)
	return agent.Job{}
}

// countingJob prints 0..lines-1 on stdout and e0.. on stderr, and, first, the number of processes its /proc
// lists (the job's own /proc lists its shell and the counting command, the host's many more).
func countingJob(lines int) []string {
	return []string{"sh", "-c", fmt.Sprintf(
		`n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo "procs $n" >&2; i=0; while [ $i -lt %d ]; do echo $i; echo e$i >&2; i=$((i+1)); sleep 0.03; done`, lines)}
}

// snapshotRestoreElsewhere snapshots the running job on node1, crashes node1, restores the job on node2 and
// checks that its outputs are complete, each line once, in order.
func snapshotRestoreElsewhere(t *testing.T, c *labcluster.Cluster, j agent.Job, lines int) {
	t.Helper()
	ctx := context.Background()
	waitSize(t, map[string]int64{j.StdoutPath(): 50, j.StderrPath(): 50})
	if out := readOrEmpty(j.StderrPath()); !strings.HasPrefix(out, "procs ") {
		t.Fatalf("job's stderr starts %q, want its process count", head(out))
	} else if n, err := strconv.Atoi(strings.TrimPrefix(strings.SplitN(out, "\n", 2)[0], "procs ")); err != nil || n > 3 {
		t.Errorf("the job's /proc lists %d processes (%v): it is not the /proc of the job's PID namespace", n, err)
	}
	m := snapshotNow(t, c, "node1", j.ID)
	if len(m.OpenFiles) != 2 {
		t.Errorf("snapshot %s lists %+v; want the job's stdout and stderr", m.ID, m.OpenFiles)
	}
	sizes := map[string]int64{}
	for _, f := range m.OpenFiles {
		sizes[f.Path] = f.Size
	}
	waitSize(t, sizes) // written past the snapshot: the restore truncates them back
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	r, err := c.Client("node2").Restore(ctx, agent.RestoreRequest{Snapshot: m.ID, Job: j.ID})
	if err != nil {
		t.Fatalf("restore on node2: %v", err)
	}
	if r.Node != "node2" || r.Restored != m.ID {
		t.Errorf("restored job %+v, want it on node2 from %s", r, m.ID)
	}
	end := waitExited(t, c, "node2", j.ID)
	if end.State != agent.JobExited || end.Exit == nil || end.Exit.Code != 0 {
		t.Errorf("restored job ended %s %+v, want exit 0", end.State, end.Exit)
	}
	if got, want := readOrEmpty(j.StdoutPath()), numbered("", lines); got != want {
		t.Errorf("stdout after the restore: %s", firstDiff(got, want))
	}
	stderr := readOrEmpty(j.StderrPath())
	if _, rest, _ := strings.Cut(stderr, "\n"); rest != numbered("e", lines) {
		t.Errorf("stderr after the restore: %s", firstDiff(rest, numbered("e", lines)))
	}
}

// A job that runs as uid 65534 is snapshotted and restored on another host; its output continues without a
// gap or a repeat. The old code could not dump it: CRIU's parasite, running with the job's credentials,
// found the host's /proc and tried to mount its own ("Can't create a directory (-13)", "can't dump
// unprivileged task whose /proc doesn't belong to it").
func TestSnapshotAndRestoreJobOfOtherUser(t *testing.T) {
	t.Parallel() // each test has its own lab
	requireSysResource(t)
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	const lines = 300
	j := startInDir(t, c, "node1", "nobodyjob", nobodyID, "/", countingJob(lines)...)
	if j.UID != nobodyID {
		t.Fatalf("job runs as uid %d, want %d", j.UID, nobodyID)
	}
	snapshotRestoreElsewhere(t, c, j, lines)
}

// A root job whose working directory holds a directory named proc.crtools is snapshotted and restored. The
// old code failed every dump of it: with the host's /proc in view, CRIU's parasite mkdir()s proc.crtools in
// the job's working directory to mount a /proc there ("Can't create a directory (-17)"), which is also the
// race two agents dumping root jobs in "/" at the same instant lost. With the job's own /proc, the parasite
// creates nothing.
func TestSnapshotWithProcCrtoolsInWorkingDirectory(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "proc.crtools"), 0o700); err != nil {
		t.Fatal(err)
	}
	const lines = 300
	j := startInDir(t, c, "node1", "crtoolsdir", 0, dir, countingJob(lines)...)
	snapshotRestoreElsewhere(t, c, j, lines)
	if ents, err := os.ReadDir(filepath.Join(dir, "proc.crtools")); err != nil || len(ents) != 0 {
		t.Errorf("proc.crtools in the job's directory: %v, %v; want it as the test made it", ents, err)
	}
}

// requireSysResource skips, loudly, where root lacks CAP_SYS_RESOURCE (a container's bounding set): CRIU
// reads every task's resource limits with prlimit(2), which the kernel allows on a task of another user
// only with that capability ("Can't get rlimit 0: Operation not permitted").
func requireSysResource(t *testing.T) {
	t.Helper()
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		t.Fatal(err)
	}
	if data[unix.CAP_SYS_RESOURCE/32].Effective&(1<<(unix.CAP_SYS_RESOURCE%32)) == 0 {
		t.Skip("SKIPPED: root lacks CAP_SYS_RESOURCE here, so CRIU cannot read the resource limits of a job of another user (prlimit: EPERM); run where root has it")
	}
}
