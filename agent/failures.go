package agent

import (
	"context"
	"time"

	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/restore/recovery"
)

// Failure is the timeline of one node failure (or planned migration) and its recovery, and Stage one step
// of it (package failurelog, which keeps them; named here as the agent's API names them).
type (
	Failure = failurelog.Failure
	Stage   = failurelog.Stage
)

// Stage names, in the order a recovery goes through them.
const (
	StageDetected  = "detected"
	StageClaimed   = "spare claimed"
	StageFetched   = recovery.StageFetched
	StageRewritten = recovery.StageRewritten
	StageRestored  = recovery.StageRestored
	StageReplayed  = recovery.StageReplayed
	StageProtected = recovery.StageProtected
)

func (a *Agent) saveFailures() {
	if err := a.failures.Save(); err != nil {
		a.log.Warn("save failure timelines", "err", err)
	}
}

// failureSaveEvery is how often timelines merged from peers are written at most (mergeFailures).
const failureSaveEvery = 5 * time.Second

// saveMergedFailures writes the timelines merged from peers but not yet on disk, every failureSaveEvery
// and once more as ctx ends.
func (a *Agent) saveMergedFailures(ctx context.Context) {
	t := time.NewTicker(failureSaveEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			a.flushMergedFailures()
			return
		case <-t.C:
			a.flushMergedFailures()
		}
	}
}

// flushMergedFailures writes the failure log if a timeline merged from a peer is not on disk yet.
func (a *Agent) flushMergedFailures() {
	if a.failures.Unsaved() {
		a.saveFailures()
	}
}

// Failures returns the failure timelines this agent knows of, oldest first.
func (a *Agent) Failures() []*Failure { return a.failures.List() }
