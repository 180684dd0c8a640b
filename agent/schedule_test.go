package agent

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestSnapScheduler plays sequences of scheduler ticks: which jobs are due when, from a job's first
// snapshot (at once) to the retries of a first snapshot that failed and the intervals after it.
func TestSnapScheduler(t *testing.T) {
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	job := func(id string) Job { return Job{ID: id, Node: "node1", State: JobRunning} }
	protected := func(j Job, at time.Time) Job {
		j.Replica = &Replica{Snapshot: "s", Time: at, Node: j.Node}
		return j
	}
	restored := job("r")
	restored.Restored = "snap-from-node2"
	movedRecord := protected(job("m"), t0.Add(-time.Second)) // a replica taken on another host
	movedRecord.Replica.Node = "node2"
	exited := job("a")
	exited.State = JobExited
	opened := func(j Job) Job {
		j.NewConns = []string{"10.0.0.1:5000 -> 10.0.0.2:7000: opened after snapshot s"}
		return j
	}

	type step struct {
		at   time.Duration // after t0
		jobs []Job
		want []string // jobs due (keys in semi-coordinated mode)
		// after: the jobs as they are after the attempt (protected or not); nil: no attempt is made.
		after []Job
	}
	tests := []struct {
		name     string
		semi     bool
		interval time.Duration
		steps    []step
	}{
		{name: "a new job is due at once, then one interval after its replica", interval: time.Minute, steps: []step{
			{at: 0, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{protected(job("a"), t0)}},
			{at: 59 * time.Second, jobs: []Job{protected(job("a"), t0)}},
			{at: 60 * time.Second, jobs: []Job{protected(job("a"), t0)}, want: []string{"a"}},
		}},
		{name: "a failed first snapshot is retried after 2 s, then 4 s", interval: time.Hour, steps: []step{
			{at: 0, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{job("a")}},
			{at: 1900 * time.Millisecond, jobs: []Job{job("a")}},
			{at: 2 * time.Second, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{job("a")}},
			{at: 5900 * time.Millisecond, jobs: []Job{job("a")}},
			{at: 6 * time.Second, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{protected(job("a"), t0.Add(6*time.Second))}},
			{at: 20 * time.Second, jobs: []Job{protected(job("a"), t0.Add(6*time.Second))}},
		}},
		{name: "retries are never further apart than the interval", interval: 3 * time.Second, steps: []step{
			{at: 0, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{job("a")}},
			{at: 2 * time.Second, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{job("a")}},
			{at: 5 * time.Second, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{job("a")}},
			{at: 8 * time.Second, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{job("a")}},
		}},
		{name: "an adopted job with a replica is due at the grid point at least half an interval after it", interval: time.Minute, steps: []step{
			{at: 0, jobs: []Job{protected(job("a"), t0.Add(-10*time.Second))}},
			{at: 59 * time.Second, jobs: []Job{protected(job("a"), t0.Add(-10*time.Second))}},
			{at: 60 * time.Second, jobs: []Job{protected(job("a"), t0.Add(-10*time.Second))}, want: []string{"a"}},
		}},
		{name: "an adopted job whose replica is old is due on the grid at once", interval: time.Minute, steps: []step{
			{at: 0, jobs: []Job{protected(job("a"), t0.Add(-50*time.Second))}, want: []string{"a"}},
		}},
		{name: "a restored job is left to its recovery for an interval", interval: time.Minute, steps: []step{
			{at: 0, jobs: []Job{restored}},
			{at: 59 * time.Second, jobs: []Job{restored}},
			{at: 60 * time.Second, jobs: []Job{restored}, want: []string{"r"}},
		}},
		{name: "a replica taken on another host does not protect the job here", interval: time.Hour, steps: []step{
			{at: 0, jobs: []Job{movedRecord}, want: []string{"m"}},
		}},
		{name: "an exited job is forgotten; the same id running again is new", interval: time.Hour, steps: []step{
			{at: 0, jobs: []Job{job("a")}, want: []string{"a"}, after: []Job{protected(job("a"), t0)}},
			{at: time.Second, jobs: []Job{exited}},
			{at: 2 * time.Second, jobs: []Job{job("a")}, want: []string{"a"}},
		}},
		{name: "connections newer than the replica: due a second after the last snapshot, then ever later while they keep coming", interval: time.Hour, steps: []step{
			{at: 0, jobs: []Job{protected(job("a"), t0)}},
			{at: 500 * time.Millisecond, jobs: []Job{opened(protected(job("a"), t0))}},
			{at: time.Second, jobs: []Job{opened(protected(job("a"), t0))}, want: []string{"a"}, after: []Job{protected(job("a"), t0.Add(time.Second))}},
			{at: 1500 * time.Millisecond, jobs: []Job{opened(protected(job("a"), t0.Add(time.Second)))}},
			// The gap has doubled; this attempt fails: retried like a first snapshot, 2 s later.
			{at: 3 * time.Second, jobs: []Job{opened(protected(job("a"), t0.Add(time.Second)))}, want: []string{"a"}, after: []Job{opened(protected(job("a"), t0.Add(time.Second)))}},
			{at: 4900 * time.Millisecond, jobs: []Job{opened(protected(job("a"), t0.Add(time.Second)))}},
			{at: 5 * time.Second, jobs: []Job{opened(protected(job("a"), t0.Add(time.Second)))}, want: []string{"a"}, after: []Job{protected(job("a"), t0.Add(5*time.Second))}},
			{at: 8 * time.Second, jobs: []Job{opened(protected(job("a"), t0.Add(5*time.Second)))}},
			// Quiet for twice the gap (4 s): the next new connection is snapshotted a second after again.
			{at: 13 * time.Second, jobs: []Job{protected(job("a"), t0.Add(5*time.Second))}},
			{at: 14 * time.Second, jobs: []Job{opened(protected(job("a"), t0.Add(5*time.Second)))}, want: []string{"a"}},
		}},
		{name: "connections newer than the replica never make snapshots closer than the interval", interval: 500 * time.Millisecond, steps: []step{
			{at: 0, jobs: []Job{protected(job("a"), t0)}},
			{at: 400 * time.Millisecond, jobs: []Job{opened(protected(job("a"), t0))}},
			{at: 500 * time.Millisecond, jobs: []Job{opened(protected(job("a"), t0))}, want: []string{"a"}},
		}},
		{name: "semi-coordinated: a new job makes the host due", semi: true, interval: time.Minute, steps: []step{
			{at: 0, jobs: []Job{job("a")}, want: []string{""}, after: []Job{protected(job("a"), t0)}},
			{at: 10 * time.Second, jobs: []Job{protected(job("a"), t0)}},
			{at: 11 * time.Second, jobs: []Job{protected(job("a"), t0), job("b")}, want: []string{""},
				after: []Job{protected(job("a"), t0), protected(job("b"), t0.Add(11*time.Second))}},
			// On the grid (t0 is on it): 49 s after the attempt, more than half an interval.
			{at: 59 * time.Second, jobs: []Job{protected(job("a"), t0), protected(job("b"), t0.Add(11*time.Second))}},
			{at: 60 * time.Second, jobs: []Job{protected(job("a"), t0), protected(job("b"), t0.Add(11*time.Second))}, want: []string{""}},
		}},
		{name: "semi-coordinated: the host retries while one job lacks a replica", semi: true, interval: time.Hour, steps: []step{
			{at: 0, jobs: []Job{protected(job("a"), t0), job("b")}, want: []string{""}, after: []Job{protected(job("a"), t0), job("b")}},
			{at: time.Second, jobs: []Job{protected(job("a"), t0), job("b")}},
			{at: 2 * time.Second, jobs: []Job{protected(job("a"), t0), job("b")}, want: []string{""}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newSnapScheduler(tt.semi)
			s.phaseOf = func(Job) uint64 { return 0 } // t0 is on every grid: the cases read in whole intervals
			for _, st := range tt.steps {
				now := t0.Add(st.at)
				due, keys, _ := s.due(st.jobs, now, func(string) time.Duration { return tt.interval })
				if !slices.Equal(keys, st.want) {
					t.Fatalf("at +%s: due %v, want %v", st.at, keys, st.want)
				}
				if tt.semi && due != nil {
					t.Fatalf("at +%s: semi-coordinated mode names jobs %v; it snapshots them all", st.at, due)
				}
				if len(keys) > 0 && st.after != nil {
					s.attempted(keys, st.after, now)
				} else if len(keys) > 0 {
					s.attempted(keys, st.jobs, now)
				}
			}
		})
	}
}

// TestWaitFrozenBounded: a cgroup that never reports frozen (a task in uninterruptible sleep) fails the
// wait after the timeout instead of blocking the snapshot, and with it every job of the host, forever.
func TestWaitFrozenBounded(t *testing.T) {
	dir := t.TempDir()
	frozen, stuck := filepath.Join(dir, "frozen"), filepath.Join(dir, "stuck")
	for cg, events := range map[string]string{frozen: "populated 1\nfrozen 1\n", stuck: "populated 1\nfrozen 0\n"} {
		if err := os.Mkdir(cg, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(cg, "cgroup.events"), []byte(events), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name    string
		cgroups []string
		wantErr string
	}{
		{"all frozen", []string{frozen}, ""},
		{"one never freezes", []string{frozen, stuck}, "did not freeze within"},
		{"gone", []string{filepath.Join(dir, "gone")}, "read freeze state"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			done := make(chan error, 1)
			go func() { done <- waitFrozen(context.Background(), tt.cgroups, 200*time.Millisecond) }()
			select {
			case err := <-done:
				if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
					t.Fatalf("waitFrozen: %v, want error %q", err, tt.wantErr)
				}
			case <-time.After(time.Minute): // a failure bound only
				t.Fatal("waitFrozen still waiting after a minute with a 200 ms timeout")
			}
		})
	}
}

