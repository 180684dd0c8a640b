package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/grant"
)

// TestGiveBackOrphanClaims: an agent killed after its claim of a job's next incarnation and before the
// restored job's record left the incarnation held by a restore that never ran; every later restore of
// the job, here or elsewhere, was refused. The restarted agent gives such claims back, and only those.
func TestGiveBackOrphanClaims(t *testing.T) {
	ta := newTestAgent(t)
	ta.failMember(t, "node2") // this agent alone grants
	const (
		orphan   = "orphan-00000001" // claimed, then the agent died: no record, empty cgroup
		starting = "start-00000001"  // claimed, no record yet, but its cgroup has processes (CRIU ran)
	)
	ta.mu.Lock()
	ta.byID[rootsJob].Incarnation = 1 // restored here as incarnation 1: the claim ran
	ta.mu.Unlock()
	cg := filepath.Join(ta.cfg.CgroupParent, starting)
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cg, "cgroup.events"), []byte("populated 1\nfrozen 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	held := map[string]string{orphan: "node1", starting: "node1", rootsJob: "node1", goneJob: "node2"}
	for job, host := range held {
		if _, err := ta.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: "restore:dead", Host: host}, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	// Before: a new restore of the orphaned incarnation is refused as if the job ran here.
	if err := ta.claimIncarnation(t.Context(), orphan, 1, "restore:new", ""); !errors.Is(err, grant.ErrConflict) {
		t.Fatalf("claim before the restart: %v, want a refusal", err)
	}

	ta.giveBackOrphanClaims(t.Context())

	for job, host := range held {
		rec, _ := ta.grants.Lookup(job)
		if want := job == orphan; rec.Released != want {
			t.Errorf("job %s (held on %s): released %v, want %v", job, host, rec.Released, want)
		}
	}
	if err := ta.claimIncarnation(t.Context(), orphan, 1, "restore:new", ""); err != nil {
		t.Fatalf("claim after the restart: %v, want the incarnation given back", err)
	}
}

// TestGiveBackOrphanClaimsKeepsRunningShim: an agent killed while CRIU restored a job leaves the job's shim
// (its own session) restoring, into a cgroup that stays empty until CRIU forks the tree; the job then runs
// here without a record. The restarted agent must keep that incarnation claimed: given back, a fail-over
// elsewhere could claim it and run a second copy.
func TestGiveBackOrphanClaimsKeepsRunningShim(t *testing.T) {
	ta := newTestAgent(t)
	ta.failMember(t, "node2") // this agent alone grants

	const job = "restoring-00000001" // claimed, no record, no cgroup yet: its shim's CRIU is still at work
	if _, err := ta.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: "failover:dead", Host: "node1"}, time.Now()); err != nil {
		t.Fatal(err)
	}
	// The shim holds its log open as its standard error for as long as it lives; this test stands in for it.
	shimLog, err := os.OpenFile(ta.shimLog(job), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer shimLog.Close()

	ta.giveBackOrphanClaims(t.Context())

	if rec, _ := ta.grants.Lookup(job); rec.Released {
		t.Fatal("the incarnation of a restore whose shim runs was given back")
	}
	if err := ta.claimIncarnation(t.Context(), job, 1, "restore:new", ""); !errors.Is(err, grant.ErrConflict) {
		t.Fatalf("claim while the shim restores: %v, want a refusal", err)
	}

	shimLog.Close() // the shim ended: what it restored has no record and no process here
	ta.giveBackOrphanClaims(t.Context())
	if rec, _ := ta.grants.Lookup(job); !rec.Released {
		t.Fatal("the incarnation of a restore whose shim is gone was kept")
	}
}

// lateRelease serves the grants of an agent whose answer to a give-back comes after the asker stopped
// waiting for it (a slow disk, a lost segment): the give-back is applied after the next grant request,
// or after 2 s if none comes.
type lateRelease struct {
	peerService
	grants    atomic.Int32
	regranted chan struct{} // closed when a grant request after the first was answered
	applied   chan struct{} // closed when the give-back was applied
}

func (s *lateRelease) Grant(ctx context.Context, peer string, req clusterapi.GrantRequest) (clusterapi.GrantReply, error) {
	if req.Release {
		select {
		case <-s.regranted:
		case <-time.After(2 * time.Second):
		}
		defer close(s.applied)
		return s.peerService.Grant(ctx, peer, req)
	}
	rep, err := s.peerService.Grant(ctx, peer, req)
	if s.grants.Add(1) == 2 {
		close(s.regranted)
	}
	return rep, err
}

