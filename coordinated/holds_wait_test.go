package coordinated

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
)

// TestHoldOutlastsSlowerHostsDumps: after its own dump a host keeps its hold as long as the coordinator
// waits for the slowest host's dump, not HoldMax: a launcher's host beside one dumping eight 8 GiB ranks
// (90 s) thawed its jobs a minute after its own quick dump, the thaw found nothing held, and the run was
// never cut. A coordinator that never comes back still has the hold end by itself.
func TestHoldOutlastsSlowerHostsDumps(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var hs Holds[string]
		ended, expired := 0, 0
		h := &Hold[string]{Cut: "cut-1", Coordinator: "n2"}
		if err := hs.Begin("big.0", h, func() { ended++ }, func() { expired++ }); err != nil {
			t.Fatal(err)
		}
		h.Pause()() // this host's dump, done at once
		time.Sleep(HoldMax + 30*time.Second)
		if hs.Get("big.0", "cut-1") == nil || ended != 0 {
			t.Fatalf("%s after this host's dump, with the coordinator waiting for another's: the hold ended (%d)", HoldMax+30*time.Second, ended)
		}
		time.Sleep(clusterapi.MaxCoordStep)
		synctest.Wait()
		if hs.Get("big.0", "cut-1") != nil || ended != 1 || expired != 1 {
			t.Errorf("past the coordinator's own bound: hold still there %v, ended %d, expired %d; want it ended by itself", hs.Get("big.0", "cut-1") != nil, ended, expired)
		}
	})
}
