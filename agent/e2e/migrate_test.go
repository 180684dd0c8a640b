package e2e

import (
	"context"
	"fmt"
	"hash/fnv"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestMigrate: rank 1 of a two-rank ringstencil, on a job address of its own, is moved by the operator
// from node2 to node3 and back while it exchanges with rank 0 on node1, which never stops. Each move
// freezes and dumps the rank, kills it without a reset reaching rank 0 and restores it on the target with
// what rank 0 sent meanwhile replayed; the run's checksum equals the failure-free one. The source keeps
// no copy, no exit record and no job network; the move is in the event log; a job on its host's address
// is refused and runs on. Then two moves fail: to node4, whose snapshot store is full, at the transfer of
// the dump (rank 1 is thawed and runs on where it was, the same process); to node3, whose restore fails
// after rank 1 left node2 (node2 restores it again from the snapshot it left with). The run still ends
// with the failure-free checksum.
func TestMigrate(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const port = 7470
	args := ringArgs(1500, 16<<10, 10*time.Millisecond)
	ctx := context.Background()
	want := reference(t, 2, args)
	l := newLab(t, 4, 0, false)
	store := mountStore(t, l, "node4", "1g") // to be filled later
	c := startCluster(t, l, labcluster.Options{Interval: "1h", JobAddresses: true})
	rg := startJobAddrRing(t, c, port, args, "")
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	before0 := rg.job(t, "node1", 0)

	// A job on its host's address cannot move: refused before anything stops, and it runs on.
	other, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: "other", Argv: []string{"/bin/sleep", "600"}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Client("node1").Migrate(ctx, agent.MigrateRequest{Job: other.ID, To: "node3"})
	if err == nil || !strings.Contains(err.Error(), agent.ErrNotMovable.Error()) || !strings.Contains(err.Error(), "host address") {
		t.Errorf("migrating a job without a job address: %v, want a refusal naming the host address", err)
	}
	if j, err := c.Client("node1").Job(ctx, other.ID); err != nil || j.State != agent.JobRunning || j.PID != other.PID {
		t.Errorf("the refused job after the refusal: %+v %v, want it running as before", j, err)
	}
	if err := c.Client("node1").Signal(ctx, other.ID, 9); err != nil {
		t.Fatal(err)
	}

	from := "node2"
	for _, to := range []string{"node3", "node2"} {
		old := rg.job(t, from, 1)
		m, err := c.Client(from).Migrate(ctx, agent.MigrateRequest{Job: old.ID, To: to})
		if err != nil {
			t.Fatalf("migrate rank 1 from %s to %s: %v", from, to, err)
		}
		t.Logf("rank 1 %s -> %s: snapshot %s, running after %s, replay done after %s", from, to, m.Snapshot, m.Frozen, m.Replayed)
		if m.To != to || m.Error != "" || m.Frozen <= 0 || m.Replayed < m.Frozen {
			t.Fatalf("migration %+v, want rank 1 on %s with its restore and replay times", m, to)
		}
		moved := rg.job(t, to, 1)
		if moved.State != agent.JobRunning || moved.Restored != m.Snapshot || moved.Incarnation != old.Incarnation+1 ||
			moved.Net == nil || moved.Net.Addr != old.Net.Addr {
			t.Fatalf("rank 1 on %s: %+v, want it running from %s, incarnation %d, with the address %s", to, moved, m.Snapshot, old.Incarnation+1, old.Net.Addr)
		}
		requireInJobNet(t, c, moved)
		left := rg.job(t, from, 1)
		if left.State != agent.JobMoved || left.MovedTo != to {
			t.Errorf("rank 1's record on %s: state %s moved to %q, want moved to %s", from, left.State, left.MovedTo, to)
		}
		if ok, _ := jobnet.Exists(old.Net.Name); ok {
			t.Errorf("%s kept rank 1's job network %s", from, old.Net.Name)
		}
		if _, err := os.Stat(old.ExitPath()); err == nil {
			t.Errorf("rank 1's exit record exists after its move from %s: its killed copy must leave none", from)
		}
		f := findEvent(t, c, m.Event)
		logTimeline(t, f)
		if f.Kind != agent.KindMigration || !f.Done || f.Error != "" || f.Node != from || f.Target != to {
			t.Errorf("event %s: %+v, want a completed migration from %s to %s", m.Event, f, from, to)
		}
		for _, s := range f.Stages {
			if s.Error != "" {
				t.Errorf("stage %s: %s", s.Name, s.Error)
			}
		}
		rg.waitProgress(t, progressEvery, 2*time.Minute) // exchanging again, through the moved address
		from = to
	}

	// node4 has no room for the snapshot: the move fails before rank 1 leaves node2, which thaws it.
	var fs unix.Statfs_t
	if err := unix.Statfs(store, &fs); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("ftkit-test", store, "tmpfs", unix.MS_REMOUNT, fmt.Sprintf("size=%d,mode=0700", int64(fs.Blocks-fs.Bfree)*fs.Bsize+64<<10)); err != nil {
		t.Fatalf("shrink the tmpfs on %s: %v", store, err)
	}
	old := rg.job(t, "node2", 1)
	_, err = c.Client("node2").Migrate(ctx, agent.MigrateRequest{Job: old.ID, To: "node4"})
	t.Logf("rank 1 node2 -> node4 (full): %v", err)
	if err == nil || !strings.Contains(err.Error(), "no space left on device") || !strings.Contains(err.Error(), "runs on here") {
		t.Errorf("migration to a full node4: %v, want a refusal naming its full disk and saying the job runs on", err)
	}
	if back := rg.job(t, "node2", 1); back.State != agent.JobRunning || back.PID != old.PID || back.Incarnation != old.Incarnation {
		t.Fatalf("rank 1 on node2 after the failed move: %+v, want the same process running on", back)
	}
	if _, err := c.Client("node4").Job(ctx, old.ID); err == nil {
		t.Errorf("node4 has a record of rank 1 after the failed move")
	}
	rg.waitProgress(t, progressEvery, 2*time.Minute)

	// node3 cannot make rank 1's job network (a directory stands where its namespace goes): its restore
	// fails after rank 1 left node2, which restores it again from the snapshot it left with.
	h := fnv.New32a()
	h.Write([]byte("node3"))
	block := filepath.Join(jobnet.NetnsDir, fmt.Sprintf("ftj-%08x-%s", h.Sum32(), old.ID))
	if err := os.MkdirAll(filepath.Join(block, "in-the-way"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(block) })
	m, err := c.Client("node2").Migrate(ctx, agent.MigrateRequest{Job: old.ID, To: "node3"})
	if err != nil {
		t.Fatalf("a migration whose target fails must end with the job running on its host again: %v", err)
	}
	t.Logf("rank 1 node2 -> node3 (its job network blocked): %+v", m)
	if m.To != "node2" || !strings.Contains(m.Error, block) {
		t.Errorf("migration %+v, want rank 1 back on node2 and node3's error naming %s", m, block)
	}
	back := rg.job(t, "node2", 1)
	if back.State != agent.JobRunning || back.Restored != m.Snapshot || back.Incarnation != old.Incarnation+1 || back.Net == nil || back.Net.Addr != old.Net.Addr {
		t.Fatalf("rank 1 on node2 after the failed move: %+v, want it running from %s, incarnation %d, with its address", back, m.Snapshot, old.Incarnation+1)
	}
	if f := findEvent(t, c, m.Event); !strings.Contains(f.Error, "not moved as asked") {
		t.Errorf("event %s: error %q, want it to say the job was not moved", m.Event, f.Error)
	}
	if j, err := c.Client("node3").Job(ctx, old.ID); err == nil && j.State == agent.JobRunning {
		t.Errorf("node3 runs rank 1 after its failed restore: %+v", j)
	}
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	if b, err := os.ReadFile(rg.jobs[1].ExitPath()); err != nil || !strings.Contains(string(b), `"node2"`) {
		t.Errorf("rank 1 should have finished on node2: %s %v", b, err)
	}
	after0 := rg.job(t, "node1", 0)
	if after0.PID != before0.PID || after0.Restored != "" || after0.Incarnation != 0 {
		t.Errorf("rank 0 was disturbed: pid %d -> %d, restored from %q, incarnation %d", before0.PID, after0.PID, after0.Restored, after0.Incarnation)
	}
}

// TestMigrationResumedAfterAgentDies: node2's agent is SIGKILLed right after rank 1 of a ringstencil left
// node2 for node3, and started again. The restarted agent finishes the move (from node3's record of the
// restore, or by asking node3 again if the request never reached it): rank 1 runs on node3 from the dump
// it left with, its event is closed, and the ranks finish with the failure-free output. Before, nothing
// resumed a migration: its event stayed open for good, and a job killed before the request was sent ran
// nowhere.
func TestMigrationResumedAfterAgentDies(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const port = 7471
	args := ringArgs(1500, 16<<10, 10*time.Millisecond)
	ctx := context.Background()
	want := reference(t, 2, args)
	l := newLab(t, 3, 0, false)
	c := startCluster(t, l, labcluster.Options{Interval: "1h", JobAddresses: true})
	rg := startJobAddrRing(t, c, port, args, "")
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	old := rg.job(t, "node2", 1)

	moving := make(chan error, 1)
	go func() {
		_, err := c.Client("node2").Migrate(ctx, agent.MigrateRequest{Job: old.ID, To: "node3"})
		moving <- err
	}()
	var event string
	for deadline := time.Now().Add(2 * time.Minute); event == ""; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("rank 1 did not leave node2 within 2 minutes")
		}
		evs, _ := c.Client("node2").Events(ctx)
		for _, f := range evs {
			if f.Kind == agent.KindMigration && slices.Contains(f.Jobs, old.ID) &&
				slices.ContainsFunc(f.Stages, func(s agent.Stage) bool { return s.Name == agent.StageLeft }) {
				event = f.ID
			}
		}
	}
	if err := c.KillAgent("node2"); err != nil {
		t.Fatal(err)
	}
	t.Logf("node2's agent SIGKILLed once rank 1 had left it (migration %s); the request ended with: %v", event, <-moving)
	if err := c.StartAgent(ctx, "node2"); err != nil {
		t.Fatal(err)
	}

	var f *agent.Failure
	poll(t, 3*time.Minute, "the migration's event closed on node2", func() bool {
		evs, err := c.Client("node2").Events(ctx)
		for _, e := range evs {
			if e.ID == event && e.Done {
				f = e
			}
		}
		return err == nil && f != nil
	})
	logTimeline(t, f)
	if f.Error != "" || f.Target != "node3" {
		t.Fatalf("event %s: error %q, target %s; want the move to node3 finished", event, f.Error, f.Target)
	}
	moved := rg.job(t, "node3", 1)
	if moved.State != agent.JobRunning || moved.Incarnation != old.Incarnation+1 || moved.Net == nil || moved.Net.Addr != old.Net.Addr {
		t.Fatalf("rank 1 on node3: %+v, want it running, incarnation %d, with the address %s", moved, old.Incarnation+1, old.Net.Addr)
	}
	requireInJobNet(t, c, moved)
	if left := rg.job(t, "node2", 1); left.State != agent.JobMoved || left.MovedTo != "node3" {
		t.Errorf("rank 1's record on node2: state %s moved to %q, want moved to node3", left.State, left.MovedTo)
	}
	if _, err := os.Stat(old.ExitPath()); err == nil {
		t.Errorf("rank 1's exit record exists after its move: its killed copy must leave none")
	}
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
	if b, err := os.ReadFile(rg.jobs[1].ExitPath()); err != nil || !strings.Contains(string(b), `"node3"`) {
		t.Errorf("rank 1 should have finished on node3: %s %v", b, err)
	}
}

