package agent

import (
	"context"
	"errors"
	"net"
	"runtime"
	"sync"
	"testing"
	"testing/synctest"
	"time"

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
	holdClaim(t, a, "f1")
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

// holdClaim has a claimed for failure (by n1, for n3), as serveClaim does before it starts the prefetch.
func holdClaim(t *testing.T, a *Agent, failure string) spare.Claim {
	t.Helper()
	cl := spare.Claim{Failure: failure, By: "n1", Failed: "n3", Need: spare.Need{Jobs: 1, MemoryBytes: 1 << 30}}
	if err := a.claims.Claim(cl, 1<<40); err != nil {
		t.Fatal(err)
	}
	return cl
}

// transferUnderWay registers a transfer of job/snap to a as under way (fetchOnce), as a recovery's or a
// rollback's fetch does: a prefetch of that snapshot waits for it.
func transferUnderWay(a *Agent, job, snap string) *fetchCall {
	c := &fetchCall{done: make(chan struct{})}
	a.fetching.mu.Lock()
	defer a.fetching.mu.Unlock()
	if a.fetching.m == nil {
		a.fetching.m = map[string]*fetchCall{}
	}
	a.fetching.m[job+"/"+snap] = c
	return c
}

// TestPrefetchHasNoFixedLimit: a prefetch's transfers are bounded by their manifests (receiveFetch), so a
// large snapshot's may take longer than 30 minutes. A fixed 30 minutes cut off the prefetch whatever the
// snapshot's size, and the recovery fetched it all again. (A bubble runs no TLS: the prefetch here waits
// for a transfer of its snapshot under way, under the same context as its own transfers.)
func TestPrefetchHasNoFixedLimit(t *testing.T) {
	const job, snap = "big-1a2b3c4d", "20250101T000000.000Z-n3-000001"
	pki := newTestPKI(t)
	a, _ := clientAgent(t, pki, nil)
	cl := holdClaim(t, a, "f1")
	cl.Prefetch = []spare.Prefetch{{Job: job, Snapshot: snap, Source: "n2"}}
	synctest.Test(t, func(t *testing.T) {
		c := transferUnderWay(a, job, snap)
		done := make(chan struct{})
		go func() {
			defer close(done)
			a.prefetch(cl)
		}()
		time.Sleep(2 * time.Hour) // the bubble's clock: a transfer its manifest allows this long
		a.fetching.mu.Lock()
		delete(a.fetching.m, job+"/"+snap)
		a.fetching.mu.Unlock()
		close(c.done) // it succeeded
		<-done
	})
	if from, ok := a.takePrefetched(job, snap); !ok || from != "n2" {
		t.Fatalf("the prefetch of a snapshot whose transfer took 2 hours was given up (recorded: %v, from %q)", ok, from)
	}
}

// TestPrefetchRecordKeepsOnlyTheHeldClaims: the record of prefetched snapshots holds only the claim this
// host holds; the entries of a claim released without a recovery (abandoned) are dropped. Kept, every
// abandoned claim left its prefetches recorded for good.
func TestPrefetchRecordKeepsOnlyTheHeldClaims(t *testing.T) {
	pki := newTestPKI(t)
	a, _ := clientAgent(t, pki, nil)
	prefetchVia := func(cl spare.Claim, job, snap string) {
		c := transferUnderWay(a, job, snap)
		close(c.done) // done, successfully
		cl.Prefetch = []spare.Prefetch{{Job: job, Snapshot: snap, Source: "n2"}}
		a.prefetch(cl)
	}
	prefetchVia(holdClaim(t, a, "f1"), "job-a", "20250101T000000.000Z-n3-000001")
	if err := a.claims.Release("f1"); err != nil { // abandoned: no recovery came
		t.Fatal(err)
	}
	prefetchVia(holdClaim(t, a, "f2"), "job-b", "20250101T000000.000Z-n3-000002")
	a.fetching.mu.Lock()
	n := len(a.fetching.prefetched)
	a.fetching.mu.Unlock()
	if n != 1 {
		t.Errorf("%d prefetches recorded, want 1: the released claim's are kept", n)
	}
	if _, ok := a.takePrefetched("job-a", "20250101T000000.000Z-n3-000001"); ok {
		t.Error("a prefetch of a released claim is still recorded")
	}
	if from, ok := a.takePrefetched("job-b", "20250101T000000.000Z-n3-000002"); !ok || from != "n2" {
		t.Errorf("the held claim's prefetch: recorded %v, from %q", ok, from)
	}
}

// TestPrefetchStopsWithItsClaim: with no fixed limit, a prefetch lasts as long as its claim is held; one
// whose claim was released (abandoned, and the spare claimed for the next failure) fetches no more, so
// that it does not compete with the next claim's prefetch and recovery for the link and the disk.
func TestPrefetchStopsWithItsClaim(t *testing.T) {
	pki := newTestPKI(t)
	n2 := &fetchScript{started: make(chan struct{}), release: make(chan struct{})}
	close(n2.release)
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2)})
	cl := holdClaim(t, a, "f1")
	if err := a.claims.Release("f1"); err != nil {
		t.Fatal(err)
	}
	holdClaim(t, a, "f2")
	cl.Prefetch = []spare.Prefetch{{Job: "job-a", Snapshot: "20250101T000000.000Z-n3-000001", Source: "n2"}}
	a.prefetch(cl)
	if n := n2.count(); n != 0 {
		t.Errorf("%d snapshots fetched for a released claim, want 0", n)
	}
}
