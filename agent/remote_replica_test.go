package agent

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
)

// replicaScript is a member that answers pings (unless it hangs, as behind a partition) and holds a replica.
type replicaScript struct {
	clusterapi.Service
	name     string
	hang     bool
	m        *ckpt.Manifest // nil: it holds none
	replicas atomic.Int32   // the questions for a replica it got
}

func (s *replicaScript) Ping(ctx context.Context, _ string) (clusterapi.PingReply, error) {
	if s.hang {
		<-ctx.Done()
		return clusterapi.PingReply{}, ctx.Err()
	}
	return clusterapi.PingReply{Node: s.name}, nil
}

func (s *replicaScript) Replica(context.Context, string, clusterapi.ReplicaRequest) (clusterapi.ReplicaReply, error) {
	s.replicas.Add(1)
	if s.m == nil {
		return clusterapi.ReplicaReply{}, fmt.Errorf("no replica here")
	}
	return clusterapi.ReplicaReply{Manifest: s.m}, nil
}

// TestRemoteReplicaSkipsUnreachable: the recovery's question for replicas goes to the members that answer a
// ping within the probe timeout, all at once. A member cut off by a partition (its pings unanswered) is not
// asked: asked in turn as before, it held the recovery for the question's whole bound (30 s by default;
// measured in a lab partition of two nodes: 30 s between "detected" and "spare claimed").
func TestRemoteReplicaSkipsUnreachable(t *testing.T) {
	pki := newTestPKI(t)
	const job = "work-n3-1"
	m := cutSnapshot(t, testStore(t, "n3"), job)
	holder := &replicaScript{name: "n2", m: m}
	cutOff := &replicaScript{name: "s1", hang: true, m: m}
	a, _ := clientAgent(t, pki, map[string]uint16{
		"n2": scriptedPeer(t, pki, "n2", holder),
		"s1": scriptedPeer(t, pki, "s1", cutOff),
	}) // s2's port refuses
	a.cfg.Heartbeat.ProbeTimeout.Duration = 200 * time.Millisecond
	held, err := a.remoteReplica(t.Context(), job, "n3")
	if err != nil || len(held) != 1 || held[0].holder != "n2" || held[0].m.ID != m.ID {
		t.Fatalf("remoteReplica = %+v, %v; want n2's replica %s", held, err, m.ID)
	}
	if n := cutOff.replicas.Load(); n != 0 {
		t.Errorf("the member that does not answer pings was asked for its replica %d time(s)", n)
	}
	if n := holder.replicas.Load(); n != 1 {
		t.Errorf("the holder was asked %d time(s), want once", n)
	}

	// None answers with one: the error names each member and why.
	holder.m = nil
	if _, err := a.remoteReplica(t.Context(), job, "n3"); err == nil || !strings.Contains(err.Error(), "s1 does not answer") || !strings.Contains(err.Error(), "no replica here") {
		t.Errorf("remoteReplica without a holder: %v; want why each member has none", err)
	}
}
