package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/ring"
)

// TestSelfFenceInMinority: a node that hears its predecessor but not its protector fences itself when the
// members it does not reach are a majority of the others (a partition that cut it off with its predecessor:
// each still hears one neighbour, and the protector's side declares it failed and restores its jobs), and
// keeps its jobs when it reaches a majority (its protector failed, or is the one cut off: that side cannot
// declare anyone). Before, hearing one neighbour was never isolation: the node in the minority ran on beside
// the copies of its jobs restored on the other side.
//
// The ring is n1 (this node) -> n2 (its protector) -> n3 (its predecessor) -> n1, with spares s1 and s2.
func TestSelfFenceInMinority(t *testing.T) {
	pki := newTestPKI(t)
	tests := []struct {
		name   string
		answer []string // the members that answer pings; the others' ports refuse
		fence  bool
	}{
		{"cut off with its predecessor", []string{"n3"}, true},
		{"the protector alone is cut off", []string{"n3", "s1", "s2"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ports := map[string]uint16{}
			for _, m := range tt.answer {
				ports[m] = scriptedPeer(t, pki, m, &pingScript{name: m})
			}
			a, logs, kill := fencingAgent(t, pki, ports)
			// n3 beats all along; n2 never acknowledges a beat.
			ctx := runSelfFence(t, a)
			go predecessorBeats(ctx, a)

			requireFenceDecision(t, a, logs, kill, tt.fence, "no answer from 3 of the 4 other members")
		})
	}
}

// TestSelfFenceRingOfTwo: in a ring of two nodes with a spare, a node that hears nothing from its only
// neighbour for fence_timeout fences itself when it reaches no other member (the neighbour and the spare
// are a majority: they declare it and restore its jobs on the spare), and keeps its jobs when it reaches
// the spare (its neighbour failed, or is the one cut off). With no other member, nothing tells the two
// apart, and it does not fence (a fence command covers such rings). Before, a ring of two never fenced:
// the node cut off ran on beside the copies of its jobs restored on the spare.
//
// The ring is n1 (this node) -> n2 (its protector and predecessor) -> n1; n2 is silent and refuses pings.
func TestSelfFenceRingOfTwo(t *testing.T) {
	pki := newTestPKI(t)
	tests := []struct {
		name    string
		members []string // the view's
		answer  []string // the members that answer pings; the others' ports refuse
		fence   bool
	}{
		{"cut off from its neighbour and the spare", []string{"n1", "n2", "s1"}, nil, true},
		{"its neighbour failed, the spare answers", []string{"n1", "n2", "s1"}, []string{"s1"}, false},
		{"no other member", []string{"n1", "n2"}, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ports := map[string]uint16{}
			for _, m := range tt.answer {
				ports[m] = scriptedPeer(t, pki, m, &pingScript{name: m})
			}
			a, logs, kill := fencingAgent(t, pki, ports, tt.members...)
			if p, _ := a.View().Predecessor("n1"); p.Name != "n2" {
				t.Fatalf("predecessor of n1: %q, want n2", p.Name)
			}
			runSelfFence(t, a)

			if len(tt.members) == 2 {
				time.Sleep(3 * a.cfg.Failover.FenceTimeout.Duration)
				if b, _ := os.ReadFile(kill); string(b) == "1" || a.selfFenced.Load() || strings.Contains(logs.String(), keepsJobs) {
					t.Fatalf("job killed %q, node fenced %v with no other member; log:\n%s", b, a.selfFenced.Load(), logs.String())
				}
				return
			}
			requireFenceDecision(t, a, logs, kill, tt.fence, "no answer from 2 of the 2 other members")
		})
	}
}

