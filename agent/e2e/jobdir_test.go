package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/lab/labcluster"
)

const nobodyID = 65534

// asNobody runs a command as the job's user (uid 65534): what the job itself could do.
func asNobody(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobodyID, Gid: nobodyID}}
	cmd.Dir = "/"
	return cmd
}

// userDir makes a directory the job's user owns, outside the job directory, removed at the end.
func userDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "ftkit-e2e-user-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(d, nobodyID, nobodyID); err != nil {
		t.Fatal(err)
	}
	return d
}

// startAs starts ftwrap for a job on host as uid (root if 0) and returns the job once the agent lists it.
func startAs(t *testing.T, c *labcluster.Cluster, host, name string, uid uint32, argv ...string) agent.Job {
	t.Helper()
	cmd := ftwrap(c, host, append([]string{"--name", name, "--"}, argv...)...)
	if uid != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
		cmd.Dir = "/"
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

// waitSize waits until every file is larger than its given size.
func waitSize(t *testing.T, sizes map[string]int64) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for p, n := range sizes {
		for {
			st, err := os.Stat(p)
			if err == nil && st.Size() > n {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s did not grow past %d bytes: %v", p, n, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// snapshotNow snapshots the job on host and waits for the replica on the protector.
func snapshotNow(t *testing.T, c *labcluster.Cluster, host, job string) *ckpt.Manifest {
	t.Helper()
	r, err := c.Client(host).Checkpoint(context.Background(), job)
	if err != nil || r.Error != "" || len(r.Results) != 1 || !r.Results[0].Shipped {
		t.Fatalf("checkpoint of %s: %+v, %v", job, r, err)
	}
	return r.Results[0].Manifest
}

// waitExited waits until the job's agent on host records how it ended.
func waitExited(t *testing.T, c *labcluster.Cluster, host, job string) agent.Job {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		j, err := c.Client(host).Wait(context.Background(), job, 10*time.Second)
		if err == nil && j.State != agent.JobRunning {
			return j
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s on %s did not end: %+v, %v", job, host, j, err)
		}
	}
}

func readOrEmpty(p string) string {
	b, _ := os.ReadFile(p)
	return string(b)
}

func numbered(prefix string, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "%s%d\n", prefix, i)
	}
	return b.String()
}

// rootFiles makes root's files that a job's user would like root to overwrite, truncate or read, larger
// than anything the jobs write (an old restore truncated a longer file), and a check that they are
// untouched.
func rootFiles(t *testing.T, names ...string) (map[string]string, func(when string)) {
	t.Helper()
	dir := t.TempDir()
	content := func(name string) string {
		if name == "exit" { // a record the agent would take for the job's end
			return `{"code": 77, "node": "forged"}`
		}
		return strings.Repeat("root's data, not the job's\n", 4096)
	}
	targets := map[string]string{}
	for _, name := range names {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content(name)), 0o644); err != nil {
			t.Fatal(err)
		}
		targets[name] = p
	}
	return targets, func(when string) {
		t.Helper()
		for name, p := range targets {
			if got, want := readOrEmpty(p), content(name); got != want {
				t.Errorf("%s: root's file %s changed: %d bytes, want %d", when, p, len(got), len(want))
			}
		}
	}
}

