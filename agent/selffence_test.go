package agent

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/fence"
	"github.com/ftkit/ftkit/ring"
	"golang.org/x/sys/unix"
)

// TestFenceJobs: a fencing node writes 1 to cgroup.kill of each running job's own cgroup (the test agent's
// cgroups are plain directories, so the file is an ordinary one here), never through a link planted there,
// and records one self-fenced event naming the jobs it killed and the one it could not.
func TestFenceJobs(t *testing.T) {
	ta := newTestAgent(t)
	kill := func(id string) string { return filepath.Join(ta.layout().cgroup(id), "cgroup.kill") }
	if err := os.WriteFile(kill(ownersJob), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(ta.dir, "not-a-cgroup")
	if err := os.WriteFile(target, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, kill(rootsJob)); err != nil {
		t.Fatal(err)
	}
	if ok, _ := ta.fenceJobs(ta.runningJobs(), 4*time.Second, "no contact with node2 and node3 for 4s"); !ok {
		t.Fatal("fenceJobs found no job to kill")
	}
	if b, _ := os.ReadFile(kill(ownersJob)); string(b) != "1" {
		t.Errorf("cgroup.kill of %s holds %q, want 1", ownersJob, b)
	}
	if b, _ := os.ReadFile(target); len(b) != 0 {
		t.Errorf("the link planted as cgroup.kill was written through: %q", b)
	}
	// The killed job's record says it goes on elsewhere (ftwrap follows it there), and its shim was told
	// before the kill not to record the copy's end as the job's; the one not killed, not.
	if j, _, _ := ta.Job(ownersJob, 0); !j.Fenced {
		t.Errorf("the killed job's record %+v does not say it was fenced", j)
	} else if _, err := os.Lstat(ta.supersededMark(ownersJob, j.Incarnation)); err != nil {
		t.Errorf("the killed job's copy was not marked superseded: %v", err)
	}
	if j, _, _ := ta.Job(rootsJob, 0); j.Fenced {
		t.Errorf("the job that could not be killed is marked fenced: %+v", j)
	}
	var got *Failure
	for _, f := range ta.Failures() {
		if len(f.Stages) == 1 && f.Stages[0].Name == StageSelfFenced {
			got = f
		}
	}
	if got == nil {
		t.Fatalf("no self-fenced event in %+v", ta.Failures())
	}
	st := got.Stages[0]
	if got.Node != "node1" || !got.Done || !strings.Contains(st.Detail, "no contact with node2 and node3 for 4s; killed jobs "+ownersJob) ||
		!strings.Contains(st.Error, rootsJob) || strings.Contains(st.Detail, doneJob) || got.Detected.Sub(got.LastBeat) != 4*time.Second {
		t.Errorf("self-fence event %+v, stage %+v", got, st)
	}
}

func TestFenceJobsNothingRunning(t *testing.T) {
	ta := newTestAgent(t)
	for _, id := range []string{ownersJob, rootsJob} {
		ta.byID[id].State = JobExited
	}
	if ok, _ := ta.fenceJobs(ta.runningJobs(), 4*time.Second, "no contact with node2 and node3 for 4s"); ok {
		t.Fatal("fenceJobs reported a fence with no job running")
	}
	if fs := ta.Failures(); len(fs) != 0 {
		t.Fatalf("an idle host recorded %+v", fs)
	}
}

// fenceScript is an executable fence command that exits with code.
func fenceScript(t *testing.T, code string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "fence")
	if err := os.WriteFile(p, []byte("#!/bin/sh\necho \"fence $1 $2\"\nexit "+code+"\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	return p
}

// failedHost puts something at node2's address for TestAwaitFence, and returns that address: "silent", a
// listener whose accept queue is full, so that the kernel drops the next handshake as a cut-off host's goes
// unanswered; "hung", one that completes handshakes and never answers, as a host whose agent is stopped;
// "down", nothing, so the kernel refuses, as a host whose agent does not run.
func failedHost(t *testing.T, kind string) netip.AddrPort {
	t.Helper()
	switch kind {
	case "down":
		return netip.MustParseAddrPort("127.0.0.2:1")
	case "hung":
		l, err := net.Listen("tcp", "127.0.0.2:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return netip.MustParseAddrPort(l.Addr().String())
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	// A backlog of 0 queues one connection: the one made here. The kernel drops the SYNs after it.
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 2}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 2}), uint16(sa.(*unix.SockaddrInet4).Port))
	c, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return addr
}

