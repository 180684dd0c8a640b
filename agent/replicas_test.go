package agent

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
)

// A protector receiving more snapshots of a job than checkpoint.keep keeps the newest keep of them.
func TestKeepReplicas(t *testing.T) {
	const keep, n = 2, 5
	open := func(node string) *ckpt.Store {
		s, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: node})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	origin, prot := open("node1"), open("prot")
	var cfg Config
	cfg.Checkpoint.Keep = keep
	a := &Agent{cfg: cfg, store: prot, log: slog.New(slog.DiscardHandler)}
	// The protector's own snapshot of the same job (it ran here once) is not the sender's to prune.
	own, err := prot.Begin("job")
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(own.Dir(), "pages-1.img"), []byte("own"), 0o600)
	mOwn, err := own.Commit(context.Background(), ckpt.Info{CRIUVersion: "4.2.1", Mode: ckpt.ModeUncoordinated})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := range n {
		p, err := origin.Begin("job")
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(p.Dir(), "pages-1.img"), []byte{byte(i)}, 0o600)
		m, err := p.Commit(context.Background(), ckpt.Info{CRIUVersion: "4.2.1", Mode: ckpt.ModeUncoordinated})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, m.ID)
		c1, c2 := net.Pipe()
		recv := make(chan *ship.Received, 1)
		go func() {
			defer c2.Close()
			got, err := ship.Receive(context.Background(), c2, prot, ship.ReceiveOptions{Peer: "node1", Authorize: ship.FromNode("node1")})
			if err != nil {
				t.Error(err)
			}
			recv <- got
		}()
		if _, err := ship.Send(context.Background(), c1, origin, "job", m.ID, ship.SendOptions{Peer: "prot"}); err != nil {
			t.Fatal(err)
		}
		c1.Close()
		got := <-recv
		if got == nil {
			t.FailNow()
		}
		a.keepReplicas(context.Background(), got)
	}
	left, _ := prot.List("job", "node1")
	if want := []string{ids[n-1], ids[n-2]}; !slices.Equal(left, want) {
		t.Errorf("protector holds %v, want the newest %d %v", left, keep, want)
	}
	if mine, _ := prot.List("job", "prot"); !slices.Equal(mine, []string{mOwn.ID}) {
		t.Errorf("protector's own snapshots %v, want %s kept", mine, mOwn.ID)
	}
}

// TestReplicaArrivalsSince: a failed node's jobs are those its last heartbeat named plus those whose
// replica arrived after that heartbeat (a job started and protected between the node's last beat and its
// crash, which no beat named: before, its failure listed no job and the job was never restored).
func TestReplicaArrivalsSince(t *testing.T) {
	var r replicaArrivals
	beat := time.Date(2026, 11, 26, 8, 16, 36, 44e6, time.UTC)
	r.arrived("node1", "old-1", beat.Add(-time.Second))
	r.arrived("node1", "late-2", beat.Add(177*time.Millisecond))
	r.arrived("node1", "late-1", beat.Add(time.Second))
	r.arrived("node1", "named", beat.Add(time.Second))
	r.arrived("node2", "other", beat.Add(time.Second))
	for _, tc := range []struct {
		node  string
		named []string
		want  []string
	}{
		{"node1", []string{"named"}, []string{"named", "late-1", "late-2"}},
		{"node1", nil, []string{"late-1", "late-2", "named"}},
		{"node3", []string{"x"}, []string{"x"}},
	} {
		if got := r.since(tc.node, beat, tc.named); !slices.Equal(got, tc.want) {
			t.Errorf("since(%s, %v) = %v, want %v", tc.node, tc.named, got, tc.want)
		}
	}
}
