package agent

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
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

// pruningProtector stores the snapshots it is sent and prunes the sender's replicas of the job as a
// protector does with checkpoint.keep = 1 (keepReplicas), keeping those pinned says a cut it recorded names.
type pruningProtector struct {
	clusterapi.Service
	store  *ckpt.Store
	pinned func() []string
}

func (s pruningProtector) ReceiveSnapshot(ctx context.Context, peer string, c net.Conn) error {
	got, err := ship.Receive(ctx, c, s.store, ship.ReceiveOptions{Peer: peer, Authorize: ship.FromNode(peer)})
	if err != nil {
		return err
	}
	_, err = s.store.PruneReceived(ctx, got.Manifest.Job, got.Manifest.Node, 1, got.Manifest.ID, s.pinned()...)
	return err
}

// TestCutSnapshotKeptOnProtectorUntilCommit: with checkpoint.keep = 1, a job's cut snapshot is replicated at
// the cut's thaw, and a later snapshot of the job (its schedule, an operator's) is shipped before the cut's
// commit has reached the protector, which pins nothing of the cut until it records it. The later snapshot's
// replication waits for the commit, and the protector keeps the cut's replica. Before, the protector pruned
// it at once: the cut was committed with its part's only copy on the part's host, and that host's failure,
// which the cut is there to outlive, left the run no cut to roll back to.
func TestCutSnapshotKeptOnProtectorUntilCommit(t *testing.T) {
	pki := newTestPKI(t)
	prot, err := ckpt.Open(filepath.Join(t.TempDir(), "prot"), ckpt.Options{Node: "n2"})
	if err != nil {
		t.Fatal(err)
	}
	var committed atomic.Bool
	var cutSnap string
	svc := pruningProtector{store: prot, pinned: func() []string {
		if committed.Load() { // the protector's record of the cut, from its commit on
			return []string{cutSnap}
		}
		return nil
	}}
	a, logs := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", svc)})
	const job, key, cut = "farm-00000001", "0/farm", "cut-20261203T100000.000"
	snapshot := func(b byte) *ckpt.Manifest {
		pend, err := a.store.Begin(job)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(pend.Dir(), "pages-1.img"), []byte{b}, 0o600); err != nil {
			t.Fatal(err)
		}
		m, err := pend.Commit(t.Context(), ckpt.Info{CRIUVersion: "4.2.1", Mode: ckpt.ModeUncoordinated})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	// The cut's dump, pinned here and replicated at its thaw (coordThaw).
	x := snapshot(1)
	cutSnap = x.ID
	a.uncommitted.Add(key, cut, "node2", []*ckpt.Manifest{x})
	if _, err := a.shipToProtector(t.Context(), x, nil); err != nil {
		t.Fatalf("the cut's replication: %v", err)
	}
	// The next snapshot of the job, before the commit.
	y := snapshot(2)
	done := make(chan error, 1)
	go func() {
		_, err := a.shipToProtector(t.Context(), y, nil)
		done <- err
	}()
	var shipErr error
	shipped := false
	for deadline := time.Now().Add(failAfter); !shipped && !strings.Contains(logs.String(), "waits for the commit"); time.Sleep(time.Millisecond) {
		select {
		case shipErr = <-done:
			shipped = true
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s neither shipped nor waiting after %s", y.ID, failAfter)
		}
	}
	// The commit: the protector records the cut (its record pins the cut's snapshot), then this host does.
	committed.Store(true)
	a.uncommitted.Done(key, cut, "node2")
	if !shipped {
		select {
		case shipErr = <-done:
		case <-time.After(failAfter):
			t.Fatalf("snapshot %s still not shipped %s after the cut's commit", y.ID, failAfter)
		}
	}
	if shipErr != nil {
		t.Fatalf("replication of %s: %v", y.ID, shipErr)
	}
	left, _ := prot.List(job, "n1")
	if !slices.Contains(left, x.ID) || !slices.Contains(left, y.ID) {
		t.Errorf("protector holds %v of job %s; want the cut's %s (committed) and the newer %s", left, job, x.ID, y.ID)
	}
}