// TestAwaitFence: the protector's fenced stage. A fence command that confirms the host is off ends the
// wait at once; one that fails (or none) falls back to waiting until ReadyAt of the last beat, unless the
// host answers while its agent does not (it will not fence itself); a cancelled wait is an error in the
// stage.
func TestAwaitFence(t *testing.T) {
	for _, tc := range []struct {
		name    string
		command string // exit code of the fence command; "" none
		host    string // what answers at node2's address (failedHost); "" the fixture's, which refuses
		timeout time.Duration
		ago     time.Duration // how long before the call the last beat arrived
		vouched time.Duration // how long before the call this host vouched for the node (0: never)
		watched time.Duration // how long before the call watching the node last began (0: before its last beat)
		beat    []string      // the jobs a beat of the node that arrived after the last one named (nil: none came)
		refused time.Duration // how long before the call this host refused to vouch for it, declared (0: never)
		cancel  bool
		wantErr string // in the error; "" none
		detail  []string
	}{
		{name: "command confirms", command: "0", timeout: time.Hour, detail: []string{"fence command confirmed the host is off", "fence node2 127.0.0.2:1"}},
		{name: "command fails, host silent: wait", command: "3", host: "silent", timeout: 6 * time.Second, ago: 6 * time.Second,
			detail: []string{"fence command failed (exit status 3)", "waited until fence_timeout 6s"}},
		// Up and reachable, it is not cut off; with its agent stopped or not running, nothing kills its jobs.
		{name: "command fails, agent hung on a live host", command: "3", host: "hung", timeout: 6 * time.Second, ago: 6 * time.Second,
			wantErr: "its host answers while its agent does not", detail: []string{"fence command failed (exit status 3)"}},
		{name: "command fails, agent down on a live host", command: "3", host: "down", timeout: 6 * time.Second, ago: 6 * time.Second,
			wantErr: "its host answers while its agent does not", detail: []string{"fence command failed (exit status 3)"}},
		{name: "no command, wait", timeout: 6 * time.Second, ago: 6 * time.Second, detail: []string{"waited until fence_timeout 6s"}},
		{name: "no command, long past", timeout: 6 * time.Second, ago: time.Minute, detail: []string{"waited until"}},
		// The node counts the vouch as contact: the wait counts from it, not from the older beat.
		{name: "vouched after the last beat", timeout: 6 * time.Second, ago: 9 * time.Second, vouched: 6 * time.Second, detail: []string{"waited until"}},
		// Its last beat came before a ring change made it this host's predecessor again: since then it may
		// have reached another protector, and counts its silence from that; the wait counts from the change.
		{name: "watching began after its last beat", timeout: 6 * time.Second, ago: 9 * time.Second, watched: 6 * time.Second, detail: []string{"waited until"}},
		{name: "cancelled", timeout: time.Hour, cancel: true, wantErr: context.Canceled.Error(), detail: []string{"waited until"}},
		// Back without the recovery's jobs (a restarted host): nothing runs twice.
		{name: "beat again without its jobs", timeout: 6 * time.Second, ago: 9 * time.Second, beat: []string{"other"}, detail: []string{"waited until"}},
		// Told by the refused vouch that it was declared: it killed its jobs then, and the wait covers the kill.
		{name: "beat again, vouch refused", timeout: 6 * time.Second, ago: 9 * time.Second, beat: []string{"j1"}, refused: 200 * time.Millisecond, detail: []string{"waited until"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.cfg.Failover.FenceTimeout = Duration{Duration: tc.timeout}
			ta.cfg.Heartbeat.ProbeTimeout = Duration{Duration: 300 * time.Millisecond}
			if tc.host != "" {
				ta.cfg.Cluster.Members[1].Address = failedHost(t, tc.host)
				if err := ta.loadView(); err != nil {
					t.Fatal(err)
				}
			}
			if tc.command != "" {
				ta.cfg.Failover.FenceCommand = []string{fenceScript(t, tc.command), "{host}", "{address}"}
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cancel {
				cancel()
			}
			now := time.Now()
			s := detect.Suspect{Name: "node2", LastBeat: now.Add(-tc.ago), Silence: tc.ago, Jobs: []string{"j1"}}
			if tc.watched > 0 {
				s.Watched, s.Silence = now.Add(-tc.watched), tc.watched
			}
			ta.watchdog = detect.NewWatchdog(detect.Config{Timeout: time.Second})
			ta.watchdog.Beat(detect.Beat{From: "node2", Seq: 1, Jobs: s.Jobs, Sent: s.LastBeat}, s.LastBeat)
			if tc.beat != nil {
				ta.watchdog.Beat(detect.Beat{From: "node2", Seq: 2, Jobs: tc.beat, Sent: now}, now)
			}
			if tc.refused > 0 {
				if err := ta.declared.fail("node2", 0, s.LastBeat); err != nil {
					t.Fatal(err)
				}
				if ta.declared.vouch("node2", 0, now.Add(-tc.refused)) == nil {
					t.Fatal("vouched for a node declared failed")
				}
			}
			ref := s.LastBeat
			if tc.watched > 0 {
				ref = s.Watched
			}
			if tc.vouched > 0 {
				ref = now.Add(-tc.vouched)
				if err := ta.declared.vouch("node2", 0, ref); err != nil {
					t.Fatal(err)
				}
			}
			id := "node2-test"
			err := ta.awaitFence(ctx, id, s, now, "127.0.0.2:1")
			if (err != nil) != (tc.wantErr != "") || err != nil && !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("awaitFence = %v, want error %q", err, tc.wantErr)
			}
			ready := ta.cfg.FenceTiming().ReadyAt(ref)
			if tc.refused > 0 {
				ready = now.Add(-tc.refused + fence.KillBound)
			}
			switch {
			case tc.command == "0" && !time.Now().Before(ready):
				t.Errorf("waited until %s although the fence command confirmed", ready)
			case tc.command != "0" && tc.wantErr == "" && time.Now().Before(ready):
				t.Errorf("returned before %s, when the failed node may not have fenced itself yet", ready)
			}
			var st *Stage
			for _, f := range ta.Failures() {
				if f.ID == id && len(f.Stages) == 1 {
					st = &f.Stages[0]
				}
			}
			if st == nil || st.Name != StageFenced || !strings.Contains(st.Error, tc.wantErr) || (st.Error == "") != (tc.wantErr == "") {
				t.Fatalf("stage %+v", st)
			}
			for _, d := range tc.detail {
				if !strings.Contains(st.Detail, d) {
					t.Errorf("stage detail %q lacks %q", st.Detail, d)
				}
			}
		})
	}
}

