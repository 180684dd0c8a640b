package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/shim"
)

// jobBackend is a local agent that knows one job; only Job is served (the rest of Backend is never called).
type jobBackend struct {
	agentapi.Backend
	mu    sync.Mutex
	job   agent.Job
	asked chan struct{} // closed when the job is first asked about (newJobBackend)
	once  sync.Once
}

func newJobBackend(j agent.Job) *jobBackend { return &jobBackend{job: j, asked: make(chan struct{})} }

func (b *jobBackend) CheckpointFloor() time.Duration { return time.Hour }

func (b *jobBackend) set(j agent.Job) { b.mu.Lock(); defer b.mu.Unlock(); b.job = j }

func (b *jobBackend) Job(id string, _ uint32) (agent.Job, <-chan struct{}, error) {
	b.once.Do(func() { close(b.asked) })
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.job.ID != id {
		return agent.Job{}, nil, fmt.Errorf("%w: %s", agent.ErrNoJob, id)
	}
	return b.job, make(chan struct{}), nil
}

// StartJobOn "starts" the backend's job: ftwrap's wrap follows it from there.
func (b *jobBackend) StartJobOn(context.Context, string, agent.JobSpec, uint32, uint32) (*agent.Job, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	j := b.job
	return &j, nil
}

func serveAgent(t *testing.T, b agentapi.Backend) *agentapi.Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	srv, err := agentapi.Listen(t.Context(), sock, b, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return agentapi.NewClient(sock)
}

// followPastStale has ftwrap's waitExit for job meet stale, a superseded copy's exit record, while its agent
// says agentSays of the job; once waitExit has asked the agent about it, end (the job's end) goes in, and then
// the agent says ended: in the other order, a look between the two met the stale record with the agent saying
// ended, and took it (a flake of ci375 under load). It returns what waitExit took for the end.
func followPastStale(t *testing.T, job, agentSays agent.Job, stale, end string) *shim.ExitStatus {
	t.Helper()
	b := newJobBackend(agentSays)
	c := serveAgent(t, b)
	writeRaw(t, job.Dir, stale)
	go func() {
		<-b.asked
		writeRaw(t, job.Dir, end)
		ended := agentSays
		ended.State = agent.JobExited
		b.set(ended)
	}()
	done := make(chan struct{})
	var st *shim.ExitStatus
	var err error
	go func() { st, err = waitExit(t.Context(), slog.New(slog.DiscardHandler), c, job, nil); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("waitExit did not take the job's end")
	}
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// The copy on ftwrap's host was fenced and killed, but its shim (an older agent's, or one whose superseded
// mark could not be written) recorded the kill: the job runs on on node2. ftwrap must not end with that
// kill's status, as the agents do not (watchJobs takes only its own host's records), but follow the job on
// to the end its restored copy records.
func TestWaitExitIgnoresSupersededCopysRecord(t *testing.T) {
	job := agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobRunning, Dir: t.TempDir()}
	fenced := job
	fenced.State, fenced.Fenced = agent.JobLost, true
	st := followPastStale(t, job, fenced, `{"code": 137, "signal": "SIGKILL", "node": "node1", "time": "2026-12-07T12:00:00Z"}`,
		`{"code": 0, "node": "node2", "time": "2026-12-07T12:01:00Z"}`)
	if st.Node != "node2" || st.Code != 0 {
		t.Fatalf("waitExit = status %d (%s) from %s: the fenced copy's kill, while the job ran on on node2; want node2's 0", st.Code, st.Signal, st.Node)
	}
}

// A migrated job's copy left behind is killed the same way (state moved): its kill is not the job's end.
func TestWaitExitIgnoresMovedCopysRecord(t *testing.T) {
	job := agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobRunning, Dir: t.TempDir()}
	moved := job
	moved.State, moved.MovedTo = agent.JobMoved, "node2"
	st := followPastStale(t, job, moved, `{"code": 137, "signal": "SIGKILL", "node": "node1", "time": "2026-12-07T12:00:00Z"}`,
		`{"code": 3, "node": "node2", "time": "2026-12-07T12:01:00Z"}`)
	if st.Node != "node2" || st.Code != 3 {
		t.Fatalf("waitExit = status %d from %s: the moved copy's kill; want node2's 3", st.Code, st.Node)
	}
}

