package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"github.com/ftkit/ftkit/agentconfig"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/interval"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/shim"
)

// The local API is tested on a minimal Agent: no root, no CRIU, no eBPF. Callers are injected the way
// the server does it from SO_PEERCRED (withCaller); the work that needs the real system (a dump, a
// restore) is made to fail at a known later step, so a test can tell "refused" from "allowed, then
// failed for another reason".

var (
	asRoot  = &unix.Ucred{Uid: 0, Gid: 0, Pid: 1}
	asOwner = &unix.Ucred{Uid: 1000, Gid: 1000, Pid: 2}
	asOther = &unix.Ucred{Uid: 2000, Gid: 2000, Pid: 3}
)

// Jobs of the test agent: the owner's running job, root's running job, and the owner's exited job.
const (
	ownersJob = "mine-00000001"
	rootsJob  = "roots-00000001"
	doneJob   = "done-00000001"
	goneJob   = "gone-00000001" // not on this host, but the store holds its snapshot (a protector's replica)
	theirJob  = "theirs-00000001"
)

type testAgent struct {
	*Agent
	dir      string
	ownSnap  string // snapshot of ownersJob
	goneSnap string // snapshot of goneJob
}

// failMember has this agent adopt a view in which member name failed. Failing node2, the only other node,
// leaves this agent the one member that grants incarnations.
func (ta *testAgent) failMember(t *testing.T, name string) {
	t.Helper()
	v, err := ta.View().Fail(name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ta.adoptView(v); err != nil {
		t.Fatal(err)
	}
}

func newTestAgent(t *testing.T) *testAgent {
	t.Helper()
	dir := t.TempDir()
	cfg := agentconfig.Defaults()
	cfg.Name = "node1"
	cfg.StateDir = dir
	cfg.JobsDir = filepath.Join(dir, "jobdirs")
	cfg.CgroupParent = filepath.Join(dir, "cgroups")
	cfg.Socket = filepath.Join(dir, "agent.sock")
	// Loopback addresses nobody listens on: no test here reaches a peer.
	cfg.Cluster.Members = []Member{{Name: "node1", Address: netip.MustParseAddrPort("127.0.0.1:1"), Role: RoleNode},
		{Name: "node2", Address: netip.MustParseAddrPort("127.0.0.2:1"), Role: RoleNode}}
	a := &Agent{
		cfg: cfg, log: slog.New(slog.DiscardHandler),
		// Any dump or restore fails at its start: these binaries do not exist.
		criu: criu.Client{Binary: filepath.Join(dir, "no-criu")}, self: filepath.Join(dir, "no-shim"),
		jobs: jobStore{dir: filepath.Join(dir, "jobs")},
		byID: map[string]*Job{}, policies: map[string]*interval.Policy{}, changed: make(chan struct{}),
		replicaConns: map[string]replicaConns{}, beatNow: make(chan struct{}, 1),
	}
	for _, d := range []string{a.jobs.dir, cfg.JobsDir, cfg.CgroupParent} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.loadView(); err != nil {
		t.Fatal(err)
	}
	var err error
	if a.failures, err = failurelog.Open(dir, cfg.Name); err != nil {
		t.Fatal(err)
	}
	if a.store, err = ckpt.Open(filepath.Join(dir, "snapshots"), ckpt.Options{Node: cfg.Name}); err != nil {
		t.Fatal(err)
	}
	if a.grants, err = grant.Open(filepath.Join(dir, "grants.json"), grant.Options{}); err != nil {
		t.Fatal(err)
	}
	ta := &testAgent{Agent: a, dir: dir}
	ta.addJob(t, Job{ID: ownersJob, UID: asOwner.Uid, GID: asOwner.Gid, State: JobRunning, PID: os.Getpid()})
	ta.addJob(t, Job{ID: rootsJob, UID: 0, GID: 0, State: JobRunning, PID: os.Getpid()})
	ta.addJob(t, Job{ID: doneJob, UID: asOwner.Uid, GID: asOwner.Gid, State: JobExited, Exit: &shim.ExitStatus{Code: 0}})
	ta.ownSnap = ta.addSnapshot(t, Job{ID: ownersJob, UID: asOwner.Uid, GID: asOwner.Gid, Node: cfg.Name})
	ta.goneSnap = ta.addSnapshot(t, Job{ID: goneJob, UID: asOwner.Uid, GID: asOwner.Gid, Node: "node2"})
	ta.addSnapshot(t, Job{ID: rootsJob, UID: 0, GID: 0, Node: cfg.Name})
	return ta
}

// addJob records a job the way StartJob does, with a cgroup directory of its own.
func (ta *testAgent) addJob(t *testing.T, j Job) *Job {
	t.Helper()
	j.Node = ta.cfg.Name
	j.Created = time.Now().UTC()
	j.Cgroup = filepath.Join(ta.cfg.CgroupParent, j.ID)
	j.Dir = filepath.Join(ta.cfg.JobsDir, j.ID)
	j.Spec.Argv = []string{"test"}
	if err := os.MkdirAll(j.Cgroup, 0o755); err != nil {
		t.Fatal(err)
	}
	ta.setProcs(t, &j, j.PID)
	ta.mu.Lock()
	ta.byID[j.ID] = &j
	ta.notify()
	ta.mu.Unlock()
	return &j
}

// setProcs writes the job's fake cgroup.procs, as the kernel lists the processes of a cgroup.
func (ta *testAgent) setProcs(t *testing.T, j *Job, pids ...int) {
	t.Helper()
	var b strings.Builder
	for _, p := range pids {
		b.WriteString(strconv.Itoa(p) + "\n")
	}
	if err := os.WriteFile(filepath.Join(j.Cgroup, "cgroup.procs"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// addSnapshot commits a snapshot carrying j's record, as the agent does after a dump.
func (ta *testAgent) addSnapshot(t *testing.T, j Job) string {
	t.Helper()
	return ta.addSnapshotImages(t, j, map[string][]byte{"core-1.img": []byte("not really an image")})
}

// addSnapshotImages is addSnapshot with these files as its CRIU images.
func (ta *testAgent) addSnapshotImages(t *testing.T, j Job, images map[string][]byte) string {
	t.Helper()
	p, err := ta.store.Begin(j.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(p.Dir(), snapImages), 0o700); err != nil {
		t.Fatal(err)
	}
	for name, b := range images {
		if err := os.WriteFile(filepath.Join(p.Dir(), snapImages, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// The layout a receiving agent checks (checkPeerJob): the same on every host.
	j.Dir = filepath.Join(ta.cfg.JobsDir, j.ID)
	j.Cgroup = filepath.Join(ta.cfg.CgroupParent, j.ID)
	b, _ := json.Marshal(j)
	if err := os.WriteFile(filepath.Join(p.Dir(), snapJob), b, 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := p.Commit(context.Background(), ckpt.Info{Mode: Uncoordinated})
	if err != nil {
		t.Fatal(err)
	}
	return m.ID
}

// failAfter bounds a test's wait; reaching it means the code under test did not act.
const failAfter = 20 * time.Second

func testFailures() []*Failure {
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	return []*Failure{
		{ID: "node2-1", Node: "node2", Protector: "node3", Target: "spare1", Detected: t0, Updated: t0,
			Jobs: []string{goneJob, theirJob}, Done: true, Error: "job " + theirJob + ": no replica on node3",
			Stages: []Stage{
				{Name: StageDetected, Host: "node3", Detail: "no heartbeat for 3s"},
				{Name: StageClaimed, Host: "node3", Detail: "2 job(s), 800 MB", Error: "spare1 slow"},
				{Name: StageRestored, Job: goneJob, Host: "spare1", Detail: "pid 7"},
				{Name: StageRestored, Job: theirJob, Host: "spare1", Detail: "pid 8", Error: "criu: no"},
			}},
		{ID: "node4-1", Node: "node4", Protector: "node1", Target: "node1", Detected: t0.Add(time.Hour), Updated: t0,
			Jobs: []string{theirJob + "2"}, Stages: []Stage{{Name: StageDetected, Host: "node1"}}},
		{ID: "node5-1", Node: "node5", Protector: "node1", Target: "node1", Detected: t0.Add(2 * time.Hour), Updated: t0,
			Jobs: []string{ownersJob}, Error: "replay incomplete", Stages: []Stage{{Name: StageReplayed, Job: ownersJob, Host: "node1", Detail: "3 conns"}}},
		{ID: "node6-1", Node: "node6", Detected: t0.Add(3 * time.Hour), Updated: t0}, // no jobs
	}
}

func TestFailuresFor(t *testing.T) {
	all := testFailures()
	owns := func(job string) bool { return job == goneJob || job == ownersJob }
	got := failuresFor(all, owns)
	want := []*Failure{
		{ID: "node2-1", Node: "node2", Protector: "node3", Target: "spare1", Detected: all[0].Detected, Updated: all[0].Updated,
			Jobs: []string{goneJob}, Done: true, Error: "the recovery of some jobs failed or is incomplete; ask the administrator for details",
			Stages: []Stage{
				{Name: StageDetected, Host: "node3"},
				{Name: StageClaimed, Host: "node3"},
				{Name: StageRestored, Job: goneJob, Host: "spare1", Detail: "pid 7"},
			}},
		all[2],
	}
	gb, _ := json.MarshalIndent(got, "", " ")
	wb, _ := json.MarshalIndent(want, "", " ")
	if !bytes.Equal(gb, wb) {
		t.Errorf("got\n%s\nwant\n%s", gb, wb)
	}
	if !strings.Contains(all[0].Error, theirJob) || all[0].Stages[1].Detail == "" {
		t.Error("failuresFor changed its input")
	}
	if got := failuresFor(all, func(string) bool { return false }); got == nil || len(got) != 0 {
		t.Errorf("a uid without jobs sees %v, want an empty list", got)
	}
}

// failuresFor asks whether the caller owns a job once per job, however many failures and stages name it:
// for a job not running here the answer is read from disk (ownerOf).
func TestFailuresForAsksOncePerJob(t *testing.T) {
	all := testFailures()
	all = append(all, all[0], all[2]) // the same jobs again, as in a log of many failures
	asked := map[string]int{}
	failuresFor(all, func(job string) bool {
		asked[job]++
		return job == goneJob || job == ownersJob
	})
	for job, n := range asked {
		if n != 1 {
			t.Errorf("asked %d times whether the caller owns %s, want once", n, job)
		}
	}
}

// TestFailuresForClippedJobs: the failure log keeps at most failurelog.MaxJobs job ids per failure (and
// max_jobs_per_user is as many by default), so a list the caller owns whole may stand for a recovery of more
// jobs, other users' among them, which its error names. The old filter showed that error as it was to a
// user owning every listed job: other users' job ids, and why their recoveries failed.
func TestFailuresForClippedJobs(t *testing.T) {
	var mine []string
	for i := range failurelog.MaxJobs + 10 {
		mine = append(mine, "mine-"+strconv.Itoa(i))
	}
	for _, tt := range []struct {
		name      string
		jobs      []string // of the failure as recorded (clipped to MaxJobs)
		wantError bool     // the error shown as it is
	}{
		{"every job listed", mine[:3], true},
		{"list clipped", append(slices.Clone(mine[:failurelog.MaxJobs]), theirJob), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			log, err := failurelog.Open(t.TempDir(), "node3")
			if err != nil {
				t.Fatal(err)
			}
			log.Update("node2-1", func(f *Failure) {
				f.Node, f.Protector, f.Jobs, f.Done = "node2", "node3", tt.jobs, true
				f.Error = "job " + tt.jobs[len(tt.jobs)-1] + ": no replica on node3"
			})
			owns := func(job string) bool { return strings.HasPrefix(job, "mine-") }
			got := failuresFor(log.List(), owns)
			if len(got) != 1 {
				t.Fatalf("failures %v, want the one", got)
			}
			if shown := got[0].Error == log.List()[0].Error; shown != tt.wantError {
				t.Errorf("error %q shown to a user owning the %d jobs listed of %d: %v, want %v", got[0].Error, len(got[0].Jobs), len(tt.jobs), shown, tt.wantError)
			}
			if b, _ := json.Marshal(got); strings.Contains(string(b), theirJob) {
				t.Errorf("a user sees another user's job %s", theirJob)
			}
		})
	}
}

// What the tests of the local API (package agent_test, which serve agentapi over a test agent) may
// reach of the test agent.

type TestAgent = testAgent

const (
	OwnersJob = ownersJob
	RootsJob  = rootsJob
	DoneJob   = doneJob
	GoneJob   = goneJob
	TheirJob  = theirJob
)

var (
	AsRoot, AsOwner, AsOther = asRoot, asOwner, asOther
	TestFailures             = testFailures
)

func NewTestAgent(t *testing.T) *TestAgent            { return newTestAgent(t) }
func (ta *testAgent) AddJob(t *testing.T, j Job) *Job { return ta.addJob(t, j) }
func (ta *testAgent) Dir() string                     { return ta.dir }
func (ta *testAgent) StoreRoot() string               { return ta.store.Root() }
func (ta *testAgent) JobsDir() string                 { return ta.cfg.JobsDir }
func (ta *testAgent) OwnSnap() string                 { return ta.ownSnap }
func (ta *testAgent) GoneSnap() string                { return ta.goneSnap }
func (ta *testAgent) SetShim(path string)             { ta.self = path }
func (ta *testAgent) SetCheckpointFloor(d time.Duration) {
	ta.cfg.Checkpoint.MinInterval = Duration{Duration: d}
}
func (ta *testAgent) AddFailures(fs []*Failure) {
	for _, f := range fs {
		ta.failures.Update(f.ID, func(g *Failure) { *g = *f })
	}
}
