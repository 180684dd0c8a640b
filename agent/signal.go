package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/shim"
)

// A user's handle on a job is its own host's agent (ftwrap's Ctrl-C, ftctl kill), which keeps the job's
// record after the job went elsewhere: migrated (MovedTo) or, lost here, restored by a failover (the
// failure timeline's target). Such a signal is passed to that host's agent (clusterapi.OpSignal), one hop
// only: that agent signals its running copy or refuses. Before, it was refused here ("job ID is moved"),
// and neither a Ctrl-C nor the second one that kills could stop the job through ftwrap.

// SignalElsewhere passes sig, sent by uid (the job's owner or root: the caller checked) to job j that
// left this host, to the host j went to. It returns that host ("" if this agent knows of none: the
// signal is refused as before) and the error of passing it.
func (a *Agent) SignalElsewhere(ctx context.Context, j Job, uid uint32, sig int) (string, error) {
	host := a.wentTo(j)
	if host == "" {
		return "", nil
	}
	req := clusterapi.SignalRequest{Job: j.ID, UID: uid, Signal: sig}
	if err := a.peers().Signal(ctx, host, req); err != nil {
		return host, fmt.Errorf("pass signal %d for job %s to %s, where it went: %w", sig, j.ID, host, err)
	}
	a.log.Info("signal passed to the job's host", "job", j.ID, "host", host, "signal", sig, "uid", uid)
	return host, nil
}

// wentTo is the host job j went to from here: the migration's target, or for a job lost here, the
// target of the newest recovery that names it.
func (a *Agent) wentTo(j Job) string {
	switch j.State {
	case JobMoved:
		return j.MovedTo
	case JobLost:
	default:
		return ""
	}
	var newest *Failure
	for _, f := range a.failures.List() {
		if f.Target == "" || f.Target == a.cfg.Name || !slices.Contains(f.Jobs, j.ID) {
			continue
		}
		if newest == nil || f.Detected.After(newest.Detected) {
			newest = f
		}
	}
	if newest == nil {
		return ""
	}
	return newest.Target
}

// serveSignal signals this host's running copy of a job for a caller of member peer, if req.UID owns it
// (or is root). It never passes the signal on: a job that left here too is refused, as locally.
func (a *Agent) serveSignal(peer string, req clusterapi.SignalRequest) error {
	if m, ok := a.member(peer); !ok || m.State != ring.StateAlive {
		return &clusterapi.Error{Code: clusterapi.CodeRefused,
			Message: fmt.Sprintf("signal from %s: not an alive member in this host's view", peer)}
	}
	if err := req.Validate(); err != nil { // the server did; a direct caller (tests) may not have
		return &clusterapi.Error{Code: clusterapi.CodeBadRequest, Message: err.Error()}
	}
	j, _, err := a.Job(req.Job, req.UID)
	if err != nil {
		return &clusterapi.Error{Code: clusterapi.CodeRefused, Message: err.Error()}
	}
	if j.State != JobRunning {
		return &clusterapi.Error{Code: clusterapi.CodeRefused, Message: fmt.Sprintf("job %s is %s on %s", j.ID, j.State, a.cfg.Name)}
	}
	err = shim.Signal(j.PID, j.Cgroup, unix.Signal(req.Signal))
	if errors.Is(err, shim.ErrJobGone) {
		return &clusterapi.Error{Code: clusterapi.CodeRefused, Message: fmt.Sprintf("job %s: %v", j.ID, err)}
	}
	if err != nil {
		return fmt.Errorf("signal job %s: %w", j.ID, err)
	}
	a.log.Info("job signalled for a member's caller", "peer", peer, "job", j.ID, "signal", req.Signal, "uid", req.UID)
	return nil
}

func (s peerService) Signal(_ context.Context, peer string, req clusterapi.SignalRequest) error {
	return s.a.serveSignal(peer, req)
}
