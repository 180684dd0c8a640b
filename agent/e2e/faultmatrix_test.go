package e2e

// The fault matrix of issue 10: one end-to-end test per fault, each ending with the failure-free result or a
// clear, named refusal; never a hang, never a silent wrong result, and nothing left behind. Every test runs
// the ringstencil ring of failover_test.go (rank r on node r+1, a final checksum over every byte exchanged),
// injects its fault at a condition it waits for (a replicated snapshot, a dump or a receive in flight, a
// stage of the recovery timeline), and bounds every wait. Run them one at a time
// (`go test -count=1 -p 1 -run 'TestFaultX' -v ./agent/e2e/`): each stays under go test's default 10-minute
// timeout even when it fails at its longest bound, so that its cleanups always run.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/shim"
)

// startMatrix runs the failure-free reference of ref, then starts 3 ranks of ref plus extra (flags that do
// not change the checksum: --ballast, --progress) on node1..node3 of a lab with the given spares and
// waits until every rank reports progress. prepare, if set, runs on the lab before the agents start.
//
// The run is held 100 iterations before its end (startHeldRing; CI: rank 1 of TestFaultCrashDuringSnapshot
// ended while the test's first snapshot of it was still being shipped, and a fault injected after the end
// tests nothing).
func startMatrix(t *testing.T, spares, port int, ref []string, prepare func(*lab.Lab), extra ...string) (*labcluster.Cluster, *ring, string) {
	t.Helper()
	want := reference(t, 3, ref)
	l := newLab(t, 3, spares, false)
	if prepare != nil {
		prepare(l)
	}
	c := startCluster(t, l, labcluster.Options{Interval: "1h"})
	logEventsOnFailure(t, c)
	rg := startHeldRing(t, c, 3, port, append(append([]string{}, ref...), extra...))
	for r := range rg.jobs {
		rg.waitIteration(t, r, 1, 2*time.Minute)
	}
	return c, rg, want
}

// flagInt is the value of the last flag name in args.
func flagInt(t *testing.T, args []string, name string) int {
	t.Helper()
	for i := len(args) - 2; i >= 0; i-- {
		if args[i] == name {
			n, err := strconv.Atoi(args[i+1])
			if err != nil {
				t.Fatalf("%s %q: %v", name, args[i+1], err)
			}
			return n
		}
	}
	t.Fatalf("no %s in %q", name, args)
	return 0
}

// lastIteration is the last iteration rank r reported on its stdout (ringstencil --progress), 0 before any.
func (rg *ring) lastIteration(r int) int {
	b, _ := os.ReadFile(rg.jobs[r].StdoutPath())
	lines := strings.Split(string(b), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if f := strings.Fields(lines[i]); len(f) == 4 && f[2] == "iteration" {
			if n, err := strconv.Atoi(f[3]); err == nil {
				return n
			}
		}
	}
	return 0
}

// waitIteration waits until rank r has reported iteration n, or the iteration its gate holds it at.
func (rg *ring) waitIteration(t *testing.T, r, n int, timeout time.Duration) {
	t.Helper()
	if rg.heldAt > 0 && n > rg.heldAt {
		n = rg.heldAt
	}
	for deadline := time.Now().Add(timeout); rg.lastIteration(r) < n; time.Sleep(20 * time.Millisecond) {
		if _, err := shim.ReadExit(rg.jobs[r].ExitPath()); err == nil {
			t.Fatalf("rank %d ended before iteration %d: make the run longer", r, n)
		}
		if time.Now().After(deadline) {
			t.Fatalf("rank %d did not reach iteration %d within %s (at %d)", r, n, timeout, rg.lastIteration(r))
		}
	}
}

// requireRunning fails the test if a rank has already ended: a fault injected then would test nothing.
func (rg *ring) requireRunning(t *testing.T) {
	t.Helper()
	for r, j := range rg.jobs {
		if st, err := shim.ReadExit(j.ExitPath()); err == nil {
			t.Fatalf("rank %d ended (%+v) before the fault was injected: make the run longer", r, st)
		}
	}
}

// storeDir is where host's agent keeps the snapshots of job: its own and the replicas it holds.
func storeDir(c *labcluster.Cluster, host, job string) string {
	return filepath.Join(labcluster.StateDir(c.Lab.State().ID, host), "snapshots", job)
}

// pendingBytes sums the files in the unfinished (.tmp-*) snapshot directories of dir: a dump or a receive in
// flight. found is false when there is none.
func pendingBytes(dir string) (found bool, n int64) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), ".tmp-") {
			continue
		}
		found = true
		filepath.WalkDir(filepath.Join(dir, e.Name()), func(_ string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				if info, err := d.Info(); err == nil {
					n += info.Size()
				}
			}
			return nil
		})
	}
	return found, n
}

// storeBusy reports whether the snapshot store at dir holds an unfinished snapshot of any job.
func storeBusy(dir string) bool {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if found, _ := pendingBytes(filepath.Join(dir, e.Name())); found {
			return true
		}
	}
	return false
}

