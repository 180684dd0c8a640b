package agent

import (
	"net/netip"
	"os"
	"os/exec"
	"testing"

	"github.com/ftkit/ftkit/ring"
)

// TestAllEnded: re-protection is skipped only when every restored job has really ended: a job whose record
// says running and whose process lives is waited for (briefly) and then counts as running.
func TestAllEnded(t *testing.T) {
	a := resumeTestAgent(t)
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	a.byID["ended"] = &Job{ID: "ended", State: JobExited, PID: os.Getpid()}
	a.byID["gone"] = &Job{ID: "gone", State: JobRunning, PID: gone.Process.Pid} // exited, not yet noticed
	a.byID["alive"] = &Job{ID: "alive", State: JobRunning, PID: os.Getpid()}
	tests := []struct {
		ids  []string
		want bool
	}{
		{[]string{"ended"}, true},
		{[]string{"gone", "ended"}, true},
		{[]string{"unknown"}, true},
		{[]string{"ended", "alive"}, false},
	}
	for _, tt := range tests {
		if got := a.allEnded(tt.ids); got != tt.want {
			t.Errorf("allEnded(%v) = %v, want %v", tt.ids, got, tt.want)
		}
	}
}

// TestReplaceInViewKeepsLaterChanges: a fail-over's view change goes onto the view as it is when it is
// made, after the fence wait: spares added meanwhile stay, and the failed node is failed. Before, the
// change was made to the view read before the wait, whose epoch the newer view had passed: it was dropped
// as stale, and the fail-over went on with the failed node alive and its replacement a free spare.
func TestReplaceInViewKeepsLaterChanges(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	v, err := ta.View().AddSpare(ring.Member{Name: "spare1", Address: netip.MustParseAddrPort("127.0.0.11:1"), Role: ring.RoleSpare})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ta.adoptView(v); err != nil {
		t.Fatal(err)
	}
	// During the fence wait, two more spares register.
	for i, name := range []string{"spare2", "spare3"} {
		nv, err := ta.View().AddSpare(ring.Member{Name: name, Address: netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, byte(12 + i)}), 1), Role: ring.RoleSpare})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ta.adoptView(nv); err != nil {
			t.Fatal(err)
		}
	}
	if err := ta.replaceInView("node2", "spare1", false, false); err != nil {
		t.Fatal(err)
	}
	cur := ta.View()
	if m, _ := cur.Member("node2"); m.State != ring.StateFailed {
		t.Errorf("view %d: node2 is %s, want failed", cur.Epoch, m.State)
	}
	for _, name := range []string{"spare2", "spare3"} {
		if _, ok := cur.Member(name); !ok {
			t.Errorf("view %d lost %s, added during the fence wait", cur.Epoch, name)
		}
	}
}

// TestReassertFailed: two protectors that failed two nodes over at once each made a view of the same
// epoch, and the one with the larger hash won everywhere: the other failed node was alive again, its
// replacement a free spare, for good. Now its protector, finding the change lost, applies it again.
func TestReassertFailed(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3", "node4")
	v, err := ta.View().AddSpare(ring.Member{Name: "spare1", Address: netip.MustParseAddrPort("127.0.0.11:1"), Role: ring.RoleSpare})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ta.adoptView(v); err != nil {
		t.Fatal(err)
	}
	applied := 0
	reapply := func() error { applied++; return ta.replaceInView("node2", "spare1", false, false) }
	// The view that won fails node4 only (the other protector's change): node2 is alive in it.
	won, err := ta.View().Fail("node4")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ta.adoptView(won); err != nil {
		t.Fatal(err)
	}
	inc := ta.incarnationOf("node2")
	if ta.reassertFailed(t.Context(), "node2", inc+1, reapply) || applied != 0 {
		t.Fatalf("node2 alive as a later incarnation (rejoined): reasserted %d times, want none", applied)
	}
	if !ta.reassertFailed(t.Context(), "node2", inc, reapply) || applied != 1 {
		t.Fatalf("node2 alive in view %d: reasserted %d times, want once", ta.View().Epoch, applied)
	}
	cur := ta.View()
	for _, n := range []string{"node2", "node4"} {
		if m, _ := cur.Member(n); m.State != ring.StateFailed {
			t.Errorf("view %d: %s is %s, want failed (both failures kept)", cur.Epoch, n, m.State)
		}
	}
	if ta.reassertFailed(t.Context(), "node2", inc, reapply) || applied != 1 {
		t.Errorf("node2 failed in the view: applied again (%d)", applied)
	}
}
