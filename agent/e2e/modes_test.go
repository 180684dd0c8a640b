package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/lab/labcluster"
)

func TestCorruptSnapshotRefused(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", ManualFailover: true})
	ctx := context.Background()
	cmd, out, job := startWrapped(t, c, "node1", "count", "sh", "-c", `i=0; while [ $i -lt 300 ]; do echo $i; i=$((i+1)); sleep 0.03; done`)
	// The job's first snapshot, taken as it started, comes before the two this test takes.
	waitProtected(t, c, "node1", job, 2*time.Minute)
	var ids []string
	for i := 0; i < 2; i++ {
		time.Sleep(300 * time.Millisecond)
		r, err := c.Client("node1").Checkpoint(ctx, job)
		if err != nil || len(r.Results) != 1 || !r.Results[0].Shipped {
			t.Fatalf("checkpoint: %+v, %v", r, err)
		}
		ids = append(ids, r.Results[0].Manifest.ID)
	}
	// Flip one byte of the newest replica on node2 (node1's protector).
	dir := filepath.Join("/var/lib/ftkit/labs", c.Lab.State().ID, "node2", "snapshots", job, ids[1], "images")
	pages, _ := filepath.Glob(filepath.Join(dir, "pages-*.img"))
	if len(pages) == 0 {
		t.Fatalf("no pages image in %s", dir)
	}
	f, err := os.OpenFile(pages[0], os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	f.ReadAt(b, 100)
	b[0] ^= 0xff
	f.WriteAt(b, 100)
	f.Close()

	if err := c.Lab.Crash(ctx, "node1"); err != nil {
		t.Fatal(err)
	}
	_, err = c.Client("node2").Restore(ctx, agent.RestoreRequest{Snapshot: ids[1]})
	if err == nil {
		t.Fatal("restore from a corrupted snapshot succeeded")
	}
	msg := err.Error()
	for _, want := range []string{"snapshot failed verification", filepath.Base(pages[0]), "next older verified snapshot is " + ids[0]} {
		if !strings.Contains(msg, want) {
			t.Errorf("refusal %q does not mention %q", msg, want)
		}
	}
	// The older snapshot it offers restores, and the job finishes without a gap.
	if _, err := c.Client("node2").Restore(ctx, agent.RestoreRequest{Snapshot: ids[0]}); err != nil {
		t.Fatalf("restore of the offered older snapshot: %v", err)
	}
	if err := waitCmd(t, cmd, 60*time.Second); err != nil {
		t.Fatalf("ftwrap: %v", err)
	}
	var want strings.Builder
	for i := 0; i < 300; i++ {
		fmt.Fprintln(&want, i)
	}
	if out.String() != want.String() {
		t.Errorf("output: %s", firstDiff(out.String(), want.String()))
	}
}

// In semi-coordinated mode the jobs of a host are frozen together, so a connection between two of them
// is captured consistently: what one side has sent is exactly what the other side has received.
func TestSemiCoordinatedSnapshotIsConsistent(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1h", Mode: agent.SemiCoordinated})
	ctx := context.Background()
	peers := "127.0.0.1:7301,127.0.0.1:7302"
	var jobs []string
	for r := 0; r < 2; r++ {
		_, _, job := startWrapped(t, c, "node1", fmt.Sprintf("rank%d", r), bins.Ringstencil, "--rank", fmt.Sprint(r),
			"--peers", peers, "--iters", "100000", "--block", "4096")
		jobs = append(jobs, job)
	}
	time.Sleep(time.Second)
	for round := 0; round < 3; round++ {
		reply, err := c.Client("node1").Checkpoint(ctx)
		if err != nil || reply.Error != "" || len(reply.Results) != 2 {
			t.Fatalf("semi-coordinated checkpoint: %+v, %v", reply, err)
		}
		conns := map[string][]image.TCPConn{}
		for _, r := range reply.Results {
			if r.Manifest.Mode != agent.SemiCoordinated {
				t.Fatalf("manifest mode %q", r.Manifest.Mode)
			}
			dir := filepath.Join("/var/lib/ftkit/labs", c.Lab.State().ID, "node1", "snapshots", r.Manifest.Job, r.Manifest.ID, "images")
			cs, err := image.TCPConnections(dir)
			if err != nil {
				t.Fatal(err)
			}
			conns[r.Manifest.Job] = cs
		}
		// Match each connection of rank 0 with its other end in rank 1.
		matched := 0
		for _, a := range conns[jobs[0]] {
			for _, b := range conns[jobs[1]] {
				if a.Local != b.Remote || a.Remote != b.Local {
					continue
				}
				matched++
				for _, dir := range [][2]image.TCPConn{{a, b}, {b, a}} {
					snd, rcv := dir[0], dir[1]
					sndNxt := snd.OutqSeq - snd.UnsqLen
					if rcv.InqSeq != sndNxt {
						t.Errorf("round %d: %s -> %s not consistent: sender snd_nxt %d, receiver rcv_nxt %d", round, snd.Local, snd.Remote, sndNxt, rcv.InqSeq)
					}
				}
			}
		}
		if matched != 2 {
			t.Fatalf("round %d: matched %d connections between the ranks, want 2", round, matched)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// The host was thawed: both ranks still make progress.
	for _, j := range jobs {
		jj, err := c.Client("node1").Job(ctx, j)
		if err != nil || jj.State != agent.JobRunning {
			t.Fatalf("job %s after snapshots: %+v, %v", j, jj, err)
		}
		events, _ := os.ReadFile(filepath.Join(jj.Cgroup, "cgroup.events"))
		if !strings.Contains(string(events), "frozen 0") {
			t.Errorf("job %s left frozen: %s", j, events)
		}
	}
}

func TestPeriodicSnapshots(t *testing.T) {
	t.Parallel() // each test has its own lab
	c := newCluster(t, 2, 0, labcluster.Options{Interval: "1s"})
	ctx := context.Background()
	_, _, job := startWrapped(t, c, "node1", "sleeper", "sleep", "30")
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		ms, err := c.Client("node2").Snapshots(ctx, job)
		if err == nil && len(ms) >= 3 {
			return // three periodic snapshots, replicated on the protector
		}
		time.Sleep(200 * time.Millisecond)
	}
	ms, err := c.Client("node1").Snapshots(ctx, job)
	t.Fatalf("fewer than 3 replicated snapshots after 20s with a 1s interval: node1 holds %d (%v)", len(ms), err)
}