// A job's directory is root's: the job's user (uid 65534 here) can add, replace or remove nothing in it,
// so it cannot plant a link for the shim, a snapshot or a restore (all root) to write through, nor forge
// the exit record.
func TestJobUserCannotPlantInJobDirectory(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h"})
	targets, untouched := rootFiles(t, "stdout", "stderr", "exit", "other")
	home := userDir(t)
	stop := filepath.Join(home, "stop")
	j := startAs(t, c, "node1", "planter", nobodyID, "sh", "-c", fmt.Sprintf(
		`i=0; while [ ! -e %s ]; do echo $i; echo e$i >&2; i=$((i+1)); sleep 0.05; done; echo done`, stop))
	if st, err := os.Stat(j.Dir); err != nil || st.Sys().(*syscall.Stat_t).Uid != 0 || st.Mode().Perm() != 0o755 {
		t.Errorf("job directory %s: %v, %v; want root's, 0755", j.Dir, st, err)
	}
	for _, name := range []string{"stdout", "stderr", "exit", "other"} {
		if out, err := asNobody("ln", "-sfn", targets[name], filepath.Join(j.Dir, name)).CombinedOutput(); err == nil {
			t.Errorf("uid %d planted %s -> %s in its job directory", nobodyID, name, targets[name])
		} else {
			t.Logf("planting %s refused: %s", name, bytes.TrimSpace(out))
		}
	}
	for _, name := range []string{"stdout", "stderr"} {
		if st, err := os.Lstat(filepath.Join(j.Dir, name)); err != nil || !st.Mode().IsRegular() || st.Sys().(*syscall.Stat_t).Uid != nobodyID {
			t.Errorf("job output %s: %v, %v; want a regular file of uid %d", name, st, err, nobodyID)
		}
	}
	// The job is in its loop (it printed its first line) before it is told to stop: on a loaded machine
	// its shell may not have looked for the stop file yet.
	for deadline := time.Now().Add(time.Minute); !strings.HasPrefix(readOrEmpty(j.StdoutPath()), "0\n"); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the job printed nothing within a minute: %q", readOrEmpty(j.StdoutPath()))
		}
	}
	if out, err := asNobody("touch", stop).CombinedOutput(); err != nil {
		t.Fatalf("stop the job: %v\n%s", err, out)
	}
	// The agent records the job's real end, not a forged one.
	end := waitExited(t, c, "node1", j.ID)
	if end.State != agent.JobExited || end.Exit == nil || end.Exit.Code != 0 || end.Exit.Node != "node1" {
		t.Errorf("job ended %s %+v; want exited with code 0 on node1", end.State, end.Exit)
	}
	if out := readOrEmpty(j.StdoutPath()); !strings.HasPrefix(out, "0\n") || !strings.HasSuffix(out, "done\n") {
		t.Errorf("job's stdout %q...", head(out))
	}
	untouched("after the job ran")
}

func head(s string) string {
	if len(s) > 40 {
		return s[:40]
	}
	return s
}