// The job's own end on ftwrap's host is taken, once its agent agrees (or cannot be asked).
func TestWaitExitTakesOwnHostsEnd(t *testing.T) {
	for _, tc := range []struct {
		name  string
		agent func(j agent.Job) *agent.Job // nil: no agent answers
	}{
		{"exited", func(j agent.Job) *agent.Job { j.State = agent.JobExited; return &j }},
		{"agent not noticed yet", func(j agent.Job) *agent.Job { return &j }},
		{"agent unreachable", func(agent.Job) *agent.Job { return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			job := agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobRunning, Dir: dir}
			var c *agentapi.Client
			if j := tc.agent(job); j != nil {
				b := newJobBackend(*j)
				c = serveAgent(t, b)
				if j.State == agent.JobRunning {
					go func() { // the agent's watchJobs notices the record after ftwrap first asked
						<-b.asked
						j.State = agent.JobExited
						b.set(*j)
					}()
				}
			} else {
				c = agentapi.NewClient(filepath.Join(t.TempDir(), "none.sock"))
			}
			writeRaw(t, dir, `{"code": 7, "node": "node1", "time": "2026-12-07T12:00:00Z"}`)
			done := make(chan struct{})
			var st *shim.ExitStatus
			var err error
			go func() { st, err = waitExit(t.Context(), slog.New(slog.DiscardHandler), c, job, nil); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("waitExit did not take the job's own end")
			}
			if err != nil || st.Code != 7 {
				t.Fatalf("waitExit = %+v, %v; want status 7", st, err)
			}
		})
	}
}

// writeRaw writes an exit record's JSON as a shim does (root's, renamed into place): a record of this
// version's shim, with the copy's incarnation, written as such to run against any version of ExitStatus.
func writeRaw(t *testing.T, dir, record string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("exit records are root's: run as root")
	}
	tmp := filepath.Join(dir, ".exit.tmp")
	if err := os.WriteFile(tmp, []byte(record), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "exit")); err != nil {
		t.Fatal(err)
	}
}

// The job left ftwrap's host, ran on node2 as incarnation 1, and came back here as incarnation 2 when
// node2 failed; node2's copy, killed once node2 rejoined, recorded its kill (an older agent's shim, or a
// superseded mark that could not be written). That record names another host, which ftwrap took for the
// end of the job's restored copy and exited 137 with while the job ran on here: an older incarnation than
// the one its agent runs is a superseded copy's, and ftwrap follows the job on to its end.
func TestWaitExitIgnoresOlderIncarnationsRecord(t *testing.T) {
	job := agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobRunning, Dir: t.TempDir()}
	back := job
	back.Incarnation = 2
	st := followPastStale(t, job, back, `{"code": 137, "signal": "SIGKILL", "node": "node2", "time": "2026-12-07T12:00:00Z", "incarnation": 1}`,
		`{"code": 0, "node": "node1", "time": "2026-12-07T12:01:00Z", "incarnation": 2}`)
	if st.Node != "node1" || st.Code != 0 {
		t.Fatalf("waitExit = status %d (%s) from %s: the kill of node2's older copy, while the job ran on here as incarnation 2; want node1's 0", st.Code, st.Signal, st.Node)
	}
}

// A record naming an incarnation no older than the agent's copy, or none (an older shim's), keeps being
// taken as the end of a copy elsewhere.
func TestWaitExitTakesRecordOfNewerOrNoIncarnation(t *testing.T) {
	for _, record := range []string{
		`{"code": 5, "node": "node2", "time": "2026-12-07T12:00:00Z", "incarnation": 1}`,
		`{"code": 5, "node": "node2", "time": "2026-12-07T12:00:00Z"}`,
	} {
		dir := t.TempDir()
		job := agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobRunning, Dir: dir}
		fenced := job
		fenced.State, fenced.Fenced = agent.JobLost, true
		c := serveAgent(t, newJobBackend(fenced))
		writeRaw(t, dir, record)
		st, err := waitExit(t.Context(), slog.New(slog.DiscardHandler), c, job, nil)
		if err != nil || st.Code != 5 {
			t.Fatalf("record %s: waitExit = %+v, %v; want status 5", record, st, err)
		}
	}
}