// TestServeVouch: a protector vouches only for its alive predecessor as the incarnation it says, and not
// after declaring it failed; a vouch clears the watchdog's silence and drops a declaration on the silence
// before it.
func TestServeVouch(t *testing.T) {
	base, failed, _ := rejoinViews(t) // node1 (this agent) watches node3
	for _, tc := range []struct {
		name     string
		view     ring.View
		peer     string
		inc      uint64
		declared bool   // this agent declared node3 (incarnation 0) failed before
		refusal  string // "" for vouched
	}{
		{"its predecessor", base, "node3", 0, false, ""},
		{"not a member", base, "node9", 0, false, "does not list it alive as incarnation 0"},
		{"another incarnation", base, "node3", 2, false, "does not list it alive as incarnation 2"},
		{"failed in the view", failed, "node2", 0, false, "does not list it alive"},
		{"not its predecessor", base, "node2", 0, false, "this node does not watch it"},
		{"declared failed here", base, "node3", 0, true, "declared node3 (incarnation 0) failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta := newTestAgent(t)
			ta.members.view = tc.view
			ta.watchdog = detect.NewWatchdog(detect.Config{Timeout: time.Second})
			silent := time.Now().Add(-time.Minute)
			ta.watchdog.Watch(tc.peer, silent)
			if tc.declared {
				if err := ta.declared.fail("node3", 0, silent); err != nil {
					t.Fatal(err)
				}
			}
			got := ta.serveVouch(tc.peer, clusterapi.VouchRequest{Incarnation: tc.inc})
			if tc.refusal != "" {
				if got.Member || !strings.Contains(got.Why, tc.refusal) {
					t.Fatalf("answer %+v, want refused with %q", got, tc.refusal)
				}
				if len(ta.watchdog.Suspects(time.Now())) != 1 {
					t.Error("a refused vouch cleared the watchdog's suspicion")
				}
				return
			}
			if !got.Member {
				t.Fatalf("answer %+v, want vouched", got)
			}
			if s := ta.watchdog.Suspects(time.Now()); len(s) != 0 {
				t.Errorf("suspects %+v after the vouch: its silence should count from the vouch", s)
			}
			if _, err := ta.declared.declare(tc.peer, tc.inc, silent); !errors.Is(err, errVouched) {
				t.Errorf("a declaration on the silence before the vouch: %v, want errVouched", err)
			}
		})
	}
}

