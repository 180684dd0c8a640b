package agentapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"github.com/ftkit/ftkit/internal/testenv"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
)

// The signal endpoint, on real processes: the job's owner and root reach the job; another uid, a PID
// that is no longer the job's (reused), and a job whose process is gone are refused.
func TestAPISignal(t *testing.T) {
	fb := newFakeBackend(t)
	h := Handler(fb, DefaultLimits())
	const (
		inCgroup   = iota // the job's process runs in the job's cgroup
		reused            // the PID names a process outside the job's cgroup
		reaped            // the process exited and was reaped
		cgroupGone        // the job's cgroup was removed (the job ended)
	)
	tests := []struct {
		name    string
		cred    *unix.Ucred
		state   int
		code    int
		wantErr string
	}{
		{"owner", asOwner, inCgroup, 204, ""},
		{"root", asRoot, inCgroup, 204, ""},
		{"other", asOther, inCgroup, 404, "no such job"},
		{"owner, pid reused outside the job", asOwner, reused, 409, "no longer in the job's cgroup"},
		{"root, pid reused outside the job", asRoot, reused, 409, "no longer in the job's cgroup"},
		{"owner, process gone", asOwner, reaped, 409, "has exited"},
		{"owner, cgroup gone", asOwner, cgroupGone, 409, "was removed"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cmd := testenv.StartSleep(t)
			pid := cmd.Process.Pid
			j := fb.addJob(t, agent.Job{ID: "sig-" + strconv.Itoa(i), UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobRunning, PID: pid})
			switch tt.state {
			case reused:
				fb.setProcs(t, j, pid+1, 1)
			case reaped:
				cmd.Process.Kill()
				cmd.Wait()
			case cgroupGone:
				os.RemoveAll(j.Cgroup)
			}
			w := call(t, h, tt.cred, "POST", "/v1/jobs/"+j.ID+"/signal", `{"signal":15}`)
			if w.Code != tt.code || !strings.Contains(w.Body.String(), tt.wantErr) {
				t.Fatalf("%d %s, want %d %q", w.Code, w.Body.String(), tt.code, tt.wantErr)
			}
			switch {
			case tt.state == reaped:
			case tt.code == 204:
				testenv.WaitSignalled(t, cmd, syscall.SIGTERM)
			default:
				testenv.StillRuns(t, cmd)
			}
		})
	}
}

// TestAPISignalMovedJob: a signal for a job that left this host (migrated: MovedTo) is passed to the
// backend for the host it went to, with the caller's uid, and answered as delivered; another uid still
// finds no job, and a job that went nowhere known is refused as before. Until then every signal for a
// moved job was refused ("job ID is moved"): ftwrap's Ctrl-C, and the second that kills, never reached it.
func TestAPISignalMovedJob(t *testing.T) {
	fb := newFakeBackend(t)
	h := Handler(fb, DefaultLimits())
	moved := fb.addJob(t, agent.Job{ID: "moved-1", UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobMoved, MovedTo: "node2"})
	lost := fb.addJob(t, agent.Job{ID: "lost-1", UID: asOwner.Uid, GID: asOwner.Gid, State: agent.JobLost})
	if w := call(t, h, asOther, "POST", "/v1/jobs/"+moved.ID+"/signal", `{"signal":2}`); w.Code != 404 {
		t.Fatalf("another uid: %d %s, want 404", w.Code, w.Body.String())
	}
	if w := call(t, h, asOwner, "POST", "/v1/jobs/"+lost.ID+"/signal", `{"signal":2}`); w.Code != 409 || !strings.Contains(w.Body.String(), "is lost") {
		t.Fatalf("a job gone nowhere known: %d %s, want 409 is lost", w.Code, w.Body.String())
	}
	if w := call(t, h, asOwner, "POST", "/v1/jobs/"+moved.ID+"/signal", `{"signal":2}`); w.Code != 204 {
		t.Fatalf("the owner's signal to a moved job: %d %s, want 204", w.Code, w.Body.String())
	}
	fb.mu.Lock()
	defer fb.mu.Unlock()
	if want := []string{"moved-1 1000 2 node2"}; !slices.Equal(fb.passed, want) {
		t.Errorf("passed on %q, want %q", fb.passed, want)
	}
}

// serveTest serves the API on an abstract unix socket (no file: any uid may connect) and returns its
// address; the server is closed at the end of the test.
func serveTest(t *testing.T, fb *fakeBackend, lim Limits) string {
	t.Helper()
	addr := "@ftkit-api-test-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	srv := newServer(ctx, fb, lim, slog.New(slog.DiscardHandler))
	done := make(chan error, 1)
	go func() { done <- srv.Serve(newCredListener(ln, lim, slog.New(slog.DiscardHandler))) }()
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serve: %v", err)
		}
	})
	return addr
}

