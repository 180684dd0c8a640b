package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestSocatRelayChain is issue 11's pipeline: a protected source on node1 streams 512 MiB through three
// Debian `socat -u TCP-LISTEN:P TCP:next:P` relays on node2, node3 and node4 into a protected sink back on
// node1, every process a job under its host's agent. The middle relay's host, node3, is snapshotted and
// power-cut mid-stream. Both of the relay's connections are one-way: node2 sends to it and hears nothing
// back but ACKs, and node4 never sends it a payload byte, so the restore finds nothing of node4's in any
// log (the case that once stopped recovery with "connection not in log"). The relay comes back on spare1,
// gets node2's logged bytes again, re-sends to node4 what node4 already had (every byte checked against
// node4's receive record), and the sink's SHA-256 is the source's.
func TestSocatRelayChain(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	requirePrograms(t, "socat")
	socat, _ := exec.LookPath("socat") // a job's PATH is its own: an absolute path
	const (
		port   = 7700
		block  = 64 << 10
		blocks = 8192 // 512 MiB
		// every is the sink's progress granularity: 4 MiB.
		every = 64
	)
	c := newCluster(t, 4, 1, labcluster.Options{Interval: "1h"})
	addr := func(host string) string { return hostPort(t, c, host, port) }
	// The source holds before its last 64 MiB until the crash is over: the stream cannot end before the
	// fault, however slow the machine. It sleeps 2 ms a block (about 30 MiB/s): the log of what node2 sends
	// node3 past the snapshot stays a few hundred MiB at most on a slow machine.
	withGate, release := gated(t, []string{"--rank", "1", "--peer", addr("node2"), "--iters", fmt.Sprint(blocks),
		"--block", fmt.Sprint(block), "--delay", "2ms", "--oneway", "--progress", fmt.Sprint(every)}, blocks-1024)
	// Started downstream first, so that each relay's connect finds its next hop listening; the retry only
	// covers a listener still coming up.
	ch := &chain{c: c}
	ch.start(t, "node1", "sink", bins.Nondet, "--rank", "0", "--peer", addr("node1"), "--iters", fmt.Sprint(blocks),
		"--block", fmt.Sprint(block), "--oneway", "--progress", fmt.Sprint(every))
	next := "node1"
	for _, host := range []string{"node4", "node3", "node2"} {
		ch.start(t, host, "relay-"+host, socat, "-u", fmt.Sprintf("TCP-LISTEN:%d,reuseaddr", port),
			fmt.Sprintf("TCP:%s,retry=100,interval=0.1", addr(next)))
		next = host
	}
	ch.start(t, "node1", "source", append([]string{bins.Nondet}, withGate...)...)
	defer release()
	for _, j := range ch.jobs {
		waitProtected(t, c, j.Node, j.ID, 2*time.Minute)
	}
	sink := ch.jobs[0]

	// The stream flows through every relay: the snapshot has the middle relay's connections established.
	ch.waitReceived(t, sink, 8*every, 2*time.Minute)
	before := map[string]agent.Job{}
	for _, j := range ch.jobs {
		if j.Node != "node3" {
			before[j.ID] = ch.job(t, j.Node, j.ID)
		}
	}
	atSnapshot := ch.received(sink)
	reply, err := c.Client("node3").Checkpoint(context.Background())
	if err != nil || reply.Error != "" || len(reply.Results) == 0 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint of node3: %+v %v", reply, err)
	}
	// Mid-stream: 32 MiB more reach the sink after the snapshot, which the restored relay re-sends.
	ch.waitReceived(t, sink, ch.received(sink)+8*every, 2*time.Minute)
	atCrash := ch.received(sink)
	if err := c.Lab.Crash(context.Background(), "node3"); err != nil {
		t.Fatal(err)
	}
	t.Logf("node3 snapshotted with %d MiB at the sink, crashed with %d MiB there", atSnapshot*block>>20, atCrash*block>>20)
	f := waitFailure(t, c, "node3", 5*time.Minute)
	requireStages(t, f)
	if f.Target != "spare1" || f.Basic {
		t.Errorf("restored on %s (basic %v), want spare1", f.Target, f.Basic)
	}
	replay := stageOf(t, f, agent.StageReplayed)
	if resent, verified := resentBytes(t, replay.Detail), verifiedBytes(t, replay.Detail); resent == 0 || verified != resent {
		t.Errorf("re-sent %d bytes, verified %d: want a real re-sent range, all verified (%s)", resent, verified, replay.Detail)
	}
	// The restored relay's own snapshot (re-protection) can check what a restore of it would re-send on
	// both its connections: on spare1, which never saw their handshakes nor the bytes sent before the
	// restore, each prefix extends the one of the snapshot it was restored from. Without that the
	// re-protection waited 5 s for those bytes in spare1's log, in vain, and went without the prefixes.
	relay := ch.job(t, "spare1", ch.jobs[2].ID)
	if relay.Replica == nil || len(relay.Replica.Unrecoverable) != 0 || relay.Restored == "" {
		t.Errorf("the restored relay: replica %+v, restored from %q", relay.Replica, relay.Restored)
	} else {
		m, from := manifestOn(t, c, "spare1", relay.ID, relay.Replica.Snapshot), manifestOn(t, c, "spare1", relay.ID, relay.Restored)
		if len(m.Conns) != 2 {
			t.Errorf("the restored relay's snapshot %s has %d connections, want 2: %+v", m.ID, len(m.Conns), m.Conns)
		}
		for _, cn := range m.Conns {
			if cn.SentPrefix == nil {
				t.Errorf("the restored relay's snapshot %s has no sent prefix for %s: a restore re-sending on it would be refused", m.ID, cn.Tuple)
				continue
			}
			t.Logf("re-protection snapshot, %s: write_seq %d, prefix %+v", cn.Tuple, cn.OutqSeq, *cn.SentPrefix)
			// Upstream the relay sent nothing since: the same bytes before write_seq, the same prefix.
			for _, fc := range from.Conns {
				if fc.Tuple != cn.Tuple || fc.OutqSeq != cn.OutqSeq {
					continue
				}
				t.Logf("restored snapshot, %s: write_seq %d, prefix %+v", fc.Tuple, fc.OutqSeq, fc.SentPrefix)
				if fc.SentPrefix == nil || *fc.SentPrefix != *cn.SentPrefix {
					t.Errorf("%s: prefix %+v at write_seq %d, the restored snapshot's %+v at the same", cn.Tuple, *cn.SentPrefix, cn.OutqSeq, fc.SentPrefix)
				}
			}
		}
	}
	release()

	want := streamSum(blocks, block)
	for _, j := range ch.jobs {
		st, out := waitExit(t, j, 3*time.Minute)
		if st.Code != 0 || st.Signal != "" {
			t.Errorf("job %s (%s) ended %+v on %s: %s", j.Spec.Name, j.ID, st, st.Node, tail(out))
			continue
		}
		switch j.Spec.Name {
		case "sink", "source":
			if got := checksumOf(t, out); got != want {
				t.Errorf("%s checksum %s, want the generator's %s", j.Spec.Name, got, want)
			} else {
				t.Logf("%s: sha256 %s of %d MiB, the generator's", j.Spec.Name, got, blocks*block>>20)
			}
		}
	}
	// The survivors never stopped: same process, never restored.
	for id, b := range before {
		if a := ch.job(t, b.Node, id); a.PID != b.PID || a.Restored != "" {
			t.Errorf("job %s on %s was disturbed: pid %d -> %d, restored from %q", b.Spec.Name, b.Node, b.PID, a.PID, a.Restored)
		}
	}
	if j := ch.job(t, "spare1", ch.jobs[2].ID); j.Node != "spare1" || j.Restored == "" {
		t.Errorf("the middle relay on spare1: %+v", j)
	}
}

