package coordinated

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
)

// dyingHost is a run on hosts "a" and "b" whose host b dies in its dump: its call never answers (a
// powered-off host sends no reset), and after a moment the view declares it failed.
type dyingHost struct {
	mu      sync.Mutex
	died    bool
	aborted []string
}

func (f *dyingHost) Alive() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.died {
		return []string{"a"}
	}
	return []string{"a", "b"}
}

func (f *dyingHost) Coordinate(ctx context.Context, host string, req clusterapi.CoordinateRequest) (clusterapi.CoordinateReply, error) {
	job := "job" + host + "-00000001"
	part := clusterapi.CutPart{Job: job, Host: host, Snapshot: "20261203T100000.000Z-" + host + "-000001"}
	switch req.Phase {
	case clusterapi.CoordList:
		return clusterapi.CoordinateReply{Jobs: []string{job}, Owners: map[string]uint32{job: 0}}, nil
	case clusterapi.CoordDump:
		if host == "b" {
			time.AfterFunc(50*time.Millisecond, func() { f.mu.Lock(); f.died = true; f.mu.Unlock() })
			<-ctx.Done() // the call gives up only when its caller does
			return clusterapi.CoordinateReply{}, ctx.Err()
		}
		return clusterapi.CoordinateReply{Parts: []clusterapi.CutPart{part}}, nil
	case clusterapi.CoordAbort:
		f.mu.Lock()
		f.aborted = append(f.aborted, host)
		f.mu.Unlock()
	}
	return clusterapi.CoordinateReply{}, nil
}

// TestCutGivesUpWhenAHostOfTheRunFails: a host of the run that fails during the cut ends it at once, the
// other hosts' jobs thawed (abort). Before, the coordinator waited for the dead host's answer as long as a
// dump may take (clusterapi.MaxCoordStep, ten minutes), the other hosts holding the run's jobs frozen, and
// their snapshot lock, meanwhile: the rollback of the run after that very failure waited for it.
func TestCutGivesUpWhenAHostOfTheRunFails(t *testing.T) {
	f := &dyingHost{}
	c := &Coordinator{Self: "a", Members: f, Records: Records{Dir: t.TempDir(), Host: "a"}, Log: slog.New(slog.DiscardHandler)}
	// The deadline stands for MaxCoordStep: the cut must end on b's failure, not on it.
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	cut, err := c.Snapshot(ctx, "r", nil)
	if err == nil {
		t.Fatalf("cut %+v taken with a host that died in its dump", cut)
	}
	if !strings.Contains(err.Error(), "host b of the run is no longer an alive member") {
		t.Errorf("the cut was given up %s after it began, not for its host's failure: %v", time.Since(start).Round(time.Millisecond), err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !slices.Contains(f.aborted, "a") {
		t.Errorf("hosts aborted %v: a's jobs stay frozen", f.aborted)
	}
}
