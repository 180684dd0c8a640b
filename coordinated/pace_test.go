package coordinated

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
)

// TestPace: when Schedule takes a run's cut, or first looks whether its newest cut holds every job of the
// run. Before, the first cut was taken at once and the next an interval later whatever happened: a rank
// that started after the first cut (an MPI launch starts its ranks one host after another) could not be
// rolled back for a whole interval, nor could any job after a failed cut.
func TestPace(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 7, 0, 0, 0, time.UTC)
	const iv = time.Minute
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	cutAt := func(s float64) *Cut { return &Cut{ID: "c", Taken: at(s)} }
	for _, tc := range []struct {
		name       string
		p          pace
		newest     *Cut
		now        float64 // seconds after t0
		take, look bool
	}{
		{name: "a run's first cut: at once", now: 0, take: true},
		{name: "taking part: an interval after the newest cut", p: pace{tried: at(0)}, newest: cutAt(0), now: 30},
		{name: "taking part, the interval passed", p: pace{tried: at(0)}, newest: cutAt(0), now: 60, take: true},
		{name: "taking part: no looks", p: pace{tried: at(0)}, newest: cutAt(0), now: 2},
		{name: "coordinating: the first look 2 s after the cut", p: pace{tried: at(0), coordinates: true}, newest: cutAt(0.1), now: 2.1, look: true},
		{name: "coordinating: not before", p: pace{tried: at(0), coordinates: true}, newest: cutAt(0.1), now: 2},
		{name: "coordinating: the second look 4 s after the first", p: pace{tried: at(0), coordinates: true, looks: 1, looked: at(2)}, newest: cutAt(0), now: 5.9},
		{name: "coordinating: the second look", p: pace{tried: at(0), coordinates: true, looks: 1, looked: at(2)}, newest: cutAt(0), now: 6, look: true},
		{name: "coordinating: a look older than the newest cut (an operator's) counts from the cut",
			p: pace{tried: at(0), coordinates: true, looks: 1, looked: at(2)}, newest: cutAt(10), now: 13},
		{name: "coordinating: the interval passed", p: pace{tried: at(0), coordinates: true, looks: 5, looked: at(58)}, newest: cutAt(0), now: 60, take: true},
		{name: "coordinating, no cut recorded: the interval", p: pace{tried: at(0), coordinates: true}, now: 30},
		{name: "failed once: again after 2 s", p: pace{tried: at(0), coordinates: true, failed: 1}, now: 2, take: true},
		{name: "failed once: not before", p: pace{tried: at(0), coordinates: true, failed: 1}, now: 1.9},
		{name: "failed three times: 8 s", p: pace{tried: at(0), failed: 3}, newest: cutAt(-100), now: 7.9},
		{name: "failed three times, 8 s after", p: pace{tried: at(0), failed: 3}, newest: cutAt(-100), now: 8, take: true},
		{name: "failed often: at most the interval", p: pace{tried: at(0), failed: 40}, now: 60, take: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			take, look := tc.p.next(at(tc.now), iv, tc.newest)
			if take != tc.take || look != tc.look {
				t.Errorf("next at %vs: take %v, look %v; want %v, %v", tc.now, take, look, tc.take, tc.look)
			}
		})
	}
}

// listMembers answers the list phase with jobs by host.
type listMembers map[string][]string

func (m listMembers) Alive() []string {
	var out []string
	for h := range m {
		out = append(out, h)
	}
	return out
}

func (m listMembers) Coordinate(_ context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	if req.Phase != clusterapi.CoordList {
		return clusterapi.CoordinateReply{}, fmt.Errorf("phase %s: only the list is asked", req.Phase)
	}
	return clusterapi.CoordinateReply{Jobs: m[host]}, nil
}

// TestOutOf: the jobs of a run its newest cut does not hold, on every alive member.
func TestOutOf(t *testing.T) {
	c := &Coordinator{Self: "node1", Log: slog.New(slog.DiscardHandler),
		Members: listMembers{"node1": {"rank0"}, "node2": {"rank1", "rank2"}, "node3": nil}}
	cut := &Cut{Run: "ring", Parts: []clusterapi.CutPart{{Job: "rank0", Host: "node1"}, {Job: "rank2", Host: "node2"}}}
	out, err := c.outOf(t.Context(), cut)
	if err != nil || !slices.Equal(out, []string{"rank1"}) {
		t.Fatalf("outOf = %v, %v; want [rank1]", out, err)
	}
	cut.Parts = append(cut.Parts, clusterapi.CutPart{Job: "rank1", Host: "node2"})
	if out, err := c.outOf(t.Context(), cut); err != nil || len(out) != 0 {
		t.Fatalf("outOf a cut of every job = %v, %v; want none", out, err)
	}
}

// TestPaceOverTime runs the pace of a coordinating host second by second, as Schedule does: a run whose
// jobs all started before its first cut is looked at 2, 6, 14, 30 s after it and cut again on its
// interval; a run whose jobs keep coming (a job per task) is cut for them ever less often, the gaps
// doubling up to its interval, never every look.
func TestPaceOverTime(t *testing.T) {
	const iv = time.Minute
	t0 := time.Date(2026, 12, 3, 7, 0, 0, 0, time.UTC)
	run := func(missing bool) (cuts, looks []int) {
		p := &pace{}
		var newest *Cut
		for s := 0; s <= 300; s++ {
			now := t0.Add(time.Duration(s) * time.Second)
			take, look := p.next(now, iv, newest)
			forJobs := false
			if look {
				looks = append(looks, s)
				p.lookedAt(now, missing)
				take, forJobs = missing, missing
			}
			if !take {
				continue
			}
			p.tried, p.coordinates = now, true
			newest = &Cut{ID: fmt.Sprint(s), Taken: now}
			p.took(true, forJobs)
			cuts = append(cuts, s)
		}
		return cuts, looks
	}
	cuts, looks := run(false)
	if want := []int{0, 60, 120, 180, 240, 300}; !slices.Equal(cuts, want) {
		t.Errorf("a run whose cuts hold every job: cuts at %v s, want %v", cuts, want)
	}
	if want := []int{2, 6, 14, 30, 62, 66, 74, 90}; !slices.Equal(looks[:8], want) {
		t.Errorf("a run whose cuts hold every job: looks at %v s, want %v first", looks, want)
	}
	cuts, _ = run(true)
	if want := []int{0, 2, 6, 14, 30, 62, 122, 182, 242}; !slices.Equal(cuts, want) { // gaps 2, 4, 8, 16, 32, then the interval
		t.Errorf("a run whose jobs keep coming: cuts at %v s, want %v", cuts, want)
	}
}
