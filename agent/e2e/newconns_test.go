package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestConnectionAfterSnapshot: rank 1 starts alone and is protected before its peers exist, so every
// connection it will have is opened after its first snapshot. Its agent finds them missing from the
// replica and snapshots it again (the interval is an hour), and a crash of its node afterwards is
// recovered with the result of a failure-free run. Before, nothing renewed the snapshot: the recovery
// restored a rank without connections, the survivors' next segments were answered with resets, and the
// recovery ended in its replay timeout (CI, TestMetricsRecovery, when its start snapshot came first).
func TestConnectionAfterSnapshot(t *testing.T) {
	t.Parallel()
	args := ringArgs(700, 64<<10, 10*time.Millisecond)
	want := reference(t, 3, args)
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	argv := ringArgv(t, c, 3, 7380, args)
	rg := newRing(t, c, 3)
	rg.start(t, 1, "rank", argv(1))
	first := waitProtected(t, c, "node2", rg.jobs[1].ID, 2*time.Minute).Replica.Snapshot
	rg.start(t, 0, "rank", argv(0))
	rg.start(t, 2, "rank", argv(2))
	rg.waitProgress(t, progressEvery, 2*time.Minute)
	j := waitCovered(t, c, "node2", rg.jobs[1].ID, 2*time.Minute)
	if j.Replica.Snapshot == first {
		t.Fatalf("rank 1's connections are all in its first snapshot %s, taken before its peers started", first)
	}
	m := manifestOn(t, c, "node2", j.ID, j.Replica.Snapshot)
	if len(m.Conns) != 2 {
		t.Fatalf("rank 1's renewed snapshot %s holds %d connections, want 2: %+v", m.ID, len(m.Conns), m.Conns)
	}
	if b, err := os.ReadFile(c.LogPath("node2")); err != nil || !strings.Contains(string(b), "job has connections its replica lacks") {
		t.Errorf("node2's agent did not log the connections its replica lacked (%v)", err)
	}
	rg.waitProgress(t, 60, 2*time.Minute)
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	checkRanks(t, rg.wait(t, 3*time.Minute), want)
}

// TestUncoveredJobRefused: a job whose listener holds a connection it never accepts cannot be dumped
// again (CRIU refuses a listener with connections in its queue), so its replica, taken before the peer
// connected, lacks that connection. Its record says so (`ftctl status`: UNPROTECTED), its heartbeats tell
// its protector, and when its node fails the recovery refuses to restore it and says why. Before, the
// recovery restored the job without the connection and reported success while the peer's connection was
// reset (TestConnectionAfterSnapshot's old outcome).
func TestUncoveredJobRefused(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx := context.Background()
	h2, err := c.Lab.Host("node2")
	if err != nil {
		t.Fatal(err)
	}
	listen := fmt.Sprintf("import socket, time\ns = socket.socket()\ns.bind(('%s', 7381))\ns.listen()\ntime.sleep(3600)\n", h2.Addr.Addr())
	connect := fmt.Sprintf("import socket, time\ns = socket.create_connection(('%s', 7381))\nprint('connected', flush=True)\ntime.sleep(3600)\n", h2.Addr.Addr())
	l, err := c.Client("node2").StartJob(ctx, agent.JobSpec{Name: "listener", Argv: []string{"/usr/bin/python3", "-c", listen}})
	if err != nil {
		t.Fatal(err)
	}
	first := waitProtected(t, c, "node2", l.ID, 2*time.Minute).Replica.Snapshot
	cl, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: "client", Argv: []string{"/usr/bin/python3", "-c", connect}})
	if err != nil {
		t.Fatal(err)
	}
	var j agent.Job
	for deadline := time.Now().Add(time.Minute); len(j.NewConns) == 0; time.Sleep(50 * time.Millisecond) {
		if j, err = c.Client("node2").Job(ctx, l.ID); err != nil || time.Now().After(deadline) {
			b, _ := os.ReadFile(cl.StdoutPath())
			t.Fatalf("the listener's record never named the connection in its queue: %+v, %v (client: %q)", j, err, b)
		}
	}
	if want := "a connection waits in its accept queue"; !strings.Contains(j.NewConns[0], want) || j.Covered() {
		t.Fatalf("the listener's new connections %q: want %q, and not covered", j.NewConns, want)
	}
	// node3, node2's protector, has heard it from node2's heartbeats.
	waitLog(t, c, "node3", "a job of the member has connections its replica lacks", time.Minute)
	if err := c.Lab.Crash(ctx, "node2"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node2", 5*time.Minute)
	logTimeline(t, f)
	want := fmt.Sprintf("job %s not restored: its newest replica %s lacks connections the job opened after it", l.ID, first)
	if !strings.Contains(f.Error, want) {
		t.Fatalf("recovery error %q, want it to say %q", f.Error, want)
	}
	for _, h := range []string{"spare1", "node3", "node1"} {
		if jobs, err := c.Client(h).Jobs(ctx); err == nil {
			for _, o := range jobs {
				if o.ID == l.ID {
					t.Errorf("the listener was restored on %s: %+v", h, o)
				}
			}
		}
	}
}

