package agent

import (
	"errors"
	"sort"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/ring"
)

// What the local API (package agentapi) shows of this host: every method filters by the caller's uid,
// which the API takes from SO_PEERCRED. Root sees everything; another uid its own jobs only.

// Status is what GET /v1/status returns.
type Status struct {
	Node      string `json:"node"`
	Role      Role   `json:"role"`
	Protector string `json:"protector,omitempty"`
	Mode      Mode   `json:"mode"`
	Interval  string `json:"interval"`
	// AutoMTBF is the MTBF interval auto is computed for now: checkpoint.mtbf, or checkpoint.mtbf / (1 -
	// recall) while the health command answers (unpredictedMTBF).
	AutoMTBF string        `json:"auto_mtbf,omitempty"`
	Epoch    uint64        `json:"epoch"` // of the membership view
	Members  []ring.Member `json:"members"`
	Busy     string        `json:"busy,omitempty"` // checkpoint or restore in progress
	Jobs     []Job         `json:"jobs"`
	// JobProtectors names, for each running job, the member its snapshots go to now: its run's next host
	// (through the view) for a job with a placement, else this node's ring protector.
	JobProtectors map[string]string `json:"job_protectors,omitempty"`
	Version       string            `json:"version"`
	CRIU          string            `json:"criu"`
	Log           *LogStatus        `json:"log,omitempty"`
	// FailurePredicted: the health command predicts a failure of this host, which was drained (health.go).
	FailurePredicted bool `json:"failure_predicted,omitempty"`
	// Cuts are the newest coordinated snapshots recorded here of the runs of the running jobs shown that
	// roll their run back (coordinated and auto recovery): `ftctl status` names a run's running jobs that
	// its newest cut lacks, since a rollback of the run refuses until a cut holds them.
	Cuts []*coordinated.Cut `json:"cuts,omitempty"`
}

// Status is this host as uid may see it: the cluster view, and the jobs uid may see (all for root).
func (a *Agent) Status(uid uint32) Status {
	v := a.View()
	self, _ := v.Member(a.cfg.Name)
	busy := a.busy.current()
	s := Status{
		Node: a.cfg.Name, Role: Role(self.Role), Mode: a.cfg.Checkpoint.Mode, Interval: a.cfg.Checkpoint.Interval.String(),
		Epoch: v.Epoch, Members: v.Members, Busy: busy, Jobs: a.Jobs(uid), Version: version.Ftkit(), CRIU: a.criu.Binary,
		Log: a.logStatus(), FailurePredicted: a.predicted.Load(), AutoMTBF: a.unpredictedMTBF().String(),
	}
	if p, ok := v.Protector(a.cfg.Name); ok {
		s.Protector = p.Name
	}
	for _, j := range s.Jobs {
		if p, ok := a.protectorOf(v, j.Spec.Placement); ok && j.State == JobRunning {
			if s.JobProtectors == nil {
				s.JobProtectors = map[string]string{}
			}
			s.JobProtectors[j.ID] = p.Name
		}
	}
	s.Cuts = a.runCuts(s.Jobs)
	return s
}

// runCuts are the newest cuts recorded here of the runs of jobs' running jobs that roll their run back.
func (a *Agent) runCuts(jobs []Job) []*coordinated.Cut {
	records := a.cutRecords()
	var cuts []*coordinated.Cut
	seen := map[coordinated.Run]bool{}
	for _, j := range jobs {
		k := coordinated.Run{Name: j.Spec.Run, UID: j.UID}
		if j.State != JobRunning || !j.Spec.RollsBackRun() || seen[k] {
			continue
		}
		seen[k] = true
		c, err := records.Load(k.Name, &k.UID)
		switch {
		case err == nil:
			cuts = append(cuts, c)
		case !errors.Is(err, coordinated.ErrNoCut):
			a.log.Warn("status: the run's cut record is unreadable", "run", k.Name, "uid", k.UID, "err", err)
		}
	}
	return cuts
}

func sortJobs(js []Job) {
	sort.Slice(js, func(a, b int) bool { return js[a].Created.Before(js[b].Created) })
}

// failuresFor is what a non-root caller may see of the failure timelines: those that concern at least one
// of its jobs, reduced to its jobs. Other users' job ids, the stages of their jobs and the errors naming
// them are left out; node-level stages keep where and when (who failed, who detected it, where its jobs
// went: the membership view every user can read says as much) without their details.
func failuresFor(all []*Failure, owns func(job string) bool) []*Failure {
	// Asked once per job: for a job not running here, owns reads the newest snapshot's record from disk, and
	// a job comes back in many failures and stages (up to MaxFailures*(MaxJobs+MaxStages) times a request).
	known, ask := map[string]bool{}, owns
	owns = func(job string) bool {
		v, ok := known[job]
		if !ok {
			v = ask(job)
			known[job] = v
		}
		return v
	}
	out := []*Failure{}
	for _, f := range all {
		var jobs []string
		for _, j := range f.Jobs {
			if owns(j) {
				jobs = append(jobs, j)
			}
		}
		if len(jobs) == 0 {
			continue
		}
		c := *f
		c.Jobs = jobs
		c.Stages = nil
		for _, st := range f.Stages {
			switch {
			case st.Job == "":
				c.Stages = append(c.Stages, Stage{Name: st.Name, Host: st.Host, Start: st.Start, End: st.End})
			case owns(st.Job):
				c.Stages = append(c.Stages, st)
			}
		}
		// A list at the log's bound may have lost jobs, other users' among them, which the error names.
		if c.Error != "" && (len(jobs) < len(f.Jobs) || len(f.Jobs) >= failurelog.MaxJobs) {
			c.Error = "the recovery of some jobs failed or is incomplete; ask the administrator for details"
		}
		out = append(out, &c)
	}
	return out
}

// Events returns the failure timelines uid may see: all of them for root, else failuresFor's reduction.
func (a *Agent) Events(uid uint32) []*Failure {
	if uid == 0 {
		return a.Failures()
	}
	return failuresFor(a.Failures(), a.ownerOf(uid))
}

// CheckpointFloor is the shortest time between two checkpoints a non-root uid may ask for
// (checkpoint.min_interval).
func (a *Agent) CheckpointFloor() time.Duration { return a.cfg.Checkpoint.MinInterval.Duration }

// ownerOf tells whether uid owns a job: one this host runs or ran, or one of whose snapshots it holds
// (the protector that handled a failure holds the failed node's replicas; its spare runs the jobs).
func (a *Agent) ownerOf(uid uint32) func(job string) bool {
	mine := map[string]bool{}
	for _, j := range a.Jobs(uid) {
		mine[j.ID] = true
	}
	return func(job string) bool {
		if mine[job] {
			return true
		}
		if a.store == nil || ckpt.ValidName(job) != nil {
			return false
		}
		ids, err := a.store.List(job, "")
		if err != nil || len(ids) == 0 {
			return false
		}
		// The bounded job record says whose it is: a user's listing, repeated at will, must not have root read
		// the manifest (up to 16 MiB) of every job of the failure log, other users' included, as Snapshots.
		return a.ownsSnapshotAt(job, ids[0], uid)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
