package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode"

	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/sitecmd"
	"github.com/ftkit/ftkit/ring"
)

// A run's launcher (ftctl mpirun's launch-daemon, what MPI runs instead of ssh) starts the run's part on
// another host through its own host's agent, which forwards the job spec and its caller's identity (from
// SO_PEERCRED) to the target's agent over the cluster protocol. The target believes the identity because
// the request comes from an authenticated, alive member: a member certificate lets its holder start jobs
// as any user on every member, as slurmctld does through slurmd (docs/deploy.md, security model). Whether
// the user may run anything on the target at all is the site's to say: the target runs its
// cluster.start_job_command, if set, before it starts a job a member forwarded (admitForwardedStart).

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
		JobAddress: spec.JobAddress, Run: spec.Run, Recovery: spec.Recovery, Limits: spec.Limits, Umask: spec.Umask,
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
	spec := JobSpec{Name: req.Name, Argv: req.Argv, Env: req.Env, Dir: req.Dir, Interval: req.Interval, JobAddress: req.JobAddress, Run: req.Run, Recovery: req.Recovery, Limits: req.Limits, Umask: req.Umask}
	if p := req.Placement; p != nil {
		spec.Placement = &Placement{Hosts: p.Hosts, Spares: p.Spares}
	}
	a.log.Info("job start asked by a member", "peer", peer, "name", req.Name, "uid", req.UID)
	if err := a.admitForwardedStart(ctx, peer, req); err != nil {
		return clusterapi.StartJobReply{}, err
	}
	j, err := a.StartJob(ctx, spec, req.UID, req.GID)
	if err != nil {
		return clusterapi.StartJobReply{}, fmt.Errorf("start job %q for %s: %w", req.Name, peer, err)
	}
	return clusterapi.StartJobReply{ID: j.ID, Node: j.Node, PID: j.PID, Dir: j.Dir}, nil
}

// maxRefusalReason bounds what of the start-job command's standard error goes back to the user.
const maxRefusalReason = 256

// admitForwardedStart runs cluster.start_job_command for a job member peer asks this host to start, and
// refuses the start unless it exits 0. Only a forwarded start is asked about, never a local one (StartJobOn
// with this host's name, ftwrap): a user on this host runs processes here anyway. Root's jobs are asked
// about too: the command decides (the shipped Slurm script admits root only where root runs a Slurm job).
func (a *Agent) admitForwardedStart(ctx context.Context, peer string, req clusterapi.StartJobRequest) error {
	why, slurmJob := a.startJobCommand(ctx, peer, req.UID, req.GID, req.Env)
	if why == "" {
		if len(a.cfg.Cluster.StartJobCommand) > 0 {
			a.log.Info("start-job command admitted a member's job", "peer", peer, "name", req.Name, "uid", req.UID, "slurm_job", slurmJob)
		}
		return nil
	}
	a.log.Warn("job start asked by a member refused: not admitted on this host", "peer", peer, "name", req.Name, "uid", req.UID, "gid", req.GID, "why", why)
	return &clusterapi.Error{Code: clusterapi.CodeRefused,
		Message: fmt.Sprintf("start-job from %s: uid %d (gid %d) may not start jobs on %s: %s", peer, req.UID, req.GID, a.cfg.Name, why)}
}

