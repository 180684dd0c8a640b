package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
)

func TestCheckPeerJob(t *testing.T) {
	l := jobLayout{jobsDir: "/var/lib/ftkit/jobs", cgroupParent: "/sys/fs/cgroup/ftkit"}
	const id = "count-0123abcd"
	dir := "/var/lib/ftkit/jobs/" + id
	good := func() (*ckpt.Manifest, *Job) {
		m := &ckpt.Manifest{Job: id, ID: "snap-1"}
		m.OpenFiles = []ckpt.OpenFile{
			{Path: dir + "/stdout", Size: 10}, {Path: dir + "/stderr", Size: 0}, {Path: "/home/u/out.log", Size: 5},
		}
		return m, &Job{ID: id, UID: 65534, GID: 65534, Dir: dir, Cgroup: "/sys/fs/cgroup/ftkit/" + id}
	}
	tests := []struct {
		name   string
		change func(*ckpt.Manifest, *Job)
		want   string // "" accepts; else a part of the error
	}{
		{"valid", func(*ckpt.Manifest, *Job) {}, ""},
		{"root job", func(_ *ckpt.Manifest, j *Job) { j.UID, j.GID = 0, 0 }, ""},
		{"manifest job not an id", func(m *ckpt.Manifest, j *Job) { m.Job, j.ID = "../../etc", "../../etc" },
			`manifest field "job" is "../../etc"`},
		{"id differs from the manifest's", func(_ *ckpt.Manifest, j *Job) { j.ID = "other-0123abcd" },
			`job record field "id" is "other-0123abcd", want "count-0123abcd" (the manifest's job)`},
		{"id with a path", func(_ *ckpt.Manifest, j *Job) { j.ID = "../count-0123abcd" }, `field "id"`},
		{"dir elsewhere", func(_ *ckpt.Manifest, j *Job) { j.Dir = "/etc" },
			`snapshot snap-1: job record field "dir" is "/etc", want "/var/lib/ftkit/jobs/count-0123abcd"`},
		{"dir of another job", func(_ *ckpt.Manifest, j *Job) { j.Dir = "/var/lib/ftkit/jobs/x-00000000" }, `field "dir"`},
		{"dir unclean", func(_ *ckpt.Manifest, j *Job) { j.Dir = dir + "/." }, `field "dir"`},
		// The record's cgroup is never used: it becomes this agent's (another cgroup_parent, or a forged path).
		{"cgroup of another node's parent", func(_ *ckpt.Manifest, j *Job) { j.Cgroup = "/sys/fs/cgroup/other/" + id }, ""},
		{"cgroup elsewhere", func(_ *ckpt.Manifest, j *Job) { j.Cgroup = "/sys/fs/cgroup" }, ""},
		{"uid -1", func(_ *ckpt.Manifest, j *Job) { j.UID = noID }, `field "uid" is "4294967295"`},
		{"gid -1", func(_ *ckpt.Manifest, j *Job) { j.GID = noID }, `field "gid" is "4294967295"`},
		{"open file relative", func(m *ckpt.Manifest, _ *Job) { m.OpenFiles[2].Path = "home/u/out.log" },
			`manifest field "open_files[2].path" is "home/u/out.log", want an absolute, clean path`},
		{"open file unclean", func(m *ckpt.Manifest, _ *Job) { m.OpenFiles[0].Path = dir + "/../x-00000000/stdout" },
			`"open_files[0].path"`},
		{"open file is the exit record", func(m *ckpt.Manifest, _ *Job) { m.OpenFiles[1].Path = dir + "/exit" },
			`"open_files[1].path" is "` + dir + `/exit", inside the job directory but not stdout or stderr`},
		{"open file in a subdirectory", func(m *ckpt.Manifest, _ *Job) { m.OpenFiles[0].Path = dir + "/sub/stdout" },
			`"open_files[0].path"`},
		{"open file is the job directory", func(m *ckpt.Manifest, _ *Job) { m.OpenFiles[0].Path = dir }, `"open_files[0].path"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, j := good()
			tc.change(m, j)
			err := checkPeerJob(l, m, j)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && err == nil:
				t.Fatalf("accepted; want an error with %q", tc.want)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("error %q\ndoes not contain %q", err, tc.want)
			case err == nil && j.Cgroup != l.cgroup(id):
				t.Fatalf("accepted with cgroup %q; want this agent's %q", j.Cgroup, l.cgroup(id))
			}
		})
	}
}

func TestOutputName(t *testing.T) {
	l := jobLayout{jobsDir: "/j"}
	for _, tc := range []struct {
		path, name string
		inside     bool
	}{
		{"/j/a-00000000/stdout", "stdout", true},
		{"/j/a-00000000/stderr", "stderr", true},
		{"/j/a-00000000/exit", "", true},
		{"/j/a-00000000", "", true},
		{"/j/a-00000000/x/stdout", "", true},
		{"/j/a-000000001/stdout", "", false}, // a sibling whose name starts the same
		{"/home/u/out", "", false},
	} {
		name, inside := l.outputName("a-00000000", tc.path)
		if name != tc.name || inside != tc.inside {
			t.Errorf("outputName(%s) = %q, %v; want %q, %v", tc.path, name, inside, tc.name, tc.inside)
		}
	}
}

func TestPlacementValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    *Placement
		ok   bool
	}{
		{"none", nil, true},
		{"hosts and spares", &Placement{Hosts: []string{"node1", "node2"}, Spares: []string{"node3"}}, true},
		{"no hosts", &Placement{Spares: []string{"node3"}}, false},
		{"repeated host", &Placement{Hosts: []string{"node1", "node1"}}, false},
		{"spare also a host", &Placement{Hosts: []string{"node1", "node2"}, Spares: []string{"node2"}}, false},
		{"bad name", &Placement{Hosts: []string{"../etc"}}, false},
		{"too many", &Placement{Hosts: manyHosts(MaxPlacementHosts + 1)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.p.Validate(); (err == nil) != tc.ok {
				t.Fatalf("Validate(%+v) = %v, want ok=%v", tc.p, err, tc.ok)
			}
		})
	}
}

func manyHosts(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("node%d", i+1)
	}
	return out
}

// TestStartJobKillsWhatItCannotRecord: a job whose record cannot be saved once its shim runs (a full state
// directory) is killed, and StartJob says so. Before, StartJob reported a failure and the job ran on, in
// no record: unwatched, unprotected, its address handed out again.
func TestStartJobKillsWhatItCannotRecord(t *testing.T) {
	ta := newTestAgent(t)
	stop, pidFile := filepath.Join(ta.dir, "stop"), filepath.Join(ta.dir, "shim.pid")
	t.Cleanup(func() {
		// Until the fake shim has gone: the test's directory, and the stop file in it, go next.
		os.WriteFile(stop, nil, 0o600)
		b, _ := os.ReadFile(pidFile)
		for deadline := time.Now().Add(failAfter); len(b) > 0; time.Sleep(20 * time.Millisecond) {
			if _, err := os.Stat("/proc/" + strings.TrimSpace(string(b))); err != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("fake shim %s did not stop", b)
				break
			}
		}
	})
	// The fake shim makes the record's path a directory, so that the save fails, gives the job's cgroup
	// its cgroup.kill as the kernel does, reports a pid, and waits.
	script := "#!/bin/sh\nid=$(sed -n 's/.*\"job_id\":\"\\([^\"]*\\)\".*/\\1/p')\n" +
		"mkdir -p '" + ta.jobs.dir + "'/\"$id\".json/blocker\n: > '" + ta.cfg.CgroupParent + "'/\"$id\"/cgroup.kill\n" +
		"echo $$ > '" + pidFile + "'\necho '{\"pid\": 4242}'\n" +
		"while [ ! -e '" + stop + "' ]; do sleep 0.05; done\n"
	shimPath := filepath.Join(ta.dir, "fake-shim")
	if err := os.WriteFile(shimPath, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.self = shimPath
	_, err := ta.StartJob(t.Context(), JobSpec{Name: "orphan", Argv: []string{"/bin/true"}}, 0, 0)
	if err == nil || !strings.Contains(err.Error(), "the job was killed") {
		t.Fatalf("StartJob: %v; want its record's failure, saying the job was killed", err)
	}
	cgs, _ := filepath.Glob(filepath.Join(ta.cfg.CgroupParent, "orphan-*"))
	if len(cgs) != 1 {
		t.Fatalf("job cgroups %v, want one", cgs)
	}
	id := filepath.Base(cgs[0])
	if b, _ := os.ReadFile(filepath.Join(cgs[0], "cgroup.kill")); string(b) != "1" {
		t.Errorf("cgroup.kill of %s holds %q, want 1: the job runs on in no record", id, b)
	}
	if _, err := os.Lstat(ta.supersededMark(id, 0)); err != nil {
		t.Errorf("the killed copy was not marked superseded (its shim would record the kill as the job's end): %v", err)
	}
	if _, _, err := ta.Job(id, 0); err == nil {
		t.Errorf("job %s is listed", id)
	}
}

// TestStartJobKillsWhatItCannotLaunch: when the shim's report does not come (the client went away, so the
// request's context ended, or the shim died), the job's init may already run in the job's cgroup: the shim
// starts it before it reports, and Launch kills only the shim, not the init that is its child in a PID
// namespace of its own. StartJob then forgets the job, so whatever runs in its cgroup is killed: it would
// run on in no record, unwatched and unprotected, its cgroup never removed.
func TestStartJobKillsWhatItCannotLaunch(t *testing.T) {
	ta := newTestAgent(t)
	stop, pidFile := filepath.Join(ta.dir, "stop"), filepath.Join(ta.dir, "shim.pid")
	t.Cleanup(func() { os.WriteFile(stop, nil, 0o600) })
	// The fake shim has started the job (the cgroup has its cgroup.kill, as the kernel gives every cgroup),
	// and dies or is killed before it reports.
	script := "#!/bin/sh\nid=$(sed -n 's/.*\"job_id\":\"\\([^\"]*\\)\".*/\\1/p')\n" +
		": > '" + ta.cfg.CgroupParent + "'/\"$id\"/cgroup.kill\n" +
		"echo $$ > '" + pidFile + "'\n" +
		"while [ ! -e '" + stop + "' ]; do sleep 0.05; done\n"
	shimPath := filepath.Join(ta.dir, "fake-shim")
	if err := os.WriteFile(shimPath, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.self = shimPath
	ctx, cancel := context.WithCancel(t.Context())
	go func() { // the client goes away once the job runs
		for deadline := time.Now().Add(failAfter); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if _, err := os.Stat(pidFile); err == nil {
				break
			}
		}
		cancel()
	}()
	if _, err := ta.StartJob(ctx, JobSpec{Name: "gone", Argv: []string{"/bin/true"}}, 1000, 1000); err == nil {
		t.Fatal("StartJob succeeded without the shim's report")
	}
	cgs, _ := filepath.Glob(filepath.Join(ta.cfg.CgroupParent, "gone-*"))
	if len(cgs) != 1 {
		t.Fatalf("job cgroups %v, want one", cgs)
	}
	if b, _ := os.ReadFile(filepath.Join(cgs[0], "cgroup.kill")); string(b) != "1" {
		t.Errorf("cgroup.kill of %s holds %q, want 1: the job runs on in no record", filepath.Base(cgs[0]), b)
	}
}

// TestStartJobBoundsLocalSpec: a local caller's spec gets the bounds a member's start-job request gets,
// before anything is created for it. The old code took a relative or unclean working directory and any
// number of arguments up to the API's 1 MiB body from a local user, into a record every snapshot carries.
func TestStartJobBoundsLocalSpec(t *testing.T) {
	ta := newTestAgent(t)
	many := make([]string, clusterapi.MaxStartJobArgs+1)
	for i := range many {
		many[i] = "x"
	}
	for _, tt := range []struct {
		name string
		spec JobSpec
		want string
	}{
		{"relative working directory", JobSpec{Name: "rel", Argv: []string{"/bin/true"}, Dir: "work"}, "not an absolute, clean path"},
		{"unclean working directory", JobSpec{Name: "unclean", Argv: []string{"/bin/true"}, Dir: "/tmp/../etc"}, "not an absolute, clean path"},
		{"too many arguments", JobSpec{Name: "many", Argv: many}, "at most 4096"},
		{"too many bytes", JobSpec{Name: "big", Argv: []string{"/bin/true"}, Env: []string{"A=" + strings.Repeat("a", clusterapi.MaxStartJobBytes)}}, "bytes of arguments and environment"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ta.StartJob(t.Context(), tt.spec, 1000, 1000)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("StartJob = %v, want an error with %q", err, tt.want)
			}
			if cgs, _ := filepath.Glob(filepath.Join(ta.cfg.CgroupParent, tt.spec.Name+"-*")); len(cgs) != 0 {
				t.Errorf("job cgroups %v made for a refused spec", cgs)
			}
		})
	}
}

// TestStartJobBoundsJobsPerUser: a user other than root runs at most checkpoint.max_jobs_per_user jobs on a
// host, counting its starts in progress; ended jobs, other users' and root's do not count, and root is never
// bounded.
func TestStartJobBoundsJobsPerUser(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.MaxJobsPerUser = 3
	ta.mu.Lock()
	for i, st := range []JobState{JobRunning, JobRunning, JobExited} {
		id := fmt.Sprintf("mine-%d", i)
		ta.byID[id] = &Job{ID: id, UID: 3000, State: st}
	}
	ta.byID["other"] = &Job{ID: "other", UID: 4000, State: JobRunning}
	ta.mu.Unlock()

	release, err := ta.admit(3000) // the third: a start in progress
	if err != nil {
		t.Fatalf("uid 3000's third job refused: %v", err)
	}
	requireStarts(t, ta, []startRow{
		{"a fourth job of uid 3000", 3000, "uid 3000 already runs 3 jobs on node1"},
		{"a job of another user", 4000, "no-shim"},
		{"a job of root", 0, "no-shim"},
	})
	release()
	if release, err := ta.admit(3000); err != nil {
		t.Errorf("uid 3000's third job refused after the start in progress ended: %v", err)
	} else {
		release()
	}
	if len(ta.starting) != 0 {
		t.Errorf("starts in progress left counted: %v", ta.starting)
	}
}

// TestStartJobBoundsEndedJobsPerUser: the records of a user's ended jobs stay for checkpoint.keep_ended (a
// day), each with its spec of up to clusterapi.MaxStartJobBytes of arguments and environment, in the
// agent's memory and its state directory. Ended jobs leave max_jobs_per_user free, so a user starting a
// program that exits at once in a loop would make root keep records without bound: past
// maxEndedJobsPerUser ended records of its own, a user's start is refused; other users and root are not.
func TestStartJobBoundsEndedJobsPerUser(t *testing.T) {
	ta := newTestAgent(t)
	ta.cfg.Checkpoint.MaxJobsPerUser = 3
	ta.mu.Lock()
	for i := range maxEndedJobsPerUser {
		id := fmt.Sprintf("ended-%d", i)
		ta.byID[id] = &Job{ID: id, UID: 3000, State: []JobState{JobExited, JobLost}[i%2]}
	}
	ta.byID["forgotten"] = &Job{ID: "forgotten", UID: 4000, State: JobExited, Forgotten: true}
	ta.mu.Unlock()
	requireStarts(t, ta, []startRow{
		{"uid 3000 past the bound", 3000, "keeps the records of 1024 ended jobs of uid 3000"},
		{"a job of another user", 4000, "no-shim"},
		{"a job of root", 0, "no-shim"},
	})
}

// startRow is a start by uid and what its error says: the bound's, or a later failure's (the test agent
// has no shim).
type startRow struct {
	name string
	uid  uint32
	want string
}

func requireStarts(t *testing.T, ta *testAgent, rows []startRow) {
	t.Helper()
	for _, tt := range rows {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ta.StartJob(t.Context(), JobSpec{Name: "bounded", Argv: []string{"/bin/true"}}, tt.uid, tt.uid)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("StartJob = %v, want an error with %q", err, tt.want)
			}
		})
	}
}

// TestJobStoreSkipsRecordsRootDidNotWrite: in the default layout the records directory is jobs_dir, which
// may be sticky and writable by users (--check-config accepts it). A record a user put there, or a link
// to a file of root's elsewhere, must not be adopted as root's: before, all loaded both, and adopt took a
// user's record naming any cgroup and PID (a root daemon's) for a job of theirs.
func TestJobStoreSkipsRecordsRootDidNotWrite(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (chown to a user)")
	}
	base := t.TempDir()
	s := jobStore{dir: filepath.Join(base, "jobs")}
	if err := os.Mkdir(s.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chmod(s.dir, 0o777|os.ModeSticky)
	if err := s.save(&Job{ID: "real-0000000a", Node: "n1", State: JobRunning}); err != nil {
		t.Fatal(err)
	}
	forged := []byte(`{"id":"forged-0000000b","node":"n1","state":"running","pid":1,"cgroup":"/sys/fs/cgroup/init.scope","uid":1000}`)
	if err := os.WriteFile(s.path("forged-0000000b"), forged, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(s.path("forged-0000000b"), 1000, 1000); err != nil {
		t.Fatal(err)
	}
	elsewhere := filepath.Join(base, "root-owned.json")
	if err := os.WriteFile(elsewhere, []byte(`{"id":"linked-0000000c","node":"n1","state":"running"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(elsewhere, s.path("linked-0000000c")); err != nil {
		t.Fatal(err)
	}
	jobs, err := s.all()
	var ids []string
	for _, j := range jobs {
		ids = append(ids, j.ID)
	}
	if len(ids) != 1 || ids[0] != "real-0000000a" {
		t.Errorf("all() loaded %v, want only real-0000000a (root's own record)", ids)
	}
	if err == nil || !strings.Contains(err.Error(), "forged-0000000b") || !strings.Contains(err.Error(), "linked-0000000c") {
		t.Errorf("all() error = %v, want one naming the records it skipped", err)
	}
}