// givesWay refuses the first request with a rival's grant, which the rival then gives back: a contended
// first attempt, a free second one.
type givesWay struct {
	peerService
	once              sync.Once
	job, rival, rhost string
}

func (s *givesWay) Grant(ctx context.Context, peer string, req clusterapi.GrantRequest) (clusterapi.GrantReply, error) {
	rep, err := s.peerService.Grant(ctx, peer, req)
	s.once.Do(func() {
		err = errors.Join(err, s.a.grants.Release(s.job, req.Incarnation, s.rival, s.rhost, time.Now()))
	})
	return rep, err
}

// TestLateGiveBackKeepsWinningGrant: a claim of n1 contended in its first attempt gives its grants back and
// tries again under the same holder. Member n2 applied the give-back only after it granted the second
// attempt (the asker had stopped waiting for its answer, and a member serves requests concurrently, each
// to its end), and recorded the winning grant as given back. A restore on s1, cut off from n1 and n3 that
// hold n1's grant, then got a majority from s1, n2 and s2, overlapping n1's only at n2: both ran the job.
func TestLateGiveBackKeepsWinningGrant(t *testing.T) {
	const job = "late-00000001"
	pki := newTestPKI(t)
	member := func(name string, ports map[string]uint16) *Agent { return grantMember(t, pki, name, ports) }
	n2 := &lateRelease{peerService: peerService{member("n2", nil)}, regranted: make(chan struct{}), applied: make(chan struct{})}
	n3 := &givesWay{peerService: peerService{member("n3", nil)}, job: job, rival: "restore:rival", rhost: "s2"}
	if _, err := n3.a.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: n3.rival, Host: n3.rhost}, time.Now()); err != nil {
		t.Fatal(err)
	}
	s2 := peerService{member("s2", nil)}
	p2, p3, ps2 := scriptedPeer(t, pki, "n2", n2), scriptedPeer(t, pki, "n3", n3), scriptedPeer(t, pki, "s2", s2)

	// n1 reaches n2 and n3, not the spares.
	n1 := member("n1", map[string]uint16{"n2": p2, "n3": p3})
	err1 := n1.claimIncarnation(t.Context(), job, 1, "restore:n1", "")
	select {
	case <-n2.applied:
	case <-time.After(failAfter):
		t.Fatal("n2 never applied the give-back")
	}
	rec, _ := n2.a.grants.Lookup(job)
	t.Logf("n1's claim: %v; n2's grant: %+v", err1, rec)

	// The partition moves: s1 reaches n2 and s2, not n1 and n3.
	s1 := member("s1", map[string]uint16{"n2": p2, "s2": ps2})
	err2 := s1.claimIncarnation(t.Context(), job, 1, "restore:s1", "")
	if err1 == nil && err2 == nil {
		t.Fatalf("incarnation 1 of %s claimed by n1 and by s1: n2 recorded n1's winning grant as given back (%+v)", job, rec)
	}
}

// TestContendedClaimTriesAgain: a claim refused in its first attempt by a rival restore's grant, which the
// rival then gives back, gives its own grants back and, every give-back answered, tries again and wins. A
// member's answer to a give-back was taken for no answer ("empty answer": GrantReply.Granted is documented
// as "granted, or given back", but a give-back answered without it), so a contended claim never tried
// again and both restores of the job failed.
func TestContendedClaimTriesAgain(t *testing.T) {
	const job = "contend-00000001"
	pki := newTestPKI(t)
	member := func(name string, ports map[string]uint16) *Agent { return grantMember(t, pki, name, ports) }
	n2 := peerService{member("n2", nil)}
	n3 := &givesWay{peerService: peerService{member("n3", nil)}, job: job, rival: "restore:rival", rhost: "s2"}
	if _, err := n3.a.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: n3.rival, Host: n3.rhost}, time.Now()); err != nil {
		t.Fatal(err)
	}
	n1 := member("n1", map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2), "n3": scriptedPeer(t, pki, "n3", n3)})

	if answered := n1.giveBack(t.Context(), "other-00000001", 1, "restore:n1", []string{"n1", "n2"}); !answered {
		t.Errorf("a give-back of a grant nobody holds, answered by n1 itself and by n2: reported unanswered")
	}
	if err := n1.claimIncarnation(t.Context(), job, 1, "restore:n1", ""); err != nil {
		t.Fatalf("claim contended by a rival that gave way: %v, want it won on a later attempt", err)
	}
	for _, a := range []*Agent{n1, n2.a, n3.a} {
		if rec, _ := a.grants.Lookup(job); rec.Holder != "restore:n1" || rec.Released {
			t.Errorf("%s's grant of %s: %+v, want held by restore:n1", a.cfg.Name, job, rec)
		}
	}
}

