package agentapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
)

// writeOutput writes a job's output file as the job's user would own it.
func writeOutput(t *testing.T, j *agent.Job, name, content string) string {
	t.Helper()
	p := filepath.Join(j.Dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, int(j.UID), int(j.GID)); err != nil {
		t.Fatal(err)
	}
	return p
}

// GET /v1/jobs/{id}/output: the job's owner and root read it, another uid gets "no such job"; a link, a
// hard link to another user's file or a FIFO planted as the output is refused, never followed or waited on.
func TestAPIOutput(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (the outputs belong to the job's uid)")
	}
	fb := newFakeBackend(t)
	h := Handler(fb, DefaultLimits())
	j := fb.addJob(t, agent.Job{ID: "out-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobExited})
	writeOutput(t, j, "stdout", "hello out\n")
	writeOutput(t, j, "stderr", "hello err\n")
	secret := filepath.Join(fb.dir, "secret")
	if err := os.WriteFile(secret, []byte("root's secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := fb.addJob(t, agent.Job{ID: "link-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobExited})
	if err := os.Symlink(secret, filepath.Join(link.Dir, "stdout")); err != nil {
		t.Fatal(err)
	}
	hard := fb.addJob(t, agent.Job{ID: "hard-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobExited})
	if err := os.Link(secret, filepath.Join(hard.Dir, "stdout")); err != nil {
		t.Fatal(err)
	}
	fifo := fb.addJob(t, agent.Job{ID: "fifo-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobRunning})
	if err := syscall.Mkfifo(filepath.Join(fifo.Dir, "stdout"), 0o600); err != nil {
		t.Fatal(err)
	}
	os.Chown(filepath.Join(fifo.Dir, "stdout"), int(asOwner.Uid), int(asOwner.Gid))
	dirLink := fb.addJob(t, agent.Job{ID: "dirlink-00000001", UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobExited})
	os.RemoveAll(dirLink.Dir)
	if err := os.Symlink(filepath.Dir(secret), dirLink.Dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(fb.dir, "stdout"), []byte("root's secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, path string
		cred       *unix.Ucred
		code       int
		body       string
	}{
		{"owner stdout", "/v1/jobs/" + j.ID + "/output", asOwner, 200, "hello out\n"},
		{"owner stderr", "/v1/jobs/" + j.ID + "/output?stream=stderr", asOwner, 200, "hello err\n"},
		{"root", "/v1/jobs/" + j.ID + "/output?stream=stdout", asRoot, 200, "hello out\n"},
		{"other", "/v1/jobs/" + j.ID + "/output", asOther, 404, "no such job"},
		{"no credentials", "/v1/jobs/" + j.ID + "/output", nil, 403, "credentials unavailable"},
		{"bad stream", "/v1/jobs/" + j.ID + "/output?stream=exit", asOwner, 400, "use stdout or stderr"},
		{"bad follow", "/v1/jobs/" + j.ID + "/output?follow=maybe", asOwner, 400, "use true or false"},
		{"missing", "/v1/jobs/" + link.ID + "/output?stream=stderr", asOwner, 404, "has no stderr"},
		{"planted link", "/v1/jobs/" + link.ID + "/output", asOwner, 409, "link"},
		{"planted link as root", "/v1/jobs/" + link.ID + "/output", asRoot, 409, "link"},
		{"hard link to root's file", "/v1/jobs/" + hard.ID + "/output", asOwner, 409, "uid 0"},
		{"fifo", "/v1/jobs/" + fifo.ID + "/output?follow=true", asOwner, 409, "not a regular file"},
		{"job directory is a link", "/v1/jobs/" + dirLink.ID + "/output", asOwner, 409, "link"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			done := make(chan struct{})
			var code int
			var body string
			go func() {
				defer close(done)
				w := call(t, h, tt.cred, "GET", tt.path, "")
				code, body = w.Code, w.Body.String()
			}()
			select {
			case <-done:
			case <-time.After(failAfter):
				t.Fatalf("no answer after %s", failAfter)
			}
			if code != tt.code || !strings.Contains(body, tt.body) {
				t.Fatalf("%d %q, want %d %q", code, body, tt.code, tt.body)
			}
			if strings.Contains(body, "root's secret") {
				t.Fatalf("served root's file: %q", body)
			}
		})
	}
}

// With follow, the client gets what the job writes while it runs, and the answer ends with the job.
func TestClientOutputFollow(t *testing.T) {
	fb := newFakeBackend(t)
	addr := serveTest(t, fb, DefaultLimits())
	uid, gid := uint32(os.Getuid()), uint32(os.Getgid())
	j := fb.addJob(t, agent.Job{ID: "follow-00000001", UID: uid, GID: gid, State: agent.JobRunning, PID: os.Getpid()})
	p := writeOutput(t, j, "stdout", "first\n")
	c := NewClient(addr)
	w := &chanWriter{ch: make(chan string, 16)}
	done := make(chan error, 1)
	go func() { done <- c.Output(context.Background(), j.ID, "stdout", true, w) }()
	// Wait for the first line to arrive: the follow is under way.
	got := ""
	select {
	case s := <-w.ch:
		got += s
	case <-time.After(failAfter):
		t.Fatal("nothing followed")
	}
	if got != "first\n" {
		t.Fatalf("first read %q", got)
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("second\n")
	f.Close()
	fb.update(j.ID, func(j *agent.Job) { j.State = agent.JobExited })
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("follow: %v", err)
		}
	case <-time.After(failAfter):
		t.Fatal("the follow did not end with the job")
	}
	close(w.ch)
	for s := range w.ch {
		got += s
	}
	if got != "first\nsecond\n" {
		t.Fatalf("followed %q", got)
	}
	// Without follow: the output as it is, at once.
	var once bytes.Buffer
	if err := c.Output(context.Background(), j.ID, "stdout", false, &once); err != nil || once.String() != "first\nsecond\n" {
		t.Fatalf("output %q, %v", once.String(), err)
	}
}

// The client names the socket it tried, not the placeholder URL.
func TestClientUnreachableNamesSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	_, err := NewClient(sock).Jobs(context.Background())
	if err == nil || !strings.Contains(err.Error(), sock) || strings.Contains(err.Error(), "http://") {
		t.Fatalf("error %v: want it to name %s and no URL", err, sock)
	}
}

// chanWriter hands each write to a channel.
type chanWriter struct{ ch chan string }

func (w *chanWriter) Write(b []byte) (int, error) {
	w.ch <- string(b)
	return len(b), nil
}

// TestClientOutputFollowSaysWhereTheJobWent: a followed output ends when the agent's record of the job stops
// running, which a migration away (or a fence of this host's copy, the job restored elsewhere) does too. The
// old client ended without a word, as at the job's end, while the job ran on and wrote on elsewhere; the
// follow now ends with an error that says the job goes on, and where.
func TestClientOutputFollowSaysWhereTheJobWent(t *testing.T) {
	for _, tt := range []struct {
		name string
		away func(*agent.Job)
		want string
	}{
		{"moved", func(j *agent.Job) { j.State, j.MovedTo = agent.JobMoved, "node2" }, "moved to node2"},
		{"fenced", func(j *agent.Job) { j.State, j.Fenced = agent.JobLost, true }, "restored on another host"},
		{"exited", func(j *agent.Job) { j.State = agent.JobExited }, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			fb := newFakeBackend(t)
			addr := serveTest(t, fb, DefaultLimits())
			j := fb.addJob(t, agent.Job{ID: "away-00000001", UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), State: agent.JobRunning, PID: os.Getpid()})
			writeOutput(t, j, "stdout", "first\n")
			w := &chanWriter{ch: make(chan string, 16)}
			done := make(chan error, 1)
			go func() { done <- NewClient(addr).Output(context.Background(), j.ID, "stdout", true, w) }()
			select {
			case <-w.ch: // the follow is under way
			case <-time.After(failAfter):
				t.Fatal("nothing followed")
			}
			fb.update(j.ID, tt.away)
			var err error
			select {
			case err = <-done:
			case <-time.After(failAfter):
				t.Fatal("the follow did not end")
			}
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("follow of a job that ended: %v, want no error", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("follow of a job that went on elsewhere ended with %v, want an error saying %q", err, tt.want)
			}
		})
	}
}

// TestClientReplyBounded: a successful answer is read up to a bound of its kind, far above any honest one;
// the old client read it whole, whatever its size (only error answers were bounded).
func TestClientReplyBounded(t *testing.T) {
	addr := "@ftkit-api-test-big-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// A job record whose id goes on past the bound, written a chunk at a time.
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"`)
		chunk := strings.Repeat("a", 1<<20)
		for range maxRecordReply>>20 + 1 {
			if _, err := io.WriteString(w, chunk); err != nil {
				return // the client stopped reading
			}
		}
		io.WriteString(w, `"}`)
	})}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	j, err := NewClient(addr).Job(context.Background(), "big-00000001")
	if err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("answer of more than %d bytes: job id of %d bytes, error %v; want it refused", maxRecordReply, len(j.ID), err)
	}
}

