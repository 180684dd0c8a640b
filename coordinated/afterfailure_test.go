package coordinated

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// rollbackRecorder is a cluster after host "f" failed: its jobs run nowhere, "n1" and the spare "s1" are
// alive, and every phase succeeds; it records the restores asked for.
type rollbackRecorder struct {
	mu       sync.Mutex
	restored []string // "uid/run job@host"
}

func (r *rollbackRecorder) Alive() []string { return []string{"n1", "s1"} }

func (r *rollbackRecorder) Coordinate(_ context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if req.Phase == clusterapi.CoordRestore {
		for _, p := range req.Parts {
			r.restored = append(r.restored, fmt.Sprintf("%d/%s %s@%s", *req.UID, req.Run, p.Job, host))
		}
	}
	return clusterapi.CoordinateReply{}, nil
}

// TestAfterFailureTwoUsersRunsOfOneName: runs are per user, and two users may both call their run "farm".
// When the failed host ran a coordinated-mode job of each, both runs roll back. Before, the runs were told
// apart by name only: the second user's was skipped, its job ran nowhere, and the failure was reported
// recovered.
func TestAfterFailureTwoUsersRunsOfOneName(t *testing.T) {
	recs := Records{Dir: t.TempDir(), Host: "n1", Log: slog.New(slog.DiscardHandler)}
	for i, uid := range []uint32{1000, 2000} {
		job := fmt.Sprintf("farm-f-%08d", uid)
		if err := recs.Save(Cut{Run: "farm", UID: uid, ID: fmt.Sprintf("cut-20261203T10000%d.000", i), Parts: []clusterapi.CutPart{
			{Job: job, Host: "f", Snapshot: "20261203T100000.000Z-f-00000" + fmt.Sprint(i+1), Recovery: RecoveryCoordinated},
		}}); err != nil {
			t.Fatal(err)
		}
	}
	jobs := []string{"farm-f-00001000", "farm-f-00002000"}
	rec := &rollbackRecorder{}
	c := &Coordinator{Self: "n1", Members: rec, Records: recs, Log: slog.New(slog.DiscardHandler)}
	err := c.AfterFailure(t.Context(), "f", "s1", jobs, jobs, nil, func(clusterapi.CutPart) bool { return true }, func(Stage) {})
	slices.Sort(rec.restored)
	want := []string{"1000/farm farm-f-00001000@s1", "2000/farm farm-f-00002000@s1"}
	if !slices.Equal(rec.restored, want) || err != nil {
		t.Errorf("restored %q, %v; want %q, no error", rec.restored, err, want)
	}

	// A coordinated job with no cut here is not rolled back: named, never reported recovered.
	err = c.AfterFailure(t.Context(), "f", "s1", []string{"lone-f-00000001"}, []string{"lone-f-00000001"}, nil, func(clusterapi.CutPart) bool { return true }, func(Stage) {})
	if err != nil {
		t.Errorf("a job without a cut: %v; message logging recovers it, nothing to roll back", err)
	}
}