// grantMember is member name of a cluster whose other members listen on ports, with credentials of pki and
// a grant registry of its own.
func grantMember(t *testing.T, pki *testPKI, name string, ports map[string]uint16) *Agent {
	t.Helper()
	a, _ := newWireAgent(t, name, testMembers(ports))
	cfg := pki.creds(t, name)
	a.cfg.Cluster.CA, a.cfg.Cluster.Cert, a.cfg.Cluster.Key = cfg.CAFile, cfg.CertFile, cfg.KeyFile
	var err error
	if a.grants, err = grant.Open(filepath.Join(t.TempDir(), "grants.json"), grant.Options{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.peers().Close() })
	return a
}

// yields answers like its member, and after its first answer runs then (a rival giving way).
type yields struct {
	peerService
	once sync.Once
	then func() error
}

func (s *yields) Grant(ctx context.Context, peer string, req clusterapi.GrantRequest) (clusterapi.GrantReply, error) {
	rep, err := s.peerService.Grant(ctx, peer, req)
	s.once.Do(func() { err = errors.Join(err, s.then()) })
	return rep, err
}

// TestContendedClaimWithoutGrantsTriesAgain: a claim that every member refused, each for another rival
// restore of the same incarnation, got no grant to give back. It gave back to "every member" instead (nil),
// the node it replaces among them, which does not answer: the give-back counted as unanswered, and the
// claim never tried again once the rivals gave way.
func TestContendedClaimWithoutGrantsTriesAgain(t *testing.T) {
	const job = "nogrant-00000001"
	pki := newTestPKI(t)
	member := func(name string, ports map[string]uint16) *Agent { return grantMember(t, pki, name, ports) }
	var n1 *Agent
	rivals := map[string]string{"n1": "restore:r1", "n2": "restore:r2", "n3": "restore:r3"}
	n2 := &yields{peerService: peerService{member("n2", nil)}}
	n3 := &givesWay{peerService: peerService{member("n3", nil)}, job: job, rival: rivals["n3"], rhost: "s2"}
	// n2 gives way once n1 refused its own claim, and has n1's rival give way too.
	n2.then = func() error {
		deadline := time.Now().Add(failAfter)
		for rec, _ := n1.grants.Lookup(job); !rec.Seen.After(rec.Granted); rec, _ = n1.grants.Lookup(job) {
			if time.Now().After(deadline) {
				return errors.New("n1 never answered its own claim")
			}
			time.Sleep(time.Millisecond)
		}
		return errors.Join(n2.a.grants.Release(job, 1, rivals["n2"], "s2", time.Now()),
			n1.grants.Release(job, 1, rivals["n1"], "s2", time.Now()))
	}
	n1 = member("n1", map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2), "n3": scriptedPeer(t, pki, "n3", n3)})
	granted := time.Now().Add(-time.Hour)
	for _, a := range []*Agent{n1, n2.a, n3.a} {
		if _, err := a.grants.Grant(grant.Request{Job: job, Incarnation: 1, Holder: rivals[a.cfg.Name], Host: "s2"}, granted); err != nil {
			t.Fatal(err)
		}
	}

	// n1 restores s1's job: s1 (gone, unreachable) is not asked; s2 is unreachable too.
	if err := n1.claimIncarnation(t.Context(), job, 1, "restore:n1", "s1"); err != nil {
		t.Fatalf("claim refused by three rivals that then gave way: %v, want it won on a later attempt", err)
	}
	for _, a := range []*Agent{n1, n2.a, n3.a} {
		if rec, _ := a.grants.Lookup(job); rec.Holder != "restore:n1" || rec.Released {
			t.Errorf("%s's grant of %s: %+v, want held by restore:n1", a.cfg.Name, job, rec)
		}
	}
}
