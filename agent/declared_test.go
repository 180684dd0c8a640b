package agent

import (
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
		forget := d.declare("node2")
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
	forget := a.declared.declare("node2")
	defer forget()
	if _, err := a.beforeReplicaCommit(&ckpt.Manifest{Node: "node2", Job: "late"}); err == nil {
		t.Error("a replica of a node declared failed was let through to its commit")
	}
	if got := a.replicas.since("node2", past, nil); !slices.Equal(got, []string{"fresh"}) {
		t.Errorf("jobs with a replica since the last beat: %v, want [fresh]", got)
	}
}
