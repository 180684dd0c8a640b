package coordinated

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
)

// TestHolds: one hold per run; its end runs once, when the coordinator thaws it or is declared failed,
// and never for a second freeze of a run already held (those jobs are the first hold's).
func TestHolds(t *testing.T) {
	var hs Holds[string]
	uid := uint32(1000)
	key := HoldKey(clusterapi.CoordinateRequest{Run: "farm", UID: &uid})
	if key != "1000/farm" {
		t.Fatalf("HoldKey = %q", key)
	}
	ends := map[string]int{}
	begin := func(key, cut, coordinator string) error {
		h := &Hold[string]{Cut: cut, Coordinator: coordinator, Jobs: []string{"j-" + cut}, Frozen: time.Now()}
		return hs.Begin(key, h, func() { ends[cut]++ }, func() { t.Errorf("hold %s expired", cut) })
	}
	if err := begin(key, "cut-1", "node2"); err != nil {
		t.Fatal(err)
	}
	if err := begin(key, "cut-2", "node3"); err == nil || !strings.Contains(err.Error(), "cut-1") {
		t.Fatalf("second freeze of a held run: %v, want a refusal naming cut-1", err)
	}
	if ends["cut-2"] != 0 || ends["cut-1"] != 0 {
		t.Fatalf("ends after a refused freeze: %v, want none", ends)
	}
	if h := hs.Get(key, "cut-2"); h != nil {
		t.Errorf("Get of another cut: %+v, want nil", h)
	}
	h := hs.Get(key, "cut-1")
	if h == nil || h.Jobs[0] != "j-cut-1" {
		t.Fatalf("Get: %+v", h)
	}
	h.Pause()()
	if hs.End(key, "cut-2") != nil || ends["cut-1"] != 0 {
		t.Fatalf("End of another cut ended the hold: ends %v", ends)
	}
	if got := hs.End(key, "cut-1"); got != h || ends["cut-1"] != 1 || hs.Len() != 0 {
		t.Fatalf("End: %+v, ends %v, %d left", got, ends, hs.Len())
	}
	if hs.End(key, "cut-1") != nil || ends["cut-1"] != 1 {
		t.Fatalf("a second End: ends %v, want the end run once", ends)
	}

	other := HoldKey(clusterapi.CoordinateRequest{Run: "ring", UID: &uid})
	if err := begin(key, "cut-3", "node2"); err != nil {
		t.Fatal(err)
	}
	if err := begin(other, "cut-4", "node3"); err != nil {
		t.Fatal(err)
	}
	ended := hs.EndOf(func(c string) bool { return c == "node2" })
	if len(ended) != 1 || ended[0].Cut != "cut-3" || ends["cut-3"] != 1 || ends["cut-4"] != 0 || hs.Len() != 1 {
		t.Fatalf("EndOf(node2): %d ended, ends %v, %d left; want cut-3 alone", len(ended), ends, hs.Len())
	}
	hs.End(other, "cut-4")
}

// TestHoldFreeze: a host that thawed a held run's jobs to let them accept a connection freezes them again
// through the hold. Once the hold has ended (its coordinator failed, or HoldMax passed), which thawed the
// jobs, they are never frozen again for it: the end comes before or after a freeze, never during, and a
// freeze after the end is refused.
func TestHoldFreeze(t *testing.T) {
	uid := uint32(1000)
	key := HoldKey(clusterapi.CoordinateRequest{Run: "farm", UID: &uid})
	t.Run("before and after the end", func(t *testing.T) {
		var hs Holds[string]
		first := time.Now().Add(-time.Second)
		h := &Hold[string]{Cut: "cut-1", Frozen: first}
		thawed := 0
		if err := hs.Begin(key, h, func() { thawed++ }, func() {}); err != nil {
			t.Fatal(err)
		}
		froze := 0
		freeze := func() error { froze++; return nil }
		if err := h.Freeze(freeze); err != nil || froze != 1 || !h.Frozen.After(first) {
			t.Fatalf("Freeze of a hold: %v, froze %d, Frozen %v; want the jobs frozen and Frozen now", err, froze, h.Frozen)
		}
		if hs.End(key, "cut-1") != h || thawed != 1 || h.FrozenFor >= time.Second {
			t.Fatalf("End: thawed %d, FrozenFor %v; want one thaw, frozen since the last Freeze", thawed, h.FrozenFor)
		}
		if err := h.Freeze(freeze); !errors.Is(err, ErrEnded) || froze != 1 {
			t.Fatalf("Freeze of an ended hold: %v, froze %d; want ErrEnded and no freeze", err, froze)
		}
	})
	t.Run("racing the end", func(t *testing.T) {
		for i := range 200 {
			var hs Holds[string]
			var mu sync.Mutex
			var events []string
			record := func(e string) {
				mu.Lock()
				events = append(events, e)
				mu.Unlock()
			}
			h := &Hold[string]{Cut: fmt.Sprint("cut-", i), Frozen: time.Now()}
			if err := hs.Begin(key, h, func() { record("thaw") }, func() {}); err != nil {
				t.Fatal(err)
			}
			done := make(chan error)
			go func() { done <- h.Freeze(func() error { record("freeze"); return nil }) }()
			hs.End(key, h.Cut)
			err := <-done
			switch {
			case slices.Equal(events, []string{"freeze", "thaw"}) && err == nil:
			case slices.Equal(events, []string{"thaw"}) && errors.Is(err, ErrEnded):
			default:
				t.Fatalf("run %d: events %q, Freeze %v; want a freeze before the thaw, or none after it", i, events, err)
			}
		}
	})
}