func TestUnrecoverableConns(t *testing.T) {
	owner := func(a netip.Addr) string {
		switch a.Unmap() {
		case netip.MustParseAddr("10.0.0.1"):
			return "node1"
		case netip.MustParseAddr("10.0.0.2"):
			return "node2"
		}
		return ""
	}
	// This host is node1; each job is dumped on its own unless the mode dumps the host's jobs together.
	apart := func(a netip.Addr) bool { return a.Unmap().IsLoopback() || owner(a) == "node1" }
	conn := func(local, remote string) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort(local), Remote: netip.MustParseAddrPort(remote)}}
	}
	const stranger, local = "not a cluster member", "another process of this host"
	tests := []struct {
		name     string
		conns    []ckpt.Conn
		together bool     // semi-coordinated mode
		want     []string // why, per connection named
	}{
		{"peers on members", []ckpt.Conn{conn("10.0.0.1:5000", "10.0.0.2:7000")}, false, nil},
		{"a v4-mapped member address", []ckpt.Conn{conn("[::ffff:10.0.0.1]:5000", "[::ffff:10.0.0.2]:7000")}, false, nil},
		{"a host outside the cluster", []ckpt.Conn{conn("10.0.0.1:5000", "10.0.0.2:7000"), conn("10.0.0.1:5002", "192.0.2.7:80")}, false, []string{stranger}},
		{"loopback, both ends in the job", []ckpt.Conn{conn("127.0.0.1:5000", "127.0.0.1:7000"), conn("127.0.0.1:7000", "127.0.0.1:5000"),
			conn("[::1]:5000", "[::1]:7000"), conn("[::1]:7000", "[::1]:5000")}, false, nil},
		{"this host's address, both ends in the job", []ckpt.Conn{conn("10.0.0.1:5001", "10.0.0.1:7001"), conn("10.0.0.1:7001", "10.0.0.1:5001")}, false, nil},
		{"loopback, the peer in another job", []ckpt.Conn{conn("127.0.0.1:5000", "127.0.0.1:7000")}, false, []string{local}},
		{"this host's address, the peer in another job", []ckpt.Conn{conn("10.0.0.1:5001", "10.0.0.1:7001")}, false, []string{local}},
		{"the host's jobs dumped together", []ckpt.Conn{conn("127.0.0.1:5000", "127.0.0.1:7000"), conn("10.0.0.1:5001", "10.0.0.1:7001")}, true, nil},
	}
	for _, tt := range tests {
		a := apart
		if tt.together {
			a = nil
		}
		got := unrecoverableConns(tt.conns, owner, a)
		if len(got) != len(tt.want) {
			t.Errorf("%s: %q, want %d connection(s)", tt.name, got, len(tt.want))
			continue
		}
		for i, g := range got {
			if !strings.Contains(g, tt.want[i]) {
				t.Errorf("%s: %q does not say %q", tt.name, g, tt.want[i])
			}
		}
	}
}

