package agent

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/restore"
)

// TestRouteEdits: a recovery's route changes stay on disk until their put-back, a restarted agent puts
// back what is left (a job network deleted since has nothing left), and what it could not put back is
// tried again at the next start. The put-back itself is restore's (TestTakeOverAnnounce,
// TestLowerPathMTU); a kernel-level run of the whole is TestFaultAgentKilledDuringReplay's check of the
// spare's routes.
func TestRouteEdits(t *testing.T) {
	path := filepath.Join(t.TempDir(), routeEditsFile)
	log := slog.New(slog.DiscardHandler)
	k := openRouteEdits(path, log)
	routes := []restore.RaisedRoute{{Route: "2 10.0.0.0/24 <nil> 0 254", SetCwnd: 300, SetRwnd: 300}}
	mtu := []restore.LoweredRoute{{Route: "2 10.0.0.0/24 <nil> 0 254", SetMTU: 1499, SetAdvMSS: 1460}}
	doneHost := k.Keep("", restore.RouteEdit{Iface: "ftkit-test-missing0", InitCwnd: routes, MTU: mtu})
	doneJob := k.Keep("ftjob-gone", restore.RouteEdit{Iface: "eth0", InitCwnd: routes})
	doneOther := k.Keep("ftjob-other", restore.RouteEdit{Iface: "eth0", InitCwnd: routes})
	doneOther()
	doneOther() // once only
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the record of route changes: %v, %v; want a 0600 file", fi, err)
	}

	// The agent is killed here: the two entries left are what the next one finds.
	next := openRouteEdits(path, log)
	err := next.putBackLeft()
	if err == nil || !strings.Contains(err.Error(), "ftkit-test-missing0") {
		t.Errorf("put back on a missing interface: %v, want its error", err)
	}
	if len(next.left) != 1 {
		t.Fatalf("after the put-back %d entries are left (%+v), want the host's, which failed", len(next.left), next.left)
	}
	for _, e := range next.left {
		if e.Netns != "" || e.Iface != "ftkit-test-missing0" || len(e.InitCwnd) != 1 || e.InitCwnd[0].SetCwnd != 300 || len(e.MTU) != 1 || e.MTU[0].SetMTU != 1499 {
			t.Errorf("entry left: %+v", e)
		}
	}
	// And the one after finds it still.
	if err := openRouteEdits(path, log).putBackLeft(); err == nil {
		t.Error("the entry that failed was not tried again at the next start")
	}
	// Had the first agent lived, its put-backs would have left nothing.
	doneHost()
	doneJob()
	if b, err := os.ReadFile(path); err != nil || strings.TrimSpace(string(b)) != "{}" {
		t.Errorf("after every put-back the record holds %q (%v), want nothing", b, err)
	}

	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := openRouteEdits(path, log).putBackLeft(); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("a corrupt record: %v, want an error naming it", err)
	}
	if err := openRouteEdits(filepath.Join(t.TempDir(), "none"), log).putBackLeft(); err != nil {
		t.Errorf("no record: %v", err)
	}
	var nilKeeper *routeEdits
	nilKeeper.Keep("", restore.RouteEdit{})()
	if err := nilKeeper.putBackLeft(); err != nil {
		t.Error(err)
	}
}
