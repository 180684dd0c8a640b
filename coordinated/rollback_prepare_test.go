package coordinated

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// healthyRun is a run with one running job on each of hosts "a" and "b". Host b cannot restore its part
// (its snapshot does not verify, or cannot be fetched): it refuses, as rollbackParts does.
type healthyRun struct {
	mu      sync.Mutex
	running map[string]bool // job -> runs
	phases  []string
}

func (f *healthyRun) Alive() []string { return []string{"a", "b"} }

func (f *healthyRun) Coordinate(_ context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	job := "job" + host + "-00000001"
	f.phases = append(f.phases, string(req.Phase)+"@"+host)
	bad := errors.New("nothing stopped: part 20261203T100000.000Z-b-000001 of job jobb-00000001: sha256 mismatch")
	switch req.Phase {
	case clusterapi.CoordList:
		if f.running[job] {
			return clusterapi.CoordinateReply{Jobs: []string{job}, Owners: map[string]uint32{job: 0}}, nil
		}
	case clusterapi.CoordPrepare:
		if host == "b" {
			return clusterapi.CoordinateReply{}, bad
		}
	case clusterapi.CoordStop:
		if host == "b" {
			return clusterapi.CoordinateReply{}, bad
		}
		for _, p := range req.Parts {
			f.running[p.Job] = false
		}
	case clusterapi.CoordRestore:
		for _, p := range req.Parts {
			f.running[p.Job] = true
		}
	}
	return clusterapi.CoordinateReply{}, nil
}

// TestRollbackStopsNothingWhenAPartCannotBeRestored: a rollback of a running run one of whose parts cannot
// be restored stops nothing. Before, each host checked its own parts in its stop phase, which all hosts run
// at once: the other hosts' jobs were killed, nothing was restored, and the run was dead.
func TestRollbackStopsNothingWhenAPartCannotBeRestored(t *testing.T) {
	f := &healthyRun{running: map[string]bool{"joba-00000001": true, "jobb-00000001": true}}
	c := &Coordinator{Self: "a", Members: f, Records: Records{Dir: t.TempDir(), Host: "a"}, Log: slog.New(slog.DiscardHandler)}
	cut := &Cut{Run: "r", ID: "cut-1", Parts: []clusterapi.CutPart{
		{Job: "joba-00000001", Host: "a", Snapshot: "20261203T100000.000Z-a-000001"},
		{Job: "jobb-00000001", Host: "b", Snapshot: "20261203T100000.000Z-b-000001"},
	}}
	err := c.RollBack(t.Context(), cut, "", func(clusterapi.CutPart) bool { return false }, func(Stage) {})
	if err == nil {
		t.Fatal("a rollback with a part that cannot be restored succeeded")
	}
	for job, runs := range f.running {
		if !runs {
			t.Errorf("job %s no longer runs after the refused rollback (phases %v; err %v)", job, f.phases, err)
		}
	}
}
