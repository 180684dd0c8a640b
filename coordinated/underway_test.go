package coordinated

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// underwayRun is fakeRun, noting at each phase how many cuts were recorded as under way.
type underwayRun struct {
	*fakeRun
	dir    string
	counts map[clusterapi.CoordPhase][]int
}

func (u *underwayRun) Coordinate(ctx context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	des, _ := os.ReadDir(u.dir)
	u.fakeRun.mu.Lock()
	u.counts[req.Phase] = append(u.counts[req.Phase], len(des))
	u.fakeRun.mu.Unlock()
	return u.fakeRun.Coordinate(ctx, host, req)
}

// TestUnderwayRecordedUntilCommit: a cut is recorded as under way from before its freeze until just before
// its commit is sent (a commit that reached some members only must not be aborted on the others by a
// restarted coordinator, AbortLeft), and forgotten when it is given up.
func TestUnderwayRecordedUntilCommit(t *testing.T) {
	for _, tc := range []struct {
		name     string
		dumpErrs []error
	}{
		{"committed", nil},
		{"given up", []error{&clusterapi.Error{Code: clusterapi.CodeRefused, Message: "criu failed"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "under-way")
			f := &underwayRun{fakeRun: &fakeRun{dumpErrs: tc.dumpErrs, phases: map[clusterapi.CoordPhase]int{}}, dir: dir, counts: map[clusterapi.CoordPhase][]int{}}
			c := &Coordinator{Self: "a", Members: f, Records: Records{Dir: t.TempDir(), Host: "a"}, Underway: Underway{Dir: dir}, Log: slog.New(slog.DiscardHandler)}
			_, err := c.Snapshot(t.Context(), "r", nil)
			if committed := len(f.counts[clusterapi.CoordCommit]) > 0; committed != (tc.dumpErrs == nil) || committed != (err == nil) {
				t.Fatalf("commit sent %v, err %v", committed, err)
			}
			for _, n := range f.counts[clusterapi.CoordFreeze] {
				if n != 1 {
					t.Errorf("freeze sent with %d cuts recorded as under way, want 1", n)
				}
			}
			for _, n := range f.counts[clusterapi.CoordCommit] {
				if n != 0 {
					t.Errorf("commit sent with %d cuts recorded as under way, want 0", n)
				}
			}
			if des, _ := os.ReadDir(dir); len(des) != 0 {
				t.Errorf("%d cuts still recorded as under way after the cut ended", len(des))
			}
			// Nothing left to give up at the next start.
			f.phases = map[clusterapi.CoordPhase]int{}
			c.AbortLeft(t.Context())
			if n := f.phases[clusterapi.CoordAbort]; n != 0 {
				t.Errorf("a restart sent %d aborts of cuts that had ended", n)
			}
		})
	}
}

// TestAbortLeftRefusesForeignRecord: a record left under way is validated before any name in it is used:
// one naming a host that is no member name, or an invalid run, is removed without a word to anyone.
func TestAbortLeftRefusesForeignRecord(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{
		"bad-host.0.cut-1.json": `{"run":"r","uid":0,"cut":"cut-1","hosts":["../../etc"]}`,
		"bad-run.0.cut-1.json":  `{"run":"../r","uid":0,"cut":"cut-1","hosts":["a"]}`,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f := &fakeRun{phases: map[clusterapi.CoordPhase]int{}}
	c := &Coordinator{Self: "a", Members: f, Underway: Underway{Dir: dir}, Log: slog.New(slog.DiscardHandler)}
	c.AbortLeft(t.Context())
	if n := f.phases[clusterapi.CoordAbort]; n != 0 {
		t.Errorf("%d aborts sent for invalid records", n)
	}
	if des, _ := os.ReadDir(dir); len(des) != 0 {
		t.Errorf("%d invalid records left", len(des))
	}
}