// TestSelfFenceHeldWhilePredecessorReturns: a node fenced on both neighbours' silence whose predecessor is
// heard again while its protector stays silent keeps its fence until the members answer. Before, it
// unfenced at once (no answer yet from this silence: none is asked while both are silent), pushed its view
// as on a rejoin and let jobs start, then fenced again once the pings to the far side timed out.
func TestSelfFenceHeldWhilePredecessorReturns(t *testing.T) {
	pki := newTestPKI(t)
	// n2 refuses; the spares accept and never answer, so the question takes the whole probe timeout.
	ports := map[string]uint16{"s1": stalledPeer(t, pki, "s1"), "s2": stalledPeer(t, pki, "s2")}
	a, logs, _ := fencingAgent(t, pki, ports)
	// Neither neighbour is heard: the node fences on both silences.
	ctx := runSelfFence(t, a)
	for deadline := time.Now().Add(failAfter); !a.selfFenced.Load(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not fenced within %s; log:\n%s", failAfter, logs.String())
		}
	}

	// The predecessor beats again; the protector stays silent, and the members do not answer.
	go predecessorBeats(ctx, a)
	for end := time.Now().Add(2 * a.cfg.ProbeTimeout()); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		if !a.selfFenced.Load() {
			t.Fatalf("unfenced while the protector is silent and no member answered; log:\n%s", logs.String())
		}
	}
	if strings.Contains(logs.String(), "contact with the ring is back") {
		t.Errorf("rejoined while the protector is silent; log:\n%s", logs.String())
	}
}

// fencingAgent is member n1 of the ring n1 -> n2 (its protector) -> n3 (its predecessor), with spares s1
// and s2 (or of the view of those of them named in only), the members in ports listening there: a
// self-fence that checks every 10 ms and fences after 300 ms, with one running job, whose cgroup.kill file
// it returns.
func fencingAgent(t *testing.T, pki *testPKI, ports map[string]uint16, only ...string) (*Agent, *testenv.SyncBuffer, string) {
	t.Helper()
	a, logs := clientAgent(t, pki, ports)
	if len(only) > 0 {
		v, err := ring.New(slices.DeleteFunc(testMembers(ports), func(m ring.Member) bool { return !slices.Contains(only, m.Name) }))
		if err != nil {
			t.Fatal(err)
		}
		a.members.view = v
	}
	if p, _ := a.View().Protector("n1"); p.Name != "n2" {
		t.Fatalf("protector of n1: %q, want n2", p.Name)
	}
	a.cfg.Heartbeat.Interval.Duration = 20 * time.Millisecond // checks every 10 ms
	a.cfg.Heartbeat.ProbeTimeout.Duration = 200 * time.Millisecond
	a.cfg.Failover.FenceTimeout.Duration = 300 * time.Millisecond
	a.cfg.CgroupParent, a.cfg.JobsDir = t.TempDir(), t.TempDir()
	a.jobs = jobStore{dir: t.TempDir()}
	a.stalls = detect.NewStalls(time.Second, time.Second)
	const job = "work-0000000b"
	a.byID[job] = &Job{ID: job, Node: "n1", State: JobRunning}
	kill := filepath.Join(a.layout().cgroup(job), "cgroup.kill")
	if err := os.MkdirAll(filepath.Dir(kill), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kill, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	pred, _ := a.View().Predecessor("n1")
	a.watchdog.Watch(pred.Name, time.Now())
	return a, logs, kill
}

// runSelfFence runs a's self-fence until the test ends, and returns the context that ends with it.
func runSelfFence(t *testing.T, a *Agent) context.Context {
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); a.selfFence(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return ctx
}

// predecessorBeats records a beat of n3 every 5 ms until ctx ends.
func predecessorBeats(ctx context.Context, a *Agent) {
	for seq := uint64(1); ctx.Err() == nil; seq++ {
		a.watchdog.Beat(detect.Beat{From: "n3", Seq: seq, Sent: time.Now()}, time.Now())
		time.Sleep(5 * time.Millisecond)
	}
}

// keepsJobs is what a node that reaches a majority of the other members logs, once a silence.
const keepsJobs = "reaches a majority of the other members: not fencing"

// requireFenceDecision waits until self-fencing agent a (its job's cgroup.kill file kill) fences or keeps
// its jobs, and checks that it did what fence says: logged keeping them once, or killed the job and
// recorded why (its event's detail holds each of why; one alone comes after "no contact with its protector n2").
func requireFenceDecision(t *testing.T, a *Agent, logs *testenv.SyncBuffer, kill string, fence bool, why ...string) {
	t.Helper()
	killed := func() bool { b, _ := os.ReadFile(kill); return string(b) == "1" }
	fenced := func() bool { return killed() && a.selfFenced.Load() }
	kept := func() bool { return strings.Contains(logs.String(), keepsJobs) }
	for deadline := time.Now().Add(failAfter); !fenced() && !kept(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("neither fenced nor kept its jobs within %s; log:\n%s", failAfter, logs.String())
		}
	}
	if killed() != fence || a.selfFenced.Load() != fence {
		t.Fatalf("job killed %v, node fenced %v; want %v; log:\n%s", killed(), a.selfFenced.Load(), fence, logs.String())
	}
	if !fence {
		// Logged once a silence, not at each answer (a question goes out every check).
		time.Sleep(2 * a.cfg.Failover.FenceTimeout.Duration)
		if n := strings.Count(logs.String(), keepsJobs); n != 1 || killed() || a.selfFenced.Load() {
			t.Errorf("logged keeping the jobs %d times (want once), job killed %v, node fenced %v; log:\n%s", n, killed(), a.selfFenced.Load(), logs.String())
		}
		return
	}
	i := slices.IndexFunc(a.failures.List(), func(f *Failure) bool { return f.Node == "n1" && len(f.Stages) > 0 })
	if i < 0 {
		t.Fatal("no self-fence event recorded")
	}
	st := a.failures.List()[i].Stages[0]
	if len(why) == 1 {
		why = append([]string{"no contact with its protector n2"}, why...)
	}
	if st.Name != StageSelfFenced || slices.ContainsFunc(why, func(w string) bool { return !strings.Contains(st.Detail, w) }) {
		t.Errorf("self-fence stage %+v does not say why (%q)", st, why)
	}
}