// The job's output that ftwrap could not write (its stdout or stderr on a full disk, or over a quota) is
// lost to the user: ftwrap must not exit 0 as if it had printed the job's output, and a failed job keeps
// its own status. It exited 0 and printed nothing.
func TestWrapFailsWhenOutputIsLost(t *testing.T) {
	for _, tc := range []struct {
		name     string
		stream   string // the file ftwrap cannot write the job's output of
		code     int    // the job's
		wantCode int
	}{
		{"stdout, job succeeded", "stdout", 0, cli.ExitFailure},
		{"stderr, job succeeded", "stderr", 0, cli.ExitFailure},
		{"stdout, job failed", "stdout", 3, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			job := agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobExited, Dir: dir}
			for _, f := range []string{"stdout", "stderr"} {
				if err := os.WriteFile(filepath.Join(dir, f), []byte("the job's "+f+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			writeRaw(t, dir, fmt.Sprintf(`{"code": %d, "node": "node1", "time": "2026-12-07T12:00:00Z"}`, tc.code))
			c := serveAgent(t, newJobBackend(job))
			full, err := os.OpenFile("/dev/full", os.O_WRONLY, 0) // every write fails with ENOSPC
			if err != nil {
				t.Skipf("SKIPPED: no /dev/full: %v", err)
			}
			defer full.Close()
			null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0) // the other stream's output is not looked at
			if err != nil {
				t.Fatal(err)
			}
			defer null.Close()
			stdout, stderr := os.Stdout, os.Stderr
			os.Stdout, os.Stderr = full, null
			if tc.stream == "stderr" {
				os.Stdout, os.Stderr = null, full
			}
			err = wrap(t.Context(), slog.New(slog.DiscardHandler), c, agent.JobSpec{Argv: []string{"prog"}})
			os.Stdout, os.Stderr = stdout, stderr
			var ee *cli.ExitError
			if !errors.As(err, &ee) || ee.Code != tc.wantCode {
				t.Fatalf("wrap = %v: the job's %s was lost (ENOSPC) and the job exited %d; want exit status %d", err, tc.stream, tc.code, tc.wantCode)
			}
			if !errors.Is(err, syscall.ENOSPC) {
				t.Errorf("wrap = %v: want the write's error (ENOSPC)", err)
			}
		})
	}
}

// hungAgent listens on a socket like an agent and takes requests, but never answers (a stopped or
// deadlocked agent, one whose host is failing). The channel is closed when the first request has come.
func hungAgent(t *testing.T) (*agentapi.Client, <-chan struct{}) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	asked := make(chan struct{})
	var once sync.Once
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
			go func() {
				if _, err := http.ReadRequest(bufio.NewReader(conn)); err == nil {
					once.Do(func() { close(asked) })
				}
			}()
		}
	}()
	return agentapi.NewClient(sock), asked
}

// ftwrap's agent stops answering (it takes requests but never answers) while the job, restored on node2,
// ends there. ftwrap must take that end from the job's directory, as it does when its agent is gone, and
// not wait for the agent's answer forever: it hung in its poll of the agent, and in passing on a Ctrl-C.
func TestWaitExitNotHeldByHungAgent(t *testing.T) {
	for _, tc := range []struct {
		name   string
		signal bool // a Ctrl-C comes first, which ftwrap passes to the job through the agent
	}{
		{"poll", false},
		{"signal", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			job := agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobRunning, Dir: dir}
			c, asked := hungAgent(t)
			sigs := make(chan os.Signal, 2)
			if tc.signal {
				sigs <- syscall.SIGINT
			}
			go func() {
				<-asked
				writeRaw(t, dir, `{"code": 4, "node": "node2", "time": "2026-12-07T12:01:00Z"}`)
			}()
			done := make(chan struct{})
			var st *shim.ExitStatus
			var err error
			go func() { st, err = waitExit(t.Context(), slog.New(slog.DiscardHandler), c, job, sigs); close(done) }()
			select {
			case <-done:
			case <-time.After(time.Minute):
				t.Fatal("waitExit did not take the job's end on node2 while its agent did not answer")
			}
			if err != nil || st.Code != 4 || st.Node != "node2" {
				t.Fatalf("waitExit = %+v, %v; want node2's status 4", st, err)
			}
		})
	}
}