// startJobAddrRing starts a two-rank ringstencil of args (gated near its end) on job addresses: rank 0 on
// node1, rank 1 on node2, each on the first address of its host's pool; a failed test logs their output. Both
// are jobs of run (none if "").
func startJobAddrRing(t *testing.T, c *labcluster.Cluster, port int, args []string, run string) *ring {
	t.Helper()
	st := c.Lab.State()
	addrs := []netip.Addr{labcluster.JobPool(st, "node1").Addr(), labcluster.JobPool(st, "node2").Addr()}
	peers := netip.AddrPortFrom(addrs[0], uint16(port)).String() + "," + netip.AddrPortFrom(addrs[1], uint16(port)).String()
	withGate, release := gated(t, args, 1490)
	rg := newRing(t, c, 2)
	rg.release = release
	for r, host := range []string{"node1", "node2"} {
		j, err := c.Client(host).StartJob(context.Background(), agent.JobSpec{Name: fmt.Sprintf("rank%d", r), JobAddress: true, Run: run,
			Argv: append([]string{bins.Ringstencil, "--rank", fmt.Sprint(r), "--peers", peers}, withGate...)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { removeJobNets(t, j.ID) })
		if j.Net == nil || j.Net.Addr.Addr() != addrs[r] {
			t.Fatalf("rank %d's job network %+v, want the address %s", r, j.Net, addrs[r])
		}
		rg.jobs[r] = j
	}
	return rg
}

// findEvent is event id as node1's agent lists it (the event log travels with the views).
func findEvent(t *testing.T, c *labcluster.Cluster, id string) *agent.Failure {
	t.Helper()
	var found *agent.Failure
	poll(t, 30*time.Second, "event "+id+" on node1", func() bool {
		evs, err := c.Client("node1").Events(context.Background())
		if err != nil {
			return false
		}
		for _, f := range evs {
			if f.ID == id && f.Done {
				found = f
				return true
			}
		}
		return false
	})
	return found
}

// TestHealthDrain: node2's health command starts predicting a failure (exit 1, as an ECC predictor would):
// its agent drains it by itself. Rank 1 of a ringstencil, on a job address, moves to node3, node2's
// protector, while rank 0 runs on; a job on node2's host address cannot move and is snapshotted instead;
// `ftctl status` says the failure is predicted and `ftctl events` has the drain. Once the command says
// healthy again, an operator's drain of node3 (`ftctl drain --to node2`) brings rank 1 back, and the run
// ends with the failure-free checksum.
func TestHealthDrain(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const port = 7480
	args := ringArgs(1500, 16<<10, 10*time.Millisecond)
	ctx := context.Background()
	want := reference(t, 2, args)
	dir := t.TempDir()
	health := filepath.Join(dir, "health")
	script := "#!/bin/sh\nif [ -e " + dir + "/fail-$1 ]; then echo \"ECC: 3 uncorrectable errors on DIMM B2 of $1\"; exit 1; fi\necho healthy\n"
	if err := os.WriteFile(health, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	c := newCluster(t, 3, 0, labcluster.Options{Interval: "1h", JobAddresses: true,
		HealthCommand: []string{health, "{host}"}, HealthInterval: 200 * time.Millisecond})
	rg := startJobAddrRing(t, c, port, args, "")
	stay, err := c.Client("node2").StartJob(ctx, agent.JobSpec{Name: "stay", Argv: []string{"/bin/sleep", "600"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Client("node2").Signal(context.Background(), stay.ID, 9) })
	waitProtected(t, c, "node2", stay.ID, 2*time.Minute)
	rg.waitProgress(t, progressEvery, 2*time.Minute)

	if err := os.WriteFile(filepath.Join(dir, "fail-node2"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var drain *agent.Failure
	poll(t, 2*time.Minute, "node2 to drain itself", func() bool {
		evs, err := c.Client("node2").Events(ctx)
		if err != nil {
			return false
		}
		for _, f := range evs {
			if f.Kind == agent.KindDrain && f.Done {
				drain = f
				return true
			}
		}
		return false
	})
	logTimeline(t, drain)
	if drain.Error != "" || !strings.Contains(drain.Stages[0].Detail, "uncorrectable errors on DIMM B2 of node2") {
		t.Errorf("drain %+v: want no error and the health command's reason", drain)
	}
	if s, err := c.Client("node2").Status(ctx); err != nil || !s.FailurePredicted {
		t.Errorf("node2's status: predicted %v (%v), want the failure predicted", s.FailurePredicted, err)
	}
	moved := rg.job(t, "node3", 1)
	if moved.State != agent.JobRunning || moved.Net == nil || moved.Net.Addr != rg.jobs[1].Net.Addr {
		t.Fatalf("rank 1 on node3 after the drain: %+v, want it running with its address", moved)
	}
	if j, err := c.Client("node2").Job(ctx, stay.ID); err != nil || j.State != agent.JobRunning || j.PID != stay.PID {
		t.Errorf("the job on node2's host address: %+v %v, want it running on where it was", j, err)
	}
	snapped := false
	for _, s := range drain.Stages {
		snapped = snapped || (s.Name == agent.StageSnapshotted && s.Job == stay.ID && s.Error == "")
	}
	if !snapped {
		t.Errorf("the drain did not snapshot the job that cannot move")
	}
	rg.waitProgress(t, progressEvery, 2*time.Minute)

	if err := os.Remove(filepath.Join(dir, "fail-node2")); err != nil {
		t.Fatal(err)
	}
	poll(t, time.Minute, "node2 to be healthy again", func() bool {
		s, err := c.Client("node2").Status(ctx)
		return err == nil && !s.FailurePredicted
	})
	res, err := c.Client("node3").Drain(ctx, agent.DrainRequest{To: []string{"node2"}})
	if err != nil || len(res.Moved) != 1 || res.Moved[0].To != "node2" || len(res.Failed) != 0 {
		t.Fatalf("drain of node3 to node2: %+v %v, want rank 1 moved", res, err)
	}
	if j := rg.job(t, "node2", 1); j.State != agent.JobRunning || j.Incarnation != moved.Incarnation+1 {
		t.Fatalf("rank 1 on node2 after node3's drain: %+v", j)
	}
	outs := rg.wait(t, 3*time.Minute)
	checkRanks(t, outs, want)
}
