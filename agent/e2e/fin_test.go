package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestRestoredReaderGetsPeersFIN: a one-way stream whose sender closed its side after the receiver's
// snapshot, its FIN acknowledged by the receiver's host before that host failed. The restored receiver
// gets the last block from the sender's log and the FIN from the recovery, reads to the end of the stream
// and ends with the sender's checksum. Before, the images held the block but not the FIN, which the sender
// never sends again once acknowledged: the restored receiver read the block and waited forever.
func TestRestoredReaderGetsPeersFIN(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const (
		port   = 7730
		block  = 64 << 10
		blocks = 40
	)
	c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
	ctx := context.Background()
	peer := hostPort(t, c, "node2", port)
	common := []string{"--peer", peer, "--iters", fmt.Sprint(blocks), "--block", fmt.Sprint(block), "--oneway", "--eof", "--progress", "1"}
	// The sender holds before its last block, the receiver before reading it: the receiver's snapshot
	// comes before the block and the FIN.
	sendArgs, releaseSend := gated(t, append([]string{"--rank", "1", "--delay", "1ms"}, common...), blocks-1)
	recvArgs, releaseRecv := gated(t, append([]string{"--rank", "0"}, common...), blocks-1)
	ch := &chain{c: c}
	ch.start(t, "node2", "reader", append([]string{bins.Nondet}, recvArgs...)...)
	ch.start(t, "node1", "writer", append([]string{bins.Nondet}, sendArgs...)...)
	recv, send := ch.jobs[0], ch.jobs[1]
	waitProtected(t, c, "node1", send.ID, 2*time.Minute)
	ch.waitReceived(t, recv, blocks-1, 2*time.Minute)
	m := snapshotNow(t, c, "node2", recv.ID)
	t.Logf("reader snapshotted (%s) after %d blocks", m.ID, blocks-1)

	releaseSend()
	ns, err := c.Lab.NetnsPath("node1")
	if err != nil {
		t.Fatal(err)
	}
	// FIN_WAIT2: node2's kernel acknowledged the writer's FIN (the reader, held, read none of it).
	poll(t, time.Minute, "the writer's FIN acknowledged by node2", func() bool {
		out, err := exec.Command("nsenter", "--net="+ns, "ss", "-Htn", "state", "fin-wait-2", "dst", peer).Output()
		return err == nil && len(strings.TrimSpace(string(out))) > 0
	})
	if err := c.Lab.Crash(ctx, "node2"); err != nil {
		t.Fatal(err)
	}
	releaseRecv() // the restored reader reads on
	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	requireStream(t, []agent.Job{recv, send}, blocks, block)
}

// TestRestoredWriterResendsItsFIN: a one-way stream whose sender closed its side after its own snapshot,
// the last bytes read and the FIN taken by the receiver's host (the receiver, held before the read that
// finds the end of the stream, waits in CLOSE_WAIT) before the sender's host failed. The restored sender
// sends what it sent since its snapshot and its FIN again; the recovery verifies both against what the
// receiver's host took (the FIN at the sequence it took it), and both ends finish with the generator's
// checksum. Before, the receiver's record ended one byte short of what it acknowledged (the FIN takes a
// sequence number, and nothing records it), and the recovery refused the sender's re-sent bytes as
// unverifiable and killed it. In the second row the sender had sent every byte before its snapshot: it
// re-sends its FIN alone, against a record of no byte.
func TestRestoredWriterResendsItsFIN(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	const (
		block  = 64 << 10
		blocks = 40
	)
	for i, tt := range []struct {
		name string
		held int // the block the sender is held before for its snapshot (blocks: before it closes)
	}{
		{"the last block and the FIN", blocks - 1},
		{"the FIN alone", blocks},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel() // each row has its own lab
			c := newCluster(t, 3, 1, labcluster.Options{Interval: "1h"})
			ctx := context.Background()
			peer := hostPort(t, c, "node2", uint16(7736+i))
			common := []string{"--peer", peer, "--iters", fmt.Sprint(blocks), "--block", fmt.Sprint(block), "--oneway", "--eof", "--progress", "1"}
			// The receiver holds before the read that finds the end of the stream: it closes its side only
			// after the recovery.
			sendArgs, releaseSend := gated(t, append([]string{"--rank", "1", "--delay", "1ms"}, common...), tt.held)
			recvArgs, releaseRecv := gated(t, append([]string{"--rank", "0"}, common...), blocks)
			ch := &chain{c: c}
			ch.start(t, "node2", "reader", append([]string{bins.Nondet}, recvArgs...)...)
			ch.start(t, "node1", "writer", append([]string{bins.Nondet}, sendArgs...)...)
			recv, send := ch.jobs[0], ch.jobs[1]
			waitProtected(t, c, "node1", send.ID, 2*time.Minute)
			ch.waitReceived(t, recv, tt.held, 2*time.Minute) // the writer is held there
			m := snapshotNow(t, c, "node1", send.ID)
			t.Logf("writer snapshotted (%s) after %d blocks", m.ID, tt.held)

			releaseSend()
			ns, err := c.Lab.NetnsPath("node1")
			if err != nil {
				t.Fatal(err)
			}
			// The reader read the last block, and node2's kernel acknowledged the writer's FIN (FIN_WAIT2).
			ch.waitReceived(t, recv, blocks, 2*time.Minute)
			poll(t, time.Minute, "the writer's FIN acknowledged by node2", func() bool {
				out, err := exec.Command("nsenter", "--net="+ns, "ss", "-Htn", "state", "fin-wait-2", "dst", peer).Output()
				return err == nil && len(strings.TrimSpace(string(out))) > 0
			})
			if err := c.Lab.Crash(ctx, "node1"); err != nil {
				t.Fatal(err)
			}
			f := waitFailure(t, c, "node1", 5*time.Minute)
			requireStages(t, f)
			releaseRecv() // the reader reads on, to the end of the stream, and closes
			requireStream(t, []agent.Job{recv, send}, blocks, block)
		})
	}
}
