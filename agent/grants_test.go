package agent

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ftkit/ftkit/grant"
)

// TestGiveBackOrphanClaims: an agent killed after its claim of a job's next incarnation and before the
// restored job's record left the incarnation held by a restore that never ran; every later restore of
// the job, here or elsewhere, was refused. The restarted agent gives such claims back, and only those.
func TestGiveBackOrphanClaims(t *testing.T) {
	ta := newTestAgent(t)
	ta.failMember(t, "node2") // this agent alone grants
	const (
		orphan   = "orphan-00000001" // claimed, then the agent died: no record, empty cgroup
		starting = "start-00000001"  // claimed, no record yet, but its cgroup has processes (CRIU ran)
	)
	ta.mu.Lock()
	ta.byID[rootsJob].Incarnation = 1 // restored here as incarnation 1: the claim ran
	ta.mu.Unlock()
	cg := filepath.Join(ta.cfg.CgroupParent, starting)
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cg, "cgroup.events"), []byte("populated 1\nfrozen 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	held := map[string]string{orphan: "node1", starting: "node1", rootsJob: "node1", goneJob: "node2"}
	for job, host := range held {
		if _, err := ta.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: "restore:dead", Host: host}, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	// Before: a new restore of the orphaned incarnation is refused as if the job ran here.
	if err := ta.claimIncarnation(t.Context(), orphan, 1, "restore:new", ""); !errors.Is(err, grant.ErrConflict) {
		t.Fatalf("claim before the restart: %v, want a refusal", err)
	}

	ta.giveBackOrphanClaims(t.Context())

	for job, host := range held {
		rec, _ := ta.grants.Lookup(job)
		if want := job == orphan; rec.Released != want {
			t.Errorf("job %s (held on %s): released %v, want %v", job, host, rec.Released, want)
		}
	}
	if err := ta.claimIncarnation(t.Context(), orphan, 1, "restore:new", ""); err != nil {
		t.Fatalf("claim after the restart: %v, want the incarnation given back", err)
	}
}

// TestGiveBackOrphanClaimsKeepsRunningShim: an agent killed while CRIU restored a job leaves the job's shim
// (its own session) restoring, into a cgroup that stays empty until CRIU forks the tree; the job then runs
// here without a record. The restarted agent must keep that incarnation claimed: given back, a fail-over
// elsewhere could claim it and run a second copy.
func TestGiveBackOrphanClaimsKeepsRunningShim(t *testing.T) {
	ta := newTestAgent(t)
	ta.failMember(t, "node2") // this agent alone grants

	const job = "restoring-00000001" // claimed, no record, no cgroup yet: its shim's CRIU is still at work
	if _, err := ta.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: "failover:dead", Host: "node1"}, time.Now()); err != nil {
		t.Fatal(err)
	}
	// The shim holds its log open as its standard error for as long as it lives; this test stands in for it.
	shimLog, err := os.OpenFile(ta.shimLog(job), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer shimLog.Close()

	ta.giveBackOrphanClaims(t.Context())

	if rec, _ := ta.grants.Lookup(job); rec.Released {
		t.Fatal("the incarnation of a restore whose shim runs was given back")
	}
	if err := ta.claimIncarnation(t.Context(), job, 1, "restore:new", ""); !errors.Is(err, grant.ErrConflict) {
		t.Fatalf("claim while the shim restores: %v, want a refusal", err)
	}

	shimLog.Close() // the shim ended: what it restored has no record and no process here
	ta.giveBackOrphanClaims(t.Context())
	if rec, _ := ta.grants.Lookup(job); !rec.Released {
		t.Fatal("the incarnation of a restore whose shim is gone was kept")
	}
}
