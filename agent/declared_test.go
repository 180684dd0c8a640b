package agent

import (
	"errors"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
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
