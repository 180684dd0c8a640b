package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/shim"
)

// The local API is HTTP/JSON on a unix socket. Callers are identified by SO_PEERCRED, never by anything
// they send: root may do anything, another uid sees and acts on its own jobs only.

type credKey struct{}

// withCaller records the caller's credentials in a request's context, as read from its connection.
func withCaller(ctx context.Context, cred *unix.Ucred) context.Context {
	return context.WithValue(ctx, credKey{}, cred)
}

// peerCred reads the connecting process's credentials from a unix socket.
func peerCred(c net.Conn) (*unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, errors.New("not a unix socket")
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

func callerOf(r *http.Request) *unix.Ucred {
	c, _ := r.Context().Value(credKey{}).(*unix.Ucred)
	return c
}

// Status is what GET /v1/status returns.
type Status struct {
	Node      string        `json:"node"`
	Role      Role          `json:"role"`
	Protector string        `json:"protector,omitempty"`
	Mode      Mode          `json:"mode"`
	Interval  string        `json:"interval"`
	Epoch     uint64        `json:"epoch"` // of the membership view
	Members   []ring.Member `json:"members"`
	Busy      string        `json:"busy,omitempty"` // checkpoint or restore in progress
	Jobs      []Job         `json:"jobs"`
	Version   string        `json:"version"`
	CRIU      string        `json:"criu"`
	Log       *LogStatus    `json:"log,omitempty"`
}

func (a *Agent) status(uid uint32) Status {
	v := a.View()
	self, _ := v.Member(a.cfg.Name)
	busy, _ := a.busy.Load().(string)
	s := Status{
		Node: a.cfg.Name, Role: Role(self.Role), Mode: a.cfg.Checkpoint.Mode, Interval: a.cfg.Checkpoint.Interval.String(),
		Epoch: v.Epoch, Members: v.Members, Busy: busy, Jobs: a.Jobs(uid), Version: version.Ftkit(), CRIU: a.criu.Binary,
		Log: a.logStatus(),
	}
	if p, ok := v.Protector(a.cfg.Name); ok {
		s.Protector = p.Name
	}
	return s
}

// apiLimits bound what one client of the local API can hold. The socket is open to every local user and
// the agent runs as root: a user must not be able to pin its goroutines or use up its file descriptors.
type apiLimits struct {
	readHeader time.Duration // to send the request line and headers
	read       time.Duration // to send the whole request (bodies are at most maxBody)
	idle       time.Duration // a kept-alive connection waiting for its next request
	respond    time.Duration // default bound on a handler and the write of its answer
	// Concurrent connections of one non-root uid, and of all non-root uids together; root is never refused
	// (ftctl as root must work while users misbehave). ftwrap keeps one connection per running job.
	connsPerUID, conns int
}

func defaultAPILimits() apiLimits {
	return apiLimits{readHeader: 10 * time.Second, read: 30 * time.Second, idle: 30 * time.Second,
		respond: time.Minute, connsPerUID: 128, conns: 1024}
}

const maxBody = 1 << 20 // a job spec with its environment is the largest request

// writeGrace is how long after its context ended a handler may still write its answer (the error).
const writeGrace = 5 * time.Second

// bounded limits how long h may take: its context ends after d, and writes to its answer fail writeGrace
// later. d = 0 lifts the server's default bound, for work whose length depends on the job (a dump, a
// restore): that work stops when the client goes away, and the per-uid connection limit caps how much of
// it one user holds.
func bounded(d time.Duration, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		if d <= 0 {
			rc.SetWriteDeadline(time.Time{}) // not supported by test recorders: nothing to lift there
			h(w, r)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), d)
		defer cancel()
		rc.SetWriteDeadline(time.Now().Add(d + writeGrace))
		h(w, r.WithContext(ctx))
	}
}

// readBody reads the whole request body before the handler runs (bodies are small). The read timeout then
// bounds only the sending of the request, and net/http goes on to watch the connection for the client going
// away, which cancels the handler's context: a dump or restore nobody waits for any more stops.
func readBody(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		if err != nil {
			code := http.StatusBadRequest
			if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
				code = http.StatusRequestEntityTooLarge
			}
			writeError(w, code, fmt.Errorf("read the request: %w", err))
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(b))
		h.ServeHTTP(w, r)
	})
}

