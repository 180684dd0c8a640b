package coordinated

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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

// bigRun is a run of n jobs on host b and one on host a. Each host records the commit as the agent does:
// a peer's through the client, which validates the request, the coordinator's own directly.
type bigRun struct {
	n       int
	late    bool   // b's jobs but one started after the list
	peer    string // host b's name ("": "b")
	records map[string]Records
}

func (f *bigRun) Alive() []string {
	if f.peer != "" {
		return []string{"a", f.peer}
	}
	return []string{"a", "b"}
}

func (f *bigRun) Coordinate(_ context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	var parts []clusterapi.CutPart
	var jobs []string
	owners := map[string]uint32{}
	for i := range f.n {
		if host == "a" && i > 0 {
			break
		}
		job := fmt.Sprintf("job%s-%08d", host, i)
		jobs = append(jobs, job)
		owners[job] = 0
		parts = append(parts, clusterapi.CutPart{Job: job, Host: host, Snapshot: fmt.Sprintf("20261203T100000.000Z-%s-%06d", host, i+1)})
	}
	switch req.Phase {
	case clusterapi.CoordList:
		if f.late {
			jobs = jobs[:1]
		}
		return clusterapi.CoordinateReply{Jobs: jobs, Owners: owners}, nil
	case clusterapi.CoordDump, clusterapi.CoordThaw:
		return clusterapi.CoordinateReply{Parts: parts}, nil
	case clusterapi.CoordCommit:
		if host != "a" {
			if err := req.Validate(); err != nil {
				return clusterapi.CoordinateReply{}, err
			}
			// As a peer's server reads it.
			if b, err := json.Marshal(req); err != nil || len(b) > clusterapi.MaxMessage {
				return clusterapi.CoordinateReply{}, &clusterapi.Error{Code: clusterapi.CodeTooLarge, Message: fmt.Sprintf("the commit request is longer than %d bytes", clusterapi.MaxMessage)}
			}
		}
		return clusterapi.CoordinateReply{}, f.records[host].Save(Cut{Run: req.Run, UID: *req.UID, ID: req.Cut, Parts: req.Parts})
	}
	return clusterapi.CoordinateReply{}, nil
}

// TestSnapshotOfTooManyJobs: a run of more jobs than a cut holds (clusterapi.MaxCutParts) gets no cut, and
// says so, before its freeze if its list shows them; every host keeps the run's previous cut. Before, the coordinator reported the cut taken: its own
// commit, which no client validates, wrote a record that every later read refuses over its previous cut's
// (unpinning that cut's snapshots), and every peer refused the commit.
func TestSnapshotOfTooManyJobs(t *testing.T) {
	for _, tc := range []struct {
		name string
		jobs int // on host b
		late bool
		peer string
		ok   bool
	}{
		{"as many as a cut holds", clusterapi.MaxCutParts - 1, false, "", true},
		{"one more", clusterapi.MaxCutParts, false, "", false},
		{"one more, started after the list", clusterapi.MaxCutParts, true, "", false},
		// A commit longer than a member reads (long names): before, every peer refused it, the coordinator
		// alone recorded the cut, and the peers' pins of its snapshots held their replication until their bound.
		{"a commit longer than a member reads", clusterapi.MaxCutParts - 1, false, strings.Repeat("b", 63), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &bigRun{n: tc.jobs, late: tc.late, peer: tc.peer, records: map[string]Records{}}
			uid := uint32(0)
			prev := Cut{Run: "r", UID: uid, ID: "cut-20261203T090000.000",
				Parts: []clusterapi.CutPart{{Job: "joba-00000000", Host: "a", Snapshot: "20261203T090000.000Z-a-000001"}}}
			for _, h := range f.Alive() {
				f.records[h] = Records{Dir: t.TempDir(), Host: h, Log: slog.New(slog.DiscardHandler)}
				if err := f.records[h].Save(prev); err != nil {
					t.Fatal(err)
				}
			}
			c := &Coordinator{Self: "a", Members: f, Records: f.records["a"], Log: slog.New(slog.DiscardHandler)}
			cut, err := c.Snapshot(t.Context(), "r", &uid)
			if tc.ok {
				if err != nil || len(cut.Parts) != tc.jobs+1 {
					t.Fatalf("cut of %d jobs: %v", tc.jobs+1, err)
				}
				prev = *cut
			} else if err == nil || !errors.Is(err, ErrRefused) {
				t.Errorf("cut of %d jobs, more than a member records: %v, want it refused", tc.jobs+1, err)
			}
			for _, h := range f.Alive() {
				if rec, err := f.records[h].Load("r", &uid); err != nil || rec.ID != prev.ID {
					t.Errorf("record on %s: %v, want cut %s", h, err, prev.ID)
				}
			}
		})
	}
}
