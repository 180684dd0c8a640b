package agent

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/clusterapi"
)

// replicaHolder is a member that serves fetches from its store (a protector's replicas), counting them.
type replicaHolder struct {
	clusterapi.Service
	store   *ckpt.Store
	fetches atomic.Int32
}

func (h *replicaHolder) Fetch(ctx context.Context, peer string, req clusterapi.FetchRequest, c net.Conn) error {
	h.fetches.Add(1)
	_, err := ship.Send(ctx, c, h.store, req.Job, req.ID, ship.SendOptions{Peer: peer})
	return err
}

// cutSnapshot commits to s a snapshot carrying the record of job id of root's run farm.
func cutSnapshot(t *testing.T, s *ckpt.Store, id string) *ckpt.Manifest {
	t.Helper()
	p, err := s.Begin(id)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(Job{ID: id, Spec: JobSpec{Run: "farm"}})
	if err := os.WriteFile(filepath.Join(p.Dir(), snapJob), b, 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := p.Commit(t.Context(), ckpt.Info{Mode: ckpt.ModeUncoordinated})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestRollbackPartOnRejoinedHost: a rollback places a part on its own host n1 (Place: the job runs
// nowhere and its host is alive), which failed and rejoined without its copy of the part's snapshot. The
// prepare phase fetches it from the member holding the replica, and the rollback goes on. The old code
// fetched only for a part restored off its host: the prepare failed on the missing snapshot, and the run
// could not be rolled back while n1 stayed alive. A host that kept its copy fetches nothing.
func TestRollbackPartOnRejoinedHost(t *testing.T) {
	const job = "farm-n1-1"
	for _, tc := range []struct {
		name        string
		keptCopy    bool
		wantFetches int32
	}{
		{"rejoined without its copy", false, 1},
		{"kept its copy", true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pki := newTestPKI(t)
			holder := &replicaHolder{store: testStore(t, "n1")} // n1's snapshot, as n2 holds its replica
			m := cutSnapshot(t, holder.store, job)
			a, _ := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", holder)})
			if tc.keptCopy {
				m = cutSnapshot(t, a.store, job)
			}
			part := clusterapi.CutPart{Job: job, Host: "n1", Target: "n1", Snapshot: m.ID}
			ms, err := a.rollbackParts(t.Context(), "farm", 0, []clusterapi.CutPart{part})
			if err != nil {
				t.Fatalf("prepare of part %s on its own host n1: %v", m.ID, err)
			}
			if len(ms) != 1 || ms[0].ID != m.ID {
				t.Errorf("prepare verified %v, want snapshot %s", ms, m.ID)
			}
			if n := holder.fetches.Load(); n != tc.wantFetches {
				t.Errorf("%d fetches from the replica holder, want %d", n, tc.wantFetches)
			}
		})
	}
}
