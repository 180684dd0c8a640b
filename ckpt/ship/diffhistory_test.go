package ship

import (
	"fmt"
	"testing"
)

func TestDiffHistory(t *testing.T) {
	diffed := func(copied int64) *Sent { return &Sent{BaseID: "base", Bytes: 1600, CopiedBytes: copied} }
	whole := &Sent{Bytes: 1600}
	type step struct {
		record *Sent // recorded before the question, if set
		want   bool  // Diff's answer
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"a job never seen diffs", []step{{nil, true}, {nil, true}}},
		{"a useless diff: four whole transfers, then a diff again", []step{
			{diffed(99), false}, {whole, false}, {whole, false}, {whole, false}, {whole, true},
		}},
		{"a diff that took a sixteenth or more keeps diffing", []step{{diffed(100), true}, {diffed(1500), true}}},
		{"a refused diff counts as useless", []step{{&Sent{DeltaRefused: true, Bytes: 1600}, false}}},
		{"a useful diff after the skips ends them", []step{
			{diffed(0), false}, {nil, false}, {nil, false}, {nil, false}, {nil, true}, {diffed(800), true},
		}},
		{"a useless diff again starts the skips over", []step{
			{diffed(0), false}, {nil, false}, {diffed(0), false}, {nil, false}, {nil, false}, {nil, false}, {nil, true},
		}},
	} {
		var h DiffHistory
		for i, s := range tc.steps {
			if s.record != nil {
				h.Record("job", s.record)
			}
			if got := h.Diff("job"); got != s.want {
				t.Errorf("%s: step %d: Diff = %v, want %v", tc.name, i, got, s.want)
			}
			if !h.Diff("other") {
				t.Errorf("%s: step %d: another job does not diff", tc.name, i)
			}
		}
	}
}

// The history stays bounded: past maxDiffHistory jobs it starts over, which only costs diffs.
func TestDiffHistoryBounded(t *testing.T) {
	var h DiffHistory
	for i := range maxDiffHistory + 10 {
		h.Record(fmt.Sprint("job", i), &Sent{BaseID: "b", Bytes: 100})
	}
	if n := len(h.skip); n != 10 {
		t.Fatalf("%d jobs remembered, want 10 (cleared at %d)", n, maxDiffHistory)
	}
	if h.Diff("job0") == false {
		t.Error("a job forgotten by the clearing still skips its diffs")
	}
}

// Real transfers driven by the history, as the agent ships its scheduled snapshots: a job that rewrites
// every page between snapshots diffs once for nothing, then ships whole for four snapshots; one that
// rewrites a tenth keeps diffing. Every copy verifies.
func TestDiffHistoryTransfers(t *testing.T) {
	for _, tc := range []struct {
		name     string
		every    int    // rewrite one page in every, between snapshots
		wantDiff []bool // for snapshots 2 to 7: against a base or whole
	}{
		{"every page rewritten", 1, []bool{true, false, false, false, false, true}},
		{"a tenth rewritten", 10, []bool{true, true, true, true, true, true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			origin, prot := openStore(t, "node1"), openStore(t, "prot")
			var h DiffHistory
			pages := memoryPages(4<<20, 9)
			for i := range len(tc.wantDiff) + 1 {
				if i > 0 {
					pages = rewritePages(pages, tc.every, byte(i))
				}
				m := makeSnapshot(t, origin, "job", map[string][]byte{"pages-1.img": pages, "core-1.img": []byte("core")})
				sent, _ := shipPipe(t, origin, prot, m.ID, SendOptions{JustCommitted: true, NoDelta: !h.Diff("job")})
				h.Record("job", sent)
				if _, err := prot.Verify(t.Context(), "job", m.ID); err != nil {
					t.Fatalf("snapshot %d: %v", i+1, err)
				}
				if i == 0 {
					continue
				}
				if got := sent.BaseID != ""; got != tc.wantDiff[i-1] {
					t.Errorf("snapshot %d: diffed %v (copied %d of %d bytes), want %v", i+1, got, sent.CopiedBytes, sent.Bytes, tc.wantDiff[i-1])
				}
			}
		})
	}
}

// The history keeps each job's last transfer's index as its next base: replaced by the next transfer's,
// dropped by one without an index (a protector that had the snapshot), by Forget, and, past
// maxBaseIndexes, all at once.
func TestDiffHistoryBases(t *testing.T) {
	index := func(id string, blocks int) *BaseIndex {
		return &BaseIndex{idx: &baseIndex{id: id, bs: 4096, hashes: map[uint32][]uint64{0: make([]uint64, blocks)}}, want: 4096}
	}
	base := func(h *DiffHistory, job string) string {
		if b := h.Base(job); b != nil {
			return b.ID()
		}
		return ""
	}
	var h DiffHistory
	if got := base(&h, "job"); got != "" {
		t.Fatalf("a job never seen has base %q", got)
	}
	h.Record("job", &Sent{Index: index("s1", 10)})
	h.Record("other", &Sent{Index: index("o1", 10)})
	h.Record("job", &Sent{BaseID: "s1", Bytes: 1600, CopiedBytes: 1500, Index: index("s2", 10)})
	if got := base(&h, "job"); got != "s2" {
		t.Errorf("base %q after the transfer of s2, want s2", got)
	}
	if h.size != 2*80 {
		t.Errorf("%d bytes of indexes counted, want %d", h.size, 2*80)
	}
	h.Record("job", &Sent{AlreadyPresent: true})
	if got := base(&h, "job"); got != "" {
		t.Errorf("base %q after a transfer without an index, want none", got)
	}
	h.Forget("other")
	if got := base(&h, "other"); got != "" || h.size != 0 {
		t.Errorf("base %q (%d bytes counted) after Forget, want none", got, h.size)
	}
	big := maxBaseIndexes / 8 / 2 // blocks of half the bound
	h.Record("a", &Sent{Index: index("a1", big)})
	h.Record("b", &Sent{Index: index("b1", big)})
	h.Record("c", &Sent{Index: index("c1", big)})
	if base(&h, "a") != "" || base(&h, "b") != "" || base(&h, "c") != "c1" || h.size != int64(big)*8 {
		t.Errorf("past the bound: bases a %q b %q c %q, %d bytes counted; want only c's", base(&h, "a"), base(&h, "b"), base(&h, "c"), h.size)
	}
	h.Record("d", &Sent{Index: index("d1", maxBaseIndexes/8+1)})
	if base(&h, "d") != "" || base(&h, "c") != "c1" {
		t.Error("an index larger than the bound was kept, or dropped the others")
	}
}
