package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/interval"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/ring"
)

// testView is a new view of the named members, nodes but for names starting with "spare".
func testView(t *testing.T, names ...string) ring.View {
	t.Helper()
	var ms []ring.Member
	for i, name := range names {
		role := ring.RoleNode
		if strings.HasPrefix(name, "spare") {
			role = ring.RoleSpare
		}
		ms = append(ms, ring.Member{Name: name, Role: role, Address: netip.MustParseAddrPort(fmt.Sprintf("10.0.0.%d:7420", i+1))})
	}
	v, err := ring.New(ms)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestCheckMigration: a target accepts a migration only from the alive node of the ring the job runs on,
// for snapshots that node holds, to itself as an alive node, without host addresses.
func TestCheckMigration(t *testing.T) {
	v := testView(t, "node1", "node2", "node3", "spare1")
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
		// A live job of node1 (node2 protects it, so holds its snapshots) copied to node3.
		{"another node's snapshots, taken from it", "node3", v, "node2", func(r RecoverRequest) RecoverRequest {
			r.Jobs = job("node2") // a copy: ok's stays as it is
			r.Jobs[0].TakenFrom = "node1"
			return r
		}, "restored from snapshots of node1"},
		{"another node's snapshot, sent by the mover", "node3", v, "node2", func(r RecoverRequest) RecoverRequest {
			const s = "20261126T120000.000Z-node1-000001"
			r.Jobs = []RecoverJob{{Job: "j-1", Snapshot: s, Source: "node2", Candidates: []Candidate{{Snapshot: s, Source: "node2"}}}}
			return r
		}, "was not taken by node2"},
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

// TestFreshReceipts: a received snapshot counts as verified for freshFor, not after, not another one, and
// not once its files changed (another stamp).
func TestFreshReceipts(t *testing.T) {
	var f freshReceipts
	t0 := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	f.note("j", "s1", "stamp", t0)
	tests := []struct {
		job, id, stamp string
		at             time.Time
		want           bool
	}{
		{"j", "s1", "stamp", t0.Add(time.Second), true},
		{"j", "s1", "stamp", t0.Add(freshFor), true},
		{"j", "s1", "stamp", t0.Add(freshFor + time.Millisecond), false},
		{"j", "s1", "stamp", t0.Add(-time.Second), false}, // a clock that went back proves nothing
		{"j", "s1", "written since", t0.Add(time.Second), false},
		{"j", "s2", "stamp", t0.Add(time.Second), false},
		{"k", "s1", "stamp", t0.Add(time.Second), false},
	}
	for _, tt := range tests {
		if got := f.fresh(tt.job, tt.id, tt.stamp, tt.at); got != tt.want {
			t.Errorf("fresh(%s, %s, %q, t0%+v) = %v, want %v", tt.job, tt.id, tt.stamp, tt.at.Sub(t0), got, tt.want)
		}
	}
	f.note("j", "s2", "stamp", t0.Add(2*freshFor)) // noting forgets the stale ones
	if len(f.at) != 1 {
		t.Errorf("%d receipts kept, want only the fresh one", len(f.at))
	}
}

// TestVerifyUnlessFresh: a snapshot received moments ago is not hashed again, unless a file of it was
// written to since; then the damage is found. A restore's hard links to its files change nothing.
func TestVerifyUnlessFresh(t *testing.T) {
	a := &Agent{store: testStore(t, "node1"), log: slog.New(slog.DiscardHandler)}
	ctx := t.Context()
	m := testSnapshot(t, a.store, "counter-1a2b3c4d", "the job's memory")
	pages := filepath.Join(a.store.Path(m.Job, m.ID), "pages-1.img")
	a.noteReceived(m.Job, m.ID)
	if err := os.Link(pages, filepath.Join(t.TempDir(), "work-copy.img")); err != nil {
		t.Fatal(err)
	}
	stamp, err := filesStamp(a.store.Path(m.Job, m.ID))
	if err != nil {
		t.Fatal(err)
	}
	if !a.received.fresh(m.Job, m.ID, stamp, time.Now()) {
		t.Error("a hard link to a file made a snapshot received moments ago stale")
	}
	if _, err := a.verifyUnlessFresh(ctx, m.Job, m.ID); err != nil {
		t.Fatal(err)
	}

	// A write stamps the file with the file system's clock, which moves on ticks: wait until it has moved
	// past the receipt, or the write would be indistinguishable from it.
	old, err := os.Stat(pages)
	if err != nil {
		t.Fatal(err)
	}
	probe := filepath.Join(t.TempDir(), "probe")
	for {
		if err := os.WriteFile(probe, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if st, err := os.Stat(probe); err != nil || st.ModTime().After(old.ModTime()) {
			break
		}
		runtime.Gosched()
	}
	f, err := os.OpenFile(pages, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("T"), 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := a.verifyUnlessFresh(ctx, m.Job, m.ID); !errors.Is(err, ckpt.ErrCorrupt) {
		t.Errorf("a received snapshot written to since: %v, want it verified and found corrupt", err)
	}
}

// TestDrainTargets: a drain goes to the given nodes, or to the ring's other alive nodes from the protector
// on; never to itself, a spare or a failed node.
func TestDrainTargets(t *testing.T) {
	v := testView(t, "node1", "node2", "node3", "node4", "spare1")
	failed, err := v.Fail("node4")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		view ring.View
		self string
		to   []string
		want []string
		err  string
	}{
		{"the ring from the protector on", v, "node2", nil, []string{"node3", "node4", "node1"}, ""},
		{"a failed node is skipped", failed, "node3", nil, []string{"node1", "node2"}, ""},
		{"as given", v, "node2", []string{"node4", "node1"}, []string{"node4", "node1"}, ""},
		// A node named twice, apart (`--to node4,node1,node4`), is tried once per job: not a second freeze and
		// dump of a job it failed, nor twice the share of the jobs.
		{"a node named twice is tried once", v, "node2", []string{"node4", "node1", "node4"}, []string{"node4", "node1"}, ""},
		{"not to itself", v, "node2", []string{"node2"}, nil, `"node2" is not another alive node`},
		{"not to a spare", v, "node2", []string{"spare1"}, nil, `"spare1" is not another alive node`},
		{"not to a failed node", failed, "node2", []string{"node4"}, nil, `"node4" is not another alive node`},
		{"not to a stranger", v, "node2", []string{"nodeX"}, nil, `"nodeX" is not another alive node`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := drainTargets(tt.view, tt.self, tt.to)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("got %v, %v; want an error saying %s", got, err, tt.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tt.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tt.want)
			}
		})
	}
	alone, err := testView(t, "node1", "node2").Fail("node1")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := drainTargets(alone, "node2", nil); err == nil {
		t.Errorf("a ring with no other alive node: %v, want an error", got)
	}
}

// TestHealthInterval: with a predictor the automatic interval counts only the failures it misses; while
// it predicts a failure, snapshots come at Daly's interval for one a lead time away (never below the
// floor), whatever the job's own interval.
func TestHealthInterval(t *testing.T) {
	a := resumeTestAgent(t)
	a.policies = map[string]*interval.Policy{}
	a.cfg.Checkpoint.Interval = Interval{Fixed: time.Hour}
	a.cfg.Checkpoint.MTBF.Duration = 10 * time.Hour
	a.cfg.Checkpoint.MinInterval.Duration = time.Second
	a.cfg.Health = HealthConfig{Command: []string{"/bin/true"}, Recall: 0.75, LeadTime: Duration{Duration: 10 * time.Minute}}
	if got := a.unpredictedMTBF(); got != 10*time.Hour {
		t.Errorf("MTBF for the checkpoint interval before the health command answered: %s, want checkpoint.mtbf", got)
	}
	a.answering.Store(true)
	if got := a.unpredictedMTBF(); got != 40*time.Hour {
		t.Errorf("MTBF for the checkpoint interval with recall 0.75: %s, want 40h", got)
	}
	if got := a.jobInterval("j"); got != time.Hour {
		t.Errorf("interval while healthy: %s, want the fixed 1h", got)
	}
	a.predicted.Store(true)
	want := interval.Daly(time.Second, 10*time.Minute) // the policy's initial cost estimate is 1 s
	if got := a.jobInterval("j"); got != want || got >= time.Hour {
		t.Errorf("interval while a failure is predicted: %s, want Daly(1s, 10m) = %s", got, want)
	}
	a.cfg.Health.Command = nil
	if got := a.unpredictedMTBF(); got != 10*time.Hour {
		t.Errorf("MTBF without a predictor: %s, want checkpoint.mtbf", got)
	}
}

// TestOwnRestoreDir: a job record's LazyWork is used only if it names one of this agent's restore
// working directories.
func TestOwnRestoreDir(t *testing.T) {
	a := resumeTestAgent(t)
	base := filepath.Join(a.cfg.StateDir, "restore")
	for dir, want := range map[string]bool{
		filepath.Join(base, "rank1-20261126T120000.000Z-node2-000001-0a1b2c3d"): true,
		base:                                   false,
		filepath.Join(base, "a", "b"):          false,
		filepath.Join(base, "..", "snapshots"): false,
		"/etc":                                 false,
		"":                                     false,
	} {
		if got := a.ownRestoreDir(dir); got != want {
			t.Errorf("ownRestoreDir(%q) = %v, want %v", dir, got, want)
		}
	}
}

// TestLeaveThatCannotKillStays: a migration whose dump was shipped but whose job could not be killed here
// leaves the job running here as it was. Before, the job stayed frozen, recorded as moved, its address off
// the wire and its copy marked superseded, while the migration reported it "not moved": it ran nowhere.
func TestLeaveThatCannotKillStays(t *testing.T) {
	ta := newTestAgent(t)
	j := *ta.byID[rootsJob]
	if err := os.WriteFile(filepath.Join(j.Cgroup, "cgroup.freeze"), []byte("1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(j.Cgroup, "cgroup.kill"), 0o755); err != nil { // the kill fails
		t.Fatal(err)
	}
	deleteNet, err := ta.leave(t.Context(), j, "node2", "", "")
	deleteNet()
	if err == nil || !strings.Contains(err.Error(), "runs on here") {
		t.Fatalf("leave: %v; want a failure saying the job runs on here", err)
	}
	cur, _, _ := ta.Job(rootsJob, 0)
	frozen, _ := isFrozen(j.Cgroup)
	_, markErr := os.Lstat(ta.supersededMark(rootsJob, j.Incarnation))
	if cur.State != JobRunning || cur.MovedTo != "" || frozen || markErr == nil {
		t.Errorf("after a leave that could not kill: record %q (moved to %q), frozen %v, marked superseded %v; want running, thawed, unmarked",
			cur.State, cur.MovedTo, frozen, markErr == nil)
	}
}

// TestResumeMigrations: a restarted agent ends the migrations its predecessor left open. One whose job had
// not left (adopted, running here) is closed as not moved; one whose job had left is taken up again: what
// is left of the job here is killed without its shim recording an end, and the move finishes (here, with no
// target answering and no CRIU, as a job lost with the snapshot to restore it from). Before, nothing ended
// them: the events stayed open for good and a job that had left ran nowhere.
func TestResumeMigrations(t *testing.T) {
	ta := newTestAgent(t)
	moved := ta.addJob(t, Job{ID: "moved-00000001", State: JobRunning, PID: os.Getpid()})
	snap := ta.addSnapshot(t, *moved)
	ta.mu.Lock()
	moved.State, moved.MovedTo, moved.Migration, moved.MovedSnapshot = JobMoved, "node2", "moved-00000001-migrate-1", snap
	ta.mu.Unlock()
	unnamed := ta.addJob(t, Job{ID: "unnamed-00000001", State: JobMoved, MovedTo: "node2"})
	if err := os.WriteFile(filepath.Join(moved.Cgroup, "cgroup.kill"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	open := map[string]string{ // event: job
		"roots-00000001-migrate-1":   rootsJob,   // had not left: adopted
		"moved-00000001-migrate-1":   moved.ID,   // had left
		"unnamed-00000001-migrate-1": unnamed.ID, // left, by an agent that did not record its dump
		"gone-00000001-migrate-1":    "gone-00000001",
	}
	for id, job := range open {
		ta.failures.Update(id, func(f *Failure) {
			f.Kind, f.Node, f.Protector, f.Target, f.Jobs = KindMigration, "node1", "node1", "node2", []string{job}
		})
	}
	ta.failures.Update("done-migrate", func(f *Failure) {
		f.Kind, f.Node, f.Protector, f.Jobs, f.Done = KindMigration, "node1", "node1", []string{doneJob}, true
	})
	ta.failures.Update("other-migrate", func(f *Failure) { f.Kind, f.Node, f.Jobs = KindMigration, "node2", []string{"x-00000001"} })

	ctx, cancel := context.WithCancel(t.Context())
	cancel() // the target is not waited for
	n, wait := ta.resumeMigrations(ctx)
	wait()
	if n != 1 {
		t.Fatalf("resumed %d migrations, want 1 (the job that had left)", n)
	}
	event := func(id string) *Failure {
		for _, f := range ta.failures.List() {
			if f.ID == id {
				return f
			}
		}
		t.Fatalf("event %s is gone", id)
		return nil
	}
	wants := map[string]string{
		"roots-00000001-migrate-1":   "restarted before job roots-00000001 left this host",
		"moved-00000001-migrate-1":   "ftctl restore --snapshot " + snap,
		"unnamed-00000001-migrate-1": "does not name the dump",
		"gone-00000001-migrate-1":    "no record of job gone-00000001",
	}
	for id, want := range wants {
		if f := event(id); !f.Done || !strings.Contains(f.Error, want) {
			t.Errorf("event %s: done %v, error %q; want it done, saying %q", id, f.Done, f.Error, want)
		}
	}
	if f := event("other-migrate"); f.Done {
		t.Errorf("another node's migration was ended here")
	}
	if b, err := os.ReadFile(filepath.Join(moved.Cgroup, "cgroup.kill")); err != nil || string(b) != "1" {
		t.Errorf("cgroup.kill of the job that had left: %q, %v; want it killed", b, err)
	}
	if _, err := os.Lstat(ta.supersededMark(moved.ID, moved.Incarnation)); err != nil {
		t.Errorf("the killed copy is not marked superseded (its shim would record its end): %v", err)
	}
	if j, _, _ := ta.Job(rootsJob, 0); j.State != JobRunning {
		t.Errorf("the adopted job is %s, want it running on", j.State)
	}
}

// TestDrainWaitsForReplayWithLongReplayTimeout: a drain waits for a job's replay up to twice
// failover.replay_timeout, which the configuration accepts up to the longest duration. Before,
// twice a replay_timeout of 1281024h or more wrapped negative, and the drain gave up on a replaying job at
// once ("still replaying after -…"), leaving it on a host predicted to fail; now it waits (here until its
// caller goes, which the test does at once).
func TestDrainWaitsForReplayWithLongReplayTimeout(t *testing.T) {
	for _, rt := range []string{"2m", "1281024h", "2562047h"} {
		t.Run(rt, func(t *testing.T) {
			ta := newTestAgent(t)
			cfg := ta.cfg
			if err := cfg.Failover.ReplayTimeout.UnmarshalText([]byte(rt)); err != nil {
				t.Fatal(err)
			}
			if err := cfg.Validate(); err != nil {
				t.Fatalf("replay_timeout %s refused: %v (the test assumes it is accepted)", rt, err)
			}
			ta.cfg = cfg
			for _, id := range ta.runningJobIDs() {
				ta.replays.set(id, true)
			}
			ctx, cancel := context.WithCancel(t.Context())
			cancel() // the drain's caller is gone: the wait for a replay ends with it, not before
			res := ta.drain(ctx, nil, "test")
			if len(res.Failed) == 0 {
				t.Fatalf("drain of replaying jobs: %+v; want them not moved", res)
			}
			for _, f := range res.Failed {
				if !strings.Contains(f, "waiting for its replay") {
					t.Errorf("drain with replay_timeout %s: %q; want it still waiting for the replay when its caller went", rt, f)
				}
			}
		})
	}
}

// withScriptedNode2 makes ta node1, with its credentials, of a view of node1 and node2, where node2 is a
// member that serves the protocol over svc.
func withScriptedNode2(t *testing.T, ta *testAgent, svc clusterapi.Service) {
	t.Helper()
	pki := newTestPKI(t)
	port := scriptedPeer(t, pki, "node2", svc)
	creds := pki.creds(t, "node1")
	ta.cfg.Cluster.CA, ta.cfg.Cluster.Cert, ta.cfg.Cluster.Key = creds.CAFile, creds.CertFile, creds.KeyFile
	ta.wire = testWire
	v, err := ring.New([]ring.Member{
		{Name: "node1", Address: netip.MustParseAddrPort("127.0.0.1:1"), Role: ring.RoleNode, Addrs: []netip.Addr{addrN1}},
		{Name: "node2", Address: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port), Role: ring.RoleNode, Addrs: []netip.Addr{addrN2}},
	})
	if err != nil {
		t.Fatal(err)
	}
	ta.members.view = v
	t.Cleanup(func() { ta.peers().Close() })
}

// memScript is a member whose ping answer reports the available memory the test sets (nil: none, as an
// agent before the field answers).
type memScript struct {
	clusterapi.Service
	name  string
	avail *int64
}

func (s *memScript) Ping(context.Context, string) (clusterapi.PingReply, error) {
	return clusterapi.PingReply{Node: s.name, MemAvailable: s.avail}, nil
}

// TestMigrateChecksTargetMemory: a migration is refused before the job is frozen when the target reports
// less available memory than the job's newest snapshot here needs (with a spare claim's 10% headroom), and
// the job runs on untouched; a target with the memory, or one that does not report it (an older agent), is
// moved to (here the dump then fails: no CRIU). Before, the job was frozen, dumped, shipped and killed here
// whatever the target held: restored there, the OOM killer killed processes on it (another user's job,
// maybe), or its restore failed and the job was restored here again, stopped twice as long.
func TestMigrateChecksTargetMemory(t *testing.T) {
	n := func(v int64) *int64 { return &v }
	tests := []struct {
		name    string
		avail   *int64
		refusal string // "" the job is frozen for its dump
	}{
		{"the target cannot hold the job", n(100), "needs"},
		{"the target holds it but for the headroom", nil, "headroom"}, // avail set below: the snapshot's size
		{"the target reports a negative amount", n(-1), "not an amount"},
		{"the target holds it", n(1 << 40), ""},
		{"an older target reports nothing", nil, ""},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ta := newTestAgent(t)
			script := &memScript{name: "node2", avail: tt.avail}
			withScriptedNode2(t, ta, script)
			j := ta.addJob(t, Job{ID: "big-00000001", State: JobRunning, PID: os.Getpid(),
				Net: &JobNet{Name: "big", Addr: netip.MustParsePrefix(fmt.Sprintf("10.77.0.%d/24", 100+i))}})
			snap := ta.addSnapshot(t, *j)
			if tt.name == "the target holds it but for the headroom" {
				m, err := ta.store.Manifest(j.ID, snap)
				if err != nil {
					t.Fatal(err)
				}
				script.avail = n(m.TotalSize()) // all of it, not the 10% more a restore needs
			}
			_, err := ta.Migrate(t.Context(), MigrateRequest{Job: j.ID, To: "node2"}, 0)
			_, freezeErr := os.Lstat(filepath.Join(j.Cgroup, "cgroup.freeze"))
			frozen := freezeErr == nil
			if tt.refusal != "" {
				if err == nil || !errors.Is(err, ErrNotMovable) || !strings.Contains(err.Error(), tt.refusal) || frozen {
					t.Fatalf("Migrate: %v, job frozen %v; want it refused saying %q before any freeze", err, frozen, tt.refusal)
				}
				if cur, _, _ := ta.Job(j.ID, 0); cur.State != JobRunning {
					t.Errorf("refused migration left the job %s, want it running", cur.State)
				}
				return
			}
			if err == nil || strings.Contains(err.Error(), "memory") || !frozen {
				t.Errorf("Migrate: %v, job frozen %v; want it frozen for its dump (which fails without CRIU), not refused for memory", err, frozen)
			}
		})
	}
}

// TestPingReportsMemory: a ping's answer carries this host's available memory, for a migration's source.
func TestPingReportsMemory(t *testing.T) {
	ta := newTestAgent(t)
	if rep := ta.servePing(); rep.MemAvailable == nil || *rep.MemAvailable <= 0 {
		t.Errorf("ping answer %+v; want this host's available memory", rep)
	}
}

// TestRecoverRequestKeepsOtherRecords: a recovery request whose failure id names a recovery this host keeps
// the record of, under way or another coordinator's, is refused: its tracker would start that record anew,
// and the recovery it describes could no longer be resumed after an agent restart nor answered for.
func TestRecoverRequestKeepsOtherRecords(t *testing.T) {
	const s = "20261126T120000.000Z-node2-000001"
	req := RecoverRequest{Failure: "node1-20261126T120000.000", Failed: "node2", Source: "node2", Migration: true,
		Jobs: []RecoverJob{{Job: "j-1", Snapshot: s, Source: "node2", Candidates: []Candidate{{Snapshot: s, Source: "node2"}}}}}
	tests := []struct {
		name    string
		rec     *recoveryRecord // nil: none
		refusal string          // "" accepted
	}{
		{"no record", nil, ""},
		{"another coordinator's recovery under way", &recoveryRecord{Coordinator: "node3", Asked: []string{"j-9"}}, "under way"},
		{"another coordinator's finished recovery", &recoveryRecord{Coordinator: "node3", Done: true}, "finished"},
		{"the same coordinator's recovery under way", &recoveryRecord{Coordinator: "node2"}, "under way"},
		{"the same coordinator's finished recovery", &recoveryRecord{Coordinator: "node2", Done: true}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := resumeTestAgent(t)
			a.cfg.Name = "node3"
			a.members.view = testView(t, "node1", "node2", "node3")
			if tt.rec != nil {
				tt.rec.Failure = req.Failure
				if err := saveRecovery(a.cfg.StateDir, tt.rec); err != nil {
					t.Fatal(err)
				}
			}
			err := a.checkRecoverRequest(req, "node2")
			switch {
			case tt.refusal == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tt.refusal != "" && (err == nil || !strings.Contains(err.Error(), tt.refusal)):
				t.Errorf("got %v, want a refusal saying %q", err, tt.refusal)
			}
		})
	}
}

