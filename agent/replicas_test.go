package agent

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/clusterapi"
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

// replicaService is a protector that only stores the snapshots it is sent.
type replicaService struct {
	clusterapi.Service
	store *ckpt.Store
}

func (s replicaService) ReceiveSnapshot(ctx context.Context, peer string, c net.Conn) error {
	_, err := ship.Receive(ctx, c, s.store, ship.ReceiveOptions{Peer: peer, Authorize: ship.FromNode(peer)})
	return err
}

// The agent's scheduled snapshots go whole after a diff that saved nothing (ship.DiffHistory), over mutual
// TLS to the protector of its ring: a job that rewrites all its memory pays no diffs it gains nothing
// from, and one that rewrites a little keeps diffing.
func TestShipToProtectorSkipsUselessDiffs(t *testing.T) {
	pki := newTestPKI(t)
	prot, err := ckpt.Open(filepath.Join(t.TempDir(), "prot"), ckpt.Options{Node: "n2"})
	if err != nil {
		t.Fatal(err)
	}
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", replicaService{store: prot})})
	rng := rand.NewChaCha8([32]byte{1})
	pages := make([]byte, 2<<20)
	for _, tt := range []struct {
		job       string
		rewritten int // of every 10 pages, between two snapshots
		want      []bool
	}{
		// The first snapshot has no base; the second diffs and shares nothing; four go whole; a diff again.
		{"all-00000001", 10, []bool{false, true, false, false, false, false, true}},
		{"tenth-00000001", 1, []bool{false, true, true, true, true, true, true}},
	} {
		var got []bool
		for i := range tt.want {
			for p := 0; p < len(pages)/4096; p++ {
				if i == 0 || p%10 < tt.rewritten {
					rng.Read(pages[p*4096 : (p+1)*4096])
				}
			}
			pend, err := a.store.Begin(tt.job)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(pend.Dir(), "pages-1.img"), pages, 0o600); err != nil {
				t.Fatal(err)
			}
			m, err := pend.Commit(t.Context(), ckpt.Info{CRIUVersion: "4.2.1", Mode: ckpt.ModeUncoordinated})
			if err != nil {
				t.Fatal(err)
			}
			sent, err := a.shipToProtector(t.Context(), m, nil)
			if err != nil {
				t.Fatalf("%s, snapshot %d: %v", tt.job, i, err)
			}
			if _, err := prot.Verify(t.Context(), tt.job, m.ID); err != nil {
				t.Fatalf("%s, snapshot %d: the protector's copy: %v", tt.job, i, err)
			}
			got = append(got, sent.BaseID != "")
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s: diffed %v, want %v", tt.job, got, tt.want)
		}
	}
}
