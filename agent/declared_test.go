package agent

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ring"
)

// A declaration waits for the commits under way (the fail-over's choice of replicas then sees them), and
// refuses the failed node's snapshots from then until its fail-over ends; other nodes' are not held.
func TestDeclaredFailedOrdersCommits(t *testing.T) {
	var d declaredFailed
	release, err := d.enter("node2")
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan string, 2)
	forgot := make(chan func(), 1)
	go func() {
		forget, err := d.declare("node2", 0, time.Now())
		if err != nil {
			panic(err)
		}
		events <- "declared"
		forgot <- forget
	}()
	// Wait until the declaration is held back by the commit (a pending writer fails TryRLock).
	for d.mu.TryRLock() {
		d.mu.RUnlock()
		runtime.Gosched()
	}
	events <- "committed"
	release()
	forget := <-forgot
	if got := []string{<-events, <-events}; !slices.Equal(got, []string{"committed", "declared"}) {
		t.Fatalf("order %v: the declaration returned before the commit under way was over", got)
	}

	if _, err := d.enter("node2"); err == nil || !strings.Contains(err.Error(), "declared node2 failed") {
		t.Errorf("a snapshot of node2 after its declaration: %v, want refused", err)
	}
	rel, err := d.enter("node3")
	if err != nil {
		t.Errorf("a snapshot of node3: %v, want kept", err)
	} else {
		rel()
	}
	forget()
	rel, err = d.enter("node2")
	if err != nil {
		t.Fatalf("a snapshot of node2 after its fail-over: %v, want kept", err)
	}
	rel()
}