// TestClientOutputFollowEndedByAgent: a followed output the agent ends while the job runs on (the agent
// stops or restarts: its handlers' context ends, the answer ends cleanly, the shims and the job outlive it)
// is not the job's end. The old client asked for the job afterwards and returned nil both when the agent
// still said "running" and when it could not be asked at all, so `ftctl logs --follow` exited 0 as if the
// job had ended.
func TestClientOutputFollowEndedByAgent(t *testing.T) {
	const id = "agent-00000001"
	for _, tt := range []struct {
		name string
		job  func(w http.ResponseWriter) // the agent's answer to GET /v1/jobs/{id} once the follow ended
		want string                      // in the error; "" for none
	}{
		{"job still running", func(w http.ResponseWriter) {
			writeJSON(w, http.StatusOK, agent.Job{ID: id, State: agent.JobRunning})
		}, "still runs"},
		{"agent cannot say", func(w http.ResponseWriter) {
			writeError(w, http.StatusServiceUnavailable, errors.New("the agent is stopping"))
		}, "the agent is stopping"},
		{"job exited", func(w http.ResponseWriter) { writeJSON(w, http.StatusOK, agent.Job{ID: id, State: agent.JobExited}) }, ""},
		{"job forgotten", func(w http.ResponseWriter) {
			writeError(w, http.StatusNotFound, fmt.Errorf("%w: %s on node1", agent.ErrNoJob, id))
		}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			addr := "@ftkit-api-test-ended-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
			ln, err := net.Listen("unix", addr)
			if err != nil {
				t.Fatal(err)
			}
			mux := http.NewServeMux()
			mux.HandleFunc("GET /v1/jobs/{id}/output", func(w http.ResponseWriter, r *http.Request) {
				io.WriteString(w, "first\n") // then the handler returns, as on the end of its context
			})
			mux.HandleFunc("GET /v1/jobs/{id}", func(w http.ResponseWriter, r *http.Request) { tt.job(w) })
			srv := &http.Server{Handler: mux}
			done := make(chan error, 1)
			go func() { done <- srv.Serve(ln) }()
			t.Cleanup(func() {
				srv.Close()
				<-done
			})
			var out bytes.Buffer
			err = NewClient(addr).Output(context.Background(), id, "stdout", true, &out)
			switch {
			case out.String() != "first\n":
				t.Errorf("followed %q", out.String())
			case tt.want == "" && err != nil:
				t.Errorf("follow of a job that ended: %v, want no error", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("follow the agent ended while the job may run on: %v, want an error saying %q", err, tt.want)
			}
		})
	}
}

