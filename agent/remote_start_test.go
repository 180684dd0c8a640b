package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/restore/recovery"
	"github.com/ftkit/ftkit/shim"
)

// TestServeStartJobRefusals: a start-job request is refused before anything is created when its sender is
// not an alive member or the request is invalid (the server validates too; the agent does not rely on it).
func TestServeStartJobRefusals(t *testing.T) {
	ta := newTestAgent(t)
	valid := clusterapi.StartJobRequest{Name: "run-node1", Argv: []string{"/bin/true"}, Dir: "/", UID: 1000, GID: 1000,
		Placement: &clusterapi.StartJobPlacement{Hosts: []string{"node1", "node2"}}}
	with := func(change func(*clusterapi.StartJobRequest)) clusterapi.StartJobRequest {
		r := valid
		change(&r)
		return r
	}
	jobsBefore := len(ta.Jobs(0))
	dirsBefore, _ := os.ReadDir(ta.cfg.JobsDir)
	tests := []struct {
		name, peer string
		req        clusterapi.StartJobRequest
		want       string
	}{
		{"not a member", "intruder", valid, "not an alive member"},
		{"relative dir", "node2", with(func(r *clusterapi.StartJobRequest) { r.Dir = "tmp" }), "absolute"},
		{"oversize argv", "node2", with(func(r *clusterapi.StartJobRequest) {
			r.Argv = []string{strings.Repeat("x", clusterapi.MaxStartJobBytes+1)}
		}), "bytes"},
		{"bad placement", "node2", with(func(r *clusterapi.StartJobRequest) {
			r.Placement = &clusterapi.StartJobPlacement{Hosts: []string{"node1"}, Spares: []string{"node1"}}
		}), "twice"},
		// The request's job address reaches the job's start: this agent has no pool.
		{"job address without a pool", "node2", with(func(r *clusterapi.StartJobRequest) { r.JobAddress = true }), "hands out no job addresses"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ta.serveStartJob(t.Context(), tt.peer, tt.req)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("%v; want a refusal about %q", err, tt.want)
			}
		})
	}
	t.Run("a failed member", func(t *testing.T) {
		ta.failMember(t, "node2")
		if _, err := ta.serveStartJob(t.Context(), "node2", valid); err == nil || !strings.Contains(err.Error(), "not an alive member") {
			t.Fatalf("start-job from a failed member: %v", err)
		}
	})
	dirsAfter, _ := os.ReadDir(ta.cfg.JobsDir)
	if n := len(ta.Jobs(0)); n != jobsBefore || len(dirsAfter) != len(dirsBefore) {
		t.Errorf("refused requests created jobs: %d -> %d jobs, %d -> %d job directories", jobsBefore, n, len(dirsBefore), len(dirsAfter))
	}
}

// admissionFixture is a test agent whose cluster.start_job_command is a fake site command: it records each
// run's arguments (one line) in record and admits uid 1000 only; uid 3000 hangs (a squeue that gets no
// answer). The agent's shim is a fake too, which records that it was launched in launched and reports
// nothing (the start then fails, after the admission: what matters is whether it was reached).
type admissionFixture struct {
	*testAgent
	record, launched string
}