// TestStrayLocalConns: in semi-coordinated mode a connection to a process of this host is flagged only when
// no snapshot of the freeze holds its other end.
func TestStrayLocalConns(t *testing.T) {
	onHost := func(a netip.Addr) bool {
		return a.Unmap().IsLoopback() || a.Unmap() == netip.MustParseAddr("10.0.0.1") || a.Unmap() == netip.MustParseAddr("10.0.1.5")
	}
	conn := func(local, remote string) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort(local), Remote: netip.MustParseAddrPort(remote)}}
	}
	snap := func(job string, conns ...ckpt.Conn) *ckpt.Manifest {
		return &ckpt.Manifest{Job: job, ID: "s-" + job, Info: ckpt.Info{Conns: conns}}
	}
	const stray = "the peer is a process of this host in no job snapshotted with this one"
	tests := []struct {
		name string
		ms   []*ckpt.Manifest
		want map[string][]string // why, per snapshot
	}{
		{"two jobs of the freeze, host address and loopback", []*ckpt.Manifest{
			snap("a", conn("10.0.0.1:5001", "10.0.0.1:7001"), conn("127.0.0.1:5000", "127.0.0.1:7000")),
			snap("b", conn("10.0.0.1:7001", "10.0.0.1:5001"), conn("127.0.0.1:7000", "127.0.0.1:5000"))}, nil},
		{"a peer on another host", []*ckpt.Manifest{snap("a", conn("10.0.0.1:5001", "10.0.0.2:7001"))}, nil},
		{"a process of this host in no job", []*ckpt.Manifest{
			snap("a", conn("10.0.0.1:5001", "10.0.0.1:7001"), conn("10.0.0.1:5002", "10.0.0.2:7001")),
			snap("b", conn("[::1]:7000", "[::1]:6000"))},
			map[string][]string{"s-a": {"10.0.0.1:5001 -> 10.0.0.1:7001: " + stray}, "s-b": {"[::1]:7000 -> [::1]:6000: " + stray}}},
		{"another job's address on this host, that job in the freeze", []*ckpt.Manifest{
			snap("a", conn("10.0.1.4:5001", "10.0.1.5:7001")), snap("b", conn("10.0.1.5:7001", "10.0.1.4:5001"))}, nil},
		{"a connect the other end had accepted", []*ckpt.Manifest{
			snap("a", ckpt.Conn{Tuple: conn("10.0.0.1:5001", "10.0.0.1:7001").Tuple, Connecting: true}), snap("b", conn("10.0.0.1:7001", "10.0.0.1:5001"))},
			map[string][]string{"s-a": {"still connecting in job a's snapshot, accepted in job b's"}}},
	}
	for _, tt := range tests {
		got := strayLocalConns(tt.ms, onHost)
		if len(got) != len(tt.want) {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
			continue
		}
		for id, whys := range tt.want {
			if len(got[id]) != len(whys) {
				t.Errorf("%s: snapshot %s: %q, want %q", tt.name, id, got[id], whys)
				continue
			}
			for i, w := range whys {
				if !strings.Contains(got[id][i], w) {
					t.Errorf("%s: snapshot %s: %q does not say %q", tt.name, id, got[id][i], w)
				}
			}
		}
	}
}