// waitPending waits until host's store holds an unfinished snapshot of job with at least min bytes written,
// and returns how many.
func waitPending(t *testing.T, c *labcluster.Cluster, host, job string, min int64, timeout time.Duration) int64 {
	t.Helper()
	dir := storeDir(c, host, job)
	for deadline := time.Now().Add(timeout); ; time.Sleep(5 * time.Millisecond) {
		if found, n := pendingBytes(dir); found && n >= min {
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot of %s with %d bytes in flight in %s within %s", job, min, dir, timeout)
		}
	}
}

// holdDump stops (SIGSTOP) the CRIU process that writes an unfinished snapshot into dir, so that the snapshot
// cannot complete however long the test takes to power-cut the host (which SIGKILLs it). go-criu waits for
// CRIU to exit before the dump returns, so a stopped CRIU holds the snapshot even if it has written every
// image. It returns the held snapshot's id, "" when no CRIU process has a file open there: the dump ended
// first.
func holdDump(t *testing.T, dir string) string {
	t.Helper()
	procs, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); strings.TrimSpace(string(comm)) != "criu" {
			continue
		}
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		for _, fd := range fds {
			target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
			rest, ok := strings.CutPrefix(target, dir+"/.tmp-")
			if !ok {
				continue
			}
			if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
				return "" // ESRCH: it exited after the readlink
			}
			t.Logf("stopped CRIU (pid %d), which was writing %s", pid, target)
			id, _, _ := strings.Cut(rest, "/")
			return id
		}
	}
	return ""
}

// replicaIDs lists the snapshots of job taken on node that holder's agent holds, newest first.
func replicaIDs(t *testing.T, c *labcluster.Cluster, holder, job, node string) []string {
	t.Helper()
	ms, err := c.Client(holder).Snapshots(context.Background(), job)
	if err != nil {
		t.Fatalf("snapshots on %s: %v", holder, err)
	}
	var ids []string
	for _, m := range ms {
		if m.Node == node {
			ids = append(ids, m.ID)
		}
	}
	return ids
}

// verifyFiles checks every file of the snapshot in dir against its manifest (size and sha256), reading
// only, so that the agent's store is left as it is.
func verifyFiles(t *testing.T, dir string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, ckpt.ManifestName))
	if err != nil {
		t.Fatalf("manifest of %s: %v", dir, err)
	}
	m, err := ckpt.DecodeManifest(b)
	if err != nil {
		t.Fatalf("manifest of %s: %v", dir, err)
	}
	for _, f := range m.Files {
		in, err := os.Open(filepath.Join(dir, filepath.FromSlash(f.Name)))
		if err != nil {
			t.Errorf("snapshot %s: %v", m.ID, err)
			continue
		}
		h := sha256.New()
		n, err := io.Copy(h, in)
		in.Close()
		if err != nil || n != f.Size || hex.EncodeToString(h.Sum(nil)) != f.SHA256 {
			t.Errorf("snapshot %s: file %s does not verify (%d bytes, manifest %d; %v)", m.ID, f.Name, n, f.Size, err)
		}
	}
}

// waitStage waits until some live agent's timeline of a failure of node has a stage called stage (on host,
// if not empty) and returns that failure.
func waitStage(t *testing.T, c *labcluster.Cluster, node, stage, host string, timeout time.Duration) *agent.Failure {
	t.Helper()
	clients := map[string]*agentapi.Client{}
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		for _, h := range c.Lab.State().Hosts {
			if h.Crashed {
				continue
			}
			if clients[h.Name] == nil {
				clients[h.Name] = c.Client(h.Name)
			}
			fs, err := clients[h.Name].Events(context.Background())
			if err != nil {
				continue
			}
			for _, f := range fs {
				if f.Node != node {
					continue
				}
				for _, s := range f.Stages {
					if s.Name == stage && (host == "" || s.Host == host) {
						return f
					}
				}
			}
		}
	}
	// The timeline first: a failed test's output is cut in the middle, after its first lines.
	if f := failureOf(t, c, node); f != nil {
		logTimeline(t, f)
	}
	t.Fatalf("no stage %q of the recovery of %s within %s", stage, node, timeout)
	return nil
}

// logEventsOnFailure logs the failure timelines (logEvents) when the test has failed, at its end.
func logEventsOnFailure(t *testing.T, c *labcluster.Cluster) {
	t.Cleanup(func() {
		if t.Failed() {
			logEvents(t, c)
		}
	})
}

// logEvents logs every failure timeline the live agents know (the newest copy of each), for a failed test.
func logEvents(t *testing.T, c *labcluster.Cluster) {
	t.Helper()
	newest := map[string]*agent.Failure{}
	var order []string
	for _, h := range c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		fs, err := c.Client(h.Name).Events(ctx)
		cancel()
		if err != nil {
			t.Logf("events of %s: %v", h.Name, err)
			continue
		}
		for _, f := range fs {
			if cur, ok := newest[f.ID]; !ok {
				order = append(order, f.ID)
				newest[f.ID] = f
			} else if f.Updated.After(cur.Updated) {
				newest[f.ID] = f
			}
		}
	}
	for _, id := range order {
		f := newest[id]
		t.Logf("timeline (done %v, as of %s):", f.Done, f.Updated.Format(time.RFC3339Nano))
		logTimeline(t, f)
	}
}

