package e2e

import (
	"context"
	"crypto/sha256"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/tcpflow"
)

// The test binary doubles as the jobs' program: an agent re-executes it with streamtest's role variables
// in the environment ftwrap passes on, and it then runs the role instead of the tests.
func init() { streamtest.ChildMain(nil, 10*time.Minute) }

// A connection between two protected jobs that both exit must leave the sender's log: nothing can restore
// either end any more. Before the fix the log kept every finished connection for good (5 NetPIPE runs
// left 4.1 GiB logged on the sender), and with incompressible data the next job hit the log's memory cap
// while the controller asked a node without jobs to snapshot: the senders stalled. Here node1's job sends
// 64 MiB of random bytes to node2's job, several times in a row, with a 32 MiB log cap: each run's
// connection must be freed after the jobs exit, so every next run starts with an empty log.
func TestFinishedConnLogFreed(t *testing.T) {
	t.Parallel() // each test has its own lab
	const capMiB, size, runs = 32, 64 << 20, 3
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", LogMemoryMiB: capMiB, LogRingMiB: 4})
	ctx := context.Background()
	dstAddr := c.Lab.State().Hosts[1].Addr.Addr()
	for run := range runs {
		before := logStatus(t, c, "node1")
		dst := netip.AddrPortFrom(dstAddr, uint16(7700+run))
		seed := uint64(100 + run)
		recv, recvOut, recvJob := startRole(t, c, "node2", fmt.Sprintf("recv%d", run), "recv", "FTKIT_ADDR="+dst.String())
		waitOutput(t, recvOut, "ready\n", time.Minute)
		send, sendOut, sendJob := startRole(t, c, "node1", fmt.Sprintf("send%d", run), "send", "FTKIT_ADDR="+dst.String(),
			fmt.Sprintf("FTKIT_SEED=%d", seed), fmt.Sprintf("FTKIT_SIZE=%d", size))
		// While the stream flows, node1's log holds it (else an empty log below would prove nothing).
		seen := make(chan bool, 1)
		stop := make(chan struct{})
		go func() {
			held := false
			defer func() { seen <- held }()
			for !held {
				if conns, err := c.Client("node1").LoggedConns(ctx); err == nil {
					for _, lc := range conns {
						held = held || lc.DstNode == "node2" && lc.Dst == dst && lc.Retained > 0
					}
				}
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
			}
		}()
		if err := waitCmd(t, send, 5*time.Minute); err != nil {
			t.Fatalf("run %d: sender: %v; output %q", run, err, sendOut.String())
		}
		if err := waitCmd(t, recv, 5*time.Minute); err != nil {
			t.Fatalf("run %d: receiver: %v; output %q", run, err, recvOut.String())
		}
		close(stop)
		if !<-seen {
			t.Fatalf("run %d: node1's log never held the stream to %v", run, dst)
		}
		data := streamtest.Stream(seed, size)
		if want := fmt.Sprintf("%d %x\n", size, sha256.Sum256(data)); !strings.HasSuffix(recvOut.String(), want) {
			t.Fatalf("run %d: receiver printed %q, want %q (bytes lost or changed)", run, recvOut.String(), want)
		}
		src, _, err := streamtest.ParseConnLine(strings.SplitN(sendOut.String(), "\n", 2)[0])
		if err != nil {
			t.Fatal(err)
		}
		conn := tcpflow.Tuple{Local: src, Remote: dst}
		exited := jobExit(t, c, "node1", sendJob)
		if e := jobExit(t, c, "node2", recvJob); e.After(exited) {
			exited = e
		}

		// Both jobs are gone: node1's log must drop their connection. The consumer may still be paused at
		// the cap with records of the stream in its ring; they land once memory is freed, and go too.
		var freedAt time.Time
		var last []agent.LoggedConn
		var after agent.LogStatus
		for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if last, err = c.Client("node1").LoggedConns(ctx); err != nil {
				t.Fatal(err)
			}
			after = logStatus(t, c, "node1")
			if !holds(last, conn) && after.Counters.Conns == 0 && after.Counters.RingPendingBytes == 0 {
				freedAt = time.Now()
				break
			}
		}
		if freedAt.IsZero() {
			t.Fatalf("run %d: 2 min after both jobs exited, node1's log still holds their connection %v: %+v; log %+v",
				run, conn, last, after.Counters)
		}
		if after.Counters.RetainedBytes != 0 || after.Released.Conns <= before.Released.Conns {
			t.Errorf("run %d: after the release node1's log retains %d bytes; released %+v (before %+v)",
				run, after.Counters.RetainedBytes, after.Released, before.Released)
		}
		logged := after.Counters.AppendedBytes - before.Counters.AppendedBytes
		t.Logf("run %d: %s: %.1f of %d MiB sent logged; %.1f MiB still retained were freed (%d release(s)) %v after the later job exit; log memory now %.1f MiB (cap %d MiB), %d backpressure drops so far",
			run, conn, float64(logged)/(1<<20), size>>20, float64(after.Released.Bytes-before.Released.Bytes)/(1<<20),
			after.Released.Conns-before.Released.Conns, freedAt.Sub(exited).Round(10*time.Millisecond),
			float64(after.Counters.MemoryBytes)/(1<<20), capMiB, after.Counters.DropsBackpressure)
	}
	s := logStatus(t, c, "node1")
	var events []string
	for _, e := range s.Events {
		events = append(events, fmt.Sprintf("%s %s %s %d", e.Time.Format("15:04:05.000"), e.Kind, e.Node, e.Bytes))
	}
	t.Logf("node1's log events: %s", strings.Join(events, "; "))
}