// Two fail-overs of one node may overlap (it beat again during the first one's fence wait, and fell silent
// again): the first one's end must not lift the second one's refusal of the node's snapshots, whose replicas
// it chose. Before, the first forget let a snapshot commit while the second fail-over restored.
func TestDeclaredFailedOverlappingFailovers(t *testing.T) {
	var d declaredFailed
	forget1, err := d.declare("node2", 0, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	forget2, err := d.declare("node2", 0, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	forget1()
	forget1() // a forget called twice counts once
	if rel, err := d.enter("node2"); err == nil {
		rel()
		t.Fatal("a snapshot of node2 committed after the first of two fail-overs ended, while the second restores")
	}
	forget2()
	rel, err := d.enter("node2")
	if err != nil {
		t.Fatalf("a snapshot of node2 after both fail-overs: %v, want kept", err)
	}
	rel()
}

// A replica that commits is an arrival before the commit's lock is released, so that a declaration that
// follows counts its job among the failed node's; one refused or failed is not.
func TestBeforeReplicaCommit(t *testing.T) {
	a := &Agent{}
	past := time.Now().Add(-time.Minute)
	done, err := a.beforeReplicaCommit(&ckpt.Manifest{Node: "node2", Job: "fresh"})
	if err != nil {
		t.Fatal(err)
	}
	done(nil)
	done, err = a.beforeReplicaCommit(&ckpt.Manifest{Node: "node2", Job: "failedcommit"})
	if err != nil {
		t.Fatal(err)
	}
	done(ckpt.ErrCorrupt)
	forget, err := a.declared.declare("node2", 0, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	defer forget()
	if _, err := a.beforeReplicaCommit(&ckpt.Manifest{Node: "node2", Job: "late"}); err == nil {
		t.Error("a replica of a node declared failed was let through to its commit")
	}
	if got := a.replicas.since("node2", past, nil); !slices.Equal(got, []string{"fresh"}) {
		t.Errorf("jobs with a replica since the last beat: %v, want [fresh]", got)
	}
}

// A vouch and a declaration of the same member are ordered: a vouch after the silence began drops a
// declaration on that silence (and only on that one), and a declared incarnation is vouched for no more
// (a later one is).
func TestVouchOrdersDeclarations(t *testing.T) {
	t0 := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	type step struct {
		op      string // vouch, declare (automatic fail-over), fail (recorded only), undeclare
		node    string
		inc     uint64
		at      int // vouch: when; declare/fail: when the silence began
		refused bool
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"vouch after the silence began drops the declaration", []step{
			{op: "vouch", node: "node2", at: 3200},
			{op: "declare", node: "node2", at: 100, refused: true},
			{op: "fail", node: "node2", at: 100, refused: true},
		}},
		{"a silence that began after the vouch is declared", []step{
			{op: "vouch", node: "node2", at: 3200},
			{op: "declare", node: "node2", at: 3200},
			{op: "vouch", node: "node2", at: 9000, refused: true},
		}},
		{"another member's vouch does not count", []step{
			{op: "vouch", node: "node3", at: 3200},
			{op: "declare", node: "node2", at: 100},
		}},
		{"declared first: the vouch is refused", []step{
			{op: "fail", node: "node2", at: 100},
			{op: "vouch", node: "node2", at: 3200, refused: true},
			{op: "vouch", node: "node3", at: 3200},
		}},
		{"undeclared after a fail-over that restored nothing", []step{
			{op: "declare", node: "node2", at: 100},
			{op: "undeclare", node: "node2"},
			{op: "vouch", node: "node2", at: 3200},
		}},
		{"a later incarnation is vouched for", []step{
			{op: "declare", node: "node2", inc: 0, at: 100},
			{op: "vouch", node: "node2", inc: 1, at: 60000},
			{op: "declare", node: "node2", inc: 1, at: 1000, refused: true},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d declaredFailed
			for i, s := range tc.steps {
				var err error
				switch s.op {
				case "vouch":
					err = d.vouch(s.node, s.inc, ms(s.at))
				case "declare":
					var forget func()
					if forget, err = d.declare(s.node, s.inc, ms(s.at)); err == nil {
						forget()
					}
				case "fail":
					err = d.fail(s.node, s.inc, ms(s.at))
				case "undeclare":
					d.undeclare(s.node, s.inc)
				}
				if (err != nil) != s.refused {
					t.Fatalf("step %d %+v: err %v, want refused %v", i, s, err, s.refused)
				}
				if err != nil && s.op != "vouch" && !errors.Is(err, errVouched) {
					t.Fatalf("step %d: refusal %v is not errVouched", i, err)
				}
			}
		})
	}
}

// TestFailoverThatChangesNothingSuspectsAgain: a fail-over that ends before the view changes (here none of
// the failed node's jobs can be restored: no member holds a replica) leaves the node alive in the view, as
// before. Its suspicion must end with it: a suspicion is reported once, until a beat or Clear, so left
// standing the node was never suspected again, and one that stays dead stayed in the ring for good, its
// predecessor beating to it and nobody retrying.
func TestFailoverThatChangesNothingSuspectsAgain(t *testing.T) {
	pki := newTestPKI(t)
	a, logs := clientAgent(t, pki, nil) // every other member refuses: nobody holds a replica
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	start := time.Now()
	a.watchdog.Watch("n3", start.Add(-time.Second))
	got := a.watchdog.Suspects(start)
	if len(got) != 1 {
		t.Fatalf("suspects = %+v, want n3", got)
	}
	s := got[0]
	s.Jobs = []string{"job-00000001"}
	a.failover(ctx, s, start)
	if m, _ := a.View().Member("n3"); m.State != ring.StateAlive {
		t.Fatalf("n3 is %s after a fail-over that restored nothing; log:\n%s", m.State, logs.String())
	}
	now := time.Now()
	if got := a.watchdog.Suspects(now.Add(a.cfg.Heartbeat.Timeout.Duration + time.Millisecond)); len(got) != 1 || got[0].Name != "n3" {
		t.Errorf("suspects a timeout after the fail-over ended = %+v, want n3 again; log:\n%s", got, logs.String())
	}
}

// TestRetryAfter: a node whose fail-overs keep changing nothing is suspected again after a timeout, then
// twice as long each time, at most failoverRetryMax (each try is a failure in the log, which keeps the
// newest 100); one that was heard from meanwhile starts over.
func TestRetryAfter(t *testing.T) {
	const timeout = time.Second
	t0 := time.Now()
	var d declaredFailed
	steps := []struct {
		node string
		at   time.Duration // after t0
		want time.Duration
	}{
		{"n3", 0, timeout},
		{"n3", 2 * time.Second, 2 * time.Second},
		{"n4", 2 * time.Second, timeout}, // another node's retries are its own
		{"n3", 5 * time.Second, 4 * time.Second},
		{"n3", 10 * time.Second, 8 * time.Second},
		{"n3", 19 * time.Second, 16 * time.Second},
		{"n3", 19*time.Second + 50*time.Second, timeout}, // no fail-over for more than twice the wait: heard from
	}
	for _, s := range steps {
		if got := d.retryAfter(s.node, timeout, t0.Add(s.at)); got != s.want {
			t.Errorf("%s at +%s: wait %s, want %s", s.node, s.at, got, s.want)
		}
	}
	at := t0.Add(time.Hour)
	var got time.Duration
	for i := range 20 {
		got = d.retryAfter("n5", timeout, at)
		at = at.Add(got + time.Duration(i)*time.Millisecond)
	}
	if got != failoverRetryMax {
		t.Errorf("after 20 tries the wait is %s, want at most %s", got, failoverRetryMax)
	}
}
