package main

import (
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
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
	coord := with(running, "node1", "node2")
	coord.Spec.Run, coord.Spec.Recovery = "r", agent.RecoveryCoordinated
	auto := coord
	auto.Spec.Recovery = agent.RecoveryAuto
	logging := coord
	logging.Spec.Recovery = ""
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
		{"coordinated, its run's cut lacks a job", coord, "UNPROTECTED (run r's newest cut c1 lacks late-00000002, started after it: a rollback refuses until the next)"},
		{"auto, its run's cut lacks a job", auto, "protected (42s; a rollback of run r refuses until a coordinated snapshot holds late-00000002)"},
		{"message logging, a run's cut lacks a job", logging, "protected (42s)"},
		{"a connection to a host outside the cluster", outside, "UNRECOVERABLE (1 connection(s); first: 10.0.0.1:5000 -> 192.0.2.7:80: the peer is not a cluster member, so nobody logs what it sends)"},
	}
	for _, tt := range tests {
		gaps := map[coordinated.Run]cutGap{{Name: "r"}: {cut: "c1", lacks: []string{"late-00000002"}}}
		if got := protection(tt.job, members, gaps, now); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestCutGaps(t *testing.T) {
	job := func(id, run, recovery string, uid uint32, state agent.JobState) agent.Job {
		return agent.Job{ID: id, UID: uid, State: state, Spec: agent.JobSpec{Run: run, Recovery: recovery}}
	}
	cut := func(id, run string, uid uint32, jobs ...string) *coordinated.Cut {
		c := &coordinated.Cut{Run: run, UID: uid, ID: id}
		for _, j := range jobs {
			c.Parts = append(c.Parts, clusterapi.CutPart{Job: j})
		}
		return c
	}
	const co, au = agent.RecoveryCoordinated, agent.RecoveryAuto
	run, exited := agent.JobRunning, agent.JobExited
	tests := []struct {
		name  string
		hosts []agent.Status
		want  map[coordinated.Run]cutGap
	}{
		{"the cut holds every running job", []agent.Status{
			{Jobs: []agent.Job{job("a", "r", co, 0, run)}, Cuts: []*coordinated.Cut{cut("c1", "r", 0, "a", "b")}},
			{Jobs: []agent.Job{job("b", "r", co, 0, run)}, Cuts: []*coordinated.Cut{cut("c1", "r", 0, "a", "b")}},
		}, map[coordinated.Run]cutGap{}},
		{"a rank started after the cut", []agent.Status{
			{Jobs: []agent.Job{job("a", "r", co, 0, run)}, Cuts: []*coordinated.Cut{cut("c1", "r", 0, "a")}},
			{Jobs: []agent.Job{job("b", "r", co, 0, run)}},
		}, map[coordinated.Run]cutGap{{Name: "r"}: {cut: "c1", lacks: []string{"b"}}}},
		{"the newest cut any host records counts", []agent.Status{
			{Jobs: []agent.Job{job("a", "r", au, 0, run)}, Cuts: []*coordinated.Cut{cut("c1", "r", 0, "a")}},
			{Jobs: []agent.Job{job("b", "r", au, 0, run)}, Cuts: []*coordinated.Cut{cut("c2", "r", 0, "a", "b")}},
		}, map[coordinated.Run]cutGap{}},
		{"an older cut's record on the newer job's host", []agent.Status{
			{Jobs: []agent.Job{job("a", "r", co, 0, run)}, Cuts: []*coordinated.Cut{cut("c2", "r", 0, "a")}},
			{Jobs: []agent.Job{job("c", "r", co, 0, run), job("b", "r", co, 0, run)}, Cuts: []*coordinated.Cut{cut("c1", "r", 0, "a", "b")}},
		}, map[coordinated.Run]cutGap{{Name: "r"}: {cut: "c2", lacks: []string{"b", "c"}}}},
		{"exited jobs and message-logging jobs take no part", []agent.Status{
			{Jobs: []agent.Job{job("a", "r", co, 0, run), job("x", "r", co, 0, exited), job("y", "r", "", 0, run)}, Cuts: []*coordinated.Cut{cut("c1", "r", 0, "a")}},
		}, map[coordinated.Run]cutGap{}},
		{"runs are per user", []agent.Status{
			// uid 1000's run r has no cut; uid 0's cut holds a job named like uid 1000's, not its own.
			{Jobs: []agent.Job{job("a", "r", co, 0, run), job("b", "r", co, 1000, run)}, Cuts: []*coordinated.Cut{cut("c1", "r", 0, "b")}},
		}, map[coordinated.Run]cutGap{{Name: "r"}: {cut: "c1", lacks: []string{"a"}}}},
		{"a run with no cut yet", []agent.Status{
			{Jobs: []agent.Job{job("a", "r", co, 0, run)}},
		}, map[coordinated.Run]cutGap{}},
	}
	for _, tt := range tests {
		if got := cutGaps(tt.hosts, newestCuts(tt.hosts)); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: %+v, want %+v", tt.name, got, tt.want)
		}
	}
}

func TestCutGapJobs(t *testing.T) {
	for _, tt := range []struct {
		lacks []string
		want  string
	}{
		{[]string{"a"}, "a"},
		{[]string{"a", "b", "c"}, "a,b,c"},
		{[]string{"a", "b", "c", "d", "e"}, "a,b,c and 2 more"},
	} {
		if got := (cutGap{lacks: tt.lacks}).jobs(); got != tt.want {
			t.Errorf("%v: %q, want %q", tt.lacks, got, tt.want)
		}
	}
}

func TestRunRows(t *testing.T) {
	now := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	job := func(id, run, recovery string, uid uint32) agent.Job {
		return agent.Job{ID: id, UID: uid, State: agent.JobRunning, Spec: agent.JobSpec{Run: run, Recovery: recovery}}
	}
	cut := &coordinated.Cut{Run: "b", ID: "cut-2", Taken: now.Add(-90 * time.Second), Parts: []clusterapi.CutPart{{Job: "b1"}}}
	hosts := []agent.Status{
		{Jobs: []agent.Job{job("b1", "b", agent.RecoveryCoordinated, 0), job("a1", "a", agent.RecoveryAuto, 1000), job("l1", "l", "", 0)}, Cuts: []*coordinated.Cut{cut}},
		{Jobs: []agent.Job{job("b2", "b", agent.RecoveryCoordinated, 0)}},
	}
	newest := newestCuts(hosts)
	got := runRows(hosts, newest, cutGaps(hosts, newest), now)
	want := []string{
		"a\t1000\t1\tnone yet\t-\t-",
		"b\t0\t2\tcut-2\t1m30s\tb2",
	}
	if !slices.Equal(got, want) {
		t.Errorf("rows %q, want %q (a message-logging run has none)", got, want)
	}
}
