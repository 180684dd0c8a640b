package clusterapi

import (
	"context"
	"fmt"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// A coordinated snapshot (a "cut") of a run, and a rollback of the whole run to one, are driven by one
// agent, the coordinator, through one operation in phases on every host of the run: every host freezes
// its jobs of the run before any dumps them, and thaws only once every host has dumped, so that each byte
// in flight between them is in exactly one snapshot; a rollback stops every job of the run before any
// is restored.

// CoordPhase is one step of a coordinated snapshot or rollback on one host.
type CoordPhase string

const (
	CoordList    CoordPhase = "list"    // which of the run's jobs run on the server
	CoordFreeze  CoordPhase = "freeze"  // freeze them (the server thaws them by itself if no thaw comes)
	CoordDump    CoordPhase = "dump"    // dump them, frozen; reply with the snapshots' connections
	CoordThaw    CoordPhase = "thaw"    // thaw them and replicate the dumps
	CoordAbort   CoordPhase = "abort"   // thaw them, the cut is given up
	CoordCommit  CoordPhase = "commit"  // record the complete, checked cut (Parts: all of it)
	CoordPrepare CoordPhase = "prepare" // rollback: check the server holds and can verify its parts (Parts); stops nothing
	CoordStop    CoordPhase = "stop"    // rollback: kill the server's parts (Parts) without a word on the wire
	CoordRestore CoordPhase = "restore" // rollback: restore the server's parts (Parts) from their snapshots
)

// MaxCutParts bounds the parts of a cut (a run's jobs).
const MaxCutParts = 4096

// CoordinateRequest is one phase of cut Cut of run Run of user UID: a run is its jobs of one user that
// share the run's name (users name their runs). UID may be nil only to list.
type CoordinateRequest struct {
	Run   string     `json:"run"`
	UID   *uint32    `json:"uid,omitempty"`
	Cut   string     `json:"cut"`
	Phase CoordPhase `json:"phase"`
	Parts []CutPart  `json:"parts,omitempty"`
}

// CutPart is one job's snapshot in a cut: the job, the host that took the snapshot, and the host it is
// restored on in a rollback (Host, or a spare when Host failed), with Source holding a copy.
type CutPart struct {
	Job      string `json:"job"`
	Host     string `json:"host"`
	Snapshot string `json:"snapshot"`
	Target   string `json:"target,omitempty"`
	Source   string `json:"source,omitempty"`
	// Recovery is the job's recovery mode (agent.JobSpec.Recovery): whether a failure of its host rolls the
	// run back to the cut by itself.
	Recovery string `json:"recovery,omitempty"`
	// Conns are the snapshot's connections, for the coordinator's check of the cut (dump's reply only).
	Conns []ckpt.Conn `json:"conns,omitempty"`
}

// CoordinateReply is a host's answer: its jobs of the run (list, freeze; Owners: each listed job's user) or
// its parts (dump, thaw).
type CoordinateReply struct {
	Jobs   []string          `json:"jobs,omitempty"`
	Owners map[string]uint32 `json:"owners,omitempty"`
	Parts  []CutPart         `json:"parts,omitempty"`
	// Frozen is how long the server held the run's jobs frozen (thaw: from its freeze to its thaw).
	Frozen time.Duration `json:"frozen_ns,omitempty"`
}

// ValidRunName refuses a run name that could not be a job's (runs are named as their jobs are).
func ValidRunName(run string) error {
	if !startJobNameRE.MatchString(run) {
		return fmt.Errorf("run %q: use up to 48 letters, digits, '.', '_' or '-'", run)
	}
	return nil
}

// Validate refuses names that are no job's, run's or member's, phases that do not exist, and lists past
// MaxCutParts.
func (r CoordinateRequest) Validate() error {
	if err := ValidRunName(r.Run); err != nil {
		return fmt.Errorf("coordinate: %w", err)
	}
	if err := ckpt.ValidName(r.Cut); err != nil {
		return fmt.Errorf("coordinate: cut: %w", err)
	}
	switch r.Phase {
	case CoordList:
	case CoordFreeze, CoordDump, CoordThaw, CoordAbort, CoordCommit, CoordPrepare, CoordStop, CoordRestore:
		if r.UID == nil {
			return fmt.Errorf("coordinate: %s of run %s names no user", r.Phase, r.Run)
		}
	default:
		return fmt.Errorf("coordinate: no phase %q", r.Phase)
	}
	if len(r.Parts) > MaxCutParts {
		return fmt.Errorf("coordinate: %d parts, at most %d", len(r.Parts), MaxCutParts)
	}
	for _, p := range r.Parts {
		if err := p.validate(); err != nil {
			return fmt.Errorf("coordinate: %w", err)
		}
	}
	return nil
}

func (p CutPart) validate() error {
	if err := ckpt.ValidName(p.Job); err != nil {
		return fmt.Errorf("part job: %w", err)
	}
	if _, err := ckpt.ParseID(p.Snapshot); err != nil {
		return fmt.Errorf("part %s: snapshot: %w", p.Job, err)
	}
	if len(p.Recovery) > 64 {
		return fmt.Errorf("part %s: recovery mode longer than 64 bytes", p.Job)
	}
	if err := clustertls.ValidateMemberName(p.Host); err != nil {
		return fmt.Errorf("part %s: host: %w", p.Job, err)
	}
	for _, m := range []string{p.Target, p.Source} { // optional
		if m != "" {
			if err := clustertls.ValidateMemberName(m); err != nil {
				return fmt.Errorf("part %s: %w", p.Job, err)
			}
		}
	}
	return nil
}

// MaxCoordStep bounds the phases that dump, replicate or restore jobs: they take as long as the jobs'
// memory needs (a GiB dumps in about 1.5 s here, and ships in 3).
const MaxCoordStep = 10 * time.Minute

// MaxDumpReply bounds a dump's reply: its parts carry their snapshots' connections, which a job with
// thousands of them (a server with as many clients) has past MaxMessage, as its manifest does.
const MaxDumpReply = MaxOperatorReply

// Coordinate runs one phase of a coordinated snapshot or rollback on peer.
func (c *Client) Coordinate(ctx context.Context, peer string, req CoordinateRequest) (CoordinateReply, error) {
	if err := req.Validate(); err != nil {
		return CoordinateReply{}, err
	}
	d, limit := 2*c.msg(), MaxMessage
	switch req.Phase {
	case CoordDump:
		d, limit = MaxCoordStep, MaxDumpReply
	case CoordFreeze, CoordThaw, CoordPrepare, CoordStop, CoordRestore:
		d = MaxCoordStep
	}
	return callBounded[CoordinateReply](c, ctx, peer, OpCoordinate, d, limit, req)
}
