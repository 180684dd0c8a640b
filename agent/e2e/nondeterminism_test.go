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
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestResentBytesVerified: a two-rank ping-pong (testdata/nondet), rank 1 on node2, which crashes a while
// after its snapshot. Its restored copy on spare1 re-sends the blocks rank 0 already received; the target
// compares them with node2's digests. A deterministic rank 1 re-sends the same bytes: verified, and the run
// ends with the failure-free checksum. A rank 1 whose bytes depend on the wall clock re-sends different
// ones: the recovery says it is not transparently recoverable, the restored rank is killed, and the run
// does not go on.
func TestResentBytesVerified(t *testing.T) {
	const iters, block = 600, 64 << 10
	tests := []struct {
		name  string
		clock bool
	}{
		{name: "deterministic"},
		{name: "wall-clock bytes", clock: true},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := []string{"--iters", fmt.Sprint(iters), "--block", fmt.Sprint(block), "--delay", "10ms"}
			if tt.clock {
				args = append(args, "--clock")
			}
			c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
			rg := startNondet(t, c, 7600+i, args)
			// The ranks' first snapshots, taken as they started, come before the one this test takes.
			rg.waitProtected(t, 2*time.Minute)
			time.Sleep(time.Second)
			rg.checkpoint(t, "node2")
			// Long enough for many whole blocks past the snapshot, and for node2's digests of most of them
			// to reach its protector.
			time.Sleep(1500 * time.Millisecond)
			if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
				t.Fatal(err)
			}
			f := waitFailure(t, c, "node2", 90*time.Second)
			logTimeline(t, f)
			if f.Target != "spare1" {
				t.Fatalf("restored on %s, want spare1", f.Target)
			}
			replay := stageOf(t, f, agent.StageReplayed)
			verified, total := verifiedBlocks(t, replay.Detail)
			if !tt.clock {
				requireStages(t, f)
				if verified == 0 || total < 16 {
					t.Errorf("verified %d of %d re-sent blocks; want a real re-sent range, mostly verified", verified, total)
				}
				if strings.Contains(replay.Detail, "this host's log") {
					t.Errorf("re-sent blocks missing from the target's log: %s", replay.Detail)
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
			for _, w := range []string{"non-deterministic", "CRC-32C", "re-sent"} {
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
			if st.Node != "spare1" || st.Signal != "SIGKILL" {
				t.Errorf("restored rank 1 ended %+v, want killed on spare1", st)
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

// waitExit waits for a job's exit record and returns it with the job's stdout and stderr.
func waitExit(t *testing.T, j agent.Job, timeout time.Duration) (*agent.ExitStatus, string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		st, err := agent.ReadExit(j.ExitPath())
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

var verifiedRE = regexp.MustCompile(`re-sent bytes verified: (\d+) of (\d+) blocks`)

func verifiedBlocks(t *testing.T, detail string) (verified, total int) {
	t.Helper()
	m := verifiedRE.FindStringSubmatch(detail)
	if m == nil {
		t.Fatalf("replay stage detail %q does not report the verification", detail)
	}
	verified, _ = strconv.Atoi(m[1])
	total, _ = strconv.Atoi(m[2])
	return verified, total
}

// nondetReference runs both ranks on loopback without protection and returns their common checksum.
func nondetReference(t *testing.T, args []string) string {
	t.Helper()
	peer := fmt.Sprintf("127.0.0.1:%d", freeLoopbackPorts(t, 1)[0])
	outs := make([]string, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := append([]string{"--rank", fmt.Sprint(r), "--peer", peer}, args...)
			a = append(a, "--delay", "0s")
			b, err := exec.Command(bins.Nondet, a...).CombinedOutput()
			outs[r], errs[r] = string(b), err
		}()
	}
	wg.Wait()
	for r := range 2 {
		if errs[r] != nil {
			t.Fatalf("reference rank %d: %v: %s", r, errs[r], outs[r])
		}
	}
	if a, b := checksumOf(t, outs[0]), checksumOf(t, outs[1]); a != b {
		t.Fatalf("reference ranks disagree: %s and %s", a, b)
	}
	return checksumOf(t, outs[0])
}