// readUntilClosed reads what the server sends until it closes the connection.
func readUntilClosed(t *testing.T, c net.Conn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(failAfter))
	b, err := io.ReadAll(c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the server kept the connection open for %s (got %q)", failAfter, b)
	}
	return string(b)
}

func shortLimits() Limits {
	lim := DefaultLimits()
	lim.readHeader, lim.read, lim.idle = 200*time.Millisecond, 400*time.Millisecond, 300*time.Millisecond
	return lim
}

// Slowloris: a client that sends half a request, or a request and then nothing, is cut off.
func TestAPISlowClientsCutOff(t *testing.T) {
	fb := newFakeBackend(t)
	addr := serveTest(t, fb, shortLimits())
	for _, tt := range []struct {
		name, send string
		answer     func(string) bool
	}{
		{"half a header", "GET /v1/status HTTP/1.1\r\nHost: agent\r\n", func(got string) bool { return !strings.Contains(got, " 200 ") }},
		{"half a body", "POST /v1/jobs HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"argv\":",
			func(got string) bool { return got == "" || strings.HasPrefix(got, "HTTP/1.1 400 ") }},
		{"idle after an answer", "GET /v1/jobs HTTP/1.1\r\nHost: agent\r\n\r\n", func(got string) bool {
			return strings.HasPrefix(got, "HTTP/1.1 200 ") && !strings.Contains(got, "Connection: close")
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := net.Dial("unix", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := io.WriteString(c, tt.send); err != nil {
				t.Fatal(err)
			}
			if got := readUntilClosed(t, c); !tt.answer(got) {
				t.Errorf("answer %q", got)
			}
		})
	}
}

// The read timeouts bound sending a request, not the answer: a long poll outlasts them.
func TestAPILongPollOutlastsReadTimeout(t *testing.T) {
	fb := newFakeBackend(t)
	lim := shortLimits()
	addr := serveTest(t, fb, lim)
	mine := fb.addJob(t, agent.Job{ID: "poll-1", UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), State: agent.JobRunning, PID: os.Getpid()})
	c := NewClient(addr)
	j, err := c.Wait(context.Background(), mine.ID, 3*lim.read)
	if err != nil || j.ID != mine.ID || j.State != agent.JobRunning {
		t.Fatalf("wait: %+v, %v", j, err)
	}
	// And the job's end still ends the poll.
	go func() {
		fb.update(mine.ID, func(j *agent.Job) { j.State = agent.JobExited })
	}()
	if j, err = c.Wait(context.Background(), mine.ID, 10*time.Minute); err != nil || j.State != agent.JobExited {
		t.Fatalf("wait for the end: %+v, %v", j, err)
	}
}

// dialAs opens n connections to addr with uid as the effective uid. Only the calling OS thread changes
// its uid (a raw setresuid), and that thread ends with the goroutine: the test process keeps its own.
func dialAs(t *testing.T, addr string, uid uint32, n int) []net.Conn {
	t.Helper()
	type result struct {
		cs  []net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the runtime ends the thread with this goroutine
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), uintptr(uid), ^uintptr(0)); e != 0 {
			ch <- result{err: e}
			return
		}
		var r result
		for range n {
			c, err := net.Dial("unix", addr)
			if err != nil {
				r.err = err
				break
			}
			r.cs = append(r.cs, c)
		}
		ch <- r
	}()
	r := <-ch
	for _, c := range r.cs {
		t.Cleanup(func() { c.Close() })
	}
	if r.err != nil {
		t.Fatalf("connect as uid %d: %v", uid, r.err)
	}
	return r.cs
}