// routes is the local API, refusing every request whose caller's credentials are unknown.
func (a *Agent) routes(lim apiLimits) http.Handler {
	mux := http.NewServeMux()
	handle := func(pattern string, h http.HandlerFunc) { mux.HandleFunc(pattern, bounded(lim.respond, h)) }
	handle("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.status(callerOf(r).Uid))
	})
	handle("GET /v1/jobs", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.Jobs(callerOf(r).Uid))
	})
	handle("POST /v1/jobs", func(w http.ResponseWriter, r *http.Request) {
		var spec JobSpec
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody)).Decode(&spec); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("job spec: %w", err))
			return
		}
		c := callerOf(r)
		j, err := a.StartJob(r.Context(), spec, c.Uid, c.Gid)
		if err != nil {
			writeError(w, http.StatusUnprocessableEntity, err)
			return
		}
		writeJSON(w, http.StatusCreated, j)
	})
	handle("GET /v1/jobs/{id}", func(w http.ResponseWriter, r *http.Request) {
		j, _, err := a.Job(r.PathValue("id"), callerOf(r).Uid)
		if err != nil {
			writeError(w, http.StatusNotFound, err)
			return
		}
		writeJSON(w, http.StatusOK, j)
	})
	// Long poll: returns when the job is no longer running, or after ?timeout= (default 30s) with its state.
	mux.HandleFunc("GET /v1/jobs/{id}/wait", func(w http.ResponseWriter, r *http.Request) {
		timeout := 30 * time.Second
		if t := r.URL.Query().Get("timeout"); t != "" {
			d, err := time.ParseDuration(t)
			if err != nil || d <= 0 || d > 10*time.Minute {
				writeError(w, http.StatusBadRequest, fmt.Errorf("timeout %q: use a duration up to 10m", t))
				return
			}
			timeout = d
		}
		// The answer may come as late as the poll allows (the loop below ends by then).
		http.NewResponseController(w).SetWriteDeadline(time.Now().Add(timeout + lim.respond + writeGrace))
		deadline := time.After(timeout)
		for {
			j, changed, err := a.Job(r.PathValue("id"), callerOf(r).Uid)
			if err != nil {
				writeError(w, http.StatusNotFound, err)
				return
			}
			if j.State != JobRunning {
				writeJSON(w, http.StatusOK, j)
				return
			}
			select {
			case <-changed:
			case <-deadline:
				writeJSON(w, http.StatusOK, j)
				return
			case <-r.Context().Done():
				return
			}
		}
	})
	gate := newCheckpointGate(a.cfg.Checkpoint.MinInterval.Duration)
	mux.HandleFunc("POST /v1/checkpoint", bounded(0, func(w http.ResponseWriter, r *http.Request) {
		var req CheckpointRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody)).Decode(&req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("checkpoint request: %w", err))
			return
		}
		uid := callerOf(r).Uid
		// Refused before any work: another user's job is "not found", as everywhere in this API.
		for _, id := range req.Jobs {
			if _, _, err := a.Job(id, uid); err != nil {
				writeError(w, http.StatusNotFound, err)
				return
			}
		}
		// Any user may ask for snapshots; like a job's interval, they may not come faster than the floor.
		if wait, ok := gate.allow(uid, time.Now()); !ok {
			w.Header().Set("Retry-After", strconv.Itoa(int(wait.Round(time.Second)/time.Second)+1))
			writeError(w, http.StatusTooManyRequests, fmt.Errorf("uid %d may ask for a checkpoint once every %s (checkpoint.min_interval): retry in %s",
				uid, a.cfg.Checkpoint.MinInterval, wait.Round(time.Millisecond)))
			return
		}
		res, err := a.Checkpoint(r.Context(), req.Jobs, uid)
		if errors.Is(err, ErrNoJob) {
			writeError(w, http.StatusNotFound, err)
			return
		}
		if err != nil && len(res) == 0 {
			writeError(w, http.StatusInternalServerError, err)
			return
		}
		writeJSON(w, http.StatusOK, CheckpointReply{Results: res, Error: errString(err)})
	}))
	handle("GET /v1/snapshots", func(w http.ResponseWriter, r *http.Request) {
		job := r.URL.Query().Get("job")
		if job != "" {
			if err := ckpt.ValidName(job); err != nil {
				writeError(w, http.StatusBadRequest, fmt.Errorf("job: %w", err))
				return
			}
		}
		ms, err := a.Snapshots(job, callerOf(r).Uid)
		if err != nil {
			writeError(w, http.StatusInternalServerError, err)
			return
		}
		writeJSON(w, http.StatusOK, ms)
	})
	mux.HandleFunc("POST /v1/restore", bounded(0, func(w http.ResponseWriter, r *http.Request) {
		var req RestoreRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody)).Decode(&req); err != nil || req.Snapshot == "" {
			writeError(w, http.StatusBadRequest, fmt.Errorf("restore request needs a snapshot id: %v", err))
			return
		}
		j, err := a.Restore(r.Context(), req, callerOf(r).Uid)
		switch {
		case errors.Is(err, ErrNoJob) || errors.Is(err, ckpt.ErrNotFound):
			writeError(w, http.StatusNotFound, err)
		case errors.Is(err, ErrCorruptSnapshot) || errors.Is(err, ErrJobAlive):
			writeError(w, http.StatusConflict, err)
		case err != nil:
			writeError(w, http.StatusInternalServerError, err)
		default:
			writeJSON(w, http.StatusOK, j)
		}
	}))
	handle("POST /v1/spares", func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("registering a spare changes the cluster: root only"))
			return
		}
		var req SpareRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("spare request: %w", err))
			return
		}
		v, err := a.AddSpare(r.Context(), req)
		if err != nil {
			writeError(w, http.StatusConflict, err)
			return
		}
		writeJSON(w, http.StatusOK, v)
	})
	handle("GET /v1/events", func(w http.ResponseWriter, r *http.Request) {
		uid := callerOf(r).Uid
		if uid == 0 {
			writeJSON(w, http.StatusOK, a.Failures())
			return
		}
		writeJSON(w, http.StatusOK, failuresFor(a.Failures(), a.ownerOf(uid)))
	})
	handle("GET /v1/log/conns", func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("the log holds every job's traffic: root only"))
			return
		}
		writeJSON(w, http.StatusOK, a.LoggedConns())
	})
	handle("POST /v1/jobs/{id}/signal", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Signal int `json:"signal"`
		}
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&req); err != nil || req.Signal <= 0 || req.Signal > 64 {
			writeError(w, http.StatusBadRequest, errors.New("signal: give a signal number from 1 to 64"))
			return
		}
		j, _, err := a.Job(r.PathValue("id"), callerOf(r).Uid)
		if err != nil {
			writeError(w, http.StatusNotFound, err)
			return
		}
		if j.State != JobRunning {
			writeError(w, http.StatusConflict, fmt.Errorf("job %s is %s", j.ID, j.State))
			return
		}
		err = shim.Signal(j.PID, j.Cgroup, unix.Signal(req.Signal))
		if errors.Is(err, shim.ErrJobGone) {
			writeError(w, http.StatusConflict, fmt.Errorf("job %s: %w", j.ID, err))
			return
		}
		if err != nil {
			writeError(w, http.StatusInternalServerError, fmt.Errorf("signal job %s: %w", j.ID, err))
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	return requireCred(readBody(mux))
}