// TestSnapSchedulerAlignsRun: ranks of one run whose first snapshots were taken seconds apart are then
// snapshotted at the same instants, an interval apart; the scheduler's ticks (100 ms) are simulated.
func TestSnapSchedulerAlignsRun(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 10, 0, 0, 0, time.UTC)
	const iv = 5 * time.Second
	rank := func(id string, replica time.Duration) Job {
		j := Job{ID: id, Node: "node1", State: JobRunning, Replica: &Replica{Snapshot: "s", Time: t0.Add(replica), Node: "node1"}}
		j.Spec.Run = "lammps-42"
		return j
	}
	for _, semi := range []bool{false, true} {
		jobs := []Job{rank("r0", 0), rank("r1", 1300*time.Millisecond), rank("r2", 3700*time.Millisecond)}
		s := newSnapScheduler(semi)
		times := map[string][]time.Duration{}
		for at := 3800 * time.Millisecond; at < 30*time.Second; at += 100 * time.Millisecond {
			now := t0.Add(at)
			due, keys, _ := s.due(jobs, now, func(string) time.Duration { return iv })
			if semi && len(keys) > 0 {
				due = []string{"r0", "r1", "r2"}
			}
			for _, id := range due {
				times[id] = append(times[id], at)
			}
			s.attempted(keys, jobs, now)
		}
		after := func(id string) []time.Duration { // the instants once every rank had its first
			return slices.DeleteFunc(slices.Clone(times[id]), func(d time.Duration) bool { return d < 10*time.Second })
		}
		for _, id := range []string{"r1", "r2"} {
			if !slices.Equal(after(id), after("r0")) {
				t.Errorf("semi %v: %s snapshotted at %v, r0 at %v: want the same instants after the first", semi, id, times[id], times["r0"])
			}
		}
		ts := after("r0")
		if len(ts) < 3 {
			t.Fatalf("semi %v: %d snapshots from 10 s to 30 s at a 5 s interval", semi, len(ts))
		}
		for i := 1; i < len(ts); i++ {
			if d := ts[i] - ts[i-1]; d != iv {
				t.Errorf("semi %v: snapshots %s apart (%v), want the interval %s", semi, d, ts, iv)
			}
		}
		if semi {
			continue
		}
		for _, j := range jobs { // the first comes between half and one and a half intervals after the replica
			if gap := times[j.ID][0] - j.Replica.Time.Sub(t0); gap < iv/2 || gap > 3*iv/2 {
				t.Errorf("%s: first snapshot %s after its replica, want between %s and %s", j.ID, gap, iv/2, 3*iv/2)
			}
		}
	}
}

