package agent

import (
	"context"
	"fmt"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ring"
)

// A run's launcher (ftctl mpirun's launch-daemon, what MPI runs instead of ssh) starts the run's part on
// another host through its own host's agent, which forwards the job spec and its caller's identity (from
// SO_PEERCRED) to the target's agent over the cluster protocol. The target believes the identity because
// the request comes from an authenticated, alive member: a member certificate lets its holder start jobs
// as any user on every member, as slurmctld does through slurmd (docs/deploy.md, security model).

// StartJobOn starts spec as uid:gid on member host: here if host is this agent's own name, else through
// host's agent. The job record returned is the target's (its ID, Node and the cluster-wide Dir).
func (a *Agent) StartJobOn(ctx context.Context, host string, spec JobSpec, uid, gid uint32) (*Job, error) {
	if host == "" || host == a.cfg.Name {
		return a.StartJob(ctx, spec, uid, gid)
	}
	m, ok := a.member(host)
	if !ok || m.State != ring.StateAlive {
		return nil, fmt.Errorf("start a job on %s: not an alive member of this cluster (see ftctl status)", host)
	}
	rep, err := a.peers().StartJob(ctx, host, startRequest(spec, uid, gid))
	if err != nil {
		return nil, fmt.Errorf("start the job on %s through its agent: %w", host, err)
	}
	a.log.Info("job started on another member", "host", host, "job", rep.ID, "uid", uid)
	return &Job{ID: rep.ID, Spec: spec, UID: uid, GID: gid, Node: rep.Node, PID: rep.PID, State: JobRunning, Dir: rep.Dir}, nil
}

// startRequest is spec as a start-job request, whose Validate bounds what any caller may ask for.
func startRequest(spec JobSpec, uid, gid uint32) clusterapi.StartJobRequest {
	req := clusterapi.StartJobRequest{
		Name: spec.Name, Argv: spec.Argv, Env: spec.Env, Dir: spec.Dir, Interval: spec.Interval, UID: uid, GID: gid,
		JobAddress: spec.JobAddress, Run: spec.Run, Recovery: spec.Recovery, Limits: spec.Limits,
	}
	if req.Dir == "" {
		req.Dir = "/"
	}
	if p := spec.Placement; p != nil {
		req.Placement = &clusterapi.StartJobPlacement{Hosts: p.Hosts, Spares: p.Spares}
	}
	return req
}

// serveStartJob starts a job a member forwards for one of its local callers. The request is validated
// (clusterapi); the sender must be an alive member (a failed one's certificate still authenticates).
func (a *Agent) serveStartJob(ctx context.Context, peer string, req clusterapi.StartJobRequest) (clusterapi.StartJobReply, error) {
	if m, ok := a.member(peer); !ok || m.State != ring.StateAlive {
		return clusterapi.StartJobReply{}, &clusterapi.Error{Code: clusterapi.CodeRefused,
			Message: fmt.Sprintf("start-job from %s: not an alive member in this host's view", peer)}
	}
	if err := req.Validate(); err != nil { // the server did; a direct caller (tests) may not have
		return clusterapi.StartJobReply{}, &clusterapi.Error{Code: clusterapi.CodeBadRequest, Message: err.Error()}
	}
	spec := JobSpec{Name: req.Name, Argv: req.Argv, Env: req.Env, Dir: req.Dir, Interval: req.Interval, JobAddress: req.JobAddress, Run: req.Run, Recovery: req.Recovery, Limits: req.Limits}
	if p := req.Placement; p != nil {
		spec.Placement = &Placement{Hosts: p.Hosts, Spares: p.Spares}
	}
	a.log.Info("job start asked by a member", "peer", peer, "name", req.Name, "uid", req.UID)
	j, err := a.StartJob(ctx, spec, req.UID, req.GID)
	if err != nil {
		return clusterapi.StartJobReply{}, fmt.Errorf("start job %q for %s: %w", req.Name, peer, err)
	}
	return clusterapi.StartJobReply{ID: j.ID, Node: j.Node, PID: j.PID, Dir: j.Dir}, nil
}

func (s peerService) StartJob(ctx context.Context, peer string, req clusterapi.StartJobRequest) (clusterapi.StartJobReply, error) {
	return s.a.serveStartJob(ctx, peer, req)
}

func (s peerService) Coordinate(ctx context.Context, peer string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	return s.a.serveCoordinate(ctx, peer, req)
}