// copies counts the live copies of a job: processes running its program with its arguments on this machine
// (every lab host shares its kernel), and agents that list it as running.
func copies(t *testing.T, c *labcluster.Cluster, j agent.Job) (procs, listed int) {
	t.Helper()
	want := strings.Join(j.Spec.Argv, "\x00")
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.TrimSuffix(string(b), "\x00") == want {
			procs++
		}
	}
	for _, h := range c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		got, err := c.Client(h.Name).Job(ctx, j.ID)
		cancel()
		if err == nil && got.State == agent.JobRunning {
			listed++
		}
	}
	return procs, listed
}

// requireOneCopy checks that rank r runs exactly once (or not at all once it has exited): a recovery must
// never leave two incarnations of a rank.
func (rg *ring) requireOneCopy(t *testing.T, r int) {
	t.Helper()
	procs, listed := copies(t, rg.c, rg.jobs[r])
	if _, err := shim.ReadExit(rg.jobs[r].ExitPath()); err == nil && procs == 0 && listed <= 1 {
		return // ended already; its agent may not have noticed yet
	}
	if procs != 1 || listed != 1 {
		t.Errorf("rank %d (job %s) runs as %d process(es), listed as running by %d agent(s); want exactly one", r, rg.jobs[r].ID, procs, listed)
		return
	}
	requireOwnCgroup(t, rg.c, rg.jobs[r].ID)
}

// requireOwnCgroup checks that the running copy of job id is in the cgroup its host's agent made for it,
// wherever the snapshot it was restored from was taken (each lab host has a cgroup tree of its own). It
// reports whether a host runs the job (one that ended meanwhile is not checked).
func requireOwnCgroup(t *testing.T, c *labcluster.Cluster, id string) (running bool) {
	t.Helper()
	for _, h := range c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		j, err := c.Client(h.Name).Job(ctx, id)
		cancel()
		if err != nil || j.State != agent.JobRunning {
			continue
		}
		running = true
		want := c.JobCgroup(h.Name, id)
		got, err := cgroupv2.ProcessDir(j.PID)
		if err != nil {
			t.Errorf("job %s on %s (pid %d): %v", id, h.Name, j.PID, err)
			continue
		}
		t.Logf("job %s on %s (pid %d) runs in cgroup %s", id, h.Name, j.PID, got)
		if got != want || j.Cgroup != want {
			t.Errorf("job %s on %s (pid %d) runs in cgroup %q, its record says %q; want %s's own %q", id, h.Name, j.PID, got, j.Cgroup, h.Name, want)
		}
	}
	return running
}

// requireNothingLeft checks, once every rank has exited, that no process of any rank survives, no agent
// still lists one as running, no job cgroup is left, and no live host keeps a CRIU network guard table.
// The lab's teardown removes the namespaces and checks that itself.
func (rg *ring) requireNothingLeft(t *testing.T) {
	t.Helper()
	for r, j := range rg.jobs {
		var procs, listed int
		var left []string // the job's cgroups on the hosts that ran it
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			procs, listed = copies(t, rg.c, j)
			left = nil
			for _, h := range rg.c.Lab.State().Hosts {
				if h.Crashed {
					continue // a power-cut machine's cgroups go with it (the lab's teardown removes them)
				}
				cg := rg.c.JobCgroup(h.Name, j.ID)
				if _, err := os.Stat(cg); !errors.Is(err, fs.ErrNotExist) {
					left = append(left, cg)
				}
			}
			if (procs == 0 && listed == 0 && len(left) == 0) || time.Now().After(deadline) {
				break
			}
		}
		if procs != 0 || listed != 0 {
			t.Errorf("rank %d (job %s) ended, but %d process(es) of it survive and %d agent(s) list it as running", r, j.ID, procs, listed)
		}
		if len(left) > 0 {
			t.Errorf("rank %d's cgroups %v are left behind", r, left)
		}
	}
	nft, err := exec.LookPath("nft")
	if err != nil {
		t.Logf("nft is not installed: guard tables not checked")
		return
	}
	for _, h := range rg.c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		var out []byte
		err := rg.c.Lab.Do(h.Name, func() error {
			var err error
			out, err = exec.Command(nft, "list", "tables").CombinedOutput()
			return err
		})
		if err != nil {
			t.Errorf("nft list tables on %s: %v: %s", h.Name, err, out)
		} else if strings.Contains(string(out), "CRIU-") {
			t.Errorf("%s keeps a CRIU guard table after the run:\n%s", h.Name, out)
		}
	}
}

