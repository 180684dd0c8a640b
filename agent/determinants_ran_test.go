package agent

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
)

// sinceScript is a protector that records the determinants-since requests it gets, and refuses them.
type sinceScript struct {
	clusterapi.Service
	mu   sync.Mutex
	reqs []clusterapi.DeterminantsSinceRequest
}

func (s *sinceScript) DeterminantsSince(_ context.Context, _ string, req clusterapi.DeterminantsSinceRequest) (clusterapi.DeterminantsSinceReply, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reqs = append(s.reqs, req)
	return clusterapi.DeterminantsSinceReply{}, errors.New("recorded")
}

// TestDeterminantsSinceNamesOnlyAnotherHost: a recovery names the host the job last ran on from its
// snapshot only when that is not the snapshot's own host. A member of the previous version decodes requests
// strictly and refuses one with a field it does not know: named always, every recovery with such a protector
// would have gone without its receive order.
func TestDeterminantsSinceNamesOnlyAnotherHost(t *testing.T) {
	pki := newTestPKI(t)
	n2 := &sinceScript{}
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2)})
	m := &ckpt.Manifest{Job: "j-00000001", ID: "20261207T120000.000Z-n3-000001", Node: "n3"}
	for _, ran := range []string{"n3", "s1"} {
		a.DeterminantsSince(t.Context(), "n2", m, ran)
	}
	n2.mu.Lock()
	defer n2.mu.Unlock()
	if len(n2.reqs) != 2 || n2.reqs[0].Ran != "" || n2.reqs[1].Ran != "s1" {
		t.Fatalf("requests %+v: want the first naming no host (the job last ran on the snapshot's), the second s1", n2.reqs)
	}
}
