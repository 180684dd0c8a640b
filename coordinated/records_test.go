package coordinated

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/atomicfile"
)

// TestCutRecords: cut records are kept per run and user; a run name alone finds the one user's; two users'
// runs of one name need the user; a record whose content names another run or user, or a part that is no
// snapshot, is refused; retention keeps the snapshots a record names.
func TestCutRecords(t *testing.T) {
	r := Records{Dir: t.TempDir(), Host: "node1", Log: slog.New(slog.DiscardHandler)}
	part := func(job, snap string) clusterapi.CutPart {
		return clusterapi.CutPart{Job: job, Host: "node1", Snapshot: snap}
	}
	const s1, s2 = "20260501T120000.000Z-node1-000001", "20260501T120100.000Z-node2-000002"
	mine := Cut{Run: "r1", UID: 1000, ID: "cut-1", Parts: []clusterapi.CutPart{part("a-00000001", s1)}}
	if err := r.Save(mine); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Load("r2", nil); !errors.Is(err, ErrNoCut) {
		t.Errorf("a run without a cut: %v, want ErrNoCut", err)
	}
	if c, err := r.Load("r1", nil); err != nil || c.ID != "cut-1" || c.UID != 1000 {
		t.Errorf("the one user's cut of r1: %+v %v", c, err)
	}
	older := mine
	older.ID = "cut-0"
	if err := r.Save(older); err != nil { // a commit that arrives after a newer one's
		t.Fatal(err)
	}
	if c, err := r.Load("r1", nil); err != nil || c.ID != "cut-1" {
		t.Errorf("after an older cut's late commit: %+v %v, want cut-1 kept", c, err)
	}
	theirs := Cut{Run: "r1", UID: 2000, ID: "cut-2", Parts: []clusterapi.CutPart{part("b-00000002", s2)}}
	if err := r.Save(theirs); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Load("r1", nil); err == nil || !strings.Contains(err.Error(), "name the user") {
		t.Errorf("r1 of two users without a user: %v, want a refusal asking for it", err)
	}
	uid := uint32(2000)
	if c, err := r.Load("r1", &uid); err != nil || c.ID != "cut-2" {
		t.Errorf("uid 2000's cut of r1: %+v %v", c, err)
	}
	if got := r.Pinned("b-00000002"); !slices.Equal(got, []string{s2}) {
		t.Errorf("pinned snapshots of b: %v, want [%s]", got, s2)
	}
	if c, p := r.With("a-00000001"); c == nil || c.UID != 1000 || p.Snapshot != s1 {
		t.Errorf("cut with job a: %+v %+v", c, p)
	}
	// A record is read as another member wrote it: a renamed or edited one is refused, never used.
	if err := os.Rename(r.path("r1", 2000), r.path("r1", 3000)); err != nil {
		t.Fatal(err)
	}
	other := uint32(3000)
	if _, err := r.Load("r1", &other); err == nil || !strings.Contains(err.Error(), "names run r1 of uid 2000") {
		t.Errorf("a record moved to another user's name: %v, want it refused", err)
	}
	bad := mine
	bad.Parts = []clusterapi.CutPart{part("a-00000001", "../../etc/passwd")}
	if err := atomicfile.WriteJSON(r.path("r1", 1000), bad); err != nil {
		t.Fatal(err)
	}
	mineUID := uint32(1000)
	if _, err := r.Load("r1", &mineUID); err == nil || !strings.Contains(err.Error(), "snapshot") {
		t.Errorf("a record naming a path as a snapshot: %v, want it refused", err)
	}
	if got := r.Pinned("a-00000001"); len(got) != 0 {
		t.Errorf("pinned from a refused record: %v", got)
	}
}

