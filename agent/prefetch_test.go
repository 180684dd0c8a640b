package agent

import (
	"context"
	"errors"
	"net"
	"runtime"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/spare"
)

// fetchScript is a member that answers every fetch after release is closed, by closing the connection
// (the fetch fails), counting them.
type fetchScript struct {
	clusterapi.Service
	mu      sync.Mutex
	fetches int
	started chan struct{}
	release chan struct{}
}

func (s *fetchScript) Fetch(_ context.Context, _ string, _ clusterapi.FetchRequest, c net.Conn) error {
	s.mu.Lock()
	s.fetches++
	first := s.fetches == 1
	s.mu.Unlock()
	if first {
		close(s.started)
	}
	<-s.release
	return errors.New("no such snapshot")
}

func (s *fetchScript) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fetches
}

// TestFetchOnce: a recovery (a failover's, or a coordinated rollback's or manual restore's fetch) that
// needs a snapshot whose prefetch is under way waits for that transfer instead of starting a second one;
// when it fails, the recovery fetches the snapshot itself. ci303's rollback fetched beside the prefetch,
// and one writer refused the other.
func TestFetchOnce(t *testing.T) {
	const job, snap = "rank1-0123abcd", "20250101T000000.000Z-n2-000001"
	for _, tc := range []struct {
		name  string
		fetch func(a *Agent, ctx context.Context) error
	}{
		{"failover", func(a *Agent, ctx context.Context) error { return a.fetchOnce(ctx, "n2", job, snap) }},
		{"rollback", func(a *Agent, ctx context.Context) error { return a.fetch(ctx, job, snap, "n2", "n2") }},
	} {
		t.Run(tc.name, func(t *testing.T) { testFetchOnce(t, job, snap, tc.fetch) })
	}
}

func testFetchOnce(t *testing.T, job, snap string, fetch func(a *Agent, ctx context.Context) error) {
	pki := newTestPKI(t)
	n2 := &fetchScript{started: make(chan struct{}), release: make(chan struct{})}
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2)})
	errs := make(chan error, 2)
	go func() { errs <- a.fetchOnce(t.Context(), "n2", job, snap) }() // the prefetch
	<-n2.started
	go func() { errs <- fetch(a, t.Context()) }() // the recovery
	// The recovery either waits for the prefetch or starts a second transfer (the failure).
	for waiting := 0; waiting == 0 && n2.count() == 1; runtime.Gosched() {
		a.fetching.mu.Lock()
		if c := a.fetching.m[job+"/"+snap]; c != nil {
			waiting = c.waiters
		}
		a.fetching.mu.Unlock()
	}
	if n := n2.count(); n != 1 {
		t.Fatalf("%d fetches of one snapshot at once, want 1", n)
	}
	close(n2.release)
	for range 2 {
		if err := <-errs; err == nil {
			t.Error("a fetch that failed reported success")
		}
	}
	if n := n2.count(); n != 2 {
		t.Errorf("%d fetches, want 2: the recovery fetches itself once the prefetch failed", n)
	}
	a.fetching.mu.Lock()
	defer a.fetching.mu.Unlock()
	if len(a.fetching.m) != 0 {
		t.Errorf("transfers left registered: %v", a.fetching.m)
	}
}

// TestPrefetchOnlyTheFailedNodesSnapshots: a claim comes from another member, and its prefetch list is
// only a hint of what the recovery of the failed node will restore. The spare fetches a snapshot taken on
// the failed node (or on a failed member, whose jobs the failed node was restoring), at most one per job
// and no more than the claim's need; a snapshot of an alive member's job, or a list longer than the
// failed node's jobs, is not fetched: any claimer could have the spare pull others' snapshots, up to
// MaxPrefetch of them.
func TestPrefetchOnlyTheFailedNodesSnapshots(t *testing.T) {
	pki := newTestPKI(t)
	n2 := &fetchScript{started: make(chan struct{}), release: make(chan struct{})}
	close(n2.release)
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2)})
	const failed = "20250101T000000.000Z-n3-000001"
	for _, tc := range []struct {
		name  string
		need  int
		list  []spare.Prefetch
		fetch int
	}{
		{"failed node's", 1, []spare.Prefetch{{Job: "job-a", Snapshot: failed, Source: "n2"}}, 1},
		{"alive member's", 1, []spare.Prefetch{{Job: "job-b", Snapshot: "20250101T000000.000Z-n2-000001", Source: "n2"}}, 0},
		{"not an id", 1, []spare.Prefetch{{Job: "job-c", Snapshot: "n3", Source: "n2"}}, 0},
		{"beyond the need", 1, []spare.Prefetch{
			{Job: "job-d", Snapshot: failed, Source: "n2"},
			{Job: "job-e", Snapshot: failed, Source: "n2"},
		}, 1},
		{"one per job", 2, []spare.Prefetch{
			{Job: "job-f", Snapshot: failed, Source: "n2"},
			{Job: "job-f", Snapshot: "20250101T000000.000Z-n3-000002", Source: "n2"},
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := n2.count()
			a.prefetch(spare.Claim{Failure: "f1", By: "n1", Failed: "n3", Need: spare.Need{Jobs: tc.need, MemoryBytes: 1 << 30}, Prefetch: tc.list})
			if got := n2.count() - before; got != tc.fetch {
				t.Errorf("%d snapshots fetched, want %d", got, tc.fetch)
			}
		})
	}
}
