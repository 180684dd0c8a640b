package agentapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/ring"
)

// The API's mechanics are tested over a fake backend that applies the agent's visibility rule (root sees
// every job, another uid its own); what the real agent shows each uid is tested in agent/api_test.go.

var (
	asRoot  = &unix.Ucred{Uid: 0, Gid: 0, Pid: 1}
	asOwner = &unix.Ucred{Uid: 1000, Gid: 1000, Pid: 2}
	asOther = &unix.Ucred{Uid: 2000, Gid: 2000, Pid: 3}
)

// failAfter bounds a test's wait for the server; reaching it means the server did not act.
const failAfter = 20 * time.Second

type fakeBackend struct {
	dir     string
	mu      sync.Mutex
	jobs    map[string]*agent.Job
	changed chan struct{}
	// floor is CheckpointFloor (an hour if 0); checkpoint, if set, answers Checkpoint.
	floor      time.Duration
	checkpoint func(ctx context.Context, jobs []string, uid uint32) ([]agent.SnapshotResult, error)
	// passed lists the signals SignalElsewhere passed on, as "job uid signal host".
	passed []string
}

func newFakeBackend(t *testing.T) *fakeBackend {
	t.Helper()
	return &fakeBackend{dir: t.TempDir(), jobs: map[string]*agent.Job{}, changed: make(chan struct{})}
}

// addJob records a job with a job directory and a cgroup directory of its own, as the agent lays them out.
func (fb *fakeBackend) addJob(t *testing.T, j agent.Job) *agent.Job {
	t.Helper()
	j.Node = "node1"
	j.Created = time.Now().UTC()
	j.Cgroup = filepath.Join(fb.dir, "cgroups", j.ID)
	j.Dir = filepath.Join(fb.dir, "jobs", j.ID)
	for _, d := range []string{j.Cgroup, j.Dir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	fb.setProcs(t, &j, j.PID)
	fb.mu.Lock()
	fb.jobs[j.ID] = &j
	fb.notifyLocked()
	fb.mu.Unlock()
	return &j
}

// setProcs writes the job's fake cgroup.procs, as the kernel lists the processes of a cgroup.
func (fb *fakeBackend) setProcs(t *testing.T, j *agent.Job, pids ...int) {
	t.Helper()
	var b strings.Builder
	for _, p := range pids {
		b.WriteString(strconv.Itoa(p) + "\n")
	}
	if err := os.WriteFile(filepath.Join(j.Cgroup, "cgroup.procs"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// update changes a job and wakes the long polls, as the agent does.
func (fb *fakeBackend) update(id string, f func(*agent.Job)) {
	fb.mu.Lock()
	defer fb.mu.Unlock()
	f(fb.jobs[id])
	fb.notifyLocked()
}

func (fb *fakeBackend) notifyLocked() {
	close(fb.changed)
	fb.changed = make(chan struct{})
}

func (fb *fakeBackend) Status(uid uint32) agent.Status {
	return agent.Status{Node: "node1", Jobs: fb.Jobs(uid)}
}

func (fb *fakeBackend) Jobs(uid uint32) []agent.Job {
	fb.mu.Lock()
	defer fb.mu.Unlock()
	out := []agent.Job{}
	for _, j := range fb.jobs {
		if uid == 0 || j.UID == uid {
			out = append(out, *j)
		}
	}
	return out
}

func (fb *fakeBackend) Job(id string, uid uint32) (agent.Job, <-chan struct{}, error) {
	fb.mu.Lock()
	defer fb.mu.Unlock()
	j, ok := fb.jobs[id]
	if !ok || (uid != 0 && j.UID != uid) {
		return agent.Job{}, nil, fmt.Errorf("%w: %s on node1", agent.ErrNoJob, id)
	}
	return *j, fb.changed, nil
}

var errFake = errors.New("the fake backend does no real work")

func (fb *fakeBackend) StartJobOn(_ context.Context, host string, spec agent.JobSpec, uid, gid uint32) (*agent.Job, error) {
	if host != "node2" {
		return nil, errFake
	}
	// Started "on node2": the record says who asked for it, and where.
	return &agent.Job{ID: spec.Name + "-1", Spec: spec, UID: uid, GID: gid, Node: host, Dir: "/jobs/" + spec.Name + "-1"}, nil
}

func (fb *fakeBackend) Checkpoint(ctx context.Context, jobs []string, uid uint32) ([]agent.SnapshotResult, error) {
	if fb.checkpoint != nil {
		return fb.checkpoint(ctx, jobs, uid)
	}
	return nil, errFake
}

func (fb *fakeBackend) CheckpointFloor() time.Duration {
	if fb.floor > 0 {
		return fb.floor
	}
	return time.Hour
}

func (fb *fakeBackend) Snapshots(string, uint32) ([]*ckpt.Manifest, error) { return nil, nil }

func (fb *fakeBackend) Restore(context.Context, agent.RestoreRequest, uint32) (*agent.Job, error) {
	return nil, errFake
}

func (fb *fakeBackend) Migrate(context.Context, agent.MigrateRequest, uint32) (*agent.Migration, error) {
	return nil, errFake
}

func (fb *fakeBackend) Drain(context.Context, agent.DrainRequest, uint32) (*agent.DrainResult, error) {
	return nil, errFake
}

func (fb *fakeBackend) CoordinatedSnapshot(_ context.Context, req coordinated.RunRequest, _ uint32) (*coordinated.Cut, error) {
	return &coordinated.Cut{Run: req.Run, ID: "cut-1"}, nil
}

func (fb *fakeBackend) Rollback(_ context.Context, req coordinated.RunRequest, _ uint32) (*coordinated.Rollback, error) {
	return nil, fmt.Errorf("%w of run %s", coordinated.ErrNoCut, req.Run)
}

func (fb *fakeBackend) AddSpare(context.Context, agent.SpareRequest) (ring.View, error) {
	return ring.View{}, errFake
}

func (fb *fakeBackend) Events(uint32) []*agent.Failure { return []*agent.Failure{} }

func (fb *fakeBackend) LoggedConns() []agent.LoggedConn { return nil }

// SignalElsewhere passes a moved job's signal to its MovedTo, as the agent does (without the wire).
func (fb *fakeBackend) SignalElsewhere(_ context.Context, j agent.Job, uid uint32, sig int) (string, error) {
	if j.State != agent.JobMoved || j.MovedTo == "" {
		return "", nil
	}
	fb.mu.Lock()
	defer fb.mu.Unlock()
	fb.passed = append(fb.passed, fmt.Sprintf("%s %d %d %s", j.ID, uid, sig, j.MovedTo))
	return j.MovedTo, nil
}

// call sends one request to the API's handler as cred (nil: a connection whose credentials are unknown).
func call(t *testing.T, h http.Handler, cred *unix.Ucred, method, path, body string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(method, path, strings.NewReader(body))
	if cred != nil {
		r = r.WithContext(WithCaller(r.Context(), cred))
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}