// waitRanks waits up to timeout for every rank's exit record and returns the outputs of those that ended.
func (rg *ring) waitRanks(timeout time.Duration) (outs []string, ended []bool) {
	rg.open()
	outs, ended = make([]string, len(rg.jobs)), make([]bool, len(rg.jobs))
	deadline := time.Now().Add(timeout)
	for r, j := range rg.jobs {
		for {
			if _, err := shim.ReadExit(j.ExitPath()); err == nil {
				b, _ := os.ReadFile(j.StdoutPath())
				outs[r], ended[r] = string(b), true
				break
			}
			if time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return outs, ended
}

// crash power-cuts host and logs when.
func crash(t *testing.T, c *labcluster.Cluster, host, why string) {
	t.Helper()
	if err := c.Lab.Crash(context.Background(), host); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s power-cut %s", host, why)
}

// Row 1: node2 is power-cut while a dump of its rank is in flight; its previous snapshot was replicated on
// node3. The recovery restores that previous replica on the spare, the unfinished dump never becomes a
// replica, and the result is the failure-free one.
func TestFaultCrashDuringSnapshot(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	ref := ringArgs(2500, 64<<10, 10*time.Millisecond)
	// 256 MiB of ballast: the dump writes for long enough to be caught in flight.
	c, rg, want := startMatrix(t, 1, 7700, ref, nil, "--progress", "10", "--ballast", "256")
	job := rg.jobs[1].ID
	rg.checkpoint(t, "node2")
	if len(replicaIDs(t, c, "node3", job, "node2")) == 0 {
		t.Fatalf("node3 holds no replica of rank 1, want the one just shipped")
	}
	rg.waitIteration(t, 1, rg.lastIteration(1)+50, 2*time.Minute) // bytes past the snapshot for the replay
	held, n := holdCheckpoint(t, c, "node2", job)
	// Read while the dump is in flight, which keeps any other snapshot of node2 from starting. An earlier one
	// may still be on its way to node3 (the agent takes snapshots of its own, for connections its start
	// snapshot lacked or when a peer's log fills; shipping holds no lock): its bytes can all be in flight
	// when the power goes, and node3 then commits it (ci95). The recovery must use the newest complete
	// replica node3 has when it chooses: prev[0] or newer, never the dump cut short.
	prev := replicaIDs(t, c, "node3", job, "node2")
	rg.requireRunning(t)
	crash(t, c, "node2", fmt.Sprintf("with a dump of rank 1 in flight (%d MB written)", n>>20))

	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	if f.Target != "spare1" || f.Basic {
		t.Errorf("restored on %s (basic %v), want spare1", f.Target, f.Basic)
	}
	ids := replicaIDs(t, c, "node3", job, "node2")
	if slices.Contains(ids, held) {
		t.Errorf("node3 holds the dump cut short, %s, among its replicas %v of rank 1 from node2", held, ids)
	}
	// Snapshot ids start with their time: a later one sorts after.
	if j := rg.job(t, "spare1", 1); j.Restored == held || !slices.Contains(ids, j.Restored) || j.Restored < prev[0] {
		t.Errorf("rank 1 restored from %q, want a replica node3 holds (%v), %s or newer, not the dump cut short %s", j.Restored, ids, prev[0], held)
	}
	rg.requireOneCopy(t, 1)
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	rg.requireNothingLeft(t)
}

// holdCheckpoint starts a checkpoint of job on host and stops its dump where it is once it has written some
// bytes; it returns the held snapshot's id and the bytes written. A dump of 256 MiB takes well under a
// second, less than the calls after it may take on a loaded machine (ci: it ended and became a replica
// before the power cut). A dump that ends before the stop lands is a replica like any other: once it is
// shipped, it tries again.
func holdCheckpoint(t *testing.T, c *labcluster.Cluster, host, job string) (string, int64) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		done := make(chan struct{})
		go func() { // the held one fails when the host goes; nobody waits for it
			defer close(done)
			c.Client(host).Checkpoint(context.Background(), job)
		}()
		n := waitPending(t, c, host, job, 1<<20, 2*time.Minute)
		if held := holdDump(t, storeDir(c, host, job)); held != "" {
			return held, n
		}
		if attempt == 5 {
			t.Fatalf("%d dumps of %s on %s ended before they could be stopped", attempt, job, host)
		}
		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			t.Fatalf("a checkpoint of %s on %s whose dump ended is still running after 2m", job, host)
		}
	}
}

// A node whose agent stalls in the middle of a checkpoint (its beats stop, its kernel still answers) is not
// declared failed: its protector leaves it alone for heartbeat.busy_grace, counting busy silences, and
// it is watched as before once its agent runs again. (The other half, a busy node whose host is gone, is
// declared failed like any other: TestFaultCrashDuringSnapshot, TestFaultSpareDies*.)
func TestBusyAgentStallNotFailed(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	// An agent that hears from neither neighbour for fence_timeout kills its jobs (it cannot tell its own
	// stall from a partition in which it was declared failed): 3 s in the lab by default, less than the
	// scrapes below may take on a loaded machine.
	c := newCluster(t, 3, 0, labcluster.Options{Interval: "1h", MetricsListen: metricsAddr, FenceTimeout: time.Minute})
	rg := startRing(t, c, 3, 7733, append(ringArgs(1_000_000, 64<<10, 10*time.Millisecond), "--progress", "10", "--ballast", "256"))
	for r := range rg.jobs {
		rg.waitIteration(t, r, 1, 2*time.Minute)
	}
	rg.checkpoint(t, "node2")
	held, n := holdCheckpoint(t, c, "node2", rg.jobs[1].ID)
	t.Logf("dump %s of rank 1 held on node2 (%d MB written): node2's agent is busy checkpointing", held, n>>20)
	// node3 watches node2: the agent's beat saying so must have arrived before the agent stalls.
	pollMetrics(t, c, "node3", "node3 hears that node2 checkpoints", time.Minute, func(m map[string]float64) bool {
		return m[`ftkit_predecessor_busy{node="node2"}`] == 1
	})
	resume := stopAgent(t, c, "node2")
	// Two silences of a timeout each, each with node2's host answering; no suspicion meanwhile. (Nothing
	// here asks node2's agent anything while it is stopped: the call would wait for it.)
	m := pollMetrics(t, c, "node3", "node3 counts node2's silences as busy ones", 2*time.Minute, func(m map[string]float64) bool {
		requireNoDeclaration(t, m, "node3", "node2's agent stalled in a checkpoint")
		return m["ftkit_busy_silences_total"] >= 2
	})
	t.Logf("node2's agent silent for %.1f s: node3 counted %v busy silences and %v suspicions", m[`ftkit_predecessor_heartbeat_age_seconds{node="node2"}`],
		m["ftkit_busy_silences_total"], m[`ftkit_suspicions_total{outcome="cleared"}`]+m[`ftkit_suspicions_total{outcome="confirmed"}`])
	resume()
	pollMetrics(t, c, "node3", "node2's beats resume", time.Minute, func(m map[string]float64) bool {
		age, ok := m[`ftkit_predecessor_heartbeat_age_seconds{node="node2"}`]
		return ok && age < 1 // the lab's heartbeat.timeout: the beats come again
	})
	if m := scrape(t, c, "node3"); m[`ftkit_suspicions_total{outcome="confirmed"}`] != 0 || failureOf(t, c, "node2") != nil {
		t.Fatalf("node2 declared failed after its agent ran again:\n%s", ftkitSamples(m))
	}
}

