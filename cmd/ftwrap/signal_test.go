package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/shim"
)

// signalAgent is a local agent that starts one job (after onStart, if set) and takes signals for it: each
// signal is sent on got, and the job ends with 128+N, as a job killed by it does, once stop says so.
type signalAgent struct {
	t       *testing.T
	onStart func()
	stop    func(sig int) bool
	got     chan int
	asked   chan struct{} // closed when the job is first asked about (ftwrap follows it)
	once    sync.Once
	mu      sync.Mutex
	job     agent.Job
}

func newSignalAgent(t *testing.T, stop func(sig int) bool) (*signalAgent, *agentapi.Client) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("exit records are root's: run as root")
	}
	a := &signalAgent{t: t, stop: stop, got: make(chan int, 8), asked: make(chan struct{}),
		job: agent.Job{ID: "sim-00000001", Node: "node1", State: agent.JobRunning, Dir: t.TempDir()}}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/jobs", func(w http.ResponseWriter, _ *http.Request) {
		if a.onStart != nil {
			a.onStart()
		}
		a.reply(w)
	})
	mux.HandleFunc("GET /v1/jobs/{id}", func(w http.ResponseWriter, _ *http.Request) {
		a.once.Do(func() { close(a.asked) })
		a.reply(w)
	})
	mux.HandleFunc("POST /v1/jobs/{id}/signal", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Signal int `json:"signal"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		a.got <- req.Signal
		if a.stop(req.Signal) {
			a.end(128 + req.Signal)
		}
		w.WriteHeader(http.StatusNoContent)
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return a, agentapi.NewClient(sock)
}

func (a *signalAgent) reply(w http.ResponseWriter) {
	a.mu.Lock()
	defer a.mu.Unlock()
	json.NewEncoder(w).Encode(a.job)
}

// end writes the job's exit record, as its shim does, and has the agent say it exited.
func (a *signalAgent) end(code int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	tmp := filepath.Join(a.job.Dir, ".exit.tmp")
	rec := fmt.Sprintf(`{"code": %d, "node": "node1", "time": "2026-12-07T12:00:00Z"}`, code)
	if err := os.WriteFile(tmp, []byte(rec), 0o644); err != nil {
		a.t.Error(err)
	}
	if err := os.Rename(tmp, filepath.Join(a.job.Dir, "exit")); err != nil {
		a.t.Error(err)
	}
	a.job.State = agent.JobExited
}

// runWrap runs wrap against c in the background, with ftwrap's stdout out (nil: nowhere) and its stderr
// nowhere, and returns its error once it returns.
func runWrap(t *testing.T, c *agentapi.Client, out *os.File) <-chan error {
	t.Helper()
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if out == nil {
		out = null
	}
	stdout, stderr := os.Stdout, os.Stderr
	os.Stdout, os.Stderr = out, null
	done := make(chan error, 1)
	go func() {
		done <- wrap(t.Context(), slog.New(slog.DiscardHandler), c, agent.JobSpec{Argv: []string{"prog"}})
	}()
	t.Cleanup(func() {
		os.Stdout, os.Stderr = stdout, stderr
		null.Close()
	})
	return done
}

// nextSignal is the next signal the agent was asked to send the job.
func nextSignal(t *testing.T, a *signalAgent, what string) int {
	t.Helper()
	select {
	case s := <-a.got:
		return s
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: the job was never signalled", what)
		return 0
	}
}

func wantExit(t *testing.T, done <-chan error, code int) {
	t.Helper()
	select {
	case err := <-done:
		var ee *cli.ExitError
		if !errors.As(err, &ee) || ee.Code != code {
			t.Fatalf("wrap = %v; want exit status %d", err, code)
		}
	case <-time.After(time.Minute):
		t.Fatal("wrap did not return after the job ended")
	}
}

// A Ctrl-C while the agent starts the job (the request can take seconds: a job address, a placement) must
// reach the job once it runs. It killed ftwrap, whose handler came only after the start, and the job ran on
// with nobody following it.
func TestWrapPassesSignalDuringStart(t *testing.T) {
	mine := make(chan os.Signal, 1) // keeps the test alive on the old code, which does not catch it yet
	signal.Notify(mine, syscall.SIGINT)
	defer signal.Stop(mine)
	a, c := newSignalAgent(t, func(int) bool { return true })
	a.onStart = func() {
		syscall.Kill(os.Getpid(), syscall.SIGINT)
		select {
		case <-mine: // delivered: to every channel notified of it by now
		case <-time.After(30 * time.Second):
			t.Error("SIGINT never came")
		}
	}
	done := runWrap(t, c, nil)
	if s := nextSignal(t, a, "Ctrl-C while the job started"); s != int(syscall.SIGINT) {
		t.Fatalf("the job got signal %d, want SIGINT", s)
	}
	wantExit(t, done, 128+int(syscall.SIGINT))
}

// A terminal's hangup reaches the job as it would reach PROG run alone: ftwrap died of it and the job ran
// on. A shell sends it again to its jobs as the terminal goes: that second one is a hangup too, not a kill.
func TestWrapPassesHangup(t *testing.T) {
	mine := make(chan os.Signal, 2) // keeps the test alive on the old code, which does not catch it
	signal.Notify(mine, syscall.SIGHUP)
	defer signal.Stop(mine)
	hups := 0
	a, c := newSignalAgent(t, func(int) bool { hups++; return hups == 2 })
	done := runWrap(t, c, nil)
	<-a.asked
	for i := range 2 {
		syscall.Kill(os.Getpid(), syscall.SIGHUP)
		if s := nextSignal(t, a, "hangup"); s != int(syscall.SIGHUP) {
			t.Fatalf("hangup %d: the job got signal %d, want SIGHUP", i+1, s)
		}
	}
	wantExit(t, done, 128+int(syscall.SIGHUP))
}

// A signal ignored when ftwrap started (a script's background job: `ftwrap -- server &`, or nohup) is not
// PROG's to get: run alone, PROG would have ignored it. ftwrap caught SIGINT all the same, so the Ctrl-C
// meant for the script's foreground command stopped the background job.
func TestWrapLeavesIgnoredSignalsAlone(t *testing.T) {
	signal.Ignore(syscall.SIGINT, syscall.SIGHUP)
	defer signal.Reset(syscall.SIGINT, syscall.SIGHUP)
	a, c := newSignalAgent(t, func(int) bool { return true })
	done := runWrap(t, c, nil)
	<-a.asked
	syscall.Kill(os.Getpid(), syscall.SIGINT)
	syscall.Kill(os.Getpid(), syscall.SIGHUP)
	syscall.Kill(os.Getpid(), syscall.SIGTERM) // not ignored: the job's first signal
	if s := nextSignal(t, a, "SIGTERM after ignored ones"); s != int(syscall.SIGTERM) {
		t.Fatalf("the job got signal %d first, want SIGTERM: SIGINT and SIGHUP were ignored when ftwrap started", s)
	}
	wantExit(t, done, 128+int(syscall.SIGTERM))
}

// ftwrap's stdout is a pipe whose reader has gone (ftwrap -- PROG | head -1): PROG run alone would die of
// SIGPIPE at its next write, and so does the job. ftwrap died of it (on its stdout or stderr) and the job
// ran on, unfollowed, to its end.
func TestWrapPassesBrokenPipe(t *testing.T) {
	a, c := newSignalAgent(t, func(int) bool { return true })
	if err := os.WriteFile(filepath.Join(a.job.Dir, "stdout"), []byte("first line\nsecond line\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	r.Close() // the reader is gone before the first line
	done := runWrap(t, c, w)
	if s := nextSignal(t, a, "broken pipe"); s != int(syscall.SIGPIPE) {
		t.Fatalf("the job got signal %d, want SIGPIPE", s)
	}
	wantExit(t, done, 128+int(syscall.SIGPIPE))
}

// A Ctrl-C for a job that moved is passed by the agent to the job's new host, which may answer within the
// cluster protocol's message timeout. ftwrap gave up on the agent after agentTimeout, which cancelled the
// pass of a signal the new host was about to deliver, and warned that the job could not be signalled.
func TestWrapWaitsForSignalPassedOn(t *testing.T) {
	const passTakes = agentTimeout + time.Second // the new host answers late, inside the pass's bound
	if passTakes >= clusterapi.DefaultMessageTimeout {
		t.Fatalf("the new host's answer after %v is not inside the pass's bound %v", passTakes, clusterapi.DefaultMessageTimeout)
	}
	a, c := newSignalAgent(t, func(int) bool { time.Sleep(passTakes); return true })
	var logged bytes.Buffer // written by waitExit only, read once it returned
	log := slog.New(slog.NewTextHandler(&logged, nil))
	sigs := make(chan os.Signal, 1)
	sigs <- syscall.SIGINT
	done := make(chan struct{})
	var st *shim.ExitStatus
	var err error
	go func() { st, err = waitExit(t.Context(), log, c, a.job, sigs); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("waitExit did not return after the job ended")
	}
	if err != nil || st.Code != 128+int(syscall.SIGINT) {
		t.Fatalf("waitExit = %+v, %v; want status %d", st, err, 128+int(syscall.SIGINT))
	}
	if strings.Contains(logged.String(), "could not signal") {
		t.Errorf("ftwrap gave up on a signal the job's new host took:\n%s", logged.String())
	}
}