// startRole runs a streamtest role as a protected job on host through ftwrap and returns ftwrap, its
// output (the job's) and the job's id.
func startRole(t *testing.T, c *labcluster.Cluster, host, name, role string, env ...string) (*exec.Cmd, *testenv.SyncBuffer, string) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := ftwrap(c, host, "--name", name, "--", self)
	// The receiver keeps its listener open while the log controller may have it snapshotted: the job's
	// init turns Go's MPTCP listeners off (shim.withoutMPTCP), this test no longer does.
	cmd.Env = append(append(cmd.Env, streamtest.RoleEnv+"="+role), env...)
	out := &testenv.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		jobs, _ := c.Client(host).Jobs(context.Background())
		for _, j := range jobs {
			if j.Spec.Name == name {
				return cmd, out, j.ID
			}
		}
	}
	t.Fatalf("job %s did not appear on %s", name, host)
	return nil, nil, ""
}

func waitOutput(t *testing.T, out *testenv.SyncBuffer, want string, timeout time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if strings.Contains(out.String(), want) {
			return
		}
	}
	t.Fatalf("job output %q never contained %q", out.String(), want)
}

// jobExit is when host's agent recorded that job ended; it must have exited with status 0.
func jobExit(t *testing.T, c *labcluster.Cluster, host, job string) time.Time {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		j, err := c.Client(host).Job(context.Background(), job)
		if err != nil {
			t.Fatal(err)
		}
		if j.State == agent.JobRunning {
			continue
		}
		if j.State != agent.JobExited || j.Exit == nil || j.Exit.Code != 0 {
			t.Fatalf("job %s on %s: %s %+v", job, host, j.State, j.Exit)
		}
		return j.Exit.Time
	}
	t.Fatalf("job %s on %s still running after its ftwrap returned", job, host)
	return time.Time{}
}

func logStatus(t *testing.T, c *labcluster.Cluster, host string) agent.LogStatus {
	t.Helper()
	s, err := c.Client(host).Status(context.Background())
	if err != nil || s.Log == nil {
		t.Fatalf("status of %s: %+v, %v", host, s.Log, err)
	}
	return *s.Log
}

func holds(conns []agent.LoggedConn, c tcpflow.Tuple) bool {
	for _, lc := range conns {
		if lc.Src == c.Local && lc.Dst == c.Remote {
			return true
		}
	}
	return false
}