// viewlessScript is memScript refusing view exchanges (a drain pushes its view when it ends).
type viewlessScript struct{ memScript }

func (s *viewlessScript) View(context.Context, string, clusterapi.ViewMessage) (clusterapi.ViewMessage, error) {
	return clusterapi.ViewMessage{}, errors.New("not in this test")
}

// TestDrainDumpsAFailingJobOnce: a drain whose move of a job fails in its dump, which any target would
// meet, does not freeze and dump the job again for every other node of the ring; a target that answers
// and has the memory is not to blame. Before, each alive node was tried in turn, each try freezing and
// dumping the job anew (a job with a peer on its host, refused after every dump, was stopped once per
// node of the ring), on a host predicted to fail within its lead time.
func TestDrainDumpsAFailingJobOnce(t *testing.T) {
	ta := newTestAgent(t)
	pki := newTestPKI(t)
	creds := pki.creds(t, "node1")
	ta.cfg.Cluster.CA, ta.cfg.Cluster.Cert, ta.cfg.Cluster.Key = creds.CAFile, creds.CertFile, creds.KeyFile
	ta.wire = testWire
	ms := []ring.Member{{Name: "node1", Address: netip.MustParseAddrPort("127.0.0.1:1"), Role: ring.RoleNode, Addrs: []netip.Addr{addrN1}}}
	for i, name := range []string{"node2", "node3"} {
		port := scriptedPeer(t, pki, name, &viewlessScript{memScript{name: name}})
		ms = append(ms, ring.Member{Name: name, Address: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port), Role: ring.RoleNode,
			Addrs: []netip.Addr{[]netip.Addr{addrN2, addrN3}[i]}})
	}
	v, err := ring.New(ms)
	if err != nil {
		t.Fatal(err)
	}
	ta.members.view = v
	t.Cleanup(func() { ta.peers().Close() })
	ta.mu.Lock()
	for _, j := range ta.byID { // only the job that can move is drained
		j.State = JobExited
	}
	ta.mu.Unlock()
	j := ta.addJob(t, Job{ID: "moving-00000001", State: JobRunning, PID: os.Getpid(),
		Net: &JobNet{Name: "moving", Addr: netip.MustParsePrefix("10.77.0.150/24")}})

	res := ta.drain(t.Context(), nil, "test")
	if len(res.Failed) != 1 || len(res.Moved) != 0 {
		t.Fatalf("drain: %+v; want the job not moved (no CRIU: its dump fails)", res)
	}
	var tries []string
	for _, f := range ta.failures.List() {
		if f.Kind == KindMigration && slices.Contains(f.Jobs, j.ID) {
			tries = append(tries, f.Target)
		}
	}
	if len(tries) != 1 {
		t.Errorf("the job's dump failed, and the drain froze and dumped it again for each node: migrations to %v; want one", tries)
	}
	if cur, _, _ := ta.Job(j.ID, 0); cur.State != JobRunning {
		t.Errorf("job %s after the drain; want it running here", cur.State)
	}
}

