package agent

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// TestHoldEndsWhenCoordinatorFails: a host holds a run's jobs frozen, and its snapshot lock, from the
// freeze of a cut to its coordinator's thaw. A view that declares the coordinator failed ends the hold at
// once (the old code waited coordinated.HoldMax, a minute, and a rollback's stop waited with it); a view that fails
// another member does not.
func TestHoldEndsWhenCoordinatorFails(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	uid := uint32(0)
	j, r := frozenJob(t, ta, Job{ID: "farm-node1-1", UID: uid, Spec: JobSpec{Run: "farm"}, Net: &JobNet{Name: "ftj-test"}})
	freeze := clusterapi.CoordinateRequest{Run: "farm", UID: &uid, Cut: "cut-1", Phase: clusterapi.CoordFreeze}
	rep, err := ta.serveCoordinate(t.Context(), "node2", freeze)
	if err != nil || !slices.Equal(rep.Jobs, []string{j.ID}) {
		t.Fatalf("freeze from node2: %+v, %v", rep, err)
	}
	frozen := func() string {
		b, _ := os.ReadFile(filepath.Join(j.Cgroup, "cgroup.freeze"))
		return string(b)
	}
	held := func() bool {
		if ta.ckptMu.TryLock() {
			ta.ckptMu.Unlock()
			return false
		}
		return true
	}
	if frozen() != "1" || !held() || r.held != 1 {
		t.Fatalf("after the freeze: cgroup.freeze %q, snapshot lock held %v, priority raised %d times; want 1, true, 1", frozen(), held(), r.held)
	}

	fail := func(name string) {
		t.Helper()
		v, err := ta.View().Fail(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ta.adoptView(v); err != nil {
			t.Fatal(err)
		}
	}
	fail("node3")
	if frozen() != "1" || !held() {
		t.Fatalf("node3 failed, not the coordinator: cgroup.freeze %q, snapshot lock held %v; want 1, true", frozen(), held())
	}

	fail("node2")
	if frozen() != "0" || held() || r.held != 0 {
		t.Fatalf("coordinator node2 failed: cgroup.freeze %q, snapshot lock held %v, priority raised %d times; want 0 (thawed), false, 0", frozen(), held(), r.held)
	}
	if left := ta.coord.Len(); left != 0 {
		t.Errorf("%d holds left after the coordinator's failure", left)
	}
}