// waitLog waits until host's agent log holds line.
func waitLog(t *testing.T, c *labcluster.Cluster, host, line string, timeout time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(50 * time.Millisecond) {
		if b, err := os.ReadFile(c.LogPath(host)); err == nil && strings.Contains(string(b), line) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s's agent never logged %q within %s", host, line, timeout)
		}
	}
}

// TestConnectCaughtBySnapshot: a snapshot taken while a job's connect waits for its SYN-ACK holds the
// socket in SYN_SENT, whose receive sequence is the kernel's placeholder 0. The manifest marks it
// connecting; the snapshot announces no receive point for it (a trim of the peer's log at 0 could land
// ahead of all the peer had logged and make it drop what it logs next: ci138's recovery refused as
// unverifiable); once the connect completes the job's record names the connection as one its replica
// lacks and the job is snapshotted again. Its host then crashes mid-stream and the job comes back
// exactly, its peer's acknowledgements replayed from the peer's log and its re-sent blocks verified.
// Before, the connecting snapshot stayed the job's replica for its whole interval.
func TestConnectCaughtBySnapshot(t *testing.T) {
	t.Parallel()
	const (
		port   = 7383
		block  = 16 << 10
		blocks = 4000
		every  = 50
	)
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx := context.Background()
	peer := hostPort(t, c, "node2", port)
	// node2 drops the sender's SYNs until the sender's snapshot has its connect in SYN_SENT.
	undo, err := c.Lab.Filter("node2", "ftkit_e2e_syn", fmt.Sprintf(`	chain in {
		type filter hook input priority 0; policy accept;
		tcp dport %d tcp flags & (syn | ack) == syn drop
	}`, port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { undo() })
	withGate, release := gated(t, []string{"--rank", "1", "--peer", peer, "--iters", fmt.Sprint(blocks),
		"--block", fmt.Sprint(block), "--delay", "5ms", "--progress", fmt.Sprint(every)}, blocks-200)
	defer release()
	ch := &chain{c: c}
	ch.start(t, "node2", "receiver", bins.Nondet, "--rank", "0", "--peer", peer, "--iters", fmt.Sprint(blocks),
		"--block", fmt.Sprint(block), "--progress", fmt.Sprint(every))
	ch.start(t, "node1", "sender", append([]string{bins.Nondet}, withGate...)...)
	recv, send := ch.jobs[0], ch.jobs[1]
	waitProtected(t, c, "node2", recv.ID, 2*time.Minute)
	waitProtected(t, c, "node1", send.ID, 2*time.Minute)
	ns, err := c.Lab.NetnsPath("node1")
	if err != nil {
		t.Fatal(err)
	}
	poll(t, time.Minute, "the sender's connect in SYN_SENT", func() bool {
		out, err := exec.Command("nsenter", "--net="+ns, "ss", "-Htn", "state", "syn-sent", "dst", peer).Output()
		return err == nil && len(strings.TrimSpace(string(out))) > 0
	})
	reply, err := c.Client("node1").Checkpoint(ctx)
	if err != nil || reply.Error != "" || len(reply.Results) == 0 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint of node1: %+v %v", reply, err)
	}
	connecting := ch.job(t, "node1", send.ID).Replica.Snapshot
	m := manifestOn(t, c, "node1", send.ID, connecting)
	if len(m.Conns) != 1 || !m.Conns[0].Connecting {
		t.Fatalf("snapshot %s taken while the sender connected: connections %+v, want one marked connecting", connecting, m.Conns)
	}
	if err := undo(); err != nil {
		t.Fatal(err)
	}
	// The connect completes at the SYN's next retransmission; the sender is snapshotted again after it.
	var j agent.Job
	poll(t, 2*time.Minute, "a snapshot of the sender after its connect completed", func() bool {
		j = ch.job(t, "node1", send.ID)
		return j.Replica != nil && j.Replica.Snapshot > connecting && j.Covered()
	})
	if m := manifestOn(t, c, "node1", send.ID, j.Replica.Snapshot); len(m.Conns) != 1 || m.Conns[0].Connecting {
		t.Fatalf("the sender's snapshot %s after its connect: connections %+v, want one established", m.ID, m.Conns)
	}
	if b, err := os.ReadFile(c.LogPath("node1")); err != nil || !strings.Contains(string(b), "still connecting at snapshot "+connecting) {
		t.Errorf("node1's agent did not name the connection its replica caught connecting (%v)", err)
	}
	before := ch.job(t, "node2", recv.ID)
	ch.waitReceived(t, recv, ch.received(recv)+2*every, 2*time.Minute)
	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node1", 5*time.Minute)
	requireStages(t, f)
	replay := stageOf(t, f, agent.StageReplayed)
	if resent, verified := resentBytes(t, replay.Detail), verifiedBytes(t, replay.Detail); verified != resent {
		t.Errorf("re-sent %d bytes, verified %d: want all verified (%s)", resent, verified, replay.Detail)
	}
	release()
	requireStream(t, ch.jobs, blocks, block)
	if a := ch.job(t, "node2", recv.ID); a.PID != before.PID || a.Restored != "" {
		t.Errorf("the receiver on node2 was disturbed: pid %d -> %d, restored from %q", before.PID, a.PID, a.Restored)
	}
}