// ask sends GET /v1/jobs on c and returns the answer's status code and body.
func ask(c net.Conn) (int, string, error) {
	c.SetDeadline(time.Now().Add(failAfter))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, "GET /v1/jobs HTTP/1.1\r\nHost: agent\r\n\r\n"); err != nil {
		return 0, "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// A user cannot hold more than its share of connections (the agent's file descriptors); root always can.
func TestAPIConnectionLimits(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (connects as other uids)")
	}
	fb := newFakeBackend(t)
	lim := shortLimits()
	lim.idle = time.Hour // connections stay until the test closes them
	lim.connsPerUID, lim.conns = 2, 3
	addr := serveTest(t, fb, lim)
	const u1, u2 = 65534, 65533
	want := func(c net.Conn, code int, msg string) {
		t.Helper()
		got, body, err := ask(c)
		if got != code || !strings.Contains(body, msg) {
			t.Fatalf("answer %d %q (%v), want %d %q", got, body, err, code, msg)
		}
	}
	a := dialAs(t, addr, u1, 3)
	want(a[0], 200, "")
	want(a[1], 200, "")
	want(a[2], 503, "uid 65534 already has 2 connections to the agent, its limit")
	// The agent's own client reports the reason, not a broken pipe: the refusal waits for the request.
	for range 20 {
		c := &Client{socket: addr, http: &http.Client{Transport: &http.Transport{
			DialContext: func(context.Context, string, string) (net.Conn, error) { return dialAs(t, addr, u1, 1)[0], nil },
		}}}
		if _, err := c.Jobs(context.Background()); err == nil || !strings.Contains(err.Error(), "uid 65534 already has 2 connections") {
			t.Fatalf("client over the limit: %v", err)
		}
	}
	b := dialAs(t, addr, u2, 2)
	want(b[0], 200, "")
	want(b[1], 503, "the agent already serves 3 connections of users")
	// Root is never refused.
	for _, c := range dialAs(t, addr, 0, 4) {
		want(c, 200, "")
	}
	// A closed connection frees its place: wait until the server has seen the close.
	a[0].Close()
	deadline := time.Now().Add(failAfter)
	for {
		c := dialAs(t, addr, u1, 1)[0]
		code, body, err := ask(c)
		if code == 200 {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatalf("uid %d is still refused after closing a connection: %d %q %v", u1, code, body, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The connection counts, without sockets.
func TestCredListenerCounts(t *testing.T) {
	l := newCredListener(nil, Limits{connsPerUID: 2, conns: 3}, slog.New(slog.DiscardHandler))
	for i, tt := range []struct {
		acquire bool // else release
		uid     uint32
		wantErr string
	}{
		{true, 1, ""},
		{true, 1, ""},
		{true, 1, "uid 1 already has 2"},
		{true, 0, ""},
		{true, 2, ""},
		{true, 3, "already serves 3"},
		{true, 0, ""},
		{false, 1, ""},
		{true, 3, ""},
		{true, 2, "already serves 3"},
		{false, 0, ""},
		{false, 2, ""},
		{false, 3, ""},
		{false, 1, ""},
		{true, 2, ""},
		{true, 2, ""},
		{true, 2, "uid 2 already has 2"},
	} {
		if !tt.acquire {
			l.release(tt.uid)
			continue
		}
		err := l.acquire(tt.uid)
		if (err == nil) != (tt.wantErr == "") || err != nil && !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("step %d: acquire(%d) = %v, want %q", i, tt.uid, err, tt.wantErr)
		}
	}
	if l.total != 2 || len(l.byUID) != 1 {
		t.Errorf("total %d, by uid %v", l.total, l.byUID)
	}
}

// A POST handler that runs longer than the read timeout still answers, and one whose client went away
// has its context cancelled. readBody reads the body to its end before the handler runs: a JSON decoder
// stops at the end of its value, and a request whose body is not all sent must not be acted on (net/http
// only watches for the client going away once the body has been read).
func TestReadBody(t *testing.T) {
	const readTimeout = 200 * time.Millisecond
	gone := make(chan error, 1)
	h := readBody(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var v string // decoded as the API's handlers do: the decoder stops at the end of the value
		json.NewDecoder(r.Body).Decode(&v)
		select {
		case <-time.After(3 * readTimeout):
			io.WriteString(w, "done with "+v)
		case <-r.Context().Done():
			gone <- r.Context().Err()
		}
	}))
	addr := "@ftkit-readbody-test-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadTimeout: readTimeout}
	go srv.Serve(ln)
	defer srv.Close()
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "POST / HTTP/1.1\r\nHost: agent\r\nContent-Length: 8\r\n\r\n\"hello\"\n")
	c.SetReadDeadline(time.Now().Add(failAfter))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(b) != "done with hello" {
		t.Fatalf("answer %d %q", resp.StatusCode, b)
	}
	// A chunked body whose end never comes: the read timeout ends the request, the handler never runs.
	c3, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	io.WriteString(c3, "POST / HTTP/1.1\r\nHost: agent\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n\"hello\"\n\r\n")
	c3.SetReadDeadline(time.Now().Add(failAfter))
	resp, err = http.ReadResponse(bufio.NewReader(c3), nil)
	if err != nil {
		t.Fatalf("no answer to an unfinished body: %v", err)
	}
	b, _ = io.ReadAll(resp.Body)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "timeout") {
		t.Fatalf("unfinished body: %d %q, want 400 and a timeout", resp.StatusCode, b)
	}
	// A client that leaves while its request is handled.
	c2, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c2, "POST / HTTP/1.1\r\nHost: agent\r\nContent-Length: 8\r\n\r\n\"hello\"\n")
	c2.Close()
	select {
	case err := <-gone:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("handler context: %v", err)
		}
	case <-time.After(failAfter):
		t.Fatal("the handler was not told that its client went away")
	}
}