// hangingViews is a member that answers pings and holds every view exchange until the test ends: a member
// the rejoining node's push of its view waits on (a blackholed host costs each exchange its timeout).
type hangingViews struct {
	*pingScript
	done <-chan struct{}
}

func (h hangingViews) View(ctx context.Context, _ string, _ clusterapi.ViewMessage) (clusterapi.ViewMessage, error) {
	select {
	case <-ctx.Done():
	case <-h.done:
	}
	return clusterapi.ViewMessage{}, errors.New("view exchange held")
}

// TestSelfFenceChecksWhileRejoinPushesView: a node whose contact came back after it fenced itself pushes its
// view to the members, and goes on checking meanwhile: cut off again, it fences again within fence_timeout
// (its protector's restored copies may go live from fence_timeout + margin after its last beat). Before, the
// check waited for the push, which takes a view exchange's timeout (3 s and more) per member that does not
// answer, and the node ran its jobs that long past its cut.
func TestSelfFenceChecksWhileRejoinPushesView(t *testing.T) {
	pki := newTestPKI(t)
	ports := map[string]uint16{}
	for _, m := range []string{"n3", "s1", "s2"} {
		ports[m] = scriptedPeer(t, pki, m, hangingViews{pingScript: &pingScript{name: m}, done: t.Context().Done()})
	}
	a, logs, _ := fencingAgent(t, pki, ports)
	a.wire.Message = 5 * time.Second // a view exchange's own bound, as in production: its 3 s
	ctx := runSelfFence(t, a)
	waitFenced := func(want bool, within time.Duration, what string) {
		t.Helper()
		for deadline := time.Now().Add(within); a.selfFenced.Load() != want; time.Sleep(2 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: fenced %v after %s, want %v; log:\n%s", what, a.selfFenced.Load(), within, want, logs.String())
			}
		}
	}
	// Neither neighbour is heard: fenced.
	waitFenced(true, failAfter, "both neighbours silent")

	// The predecessor is back, and the members but the protector answer: unfenced, the view pushed.
	beats, stop := context.WithCancel(ctx)
	beating := make(chan struct{})
	go func() { defer close(beating); predecessorBeats(beats, a) }()
	waitFenced(false, failAfter, "the predecessor back, a majority reached")
	if !strings.Contains(logs.String(), "contact with the ring is back after self-fencing") {
		t.Fatalf("unfenced without pushing its view; log:\n%s", logs.String())
	}

	// Cut off again while the push waits on the members: fenced again once the silence reaches the timeout.
	// The beats' goroutine gone first: a beat it records after the read below moves the deadline on.
	stop()
	<-beating
	_, last, _ := a.watchdog.Last("n3")
	waitFenced(true, time.Until(a.cfg.FenceTiming().ReadyAt(last)), "cut off again while the view is pushed")
}