// TestSnapSchedulerSpreadsUnrelatedJobs: two jobs without a run name, their replicas taken at the same
// moment, are not snapshotted at the same instants (each has a grid of its own), each an interval apart.
func TestSnapSchedulerSpreadsUnrelatedJobs(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 10, 0, 0, 0, time.UTC)
	const iv = 5 * time.Second
	solo := func(id string) Job {
		return Job{ID: id, Node: "node1", State: JobRunning, Replica: &Replica{Snapshot: "s", Time: t0, Node: "node1"}}
	}
	jobs := []Job{solo("backup-1f3a"), solo("web-9c2e")}
	s := newSnapScheduler(false)
	times := map[string][]time.Duration{}
	for at := 100 * time.Millisecond; at < 30*time.Second; at += 100 * time.Millisecond {
		now := t0.Add(at)
		due, keys, _ := s.due(jobs, now, func(string) time.Duration { return iv })
		for _, id := range due {
			times[id] = append(times[id], at)
		}
		s.attempted(keys, jobs, now)
	}
	a, b := times["backup-1f3a"], times["web-9c2e"]
	if len(a) < 4 || len(b) < 4 {
		t.Fatalf("snapshots in 30 s at a 5 s interval: %v and %v", a, b)
	}
	if a[len(a)-1] == b[len(b)-1] {
		t.Errorf("unrelated jobs snapshotted at the same instants: %v and %v", a, b)
	}
	for _, ts := range [][]time.Duration{a, b} {
		for i := 2; i < len(ts); i++ {
			if d := ts[i] - ts[i-1]; d != iv {
				t.Errorf("snapshots %s apart (%v), want the interval %s", d, ts, iv)
			}
		}
	}
}

// TestRestoredOnItsOwnHostNotProtectedByOldReplica: a copy restored on the host its snapshot was taken on (a
// coordinated rollback restores each part there; a manual restore on the job's own host) carries, in the
// record inside the snapshot, the replica taken before that snapshot: a snapshot of an execution that is
// gone (a restore from it is refused: its incarnation was superseded). Until the copy's own snapshot is
// replicated it is not protected, as a copy restored on another host is not.
func TestRestoredOnItsOwnHostNotProtectedByOldReplica(t *testing.T) {
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	id := func(at time.Time, seq uint64) string {
		return ckpt.SnapshotID{Time: at, Node: "node1", Seq: seq}.String()
	}
	older, cut, newer := id(t0, 1), id(t0.Add(time.Minute), 2), id(t0.Add(2*time.Minute), 3)
	// What restoreJob makes of the record in snapshot cut: its replica is the one before it.
	j := Job{ID: "j", Node: "node1", State: JobRunning, Restored: cut,
		Replica: &Replica{Snapshot: older, Time: t0, Node: "node1", Holders: []string{"node2"}}}
	if j.Protected() {
		t.Errorf("a copy restored from %s counts as protected by replica %s, taken before it", cut, older)
	}
	// Its own snapshot, replicated (recordReplica), protects it.
	j.Replica = &Replica{Snapshot: newer, Time: t0.Add(2 * time.Minute), Node: "node1", Holders: []string{"node2"}}
	if !j.Protected() {
		t.Errorf("a copy restored from %s is not protected by its own replica %s", cut, newer)
	}
	// Restored on another host, its own replicas protect it whatever the two hosts' clocks.
	moved := Job{ID: "j", Node: "node3", State: JobRunning, Restored: newer,
		Replica: &Replica{Snapshot: ckpt.SnapshotID{Time: t0, Node: "node3", Seq: 1}.String(), Node: "node3"}}
	if !moved.Protected() {
		t.Error("a copy restored on another host is not protected by a replica of its own taken by a slower clock")
	}
}

