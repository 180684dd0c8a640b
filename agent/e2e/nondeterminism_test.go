package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/shim"
)

// TestResentBytesVerified: a two-rank ping-pong (testdata/nondet), rank 1 on node2, which crashes a while
// after its snapshot. Its restored copy on spare1 re-sends the bytes rank 0 already received; the target
// checks every one of them against node1's record of what rank 0 received. A deterministic rank 1 re-sends
// the same bytes: all verified, and the run ends with the failure-free checksum. A rank 1 whose bytes
// depend on the wall clock re-sends different ones: the recovery says it is not transparently
// recoverable, the restored rank is killed, and the run does not go on. That holds as well when less than
// one 64 KiB block was re-sent, the crash coming right after the snapshot: the old sender-side digests
// checked only whole blocks that had reached the protector, so that recovery reported success with
// "0 of 0 blocks" verified and rank 0 went on with bytes of a different execution.
func TestResentBytesVerified(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	tests := []struct {
		name  string
		clock bool
		block int
		// after is how many blocks rank 1 sends at least between the snapshot and node2's crash.
		after int
	}{
		{name: "deterministic", block: 64 << 10, after: 150},
		{name: "wall-clock bytes", clock: true, block: 64 << 10, after: 150},
		{name: "wall-clock bytes, less than a block re-sent", clock: true, block: 128, after: 30},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // each row has its own lab
			args := []string{"--iters", "600", "--block", fmt.Sprint(tt.block), "--delay", "10ms", "--progress", "10"}
			if tt.clock {
				args = append(args, "--clock")
			}
			c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
			rg := crashMidRun(t, c, 7600+i, args, tt.after)
			f := waitFailure(t, c, "node2", 5*time.Minute)
			logTimeline(t, f)
			if f.Target != "spare1" {
				t.Fatalf("restored on %s, want spare1", f.Target)
			}
			replay := stageOf(t, f, agent.StageReplayed)
			resent := resentBytes(t, replay.Detail)
			if resent == 0 {
				t.Fatalf("nothing was re-sent (%s): the crash came too early to test anything", replay.Detail)
			}
			if !tt.clock {
				requireStages(t, f)
				if verified := verifiedBytes(t, replay.Detail); verified != resent {
					t.Errorf("verified %d of %d re-sent bytes; want all (%s)", verified, resent, replay.Detail)
				}
				want := nondetReference(t, args)
				for r, j := range rg.jobs {
					st, out := waitExit(t, j, 2*time.Minute)
					if st.Code != 0 {
						t.Errorf("rank %d exited %d: %s", r, st.Code, out)
					} else if got := checksumOf(t, out); got != want {
						t.Errorf("rank %d checksum %s, failure-free run %s", r, got, want)
					}
				}
				return
			}
			if !strings.Contains(f.Error, "not transparently recoverable") {
				t.Errorf("recovery error %q does not say the job is not transparently recoverable", f.Error)
			}
			for _, w := range []string{"not deterministic", "CRC-32C", "re-sent"} {
				if !strings.Contains(replay.Error, w) {
					t.Errorf("replay stage error %q does not mention %q", replay.Error, w)
				}
			}
			if s := stageOf(t, f, ""); s.Name == agent.StageProtected && s.Error == "" {
				t.Errorf("the killed job was re-protected: %+v", s)
			}
			// The restored rank was killed; the survivor sees its connection end and fails instead of going
			// on with bytes from a different execution.
			st, _ := waitExit(t, rg.jobs[1], time.Minute)
			if st.Node != "spare1" || st.Signal != "SIGKILL" || !strings.Contains(st.Reason, "killed by ftkit on spare1: the job's restore could not reproduce the failure-free run") {
				t.Errorf("restored rank 1 ended %+v, want killed on spare1, and the record saying why", st)
			}
			st, out := waitExit(t, rg.jobs[0], time.Minute)
			if st.Code == 0 {
				t.Errorf("rank 0 completed (%s) although its peer re-sent different bytes", out)
			}
			// The agent notices the exit at its next look at its jobs.
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
				j := rg.job(t, "spare1", 1)
				if j.State != agent.JobRunning {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("spare1 still lists the killed rank 1 as running: %+v", j)
					break
				}
			}
		})
	}
}

// startNondet starts rank 0 on node1 listening on port and rank 1 on node2.
func startNondet(t *testing.T, c *labcluster.Cluster, port int, args []string) *ring {
	t.Helper()
	h, err := c.Lab.Host("node1")
	if err != nil {
		t.Fatal(err)
	}
	peer := netip.AddrPortFrom(h.Addr.Addr(), uint16(port)).String()
	return startRanks(t, c, 2, "nondet", func(r int) []string {
		return append([]string{bins.Nondet, "--rank", fmt.Sprint(r), "--peer", peer}, args...)
	})
}

