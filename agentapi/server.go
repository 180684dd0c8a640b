// Package agentapi is the local API of ftagent, HTTP/JSON on a unix socket, and its client (ftctl,
// ftwrap). The server answers from a Backend (the agent) with what the caller may see: callers are
// identified by SO_PEERCRED (creds.go), root sees and may do anything, another uid sees and acts on its
// own jobs only, and every user's share of the agent (connections, request sizes and times, checkpoints
// asked for) is bounded.
package agentapi

import (
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
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/shim"
)

// Backend is what the API serves: the agent. Each method takes the caller's uid and shows or acts on only
// what that uid may (everything for root); a job another uid may not see is agent.ErrNoJob.
type Backend interface {
	Status(uid uint32) agent.Status
	Jobs(uid uint32) []agent.Job
	// Job returns a job and a channel closed at its next change (for long polls).
	Job(id string, uid uint32) (agent.Job, <-chan struct{}, error)
	// StartJobOn starts a job as uid:gid on member host ("" or this host's name: here; another member: through
	// its agent, which believes this agent's word for uid and gid).
	StartJobOn(ctx context.Context, host string, spec agent.JobSpec, uid, gid uint32) (*agent.Job, error)
	Checkpoint(ctx context.Context, jobs []string, uid uint32) ([]agent.SnapshotResult, error)
	// CheckpointFloor is the shortest time between two checkpoints a non-root uid may ask for.
	CheckpointFloor() time.Duration
	Snapshots(job string, uid uint32) ([]*ckpt.Manifest, error)
	Restore(ctx context.Context, req agent.RestoreRequest, uid uint32) (*agent.Job, error)
	Migrate(ctx context.Context, req agent.MigrateRequest, uid uint32) (*agent.Migration, error)
	Drain(ctx context.Context, req agent.DrainRequest, uid uint32) (*agent.DrainResult, error)
	CoordinatedSnapshot(ctx context.Context, req coordinated.RunRequest, uid uint32) (*coordinated.Cut, error)
	Rollback(ctx context.Context, req coordinated.RunRequest, uid uint32) (*coordinated.Rollback, error)
	AddSpare(ctx context.Context, req agent.SpareRequest) (ring.View, error)
	Events(uid uint32) []*agent.Failure
	LoggedConns() []agent.LoggedConn
	// SignalElsewhere passes a signal from uid for job j, which left this host, to the host it went to
	// ("" if none is known).
	SignalElsewhere(ctx context.Context, j agent.Job, uid uint32, sig int) (string, error)
}

var _ Backend = (*agent.Agent)(nil)

// Limits bound what one client of the local API can hold. The socket is open to every local user and
// the agent runs as root: a user must not be able to pin its goroutines or use up its file descriptors.
type Limits struct {
	readHeader time.Duration // to send the request line and headers
	read       time.Duration // to send the whole request (bodies are at most maxBody)
	idle       time.Duration // a kept-alive connection waiting for its next request
	respond    time.Duration // default bound on a handler and the write of its answer
	// Concurrent connections of one non-root uid, and of all non-root uids together; root is never refused
	// (ftctl as root must work while users misbehave). ftwrap keeps one connection per running job.
	connsPerUID, conns int
}