// serveLocal listens on the configured unix socket until ctx ends.
func (a *Agent) serveLocal(ctx context.Context) (*http.Server, error) {
	path := a.cfg.Socket
	// A socket file left by a crashed agent: remove it only if nobody answers on it.
	if c, err := net.Dial("unix", path); err == nil {
		c.Close()
		return nil, fmt.Errorf("another agent is serving %s; stop it first", path)
	}
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// Anyone may connect; what they may do is decided per request from SO_PEERCRED.
	if err := os.Chmod(path, 0o666); err != nil {
		ln.Close()
		return nil, err
	}
	lim := defaultAPILimits()
	srv := a.localServer(ctx, lim)
	go func() {
		if err := srv.Serve(newCredListener(ln, lim, a.log)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("local API stopped", "err", err)
		}
	}()
	a.log.Info("local API listening", "socket", path)
	return srv, nil
}

// localServer is the local API's HTTP server; it serves a credListener, whose connections carry the
// caller's credentials.
func (a *Agent) localServer(ctx context.Context, lim apiLimits) *http.Server {
	return &http.Server{
		Handler:           a.routes(lim),
		ReadHeaderTimeout: lim.readHeader,
		// Covers the body too; once a handler has read the body, net/http lifts the read deadline to
		// watch for the client going away, so long polls and long restores are not cut by it.
		ReadTimeout:  lim.read,
		WriteTimeout: lim.respond, // routes set their own bound; this one covers the rest (a 404, say)
		IdleTimeout:  lim.idle,
		BaseContext:  func(net.Listener) context.Context { return ctx },
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if pc, ok := c.(*credConn); ok && pc.cred != nil {
				return withCaller(ctx, pc.cred)
			}
			// No credentials, no access: requireCred refuses every request.
			return ctx
		},
		ErrorLog: slog.NewLogLogger(a.log.Handler(), slog.LevelWarn), // accept errors: out of descriptors, say
	}
}