// crashMidRun starts a nondet run of args (with --progress) whose rank 1 on node2 waits before block
// nondetGate until the snapshot of it the test takes, lets it go on, and crashes node2 once rank 1 has sent
// at least after blocks since: mid-run whatever the lab's load (sleeps there guessed how far the run had got,
// and under load it had ended, nothing to re-send).
func crashMidRun(t *testing.T, c *labcluster.Cluster, port int, args []string, after int) *ring {
	t.Helper()
	withGate, release := gated(t, args, nondetGate)
	rg := startNondet(t, c, port, withGate)
	// The ranks' first snapshots, taken as they started, come before the one this test takes.
	rg.waitProtected(t, 2*time.Minute)
	rg.checkpoint(t, "node2") // rank 1 is at block nondetGate at most: held there
	release()
	poll(t, 2*time.Minute, fmt.Sprintf("rank 1 past block %d", nondetGate+after), func() bool {
		return sentBlocks(rg.jobs[1]) >= nondetGate+after
	})
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	return rg
}

// nondetGate is the block crashMidRun's rank 1 waits before until its snapshot is taken.
const nondetGate = 100

// sentBlocks is how many blocks rank 1 of a nondet run with --progress says it sent.
func sentBlocks(j agent.Job) int {
	b, _ := os.ReadFile(j.StdoutPath())
	n := 0
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) == 5 && f[2] == "sent" {
			if k, err := strconv.Atoi(f[3]); err == nil {
				n = max(n, k)
			}
		}
	}
	return n
}

