package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/shim"
)

// ring is one ringstencil run: a rank per node, each a protected job started through its node's agent.
type ring struct {
	c      *labcluster.Cluster
	jobs   []agent.Job // as started
	jobDir string
	// release opens the run's gate (gated): wait and waitRanks call it before they wait for the ranks to end.
	release func()
	// heldAt is the iteration the gate holds the ranks at (they report it, then wait), 0 for a run without
	// one: waitIteration waits for no later iteration before the release.
	heldAt int
}

// gated adds a gate to a run's arguments: rank 0 holds before iteration at until the ring's wait releases
// it, so a run cannot end before the faults a test injects, however much slower than the ranks' paced
// iterations a loaded machine makes the recoveries (CI: a run ended before its third failure). The
// reference run takes the arguments without the gate: it changes no byte.
func gated(t *testing.T, args []string, at int) (withGate []string, release func()) {
	t.Helper()
	dir, err := os.MkdirTemp("", "ftkit-gate-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755) // the ranks may run as another user
	open := filepath.Join(dir, "open")
	release = func() {
		if err := os.WriteFile(open, nil, 0o644); err != nil {
			t.Errorf("open the run's gate: %v", err)
		}
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return append(append([]string{}, args...), "--gate", open, "--gate-at", fmt.Sprint(at)), release
}

// ringArgs are the ringstencil flags of a run; the reference run uses the same with loopback addresses.
// The ranks print a progress line every progressEvery iterations, which the tests wait on.
func ringArgs(iters, block int, delay time.Duration) []string {
	return []string{"--iters", fmt.Sprint(iters), "--block", fmt.Sprint(block), "--delay", delay.String(),
		"--progress", fmt.Sprint(progressEvery)}
}

const progressEvery = 10

// reference runs the ranks on loopback without any protection and returns the checksum they agree on.
func reference(t *testing.T, ranks int, args []string) string {
	t.Helper()
	outs := loopbackRun(t, ranks, ranks, func(ctx context.Context, ports []int, r int) *exec.Cmd {
		var peers []string
		for _, p := range ports {
			peers = append(peers, fmt.Sprintf("127.0.0.1:%d", p))
		}
		a := append([]string{"--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ",")}, args...)
		return exec.CommandContext(ctx, bins.Ringstencil, append(a, "--delay", "0s")...)
	})
	return checksumOf(t, outs[0])
}

// loopbackRuns lets one loopback run of the package at a time choose its ports and run: ports chosen free
// are free only until their run binds them, and the labs' tests start together (labSlots), so two runs
// chose the same ports, their ranks connected across the runs and hung (ci272).
var loopbackRuns sync.Mutex

// loopbackRun runs ranks processes, rank r made by cmd with nports loopback ports free now, and returns
// their outputs. It fails t if one fails, or if the run takes more than five minutes (seconds, normally).
func loopbackRun(t *testing.T, nports, ranks int, cmd func(ctx context.Context, ports []int, r int) *exec.Cmd) []string {
	t.Helper()
	loopbackRuns.Lock()
	defer loopbackRuns.Unlock()
	ports := freeLoopbackPorts(t, nports)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	outs := make([]string, ranks)
	errs := make([]error, ranks)
	var wg sync.WaitGroup
	for r := range ranks {
		wg.Go(func() {
			b, err := cmd(ctx, ports, r).CombinedOutput()
			outs[r], errs[r] = string(b), err
		})
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("reference run, rank %d: %v (%v): %s", r, err, context.Cause(ctx), outs[r])
		}
	}
	return outs
}

// freeLoopbackPorts returns n loopback ports free now. Reference runs share the root network namespace
// with every other test on the machine: fixed ports made two runs' ranks connect to each other and hang.
func freeLoopbackPorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	for range n {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close() // held until all are chosen, so that they differ
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports
}

func checksumOf(t *testing.T, out string) string {
	t.Helper()
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[2] == "checksum" {
			return f[3]
		}
	}
	t.Fatalf("no checksum line in %q", out)
	return ""
}

// startRing starts rank r on node r+1 (port is the ranks' listening port).
func startRing(t *testing.T, c *labcluster.Cluster, ranks, port int, args []string) *ring {
	t.Helper()
	return startRanks(t, c, ranks, "rank", ringArgv(t, c, ranks, port, args))
}

// startHeldRing starts a ring run of args held 100 iterations before its end until rg.wait: on a loaded
// machine the snapshots and waits a test makes before its fault can take longer than the whole paced run
// (CI, ci332: the lazy-pages row's run had ended when its snapshot was replicated, nothing left to crash).
func startHeldRing(t *testing.T, c *labcluster.Cluster, ranks, port int, args []string) *ring {
	t.Helper()
	held := flagInt(t, args, "--iters") - 100
	if p := flagInt(t, args, "--progress"); held <= 0 || held%p != 0 {
		t.Fatalf("a run of %d iterations reporting every %d cannot be held 100 before its end", held+100, p)
	}
	withGate, release := gated(t, args, held)
	rg := startRing(t, c, ranks, port, withGate)
	rg.release, rg.heldAt = release, held
	return rg
}

// ringArgv is rank r's ringstencil command line, rank r on node r+1.
func ringArgv(t *testing.T, c *labcluster.Cluster, ranks, port int, args []string) func(r int) []string {
	t.Helper()
	var peers []string
	for r := range ranks {
		h, err := c.Lab.Host(fmt.Sprintf("node%d", r+1))
		if err != nil {
			t.Fatal(err)
		}
		peers = append(peers, netip.AddrPortFrom(h.Addr.Addr(), uint16(port)).String())
	}
	return func(r int) []string {
		return append([]string{bins.Ringstencil, "--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ",")}, args...)
	}
}

// startRanks starts rank r on node r+1 as job name<r> running argv(r); a failed test logs every rank's output.
func startRanks(t *testing.T, c *labcluster.Cluster, ranks int, name string, argv func(r int) []string) *ring {
	t.Helper()
	rg := newRing(t, c, ranks)
	for r := range ranks {
		rg.start(t, r, name, argv(r))
	}
	return rg
}

// newRing is a ring of ranks that start (ring.start) in the order a test chooses; a failed test logs
// every started rank's output.
func newRing(t *testing.T, c *labcluster.Cluster, ranks int) *ring {
	rg := &ring{c: c, jobDir: labcluster.JobsDir(c.Lab.State().ID), jobs: make([]agent.Job, ranks)}
	t.Cleanup(func() {
		if t.Failed() {
			for r, j := range rg.jobs {
				if j.ID == "" {
					continue
				}
				b, _ := os.ReadFile(j.StdoutPath())
				e, _ := os.ReadFile(j.StderrPath())
				x, _ := os.ReadFile(j.ExitPath())
				t.Logf("rank %d (job %s): stdout %q stderr %q exit %s", r, j.ID, tail(string(b)), tail(string(e)), x)
			}
		}
	})
	return rg
}

// start starts rank r on node r+1 as job name<r> running argv.
func (rg *ring) start(t *testing.T, r int, name string, argv []string) {
	t.Helper()
	j, err := rg.c.Client(fmt.Sprintf("node%d", r+1)).StartJob(context.Background(), agent.JobSpec{Name: fmt.Sprintf("%s%d", name, r), Argv: argv})
	if err != nil {
		t.Fatal(err)
	}
	rg.jobs[r] = j
}

// open releases the run's gate, if it has one.
func (rg *ring) open() {
	if rg.release != nil {
		rg.release()
	}
}

// wait waits for every rank's exit record and returns each rank's output. It fails when the ranks go
// timeout without reporting progress: a run that ends slowly on a loaded machine is no failure (ci286:
// the heavy-traffic row's ranks, sharing the 2 cores with three other labs and TestRecvOrderCost, did
// 2800 iterations in the 2 minutes after their recovery, and were cut short), a hang is.
func (rg *ring) wait(t *testing.T, timeout time.Duration) []string {
	t.Helper()
	rg.open()
	began, from := time.Now(), rg.progressAll()
	done, moved := from, began
	outs := make([]string, len(rg.jobs))
	for r, j := range rg.jobs {
		for {
			if p := rg.progressAll(); p != done {
				done, moved = p, time.Now()
			}
			st, err := shim.ReadExit(j.ExitPath())
			if err == nil {
				b, _ := os.ReadFile(j.StdoutPath())
				e, _ := os.ReadFile(j.StderrPath())
				outs[r] = string(b)
				if st.Code != 0 {
					t.Errorf("rank %d (job %s) exited %d on %s: %s%s", r, j.ID, st.Code, st.Node, b, e)
				}
				break
			}
			if time.Since(moved) > timeout {
				b, _ := os.ReadFile(j.StdoutPath())
				e, _ := os.ReadFile(j.StderrPath())
				logSockets(t, rg.c)
				t.Fatalf("rank %d (job %s) has not finished, and no rank reported progress for %s (%d iterations in all in the %s since the wait began); stdout %q stderr %q",
					r, j.ID, timeout, done-from, time.Since(began).Round(time.Second), tail(string(b)), tail(string(e)))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	done = rg.progressAll()
	if d := time.Since(began); d > time.Second {
		t.Logf("the ranks ended %s after the wait began, %d iterations in all (%.0f per rank and second)", d.Round(time.Millisecond),
			done-from, float64(done-from)/float64(len(rg.jobs))/d.Seconds())
	}
	return outs
}

// progressAll is the sum of the ranks' progress.
func (rg *ring) progressAll() int {
	n := 0
	for r := range rg.jobs {
		n += rg.progress(r)
	}
	return n
}

// requireLiftedACKs checks that on every connection of the rank restored on spare1 the ACK clamp lifted
// some of the restored socket's pure ACKs, so that its peer heard during the replay what the replay
// delivered of its bytes (ackclamp.TestAckClampQuiet). Before, each was held back, and the peer heard
// nothing until the restored socket had re-sent everything.
func requireLiftedACKs(t *testing.T, c *labcluster.Cluster) {
	t.Helper()
	b, err := os.ReadFile(c.LogPath("spare1"))
	if err != nil {
		t.Fatal(err)
	}
	released := 0
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.Contains(line, `msg="ACK clamp released"`) {
			continue
		}
		released++
		var lifted int
		if i := strings.Index(line, "own_acks_lifted="); i < 0 {
			t.Errorf("spare1 logged no lifted ACKs: %s", line)
		} else if fmt.Sscan(line[i+len("own_acks_lifted="):], &lifted); lifted == 0 {
			t.Errorf("the ACK clamp lifted none of the restored socket's ACKs: %s", line)
		} else {
			t.Logf("spare1: %s", line[strings.Index(line, "flow="):])
		}
	}
	if released == 0 {
		t.Error("spare1 released no ACK clamp")
	}
}

// logSockets logs the TCP sockets of every live host (ss: state, queues, windows, timers) and its agent's
// log counters (backpressure drops, a paused consumer), for a run that stalled.
func logSockets(t *testing.T, c *labcluster.Cluster) {
	t.Helper()
	for _, h := range c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		ns, err := c.Lab.NetnsPath(h.Name)
		if err != nil {
			t.Logf("sockets of %s: %v", h.Name, err)
			continue
		}
		out, err := exec.Command("nsenter", "--net="+ns, "ss", "-tanoiem").CombinedOutput()
		t.Logf("sockets of %s (%v):\n%s", h.Name, err, out)
		// The host's TCP counters (window probes, local drops, TSQ): what a sender with notsent bytes and
		// nothing in flight is waiting for.
		out, err = exec.Command("nsenter", "--net="+ns, "nstat", "-as", "Tcp*").CombinedOutput()
		t.Logf("TCP counters of %s (%v): %s", h.Name, err, strings.Join(strings.Fields(string(out)), " "))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		st, err := c.Client(h.Name).Status(ctx)
		cancel()
		if err != nil || st.Log == nil {
			t.Logf("log counters of %s: none (%v)", h.Name, err)
			continue
		}
		b, _ := json.Marshal(st.Log.Counters)
		t.Logf("log counters of %s: %s", h.Name, b)
	}
}

// tail is the end of s, for a failed test's log: kept short, as CI keeps only the start and the end of a
// failed test's output.
func tail(s string) string {
	if len(s) > 600 {
		return "..." + s[len(s)-600:]
	}
	return s
}

// pid is rank r's job as its host's agent lists it now.
func (rg *ring) job(t *testing.T, host string, r int) agent.Job {
	t.Helper()
	j, err := rg.c.Client(host).Job(context.Background(), rg.jobs[r].ID)
	if err != nil {
		t.Fatalf("rank %d on %s: %v", r, host, err)
	}
	return j
}

// progress is how many iterations rank r reports done in its output (a multiple of progressEvery).
func (rg *ring) progress(r int) int {
	b, _ := os.ReadFile(rg.jobs[r].StdoutPath()) // the same path on whichever host runs the rank now
	return strings.Count(string(b), " iteration ") * progressEvery
}

// waitProgress waits until every rank has done iters more iterations than now: the ranks are connected
// and exchanging (iters > 0), and what a crash then loses is real traffic past the last snapshot. A run
// held near its end (startHeldRing) is waited for up to where its gate holds it. timeout is a failure
// bound only.
func (rg *ring) waitProgress(t *testing.T, iters int, timeout time.Duration) {
	t.Helper()
	want := make([]int, len(rg.jobs))
	for r := range rg.jobs {
		want[r] = rg.progress(r) + iters
		if rg.heldAt > 0 && want[r] > rg.heldAt {
			t.Logf("rank %d: waiting for iteration %d, where the run is held, not %d: the machine is slower than the run's pace", r, rg.heldAt, want[r])
			want[r] = rg.heldAt
		}
	}
	deadline := time.Now().Add(timeout)
	for r := range rg.jobs {
		for rg.progress(r) < want[r] {
			if time.Now().After(deadline) {
				t.Fatalf("rank %d at iteration %d after %s, want %d", r, rg.progress(r), timeout, want[r])
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// waitProtected waits until every rank's first snapshot, which its agent takes as it starts, is
// replicated: from here on a crash of any node is recoverable.
func (rg *ring) waitProtected(t *testing.T, timeout time.Duration) {
	t.Helper()
	for r, j := range rg.jobs {
		waitProtected(t, rg.c, fmt.Sprintf("node%d", r+1), j.ID, timeout)
	}
}

// waitCovered waits until every rank's agent has listed the rank's connections since this call and
// found them all in its replica (a connection opened after a snapshot makes the agent take another).
func (rg *ring) waitCovered(t *testing.T, timeout time.Duration) {
	t.Helper()
	for r, j := range rg.jobs {
		waitCovered(t, rg.c, fmt.Sprintf("node%d", r+1), j.ID, timeout)
	}
}

// waitCovered waits until host's agent has listed job id's connections after this call and its replica
// holds them all: a crash of host from then on restores every connection the job has. timeout is a
// failure bound only.
func waitCovered(t *testing.T, c *labcluster.Cluster, host, id string, timeout time.Duration) agent.Job {
	t.Helper()
	since := time.Now()
	deadline := since.Add(timeout)
	for {
		j, err := c.Client(host).Job(context.Background(), id)
		if err == nil && j.ConnsChecked.After(since) && j.Covered() {
			return j
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s on %s: connections not covered by its replica within %s: %+v (%v)", id, host, timeout, j, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkpoint snapshots rank r's node and waits until the replica is on its protector.
func (rg *ring) checkpoint(t *testing.T, host string) {
	t.Helper()
	reply, err := rg.c.Client(host).Checkpoint(context.Background())
	if err != nil || reply.Error != "" || len(reply.Results) == 0 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint of %s: %+v %v", host, reply, err)
	}
}

// waitFailure waits until some live agent reports a finished recovery of node.
func waitFailure(t *testing.T, c *labcluster.Cluster, node string, timeout time.Duration) *agent.Failure {
	t.Helper()
	return waitFinished(t, c, "recovery of "+node, func(f *agent.Failure) bool { return f.Node == node }, timeout)
}

// waitFinished waits until a live agent knows a finished failure that match accepts.
func waitFinished(t *testing.T, c *labcluster.Cluster, what string, match func(*agent.Failure) bool, timeout time.Duration) *agent.Failure {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		for _, h := range c.Lab.State().Hosts {
			if h.Crashed {
				continue
			}
			fs, err := c.Client(h.Name).Events(context.Background())
			if err != nil {
				continue
			}
			for _, f := range fs {
				if f.Done && match(f) {
					return f
				}
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("no finished %s within %s", what, timeout)
	return nil
}

func logTimeline(t *testing.T, f *agent.Failure) {
	t.Helper()
	t.Logf("failure %s: %s -> %s (basic %v) error %q", f.ID, f.Node, f.Target, f.Basic, f.Error)
	t0 := f.LastBeat
	if t0.IsZero() && len(f.Stages) > 0 {
		t0 = f.Stages[0].Start // never heard: from when watching began
	}
	for _, s := range f.Stages {
		t.Logf("  +%6.3fs %-17s %8s %s %s %s", s.End.Sub(t0).Seconds(), s.Name, s.Duration().Round(time.Millisecond), s.Job, s.Detail, s.Error)
	}
}

// requireStages checks that a recovery went through every stage without error.
func requireStages(t *testing.T, f *agent.Failure) {
	t.Helper()
	logTimeline(t, f)
	if f.Error != "" {
		t.Fatalf("recovery of %s failed: %s", f.Node, f.Error)
	}
	seen := map[string]bool{}
	for _, s := range f.Stages {
		if s.Error != "" {
			t.Errorf("stage %s: %s", s.Name, s.Error)
		}
		seen[s.Name] = true
	}
	for _, want := range []string{agent.StageDetected, agent.StageClaimed, agent.StageFetched, agent.StageRewritten,
		agent.StageRestored, agent.StageReplayed, agent.StageProtected} {
		if !seen[want] {
			t.Errorf("stage %q missing", want)
		}
	}
}

// requireRoutesPutBack fails the test if a route of host still has the initial window or the lowered MTU
// a recovery set for its restore: left, every later connection of the host starts with the re-sent
// burst's window (before, the spare kept initcwnd 23399 after TestFailover's heavy-traffic row).
func requireRoutesPutBack(t *testing.T, c *labcluster.Cluster, host string) {
	t.Helper()
	var out []byte
	if err := c.Lab.Do(host, func() (err error) {
		out, err = exec.Command("ip", "-d", "route", "show", "table", "main").CombinedOutput()
		return err
	}); err != nil {
		t.Fatalf("routes of %s: %v: %s", host, err, out)
	}
	if strings.Contains(string(out), "initcwnd") || strings.Contains(string(out), "initrwnd") || strings.Contains(string(out), " mtu ") {
		t.Errorf("%s's routes keep what its recovery set for the restore:\n%s", host, out)
	}
}

// checkRanks compares every rank's checksum with the failure-free reference.
func checkRanks(t *testing.T, outs []string, want string) {
	t.Helper()
	for r, out := range outs {
		if got := checksumOf(t, out); got != want {
			t.Errorf("rank %d checksum %s, failure-free run %s", r, got, want)
		}
	}
}

func TestFailover(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const block = 64 << 10
	tests := []struct {
		name  string
		iters int
		delay time.Duration
		// after is how many iterations the ranks do between the snapshot and the crash.
		after int
		// late: the spare joins the pool only while the job runs (ftctl spare add).
		late bool
		// lazy: the spare restores with lazy pages (failover.lazy_restore); each rank holds a ballast,
		// which it checks at its end, so a page lost on the way fails the run.
		lazy bool
	}{
		{name: "right after a snapshot, spare added while running", iters: 1000, delay: 10 * time.Millisecond, after: 0, late: true},
		{name: "long after a snapshot", iters: 1200, delay: 10 * time.Millisecond, after: 150},
		{name: "during heavy traffic", iters: 8000, delay: 0, after: 100},
		{name: "lazy pages", iters: 1200, delay: 10 * time.Millisecond, after: 50, lazy: true},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // each row has its own lab
			args := ringArgs(tt.iters, block, tt.delay)
			want := reference(t, 3, args)
			opts := labcluster.Options{Interval: "1h", LazyRestore: tt.lazy}
			if tt.late {
				opts.LateSpares = 1
			}
			if tt.lazy {
				args = append(args, "--ballast", "64")
			}
			c := newCluster(t, 3, 1, opts)
			rg := startHeldRing(t, c, 3, 7300+i, args)
			if tt.late {
				if st, _ := c.Client("node3").Status(context.Background()); len(st.Members) != 3 {
					t.Fatalf("the late spare is already a member: %+v", st.Members)
				}
				h, _ := c.Lab.Host("spare1")
				v, err := c.Client("node1").AddSpare(context.Background(), agent.SpareRequest{Name: "spare1", Address: netip.AddrPortFrom(h.Addr.Addr(), labcluster.AgentPort)})
				if err != nil {
					t.Fatal(err)
				}
				if sp := v.Spares(); len(sp) != 1 || sp[0].Name != "spare1" {
					t.Fatalf("spares after add: %+v", sp)
				}
			}
			rg.waitProtected(t, 2*time.Minute)
			rg.waitProgress(t, progressEvery, 2*time.Minute) // the ranks exchange: the snapshot has their connections
			before0, before2 := rg.job(t, "node1", 0), rg.job(t, "node3", 2)
			rg.checkpoint(t, "node2")
			rg.waitProgress(t, tt.after, 2*time.Minute)
			if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
				t.Fatal(err)
			}
			t.Logf("node2 power-cut with rank 1 at iteration %d", rg.progress(1))
			f := waitFailure(t, c, "node2", 5*time.Minute)
			requireStages(t, f)
			if f.Target != "spare1" || f.Basic {
				t.Errorf("restored on %s (basic %v), want spare1", f.Target, f.Basic)
			}
			requireRoutesPutBack(t, c, "spare1")
			outs := rg.wait(t, 2*time.Minute)
			checkRanks(t, outs, want)
			// The survivors never stopped: same process, never restored.
			for r, b := range map[int]agent.Job{0: before0, 2: before2} {
				after := rg.job(t, fmt.Sprintf("node%d", r+1), r)
				if after.PID != b.PID || after.Restored != "" {
					t.Errorf("rank %d was disturbed: pid %d -> %d, restored from %q", r, b.PID, after.PID, after.Restored)
				}
			}
			if j := rg.job(t, "spare1", 1); j.Node != "spare1" || j.Restored == "" || j.LazyWork != "" {
				t.Errorf("rank 1 on spare1: %+v, want it restored, every page in", j)
			}
			if b, err := os.ReadFile(c.LogPath("spare1")); tt.lazy && (err != nil || !strings.Contains(string(b), "lazy_pages=true")) {
				t.Errorf("spare1 did not restore rank 1 with lazy pages (%v)", err)
			}
			if tt.delay == 0 {
				requireLiftedACKs(t, c)
			}
			// node2's protector (node3) holds the replica: spare1 fetched it while node3 waited for node2's
			// fence, so the recovery found it there.
			if b, err := os.ReadFile(c.LogPath("spare1")); err != nil || !strings.Contains(string(b), "snapshots prefetched while the failed node is fenced") {
				t.Errorf("spare1 did not prefetch rank 1's snapshot during the fence wait (%v)", err)
			}
		})
	}
}

// TestNoSnapshotDuringReplay: while a recovery replays its peers' bytes into a restored rank, a snapshot of
// the rank asked for on its new host is refused (409, "replaying"), nothing else dumps it, and the recovery
// completes with the failure-free output. CI, 2026-11-27: a snapshot taken one second after a restore (for
// the connections its old replica lacked) locked the rank's connections while its receive order was being
// replayed; CRIU's lock dropped the replay's segments (EPERM) and the recovery killed the rank.
func TestNoSnapshotDuringReplay(t *testing.T) {
	t.Parallel()
	const after, delay = 150, 10 * time.Millisecond
	args := ringArgs(1200, 64<<10, delay)
	want := reference(t, 3, args)
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	rg := startHeldRing(t, c, 3, 7390, args)
	rg.waitProtected(t, 2*time.Minute)
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	rg.checkpoint(t, "node2")
	rg.waitProgress(t, after, 2*time.Minute)
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	// The replay cannot end before rank 1 has re-executed the iterations since its snapshot, each with its
	// delay: at least after*delay (1.5 s) from the restore.
	id := rg.jobs[1].ID
	restored := func() bool { // on whichever member coordinates the recovery
		if f := failureOf(t, c, "node2"); f != nil {
			for _, s := range f.Stages {
				if s.Name == agent.StageRestored && s.Job == id && s.Error == "" {
					return true
				}
			}
		}
		return false
	}
	for deadline := time.Now().Add(5 * time.Minute); !restored(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("rank 1 not restored within 5 minutes")
		}
	}
	asked := time.Now()
	reply, err := c.Client("spare1").Checkpoint(context.Background(), id)
	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	var replayed time.Time
	for _, s := range f.Stages {
		if s.Name == agent.StageReplayed && s.Job == id {
			replayed = s.End
		}
	}
	t.Logf("snapshot of rank 1 asked for on spare1 during its replay: %v", err)
	if err == nil || !strings.Contains(err.Error(), "replaying") {
		// Refused unless the replay was over when it was asked for (a starved test process).
		if replayed.IsZero() || asked.Before(replayed) {
			t.Errorf("snapshot of rank 1 asked for during its replay (asked %s, replay done %s): %+v, %v; want it refused as replaying",
				asked.Format(time.StampMilli), replayed.Format(time.StampMilli), reply, err)
		}
	}
	outs := rg.wait(t, 2*time.Minute)
	checkRanks(t, outs, want)
	// Nothing dumped rank 1 on spare1 before its replay was verified: its first snapshot there is the
	// re-protection's.
	ms, err := c.Client("spare1").Snapshots(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if strings.Contains(m.ID, "-spare1-") && m.Created.Before(replayed) {
			t.Errorf("snapshot %s of rank 1 on spare1 begun %s, before its replay was done (%s)", m.ID, m.Created.Format(time.StampMilli), replayed.Format(time.StampMilli))
		}
	}
}

// crashAfterSnapshot snapshots host, lets the ranks do after more iterations, crashes host and requires a
// complete recovery on target (in basic mode or not).
func (rg *ring) crashAfterSnapshot(t *testing.T, host string, after int, target string, basic bool) {
	t.Helper()
	rg.checkpoint(t, host)
	rg.waitProgress(t, after, 2*time.Minute)
	if err := rg.c.Lab.Crash(context.Background(), host); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, rg.c, host, 5*time.Minute)
	requireStages(t, f)
	if f.Target != target || f.Basic != basic {
		t.Fatalf("failure of %s restored on %s (basic %v), want %s (basic %v)", host, f.Target, f.Basic, target, basic)
	}
}

// TestSequentialFailures: node2 fails and its rank moves to the spare; then the spare itself (now a node
// hosting the moved rank) fails, and with no spare left its protector restores the rank itself (basic
// mode). Then a third failure of another original node, also in basic mode.
func TestSequentialFailures(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	args := ringArgs(2000, 64<<10, 10*time.Millisecond)
	want := reference(t, 4, args)
	c := newCluster(t, 4, 1, labcluster.Options{Interval: "1h"})
	rg := startHeldRing(t, c, 4, 7400, args)
	rg.waitProtected(t, 2*time.Minute)
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	rg.crashAfterSnapshot(t, "node2", 80, "spare1", false)
	// spare1 is now a node of the ring in node2's place; its snapshot of the moved rank goes to node3.
	// The ranks compute again after the recovery (the restored rank re-protected) before the next failure.
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	rg.crashAfterSnapshot(t, "spare1", 80, "node3", true)
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	rg.crashAfterSnapshot(t, "node4", 40, "node1", true)
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	if b, err := os.ReadFile(filepath.Join(rg.jobDir, rg.jobs[1].ID, "exit")); err == nil && !strings.Contains(string(b), "node3") {
		t.Errorf("rank 1 should have finished on node3: %s", b)
	}
}
