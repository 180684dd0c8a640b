package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// startWrapped starts ftwrap for argv on host and returns it with the job id once the agent lists it.
func startWrapped(t *testing.T, c *labcluster.Cluster, host, name string, argv ...string) (*exec.Cmd, *bytes.Buffer, string) {
	t.Helper()
	cmd := ftwrap(c, host, append([]string{"--name", name, "--"}, argv...)...)
	var out, stderr bytes.Buffer
	cmd.Stdout = &out
	// The program's complaint, under this test's name: in the shared stderr of parallel tests it lands
	// under whichever test gotestsum saw last (ci258).
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() && stderr.Len() > 0 {
			t.Logf("stderr of ftwrap %s on %s:\n%s", name, host, stderr.String())
		}
	})
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() }) // first: the stderr buffer is complete after Wait
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		jobs, _ := c.Client(host).Jobs(context.Background())
		for _, j := range jobs {
			if j.Spec.Name == name {
				return cmd, &out, j.ID
			}
		}
	}
	t.Fatalf("job %s did not appear on %s", name, host)
	return nil, nil, ""
}

func waitCmd(t *testing.T, cmd *exec.Cmd, timeout time.Duration) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(timeout):
		cmd.Process.Kill()
		return fmt.Errorf("still running after %s", timeout)
	}
}