// waitExit waits for a job's exit record and returns it with the job's stdout and stderr.
func waitExit(t *testing.T, j agent.Job, timeout time.Duration) (*shim.ExitStatus, string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		st, err := shim.ReadExit(j.ExitPath())
		if err == nil {
			b, _ := os.ReadFile(j.StdoutPath())
			e, _ := os.ReadFile(j.StderrPath())
			return st, string(b) + string(e)
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s did not end within %s", j.ID, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stageOf is the recovery's last stage called name ("" for the last stage of all).
func stageOf(t *testing.T, f *agent.Failure, name string) agent.Stage {
	t.Helper()
	for i := len(f.Stages) - 1; i >= 0; i-- {
		if name == "" || f.Stages[i].Name == name {
			return f.Stages[i]
		}
	}
	t.Fatalf("recovery of %s has no stage %q", f.Node, name)
	return agent.Stage{}
}

var (
	resentRE   = regexp.MustCompile(`(\d+) bytes re-sent and discarded by the peers`)
	verifiedRE = regexp.MustCompile(`re-sent bytes verified: all (\d+) on \d+ connection`)
)

// resentBytes is how many bytes a replay stage says the restored job re-sent.
func resentBytes(t *testing.T, detail string) int {
	t.Helper()
	m := resentRE.FindStringSubmatch(detail)
	if m == nil {
		t.Fatalf("replay stage detail %q does not say how much was re-sent", detail)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// verifiedBytes is how many re-sent bytes a replay stage says were checked, all of them.
func verifiedBytes(t *testing.T, detail string) int {
	t.Helper()
	m := verifiedRE.FindStringSubmatch(detail)
	if m == nil {
		t.Fatalf("replay stage detail %q does not report every re-sent byte verified", detail)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// nondetReference runs both ranks on loopback without protection and returns their common checksum.
func nondetReference(t *testing.T, args []string) string {
	t.Helper()
	outs := loopbackRun(t, 1, 2, func(ctx context.Context, ports []int, r int) *exec.Cmd {
		a := append([]string{"--rank", fmt.Sprint(r), "--peer", fmt.Sprintf("127.0.0.1:%d", ports[0])}, args...)
		return exec.CommandContext(ctx, bins.Nondet, append(a, "--delay", "0s")...)
	})
	if a, b := checksumOf(t, outs[0]), checksumOf(t, outs[1]); a != b {
		t.Fatalf("reference ranks disagree: %s and %s", a, b)
	}
	return checksumOf(t, outs[0])
}

// TestOneWayStreamSenderCrash: rank 1 on node2 streams blocks to rank 0 on node1, which never sends a byte
// back (a pipeline stage, `socat -u`). node2 crashes mid-stream. Restoring rank 1 asks node1 for what rank 0
// sent since the snapshot: nothing, so node1's log never had the connection. The old restorer took that for
// a lost log and refused ("connection not in log"); the live flow state says nothing was sent, so there is
// nothing to replay, and the stream ends with the failure-free checksum.
func TestOneWayStreamSenderCrash(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	args := []string{"--iters", "600", "--block", fmt.Sprint(16 << 10), "--delay", "10ms", "--oneway", "--progress", "10"}
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	rg := crashMidRun(t, c, 7650, args, 100) // mid-stream: bytes past the snapshot re-sent
	f := waitFailure(t, c, "node2", 5*time.Minute)
	logTimeline(t, f)
	requireStages(t, f)
	replay := stageOf(t, f, agent.StageReplayed)
	if resent, verified := resentBytes(t, replay.Detail), verifiedBytes(t, replay.Detail); resent == 0 || verified != resent {
		t.Errorf("re-sent %d bytes, verified %d: want a real re-sent range, all verified (%s)", resent, verified, replay.Detail)
	}
	// The receiver's host shows its record in `ftctl status`: the stream digested, no hole.
	st, err := c.Client("node1").Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rs := st.Log.Received; rs.Book.Flows == 0 || rs.Book.Bytes == 0 || rs.Book.Holes != 0 || rs.Error != "" || rs.Tap.BytesRecorded == 0 {
		t.Errorf("node1's receive record %+v: want the stream digested, no hole, the recorder running", rs)
	}
	want := nondetReference(t, args)
	for r, j := range rg.jobs {
		st, out := waitExit(t, j, 2*time.Minute)
		if st.Code != 0 {
			t.Errorf("rank %d exited %d: %s", r, st.Code, out)
		} else if got := checksumOf(t, out); got != want {
			t.Errorf("rank %d checksum %s, failure-free run %s", r, got, want)
		}
	}
}

// TestDivergedRankBounded: rank 1 on node2 decides from the clock (nondet --resync-after: after a pause
// longer than 2 s it asks rank 0 to resync and waits for its answer). Its restored copy on spare1 finds
// that pause (the snapshot was taken more than 2 s before the restore), takes the other branch and waits
// for an answer rank 0 never sends: it never re-sends what rank 0 had received. The recovery must end
// within failover.replay_timeout with a clear failure naming the connection and the setting, kill the
// restored rank, and leave rank 0 to fail instead of going on: never a recovery that stays at "restored".
func TestDivergedRankBounded(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const (
		resyncAfter   = 2 * time.Second
		replayTimeout = 10 * time.Second
	)
	args := []string{"--iters", "4000", "--block", fmt.Sprint(64 << 10), "--delay", "10ms", "--resync-after", resyncAfter.String()}
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h", ReplayTimeout: replayTimeout})
	rg := startNondet(t, c, 7660, args)
	rg.waitProtected(t, 2*time.Minute)
	rg.checkpoint(t, "node2")
	// The premise of the divergence, not a guess: the restored copy must find more than resyncAfter
	// elapsed since the iteration its snapshot froze; meanwhile rank 0 receives blocks the copy must re-send.
	time.Sleep(resyncAfter)
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	f := waitFailure(t, c, "node2", 5*time.Minute)
	logTimeline(t, f)
	if f.Target != "spare1" {
		t.Fatalf("restored on %s, want spare1", f.Target)
	}
	if !strings.Contains(f.Error, "not transparently recoverable") {
		t.Errorf("recovery error %q does not say the job is not transparently recoverable", f.Error)
	}
	replay := stageOf(t, f, agent.StageReplayed)
	for _, w := range []string{"did not re-send", replayTimeout.String(), "failover.replay_timeout", "diverged"} {
		if !strings.Contains(replay.Error, w) {
			t.Errorf("replay stage error %q does not mention %q", replay.Error, w)
		}
	}
	// It gave the rank the configured time, no less (the bound is the setting, not an accident).
	if d := replay.Duration(); d < replayTimeout {
		t.Errorf("replay stage ended after %s, before failover.replay_timeout (%s)", d, replayTimeout)
	}
	if s := stageOf(t, f, ""); s.Name == agent.StageProtected && s.Error == "" {
		t.Errorf("the killed job was re-protected: %+v", s)
	}
	st, _ := waitExit(t, rg.jobs[1], time.Minute)
	if st.Node != "spare1" || st.Signal != "SIGKILL" {
		t.Errorf("restored rank 1 ended %+v, want killed on spare1", st)
	}
	if st, out := waitExit(t, rg.jobs[0], time.Minute); st.Code == 0 {
		t.Errorf("rank 0 completed (%s) although its peer diverged", out)
	}
}