// TestSelfFenceKillsLateJobs: a host that fenced itself and is still cut off kills a job that began to
// run after the fence (a restore or a start under way when it fenced), and starts none meanwhile: its
// protector counts every copy there as gone and restores the jobs elsewhere. Before, the fence was taken
// once, and such a job ran on beside its copy restored elsewhere.
func TestSelfFenceKillsLateJobs(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	ta.cfg.Heartbeat.Interval.Duration = 20 * time.Millisecond // checks every 10 ms
	ta.cfg.Failover.FenceTimeout.Duration = 100 * time.Millisecond
	ta.watchdog = detect.NewWatchdog(detect.Config{})
	ta.stalls = detect.NewStalls(time.Second, time.Second)
	kill := func(id string) string { return filepath.Join(ta.layout().cgroup(id), "cgroup.kill") }
	for _, id := range []string{ownersJob, rootsJob} {
		if err := os.WriteFile(kill(id), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); ta.selfFence(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(failAfter); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within %s", what, failAfter)
			}
		}
	}
	killed := func(id string) func() bool {
		return func() bool { b, _ := os.ReadFile(kill(id)); return string(b) == "1" }
	}
	waitFor("the cut-off node fences its jobs", killed(ownersJob))
	waitFor("the node counts itself fenced", ta.selfFenced.Load)
	if _, err := ta.StartJob(t.Context(), JobSpec{Argv: []string{"/bin/true"}}, 0, 0); err == nil || !strings.Contains(err.Error(), "fenced itself") {
		t.Errorf("StartJob on the fenced node: %v; want a refusal", err)
	}
	late := ta.addJob(t, Job{ID: "late-0000000a", State: JobRunning, PID: os.Getpid()})
	if err := os.WriteFile(kill(late.ID), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor("the job that began to run after the fence is killed", killed(late.ID))
	// The record says so once the kill is written (markFenced follows killCgroup): waited for, not read
	// at once (ci355 read it between the two).
	waitFor("the late job's record says it was fenced", func() bool { j, _, _ := ta.Job(late.ID, 0); return j.Fenced })
}