func requireCred(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r) == nil {
			writeError(w, http.StatusForbidden, errors.New("caller credentials unavailable"))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// apiError is the body of every non-2xx answer.
type apiError struct {
	Error string `json:"error"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, apiError{Error: err.Error()})
}

func sortJobs(js []Job) {
	sort.Slice(js, func(a, b int) bool { return js[a].Created.Before(js[b].Created) })
}

// CheckpointRequest asks for snapshots of the given jobs now (all of the host's if empty).
type CheckpointRequest struct {
	Jobs []string `json:"jobs,omitempty"`
}

// CheckpointReply lists the snapshots taken; Error reports the jobs that failed, if any.
type CheckpointReply struct {
	Results []SnapshotResult `json:"results"`
	Error   string           `json:"error,omitempty"`
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// credListener reads each connection's SO_PEERCRED at accept and caps the connections of non-root uids.
// A connection over the cap is refused on a goroutine of its own, so that one user's flood never blocks the
// accept loop for another.
type credListener struct {
	net.Listener
	lim      apiLimits
	log      *slog.Logger
	refusing chan struct{} // a slot per connection being refused
	mu       sync.Mutex
	byUID    map[uint32]int
	total    int
	refused  int       // since the last warning
	warned   time.Time // of the last warning
}

// maxRefusing bounds the connections being answered with a refusal at once; beyond, they are just closed.
const maxRefusing = 32

func newCredListener(ln net.Listener, lim apiLimits, log *slog.Logger) *credListener {
	return &credListener{Listener: ln, lim: lim, log: log, byUID: map[uint32]int{}, refusing: make(chan struct{}, maxRefusing)}
}

// credConn is an accepted connection with its caller's credentials (nil if unreadable).
type credConn struct {
	net.Conn
	cred    *unix.Ucred
	release func()
	once    sync.Once
}

func (c *credConn) Close() error {
	c.once.Do(c.release)
	return c.Conn.Close()
}

func (l *credListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		cred, err := peerCred(c)
		if err != nil {
			// Served, and refused per request by requireCred: the client learns why.
			l.log.Warn("local API: caller credentials unavailable", "err", err)
			return &credConn{Conn: c, release: func() {}}, nil
		}
		if err := l.acquire(cred.Uid); err != nil {
			select {
			case l.refusing <- struct{}{}:
				go func() {
					defer func() { <-l.refusing }()
					refuse(c, err)
				}()
			default:
				c.Close()
			}
			continue
		}
		return &credConn{Conn: c, cred: cred, release: func() { l.release(cred.Uid) }}, nil
	}
}

// acquire counts a connection of uid, or says why it is over the limits.
func (l *credListener) acquire(uid uint32) error {
	if uid == 0 {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var err error
	switch {
	case l.byUID[uid] >= l.lim.connsPerUID:
		err = fmt.Errorf("uid %d already has %d connections to the agent, its limit: close some", uid, l.byUID[uid])
	case l.total >= l.lim.conns:
		err = fmt.Errorf("the agent already serves %d connections of users, its limit: retry later", l.total)
	default:
		l.byUID[uid]++
		l.total++
		return nil
	}
	// A flood of refusals must not flood the log too.
	if l.refused++; time.Since(l.warned) >= 10*time.Second {
		l.log.Warn("local API: connections refused", "count", l.refused, "last_uid", uid, "err", err)
		l.refused, l.warned = 0, time.Now()
	}
	return err
}

func (l *credListener) release(uid uint32) {
	if uid == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byUID[uid]--; l.byUID[uid] <= 0 {
		delete(l.byUID, uid)
	}
	l.total--
}

// refuse answers a connection that is over the limits with a 503 and closes it. The request is read
// first (briefly, and only its head): an HTTP client that gets an answer before it has sent its request
// reports a broken pipe instead of the reason.
func refuse(c net.Conn, why error) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := http.ReadRequest(bufio.NewReader(io.LimitReader(c, 16<<10))); err != nil {
		return
	}
	body, _ := json.Marshal(apiError{Error: why.Error()})
	fmt.Fprintf(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

// checkpointGate spaces the manual checkpoints each non-root uid asks for by checkpoint.min_interval: the
// floor on job intervals would mean little if any user could ask for a dump in a loop.
type checkpointGate struct {
	every time.Duration
	mu    sync.Mutex
	last  map[uint32]time.Time
}

func newCheckpointGate(every time.Duration) *checkpointGate {
	return &checkpointGate{every: every, last: map[uint32]time.Time{}}
}

// allow records a request of uid at now, or says how long it must wait.
func (g *checkpointGate) allow(uid uint32, now time.Time) (time.Duration, bool) {
	if uid == 0 {
		return 0, true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for u, t := range g.last { // the map holds at most the uids of the last interval
		if now.Sub(t) >= g.every {
			delete(g.last, u)
		}
	}
	if t, ok := g.last[uid]; ok {
		return g.every - now.Sub(t), false
	}
	g.last[uid] = now
	return 0, true
}

// failuresFor is what a non-root caller may see of the failure timelines: those that concern at least one
// of its jobs, reduced to its jobs. Other users' job ids, the stages of their jobs and the errors naming
// them are left out; node-level stages keep where and when (who failed, who detected it, where its jobs
// went: the membership view every user can read says as much) without their details.
func failuresFor(all []*Failure, owns func(job string) bool) []*Failure {
	out := []*Failure{}
	for _, f := range all {
		var jobs []string
		for _, j := range f.Jobs {
			if owns(j) {
				jobs = append(jobs, j)
			}
		}
		if len(jobs) == 0 {
			continue
		}
		c := *f
		c.Jobs = jobs
		c.Stages = nil
		for _, st := range f.Stages {
			switch {
			case st.Job == "":
				c.Stages = append(c.Stages, Stage{Name: st.Name, Host: st.Host, Start: st.Start, End: st.End})
			case owns(st.Job):
				c.Stages = append(c.Stages, st)
			}
		}
		if c.Error != "" && len(jobs) < len(f.Jobs) {
			c.Error = "the recovery of some jobs failed or is incomplete; ask the administrator for details"
		}
		out = append(out, &c)
	}
	return out
}

// ownerOf tells whether uid owns a job: one this host runs or ran, or one of whose snapshots it holds
// (the protector that handled a failure holds the failed node's replicas; its spare runs the jobs).
func (a *Agent) ownerOf(uid uint32) func(job string) bool {
	mine := map[string]bool{}
	for _, j := range a.Jobs(uid) {
		mine[j.ID] = true
	}
	return func(job string) bool {
		if mine[job] {
			return true
		}
		if a.store == nil || ckpt.ValidName(job) != nil {
			return false
		}
		ids, err := a.store.List(job, "")
		if err != nil || len(ids) == 0 {
			return false
		}
		m, err := a.store.Manifest(job, ids[0])
		return err == nil && a.ownsSnapshot(m, uid)
	}
}