func newAdmissionFixture(t *testing.T) admissionFixture {
	t.Helper()
	ta := newTestAgent(t)
	f := admissionFixture{testAgent: ta, record: filepath.Join(ta.dir, "admission.record"), launched: filepath.Join(ta.dir, "shim.launched")}
	cmd := filepath.Join(ta.dir, "ftkit-start-job-test")
	script := "#!/bin/sh\necho \"$*\" >> '" + f.record + "'\n" +
		"case \"$1\" in\n1000) exit 0 ;;\n3000) exec sleep 60 ;;\nesac\n" +
		"echo \"uid $1 has no running Slurm job on $3\" >&2\necho 'a second line nobody is shown' >&2\nexit 1\n"
	if err := os.WriteFile(cmd, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	shimPath := filepath.Join(ta.dir, "fake-shim")
	if err := os.WriteFile(shimPath, []byte("#!/bin/sh\necho launched >> '"+f.launched+"'\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	ta.self = shimPath
	ta.cfg.Cluster.StartJobCommand = []string{cmd, "{uid}", "{gid}", "{host}", "{peer}", "{slurm_job_id}"}
	ta.cfg.Cluster.StartJobCommandTimeout.Duration = time.Minute
	return f
}

// runs is the arguments of every run of the start-job command so far.
func (f admissionFixture) runs(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(f.record)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
}

// launches is how many times the agent launched a shim so far.
func (f admissionFixture) launches() int {
	b, _ := os.ReadFile(f.launched)
	return strings.Count(string(b), "launched")
}

// created lists the job directories and cgroups the agent has made.
func (f admissionFixture) created() []string {
	dirs, _ := filepath.Glob(filepath.Join(f.cfg.JobsDir, "*"))
	cgs, _ := filepath.Glob(filepath.Join(f.cfg.CgroupParent, "*"))
	return append(dirs, cgs...)
}

// TestServeStartJobAdmission: with cluster.start_job_command set, a job another member forwards is started
// only if the command, told who asks for what, exits 0. A refusal is a clean cluster error (refused) naming
// the user, this host and the first line of the command's standard error, and starts nothing: no shim, no
// job directory, no cgroup, no record. Root is asked about like anyone. A SLURM_JOB_ID that is no number
// is refused before the command runs; the command sees the first one of the environment, as the job would.
// Before, nothing asked: any user of one member started processes as themselves on every member.
func TestServeStartJobAdmission(t *testing.T) {
	valid := clusterapi.StartJobRequest{Name: "run-node1", Argv: []string{"/bin/true"}, Dir: "/", UID: 1000, GID: 1000,
		Placement: &clusterapi.StartJobPlacement{Hosts: []string{"node1", "node2"}}}
	tests := []struct {
		name    string
		uid     uint32
		env     []string
		timeout time.Duration // 0: a minute
		unset   bool          // no start_job_command
		open    bool          // the command's program writable by all
		run     string        // the command's arguments; "": not run
		refusal []string      // what the refusal says; nil: admitted
	}{
		{name: "admitted, no Slurm job id", uid: 1000, run: "1000 1000 node1 node2 "},
		{name: "admitted with a Slurm job id", uid: 1000, env: []string{"HOME=/home/u", "SLURM_JOB_ID=4242"}, run: "1000 1000 node1 node2 4242"},
		{name: "the first Slurm job id, as the job's getenv reads it", uid: 1000, env: []string{"SLURM_JOB_ID=17", "SLURM_JOB_ID=4242"}, run: "1000 1000 node1 node2 17"},
		{name: "refused", uid: 2000, env: []string{"SLURM_JOB_ID=4242"}, run: "2000 2000 node1 node2 4242",
			refusal: []string{"(refused)", "start-job from node2: uid 2000 (gid 2000) may not start jobs on node1", "exited with status 1", ": uid 2000 has no running Slurm job on node1"}},
		{name: "root is asked too", uid: 0, run: "0 0 node1 node2 ",
			refusal: []string{"uid 0 (gid 0) may not start jobs on node1", "uid 0 has no running Slurm job on node1"}},
		{name: "a Slurm job id that is no number", uid: 1000, env: []string{"SLURM_JOB_ID=-x;/etc/passwd"},
			refusal: []string{"uid 1000 (gid 1000) may not start jobs on node1", `SLURM_JOB_ID "-x;/etc/passwd" in the job's environment is no Slurm job id`}},
		{name: "an empty Slurm job id", uid: 1000, env: []string{"SLURM_JOB_ID="}, refusal: []string{"is no Slurm job id"}},
		{name: "the command times out", uid: 3000, timeout: 300 * time.Millisecond, run: "3000 3000 node1 node2 ",
			refusal: []string{"uid 3000 (gid 3000) may not start jobs on node1", "failed: timed out after 300ms", "(start_job_command_timeout)"}},
		{name: "no command: every forwarded start goes ahead", uid: 2000, unset: true},
		{name: "a program others may change is not run", uid: 1000, open: true,
			refusal: []string{"uid 1000 (gid 1000) may not start jobs on node1", "failed: not run: start-job command", "chmod go-w it"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newAdmissionFixture(t)
			if tt.unset {
				f.cfg.Cluster.StartJobCommand = nil
			}
			if tt.timeout > 0 {
				f.cfg.Cluster.StartJobCommandTimeout.Duration = tt.timeout
			}
			if tt.open {
				if err := os.Chmod(f.cfg.Cluster.StartJobCommand[0], 0o777); err != nil {
					t.Fatal(err)
				}
			}
			req := valid
			req.UID, req.GID, req.Env = tt.uid, tt.uid, tt.env
			jobsBefore, createdBefore := len(f.Jobs(0)), f.created()
			_, err := f.serveStartJob(t.Context(), "node2", req)
			if runs := f.runs(t); tt.run == "" && len(runs) != 0 || tt.run != "" && (len(runs) != 1 || runs[0] != tt.run) {
				t.Errorf("the start-job command ran with %q; want %q", runs, tt.run)
			}
			if tt.refusal == nil {
				// Admitted: the start went on to the shim (whose failure is the fake's).
				if e, ok := errors.AsType[*clusterapi.Error](err); ok && e.Code == clusterapi.CodeRefused {
					t.Fatalf("refused: %v", err)
				}
				if n := f.launches(); n != 1 {
					t.Errorf("the shim was launched %d times; want once", n)
				}
				return
			}
			e, ok := errors.AsType[*clusterapi.Error](err)
			if !ok || e.Code != clusterapi.CodeRefused {
				t.Fatalf("serveStartJob = %v; want a cluster error with code %s", err, clusterapi.CodeRefused)
			}
			for _, want := range tt.refusal {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("refusal %q does not say %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "second line") {
				t.Errorf("refusal %q holds more than the first line of the command's standard error", err)
			}
			if n, created := f.launches(), f.created(); n != 0 || !slices.Equal(created, createdBefore) || len(f.Jobs(0)) != jobsBefore {
				t.Errorf("a refused start launched %d shims, made %v (before: %v), %d -> %d jobs", n, created, createdBefore, jobsBefore, len(f.Jobs(0)))
			}
		})
	}
}

// TestStartJobOnHereSkipsAdmission: a job started on the agent's own host (StartJobOn with its name or
// none, as ftctl mpirun does for the run's first host, and ftwrap) never runs the start-job command: its
// user can run processes on this host anyway. A user it would refuse on a forwarded start still starts.
func TestStartJobOnHereSkipsAdmission(t *testing.T) {
	f := newAdmissionFixture(t)
	for _, host := range []string{"", "node1"} {
		_, err := f.StartJobOn(t.Context(), host, JobSpec{Name: "local", Argv: []string{"/bin/true"}, Env: []string{"SLURM_JOB_ID=x"}}, 2000, 2000)
		if e, ok := errors.AsType[*clusterapi.Error](err); ok && e.Code == clusterapi.CodeRefused {
			t.Fatalf("StartJobOn(%q) refused: %v", host, err)
		}
	}
	if runs := f.runs(t); len(runs) != 0 {
		t.Errorf("local starts ran the start-job command: %q", runs)
	}
	if n := f.launches(); n != 2 {
		t.Errorf("the shim was launched %d times for 2 local starts", n)
	}
}

// TestRefusalReasonLine: what of the command's standard error a user is shown is its first non-blank line,
// bounded, with no control characters (a terminal escape, a carriage return).
func TestRefusalReasonLine(t *testing.T) {
	long := strings.Repeat("é", maxRefusalReason)
	for _, tt := range []struct{ name, stderr, want string }{
		{"none", "", ""},
		{"first line", "no job here\nmore\n", "no job here"},
		{"blank lines first", "\n  \n\tno job here  \n", "no job here"},
		{"control characters", "no\x1b[31m job\r here\n", "no [31m job  here"},
		{"bounded on a character", long, strings.Repeat("é", maxRefusalReason/2) + "..."},
		{"invalid UTF-8", "no \xff job", "no ? job"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := firstLine(tt.stderr); got != tt.want {
				t.Errorf("firstLine(%q) = %q, want %q", tt.stderr, got, tt.want)
			}
		})
	}
}

// TestRestoreAdmitsPlacedHost: a fail-over restores a job on a host its placement names (a run's spare, a
// host its run's protector stands on) only if the start-job command admits the job's user there, as a
// forwarded start would be: the placement is the user's, and a user who named other users' idle nodes as
// their run's spares had their job restored there with no admission. A host the placement does not name
// (a ring spare, the ring's protector) restores as before, as does a migration (root's).
func TestRestoreAdmitsPlacedHost(t *testing.T) {
	placed := &Placement{Hosts: []string{"node2", "node3"}, Spares: []string{"node1"}}
	tests := []struct {
		name      string
		uid       uint32
		placement *Placement
		by        string // "": a migration
		run       string // the command's arguments; "": not run
		refused   bool
	}{
		{name: "a run's spare, user not admitted", uid: 2000, placement: placed, by: "node3", run: "2000 2000 node1 node3 4242", refused: true},
		{name: "a run's spare, user admitted", uid: 1000, placement: placed, by: "node3", run: "1000 1000 node1 node3 4242"},
		{name: "a host of the run", uid: 2000, placement: &Placement{Hosts: []string{"node2", "node1"}}, by: "node3", run: "2000 2000 node1 node3 4242", refused: true},
		{name: "a host the placement does not name", uid: 2000, placement: &Placement{Hosts: []string{"node2", "node3"}}, by: "node3"},
		{name: "no placement", uid: 2000, by: "node3"},
		{name: "a migration", uid: 2000, placement: placed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newAdmissionFixture(t)
			const id = "placed-00000001"
			snap := f.addSnapshot(t, Job{ID: id, UID: tt.uid, GID: tt.uid, Node: "node2",
				Spec: JobSpec{Argv: []string{"x"}, Env: []string{"SLURM_JOB_ID=4242"}, Placement: tt.placement}})
			act := &recoveryActions{a: f.Agent, records: map[*recovery.Job]Job{}, fenced: "node2", by: tt.by}
			j, err := act.Fetch(t.Context(), id, clusterapi.Candidate{Snapshot: snap})
			if err == nil {
				criu.RemoveWorkDir(j.Work)
			}
			if runs := f.runs(t); tt.run == "" && len(runs) != 0 || tt.run != "" && (len(runs) != 1 || runs[0] != tt.run) {
				t.Errorf("the start-job command ran with %q; want %q", runs, tt.run)
			}
			if tt.refused {
				if err == nil || !strings.Contains(err.Error(), "may not start jobs") || !strings.Contains(err.Error(), "has no running Slurm job on node1") {
					t.Fatalf("Fetch = %v; want a refusal naming the start-job command's reason", err)
				}
				return
			}
			// Admitted: the fetch went on to the images (the fixture's are no CRIU dump's).
			if err != nil && strings.Contains(err.Error(), "may not start jobs") {
				t.Fatalf("Fetch refused the restore: %v", err)
			}
		})
	}
}

// TestJobSpecUmaskReachesTheShim: the umask of the program that asked for a job reaches the job's shim,
// on this host (StartJobOn) and on another member (a forwarded start-job request); nil stays nil (the shim
// then gives 022). Dropped on the way, the job ran with the agent's own UMask=0077.
func TestJobSpecUmaskReachesTheShim(t *testing.T) {
	umask := func(m uint32) *uint32 { return &m }
	for _, tc := range []struct {
		name  string
		umask *uint32
	}{{"the caller's", umask(0o027)}, {"none masked", umask(0)}, {"none read", nil}} {
		for _, forwarded := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/forwarded=%v", tc.name, forwarded), func(t *testing.T) {
				ta := newTestAgent(t)
				spec := filepath.Join(ta.dir, "shim.spec")
				shimPath := filepath.Join(ta.dir, "fake-shim")
				if err := os.WriteFile(shimPath, []byte("#!/bin/sh\ncat > '"+spec+"'\nexit 1\n"), 0o755); err != nil {
					t.Fatal(err)
				}
				ta.self = shimPath
				if forwarded {
					req := startRequest(JobSpec{Name: "fwd", Argv: []string{"/bin/true"}, Umask: tc.umask}, 1000, 1000)
					b, err := json.Marshal(req) // over the wire
					if err != nil {
						t.Fatal(err)
					}
					var got clusterapi.StartJobRequest
					if err := json.Unmarshal(b, &got); err != nil {
						t.Fatal(err)
					}
					ta.serveStartJob(t.Context(), "node2", got) // the fake shim reports nothing: the start fails
				} else {
					ta.StartJobOn(t.Context(), "", JobSpec{Name: "local", Argv: []string{"/bin/true"}, Umask: tc.umask}, 1000, 1000)
				}
				b, err := os.ReadFile(spec)
				if err != nil {
					t.Fatalf("the shim was not launched: %v", err)
				}
				var s shim.Spec
				if err := json.Unmarshal(b, &s); err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(s.Umask, tc.umask) {
					t.Errorf("the shim got umask %s, want %s", fmtUmask(s.Umask), fmtUmask(tc.umask))
				}
			})
		}
	}
}

func fmtUmask(m *uint32) string {
	if m == nil {
		return "none"
	}
	return fmt.Sprintf("%04o", *m)
}
