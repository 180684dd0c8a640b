package agent

import (
	"context"
	"io"
	"slices"
	"time"

	"github.com/ftkit/ftkit/metrics"
	"github.com/ftkit/ftkit/ring"
)

// metricsSource gives the metrics collector the agent's state at scrape time.
type metricsSource struct{ a *Agent }

// recoveryStages are the stage names reported as metric labels; a failure log entry from another member
// may carry any name, which is reported as "other" (labels must stay bounded).
var recoveryStages = map[string]bool{
	StageDetected: true, StageClaimed: true, StageFetched: true, StageRewritten: true,
	StageRestored: true, StageReplayed: true, StageProtected: true, StageFenced: true, StageSelfFenced: true,
}

func (s metricsSource) MetricsState() metrics.State {
	a := s.a
	now := time.Now()
	var st metrics.State
	v := a.View()
	for _, j := range a.Jobs(0) {
		mj := metrics.Job{ID: j.ID, State: string(j.State)}
		if j.Fenced && j.State == JobLost {
			mj.State = "fenced" // killed here because it runs elsewhere (ftctl jobs: "lost here (runs elsewhere)")
		}
		// A replica whose every holder failed is gone, as `ftctl status` says (UNPROTECTED (replica holders
		// ... failed)): a failure of this host now loses the job, which counts as unreplicated.
		if j.Protected() && replicaHeld(v, j.Replica) {
			mj.Replicated, mj.ReplicaAge, mj.Uncovered = true, max(now.Sub(j.Replica.Time), 0), len(j.NewConns) > 0
			mj.Unrecoverable = len(j.Replica.Unrecoverable) > 0
		}
		st.Jobs = append(st.Jobs, mj)
	}
	st.Log = a.logMetrics()
	if pred, ok := a.View().Predecessor(a.cfg.Name); ok && a.watchdog != nil {
		p := &metrics.Predecessor{Node: pred.Name}
		if b, at, ok := a.watchdog.Last(pred.Name); ok {
			p.Beaten, p.BeatAge, p.Busy = true, max(now.Sub(at), 0), b.Busy != ""
		}
		st.Predecessor = p
	}
	if a.failures != nil {
		st.Failures = metricsFailures(a.failures.List())
	}
	return st
}

// replicaHeld reports whether a member alive in v holds a copy of r.
func replicaHeld(v ring.View, r *Replica) bool {
	return slices.ContainsFunc(r.Holders, func(h string) bool {
		m, ok := v.Member(h)
		return ok && m.State == ring.StateAlive
	})
}

// metricsFailures summarizes failure timelines: finished stages only, names outside the known set as "other".
func metricsFailures(fs []*Failure) []metrics.Failure {
	out := make([]metrics.Failure, 0, len(fs))
	for _, f := range fs {
		if f.Kind != "" {
			continue // a planned move or drain is no failure
		}
		// A node never coordinates the recovery of its own failure: such a timeline is its self-fence.
		mf := metrics.Failure{ID: f.ID, Done: f.Done, Failed: f.Error != "", Fence: f.Node == f.Protector}
		var last time.Time
		for i, st := range f.Stages {
			if st.Start.IsZero() || st.End.Before(st.Start) {
				continue // not finished (or a clock that went backwards): no duration to report
			}
			name := st.Name
			if !recoveryStages[name] {
				name = "other"
			}
			// The log keeps the first stage and drops the ones after it (failurelog.MaxStages): a stage's
			// place counts those, so that it keeps its Seq as the log drops more.
			seq := i
			if i > 0 {
				seq += f.StagesDropped
			}
			mf.Stages = append(mf.Stages, metrics.Stage{Name: name, Duration: st.Duration(), Seq: seq})
			if st.End.After(last) {
				last = st.End
			}
		}
		if f.Done && !f.Detected.IsZero() && last.After(f.Detected) {
			mf.Duration = last.Sub(f.Detected)
		}
		out = append(out, mf)
	}
	return out
}

// logMetrics reads the sender-side log's counters; nil when the log is disabled or already closed.
func (a *Agent) logMetrics() *metrics.Log {
	if a.netlog == nil {
		return nil
	}
	cnt, err := a.netlog.node.Counters()
	if err != nil {
		return nil
	}
	l := &metrics.Log{
		MemoryBytes: cnt.MemoryBytes, CapBytes: a.netlog.node.CapBytes(), PooledBytes: cnt.PooledBytes, RetainedBytes: cnt.RetainedBytes,
		SpilledBytes: cnt.SpilledBytes, Conns: cnt.Conns, ConsumerPaused: cnt.ConsumerPaused, ConsumerCPU: cnt.ConsumerCPU,
		BytesLogged: cnt.BytesLogged, PacketsLogged: cnt.PacketsLogged,
		DropsBackpressure: cnt.DropsBackpressure, DropsOversize: cnt.DropsOversize, DropsError: cnt.DropsError,
		FragmentsPassed: cnt.FragmentsPassed, AppendErrors: cnt.AppendErrors, Kicks: cnt.Kicks, LoggedPassed: cnt.LoggedPassed, ReserveLogged: cnt.ReserveLogged, UnloggedPassed: cnt.UnloggedPassed,
		ParkCapBytes: a.netlog.node.ParkCapBytes(), ParkWaitingBytes: cnt.ParkWaitingBytes, BytesParked: cnt.BytesParked,
		ParkFreed: cnt.ParkFreedBytes, ParkTaken: cnt.ParkTakenBytes, ParkLost: cnt.ParkLost,
	}
	if rc, err := a.netlog.tap.Counters(); err == nil {
		l.ReceivedBytes = rc.BytesRecorded
		l.ReceiveDropsBackpressure, l.ReceiveDropsOversize, l.ReceiveDropsError = rc.DropsBackpressure, rc.DropsOversize, rc.DropsError
		l.ReceiveUnrecordedPassed = rc.UnrecordedPassed
	}
	rel := a.netlog.node.ReleasedSoFar()
	l.ReleasedConns, l.ReleasedBytes = rel.Conns, rel.Bytes
	return l
}

// serveMetrics starts the /metrics endpoint if metrics.listen is set; it stops with ctx.
func (a *Agent) serveMetrics(ctx context.Context) (io.Closer, error) {
	if a.cfg.Metrics.Listen == "" || a.metrics == nil {
		return io.NopCloser(nil), nil
	}
	return a.metrics.Serve(ctx, a.cfg.Metrics.Listen, a.log)
}