// manifestOn reads the manifest of snapshot id of job in host's store.
func manifestOn(t *testing.T, c *labcluster.Cluster, host, job, id string) *ckpt.Manifest {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(storeDir(c, host, job), id, ckpt.ManifestName))
	if err != nil {
		t.Fatal(err)
	}
	m, err := ckpt.DecodeManifest(b)
	if err != nil {
		t.Fatalf("snapshot %s on %s: %v", id, host, err)
	}
	return m
}

// chain is the pipeline's jobs, each started through its host's agent, in the order started.
type chain struct {
	c    *labcluster.Cluster
	jobs []agent.Job
}

// start starts argv as job name on host; a failed test logs every job's output.
func (ch *chain) start(t *testing.T, host, name string, argv ...string) {
	t.Helper()
	j, err := ch.c.Client(host).StartJob(context.Background(), agent.JobSpec{Name: name, Argv: argv})
	if err != nil {
		t.Fatalf("start %s on %s: %v", name, host, err)
	}
	if len(ch.jobs) == 0 {
		t.Cleanup(func() {
			if t.Failed() {
				for _, j := range ch.jobs {
					b, _ := os.ReadFile(j.StdoutPath())
					e, _ := os.ReadFile(j.StderrPath())
					x, _ := os.ReadFile(j.ExitPath())
					t.Logf("%s (job %s): stdout %q stderr %q exit %s", j.Spec.Name, j.ID, tail(string(b)), tail(string(e)), x)
				}
			}
		})
	}
	ch.jobs = append(ch.jobs, j)
}