// TestCutRecordsConcurrentCommits: two cuts' commits of one run arrive at once (an operator's cut beside
// the scheduled one, each from its coordinator). The newer stays recorded, whichever writes last. Before,
// both read the record before either wrote it, and the older's write could replace the newer's: the run
// went back to a cut its other members had superseded, and the newer cut's snapshots lost their pin.
func TestCutRecordsConcurrentCommits(t *testing.T) {
	r := Records{Dir: t.TempDir(), Host: "node1", Log: slog.New(slog.DiscardHandler)}
	part := []clusterapi.CutPart{{Job: "a-00000001", Host: "node1", Snapshot: "20260501T120000.000Z-node1-000001"}}
	for i := range 50 {
		older := Cut{Run: "r1", UID: 1000, ID: fmt.Sprintf("cut-%03d-0", i), Parts: part}
		newer := older
		newer.ID = fmt.Sprintf("cut-%03d-1", i)
		var wg sync.WaitGroup
		for _, c := range []Cut{newer, older} {
			wg.Go(func() {
				if err := r.Save(c); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		if c, err := r.Load("r1", nil); err != nil || c.ID != newer.ID {
			t.Fatalf("round %d: recorded %+v %v after the commits of %s and %s at once; want %s", i, c, err, newer.ID, older.ID, newer.ID)
		}
	}
}

// TestRemoveOnlyTheCutLookedAt: forgetting a run's stale cut removes the cut its caller looked at, not a
// newer one whose commit came in between (the run goes on on other hosts, and this host, which runs none of
// its jobs, records each cut). Before, Remove took whatever was recorded: the run's newest cut, which it
// may need for a rollback, was gone from this member.
func TestRemoveOnlyTheCutLookedAt(t *testing.T) {
	part := []clusterapi.CutPart{{Job: "a-00000001", Host: "node1", Snapshot: "20260501T120000.000Z-node1-000001"}}
	stale := Cut{Run: "r1", UID: 1000, ID: "cut-20261203T100000.000", Parts: part}
	newer := stale
	newer.ID = "cut-20261203T110000.000"
	for _, tc := range []struct {
		name     string
		recorded []Cut // saved after the caller looked at stale
		removed  bool
		left     string // the cut recorded after the removal, "" for none
	}{
		{"unchanged", nil, true, ""},
		{"newer committed since", []Cut{newer}, false, newer.ID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Records{Dir: t.TempDir(), Host: "node1", Log: slog.New(slog.DiscardHandler)}
			if err := r.Save(stale); err != nil {
				t.Fatal(err)
			}
			looked := r.All()
			if len(looked) != 1 || looked[0].ID != stale.ID {
				t.Fatalf("recorded %+v, want %s", looked, stale.ID)
			}
			for _, c := range tc.recorded {
				if err := r.Save(c); err != nil {
					t.Fatal(err)
				}
			}
			removed, err := r.Remove(looked[0].Run, looked[0].UID, looked[0].ID)
			if err != nil || removed != tc.removed {
				t.Errorf("Remove of %s: %v, %v; want %v, nil", looked[0].ID, removed, err, tc.removed)
			}
			c, err := r.Load("r1", &stale.UID)
			switch {
			case tc.left == "" && !errors.Is(err, ErrNoCut):
				t.Errorf("after the removal: %+v, %v; want no cut", c, err)
			case tc.left != "" && (err != nil || c.ID != tc.left):
				t.Errorf("after the removal of %s: recorded %+v, %v; want %s kept", stale.ID, c, err, tc.left)
			}
		})
	}
	// No record at all (nothing was ever committed here): nothing to remove, no error.
	r := Records{Dir: t.TempDir() + "/cuts", Host: "node1", Log: slog.New(slog.DiscardHandler)}
	if removed, err := r.Remove("r1", 1000, stale.ID); removed || err != nil {
		t.Errorf("Remove without a records directory: %v, %v; want false, nil", removed, err)
	}
}

// TestRecordOfLargeCut: a cut whose commit a member accepts (at most clusterapi.MaxMessage on the wire) is
// recorded so that it reads back, though the record, indented, is larger than the commit; a record past
// what Load reads is refused by Save, and the run's previous record stays. Before, a commit of 4096 parts
// with long names was written as a record larger than Load's bound: the run had no readable cut on that
// member, its previous record replaced, and neither cut's snapshots pinned.
func TestRecordOfLargeCut(t *testing.T) {
	host := strings.Repeat("h", 40)
	large := func(id string, parts int, conns int) Cut {
		c := Cut{Run: "r1", UID: 1000, ID: id}
		for i := range parts {
			p := clusterapi.CutPart{Job: fmt.Sprintf("%s-%08x", strings.Repeat("j", 48), i), Host: host,
				Snapshot: fmt.Sprintf("20260501T120000.000Z-%s-%06d", host, i+1), Recovery: RecoveryCoordinated}
			for range conns {
				p.Conns = append(p.Conns, ckpt.Conn{})
			}
			c.Parts = append(c.Parts, p)
		}
		return c
	}
	prev := large("cut-0", 1, 0)
	for _, tc := range []struct {
		name string
		cut  Cut
		ok   bool
	}{
		{"a commit a member accepts", large("cut-1", clusterapi.MaxCutParts, 0), true},
		{"past what Load reads", large("cut-2", 64, 1000), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Records{Dir: t.TempDir(), Host: "node1", Log: slog.New(slog.DiscardHandler)}
			if err := r.Save(prev); err != nil {
				t.Fatal(err)
			}
			commit := clusterapi.CoordinateRequest{Run: tc.cut.Run, UID: &tc.cut.UID, Cut: tc.cut.ID, Phase: clusterapi.CoordCommit, Parts: tc.cut.Parts}
			if b, err := json.Marshal(commit); tc.ok && (err != nil || len(b) > clusterapi.MaxMessage) {
				t.Fatalf("the commit is %d bytes (%v), want one a member accepts", len(b), err)
			}
			err := r.Save(tc.cut)
			want := prev.ID
			if tc.ok {
				want = tc.cut.ID
				if err != nil {
					t.Fatalf("Save: %v", err)
				}
			} else if err == nil {
				t.Errorf("Save of a record Load refuses succeeded")
			}
			if c, err := r.Load("r1", nil); err != nil || c.ID != want {
				t.Errorf("recorded: %v, want cut %s readable", err, want)
			}
		})
	}
}
