package coordinated

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// fakeRun is a run with one job on each of two hosts, whose dumps answer with dumpErrs in turn (nil: the
// part) and whose other phases succeed.
type fakeRun struct {
	mu       sync.Mutex
	dumpErrs []error
	phases   map[clusterapi.CoordPhase]int
}

func (f *fakeRun) Alive() []string { return []string{"a", "b"} }

func (f *fakeRun) Coordinate(_ context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.phases[req.Phase]++
	job := "job" + host + "-00000001"
	part := clusterapi.CutPart{Job: job, Host: host, Snapshot: "20261203T100000.000Z-" + host + "-000001"}
	switch req.Phase {
	case clusterapi.CoordList:
		return clusterapi.CoordinateReply{Jobs: []string{job}, Owners: map[string]uint32{job: 0}}, nil
	case clusterapi.CoordDump:
		if host == "b" && len(f.dumpErrs) > 0 {
			err := f.dumpErrs[0]
			f.dumpErrs = f.dumpErrs[1:]
			if err != nil {
				return clusterapi.CoordinateReply{}, err
			}
		}
		return clusterapi.CoordinateReply{Parts: []clusterapi.CutPart{part}}, nil
	case clusterapi.CoordThaw:
		return clusterapi.CoordinateReply{Parts: []clusterapi.CutPart{part}}, nil
	}
	return clusterapi.CoordinateReply{}, nil
}

// TestSnapshotRetriesWhenADumpAsks: a host whose dump met a connection in a frozen job's listen queue asks
// for the cut again (clusterapi.CodeRetry): the coordinator aborts it and takes it again at once, up to
// attempts times; any other dump failure is final.
func TestSnapshotRetriesWhenADumpAsks(t *testing.T) {
	retry := &clusterapi.Error{Code: clusterapi.CodeRetry, Message: "dump job jobb-00000001: in flight"}
	other := &clusterapi.Error{Code: clusterapi.CodeRefused, Message: "dump job jobb-00000001: criu failed"}
	for _, tc := range []struct {
		name     string
		dumpErrs []error
		takes    int // freeze phases
		wantErr  string
	}{
		{"taken at once", nil, 1, ""},
		{"a dump asks once", []error{retry}, 2, ""},
		{"a dump asks every time", []error{retry, retry, retry}, attempts, "3 coordinated snapshots in a row were not taken"},
		{"a dump fails", []error{other}, 1, "criu failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeRun{dumpErrs: tc.dumpErrs, phases: map[clusterapi.CoordPhase]int{}}
			c := &Coordinator{Self: "a", Members: f, Records: Records{Dir: t.TempDir(), Host: "a"}, Log: slog.New(slog.DiscardHandler)}
			cut, err := c.Snapshot(t.Context(), "r", nil)
			switch {
			case tc.wantErr == "" && (err != nil || len(cut.Parts) != 2):
				t.Errorf("cut %+v, err %v; want a cut of both jobs", cut, err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("err %v; want one saying %q", err, tc.wantErr)
			}
			if got := f.phases[clusterapi.CoordFreeze] / 2; got != tc.takes {
				t.Errorf("%d attempts froze the run, want %d", got, tc.takes)
			}
			if got, want := f.phases[clusterapi.CoordAbort]/2, tc.takes-btoi(tc.wantErr == ""); got != want {
				t.Errorf("%d attempts aborted, want %d", got, want)
			}
		})
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