// Row 2: node1 ships a large snapshot to its protector node2, which is power-cut mid-transfer. node1's
// shipping must end (the next node of the ring takes the replica, or the snapshot is reported unreplicated),
// node2's own rank is recovered by node3 (node2's protector), and every rank's result is identical.
func TestFaultProtectorCrashWhileReceiving(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	ref := ringArgs(3000, 64<<10, 10*time.Millisecond)
	// 256 MiB of incompressible ballast: the power cut follows the first 16 MB received within
	// milliseconds, and the rest takes the transfer most of a second at least (on a loaded machine, longer
	// than the run: gated, the run waits for the fault). Every rank carries it: 512 MiB made the recovery
	// of node2's rank alone take a minute (ci90).
	c, rg, want := startMatrix(t, 1, 7710, ref, nil, "--progress", "10", "--ballast", "256")
	rg.checkpoint(t, "node2") // node2's rank is recoverable from node3
	type shipResult struct {
		reply agentapi.CheckpointReply
		err   error
		at    time.Time
	}
	shipped := make(chan shipResult, 1)
	go func() {
		reply, err := c.Client("node1").Checkpoint(context.Background(), rg.jobs[0].ID)
		shipped <- shipResult{reply, err, time.Now()}
	}()
	n := waitPending(t, c, "node2", rg.jobs[0].ID, 16<<20, 3*time.Minute)
	rg.requireRunning(t)
	crashed := time.Now()
	crash(t, c, "node2", fmt.Sprintf("while receiving rank 0's snapshot from node1 (%d MB written)", n>>20))

	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	if f.Protector != "node3" || f.Target != "spare1" || f.Basic {
		t.Errorf("node2's failure handled by %s, restored on %s (basic %v); want node3 restoring on spare1", f.Protector, f.Target, f.Basic)
	}
	rg.requireOneCopy(t, 1)

	// Bounded by the shipping protocol's own deadlines: a sender that never gives up on a dead protector
	// shows up here.
	var res shipResult
	select {
	case res = <-shipped:
	case <-time.After(4*time.Minute - time.Since(crashed)):
		t.Fatalf("node1 is still shipping to the power-cut node2 %s after the crash", time.Since(crashed).Round(time.Second))
	}
	t.Logf("node1's shipping ended %s after node2's crash", res.at.Sub(crashed).Round(time.Millisecond))
	if res.err != nil || len(res.reply.Results) != 1 {
		t.Fatalf("checkpoint on node1: %+v, %v", res.reply, res.err)
	}
	sr := res.reply.Results[0]
	if sr.Shipped {
		holders := sr.Manifest.Replicas
		t.Logf("snapshot %s replicated on %v instead", sr.Manifest.ID, holders)
		if len(holders) == 0 || slices.Contains(holders, "node2") {
			t.Errorf("snapshot %s shipped, replicas %v: want a live node of the ring, not node2", sr.Manifest.ID, holders)
		}
		for _, h := range holders {
			if h != "node2" && !slices.Contains(replicaIDs(t, c, h, rg.jobs[0].ID, "node1"), sr.Manifest.ID) {
				t.Errorf("%s is recorded as a replica holder of %s but does not list it", h, sr.Manifest.ID)
			}
		}
	} else {
		t.Logf("snapshot %s reported unreplicated: %s", sr.Manifest.ID, sr.ShipErr)
		if !strings.Contains(sr.ShipErr, "node2") {
			t.Errorf("the shipping error %q does not name the protector that failed", sr.ShipErr)
		}
	}
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	rg.requireNothingLeft(t)
}