// TestSnapSchedulerHugeInterval: a job may ask for any interval of at least checkpoint.min_interval (any
// local user can start one); one of a century or more is "as good as never", not "at every tick". Before,
// the grid's arithmetic wrapped past int64 nanoseconds for such an interval and the job was
// dumped back to back, every 100 ms tick, whatever floor the site set.
func TestSnapSchedulerHugeInterval(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 10, 0, 0, 0, time.UTC)
	for _, spec := range []string{"100000h", "1400000h", "2000000h", "2562047h"} {
		t.Run(spec, func(t *testing.T) {
			if err := (Config{}).CheckJobInterval(spec); err != nil {
				t.Fatalf("CheckJobInterval(%q): %v (the test assumes it is accepted)", spec, err)
			}
			iv, err := time.ParseDuration(spec)
			if err != nil {
				t.Fatal(err)
			}
			for _, run := range []string{"", "lammps-42", "wrf-7"} {
				j := Job{ID: "big-" + run, Node: "node1", State: JobRunning, Replica: &Replica{Snapshot: "s", Time: t0, Node: "node1"}}
				j.Spec.Run = run
				s := newSnapScheduler(false)
				for at := 100 * time.Millisecond; at < time.Minute; at += 100 * time.Millisecond {
					now := t0.Add(at)
					due, keys, _ := s.due([]Job{j}, now, func(string) time.Duration { return iv })
					if len(due) > 0 {
						t.Fatalf("run %q: job with interval %s due %s after its replica (next on its grid: %s)",
							run, spec, at, onGrid(t0, iv, s.phaseOf(j)))
					}
					s.attempted(keys, []Job{j}, now)
				}
			}
		})
	}
}

// TestSnapSchedulerConnsOnlyUnlessAnotherIsDue: in semi-coordinated mode one snapshot covers the host's
// jobs, and it is due only for new connections (the scheduler then skips it if an earlier snapshot took
// them) only when no job is due for its interval. The old code marked the host's snapshot due for
// connections alone whenever one job had opened some, even with another job due on its interval at the
// same tick: skipped, that job's snapshot waited another interval.
func TestSnapSchedulerConnsOnlyUnlessAnotherIsDue(t *testing.T) {
	t0 := time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)
	protected := func(id string, at time.Time, conns bool) Job {
		j := Job{ID: id, Node: "node1", State: JobRunning, Replica: &Replica{Snapshot: "s", Time: at, Node: "node1"}}
		if conns {
			j.NewConns = []string{"10.0.0.1:5000 -> 10.0.0.2:7000: opened after snapshot s"}
		}
		return j
	}
	iv := func(string) time.Duration { return time.Minute }
	for _, tc := range []struct {
		name      string
		jobs      []Job // at +60 s, the host's last attempt at +10 s (off its grid: due again at +60 s)
		connsOnly bool
	}{
		{name: "one job due on its interval, another for connections",
			jobs: []Job{protected("a", t0, false), protected("b", t0.Add(10*time.Second), true)}},
		{name: "only for connections", connsOnly: true,
			jobs: []Job{protected("b", t0.Add(10*time.Second), true)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSnapScheduler(true)
			s.phaseOf = func(Job) uint64 { return 0 }
			first := []Job{protected("b", t0, true)}
			if len(tc.jobs) > 1 {
				first = append([]Job{protected("a", t0, false)}, first...)
			}
			if _, keys, _ := s.due(first, t0.Add(10*time.Second), iv); !slices.Equal(keys, []string{""}) || !s.onlyForConns(keys) {
				t.Fatalf("at +10 s: due %v, only for connections %v; want the host, for connections", keys, s.onlyForConns(keys))
			}
			s.attempted([]string{""}, []Job{protected("a", t0, false), protected("b", t0.Add(10*time.Second), false)}, t0.Add(10*time.Second))
			_, keys, _ := s.due(tc.jobs, t0.Add(60*time.Second), iv)
			if !slices.Equal(keys, []string{""}) {
				t.Fatalf("at +60 s: due %v, want the host", keys)
			}
			if got := s.onlyForConns(keys); got != tc.connsOnly {
				t.Errorf("at +60 s: only for connections %v, want %v", got, tc.connsOnly)
			}
		})
	}
}
