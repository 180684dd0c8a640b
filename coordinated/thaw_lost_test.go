package coordinated

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
)

// lostThaw is a run with one job on each of two hosts whose thaw never reaches b (a connection reset, or
// the coordinator's context ended by another host's failure): b's hold stays, its jobs frozen and its
// snapshot lock taken, until something ends it.
type lostThaw struct {
	mu   sync.Mutex
	held map[string]bool // the hosts that hold the run frozen
}

func (f *lostThaw) Alive() []string { return []string{"a", "b"} }

func (f *lostThaw) Coordinate(_ context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	job := "job" + host + "-00000001"
	part := clusterapi.CutPart{Job: job, Host: host, Snapshot: "20261203T100000.000Z-" + host + "-000001"}
	switch req.Phase {
	case clusterapi.CoordList:
		return clusterapi.CoordinateReply{Jobs: []string{job}, Owners: map[string]uint32{job: 0}}, nil
	case clusterapi.CoordFreeze:
		f.held[host] = true
	case clusterapi.CoordDump:
		return clusterapi.CoordinateReply{Parts: []clusterapi.CutPart{part}}, nil
	case clusterapi.CoordThaw:
		if host == "b" {
			return clusterapi.CoordinateReply{}, errors.New("connection reset by peer")
		}
		f.held[host] = false
		return clusterapi.CoordinateReply{Parts: []clusterapi.CutPart{part}}, nil
	case clusterapi.CoordAbort:
		f.held[host] = false
	}
	return clusterapi.CoordinateReply{}, nil
}

// TestThawNotDeliveredIsAborted: a cut whose thaw did not reach a host is not recorded, and the coordinator
// ends that host's hold at once (an abort, which ends a hold the thaw did end as a no-op). Before, it
// returned without a word to it: the host kept the run's jobs frozen, and its snapshot lock, which the
// run's rollback's stop needs, until the hold's own bound after its dump (clusterapi.MaxCoordStep, 10
// minutes), every other rank of the run waiting on the frozen ones.
func TestThawNotDeliveredIsAborted(t *testing.T) {
	f := &lostThaw{held: map[string]bool{}}
	c := &Coordinator{Self: "a", Members: f, Records: Records{Dir: t.TempDir(), Host: "a"}, Log: slog.New(slog.DiscardHandler)}
	if _, err := c.Snapshot(t.Context(), "r", nil); err == nil {
		t.Fatal("a cut whose thaw failed on b was recorded")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, h := range []string{"a", "b"} {
		if f.held[h] {
			t.Errorf("%s still holds the run frozen after the cut was given up", h)
		}
	}
}
