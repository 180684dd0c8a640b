package main

import (
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ring"
)

func TestProtection(t *testing.T) {
	now := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	members := []ring.Member{{Name: "node1", State: ring.StateAlive}, {Name: "node2", State: ring.StateAlive}, {Name: "node3", State: ring.StateFailed}}
	running := agent.Job{ID: "j", Node: "node1", State: agent.JobRunning}
	with := func(j agent.Job, node string, holders ...string) agent.Job {
		j.Replica = &agent.Replica{Snapshot: "s1", Time: now.Add(-42 * time.Second), Node: node, Holders: holders}
		return j
	}
	restored := running
	restored.Restored = "s0"
	exited := running
	exited.State = agent.JobExited
	outside := with(running, "node1", "node2")
	outside.Replica.Unrecoverable = []string{"10.0.0.1:5000 -> 192.0.2.7:80: the peer is not a cluster member, so nobody logs what it sends"}
	opened := with(running, "node1", "node2")
	opened.NewConns = []string{"10.0.0.1:5000 -> 10.0.0.2:7000: opened after snapshot s1"}
	tests := []struct {
		name string
		job  agent.Job
		want string
	}{
		{"a new job", running, "UNPROTECTED (no replica yet)"},
		{"replicated on a live node", with(running, "node1", "node2"), "protected (42s)"},
		{"every holder failed", with(running, "node1", "node3"), "UNPROTECTED (replica holders node3 failed)"},
		{"one holder of two alive", with(running, "node1", "node3", "node2"), "protected (42s)"},
		{"restored here, replica from its old host", with(restored, "node4", "node1"), "UNPROTECTED (restored; awaiting its first snapshot here)"},
		{"not running", exited, "-"},
		{"a connection opened after the replica", opened, "UNPROTECTED (connections newer than its replica, which is being renewed: 10.0.0.1:5000 -> 10.0.0.2:7000: opened after snapshot s1)"},
		{"a connection to a host outside the cluster", outside, "UNRECOVERABLE (1 connection(s); first: 10.0.0.1:5000 -> 192.0.2.7:80: the peer is not a cluster member, so nobody logs what it sends)"},
	}
	for _, tt := range tests {
		if got := protection(tt.job, members, now); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}