// Row 3: node2 crashes, spare1 restores its rank, and spare1's agent is SIGKILLed while the restored rank
// re-sends what its peers already had. The rank runs under its shim and keeps running; the restarted agent
// adopts it (one copy, never two); the run ends with the failure-free result, or the failure, naming the
// job, is in the timeline; it never hangs. The routes the killed agent raised for the restore are put
// back by the restarted one.
func TestFaultAgentKilledDuringReplay(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	const block = 64 << 10
	ref := ringArgs(6000, block, 0)
	c, rg, want := startMatrix(t, 1, 7720, ref, nil, "--progress", "50")
	rg.checkpoint(t, "node2")
	// A re-sent gap of twice the largest receive window a peer can offer, per connection: the replay lasts
	// long enough to be interrupted, and cannot complete on the window it had when its agent died.
	rg.waitIteration(t, 0, rg.lastIteration(0)+2*tcpRmemMax(t)/block, 2*time.Minute)
	rg.requireRunning(t)
	crash(t, c, "node2", "a while after its snapshot")

	waitStage(t, c, "node2", agent.StageRestored, "spare1", 3*time.Minute)
	j := rg.job(t, "spare1", 1)
	if err := c.KillAgent("spare1"); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	t.Logf("spare1's agent SIGKILLed during the replay of rank 1 (pid %d)", j.PID)
	if unix.Kill(j.PID, 0) != nil {
		t.Errorf("restored rank 1 (pid %d) died with its agent; it must run on under its shim", j.PID)
	}
	if err := c.StartAgent(context.Background(), "spare1"); err != nil {
		t.Fatal(err)
	}
	if got := rg.job(t, "spare1", 1); got.PID != j.PID || (got.State != agent.JobRunning && got.Exit == nil) {
		t.Errorf("after its restart spare1's agent has rank 1 as %+v; want pid %d adopted", got, j.PID)
	}
	rg.requireOneCopy(t, 1)

	f := waitFailure(t, c, "node2", 5*time.Minute)
	logTimeline(t, f)
	// The killed agent had raised spare1's initial windows for the restore; the restarted one put them back
	// (before, they stayed raised for good).
	requireRoutesPutBack(t, c, "spare1")
	for _, s := range f.Stages {
		if s.Name == agent.StageReplayed && s.End.Before(killed) {
			t.Fatalf("the replay ended at %s, before the agent was killed: the fault missed the replay (make the re-sent gap larger)", s.End.Format(time.RFC3339Nano))
		}
	}
	outs, ended := rg.waitRanks(3 * time.Minute)
	identical := true
	for r := range rg.jobs {
		st, _ := shim.ReadExit(rg.jobs[r].ExitPath())
		switch {
		case !ended[r] && r == 1 && rg.job(t, "spare1", 1).State == agent.JobLost:
			// Killed without an exit record: spare1 fenced itself (ci235: the host starved its agent 3.2 s
			// after the restart, longer than fence_timeout), or its shim died with it. Not a hang.
			t.Logf("rank 1 was killed on spare1 without an exit record (recovery error %q); output %q", f.Error, tail(outs[r]))
			identical = false
		case !ended[r]:
			t.Errorf("rank %d hangs: no exit within 3m of the recovery's end (recovery error %q); output %q", r, f.Error, tail(outs[r]))
			identical = false
		case st.Code != 0:
			e, _ := os.ReadFile(rg.jobs[r].StderrPath())
			t.Logf("rank %d exited %d (%s) on %s: %s", r, st.Code, st.Signal, st.Node, tail(string(e)))
			identical = false
		default:
			if got := checksumOf(t, outs[r]); got != want {
				t.Logf("rank %d checksum %s, failure-free run %s", r, got, want)
				identical = false
			}
		}
	}
	switch {
	case identical:
		t.Logf("every rank ended with the failure-free checksum (recovery error: %q)", f.Error)
		rg.requireNothingLeft(t)
	case !strings.Contains(f.Error, rg.jobs[1].ID):
		t.Errorf("the run did not end with the failure-free result, and the recovery of node2 does not name the failure of rank 1 (job %s): error %q", rg.jobs[1].ID, f.Error)
	default:
		t.Logf("the run did not end with the failure-free result; the failure is named: %s", f.Error)
	}
}

// tcpRmemMax is the largest receive buffer TCP autotuning gives a socket (net.ipv4.tcp_rmem's maximum),
// which bounds the window a peer advertises.
func tcpRmemMax(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_rmem")
	f := strings.Fields(string(b))
	if err != nil || len(f) != 3 {
		t.Fatalf("read net.ipv4.tcp_rmem: %q, %v", b, err)
	}
	n, err := strconv.Atoi(f[2])
	if err != nil {
		t.Fatalf("net.ipv4.tcp_rmem %q: %v", b, err)
	}
	return n
}

// Row 4: node2 crashes and spare1, claimed for it, is power-cut in the middle of the restore. The recovery
// of node2 must end within seconds (spare1's beats said it was restoring, but its host no longer answers)
// and hand its rank over to the recovery of spare1's failure, which restores it on spare2 from node2's
// replica with the failure-free result: never a hang, never two copies of the rank.
func TestFaultSpareDiesAfterFetch(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	testSpareDiesWhileRestoring(t, agent.StageFetched, 7730)
}

// Row 4, later: spare1 is power-cut once the restored rank runs there (during its replay), so the rank
// dies with it and must be restored again from node2's replica.
func TestFaultSpareDiesAfterRestore(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	testSpareDiesWhileRestoring(t, agent.StageRestored, 7731)
}