func TestCrashAndRestoreOnSpare(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()

	// What a failure-free run prints.
	memArgs := []string{bins.Memcounter, "--mb", "64", "--steps", "300", "--delay", "50ms"}
	want, err := exec.Command(memArgs[0], append(append([]string{}, memArgs[1:]...), "--delay", "0s")...).Output()
	if err != nil {
		t.Fatal(err)
	}
	var wantCount strings.Builder
	for i := 0; i < 400; i++ {
		fmt.Fprintln(&wantCount, i)
	}

	// A mount that exists as the jobs start and is gone from the hosts before the restore (a job's private
	// tmpfs, an automounted home): a job's mount namespace copies it, and spare1 must restore without it.
	gone := filepath.Join("/run", "ftkit-test-gone-"+c.Lab.State().ID)
	mountTmpfs(t, gone)
	mountTmpfs(t, filepath.Join(gone, "inner"))
	// A mount the hosts unmount while the jobs run, its directory left in place: the jobs' copies of it
	// stay, and their snapshots must leave them out rather than dump their content (or fail, for a file
	// system CRIU cannot dump, such as NFS). An unmount propagates through the parent mount, so the mount
	// goes on a private parent: as on a host that shares no mount (a container), nothing reaches the jobs.
	staleParent := filepath.Join("/run", "ftkit-test-stale-"+c.Lab.State().ID)
	mountTmpfs(t, staleParent)
	if err := unix.Mount("", staleParent, "", unix.MS_PRIVATE, ""); err != nil {
		t.Fatal(err)
	}
	stale := mountTmpfs(t, filepath.Join(staleParent, "m"))
	mountImagesName := func(job, id string) bool {
		images := filepath.Join(labcluster.StateDir(c.Lab.State().ID, "node1"), "snapshots", job, id, "images")
		names, err := filepath.Glob(filepath.Join(images, "mountpoints-*.img"))
		if err != nil || len(names) == 0 {
			t.Fatalf("snapshot %s of job %s has no mount image in %s: %v", id, job, images, err)
		}
		for _, n := range names {
			if b, err := os.ReadFile(n); err != nil {
				t.Fatal(err)
			} else if bytes.Contains(b, []byte(stale)) {
				return true
			}
		}
		return false
	}

	memCmd, memOut, memJob := startWrapped(t, c, "node1", "mem", memArgs...)
	cntCmd, cntOut, cntJob := startWrapped(t, c, "node1", "count", "sh", "-c",
		`i=0; while [ $i -lt 400 ]; do echo $i; i=$((i+1)); sleep 0.03; done`)

	latest := map[string]string{}
	atSnapshot := map[string]int64{} // size of each job output file in the newest snapshot
	for round := 0; round < 3; round++ {
		time.Sleep(400 * time.Millisecond)
		reply, err := c.Client("node1").Checkpoint(ctx, memJob, cntJob)
		if err != nil || reply.Error != "" || len(reply.Results) != 2 {
			t.Fatalf("checkpoint round %d: %+v, %v", round, reply, err)
		}
		for _, r := range reply.Results {
			if !r.Shipped {
				t.Fatalf("snapshot %s not replicated: %s", r.Manifest.ID, r.ShipErr)
			}
			latest[r.Manifest.Job] = r.Manifest.ID
			for _, f := range r.Manifest.OpenFiles {
				if filepath.Base(f.Path) == "stdout" { // the jobs write nothing else
					atSnapshot[f.Path] = f.Size
				}
			}
			// Restore truncates the files listed here: only the job's outputs, never a binary it runs.
			for _, f := range r.Manifest.OpenFiles {
				if !strings.HasPrefix(f.Path, labcluster.JobsDir(c.Lab.State().ID)+"/") {
					t.Errorf("snapshot %s would truncate %s, which is not one of the job's outputs", r.Manifest.ID, f.Path)
				}
			}
			t.Logf("round %d: job %s snapshot %s, %.1f MB, frozen %s", round, r.Manifest.Job, r.Manifest.ID,
				float64(r.Manifest.TotalSize())/1e6, r.Manifest.Stats.FrozenTime)
			if has := mountImagesName(r.Manifest.Job, r.Manifest.ID); has != (round == 0) {
				t.Errorf("round %d: snapshot %s of job %s names the mount on %s: %v, want %v (mounted on the host in round 0 only)",
					round, r.Manifest.ID, r.Manifest.Job, stale, has, round == 0)
			}
		}
		if round == 0 {
			if err := unix.Unmount(stale, 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Output past the last snapshot, which the restored jobs write again: every job's stdout grows.
	if len(atSnapshot) != 2 {
		t.Fatalf("the snapshots list stdout files %v, want one per job", atSnapshot)
	}
	for path, size := range atSnapshot {
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
			if fi, err := os.Stat(path); err == nil && fi.Size() > size {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s did not grow past its %d bytes at the last snapshot within a minute", path, size)
			}
		}
	}
	unix.Unmount(gone, unix.MNT_DETACH) // gone from the hosts before the restore
	os.RemoveAll(gone)
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}

	for _, job := range []string{memJob, cntJob} {
		start := time.Now()
		j, err := c.Client("spare1").Restore(ctx, agent.RestoreRequest{Snapshot: latest[job], Job: job})
		if err != nil {
			t.Fatalf("restore %s on spare1: %v", job, err)
		}
		if j.Node != "spare1" || j.Restored != latest[job] {
			t.Fatalf("restored job %+v", j)
		}
		t.Logf("job %s restored on spare1 from %s in %s", job, latest[job], time.Since(start))
	}
	if b, err := os.ReadFile(c.LogPath("node1")); err != nil || strings.Count(string(b), "unmounted are left out of its snapshot") < 2*2 || !strings.Contains(string(b), stale) {
		t.Errorf("node1's agent did not log leaving %s out of both jobs' snapshots of rounds 1 and 2: %v", stale, err)
	}
	if b, err := os.ReadFile(c.LogPath("spare1")); err != nil || !strings.Contains(string(b), "restored without them") || !strings.Contains(string(b), gone+"/inner") {
		t.Errorf("spare1's agent did not log restoring the jobs without the mounts gone from the hosts (%s, %s/inner): %v", gone, gone, err)
	}
	if err := waitCmd(t, memCmd, 60*time.Second); err != nil {
		t.Fatalf("ftwrap of the memory job: %v", err)
	}
	if err := waitCmd(t, cntCmd, 60*time.Second); err != nil {
		t.Fatalf("ftwrap of the counter job: %v", err)
	}
	if memOut.String() != string(want) {
		t.Errorf("memory job output differs from a failure-free run:\n got %d bytes\nwant %d bytes\n%s", memOut.Len(), len(want), firstDiff(memOut.String(), string(want)))
	}
	if cntOut.String() != wantCount.String() {
		t.Errorf("counter output has a gap or a repeated line:\n%s", firstDiff(cntOut.String(), wantCount.String()))
	}
	// The output files themselves, not just what ftwrap printed, continue without a gap.
	got, err := os.ReadFile(filepath.Join(labcluster.JobsDir(c.Lab.State().ID), cntJob, "stdout"))
	if err != nil || string(got) != wantCount.String() {
		t.Errorf("counter's output file after restore: %v\n%s", err, firstDiff(string(got), wantCount.String()))
	}
}

// mountTmpfs mounts a small tmpfs on dir, creating it, and returns dir. When the test ends, the tmpfs is
// unmounted (with whatever is mounted below it) and dir removed.
func mountTmpfs(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("ftkit-test", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Unmount(dir, unix.MNT_DETACH)
		os.RemoveAll(dir)
	})
	return dir
}

