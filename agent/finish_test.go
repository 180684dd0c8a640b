package agent

import (
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/shim"
)

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// finish removes the job's cgroup only if it is this agent's cgroup for the job.
func TestFinishLeavesForeignCgroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (as the agent runs)")
	}
	base := t.TempDir()
	cfg := Config{Name: "n1", StateDir: filepath.Join(base, "state"), JobsDir: filepath.Join(base, "jobs"), CgroupParent: filepath.Join(base, "cg")}
	a := &Agent{cfg: cfg, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	a.jobs = jobStore{dir: filepath.Join(cfg.StateDir, "jobs")}
	a.byID = map[string]*Job{}
	a.changed = make(chan struct{})
	must(t, os.MkdirAll(a.jobs.dir, 0o755))
	l := a.layout()
	id := "job-0123abcd"
	job := Job{ID: id, UID: 65534, GID: 65534, Dir: l.dir(id), Cgroup: l.cgroup(id), Node: "n0", State: JobRunning}
	victim := filepath.Join(base, "victim")
	must(t, os.Mkdir(victim, 0o755))
	j := job
	j.Cgroup = victim
	a.byID[id] = &j // finish ends the listed copy only
	a.finish(&j, JobExited, &shim.ExitStatus{})
	if _, err := os.Stat(victim); err != nil {
		t.Errorf("finish removed %s, which is not the job's cgroup here: %v", victim, err)
	}
	own := job
	must(t, os.MkdirAll(own.Cgroup, 0o755))
	a.byID[id] = &own
	a.finish(&own, JobExited, &shim.ExitStatus{})
	if _, err := os.Stat(own.Cgroup); err == nil {
		t.Errorf("finish left the job's own cgroup %s", own.Cgroup)
	}
}