// TestRollbackOfJobMovingAway: a rollback whose part of a job is to be restored on this host, while the job
// is moving off it (recorded moved, its migration under way), is refused before anything stops and at its
// stop: the coordinator listed the job here before it left (or nowhere, while the target restores it), and
// the target's copy runs on. Before, the stop skipped the job (not running here) and the restore claimed
// past the target's incarnation (forced: "none runs"): two copies of the job. A job that moved by a
// migration that has ended, and runs nowhere now (the coordinator found it nowhere), is restored here.
func TestRollbackOfJobMovingAway(t *testing.T) {
	for _, tt := range []struct {
		name    string
		ended   bool // the migration's event
		refusal string
	}{
		{"migration under way", false, "is moving to node2"},
		{"migration ended", true, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ta := newTestAgent(t)
			const id, mig = "farm-node1-1", "farm-node1-1-migrate-x"
			uid := uint32(0)
			snap := ta.addSnapshot(t, Job{ID: id, UID: uid, Node: ta.cfg.Name, Spec: JobSpec{Run: "farm"}})
			ta.addJob(t, Job{ID: id, UID: uid, State: JobMoved, MovedTo: "node2", Migration: mig, MovedSnapshot: snap, Spec: JobSpec{Run: "farm"}})
			ta.failures.Update(mig, func(f *Failure) {
				f.Kind, f.Node, f.Protector, f.Target, f.Jobs, f.Done = KindMigration, "node1", "node1", "node2", []string{id}, tt.ended
			})
			parts := []clusterapi.CutPart{{Job: id, Host: ta.cfg.Name, Target: ta.cfg.Name, Snapshot: snap}}
			_, perr := ta.rollbackParts(t.Context(), "farm", uid, parts)
			serr := ta.rollbackStop(t.Context(), "farm", uid, parts)
			for phase, err := range map[string]error{"prepare": perr, "stop": serr} {
				switch {
				case tt.refusal == "" && err != nil:
					t.Errorf("%s: %v; want the part accepted", phase, err)
				case tt.refusal != "" && (err == nil || !strings.Contains(err.Error(), tt.refusal)):
					t.Errorf("%s of a rollback of a job moving to node2: %v; want a refusal saying %q (its restore here would be a second copy)", phase, err, tt.refusal)
				}
			}
		})
	}
}