// TestUncommittedConcurrentCuts: two cuts of one run thaw on this host before either commits (the
// scheduled cut and an operator's from another coordinator: the first thaw gives the snapshot lock back,
// and the second freezes and dumps then). Each cut's snapshots stay pinned until that cut's commit or
// give-up. Before, the second thaw's pins replaced the first's: the second's replication pruned the first
// cut's snapshot (keep = 1) here and on the protector, its commit then recorded a cut naming a snapshot
// that no longer existed, and the run's previous cut, unpinned by that record, went too.
func TestUncommittedConcurrentCuts(t *testing.T) {
	uid := uint32(1000)
	key := HoldKey(clusterapi.CoordinateRequest{Run: "farm", UID: &uid})
	dump := func(id string) []*ckpt.Manifest { return []*ckpt.Manifest{{Job: "farm-1", ID: id}} }
	const s1, s2 = "20261203T100000.000Z-node1-000001", "20261203T100001.000Z-node1-000002"
	for _, tc := range []struct {
		name  string
		steps func(u *Uncommitted)
		want  []string
	}{
		{"both thawed", func(u *Uncommitted) {}, []string{s1, s2}},
		{"the second committed", func(u *Uncommitted) { u.Done(key, "cut-2", "node2") }, []string{s1}},
		{"the first committed", func(u *Uncommitted) { u.Done(key, "cut-1", "node2") }, []string{s2}},
		{"both committed", func(u *Uncommitted) { u.Done(key, "cut-2", "node2"); u.Done(key, "cut-1", "node2") }, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var u Uncommitted
			u.Add(key, "cut-1", "node2", dump(s1))
			u.Add(key, "cut-2", "node2", dump(s2))
			tc.steps(&u)
			got := u.Pinned("farm-1")
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("pinned %v, want %v", got, tc.want)
			}
		})
	}
}

// TestUncommittedDoneOnlyByCoordinator: a cut's snapshots stay pinned from its thaw (its hold ended) to its
// commit or give-up, which its coordinator alone sends. Before, the pin did not record the coordinator, and
// any member's abort after the thaw unpinned them: retention (keep = 1) then deleted the cut's snapshot, and
// the coordinator's commit recorded a cut naming it.
func TestUncommittedDoneOnlyByCoordinator(t *testing.T) {
	uid := uint32(1000)
	key := HoldKey(clusterapi.CoordinateRequest{Run: "farm", UID: &uid})
	const s1 = "20261203T100000.000Z-node1-000001"
	for _, tc := range []struct {
		name        string
		by          string
		want        []string
		coordinator string
	}{
		{"another member", "node3", []string{s1}, "node2"},
		{"the coordinator", "node2", nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var u Uncommitted
			u.Add(key, "cut-1", "node2", []*ckpt.Manifest{{Job: "farm-1", ID: s1}})
			u.Done(key, "cut-1", tc.by)
			if got := u.Pinned("farm-1"); !slices.Equal(got, tc.want) {
				t.Errorf("after Done from %s: pinned %v, want %v", tc.by, got, tc.want)
			}
			if got := u.Coordinator(key, "cut-1"); got != tc.coordinator {
				t.Errorf("after Done from %s: coordinator %q, want %q", tc.by, got, tc.coordinator)
			}
		})
	}
}
