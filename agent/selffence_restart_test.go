package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/liveness"
)

// TestSelfFenceGoesOnAfterRestart: an agent restarted on a node that is cut off from its ring neighbours
// fences by fence_timeout after the last contact its previous process had, which is what its protector
// waits from (fence.Timing.ReadyAt from the last beat it received). Before, the restarted agent counted
// the silence from its own start: restarted 3 s into a 4 s silence, it killed its jobs 4 s later, about
// 3 s after the restored copies elsewhere went live.
func TestSelfFenceGoesOnAfterRestart(t *testing.T) {
	// Long enough that the old and the new fence time lie seconds apart: a loaded machine tells them apart.
	const timeout = 4 * time.Second
	setup := func(ta *testAgent) {
		ta.members.view = testView(t, "node1", "node2", "node3")
		ta.cfg.Heartbeat.Interval.Duration = 20 * time.Millisecond // checks every 10 ms
		ta.cfg.Failover.FenceTimeout.Duration = timeout
		ta.watchdog = detect.NewWatchdog(detect.Config{})
		ta.stalls = detect.NewStalls(time.Second, time.Second)
		ta.loops = liveness.New(time.Time{}, loopSelfFence)
	}
	// The previous agent hears its predecessor, then nobody for 3 s (its checks go on), and stops.
	prev := newTestAgent(t)
	setup(prev)
	pred, ok := prev.View().Predecessor("node1")
	if !ok {
		t.Fatal("node1 has no predecessor in the test view")
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	// The protector never answers here: its silence, on which a node that reaches no majority of the members
	// fences too, counts from when the previous agent began watching, a few ms before the predecessor's last
	// beat (ci380 had the restarted agent fence 3.8 ms before lastContact + fence_timeout so, rightly).
	watched := time.Now()
	go func() { defer close(done); prev.selfFence(ctx) }()
	checked := func(after time.Time) func() bool {
		return func() bool { return len(prev.loops.Stale(after, 0)) == 0 }
	}
	awaitCond(t, "the previous agent checks", checked(time.Now()))
	lastContact := time.Now()
	prev.watchdog.Beat(detect.Beat{From: pred.Name, Seq: 1, Run: 1, Sent: lastContact}, lastContact)
	for time.Since(lastContact) < 3*time.Second {
		awaitCond(t, "the previous agent checks", checked(time.Now()))
	}
	awaitCond(t, "the previous agent checks again (one full check done)", checked(time.Now()))
	cancel()
	<-done
	// The restarted agent, on the same state dir, hears nobody.
	ta := newTestAgent(t)
	setup(ta)
	ta.cfg.StateDir = prev.cfg.StateDir
	kill := filepath.Join(ta.layout().cgroup(ownersJob), "cgroup.kill")
	if err := os.WriteFile(kill, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	ctx, cancel = context.WithCancel(t.Context())
	done = make(chan struct{})
	go func() { defer close(done); ta.selfFence(ctx) }()
	defer func() { cancel(); <-done }()
	// Due at lastContact + timeout (1 s after the restart); 2 s more for the refused vouch and a slow
	// machine. The old code fenced only at start + timeout, 1 s later still.
	by := start.Add(timeout - time.Second)
	for b, _ := os.ReadFile(kill); string(b) != "1"; b, _ = os.ReadFile(kill) {
		if time.Now().After(by) {
			t.Fatalf("the restarted agent has not fenced %s after its start, %s after the last contact its previous process had (fence_timeout %s): it counts the silence from its own start",
				time.Since(start).Round(time.Millisecond), time.Since(lastContact).Round(time.Millisecond), timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if d := time.Since(watched); d < timeout {
		t.Errorf("fenced %s after the previous agent began watching (%s after the last contact), before fence_timeout %s",
			d, time.Since(lastContact), timeout)
	}
}

// awaitCond waits until cond holds, failing the test after failAfter.
func awaitCond(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(failAfter); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, failAfter)
		}
	}
}

// TestContactStore: the last contact a previous agent recorded counts only within the same boot, and a
// file that does not make sense is reported (the silence then starts at the agent's start, as before).
func TestContactStore(t *testing.T) {
	now := time.Now()
	for _, tt := range []struct {
		name    string
		boot    string        // the boot id at load
		elapsed time.Duration // CLOCK_BOOTTIME passed between save and load
		file    string        // replaces the saved file when set
		wantAgo time.Duration // how long ago the contact was, as of the load; 0: none
		wantErr bool
	}{
		{name: "same boot", boot: "b1", elapsed: 700 * time.Millisecond, wantAgo: 1200 * time.Millisecond},
		{name: "rebooted", boot: "b2", elapsed: time.Second},
		{name: "from the future", boot: "b1", file: `{"boot_id":"b1","heard_boottime_ns":99000000000000}`, wantErr: true},
		{name: "garbage", boot: "b1", file: `{`, wantErr: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), fenceContactFile)
			bt := 100 * time.Second
			s := &contactStore{path: path, boot: func() (string, error) { return "b1", nil }, boottime: func() (time.Duration, error) { return bt, nil }}
			if err := s.save(now, neighbourSilence{heard: now.Add(-500 * time.Millisecond), protHeard: now.Add(-2 * time.Second)}); err != nil {
				t.Fatal(err)
			}
			if tt.file != "" {
				if err := os.WriteFile(path, []byte(tt.file), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			bt += tt.elapsed
			later := now.Add(tt.elapsed)
			r := &contactStore{path: path, boot: func() (string, error) { return tt.boot, nil }, boottime: func() (time.Duration, error) { return bt, nil }}
			w, err := r.load(later)
			if (err != nil) != tt.wantErr {
				t.Fatalf("load: %v, want an error %v", err, tt.wantErr)
			}
			switch {
			case tt.wantAgo == 0 && !w.heard.IsZero():
				t.Errorf("heard %s ago, want no contact", later.Sub(w.heard))
			case tt.wantAgo != 0 && (later.Sub(w.heard) != tt.wantAgo || later.Sub(w.protHeard) != tt.wantAgo+1500*time.Millisecond):
				t.Errorf("heard %s ago, the protector %s ago; want %s and %s", later.Sub(w.heard), later.Sub(w.protHeard), tt.wantAgo, tt.wantAgo+1500*time.Millisecond)
			case tt.wantAgo != 0 && later.Sub(w.predHeard) != tt.wantAgo:
				// The protector was heard before the last contact: that one was the predecessor's.
				t.Errorf("the predecessor heard %s ago, want %s", later.Sub(w.predHeard), tt.wantAgo)
			}
			if st, err := os.Stat(path); err == nil && tt.file == "" && st.Mode().Perm() != 0o600 {
				t.Errorf("mode %v, want 0600", st.Mode().Perm())
			}
		})
	}
}

// TestSelfFenceVouchWaitsFromProtectorContact: a restarted agent that finds its node cut off asks its
// protector to vouch for it until the kill must begin for its jobs to be gone by the protector's ReadyAt,
// which counts from the last beat the protector received: the node's last contact with its protector, not
// with its predecessor, heard later. Before, the wait counted from the last contact with either neighbour
// (the predecessor's, 2.7 s later here), and an unanswered vouch held the kill past the protector's ReadyAt.
func TestSelfFenceVouchWaitsFromProtectorContact(t *testing.T) {
	pki := newTestPKI(t)
	// The protector accepts the connection and never answers: the vouch waits for its whole deadline.
	a, logs, kill := fencingAgent(t, pki, map[string]uint16{"n2": stalledPeer(t, pki, "n2")})
	timeout := a.cfg.Failover.FenceTimeout.Duration
	// The previous agent last reached its protector 3 s ago, and heard its predecessor until just over
	// fence_timeout ago.
	now := time.Now()
	protHeard, heard := now.Add(-3*time.Second), now.Add(-timeout-20*time.Millisecond)
	if err := newContactStore(filepath.Join(a.cfg.StateDir, fenceContactFile)).save(now, neighbourSilence{heard: heard, protHeard: protHeard}); err != nil {
		t.Fatal(err)
	}
	t0 := a.cfg.FenceTiming()
	// The protector received its last beat no later than an interval after protHeard: ReadyAt is past, the
	// kill is due at once (a vouch is asked for one check at most).
	if ready := t0.ReadyAt(protHeard.Add(t0.Interval)); ready.After(now) {
		t.Fatalf("test setup: the protector's ReadyAt %s is not past", ready.Sub(now))
	}
	start := time.Now()
	runSelfFence(t, a)
	by := start.Add(250 * time.Millisecond)
	for b, _ := os.ReadFile(kill); string(b) != "1"; b, _ = os.ReadFile(kill) {
		if time.Now().After(by) {
			t.Fatalf("not fenced %s after the restart, %s after the last contact with the protector (fence_timeout %s, the protector's ReadyAt past); log:\n%s",
				time.Since(start).Round(time.Millisecond), time.Since(protHeard).Round(time.Millisecond), timeout, logs.String())
		}
		time.Sleep(2 * time.Millisecond)
	}
}
