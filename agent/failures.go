package agent

import (
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

// Failures returns the failure timelines this agent knows of, oldest first.
func (a *Agent) Failures() []*Failure { return a.failures.List() }