func testSpareDiesWhileRestoring(t *testing.T, stage string, port int) {
	ref := ringArgs(2500, 64<<10, 10*time.Millisecond)
	// 128 MiB of ballast: fetch and restore take a while.
	c, rg, want := startMatrix(t, 2, port, ref, nil, "--progress", "10", "--ballast", "128")
	rg.checkpoint(t, "node2")
	rg.waitIteration(t, 1, rg.lastIteration(1)+50, 2*time.Minute)
	rg.requireRunning(t)
	crash(t, c, "node2", "a while after its snapshot")

	f := waitStage(t, c, "node2", stage, "", 3*time.Minute)
	first := f.Target
	if first == "" || first == f.Protector {
		t.Fatalf("recovery of node2 on %q (protector %s): want a spare", first, f.Protector)
	}
	crash(t, c, first, fmt.Sprintf("right after stage %q of node2's recovery there", stage))
	crashed := time.Now()

	// Bounded: a coordinator that waits on a dead target forever is the hang this row is about.
	f = waitFailure(t, c, "node2", 4*time.Minute)
	t.Logf("the recovery of node2 ended %s after %s's crash", f.Updated.Sub(crashed).Round(time.Millisecond), first)
	logTimeline(t, f)
	if f.TakenOver == "" || !strings.Contains(f.Error, first) {
		t.Fatalf("the recovery of node2 ended without handing rank 1 over to the recovery of %s's failure (taken over by %q): %q", first, f.TakenOver, f.Error)
	}
	id := f.TakenOver
	f = waitFinished(t, c, "failure "+id, func(f *agent.Failure) bool { return f.ID == id }, 4*time.Minute)
	t.Logf("the recovery of %s's failure, which took rank 1 over:", first)
	logTimeline(t, f)
	if f.Error != "" || f.Target == "" || f.Target == first {
		t.Fatalf("the recovery of %s's failure restored rank 1 on %q with error %q", first, f.Target, f.Error)
	}
	for _, want := range []string{agent.StageRestored, agent.StageReplayed, agent.StageProtected} {
		ok := false
		for _, s := range f.Stages {
			ok = ok || (s.Name == want && s.Host == f.Target && s.Error == "")
		}
		if !ok {
			t.Errorf("no successful stage %q on %s", want, f.Target)
		}
	}
	if j := rg.job(t, f.Target, 1); j.Node != f.Target || j.Restored == "" {
		t.Errorf("rank 1 on %s: %+v", f.Target, j)
	}
	rg.requireOneCopy(t, 1)
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	rg.requireNothingLeft(t)
}

// failureOf is the newest finished or unfinished timeline of a failure of node that a live agent knows.
func failureOf(t *testing.T, c *labcluster.Cluster, node string) *agent.Failure {
	t.Helper()
	var best *agent.Failure
	for _, h := range c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		fs, err := c.Client(h.Name).Events(context.Background())
		if err != nil {
			continue
		}
		for _, f := range fs {
			if f.Node == node && (best == nil || f.Updated.After(best.Updated)) {
				best = f
			}
		}
	}
	return best
}

