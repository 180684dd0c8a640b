package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sort"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/ring"
)

// The local API is HTTP/JSON on a unix socket. Callers are identified by SO_PEERCRED, never by anything
// they send: root may do anything, another uid sees and acts on its own jobs only.

type credKey struct{}

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

func (a *Agent) routes() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.status(callerOf(r).Uid))
	})
	mux.HandleFunc("GET /v1/jobs", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.Jobs(callerOf(r).Uid))
	})
	mux.HandleFunc("POST /v1/jobs", func(w http.ResponseWriter, r *http.Request) {
		var spec JobSpec
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&spec); err != nil {
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
	mux.HandleFunc("GET /v1/jobs/{id}", func(w http.ResponseWriter, r *http.Request) {
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
	mux.HandleFunc("POST /v1/checkpoint", func(w http.ResponseWriter, r *http.Request) {
		var req CheckpointRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("checkpoint request: %w", err))
			return
		}
		res, err := a.Checkpoint(r.Context(), req.Jobs, callerOf(r).Uid)
		if errors.Is(err, ErrNoJob) {
			writeError(w, http.StatusNotFound, err)
			return
		}
		if err != nil && len(res) == 0 {
			writeError(w, http.StatusInternalServerError, err)
			return
		}
		writeJSON(w, http.StatusOK, CheckpointReply{Results: res, Error: errString(err)})
	})
	mux.HandleFunc("GET /v1/snapshots", func(w http.ResponseWriter, r *http.Request) {
		ms, err := a.Snapshots(r.URL.Query().Get("job"), callerOf(r).Uid)
		if err != nil {
			writeError(w, http.StatusInternalServerError, err)
			return
		}
		writeJSON(w, http.StatusOK, ms)
	})
	mux.HandleFunc("POST /v1/restore", func(w http.ResponseWriter, r *http.Request) {
		var req RestoreRequest
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil || req.Snapshot == "" {
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
	})
	mux.HandleFunc("POST /v1/spares", func(w http.ResponseWriter, r *http.Request) {
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
	mux.HandleFunc("GET /v1/events", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, a.Failures())
	})
	mux.HandleFunc("GET /v1/log/conns", func(w http.ResponseWriter, r *http.Request) {
		if callerOf(r).Uid != 0 {
			writeError(w, http.StatusForbidden, errors.New("the log holds every job's traffic: root only"))
			return
		}
		writeJSON(w, http.StatusOK, a.LoggedConns())
	})
	mux.HandleFunc("POST /v1/jobs/{id}/signal", func(w http.ResponseWriter, r *http.Request) {
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
		if err := unix.Kill(j.PID, unix.Signal(req.Signal)); err != nil {
			writeError(w, http.StatusInternalServerError, fmt.Errorf("signal job %s: %w", j.ID, err))
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	return mux
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
	srv := &http.Server{
		Handler:           a.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			cred, err := peerCred(c)
			if err != nil {
				// No credentials, no access: the handler sees nil and the request is refused below.
				return ctx
			}
			return context.WithValue(ctx, credKey{}, cred)
		},
	}
	srv.Handler = requireCred(srv.Handler)
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("local API stopped", "err", err)
		}
	}()
	a.log.Info("local API listening", "socket", path)
	return srv, nil
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