// TestCheckpointWaitsForAccept: a snapshot asked for while a connection waits in a job's listen queue (the
// job has not accepted it yet) waits for the job to accept it and then holds it; so does a migration's dump.
// CRIU cannot dump such a connection; until 2026-12-02 the snapshot failed at once ("In-flight
// connection"), as it did in the CI run of 577c21d when TestUnprotectedPeerOnMember checkpointed a ring
// whose rank 0 still connected to rank 1. Here rank 0 of a ring stencil listens, then connects to its next
// rank, which does not listen yet, and accepts only after that: a connection to rank 0 from node2 waits in
// its queue until something listens there as rank 1.
//
// In semi-coordinated mode the agent thaws the job it froze until the job has accepted. The peers are socat
// jobs of node2, whose sends node2 logs, or the test itself, a process not started under ftkit: a migration
// must then refuse, the job running on (until 2026-12-02 only the target's restore refused, after the job
// had left: it was lost).
// acceptWaitLab is the agents' checkpoint.accept_wait in TestCheckpointWaitsForAccept: the test lets the job
// accept once the agent logs that it waits, which a loaded machine can delay past the default 2 s.
const acceptWaitLab = 20 * time.Second

func TestCheckpointWaitsForAccept(t *testing.T) {
	t.Parallel()
	checkpoint := func(c *labcluster.Cluster, j agent.Job) (string, error) {
		reply, err := c.Client("node1").Checkpoint(context.Background(), j.ID)
		if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
			return "", fmt.Errorf("checkpoint of rank 0: %+v %v", reply, err)
		}
		return reply.Results[0].Manifest.ID, nil
	}
	migrate := func(c *labcluster.Cluster, j agent.Job) (string, error) {
		m, err := c.Client("node1").Migrate(context.Background(), agent.MigrateRequest{Job: j.ID, To: "node3"})
		if err != nil || m.Error != "" {
			return "", fmt.Errorf("migration of rank 0 to node3: %+v %w", m, err)
		}
		return m.Snapshot, nil
	}
	for _, tc := range []struct {
		name      string
		plain     bool
		migration bool
		mode      agent.Mode
	}{
		{"checkpoint", true, false, agent.Uncoordinated},
		{"checkpoint, semi-coordinated", true, false, agent.SemiCoordinated},
		{"migration", false, true, agent.Uncoordinated},
		{"migration, a plain peer", true, true, agent.Uncoordinated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			snapshot := checkpoint
			if tc.migration {
				snapshot = migrate
			}
			testWaitsForAccept(t, tc.plain, tc.migration, tc.mode, snapshot)
		})
	}
	t.Run("coordinated snapshot", func(t *testing.T) {
		t.Parallel()
		testCutWaitsForAccept(t)
	})
}

