package agent

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/detect"
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

// TestServeClaimReleasesFailedClaimers: a ring spare claimed by a protector that failed (or left) before
// its recovery came here is free for the next claim: only that claimer could send the claim's recovery
// request, and the failed node's next protector recovered it elsewhere under a failure id of its own (the
// node is failed in the view, so the abandoned-recovery check never frees it). Never while a job runs or
// is being restored here: the claimer may have failed after sending its request.
func TestServeClaimReleasesFailedClaimers(t *testing.T) {
	for _, tt := range []struct {
		name     string
		claimer  string // "failed", "alive" or "gone" (no member of the view)
		here     string // "", "running" or "restoring": a job on this spare
		accepted bool
	}{
		{"claimer failed, nothing here", "failed", "", true},
		{"claimer no member, nothing here", "gone", "", true},
		{"claimer failed, a job runs here", "failed", "running", false},
		{"claimer failed, a restore is under way here", "failed", "restoring", false},
		{"claimer alive", "alive", "", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			members := testMembers(nil)
			if tt.claimer == "gone" {
				members = slices.DeleteFunc(members, func(m ring.Member) bool { return m.Name == "n2" })
			}
			a, _ := newWireAgent(t, "s1", members)
			if err := a.claims.Claim(spare.Claim{Failure: "n3-1", By: "n2", Failed: "n3", At: time.Now()}, 1<<40); err != nil {
				t.Fatal(err)
			}
			// n2 fails before changing the view; n3's next protector (n1) restores n3's jobs on s2.
			changes := []func(ring.View) (ring.View, error){
				func(v ring.View) (ring.View, error) { return v.ReplaceKeepingAddrs("n3", "s2") },
			}
			if tt.claimer == "failed" {
				changes = append([]func(ring.View) (ring.View, error){func(v ring.View) (ring.View, error) { return v.Fail("n2") }}, changes...)
			}
			for _, change := range changes {
				if _, err := a.updateView(change); err != nil {
					t.Fatal(err)
				}
			}
			switch tt.here {
			case "running":
				a.byID["job-of-n3"] = &Job{ID: "job-of-n3", State: JobRunning, Node: "s1"}
			case "restoring":
				defer a.setBusy(detect.BusyRestore)()
			}
			err := a.serveClaim("n1", spare.Claim{Failure: "s2-1", Failed: "s2", Need: spare.Need{Jobs: 1}})
			requireClaimHeld(t, a, err, tt.accepted, "s2-1", "n3-1")
		})
	}
}

// TestServeClaimReleasesClaimRecoveredElsewhere: a ring spare whose answer to a claim was lost (the claimer
// timed out after the spare had persisted it) is free for the next claim once the claimer's timeline names
// another target: the claimer took the next spare, the failed node is failed in the view, and no recovery
// request of that claim will come here. The old code kept such a claim for as long as the claimer lived:
// the spare refused every later failure. A claim whose timeline names this host, or a timeline that is not
// the claimer's, keeps it (the recovery request may be on its way).
func TestServeClaimReleasesClaimRecoveredElsewhere(t *testing.T) {
	for _, tt := range []struct {
		name      string
		protector string // whose timeline of the claimed failure this host holds
		target    string
		accepted  bool
	}{
		{"claimer recovered on another spare", "n2", "s2", true},
		{"claimer recovers here", "n2", "s1", false},
		{"no target yet", "n2", "", false},
		{"another member's timeline", "n1", "s2", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, "s1", testMembers(nil))
			if err := a.claims.Claim(spare.Claim{Failure: "n3-1", By: "n2", Failed: "n3", At: time.Now()}, 1<<40); err != nil {
				t.Fatal(err)
			}
			if _, err := a.updateView(func(v ring.View) (ring.View, error) { return v.ReplaceKeepingAddrs("n3", "s2") }); err != nil {
				t.Fatal(err)
			}
			a.failures.Update("n3-1", func(f *Failure) {
				f.Node, f.Protector, f.Target, f.Detected = "n3", tt.protector, tt.target, time.Now()
			})
			err := a.serveClaim("n1", spare.Claim{Failure: "n2-1", Failed: "n2", Need: spare.Need{Jobs: 1}})
			requireClaimHeld(t, a, err, tt.accepted, "n2-1", "n3-1")
		})
	}
}

// TestServeClaimReleasesUnnamedClaim: a ring spare claimed by an alive member for a failure whose recovery
// never came here is free again once the claim is older than a recovery may take, whether or not a
// timeline of the claimer names the failure: the claimer's fail-over would have sent its request long
// before. The old code kept such a claim for as long as the claimer lived, so a misbehaving member could
// hold every ring spare; and it kept one the claimer's timeline names for good, so a member could hold a
// spare with a timeline it never finishes, or one that ended before its view change (the node failed over
// by another protector since). A younger claim, or one whose recovery came here, is kept.
func TestServeClaimReleasesUnnamedClaim(t *testing.T) {
	for _, tt := range []struct {
		name     string
		age      time.Duration
		timeline bool // the claimer's timeline names the failure
		record   bool // its recovery request came here
		accepted bool
		done     bool // the claimer's timeline says done, without a target
		failed   bool // the failed node is failed in the view (another protector's failure of it)
	}{
		{"unnamed, older than a recovery", 2 * recoverLimit, false, false, true, false, false},
		{"unnamed, young", time.Minute, false, false, false, false, false},
		{"named by the claimer's timeline, young", time.Minute, true, false, false, false, false},
		{"named by a timeline the claimer never finishes", 2 * recoverLimit, true, false, true, false, false},
		{"named by a timeline the claimer never finishes, its node failed", 2 * recoverLimit, true, false, true, false, true},
		{"named by a timeline that ended before the view changed, its node failed since", 2 * recoverLimit, true, false, true, true, true},
		{"its recovery came here", 2 * recoverLimit, false, true, false, false, false},
		{"its recovery came here, named", 2 * recoverLimit, true, true, false, false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, "s1", testMembers(nil))
			if err := a.claims.Claim(spare.Claim{Failure: "n3-1", By: "n2", Failed: "n3", At: time.Now().Add(-tt.age)}, 1<<40); err != nil {
				t.Fatal(err)
			}
			if tt.timeline {
				a.failures.Update("n3-1", func(f *Failure) { f.Node, f.Protector, f.Detected, f.Done = "n3", "n2", time.Now(), tt.done })
			}
			if tt.failed {
				if _, err := a.updateView(func(v ring.View) (ring.View, error) { return v.Fail("n3") }); err != nil {
					t.Fatal(err)
				}
			}
			if tt.record {
				p := recoveryPath(a.cfg.StateDir, "n3-1")
				if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, []byte(`{"failure":"n3-1"}`), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			err := a.serveClaim("n1", spare.Claim{Failure: "n2-1", Failed: "n2", Need: spare.Need{Jobs: 1}})
			requireClaimHeld(t, a, err, tt.accepted, "n2-1", "n3-1")
		})
	}
}