// admitPlacedRestore runs cluster.start_job_command before a fail-over that member peer asked for restores
// job j here, if j's placement names this host and j did not run here: the placement is the user's (ftctl
// mpirun, a hostfile), and a host it names was admitted only if a part of the run was started there. Else
// any user could name other users' (or unallocated) idle nodes as their run's spares or hosts and have
// their job restored there, next to other users' jobs, with no admission. Hosts the ring chose (a ring
// spare, a protector outside the placement) are the site's, as for jobs without a placement.
func (a *Agent) admitPlacedRestore(ctx context.Context, peer string, j Job) error {
	p := j.Spec.Placement
	if p == nil || j.Node == a.cfg.Name || !slices.Contains(p.Hosts, a.cfg.Name) && !slices.Contains(p.Spares, a.cfg.Name) {
		return nil
	}
	why, _ := a.startJobCommand(ctx, peer, j.UID, j.GID, j.Spec.Env)
	if why == "" {
		return nil
	}
	a.log.Warn("restore of a job whose placement names this host refused: its user is not admitted here", "peer", peer, "job", j.ID, "uid", j.UID, "gid", j.GID, "why", why)
	return fmt.Errorf("job %s not restored: its placement names %s, where uid %d (gid %d) may not start jobs: %s", j.ID, a.cfg.Name, j.UID, j.GID, why)
}

// startJobCommand runs cluster.start_job_command for uid:gid with env, a job's environment, on behalf of
// member peer; it returns why it refused ("": admitted, or no command set) and the Slurm job id it passed.
// The job's SLURM_JOB_ID is the user's to set: it reaches the command only as a decimal number, as an
// argument the command verifies.
func (a *Agent) startJobCommand(ctx context.Context, peer string, uid, gid uint32, env []string) (why, slurmJob string) {
	argv := a.cfg.Cluster.StartJobCommand
	if len(argv) == 0 {
		return "", ""
	}
	slurmJob, ok := envValue(env, "SLURM_JOB_ID")
	if ok && !isSlurmJobID(slurmJob) {
		return fmt.Sprintf("SLURM_JOB_ID %.32q in the job's environment is no Slurm job id (a decimal number)", slurmJob), slurmJob
	}
	args := agentconfig.StartJobArgs{UID: uid, GID: gid, Host: a.cfg.Name, Peer: peer, SlurmJobID: slurmJob}
	r := sitecmd.Command{Name: "start-job command", Argv: agentconfig.ExpandStartJobCommand(argv, args),
		Timeout: a.cfg.Cluster.StartJobCommandTimeout.Duration, KeepStderr: true}.Run(ctx)
	if r.Err == nil {
		return "", slurmJob
	}
	why = "start_job_command " + argv[0]
	switch {
	case r.Exit > 0:
		why += fmt.Sprintf(" exited with status %d", r.Exit)
	case errors.Is(r.Err, context.DeadlineExceeded):
		why += fmt.Sprintf(" failed: %v (start_job_command_timeout)", r.Err)
	default:
		why += fmt.Sprintf(" failed: %v", r.Err)
	}
	if line := firstLine(r.Stderr); line != "" {
		why += ": " + line
	}
	return why, slurmJob
}

// envValue returns the value of the first name= entry of env: what the job's getenv reads.
func envValue(env []string, name string) (string, bool) {
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// isSlurmJobID reports whether s is a Slurm job id: a decimal number (Slurm's are 32-bit).
func isSlurmJobID(s string) bool {
	if s == "" || len(s) > 10 {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// firstLine is the first non-blank line of s, its control characters replaced and its length bounded by
// maxRefusalReason: it is shown to a user, in a cluster error's message.
func firstLine(s string) string {
	for _, l := range strings.Split(s, "\n") {
		l = strings.TrimSpace(strings.Map(func(r rune) rune {
			if unicode.IsControl(r) || r == unicode.ReplacementChar {
				return ' '
			}
			return r
		}, strings.ToValidUTF8(l, "?")))
		if l == "" {
			continue
		}
		if len(l) > maxRefusalReason {
			l = strings.ToValidUTF8(l[:maxRefusalReason], "") + "..."
		}
		return l
	}
	return ""
}

func (s peerService) StartJob(ctx context.Context, peer string, req clusterapi.StartJobRequest) (clusterapi.StartJobReply, error) {
	return s.a.serveStartJob(ctx, peer, req)
}

func (s peerService) Coordinate(ctx context.Context, peer string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	return s.a.serveCoordinate(ctx, peer, req)
}