// TestFailedMoveToFailedTarget: a migration whose target claimed the job's next incarnation and then failed
// (declared failed in the view) restores the job here again from the dump it left with once the target
// has surely fenced itself, its claim superseding the failed target's; a claim held on another host still
// means the job runs there. Before, the restore here was refused by the dead target's claim (ErrJobAlive), the migration
// reported the job running on the failed target, and nobody restored it: a migration is no failure a
// target's fail-over takes over (failurelog.Log.TakeOver).
func TestFailedMoveToFailedTarget(t *testing.T) {
	for _, tt := range []struct {
		name, heldOn string
		protected    bool // the target re-protected the job: its protector holds a newer replica
		restoredHere bool // the job's restore here went past the claim (here it then fails: the images are no real dump)
	}{
		{"the failed target's claim", "node2", false, true},
		{"another host's claim", "node3", false, false},
		{"the failed target's claim, the job re-protected there", "node2", true, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // loopback: the host interface a restore looks up
			ta.failMember(t, "node2")                                      // the target, declared failed; this agent alone grants
			const job = "moving-00000001"
			snap := ta.addSnapshotWithRunID(t, Job{ID: job, Node: "node1"})
			id := job + "-migrate-x"
			rreq := ta.migrationRequest(id, job, snap)
			if _, err := ta.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: "failover:" + id, Host: tt.heldOn}, time.Now()); err != nil {
				t.Fatal(err)
			}
			ta.cfg.Failover.FenceTimeout.Duration = 100 * time.Millisecond
			res := &Migration{Job: job, From: "node1", To: "node2", Snapshot: snap, Event: id, Error: "recovery on node2: the recovery's target failed"}
			if tt.protected {
				ta.failures.Update(id, func(f *Failure) {
					f.Kind, f.Stages = KindMigration, []Stage{{Name: StageProtected, Host: "node2", Detail: "shipped to node3"}}
				})
			}
			start := time.Now()
			err := ta.afterFailedMove(t.Context(), res, rreq, func(Stage) {})
			if tt.restoredHere {
				if err == nil || !strings.Contains(err.Error(), "restore it with `ftctl restore --snapshot "+snap) {
					t.Fatalf("afterFailedMove: %v, job runs on %s; want it restored here (which fails on these images: lost, with its snapshot named), not left to the failed target", err, res.To)
				}
				// The target was declared failed before the call: it fenced itself by then, not before.
				if ready := ta.cfg.FenceTiming().ReadyAt(start); time.Now().Before(ready) {
					t.Errorf("the target's claim superseded %s after the call, before the target surely fenced itself (%s)", time.Since(start), ready.Sub(start))
				}
				return
			}
			if err != nil || res.To != "node2" {
				t.Fatalf("afterFailedMove: %v, job runs on %s; want it left to the copy node2 claimed (re-protected there), or another host claimed", err, res.To)
			}
		})
	}
}