func firstDiff(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < len(g) && i < len(w); i++ {
		if g[i] != w[i] {
			return fmt.Sprintf("line %d: got %q, want %q", i+1, g[i], w[i])
		}
	}
	return fmt.Sprintf("got %d lines, want %d", len(g), len(w))
}

// TestJobSeesLaterHostMounts: what a host mounts and unmounts after a job started reaches the job, before
// and after the job's restore on another host, where the host shares the mount (systemd shares every mount
// at boot). An automounted home is the case that matters: autofs mounts it in the host's namespace on first
// access, and a private copy of the namespace failed that access.
func TestJobSeesLaterHostMounts(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 1, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()
	shared := mountTmpfs(t, filepath.Join("/run", "ftkit-test-shared-"+c.Lab.State().ID))
	if err := unix.Mount("", shared, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	// Propagation happens within mount(2) and umount(2): the job's namespace has the change when they return.
	sees := func(pid int, path string) bool {
		t.Helper()
		f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		ms, err := mountinfo.GetMountsFromReader(f, mountinfo.SingleEntryFilter(path))
		if err != nil {
			t.Fatal(err)
		}
		return len(ms) > 0
	}

	var want strings.Builder
	for i := 0; i < 300; i++ {
		fmt.Fprintln(&want, i)
	}
	cmd, out, id := startWrapped(t, c, "node1", "count", "sh", "-c",
		`i=0; while [ $i -lt 300 ]; do echo $i; i=$((i+1)); sleep 0.03; done`)
	j, err := c.Client("node1").Job(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	before := mountTmpfs(t, filepath.Join(shared, "before-snapshot"))
	if !sees(j.PID, before) {
		t.Fatalf("job %s (pid %d) does not see %s, mounted on the host after it started", id, j.PID, before)
	}
	// Except a network namespace named after the job started (a job network, a lab host): its handle in
	// /run/netns, a shared mount, must not reach the job, whose snapshot would then name a namespace gone
	// where it is restored (ci124: "Can't stat mountpoint .../ftj-...").
	later := "ftkit-test-later-" + c.Lab.State().ID
	if err := netnsthread.CreateNamed(later); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { netns.DeleteNamed(later) })
	if sees(j.PID, filepath.Join(netnsthread.RunDir, later)) {
		t.Fatalf("job %s (pid %d) sees network namespace %s, named on the host after it started", id, j.PID, later)
	}
	reply, err := c.Client("node1").Checkpoint(ctx, id)
	if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint: %+v, %v", reply, err)
	}
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	r, err := c.Client("spare1").Restore(ctx, agent.RestoreRequest{Snapshot: reply.Results[0].Manifest.ID, Job: id})
	if err != nil {
		t.Fatalf("restore %s on spare1: %v", id, err)
	}
	if !sees(r.PID, before) {
		t.Errorf("restored job (pid %d) does not see %s", r.PID, before)
	}
	after := mountTmpfs(t, filepath.Join(shared, "after-restore"))
	if !sees(r.PID, after) {
		t.Errorf("restored job (pid %d) does not see %s, mounted on the host after its restore", r.PID, after)
	}
	if err := unix.Unmount(before, 0); err != nil {
		t.Fatal(err)
	}
	if sees(r.PID, before) {
		t.Errorf("restored job (pid %d) still has %s, unmounted from the host", r.PID, before)
	}
	if err := waitCmd(t, cmd, 60*time.Second); err != nil {
		t.Fatalf("ftwrap: %v", err)
	}
	if out.String() != want.String() {
		t.Errorf("output differs from a failure-free run:\n%s", firstDiff(out.String(), want.String()))
	}
}
