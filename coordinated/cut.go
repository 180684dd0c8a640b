package coordinated

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
)

// KindRollback marks a whole-run rollback in the agent's event log (its Node: the coordinator).
const KindRollback = "rollback"

// Stages of a rollback.
const (
	StagePrepared   = "parts checked"
	StageStopped    = "stopped"
	StageRolledBack = "restored from the cut"
)

// Recovery modes of a job (clusterapi.CutPart.Recovery) that involve its run's cut.
const (
	// RecoveryCoordinated: a failure of the job's host rolls its run back, without message logging.
	RecoveryCoordinated = "coordinated"
	// RecoveryAuto: message logging first, the run's rollback if it fails.
	RecoveryAuto = "auto"
)

var (
	// ErrNoCut means a run has no coordinated snapshot this host knows of.
	ErrNoCut = errors.New("no coordinated snapshot")
	// ErrNoRun means a run has no running job on an alive member.
	ErrNoRun = errors.New("no such run")
	// ErrRefused means a run cannot be snapshotted or rolled back as asked, and trying again will not
	// change that: two users' runs of one name, a connection to a job outside the run, a job started
	// after the cut.
	ErrRefused = errors.New("refused")
)

// Cut is a coordinated snapshot of a run (the jobs of user UID named Run): one replicated snapshot per job.
type Cut struct {
	Run    string               `json:"run"`
	UID    uint32               `json:"uid"`
	ID     string               `json:"id"`
	Taken  time.Time            `json:"taken"`
	Frozen time.Duration        `json:"frozen_ns"` // the longest any host held its jobs frozen
	Parts  []clusterapi.CutPart `json:"parts"`
}

// Holds reports whether one of the cut's parts is job's.
func (c *Cut) Holds(job string) bool {
	return slices.ContainsFunc(c.Parts, func(p clusterapi.CutPart) bool { return p.Job == job })
}

// RunRequest names a run for a coordinated snapshot or a rollback: its name, and its user when users'
// runs of that name would be ambiguous (nil: the one user whose run has that name).
type RunRequest struct {
	Run string  `json:"run"`
	UID *uint32 `json:"uid,omitempty"`
}

// Rollback is the outcome of a whole-run rollback.
type Rollback struct {
	Run     string               `json:"run"`
	Cut     string               `json:"cut"`
	Event   string               `json:"event"`
	Stopped time.Duration        `json:"stopped_ns"` // from the first stop to the last restored job running
	Parts   []clusterapi.CutPart `json:"parts"`
}

// Stage is one step of a rollback, for the agent's event log.
type Stage struct {
	Name       string
	Hosts      []string
	Start, End time.Time
	Detail     string
	Err        error
}

// TornError is a cut whose snapshots do not fit together; another attempt may succeed.
type TornError struct{ Problems []string }

func (e *TornError) Error() string {
	return "the snapshots do not fit together: " + strings.Join(e.Problems, "; ")
}

// Check checks that parts restore the run's connections whole (ckpt.Match): a connection to a job outside
// the run is refused, since a rollback could not restore its other end; a torn one (TornError) may fit at
// another try.
func Check(parts []clusterapi.CutPart) error {
	snaps := make([]ckpt.Part, len(parts))
	for i, p := range parts {
		snaps[i] = ckpt.Part{Job: p.Job, Conns: p.Conns}
	}
	var outside, torn []string
	for _, m := range ckpt.Match(snaps, nil) {
		if m.Peer == "" {
			outside = append(outside, fmt.Sprintf("job %s's connection %s -> %s", m.Job, m.Conn.Local, m.Conn.Remote))
		} else {
			torn = append(torn, fmt.Sprintf("%s -> %s: %s", m.Conn.Local, m.Conn.Remote, m.Why))
		}
	}
	if len(outside) > 0 {
		slices.Sort(outside)
		return fmt.Errorf("%w: a rollback could not restore the other end of %s: it is not a job of the run", ErrRefused, strings.Join(outside, ", "))
	}
	if len(torn) > 0 {
		slices.Sort(torn)
		return &TornError{torn}
	}
	return nil
}

// Place decides where each part of cut is restored: where its job runs now (where: job -> host), else on
// its host if alive, else on target (if not ""). A part restored off its host is fetched from self if held
// says this host has it, else from any holder. A job of the run that is not in the cut refuses the
// rollback (it started after the cut). It returns the parts by host and the hosts in order.
func Place(cut *Cut, where map[string]string, alive []string, target, self string, held func(clusterapi.CutPart) bool) (map[string][]clusterapi.CutPart, []string, error) {
	where = maps.Clone(where)
	byHost := map[string][]clusterapi.CutPart{}
	var hosts []string
	for _, p := range cut.Parts {
		on, ok := where[p.Job]
		delete(where, p.Job)
		switch {
		case ok:
			p.Target = on
		case slices.Contains(alive, p.Host):
			p.Target = p.Host
		case target != "":
			p.Target = target
		default:
			return nil, nil, fmt.Errorf("run %s not rolled back: job %s runs nowhere and %s, whose snapshot is its part of cut %s, is not alive", cut.Run, p.Job, p.Host, cut.ID)
		}
		p.Source = ""
		if p.Target != p.Host && held(p) {
			p.Source = self
		}
		if _, ok := byHost[p.Target]; !ok {
			hosts = append(hosts, p.Target)
		}
		byHost[p.Target] = append(byHost[p.Target], p)
	}
	if len(where) > 0 {
		return nil, nil, fmt.Errorf("%w: run %s not rolled back: jobs %v of the run started after its cut %s (take a new one)", ErrRefused, cut.Run, slices.Sorted(maps.Keys(where)), cut.ID)
	}
	return byHost, hosts, nil
}
