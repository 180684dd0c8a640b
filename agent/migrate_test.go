package agent

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ring"
)

// TestCheckMigration: a target accepts a migration only from the alive node of the ring the job runs on,
// for snapshots that node holds, to itself as an alive node, without host addresses.
func TestCheckMigration(t *testing.T) {
	var ms []ring.Member
	for i, name := range []string{"node1", "node2", "node3", "spare1"} {
		role := ring.RoleNode
		if name == "spare1" {
			role = ring.RoleSpare
		}
		ms = append(ms, ring.Member{Name: name, Role: role, Address: netip.MustParseAddrPort(fmt.Sprintf("10.0.0.%d:7420", i+1))})
	}
	v, err := ring.New(ms)
	if err != nil {
		t.Fatal(err)
	}
	failed, err := v.Fail("node1")
	if err != nil {
		t.Fatal(err)
	}
	job := func(src string) []RecoverJob {
		const s = "20261126T120000.000Z-node2-000001"
		return []RecoverJob{{Job: "j-1", Snapshot: s, Source: src, Candidates: []Candidate{{Snapshot: s, Source: src}}}}
	}
	ok := RecoverRequest{Failure: "j-1-migrate-x", Failed: "node2", Source: "node2", Migration: true, Jobs: job("node2")}
	tests := []struct {
		name    string
		self    string
		view    ring.View
		peer    string
		req     func(RecoverRequest) RecoverRequest
		refusal string // "" accepted
	}{
		{"the job's node moves its job here", "node3", v, "node2", nil, ""},
		{"a node moves another node's job", "node3", v, "node1", nil, "may move only its own jobs"},
		{"from a failed node", "node3", failed, "node1", func(r RecoverRequest) RecoverRequest {
			r.Failed, r.Jobs = "node1", job("node1")
			return r
		}, "not an alive node"},
		{"to a spare, which nobody watches", "spare1", v, "node2", nil, "spare1 is not an alive node"},
		{"taking over host addresses", "node3", v, "node2", func(r RecoverRequest) RecoverRequest {
			r.Addrs = []netip.Addr{netip.MustParseAddr("10.0.0.2")}
			return r
		}, "host addresses"},
		{"a snapshot from a third member", "node3", v, "node2", func(r RecoverRequest) RecoverRequest {
			r.Jobs = job("node1")
			return r
		}, "is to come from node1"},
		{"no job", "node3", v, "node2", func(r RecoverRequest) RecoverRequest {
			r.Jobs = nil
			return r
		}, "names 0 jobs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := resumeTestAgent(t)
			a.cfg.Name = tt.self
			a.members.view = tt.view
			req := ok
			if tt.req != nil {
				req = tt.req(req)
			}
			err := a.checkRecoverRequest(req, tt.peer)
			switch {
			case tt.refusal == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tt.refusal != "" && (err == nil || !strings.Contains(err.Error(), tt.refusal)):
				t.Errorf("got %v, want a refusal saying %q", err, tt.refusal)
			}
		})
	}
}

// TestShimOf: the parent of a job's root is killed as its shim only if it runs the agent's binary.
func TestShimOf(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command("sleep", "60")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	if got, err := shimOf(child.Process.Pid, self); err != nil || got != os.Getpid() {
		t.Errorf("shimOf(child, this binary) = %d, %v; want this process %d", got, err, os.Getpid())
	}
	if got, err := shimOf(child.Process.Pid, "/bin/true"); err == nil {
		t.Errorf("shimOf(child, /bin/true) = %d: a parent running another binary is no shim", got)
	}
	if _, err := shimOf(1<<30, self); err == nil {
		t.Error("shimOf of a process that does not exist found a shim")
	}
}

// TestFreshReceipts: a received snapshot counts as verified for freshFor, not after, and not another one.
func TestFreshReceipts(t *testing.T) {
	var f freshReceipts
	t0 := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	f.note("j", "s1", t0)
	tests := []struct {
		job, id string
		at      time.Time
		want    bool
	}{
		{"j", "s1", t0.Add(time.Second), true},
		{"j", "s1", t0.Add(freshFor), true},
		{"j", "s1", t0.Add(freshFor + time.Millisecond), false},
		{"j", "s1", t0.Add(-time.Second), false}, // a clock that went back proves nothing
		{"j", "s2", t0.Add(time.Second), false},
		{"k", "s1", t0.Add(time.Second), false},
	}
	for _, tt := range tests {
		if got := f.fresh(tt.job, tt.id, tt.at); got != tt.want {
			t.Errorf("fresh(%s, %s, t0%+v) = %v, want %v", tt.job, tt.id, tt.at.Sub(t0), got, tt.want)
		}
	}
	f.note("j", "s2", t0.Add(2*freshFor)) // noting forgets the stale ones
	if len(f.at) != 1 {
		t.Errorf("%d receipts kept, want only the fresh one", len(f.at))
	}
}