// TestNeighbourSilence: the self-fence's silence counts from the last contact with either ring neighbour
// (and the protector's alone, from the last contact with a protector), and goes on when the neighbours
// change (new ones are no contact yet). Before, it restarted at the change:
// a cut-off node that adopted a view in which its protector failed fenced up to fence_timeout after its
// protector's replacement (waiting from the last beat it received) restored its jobs elsewhere.
func TestNeighbourSilence(t *testing.T) {
	const timeout = 400 * time.Millisecond
	t0 := time.Date(2026, 12, 7, 1, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	type step struct {
		ms         int // when the check runs, after t0
		prot, pred string
		c          fence.Contact
		fence      bool
		fresh      bool
		protMs     int // how long the protector alone has been silent
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"no contact since watching began", []step{
			{ms: 0, prot: "n2", pred: "n4", fresh: true},
			{ms: 399, prot: "n2", pred: "n4", protMs: 399},
			{ms: 400, prot: "n2", pred: "n4", fence: true, protMs: 400},
		}},
		{"the protector changes without contact", []step{
			{ms: 0, prot: "n2", pred: "n4", fresh: true},
			{ms: 300, prot: "n3", pred: "n4", protMs: 300},
			{ms: 400, prot: "n3", pred: "n4", fence: true, protMs: 400}, // the old code: not before 700
		}},
		{"the silence goes on from the last contact with the old neighbours", []step{
			{ms: 0, prot: "n2", pred: "n4", fresh: true},
			{ms: 200, prot: "n2", pred: "n4", c: fence.Contact{Protector: at(150)}, protMs: 50},
			{ms: 300, prot: "n3", pred: "n4", protMs: 150},
			{ms: 549, prot: "n3", pred: "n4", protMs: 399},
			{ms: 550, prot: "n3", pred: "n4", fence: true, protMs: 400},
		}},
		{"contact with the new protector", []step{
			{ms: 0, prot: "n2", pred: "n4", fresh: true},
			{ms: 300, prot: "n3", pred: "n4", protMs: 300},
			{ms: 500, prot: "n3", pred: "n4", c: fence.Contact{Protector: at(350)}, protMs: 150},
			{ms: 750, prot: "n3", pred: "n4", c: fence.Contact{Protector: at(350)}, fence: true, protMs: 400},
		}},
		{"the predecessor changes after its beats", []step{
			{ms: 0, prot: "n2", pred: "n4", fresh: true},
			{ms: 100, prot: "n2", pred: "n4", c: fence.Contact{Predecessor: at(100)}, protMs: 100},
			{ms: 200, prot: "n2", pred: "n5", protMs: 200},
			{ms: 499, prot: "n2", pred: "n5", protMs: 499},
			{ms: 500, prot: "n2", pred: "n5", fence: true, protMs: 500},
		}},
		{"the predecessor heard, the protector silent", []step{
			{ms: 0, prot: "n2", pred: "n4", fresh: true},
			{ms: 300, prot: "n2", pred: "n4", c: fence.Contact{Predecessor: at(300)}, protMs: 300},
			{ms: 600, prot: "n2", pred: "n4", c: fence.Contact{Predecessor: at(590)}, protMs: 600},
		}},
	}
	for _, tt := range tests {
		var w neighbourSilence
		for i, s := range tt.steps {
			d, prot, _, fresh := w.check(at(s.ms), s.prot, s.pred, s.c, timeout)
			if want := time.Duration(s.protMs) * time.Millisecond; d.Fence != s.fence || fresh != s.fresh || prot != want {
				t.Errorf("%s: step %d at +%dms (protector %s, predecessor %s): fence %v (silence %s), protector silent %s, fresh %v; want fence %v, %s, fresh %v",
					tt.name, i, s.ms, s.prot, s.pred, d.Fence, d.Silence, prot, fresh, s.fence, want, s.fresh)
			}
		}
	}
}