// TestClientOutputFollowAgentStops: the same on the agent's own server: its context ends (SIGTERM) while
// the job runs.
func TestClientOutputFollowAgentStops(t *testing.T) {
	fb := newFakeBackend(t)
	addr := "@ftkit-api-test-stops-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	lim := DefaultLimits()
	srv := newServer(ctx, fb, lim, slog.New(slog.DiscardHandler))
	done := make(chan error, 1)
	go func() { done <- srv.Serve(newCredListener(ln, lim, slog.New(slog.DiscardHandler))) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	j := fb.addJob(t, agent.Job{ID: "stops-00000001", UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), State: agent.JobRunning, PID: os.Getpid()})
	writeOutput(t, j, "stdout", "first\n")
	w := &chanWriter{ch: make(chan string, 16)}
	followed := make(chan error, 1)
	go func() { followed <- NewClient(addr).Output(context.Background(), j.ID, "stdout", true, w) }()
	select {
	case <-w.ch: // the follow is under way
	case <-time.After(failAfter):
		t.Fatal("nothing followed")
	}
	stop() // the agent stops; the job runs on
	select {
	case err := <-followed:
		if err == nil || !strings.Contains(err.Error(), "still runs") {
			t.Errorf("follow ended by the agent's stop while the job runs: %v, want an error saying it still runs", err)
		}
	case <-time.After(failAfter):
		t.Fatal("the follow did not end with the agent")
	}
}