// Restore (root) follows no link in the job directory nor on the path of a file the job writes elsewhere:
// uid 65534 controls the directory of a file a job writes, and the job directory itself as an older agent
// handed it to a job's user. It swaps each file for a link to root's file; the restore refuses, naming the
// link, and changes nothing; once the files are back, it works on them.
//
// The job runs as root: CRIU cannot dump a job of another user in its own PID namespace ("can't dump
// unprivileged task whose /proc doesn't belong to it"), so no snapshot of one exists to restore.
func TestRestoreNeverWritesThroughLinks(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()
	targets, untouched := rootFiles(t, "stdout", "stderr", "out.log")
	home := userDir(t)
	outLog := filepath.Join(home, "out.log")
	const lines = 300
	j := startAs(t, c, "node1", "linked", 0, "sh", "-c", fmt.Sprintf(
		`exec 3>%s; i=0; while [ $i -lt %d ]; do echo $i; echo e$i >&2; echo o$i >&3; i=$((i+1)); sleep 0.03; done`, outLog, lines))

	waitSize(t, map[string]int64{j.StdoutPath(): 50, j.StderrPath(): 50, outLog: 50})
	m := snapshotNow(t, c, "node1", j.ID)
	sizes := map[string]int64{}
	for _, f := range m.OpenFiles {
		sizes[f.Path] = f.Size
	}
	if _, ok := sizes[outLog]; !ok || len(sizes) != 3 {
		t.Fatalf("snapshot %s lists %+v; want stdout, stderr and %s", m.ID, m.OpenFiles, outLog)
	}
	waitSize(t, sizes) // written past the snapshot: the restore truncates every one of them

	// The job directory as an older agent made it: the user's.
	if err := os.Chown(j.Dir, nobodyID, nobodyID); err != nil {
		t.Fatal(err)
	}
	plant := fmt.Sprintf(`set -e; ln -sf %s %s; ln -sf %s %s; mv %s %s.real; ln -s %s %s`,
		targets["stdout"], j.StdoutPath(), targets["stderr"], j.StderrPath(), outLog, outLog, targets["out.log"], outLog)
	if out, err := asNobody("sh", "-c", plant).CombinedOutput(); err != nil {
		t.Fatalf("plant links as uid %d: %v\n%s", nobodyID, err, out)
	}
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}

	_, err := c.Client("node2").Restore(ctx, agent.RestoreRequest{Snapshot: m.ID, Job: j.ID})
	untouched("after a restore over planted links")
	if err == nil {
		t.Fatal("restore succeeded with the job's files swapped for links to root's files")
	}
	t.Logf("restore refused: %v", err)
	if !strings.Contains(err.Error(), "symbolic link") {
		t.Errorf("refusal %q does not say a symbolic link is in the way", err)
	}
	if st, err := os.Stat(j.Dir); err != nil || st.Sys().(*syscall.Stat_t).Uid != 0 || st.Mode().Perm() != 0o755 {
		t.Errorf("the older agent's job directory after the restore: %v, %v; want root's again, 0755", st, err)
	}

	// What the refusal asks for: the links go (the job directory is root's now: the operator removes them)
	// and the user puts its directory's file back. The restore then recreates stdout and stderr from the
	// snapshot and truncates the real out.log.
	for _, p := range []string{j.StdoutPath(), j.StderrPath()} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := asNobody("sh", "-c", fmt.Sprintf("rm %s && mv %s.real %s", outLog, outLog, outLog)).CombinedOutput(); err != nil {
		t.Fatalf("put the file back: %v\n%s", err, out)
	}
	if _, err := c.Client("node2").Restore(ctx, agent.RestoreRequest{Snapshot: m.ID, Job: j.ID}); err != nil {
		t.Fatalf("restore with the real files back: %v", err)
	}
	end := waitExited(t, c, "node2", j.ID)
	if end.State != agent.JobExited || end.Exit == nil || end.Exit.Code != 0 {
		t.Errorf("restored job ended %s %+v, want exit 0", end.State, end.Exit)
	}
	for p, want := range map[string]string{
		j.StdoutPath(): numbered("", lines), j.StderrPath(): numbered("e", lines), outLog: numbered("o", lines),
	} {
		if got := readOrEmpty(p); got != want {
			t.Errorf("%s after the restore: %s", p, firstDiff(got, want))
		}
	}
	untouched("at the end")
}

