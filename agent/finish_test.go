package agent

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
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
	job := Job{ID: id, UID: 65534, GID: 65534, Dir: l.dir(id), Cgroup: l.cgroup(id), Node: "n0"}
	victim := filepath.Join(base, "victim")
	must(t, os.Mkdir(victim, 0o755))
	j := job
	j.Cgroup = victim
	a.finish(&j, JobExited, &shim.ExitStatus{})
	if _, err := os.Stat(victim); err != nil {
		t.Errorf("finish removed %s, which is not the job's cgroup here: %v", victim, err)
	}
	own := job
	must(t, os.MkdirAll(own.Cgroup, 0o755))
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