// Row 5: node3, node2's protector, keeps its snapshot store on a small tmpfs. node2's next snapshot is
// bigger than the free space: the receive is refused with a clear error, no half-written replica is
// visible, the previous replica is still there and verifies, and a crash of node2 then recovers from that
// previous replica with the failure-free result.
func TestFaultProtectorDiskFull(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	ref := ringArgs(2500, 64<<10, 10*time.Millisecond)
	var store string
	prepare := func(l *lab.Lab) { store = mountStore(t, l, "node3", "1g") }
	c, rg, want := startMatrix(t, 1, 7740, ref, prepare, "--progress", "10", "--ballast", "64")
	job := rg.jobs[1].ID
	rg.checkpoint(t, "node2")
	// The agent may take a snapshot of rank 1 of its own around the test's (one whose first replica lacks
	// connections opened since is taken again at once); ci135's arrived on node3 after the list below was
	// read, and ci206's was still being dumped on node2 when node3 held the test's. Wait until node3 holds
	// node2's newest and nothing is in flight: no dump on node2, no dump or receive on node3, whose
	// unfinished bytes would count below as used space and be freed again when they end.
	var prev []string
	poll(t, 2*time.Minute, "node3 to hold node2's newest snapshot of rank 1, nothing in flight", func() bool {
		if dumping, _ := pendingBytes(storeDir(c, "node2", job)); dumping || storeBusy(store) {
			return false
		}
		local := replicaIDs(t, c, "node2", job, "node2")
		prev = replicaIDs(t, c, "node3", job, "node2")
		return len(local) > 0 && len(prev) > 0 && prev[0] == local[0]
	})
	ms, err := c.Client("node3").Snapshots(context.Background(), job)
	if err != nil || len(ms) == 0 || ms[0].ID != prev[0] {
		t.Fatalf("snapshots on node3: %v, %v; want %s first", ms, err, prev[0])
	}
	size := ms[0].TotalSize()
	// Leave half a snapshot of free space: the next replica cannot fit next to the previous one. The used
	// space is read while nothing is in flight on node3 (a snapshot of its own job may begin at any time).
	var used int64
	poll(t, 2*time.Minute, "node3's used space, read with no snapshot in flight", func() bool {
		if storeBusy(store) {
			return false
		}
		var st unix.Statfs_t
		if err := unix.Statfs(store, &st); err != nil {
			t.Fatal(err)
		}
		used = int64(st.Blocks-st.Bfree) * st.Bsize
		return !storeBusy(store)
	})
	remount := func(bytes int64) {
		t.Helper()
		if err := unix.Mount("ftkit-test", store, "tmpfs", unix.MS_REMOUNT, fmt.Sprintf("size=%d,mode=0700", bytes)); err != nil {
			t.Fatalf("resize the tmpfs on %s to %d bytes: %v", store, bytes, err)
		}
	}
	remount(used + size/2)
	t.Logf("node3's store: %d MB used, %d MB free; a snapshot of rank 1 is %d MB", used>>20, (size/2)>>20, size>>20)

	rg.waitIteration(t, 1, rg.lastIteration(1)+50, 2*time.Minute)
	reply, err := c.Client("node2").Checkpoint(context.Background(), job)
	if err != nil || len(reply.Results) != 1 {
		t.Fatalf("checkpoint on node2: %+v, %v", reply, err)
	}
	sr := reply.Results[0]
	t.Logf("snapshot %s: shipped %v, error %q", sr.Manifest.ID, sr.Shipped, sr.ShipErr)
	if sr.Shipped {
		t.Fatalf("snapshot %s of %d MB was accepted by node3 with %d MB free", sr.Manifest.ID, sr.Manifest.TotalSize()>>20, (size/2)>>20)
	}
	if !strings.Contains(sr.ShipErr, "no space left on device") || !strings.Contains(sr.ShipErr, "node3") {
		t.Errorf("the refusal %q does not say that node3 has no space left", sr.ShipErr)
	}
	if ids := replicaIDs(t, c, "node3", job, "node2"); len(ids) != len(prev) || ids[0] != prev[0] {
		t.Errorf("node3 lists replicas %v after the refused receive, want %v", ids, prev)
	}
	if found, n := pendingBytes(storeDir(c, "node3", job)); found {
		t.Errorf("node3 keeps a half-written replica of rank 1 (%d bytes) after the refused receive", n)
	}
	verifyFiles(t, filepath.Join(storeDir(c, "node3", job), prev[0]))

	// Room again for the re-protection after the recovery (the restored rank's snapshot also goes to node3):
	// this row is about the refused receive and the recovery from the previous replica.
	remount(1 << 30)
	rg.requireRunning(t)
	crash(t, c, "node2", "after its protector refused its snapshot")
	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	if j := rg.job(t, f.Target, 1); j.Restored != prev[0] {
		t.Errorf("rank 1 restored from %q, want the previous replica %s", j.Restored, prev[0])
	}
	rg.requireOneCopy(t, 1)
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	rg.requireNothingLeft(t)
}

// Row 6: bytes of an image file of the newest replica flip on its holder. A crash of its node then restores
// the next older replica that verifies (still recoverable: the peers keep the log data it needs) with the
// failure-free result, and the timeline or the holder's log names the corrupt snapshot.
func TestFaultCorruptNewestReplica(t *testing.T) {
	t.Parallel() // each row has its own lab (labSlots)
	ref := ringArgs(2500, 64<<10, 10*time.Millisecond)
	c, rg, want := startMatrix(t, 1, 7750, ref, nil, "--progress", "10")
	job := rg.jobs[1].ID
	for range 2 {
		rg.waitIteration(t, 1, rg.lastIteration(1)+50, 2*time.Minute)
		rg.checkpoint(t, "node2")
	}
	ids := replicaIDs(t, c, "node3", job, "node2")
	if len(ids) < 2 {
		t.Fatalf("node3 holds replicas %v of rank 1, want two", ids)
	}
	newest, older := ids[0], ids[1]
	pages, _ := filepath.Glob(filepath.Join(storeDir(c, "node3", job), newest, "images", "pages-*.img"))
	if len(pages) == 0 {
		t.Fatalf("no pages image in replica %s on node3", newest)
	}
	flipBytes(t, pages[0])
	rg.waitIteration(t, 1, rg.lastIteration(1)+50, 2*time.Minute)
	rg.requireRunning(t)
	crash(t, c, "node2", fmt.Sprintf("with its newest replica %s corrupt on node3", newest))

	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	if j := rg.job(t, f.Target, 1); j.Restored != older {
		t.Errorf("rank 1 restored from %q, want the next older verified replica %s", j.Restored, older)
	}
	named := false
	for _, s := range f.Stages {
		named = named || strings.Contains(s.Detail+s.Error, newest)
	}
	if log, err := os.ReadFile(c.LogPath(f.Protector)); err == nil {
		for _, line := range strings.Split(string(log), "\n") {
			named = named || (strings.Contains(line, newest) && strings.Contains(line, "verification"))
		}
	}
	if !named {
		t.Errorf("neither the timeline nor %s's log names the corrupt replica %s", f.Protector, newest)
	}
	rg.requireOneCopy(t, 1)
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	rg.requireNothingLeft(t)
}

// flipBytes inverts 16 bytes in the middle of a file, as bit rot on the replica holder's disk would.
func flipBytes(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Size() < 32 {
		t.Fatalf("%s: %v, %d bytes", path, err, st.Size())
	}
	b := make([]byte, 16)
	off := st.Size() / 2
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	for i := range b {
		b[i] ^= 0xff
	}
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}