// A restore that fails leaves the job's files exactly as it found them: the next attempt, or an older
// snapshot, needs the bytes written since the snapshot (the next snapshot's outputs hold them). A file the
// job appends to (`>>`) is cut back like any other: until 2026-12-07 CRIU recorded no size for it (patch
// 0009), and the restored job wrote what it had appended since the snapshot a second time.
func TestFailedRestoreLeavesOutputsAsTheyWere(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()
	dir := userDir(t)
	input, outLog, appLog := filepath.Join(dir, "input"), filepath.Join(dir, "out.log"), filepath.Join(dir, "app.log")
	if err := os.WriteFile(input, []byte("the job reads this\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const earlier = "an earlier run appended this\n"
	if err := os.WriteFile(appLog, []byte(earlier), 0o644); err != nil {
		t.Fatal(err)
	}
	const lines = 300
	j := startAs(t, c, "node1", "restorefail", 0, "sh", "-c", fmt.Sprintf(
		`exec 3<%s; exec 4>%s; exec 5>>%s; i=0; while [ $i -lt %d ]; do echo $i; echo e$i >&2; echo o$i >&4; echo a$i >&5; i=$((i+1)); sleep 0.03; done`, input, outLog, appLog, lines))
	waitSize(t, map[string]int64{j.StdoutPath(): 50, j.StderrPath(): 50, outLog: 50, appLog: int64(len(earlier)) + 50})
	m := snapshotNow(t, c, "node1", j.ID)
	sizes := map[string]int64{}
	for _, f := range m.OpenFiles {
		sizes[f.Path] = f.Size
	}
	if len(sizes) != 4 {
		t.Fatalf("snapshot %s lists %+v; want stdout, stderr, %s and %s", m.ID, m.OpenFiles, outLog, appLog)
	}
	waitSize(t, sizes)
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	before := map[string]string{}
	for p := range sizes {
		before[p] = readOrEmpty(p)
	}

	// CRIU cannot reopen the file the job reads: the restore fails after the outputs were truncated.
	if err := os.Rename(input, input+".away"); err != nil {
		t.Fatal(err)
	}
	_, err := c.Client("node2").Restore(ctx, agent.RestoreRequest{Snapshot: m.ID, Job: j.ID})
	if err == nil {
		t.Fatal("restore succeeded without a file the job has open")
	}
	t.Logf("restore failed as arranged: %v", err)
	for p, want := range before {
		if got := readOrEmpty(p); got != want {
			t.Errorf("%s after the failed restore: %d bytes, want the %d it had (%s)", p, len(got), len(want), firstDiff(got, want))
		}
	}

	// With the file back, the same snapshot restores and the job finishes without a gap or a repeat.
	if err := os.Rename(input+".away", input); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client("node2").Restore(ctx, agent.RestoreRequest{Snapshot: m.ID, Job: j.ID}); err != nil {
		t.Fatalf("restore with the file back: %v", err)
	}
	end := waitExited(t, c, "node2", j.ID)
	if end.Exit == nil || end.Exit.Code != 0 {
		t.Errorf("restored job ended %s %+v, want exit 0", end.State, end.Exit)
	}
	for p, want := range map[string]string{
		j.StdoutPath(): numbered("", lines), j.StderrPath(): numbered("e", lines), outLog: numbered("o", lines), appLog: earlier + numbered("a", lines),
	} {
		if got := readOrEmpty(p); got != want {
			t.Errorf("%s after the restore: %s", p, firstDiff(got, want))
		}
	}
}

// TestRestoreWhereAnEarlierCopyEnded: a job restored on the host where its earlier copy ended runs until it
// ends itself. Before, that copy's exit record in the job's directory made the agent finish the restored
// copy at its next look (200 ms), with the old status, and leave it unprotected.
func TestRestoreWhereAnEarlierCopyEnded(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()
	stop := filepath.Join(userDir(t), "stop")
	j := startAs(t, c, "node1", "restorehere", 0, "sh", "-c", fmt.Sprintf(
		`i=0; while [ ! -e %[1]s ]; do echo $i; i=$((i+1)); sleep 0.02; done; exit $(cat %[1]s)`, stop))
	waitSize(t, map[string]int64{j.StdoutPath(): 20})
	m := snapshotNow(t, c, "node1", j.ID)
	say := func(code string) { // whole, at once: the job reads the file as soon as it exists
		t.Helper()
		if err := os.WriteFile(stop+".new", []byte(code), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(stop+".new", stop); err != nil {
			t.Fatal(err)
		}
	}
	say("3")
	if first := waitExited(t, c, "node1", j.ID); first.Exit == nil || first.Exit.Code != 3 {
		t.Fatalf("first copy ended %s %+v, want exit 3", first.State, first.Exit)
	}
	if err := os.Remove(stop); err != nil {
		t.Fatal(err)
	}

	restored := time.Now()
	if _, err := c.Client("node1").Restore(ctx, agent.RestoreRequest{Snapshot: m.ID, Job: j.ID}); err != nil {
		t.Fatalf("restore on the host where the job ended: %v", err)
	}
	// The restored copy prints on from its snapshot: well past the agent's next look at the job.
	st, err := os.Stat(j.StdoutPath())
	if err != nil {
		t.Fatal(err)
	}
	waitSize(t, map[string]int64{j.StdoutPath(): st.Size() + 200})
	if got, err := c.Client("node1").Job(ctx, j.ID); err != nil || got.State != agent.JobRunning {
		t.Errorf("while the restored copy runs the agent has it as %s %+v (%v); want running", got.State, got.Exit, err)
	}
	say("0")
	end := waitExited(t, c, "node1", j.ID)
	if end.Exit == nil || end.Exit.Code != 0 || end.Exit.Time.Before(restored) {
		t.Errorf("restored copy ended %s %+v; want its own exit 0, after the restore at %s", end.State, end.Exit, restored.Format(time.RFC3339Nano))
	}
}
