package agent

import (
	"testing"
	"time"

	"github.com/ftkit/ftkit/spare"
)

// TestServeClaimAgesClaimOnOwnClock: an idle node of a run claimed for a failure frees that claim, when no
// recovery came, once it is older than a recovery may take, by this host's clock. The claim's time came
// from the claimer, whose clock may lag: a claimer 2*recoverLimit behind had the claim freed for another
// failure right after the view change, before its recovery request came (refused then, its jobs lost).
func TestServeClaimAgesClaimOnOwnClock(t *testing.T) {
	a, _ := newWireAgent(t, "n1", testMembers(nil))
	lagging := time.Now().Add(-2 * recoverLimit) // the claimer's wall clock
	if err := a.serveClaim("n2", spare.Claim{Failure: "n3-1", Failed: "n3", At: lagging, Spares: []string{"n1"}, Need: spare.Need{Jobs: 1}}); err != nil {
		t.Fatal(err)
	}
	// The claimer's fail-over changed the view (n1 absorbs n3); its recovery request is on its way.
	nv, err := a.View().Absorb("n3", "n1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.adoptView(nv); err != nil {
		t.Fatal(err)
	}
	err = a.serveClaim("n2", spare.Claim{Failure: "n3-2", Failed: "n3", Spares: []string{"n1"}, Need: spare.Need{Jobs: 1}})
	requireClaimHeld(t, a, err, false, "n3-2", "n3-1")
}