// addSnapshotWithRunID is addSnapshot with the dump's inventory as CRIU writes it (dumpWithRunID): a restore
// of it gets past its preparation to the incarnation's claim (and then fails: it holds no other image).
func (ta *testAgent) addSnapshotWithRunID(t *testing.T, j Job) string {
	t.Helper()
	inv, err := os.ReadFile(filepath.Join(dumpWithRunID(t), "inventory.img"))
	if err != nil {
		t.Fatal(err)
	}
	return ta.addSnapshotImages(t, j, map[string][]byte{"inventory.img": inv})
}

// TestDrainCountsAJobRunningOnItsTarget: a move whose target failed after the job's copy started there
// (its re-protection, say: the claim of the job's next incarnation refused the restore here) leaves the job
// running on the target, and Migrate says so (To the target, Error what failed). The drain counts the job
// as moved. Before, it reported it "not moved" and the drain's event "1 job(s) still here", while the host
// ran nothing of it.
func TestDrainCountsAJobRunningOnItsTarget(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2")
	ta.mu.Lock()
	for _, j := range ta.byID { // only the job that can move is drained
		j.State = JobExited
	}
	ta.mu.Unlock()
	j := ta.addJob(t, Job{ID: "moving-00000001", State: JobRunning, PID: os.Getpid(),
		Net: &JobNet{Name: "moving", Addr: netip.MustParsePrefix("10.77.0.151/24")}})
	ta.drainMove = func(_ context.Context, req MigrateRequest, _ uint32) (*Migration, error) {
		ta.mu.Lock()
		ta.byID[req.Job].State, ta.byID[req.Job].MovedTo = JobMoved, req.To
		ta.mu.Unlock()
		return &Migration{Job: req.Job, From: "node1", To: req.To, Event: req.Job + "-migrate-x", Error: "re-protection: no protector answers"}, nil
	}
	res := ta.drain(t.Context(), nil, "test")
	if len(res.Moved) != 1 || res.Moved[0].To != "node2" || len(res.Failed) != 0 {
		t.Fatalf("drain of a job that runs on node2 after its move: moved %+v, failed %q; want it moved to node2", res.Moved, res.Failed)
	}
	for _, f := range ta.failures.List() {
		if f.Kind == KindDrain && f.Error != "" {
			t.Errorf("drain event says %q; the job runs on node2", f.Error)
		}
	}
	if cur, _, _ := ta.Job(j.ID, 0); cur.State != JobMoved {
		t.Errorf("job %s after the drain; want it moved", cur.State)
	}
}
