package agent

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

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