// TestWatchJobsIgnoresOlderCopysRecord: the job came back to this host as incarnation 2, and the kill of an
// older copy of it here (incarnation 1: its shim, an older agent's, or one whose superseded mark could not
// be written, recorded it after the restore had set earlier records aside) is not the end of the copy
// that runs now: the agent finished it with that kill's status. Its own end, and a record naming no
// incarnation (an older shim's), are taken as before.
func TestWatchJobsIgnoresOlderCopysRecord(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: exit records are root's: needs root (as the agent runs)")
	}
	for _, tc := range []struct {
		name   string
		record string
		ends   bool
	}{
		{"an older copy's kill", `{"code": 137, "signal": "SIGKILL", "node": "node1", "incarnation": 1}`, false},
		{"the running copy's end", `{"code": 3, "node": "node1", "incarnation": 2}`, true},
		{"a record of an older shim", `{"code": 3, "node": "node1"}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.mu.Lock()
			j := ta.byID[rootsJob]
			j.Incarnation = 2
			ta.mu.Unlock()
			must(t, os.MkdirAll(j.Dir, 0o755))
			must(t, os.WriteFile(j.ExitPath(), []byte(tc.record), 0o644))
			ta.lookAtJobs(jobWatch{gone: map[string]time.Time{}, older: map[string]bool{}}) // one look of watchJobs
			got, _, _ := ta.Job(rootsJob, 0)
			if ended := got.State == JobExited; ended != tc.ends {
				t.Fatalf("record %s with the job at incarnation 2: state %s (exit %+v), want ended %v", tc.record, got.State, got.Exit, tc.ends)
			}
			if tc.ends && got.Exit.Code != 3 {
				t.Fatalf("exit %+v, want the record's code 3", got.Exit)
			}
		})
	}
}

// deadPID is the PID of a process that has exited and been reaped.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	must(t, cmd.Run())
	return cmd.Process.Pid
}

// TestWatchJobsGraceForEachCopy: a job whose copy here was seen gone by one look and then ended another way
// (moved by a migration or a rollback, dropped as this failed host's: its shim, marked superseded, writes no
// record) left its first sighting in the watch. When a copy of the job came back to this host (a rollback
// restores a run's jobs where they ran) and ended, a look that came between its process's end and its
// shim's exit record declared it lost at once, from the old copy's sighting, instead of giving the shim its
// moment: the job's record said lost, not exited, and its address was held for good.
func TestWatchJobsGraceForEachCopy(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (as the agent runs)")
	}
	ta := newTestAgent(t)
	w := jobWatch{gone: map[string]time.Time{}, older: map[string]bool{}}
	ta.mu.Lock()
	old := ta.byID[rootsJob]
	old.PID = deadPID(t) // the copy here killed, its shim marked superseded: no exit record
	ta.mu.Unlock()
	must(t, os.MkdirAll(old.Dir, 0o755))
	ta.lookAtJobs(w)
	if got, _, _ := ta.Job(rootsJob, 0); got.State != JobRunning {
		t.Fatalf("first look at a copy gone without a record: state %s, want running (the shim gets a moment)", got.State)
	}
	// The job left this host meanwhile (a migration or rollback recorded it moved), long ago.
	ta.mu.Lock()
	old.State = JobMoved
	for id := range w.gone {
		w.gone[id] = time.Now().Add(-time.Hour)
	}
	ta.mu.Unlock()
	ta.lookAtJobs(w)
	// A new copy restored here, whose process has just ended; its shim is writing its exit record.
	back := *old
	back.State, back.PID, back.Incarnation = JobRunning, deadPID(t), old.Incarnation+1
	ta.mu.Lock()
	ta.byID[rootsJob] = &back
	ta.mu.Unlock()
	ta.lookAtJobs(w)
	if got, _, _ := ta.Job(rootsJob, 0); got.State != JobRunning {
		t.Fatalf("first look at the returned copy, gone with its exit record not written yet: state %s, want running (its shim gets its moment, as every copy's)", got.State)
	}
}

// TestAdoptReleasesWhatEndedJobsLeft: finish saves a job's end before it gives back what the job held; an
// agent stopped in between (killed, restarted by systemd, the host's power) left the job's cgroup and a
// lazily restored job's images, its process memory, for good: the next agent's adopt looked only for the
// ended job's network. It gives the rest back too, but a cgroup something runs in (a restored copy of the
// job, where hosts share a kernel).
func TestAdoptReleasesWhatEndedJobsLeft(t *testing.T) {
	ta := newTestAgent(t)
	l := ta.layout()
	work := filepath.Join(ta.cfg.StateDir, "restore", "lazy-0000000a-snap-00000000")
	must(t, os.MkdirAll(work, 0o700))
	must(t, os.WriteFile(filepath.Join(work, "pages-1.img"), []byte("the job's memory"), 0o600))
	ended := []*Job{
		{ID: "exited-0000000a", State: JobExited, Exit: &shim.ExitStatus{Code: 0}},
		{ID: "lazy-0000000a", State: JobLost, LazyWork: work},
	}
	for _, j := range ended {
		j.Node, j.Cgroup, j.Dir, j.Created = ta.cfg.Name, l.cgroup(j.ID), l.dir(j.ID), time.Now().UTC()
		must(t, os.Mkdir(j.Cgroup, 0o755))
		must(t, ta.jobs.save(j))
	}
	// Where hosts share a kernel, the job's cgroup is that of a copy restored on another: it stays.
	busy := &Job{ID: "busy-0000000a", State: JobLost, Node: ta.cfg.Name, Cgroup: l.cgroup("busy-0000000a"), Dir: l.dir("busy-0000000a")}
	must(t, os.Mkdir(busy.Cgroup, 0o755))
	must(t, os.WriteFile(filepath.Join(busy.Cgroup, "cgroup.events"), []byte("populated 1\nfrozen 0\n"), 0o644))
	must(t, ta.jobs.save(busy))

	if n, err := ta.adopt(); err != nil || n != 0 {
		t.Fatalf("adopt: %d running, %v; want 0, nil", n, err)
	}
	for _, j := range ended {
		if _, err := os.Stat(j.Cgroup); err == nil {
			t.Errorf("job %s, %s before this agent started: its cgroup %s is left", j.ID, j.State, j.Cgroup)
		}
	}
	if _, err := os.Stat(work); err == nil {
		t.Errorf("a lazily restored job lost before this agent started: its images %s are left", work)
	}
	if _, err := os.Stat(busy.Cgroup); err != nil {
		t.Errorf("adopt removed the cgroup %s something runs in: %v", busy.Cgroup, err)
	}
}

// TestStaleEndLeavesRestoredCopy: watchJobs and dropFailedJobs take the running jobs under a.mu and end them
// after it, and finish ended whatever it was given. A copy that had ended another way meanwhile (dropped
// as this failed host's, then restored here again by a rollback or a restore) was ended a second time: its old
// record (incarnation 1, ended) was saved over the restored copy's, so that the next agent to start dropped
// the running copy unwatched (and deleted its network), and what the old copy held was given back by the job's
// id and names, the restored copy's cgroup, network, log protection and receive-order watch with it.
func TestStaleEndLeavesRestoredCopy(t *testing.T) {
	ta := newTestAgent(t)
	const id = "ends-00000001"
	old := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Incarnation: 1})
	ta.finishRunning(id, JobLost, nil) // dropped as this failed host's
	// Restored here again, as restoreJob records it.
	restored := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Incarnation: 2})
	must(t, ta.jobs.save(restored))
	// A look of watchJobs that took the old copy before it was dropped reads its exit record now.
	ta.finish(old, JobExited, &shim.ExitStatus{Code: 0})
	rec, err := ta.jobs.load(id)
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != JobRunning || rec.Incarnation != 2 {
		t.Errorf("the record of the copy restored here, after a late end of the old one: %s, incarnation %d; want running, incarnation 2", rec.State, rec.Incarnation)
	}
	if got, _, _ := ta.Job(id, 0); got.State != JobRunning || got.Incarnation != 2 {
		t.Errorf("the listed copy: %s, incarnation %d; want running, incarnation 2", got.State, got.Incarnation)
	}
}

// TestRestoreWaitsForAnEndsRelease: finish gives back what an ended copy held (log protection, receive-order
// watch, cgroup, lazy images, network) by the job's id and names after a.mu is free and the job no longer
// runs, so a restore of the job here (a rollback of its run, an operator's restore) got the restore lock
// meanwhile and made its cgroup, network and watches under the same names, for the old copy's release to
// take them down. The restore waits until the release is done.
func TestRestoreWaitsForAnEndsRelease(t *testing.T) {
	ta := newTestAgent(t)
	const id = "ends-00000001"
	// Its record names a cgroup not this agent's: releaseResources says so, the one moment inside the release a
	// unit test can stop at.
	j := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Incarnation: 1})
	j.Cgroup = filepath.Join(ta.dir, "elsewhere")
	granted := make(chan error, 1)
	waiting := make(chan struct{})
	var once, waitOnce sync.Once
	var inRelease bool
	ta.log = slog.New(hookHandler{func(r slog.Record) {
		switch {
		case strings.HasPrefix(r.Message, "waiting for the earlier copy"):
			waitOnce.Do(func() { close(waiting) })
		case strings.Contains(r.Message, "cgroup that is not this agent's"):
			once.Do(func() {
				go func() {
					unlock, err := ta.lockRestore(t.Context(), id, "restore")
					if err == nil {
						t.Cleanup(unlock)
					}
					granted <- err
				}()
				select {
				case err := <-granted:
					inRelease = true
					granted <- err
				case <-waiting:
				case <-time.After(failAfter):
					t.Error("the restore neither got the job nor waited for it")
				}
			})
		}
	}})
	ta.finish(j, JobExited, &shim.ExitStatus{Code: 0})
	if inRelease {
		t.Error("a restore of the job got it while its ended copy's release, by the job's id and names, was under way")
	}
	select {
	case err := <-granted:
		if err != nil {
			t.Errorf("a restore once the ended copy's release was done: %v", err)
		}
	case <-time.After(failAfter):
		t.Fatal("a restore waiting for the ended copy's release did not go on once it was done")
	}
}