// The client drops an idle connection before the agent does (a POST on a connection the agent is
// closing would fail, not be retried).
func TestClientIdleTimeoutBelowServers(t *testing.T) {
	tr := NewClient("/nonexistent").http.Transport.(*http.Transport)
	if tr.IdleConnTimeout <= 0 || tr.IdleConnTimeout >= DefaultLimits().idle {
		t.Fatalf("client idle timeout %s, agent's %s", tr.IdleConnTimeout, DefaultLimits().idle)
	}
}

// bounded(0) lifts the server's write timeout (a dump or restore may take longer than any fixed bound);
// bounded(d) ends the handler's context after d.
func TestBounded(t *testing.T) {
	const writeTimeout = 200 * time.Millisecond
	mux := http.NewServeMux()
	mux.HandleFunc("/long", bounded(0, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(3 * writeTimeout):
			io.WriteString(w, "done")
		case <-r.Context().Done():
			http.Error(w, "cancelled", 500)
		}
	}))
	mux.HandleFunc("/bounded", bounded(writeTimeout/2, func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		io.WriteString(w, context.Cause(r.Context()).Error())
	}))
	addr := "@ftkit-bounded-test-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux, WriteTimeout: writeTimeout}
	go srv.Serve(ln)
	defer srv.Close()
	c := &http.Client{Timeout: failAfter, Transport: &http.Transport{
		DialContext: func(context.Context, string, string) (net.Conn, error) { return net.Dial("unix", addr) },
	}}
	for path, want := range map[string]string{"/long": "done", "/bounded": "context deadline exceeded"} {
		resp, err := c.Get("http://agent" + path)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != want {
			t.Errorf("%s: %d %q, want %q", path, resp.StatusCode, b, want)
		}
	}
}

// TestAPIStartJobOnHost: ?host= hands the spec to the backend's forwarding with the caller's own uid and
// gid (from SO_PEERCRED, never from the request), and the answer is the target's record.
func TestAPIStartJobOnHost(t *testing.T) {
	h := Handler(newFakeBackend(t), DefaultLimits())
	owner := testenv.LiveCaller(t, asOwner.Uid, asOwner.Gid)
	w := call(t, h, owner, "POST", "/v1/jobs?host=node2", `{"name":"run-node2","argv":["orted"],"dir":"/shared","uid":0}`)
	if w.Code != http.StatusCreated {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	var j agent.Job
	if err := json.Unmarshal(w.Body.Bytes(), &j); err != nil {
		t.Fatal(err)
	}
	if j.Node != "node2" || j.UID != owner.Uid || j.GID != owner.Gid || j.Dir != "/jobs/run-node2-1" {
		t.Errorf("job %+v; want node2's record of a job of uid %d", j, owner.Uid)
	}
	if w := call(t, h, owner, "POST", "/v1/jobs?host=node9", `{"argv":["orted"]}`); w.Code != http.StatusUnprocessableEntity {
		t.Errorf("start on an unknown host: status %d; want 422", w.Code)
	}
}

// TestAPIRestoreForceIsRoots: a job's owner may ask for a restore, but not force one past the members'
// record of where the job runs; root may.
func TestAPIRestoreForceIsRoots(t *testing.T) {
	h := Handler(newFakeBackend(t), DefaultLimits())
	for _, tt := range []struct {
		name string
		cred *unix.Ucred
		body string
		code int
		want string
	}{
		{"forced by the owner", asOwner, `{"snapshot":"s1","force":true}`, 403, "for root"},
		{"by the owner", asOwner, `{"snapshot":"s1"}`, 500, errFake.Error()},
		{"forced by root", asRoot, `{"snapshot":"s1","force":true}`, 500, errFake.Error()},
	} {
		t.Run(tt.name, func(t *testing.T) {
			w := call(t, h, tt.cred, "POST", "/v1/restore", tt.body)
			if w.Code != tt.code || !strings.Contains(w.Body.String(), tt.want) {
				t.Fatalf("%d %s, want %d %q", w.Code, w.Body.String(), tt.code, tt.want)
			}
		})
	}
}

// TestAPIRunOps: coordinated snapshots and rollbacks stop jobs of every user on every host: root only;
// a request without a run is refused; a run without a cut is not found.
func TestAPIRunOps(t *testing.T) {
	h := Handler(newFakeBackend(t), DefaultLimits())
	for _, tt := range []struct {
		name, path, body string
		cred             *unix.Ucred
		code             int
		want             string
	}{
		{"cut as root", "/v1/cut", `{"run":"r1"}`, asRoot, 200, `"id":"cut-1"`},
		{"cut as a user", "/v1/cut", `{"run":"r1"}`, asOwner, 403, "for root"},
		{"cut without a run", "/v1/cut", `{}`, asRoot, 400, "needs a run"},
		{"rollback as a user", "/v1/rollback", `{"run":"r1"}`, asOther, 403, "for root"},
		{"rollback without a cut", "/v1/rollback", `{"run":"r1"}`, asRoot, 404, "no coordinated snapshot of run r1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			w := call(t, h, tt.cred, "POST", tt.path, tt.body)
			if w.Code != tt.code || !strings.Contains(w.Body.String(), tt.want) {
				t.Fatalf("%d %s, want %d %q", w.Code, w.Body.String(), tt.code, tt.want)
			}
		})
	}
}