// TestPredecessorSilence: the predecessor's silence alone (the first node of a segment cut off hears its
// protector) counts from its last beat, and goes on when the predecessor changes.
func TestPredecessorSilence(t *testing.T) {
	const timeout = 400 * time.Millisecond
	t0 := time.Date(2026, 12, 7, 1, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	var w neighbourSilence
	for i, s := range []struct {
		ms     int
		pred   string
		c      fence.Contact
		predMs int
	}{
		{ms: 0, pred: "n4", predMs: 0},
		{ms: 100, pred: "n4", c: fence.Contact{Protector: at(100), Predecessor: at(50)}, predMs: 50},
		{ms: 300, pred: "n5", c: fence.Contact{Protector: at(300)}, predMs: 250},
		{ms: 600, pred: "n5", c: fence.Contact{Protector: at(600)}, predMs: 550},
		{ms: 700, pred: "n5", c: fence.Contact{Protector: at(700), Predecessor: at(690)}, predMs: 10},
	} {
		d, _, pred, _ := w.check(at(s.ms), "n2", s.pred, s.c, timeout)
		if want := time.Duration(s.predMs) * time.Millisecond; pred != want || d.Fence {
			t.Errorf("step %d at +%dms (predecessor %s): predecessor silent %s, fence %v; want %s, no fence", i, s.ms, s.pred, pred, d.Fence, want)
		}
	}
}

// The members a node does not reach may declare it failed when they are a majority of the others: its
// protector's claim of the jobs' next incarnation needs that many of them.
func TestMembersAnswerMinority(t *testing.T) {
	for _, tt := range []struct {
		others, silent int
		minority       bool
	}{
		{2, 1, false}, {2, 2, true}, // a ring of three: the protector's side must hold both others
		{4, 2, false}, {4, 3, true},
		{5, 2, false}, {5, 3, true},
	} {
		ans := membersAnswer{others: tt.others, silent: make([]string, tt.silent)}
		if got := ans.minority(); got != tt.minority {
			t.Errorf("%d of %d others silent: minority %v, want %v", tt.silent, tt.others, got, tt.minority)
		}
	}
}

// TestFenceEventHidesOthersJobs: the self-fence event a user sees (GET /v1/events) names no job of another
// user, not even one the fence could not kill (the event's error names those).
func TestFenceEventHidesOthersJobs(t *testing.T) {
	ta := newTestAgent(t)
	kill := func(id string) string { return filepath.Join(ta.layout().cgroup(id), "cgroup.kill") }
	if err := os.WriteFile(kill(ownersJob), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// rootsJob cannot be killed: its cgroup.kill is a directory.
	if err := os.MkdirAll(kill(rootsJob), 0o700); err != nil {
		t.Fatal(err)
	}
	if ok, _ := ta.fenceJobs(ta.runningJobs(), 4*time.Second, "no contact with node2 and node3 for 4s"); !ok {
		t.Fatal("fenceJobs found no job to kill")
	}
	fs := ta.Events(asOwner.Uid)
	if len(fs) != 1 {
		t.Fatalf("the owner sees %d events, want its job's self-fence", len(fs))
	}
	b, err := json.Marshal(fs)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), rootsJob) {
		t.Errorf("uid %d sees another user's job %s: %s", asOwner.Uid, rootsJob, b)
	}
}

// TestSelfFenceRetriesAFailedKill: a job whose kill failed when its host fenced itself (cgroup.kill could
// not be opened: here a directory stands in its place) is killed once the kill can be done, while the host
// is still cut off: its protector restores it elsewhere after the fence wait whatever happened here. Before,
// it counted as tried with the killed ones and ran on beside its restored copy for as long as the cut lasted.
func TestSelfFenceRetriesAFailedKill(t *testing.T) {
	ta := newTestAgent(t)
	ta.members.view = testView(t, "node1", "node2", "node3")
	ta.cfg.Heartbeat.Interval.Duration = 20 * time.Millisecond // checks every 10 ms
	ta.cfg.Failover.FenceTimeout.Duration = 100 * time.Millisecond
	ta.watchdog = detect.NewWatchdog(detect.Config{})
	ta.stalls = detect.NewStalls(time.Second, time.Second)
	kill := func(id string) string { return filepath.Join(ta.layout().cgroup(id), "cgroup.kill") }
	if err := os.WriteFile(kill(ownersJob), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(kill(rootsJob), 0o700); err != nil { // its kill fails (EISDIR)
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); ta.selfFence(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(failAfter); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within %s", what, failAfter)
			}
		}
	}
	killed := func(id string) func() bool {
		return func() bool { b, _ := os.ReadFile(kill(id)); return string(b) == "1" }
	}
	waitFor("the cut-off node fences its jobs", killed(ownersJob))
	waitFor("the node counts itself fenced", ta.selfFenced.Load)
	waitFor("the failed kill is recorded", func() bool {
		for _, f := range ta.Failures() {
			if len(f.Stages) == 1 && strings.Contains(f.Stages[0].Error, rootsJob) {
				return true
			}
		}
		return false
	})
	if err := os.Remove(kill(rootsJob)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kill(rootsJob), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor("the job whose kill failed is killed once it can be", killed(rootsJob))
	waitFor("its record says it was fenced", func() bool { j, _, _ := ta.Job(rootsJob, 0); return j.Fenced })
}
