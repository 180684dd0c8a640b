package clusterapi

import (
	"errors"
	"fmt"
	"path/filepath"
	"regexp"

	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/internal/rlimits"
)

// OpStartJob asks a member to start a protected job as a user, on behalf of a local caller of the asking
// member (an MPI launcher starting its daemon on another host of its run). The asking agent took UID and
// GID from its caller's SO_PEERCRED; the serving agent believes them because the request comes from an
// authenticated member: member certificates are cluster-root credentials, as slurmd trusts slurmctld.

// Bounds of a start-job request: a job's command line and environment, as a shell would pass them, fit
// well inside; together they stay inside MaxMessage with JSON's quoting.
const (
	MaxStartJobArgs       = 4096      // argv entries, and env entries
	MaxStartJobBytes      = 512 << 10 // argv and env bytes together
	MaxStartJobPlacements = 4096      // a placement's hosts and spares together (agent.MaxPlacementHosts)
)

// StartJobRequest is OpStartJob's request: the job spec of the local API plus the caller's identity.
type StartJobRequest struct {
	Name      string             `json:"name"`
	Argv      []string           `json:"argv"`
	Env       []string           `json:"env,omitempty"`
	Dir       string             `json:"dir"`
	Interval  string             `json:"interval,omitempty"`
	Placement *StartJobPlacement `json:"placement,omitempty"`
	UID       uint32             `json:"uid"`
	GID       uint32             `json:"gid"`
	// JobAddress asks the target for an address of the job's own from its job_network.pool.
	JobAddress bool `json:"job_address,omitempty"`
	// Run is the run the job is a part of (agent.JobSpec.Run).
	Run string `json:"run,omitempty"`
	// Recovery is the job's recovery mode (agent.JobSpec.Recovery; the agent checks it).
	Recovery string `json:"recovery,omitempty"`
	// Limits are the resource limits of the program that asked the sending agent for the job.
	Limits []rlimits.Limit `json:"limits,omitempty"`
	// Umask is the umask of the program that asked the sending agent for the job (agent.JobSpec.Umask).
	Umask *uint32 `json:"umask,omitempty"`
}

// StartJobPlacement is the run's membership (agent.Placement on the wire).
type StartJobPlacement struct {
	Hosts  []string `json:"hosts"`
	Spares []string `json:"spares,omitempty"`
}

// StartJobReply is the started job's record: enough for the caller to follow it through its directory.
type StartJobReply struct {
	ID   string `json:"id"`
	Node string `json:"node"`
	PID  int    `json:"pid"`
	Dir  string `json:"dir"` // the cluster-wide job directory
}

// startJobNameRE is the agent's rule for job names (agent/job.go).
var startJobNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$`)

// Validate refuses a request before anything is started: a command line or environment beyond the
// bounds, a working directory that is not absolute and clean, a bad name or placement.
func (r StartJobRequest) Validate() error {
	if len(r.Argv) == 0 {
		return errors.New("start-job: no program given")
	}
	if len(r.Argv) > MaxStartJobArgs || len(r.Env) > MaxStartJobArgs {
		return fmt.Errorf("start-job: %d arguments and %d environment entries, at most %d each", len(r.Argv), len(r.Env), MaxStartJobArgs)
	}
	n := 0
	for _, s := range r.Argv {
		n += len(s)
	}
	for _, s := range r.Env {
		n += len(s)
	}
	if n > MaxStartJobBytes {
		return fmt.Errorf("start-job: %d bytes of arguments and environment, at most %d", n, MaxStartJobBytes)
	}
	if r.Name != "" && !startJobNameRE.MatchString(r.Name) {
		return fmt.Errorf("start-job: job name %q: use up to 48 letters, digits, '.', '_' or '-'", r.Name)
	}
	if !filepath.IsAbs(r.Dir) || filepath.Clean(r.Dir) != r.Dir {
		return fmt.Errorf("start-job: working directory %q is not an absolute, clean path", r.Dir)
	}
	if r.Run != "" && !startJobNameRE.MatchString(r.Run) {
		return fmt.Errorf("start-job: run %q: use up to 48 letters, digits, '.', '_' or '-'", r.Run)
	}
	if len(r.Interval) > 64 || len(r.Recovery) > 64 {
		return errors.New("start-job: interval or recovery longer than 64 bytes")
	}
	if err := rlimits.Validate(r.Limits); err != nil {
		return fmt.Errorf("start-job: %w", err)
	}
	if r.Umask != nil && *r.Umask > 0o777 {
		return fmt.Errorf("start-job: umask %#o has bits beyond 0777", *r.Umask)
	}
	return r.Placement.Validate()
}

// Validate refuses bad or repeated member names and lists beyond MaxStartJobPlacements.
func (p *StartJobPlacement) Validate() error {
	if p == nil {
		return nil
	}
	if len(p.Hosts) == 0 {
		return errors.New("start-job: placement without hosts")
	}
	if n := len(p.Hosts) + len(p.Spares); n > MaxStartJobPlacements {
		return fmt.Errorf("start-job: placement of %d hosts and spares, at most %d", n, MaxStartJobPlacements)
	}
	seen := make(map[string]bool, len(p.Hosts)+len(p.Spares))
	for _, lst := range [][]string{p.Hosts, p.Spares} {
		for _, h := range lst {
			if err := clustertls.ValidateMemberName(h); err != nil {
				return fmt.Errorf("start-job: placement: %w", err)
			}
			if seen[h] {
				return fmt.Errorf("start-job: placement names %q twice", h)
			}
			seen[h] = true
		}
	}
	return nil
}

// startJobIDRE is a job id: NAME-HEX, the name's alphabet.
var startJobIDRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)

// Check refuses a reply that is not the record of a started job: the caller uses its directory.
func (r StartJobReply) Check() error {
	if !startJobIDRE.MatchString(r.ID) {
		return fmt.Errorf("start-job reply: job id %q", r.ID)
	}
	if !filepath.IsAbs(r.Dir) || filepath.Clean(r.Dir) != r.Dir {
		return fmt.Errorf("start-job reply: job directory %q is not an absolute, clean path", r.Dir)
	}
	return nil
}