// A user has one checkpoint under way at a time, however short the floor: the next waits for the host's
// snapshot lock, and a user's queued requests would hold it back to back, before other users' scheduled
// snapshots. Root is not limited; another user is not held up by the first.
func TestAPICheckpointOneAtATimePerUser(t *testing.T) {
	fb := newFakeBackend(t)
	fb.floor = time.Nanosecond // spacing alone lets every request below through
	for _, j := range []agent.Job{{ID: "mine-1", UID: asOwner.Uid, State: agent.JobRunning}, {ID: "theirs-1", UID: asOther.Uid, State: agent.JobRunning}} {
		fb.addJob(t, j)
	}
	entered, release := make(chan string, 8), make(chan struct{})
	fb.checkpoint = func(ctx context.Context, jobs []string, uid uint32) ([]agent.SnapshotResult, error) {
		entered <- strconv.Itoa(int(uid))
		select {
		case <-release: // the dump, done
		case <-ctx.Done():
		}
		return nil, errFake
	}
	h := Handler(fb, DefaultLimits())
	first := make(chan int, 1)
	go func() { first <- call(t, h, asOwner, "POST", "/v1/checkpoint", `{"jobs":["mine-1"]}`).Code }()
	select {
	case <-entered:
	case <-time.After(failAfter):
		t.Fatal("the first checkpoint did not reach the agent")
	}
	second := make(chan *httptest.ResponseRecorder, 1)
	go func() { second <- call(t, h, asOwner, "POST", "/v1/checkpoint", `{"jobs":["mine-1"]}`) }()
	select {
	case w := <-second:
		if w.Code != http.StatusTooManyRequests || !strings.Contains(w.Body.String(), "under way") {
			t.Errorf("a second checkpoint of uid %d while its first is under way: %d %s, want 429", asOwner.Uid, w.Code, w.Body.String())
		}
	case <-entered:
		close(release)
		<-second
		<-first
		t.Fatalf("a second checkpoint of uid %d reached the agent while its first was under way: it waits for the snapshot lock", asOwner.Uid)
	}
	// Root, and another user, are not held up by it.
	for _, c := range []*unix.Ucred{asRoot, asOther} {
		done := make(chan int, 1)
		go func() { done <- call(t, h, c, "POST", "/v1/checkpoint", `{}`).Code }()
		select {
		case <-entered:
		case <-time.After(failAfter):
			t.Fatalf("a checkpoint of uid %d did not reach the agent", c.Uid)
		}
		defer func() { <-done }()
	}
	close(release)
	if code := <-first; code != http.StatusInternalServerError {
		t.Errorf("the first checkpoint: %d, want the fake's 500", code)
	}
	// Its answer given, the user may ask again (the floor has passed).
	if w := call(t, h, asOwner, "POST", "/v1/checkpoint", `{"jobs":["mine-1"]}`); w.Code != http.StatusInternalServerError {
		t.Errorf("a checkpoint after the first ended: %d %s, want the fake's 500", w.Code, w.Body.String())
	}
}
