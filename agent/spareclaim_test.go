package agent

import (
	"testing"
	"time"

	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
)

// TestServeClaimKeepsClaimWhileRunningItsJobs: a ring spare that restored a failure's jobs keeps its claim
// while they run, even when the view lists the failed node alive again (another failure's view of the same
// epoch won the tie-break, until the protector re-applies its change): the failure's timeline says done,
// but the jobs did come here, and a second failure's jobs must not be put on the same spare.
func TestServeClaimKeepsClaimWhileRunningItsJobs(t *testing.T) {
	a, _ := newWireAgent(t, "s1", testMembers(nil))
	if err := a.serveClaim("n2", spare.Claim{Failure: "n3-1", Failed: "n3", Need: spare.Need{Jobs: 1}}); err != nil {
		t.Fatal(err)
	}
	// The recovery ran here and is over; n3's job runs on s1.
	a.byID["job-of-n3"] = &Job{ID: "job-of-n3", State: JobRunning, Node: "s1"}
	a.failures.Update("n3-1", func(f *Failure) {
		f.Node, f.Protector, f.Target, f.Detected, f.Done = "n3", "n2", "s1", time.Now(), true
	})
	// The view that replaced n3 by s1 lost the tie: this host's view lists n3 alive and s1 a spare.
	err := a.serveClaim("n1", spare.Claim{Failure: "n2-1", Failed: "n2", Need: spare.Need{Jobs: 1}})
	requireClaimHeld(t, a, err, false, "n2-1", "n3-1")
}

// TestServeClaimAfterRejoin: a spare whose claim was used (it replaced the failed node), then failed and
// rejoined as a new incarnation (its jobs dropped), takes claims again: that claim ended with the
// incarnation that served it.
func TestServeClaimAfterRejoin(t *testing.T) {
	a, _ := newWireAgent(t, "s1", testMembers(nil))
	if err := a.serveClaim("n2", spare.Claim{Failure: "n3-1", Failed: "n3", Need: spare.Need{Jobs: 1}}); err != nil {
		t.Fatal(err)
	}
	a.failures.Update("n3-1", func(f *Failure) {
		f.Node, f.Protector, f.Target, f.Detected, f.Done = "n3", "n2", "s1", time.Now(), true
	})
	for _, change := range []func(ring.View) (ring.View, error){
		func(v ring.View) (ring.View, error) { return v.ReplaceKeepingAddrs("n3", "s1") },
		func(v ring.View) (ring.View, error) { return v.Fail("s1") },
		func(v ring.View) (ring.View, error) { return v.Rejoin("s1", 0) },
	} {
		if _, err := a.updateView(change); err != nil {
			t.Fatal(err)
		}
	}
	if m, _ := a.View().Member("s1"); m.Role != ring.RoleSpare || m.State != ring.StateAlive || m.Incarnation != 1 {
		t.Fatalf("s1 %+v, want an alive spare at incarnation 1", m)
	}
	err := a.serveClaim("n2", spare.Claim{Failure: "n1-1", Failed: "n1", Need: spare.Need{Jobs: 1}})
	requireClaimHeld(t, a, err, true, "n1-1", "n3-1")
}