func DefaultLimits() Limits {
	return Limits{readHeader: 10 * time.Second, read: 30 * time.Second, idle: 30 * time.Second,
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

// Handler is the local API served from a, refusing every request whose caller's credentials are unknown.
func Handler(a Backend, lim Limits) http.Handler {
	mux := http.NewServeMux()
	handle := func(pattern string, h http.HandlerFunc) { mux.HandleFunc(pattern, bounded(lim.respond, h)) }
	handle("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.Status(callerOf(r).Uid))
	})
	handle("GET /v1/jobs", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.Jobs(callerOf(r).Uid))
	})
	handle("POST /v1/jobs", func(w http.ResponseWriter, r *http.Request) {
		var spec agent.JobSpec
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody)).Decode(&spec); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("job spec: %w", err))
			return
		}
		// ?host=NAME: start it on that member (a run's launcher starting its part on another host).
		c := callerOf(r)
		// The job runs with its caller's resource limits, read from its process, never taken from what it
		// sends. Unknown because the caller is gone or its PID names another user's process, a user's job is
		// refused: a login session's limits, and the agent's own for the rest, may be far above the user's,
		// who can make them unknown at will (by exiting once the request is sent). Unreadable to an agent
		// without CAP_SYS_RESOURCE (EPERM for every caller, which no user chooses), and for root, a session's.
		var err error
		if spec.Limits, err = callerLimits(c); err != nil && c.Uid != 0 && !errors.Is(err, unix.EPERM) {
			writeError(w, http.StatusForbidden, fmt.Errorf("a job runs with the resource limits of the process that asks for it, and those of process %d cannot be read: %w; ask from a process that waits for the answer (ftwrap does)", c.Pid, err))
			return
		}
		// And with its umask, not the agent's (its unit's UMask=0077); unknown (only if the process went since
		// its limits were read, or for root's), the shim gives login's 022.
		spec.Umask = callerUmask(c)
		j, err := a.StartJobOn(r.Context(), r.URL.Query().Get("host"), spec, c.Uid, c.Gid)
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
			if j.State != agent.JobRunning {
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
	gate := newCheckpointGate(a.CheckpointFloor())
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
		// One at a time per user: another would wait for the host's snapshot lock, and queued ones would hold
		// it back to back, whatever the floor below.
		end, ok := gate.start(uid)
		if !ok {
			writeError(w, http.StatusTooManyRequests, fmt.Errorf("uid %d already has a checkpoint under way on this host: wait for its answer, then ask again", uid))
			return
		}
		defer end()
		// Any user may ask for snapshots; like a job's interval, they may not come faster than the floor.
		asked := time.Now()
		if wait, ok := gate.allow(uid, asked); !ok {
			w.Header().Set("Retry-After", strconv.Itoa(int(wait.Round(time.Second)/time.Second)+1))
			writeError(w, http.StatusTooManyRequests, fmt.Errorf("uid %d may ask for a checkpoint once every %s (checkpoint.min_interval): retry in %s",
				uid, a.CheckpointFloor(), wait.Round(time.Millisecond)))
			return
		}
		res, err := a.Checkpoint(r.Context(), req.Jobs, uid)
		if len(res) == 0 && (errors.Is(err, agent.ErrNoJob) || errors.Is(err, agent.ErrReplaying)) {
			// Refused before any dump (a named job ended, or is being replayed): nothing to space.
			gate.giveBack(uid, asked)
		}
		switch {
		case errors.Is(err, agent.ErrNoJob):
			writeError(w, http.StatusNotFound, err)
			return
		case errors.Is(err, agent.ErrReplaying):
			writeError(w, http.StatusConflict, err)
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
		var req agent.RestoreRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody)).Decode(&req); err != nil || req.Snapshot == "" {
			writeError(w, http.StatusBadRequest, fmt.Errorf("restore request needs a snapshot id: %v", err))
			return
		}
		// Forcing overrides the members' record of where the job runs: only the operator can know it runs
		// nowhere (its host powered off or fenced), and a second live incarnation corrupts its peers, which
		// may be other users' jobs.
		if req.Force && callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("a forced restore overrides the members' record of where the job runs: it is for root (the operator), who can make sure the job runs nowhere"))
			return
		}
		j, err := a.Restore(r.Context(), req, callerOf(r).Uid)
		switch {
		case errors.Is(err, agent.ErrNoJob) || errors.Is(err, ckpt.ErrNotFound):
			writeError(w, http.StatusNotFound, err)
		case errors.Is(err, agent.ErrCorruptSnapshot) || errors.Is(err, agent.ErrJobAlive) || errors.Is(err, agent.ErrRestoreUnderWay):
			writeError(w, http.StatusConflict, err)
		case err != nil:
			writeError(w, http.StatusInternalServerError, err)
		default:
			writeJSON(w, http.StatusOK, j)
		}
	}))
	mux.HandleFunc("POST /v1/migrate", bounded(0, func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("moving a job between hosts is for root (the operator)"))
			return
		}
		var req agent.MigrateRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&req); err != nil || req.Job == "" || req.To == "" {
			writeError(w, http.StatusBadRequest, fmt.Errorf("migrate request needs a job and a target host: %v", err))
			return
		}
		m, err := a.Migrate(r.Context(), req, callerOf(r).Uid)
		switch {
		case errors.Is(err, agent.ErrNoJob):
			writeError(w, http.StatusNotFound, err)
		case errors.Is(err, agent.ErrNotMovable):
			writeError(w, http.StatusConflict, err)
		case err != nil:
			writeError(w, http.StatusInternalServerError, err)
		default:
			writeJSON(w, http.StatusOK, m)
		}
	}))
	// A coordinated snapshot of a run, and the rollback of a run to its newest one (root only).
	runOp := func(what string, op func(ctx context.Context, req coordinated.RunRequest, uid uint32) (any, error)) http.HandlerFunc {
		return bounded(0, func(w http.ResponseWriter, r *http.Request) {
			if callerOf(r).Uid != 0 {
				writeError(w, http.StatusForbidden, fmt.Errorf("%s stops jobs on every host of a run: it is for root (the operator)", what))
				return
			}
			var req coordinated.RunRequest
			if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&req); err != nil || req.Run == "" {
				writeError(w, http.StatusBadRequest, fmt.Errorf("%s needs a run: %v", what, err))
				return
			}
			res, err := op(r.Context(), req, callerOf(r).Uid)
			switch {
			case errors.Is(err, coordinated.ErrNoRun), errors.Is(err, coordinated.ErrNoCut):
				writeError(w, http.StatusNotFound, err)
			case errors.Is(err, coordinated.ErrRefused), errors.Is(err, agent.ErrNotMovable):
				writeError(w, http.StatusConflict, err)
			case err != nil:
				writeError(w, http.StatusInternalServerError, err)
			default:
				writeJSON(w, http.StatusOK, res)
			}
		})
	}
	mux.HandleFunc("POST /v1/cut", runOp("a coordinated snapshot", func(ctx context.Context, req coordinated.RunRequest, uid uint32) (any, error) {
		return a.CoordinatedSnapshot(ctx, req, uid)
	}))
	mux.HandleFunc("POST /v1/rollback", runOp("a rollback", func(ctx context.Context, req coordinated.RunRequest, uid uint32) (any, error) {
		return a.Rollback(ctx, req, uid)
	}))
	mux.HandleFunc("POST /v1/drain", bounded(0, func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("draining a host is for root (the operator)"))
			return
		}
		var req agent.DrainRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBody)).Decode(&req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("drain request: %w", err))
			return
		}
		res, err := a.Drain(r.Context(), req, callerOf(r).Uid)
		switch {
		case errors.Is(err, agent.ErrNotMovable):
			writeError(w, http.StatusConflict, err)
		case err != nil:
			writeError(w, http.StatusInternalServerError, err)
		default:
			writeJSON(w, http.StatusOK, res)
		}
	}))
	handle("POST /v1/spares", func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("registering a spare changes the cluster: root only"))
			return
		}
		var req agent.SpareRequest
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
		writeJSON(w, http.StatusOK, a.Events(callerOf(r).Uid))
	})
	handle("GET /v1/log/conns", func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("the log holds every job's traffic: root only"))
			return
		}
		writeJSON(w, http.StatusOK, a.LoggedConns())
	})
	// Unbounded like a long poll: a followed output lasts as long as the job (the per-uid connection
	// limit caps how many one user holds).
	mux.HandleFunc("GET /v1/jobs/{id}/output", bounded(0, func(w http.ResponseWriter, r *http.Request) { serveOutput(a, w, r) }))
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
		if j.State != agent.JobRunning {
			// A job migrated or restored elsewhere is reached through its new host's agent: this one is its
			// user's only handle on it (ftwrap's Ctrl-C).
			host, err := a.SignalElsewhere(r.Context(), j, callerOf(r).Uid, req.Signal)
			switch {
			case host == "":
				writeError(w, http.StatusConflict, fmt.Errorf("job %s is %s", j.ID, j.State))
			case err != nil:
				writeError(w, http.StatusBadGateway, fmt.Errorf("job %s is %s here: %w", j.ID, j.State, err))
			default:
				w.WriteHeader(http.StatusNoContent)
			}
			return
		}
		err = shim.Signal(j.PID, j.Cgroup, unix.Signal(req.Signal))
		if errors.Is(err, shim.ErrJobGone) || errors.Is(err, shim.ErrNotDelivered) {
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

// Listen serves b's local API on the unix socket at path until ctx ends or the server is closed.
func Listen(ctx context.Context, path string, b Backend, log *slog.Logger) (*http.Server, error) {
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
	lim := DefaultLimits()
	srv := newServer(ctx, b, lim, log)
	go func() {
		if err := srv.Serve(newCredListener(ln, lim, log)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("local API stopped", "err", err)
		}
	}()
	log.Info("local API listening", "socket", path)
	return srv, nil
}

// newServer is the local API's HTTP server; it serves a credListener, whose connections carry the
// caller's credentials.
func newServer(ctx context.Context, b Backend, lim Limits, log *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           Handler(b, lim),
		ReadHeaderTimeout: lim.readHeader,
		// Covers the body too; once a handler has read the body, net/http lifts the read deadline to
		// watch for the client going away, so long polls and long restores are not cut by it.
		ReadTimeout:  lim.read,
		WriteTimeout: lim.respond, // routes set their own bound; this one covers the rest (a 404, say)
		IdleTimeout:  lim.idle,
		BaseContext:  func(net.Listener) context.Context { return ctx },
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if pc, ok := c.(*credConn); ok && pc.cred != nil {
				return WithCaller(ctx, pc.cred)
			}
			// No credentials, no access: requireCred refuses every request.
			return ctx
		},
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn), // accept errors: out of descriptors, say
	}
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

// CheckpointRequest asks for snapshots of the given jobs now (all of the host's if empty).
type CheckpointRequest struct {
	Jobs []string `json:"jobs,omitempty"`
}

// CheckpointReply lists the snapshots taken; Error reports the jobs that failed, if any.
type CheckpointReply struct {
	Results []agent.SnapshotResult `json:"results"`
	Error   string                 `json:"error,omitempty"`
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