// job is a job as host's agent lists it now.
func (ch *chain) job(t *testing.T, host, id string) agent.Job {
	t.Helper()
	j, err := ch.c.Client(host).Job(context.Background(), id)
	if err != nil {
		t.Fatalf("job %s on %s: %v", id, host, err)
	}
	return j
}

var receivedRE = regexp.MustCompile(`rank 0 received (\d+) blocks`)

// received is how many blocks the sink reports received so far.
func (ch *chain) received(j agent.Job) int {
	b, _ := os.ReadFile(j.StdoutPath())
	m := receivedRE.FindAllSubmatch(b, -1)
	if len(m) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(string(m[len(m)-1][1]))
	return n
}

// waitReceived waits until the sink reports at least n blocks received; timeout is a failure bound only.
func (ch *chain) waitReceived(t *testing.T, sink agent.Job, n int, timeout time.Duration) {
	t.Helper()
	poll(t, timeout, fmt.Sprintf("the sink to receive %d blocks", n), func() bool { return ch.received(sink) >= n })
}

// requireStream waits for each job's end and requires it to have ended well with the checksum of the
// stream `nondet --oneway` sends (streamSum), as both its ends print it.
func requireStream(t *testing.T, jobs []agent.Job, blocks, block int) {
	t.Helper()
	want := streamSum(blocks, block)
	for _, j := range jobs {
		st, out := waitExit(t, j, 3*time.Minute)
		if st.Code != 0 || st.Signal != "" {
			t.Errorf("job %s ended %+v on %s: %s", j.Spec.Name, st, st.Node, tail(out))
			continue
		}
		if got := checksumOf(t, out); got != want {
			t.Errorf("%s checksum %s, want the generator's %s", j.Spec.Name, got, want)
		}
	}
}

// streamSum is the SHA-256 of the stream `nondet --oneway` sends (rank 1, without --clock): block i is
// drawn from a PCG seeded with i.
func streamSum(blocks, block int) string {
	h := sha256.New()
	buf := make([]byte, block)
	for i := range blocks {
		r := rand.New(rand.NewPCG(uint64(i), 0x6e6f6e646574))
		for off := 0; off < len(buf); off += 8 {
			binary.LittleEndian.PutUint64(buf[off:], r.Uint64())
		}
		h.Write(buf)
	}
	return hex.EncodeToString(h.Sum(nil))
}
