package agentconfig

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"
)

// The start-job command (cluster.start_job_command) is the site's admission of the jobs members forward:
// `ftctl mpirun` starts a run's daemons on other hosts through its host's agent, which asks each target's
// agent over the cluster protocol to start a job as its local caller (the start-job operation). Before it
// starts one, the target runs the command with the placeholders below substituted; exit status 0 admits
// the job, anything else refuses it, and the first line of the command's standard error says why. A job
// started on the agent's own host (ftwrap, a local mpirun) is never asked about: its user runs processes
// there anyway. Unset, every forwarded start is admitted, and any user of one member can run processes as
// themselves on every member (docs/deploy.md, security model).
const (
	// StartJobUID and StartJobGID are the user and group the job would run as (the asking agent's local
	// caller, from SO_PEERCRED).
	StartJobUID = "{uid}"
	StartJobGID = "{gid}"
	// StartJobHost is this host's member name (its Slurm node name at a Slurm site).
	StartJobHost = "{host}"
	// StartJobPeer is the member that forwards the request.
	StartJobPeer = "{peer}"
	// StartJobSlurmJobID is the job's SLURM_JOB_ID (the first in its environment, as the job's getenv
	// reads it), or empty. The request's environment is the caller's: the command must verify the id, never
	// trust it. The agent passes only a decimal number (a Slurm job id); it refuses a start whose
	// environment holds anything else there.
	StartJobSlurmJobID = "{slurm_job_id}"
)

// MaxStartJobCommandTimeout bounds cluster.start_job_command_timeout: the asking agent waits for the whole
// start-job request some 30 s (clusterapi.Client.StartJob), and the job's start comes after the command.
const MaxStartJobCommandTimeout = 20 * time.Second

var startJobPlaceholders = []string{StartJobUID, StartJobGID, StartJobHost, StartJobPeer, StartJobSlurmJobID}

// checkStartJobCommand validates cluster.start_job_command and its timeout: a program given by absolute
// path (a root daemon must not depend on its PATH), only the known placeholders, a timeout the asking
// agent waits for.
func checkStartJobCommand(argv []string, timeout time.Duration) error {
	var errs []error
	if len(argv) > 0 {
		if !filepath.IsAbs(argv[0]) {
			errs = append(errs, fmt.Errorf("cluster.start_job_command %q: give the program by absolute path", argv[0]))
		}
		pairs := make([]string, 0, 2*len(startJobPlaceholders))
		for _, p := range startJobPlaceholders {
			pairs = append(pairs, p, "")
		}
		r := strings.NewReplacer(pairs...)
		for _, a := range argv {
			if strings.ContainsAny(r.Replace(a), "{}") {
				errs = append(errs, fmt.Errorf("cluster.start_job_command argument %q: the only placeholders are %s", a, strings.Join(startJobPlaceholders, " ")))
			}
		}
	}
	if timeout <= 0 || timeout > MaxStartJobCommandTimeout {
		errs = append(errs, fmt.Errorf("cluster.start_job_command_timeout %s: must be positive and at most %s (the asking agent waits for the whole start)", timeout, MaxStartJobCommandTimeout))
	}
	return errors.Join(errs...)
}

// StartJobArgs is what the start-job command is told about one forwarded start.
type StartJobArgs struct {
	UID, GID   uint32
	Host, Peer string
	SlurmJobID string // "" when the job's environment has none
}

// ExpandStartJobCommand substitutes a into argv. Each argument stays one argument: no shell runs.
func ExpandStartJobCommand(argv []string, a StartJobArgs) []string {
	r := strings.NewReplacer(StartJobUID, fmt.Sprint(a.UID), StartJobGID, fmt.Sprint(a.GID), StartJobHost, a.Host,
		StartJobPeer, a.Peer, StartJobSlurmJobID, a.SlurmJobID)
	out := make([]string, len(argv))
	for i, s := range argv {
		out[i] = r.Replace(s)
	}
	return out
}