// testWaitsForAccept runs rank 0 on node1 (at a job address for a migration) with a connection from node2 (a
// job, or the test if plain) waiting in its queue, and snapshot, which returns the id of the snapshot it took
// (found on node1, and on node3 after a migration).
func testWaitsForAccept(t *testing.T, plain, migration bool, mode agent.Mode, snapshot func(*labcluster.Cluster, agent.Job) (string, error)) {
	var socat string
	if !plain {
		requirePrograms(t, "socat")
		socat, _ = exec.LookPath("socat")
	}
	c := newCluster(t, 3, 0, labcluster.Options{Interval: "1h", JobAddresses: migration, Mode: mode, AcceptWait: acceptWaitLab})
	h1, err := c.Lab.Host("node1")
	if err != nil {
		t.Fatal(err)
	}
	h2, err := c.Lab.Host("node2")
	if err != nil {
		t.Fatal(err)
	}
	addr0 := h1.Addr.Addr()
	if migration {
		addr0 = labcluster.JobPool(c.Lab.State(), "node1").Addr()
	}
	rank0, rank1 := netip.AddrPortFrom(addr0, 7490), netip.AddrPortFrom(h2.Addr.Addr(), 7491)
	ch := &chain{c: c}
	j, err := c.Client("node1").StartJob(context.Background(), agent.JobSpec{Name: "rank0", JobAddress: migration, Argv: append([]string{bins.Ringstencil,
		"--rank", "0", "--peers", rank0.String() + "," + rank1.String()}, ringArgs(2000, 16<<10, 10*time.Millisecond)...)})
	if err != nil {
		t.Fatal(err)
	}
	if migration {
		t.Cleanup(func() { removeJobNets(t, j.ID) })
	}
	waitProtected(t, c, "node1", j.ID, 2*time.Minute)
	// The connection that waits: it sends nothing, and holds on.
	var from netip.AddrPort
	if plain {
		var left net.Conn
		if err := c.Lab.Do("node2", func() (err error) {
			left, err = net.DialTimeout("tcp", rank0.String(), 10*time.Second)
			return err
		}); err != nil {
			t.Fatalf("connect to rank 0 from node2: %v", err)
		}
		defer left.Close()
		from = netip.MustParseAddrPort(left.LocalAddr().String())
	} else {
		ch.start(t, "node2", "left", socat, "-u", "EXEC:sleep 600", "TCP:"+rank0.String())
		poll(t, time.Minute, "node2's connection to rank 0", func() bool {
			from = connectedTo(t, c, "node2", rank0)
			return from.IsValid()
		})
	}
	type result struct {
		id  string
		err error
	}
	done := make(chan result, 1)
	go func() {
		id, err := snapshot(c, j)
		done <- result{id, err}
	}()
	poll(t, time.Minute, "node1's agent to log that the snapshot waits for the job to accept", func() bool {
		select {
		case r := <-done:
			t.Fatalf("the snapshot returned before the job accepted the connection waiting in its queue: %s %v", r.id, r.err)
		default:
		}
		b, err := os.ReadFile(c.LogPath("node1"))
		return err == nil && strings.Contains(string(b), "the snapshot waits for the job to accept it")
	})
	// Rank 0's next connect attempt (every 50 ms) reaches this listener; it then accepts the waiting connection.
	if plain {
		var ln net.Listener
		if err := c.Lab.Do("node2", func() (err error) {
			ln, err = net.Listen("tcp", rank1.String())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
	} else {
		ch.start(t, "node2", "right", socat, "-u", fmt.Sprintf("TCP-LISTEN:%d,bind=%s", rank1.Port(), rank1.Addr()), "EXEC:sleep 600")
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the snapshot did not return within 2 minutes")
	}
	if plain && migration {
		// Refused before the job left: it runs on node1 as before.
		if r.err == nil || !strings.Contains(r.err.Error(), agent.ErrNotMovable.Error()) || !strings.Contains(r.err.Error(), "not started under ftkit") {
			t.Fatalf("migration with a peer not started under ftkit: %s %v; want a refusal naming it", r.id, r.err)
		}
		if got, err := c.Client("node1").Job(context.Background(), j.ID); err != nil || got.State != agent.JobRunning || got.PID != j.PID {
			t.Errorf("rank 0 after the refused migration: %+v %v, want it running on node1 as before", got, err)
		}
		return
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	host := "node1"
	if migration {
		host = "node3"
	}
	m := manifestOn(t, c, host, j.ID, r.id)
	accepted := tcpflow.Tuple{Local: rank0, Remote: from}
	if !slices.ContainsFunc(m.Conns, func(c ckpt.Conn) bool { return c.Tuple.Unmap() == accepted }) {
		t.Errorf("snapshot %s: connections %+v, want the one rank 0 accepted (%s)", m.ID, m.Conns, accepted)
	}
}

// testCutWaitsForAccept: a run in coordinated recovery, on job addresses: rank 0 on node1, whose right
// neighbour is a job of node1 that listens only once the test opens a gate, and on node2 a job that, once the
// run has a cut of all three and the test opens another gate, connects to rank 0 and waits in its listen
// queue (rank 0 accepts once it has connected to its right). A coordinated
// snapshot of the run freezes node1's jobs with that connection in the queue: node1 thaws them until rank 0
// has accepted it, freezes them again, and the cut is taken with the connection in rank 0's part. Before,
// rank 0's dump failed (criu.ErrInFlight) and so did the cut.
func testCutWaitsForAccept(t *testing.T) {
	requirePrograms(t, "socat")
	socat, _ := exec.LookPath("socat")
	ctx := context.Background()
	const run = "accept"
	c := newCluster(t, 3, 0, labcluster.Options{Interval: "1h", JobAddresses: true, AcceptWait: acceptWaitLab})
	st := c.Lab.State()
	pool := labcluster.JobPool(st, "node1")
	rank0, right := netip.AddrPortFrom(pool.Addr(), 7490), netip.AddrPortFrom(pool.Addr().Next(), 7491)
	dir := t.TempDir()
	gate, connect := filepath.Join(dir, "listen"), filepath.Join(dir, "connect")
	behind := func(gate, cmd string) []string {
		return []string{"/bin/sh", "-c", fmt.Sprintf(`while [ ! -e %s ]; do sleep 0.05; done; exec %s`, gate, cmd)}
	}
	start := func(host, name string, addr netip.Addr, argv ...string) agent.Job {
		t.Helper()
		j, err := c.Client(host).StartJob(ctx, agent.JobSpec{Name: name, Run: run, JobAddress: true, Recovery: agent.RecoveryCoordinated, Argv: argv})
		if err != nil {
			t.Fatalf("start %s on %s: %v", name, host, err)
		}
		t.Cleanup(func() { removeJobNets(t, j.ID) })
		if addr.IsValid() && (j.Net == nil || j.Net.Addr.Addr() != addr) {
			t.Fatalf("%s's job network %+v, want the address %s", name, j.Net, addr)
		}
		return j
	}
	r0 := start("node1", "rank0", rank0.Addr(), append([]string{bins.Ringstencil, "--rank", "0", "--peers", rank0.String() + "," + right.String()},
		ringArgs(2000, 16<<10, 10*time.Millisecond)...)...)
	start("node1", "right", right.Addr(), behind(gate, fmt.Sprintf(`%s -u TCP-LISTEN:%d,bind=%s "EXEC:sleep 600"`, socat, right.Port(), right.Addr()))...)
	left := start("node2", "left", netip.Addr{}, behind(connect, fmt.Sprintf(`%s -u "EXEC:sleep 600" TCP:%s`, socat, rank0))...)
	// node1 coordinates the run's scheduled cuts: at once, again within seconds while a job of the run is in
	// none, then one an hour. The cut below is the test's alone once one holds all three jobs.
	waitCut(t, c, "node1", run, 3)
	if err := os.WriteFile(connect, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var from netip.AddrPort
	poll(t, time.Minute, "node2's connection to rank 0", func() bool {
		from = connectedIn(t, jobnet.Path(left.Net.Name), rank0)
		return from.IsValid()
	})

	type result struct {
		cut coordinated.Cut
		err error
	}
	done := make(chan result, 1)
	go func() {
		root := uint32(0)
		cut, err := c.Client("node3").Cut(ctx, coordinated.RunRequest{Run: run, UID: &root})
		done <- result{cut, err}
	}()
	poll(t, time.Minute, "node1's agent to log that the coordinated snapshot waits for rank 0 to accept", func() bool {
		select {
		case r := <-done:
			t.Fatalf("the coordinated snapshot returned before rank 0 accepted the connection waiting in its queue: %+v %v", r.cut, r.err)
		default:
		}
		b, err := os.ReadFile(c.LogPath("node1"))
		return err == nil && strings.Contains(string(b), "the snapshot waits for the job to accept it")
	})
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the coordinated snapshot did not return within 2 minutes")
	}
	if r.err != nil {
		t.Fatalf("coordinated snapshot of run %s: %v", run, r.err)
	}
	if len(r.cut.Parts) != 3 {
		t.Fatalf("cut %+v, want a part for each of the run's 3 jobs", r.cut)
	}
	i := slices.IndexFunc(r.cut.Parts, func(p clusterapi.CutPart) bool { return p.Job == r0.ID })
	if i < 0 {
		t.Fatalf("cut %+v has no part for rank 0", r.cut)
	}
	m := manifestOn(t, c, "node1", r0.ID, r.cut.Parts[i].Snapshot)
	accepted := tcpflow.Tuple{Local: rank0, Remote: from}
	if !slices.ContainsFunc(m.Conns, func(c ckpt.Conn) bool { return c.Tuple.Unmap() == accepted }) {
		t.Errorf("rank 0's part %s: connections %+v, want the one rank 0 accepted (%s)", m.ID, m.Conns, accepted)
	}
}

// connectedTo returns the local end of an established connection of host to remote, if there is one.
func connectedTo(t *testing.T, c *labcluster.Cluster, host string, remote netip.AddrPort) netip.AddrPort {
	t.Helper()
	ns, err := c.Lab.NetnsPath(host)
	if err != nil {
		t.Fatal(err)
	}
	return connectedIn(t, ns, remote)
}

// connectedIn returns the local end of an established connection to remote in network namespace ns (a
// path), if there is one.
func connectedIn(t *testing.T, ns string, remote netip.AddrPort) netip.AddrPort {
	t.Helper()
	out, err := exec.Command("nsenter", "--net="+ns, "ss", "-Htn", "state", "established", "dst", remote.String()).Output()
	if err != nil {
		t.Fatalf("ss in %s: %v", ns, err)
	}
	for line := range strings.Lines(string(out)) {
		if f := strings.Fields(line); len(f) >= 4 {
			if local, err := netip.ParseAddrPort(f[2]); err == nil {
				return local
			}
		}
	}
	return netip.AddrPort{}
}
