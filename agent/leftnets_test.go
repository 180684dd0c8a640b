package agent

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/restore/recovery"
	"github.com/ftkit/ftkit/shim"
)

// TestLeftJobNetSurvivesRestart: a job network that could not be deleted (here a failed start's) kept its
// address reserved in the agent's memory only: after a restart nothing deleted it again, and the next job
// was given the address the left namespace still held on the wire. The next agent deletes it again at its
// start, keeps the address reserved while it cannot, and touches no network it did not record: another
// agent sharing /run/netns (a parallel lab with the same host names) keeps its own.
func TestLeftJobNetSurvivesRestart(t *testing.T) {
	ta := newTestAgent(t)
	a := ta.Agent
	a.reservedAddrs = map[netip.Addr]int{}
	a.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
	a.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
	a.cfg.JobNetwork.Kind = jobnet.MACVlan
	var mu sync.Mutex
	stuck := true
	var made string
	var addr netip.Addr
	var deleted []string
	a.nets = jobNetOps{
		create: func(_ context.Context, n *JobNet) error {
			made, addr = n.Name, n.Addr.Addr()
			return errors.New("bring up eth0: injected")
		},
		delete: func(_ context.Context, name string) error {
			mu.Lock()
			defer mu.Unlock()
			if stuck {
				return errors.New("delete eth0: injected")
			}
			deleted = append(deleted, name)
			return nil
		},
	}
	if _, err := a.StartJob(t.Context(), JobSpec{Name: "srv", Argv: []string{"/bin/true"}, JobAddress: true}, 1000, 1000); err == nil {
		t.Fatal("StartJob succeeded")
	}
	if made == "" {
		t.Fatal("StartJob failed before it made the job's network")
	}

	// A running job's network recorded as left (a restore of its job made it again since): never deleted.
	runs := ta.addJob(t, Job{ID: "runs-0000000b", State: JobRunning, PID: os.Getpid()})
	a.noteLeftNet(jobNetName(a.cfg.Name, runs.ID), leftNet{Job: runs.ID, Addr: netip.MustParsePrefix("127.0.0.203/8")}, true)

	// The agent restarts: what it held in memory is gone. Its network still cannot be deleted.
	restart := func() {
		a.mu.Lock()
		a.reservedAddrs, a.leftHeld = map[netip.Addr]int{}, nil
		a.mu.Unlock()
		if _, err := a.adopt(); err != nil {
			t.Fatal(err)
		}
	}
	restart()
	next, err := a.allocJobAddr()
	if err != nil {
		t.Fatal(err)
	}
	if next.Addr() == addr {
		t.Errorf("after a restart the next job got %s, which the failed start's undeleted network %s still holds", addr, made)
	}
	a.releaseJobAddr(next.Addr())

	// Another agent with the same host name, sharing /run/netns, recorded nothing: it deletes nothing.
	other := newTestAgent(t)
	other.reservedAddrs = map[netip.Addr]int{}
	other.nets = a.nets
	mu.Lock()
	stuck = false
	mu.Unlock()
	if _, err := other.adopt(); err != nil {
		t.Fatal(err)
	}
	if len(deleted) != 0 {
		t.Errorf("an agent deleted job networks %v it never recorded (another agent's)", deleted)
	}

	// The next restart deletes it: the record forgets it, and its address goes back to the pool.
	restart()
	if !slices.Equal(deleted, []string{made}) {
		t.Errorf("the restarted agent deleted %v, want only the left network %s", deleted, made)
	}
	left, err := a.readLeftNets()
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 0 {
		t.Errorf("the record still names %v once the left network is deleted", left)
	}
	if got, err := a.allocJobAddr(); err != nil || got.Addr() != addr {
		t.Errorf("once the left network is deleted the next job got %s, %v; want %s", got, err, addr)
	}
	if _, err := os.Stat(filepath.Join(a.cfg.StateDir, leftNetsFile)); err != nil {
		t.Error(err)
	}
}

// leftAddrAgent is a test agent with a pool of job addresses whose job networks exist and cannot be
// deleted (a.nets), and a restart that forgets what it held in memory.
func leftAddrAgent(t *testing.T) (ta *testAgent, restart func()) {
	ta = newTestAgent(t)
	ta.reservedAddrs = map[netip.Addr]int{}
	ta.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
	ta.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
	ta.cfg.JobNetwork.Kind = jobnet.MACVlan
	ta.nets = jobNetOps{
		exists: func(string) (bool, error) { return true, nil },
		delete: func(context.Context, string) error { return errors.New("delete eth0: injected") },
	}
	return ta, func() {
		ta.mu.Lock()
		ta.reservedAddrs, ta.leftHeld = map[netip.Addr]int{}, nil
		ta.mu.Unlock()
		if _, err := ta.adopt(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestOrphanJobNetAddrSurvivesRestart: an agent that stopped while an ended job's network lingered finds it
// at its start (removeOrphanJobNet) and cannot delete it. That deletion passed no address: the record of
// left networks had none, and neither that agent nor the next one kept the address the network still
// holds on the wire from the next job.
func TestOrphanJobNetAddrSurvivesRestart(t *testing.T) {
	ta, restart := leftAddrAgent(t)
	const id = "ended-0000000a"
	addr := netip.MustParsePrefix("127.0.0.200/8") // the pool's first
	must(t, ta.jobs.save(ta.addJob(t, Job{ID: id, State: JobExited, Net: &JobNet{Name: jobNetName(ta.cfg.Name, id), Kind: jobnet.MACVlan, Addr: addr}})))
	for i := range 2 {
		restart()
		got, err := ta.allocJobAddr()
		if err != nil {
			t.Fatal(err)
		}
		if got.Addr() == addr.Addr() {
			t.Fatalf("start %d: the next job got %s, which the ended job's undeleted network still holds", i+1, got)
		}
		ta.releaseJobAddr(got.Addr())
	}
}

// TestClaimedLingeringNetAddrStaysReserved: a rollback's stop (or a new copy's claim) that cannot delete an
// ended copy's lingering network leaves it on the wire. That deletion passed no address: the record of left
// networks had none, and the next agent gave the address the network still holds to the next job. (The
// lingering's own end, finding the network taken, also gave back the hold finish made, whether the claim
// deleted it or not.)
func TestClaimedLingeringNetAddrStaysReserved(t *testing.T) {
	ta, restart := leftAddrAgent(t)
	ta.cfg.JobNetwork.Linger = Duration{Duration: time.Minute}
	addr, err := ta.allocJobAddr()
	if err != nil {
		t.Fatal(err)
	}
	const id = "ended-0000000b"
	name := jobNetName(ta.cfg.Name, id)
	j := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: name, Kind: jobnet.MACVlan, Addr: addr}})
	ta.releaseJobAddr(addr.Addr()) // StartJob returns
	ta.finish(j, JobExited, &shim.ExitStatus{})
	if !ta.lingering.has(name) {
		t.Fatalf("the ended job's network %s does not linger", name)
	}
	ta.endLingering(t.Context(), name, "test: a rollback's stop")
	left, err := ta.readLeftNets()
	if err != nil {
		t.Fatal(err)
	}
	if l, ok := left[name]; !ok || l.Addr != addr {
		t.Errorf("the record of left networks has %s as %+v (recorded: %v), want it with address %s", name, l, ok, addr)
	}
	check := func(when string) {
		t.Helper()
		got, err := ta.allocJobAddr()
		if err != nil {
			t.Fatal(err)
		}
		if got.Addr() == addr.Addr() {
			t.Errorf("%s: the next job got %s, which the ended job's undeleted network still holds", when, got)
		}
		ta.releaseJobAddr(got.Addr())
	}
	check("the claim failed")
	restart()
	check("after a restart")
}

// TestLeftNetHoldEndsOnceDeleted: the address of a job network that could not be deleted stays reserved
// while the network may hold it on the wire, and no longer: a later deletion of the same network (a copy of
// the job restored here since, which ended) took it off the wire, but the hold the failed deletion kept
// stayed until the agent restarted, and the pool lost the address meanwhile.
func TestLeftNetHoldEndsOnceDeleted(t *testing.T) {
	ta, _ := leftAddrAgent(t)
	ta.cfg.JobNetwork.Linger = Duration{} // deleted as the job ends
	var mu sync.Mutex
	stuck := true
	ta.nets.delete = func(context.Context, string) error {
		mu.Lock()
		defer mu.Unlock()
		if stuck {
			return errors.New("delete eth0: injected")
		}
		return nil
	}
	addr, err := ta.allocJobAddr()
	if err != nil {
		t.Fatal(err)
	}
	const id = "ended-0000000c"
	net := &JobNet{Name: jobNetName(ta.cfg.Name, id), Kind: jobnet.MACVlan, Addr: addr}
	j := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: net})
	ta.releaseJobAddr(addr.Addr()) // StartJob returns
	ta.finish(j, JobExited, &shim.ExitStatus{})
	if got, err := ta.allocJobAddr(); err != nil || got.Addr() == addr.Addr() {
		t.Fatalf("the next job got %s, %v while the ended job's undeleted network still holds %s", got, err, addr)
	} else {
		ta.releaseJobAddr(got.Addr())
	}

	// A copy of the job restored here since runs in it, ends, and its network is deleted.
	mu.Lock()
	stuck = false
	mu.Unlock()
	n := *net
	j = ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: &n})
	ta.finish(j, JobExited, &shim.ExitStatus{})
	left, err := ta.readLeftNets()
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 0 {
		t.Errorf("the record still names %v once the network is deleted", left)
	}
	if got, err := ta.allocJobAddr(); err != nil || got.Addr() != addr.Addr() {
		t.Errorf("once the job's network is deleted the next job got %s, %v; want %s: the address stays reserved until the agent restarts", got, err, addr)
	}
}

// TestLeftNetsRetriedWhileRunning: a job network that could not be deleted was tried again only at the
// next agent's start: one whose deletion failed for a while stayed on the wire with its address, and the
// address out of the pool, for as long as the agent ran. A running agent tries again now and then
// (retryLeftNetsNow): a network it deletes gives its address back; one that still cannot be deleted keeps
// it held once, and is not logged again; one a job of this host may be using is not touched.
func TestLeftNetsRetriedWhileRunning(t *testing.T) {
	for _, tt := range []struct {
		name    string
		stuck   bool                                // the network still cannot be deleted
		busy    func(ta *testAgent, id, net string) // what of the job is under way here
		deleted bool                                // the pass deletes the network
	}{
		{name: "deletable now", deleted: true},
		{name: "still stuck", stuck: true},
		{name: "its job runs in it again", busy: func(ta *testAgent, id, net string) {
			ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: net, Kind: jobnet.MACVlan}})
		}},
		{name: "its job is being restored here", busy: func(ta *testAgent, id, _ string) {
			ta.mu.Lock()
			ta.restoring = map[string]string{id: "a recovery"}
			ta.mu.Unlock()
		}},
		{name: "an ended copy's network lingers under its name", busy: func(ta *testAgent, id, net string) {
			ta.lingering.add(net, id, netip.Prefix{})
		}},
		{name: "processes of the job are in its cgroup", busy: func(ta *testAgent, id, _ string) {
			cg := ta.layout().cgroup(id)
			must(t, os.MkdirAll(cg, 0o755))
			must(t, os.WriteFile(filepath.Join(cg, "cgroup.events"), []byte("populated 1\nfrozen 0\n"), 0o644))
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ta, _ := leftAddrAgent(t)
			var logs bytes.Buffer
			ta.log = slog.New(slog.NewTextHandler(&logs, nil))
			var mu sync.Mutex
			stuck := true
			var deleted []string
			ta.nets.delete = func(_ context.Context, name string) error {
				mu.Lock()
				defer mu.Unlock()
				if stuck {
					return errors.New("delete eth0: injected")
				}
				deleted = append(deleted, name)
				return nil
			}
			ta.nets.create = func(context.Context, *JobNet) error { return errors.New("bring up eth0: injected") }
			if _, err := ta.StartJob(t.Context(), JobSpec{Name: "srv", Argv: []string{"/bin/true"}, JobAddress: true}, 1000, 1000); err == nil {
				t.Fatal("StartJob succeeded")
			}
			left, err := ta.readLeftNets()
			if err != nil || len(left) != 1 {
				t.Fatalf("the record names %v, %v: want the failed start's network", left, err)
			}
			var net string
			var l leftNet
			for net, l = range left {
			}
			if tt.busy != nil {
				tt.busy(ta, l.Job, net)
			}
			mu.Lock()
			stuck = tt.stuck
			mu.Unlock()
			logged := logs.String()
			for range 2 {
				ta.retryLeftNetsNow(t.Context())
			}
			if got := len(deleted) > 0; got != tt.deleted {
				t.Errorf("the running agent's retries deleted %v, want the left network %s deleted: %v", deleted, net, tt.deleted)
			}
			left, err = ta.readLeftNets()
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := left[net]; ok == tt.deleted && tt.busy == nil {
				t.Errorf("after the retries the record names %v", left)
			}
			if tt.stuck && strings.Contains(strings.TrimPrefix(logs.String(), logged), "level=ERROR") {
				t.Errorf("a network that still cannot be deleted is logged again at each retry:\n%s", strings.TrimPrefix(logs.String(), logged))
			}
			got, err := ta.allocJobAddr()
			if err != nil {
				t.Fatal(err)
			}
			if (got.Addr() == l.Addr.Addr()) != tt.deleted {
				t.Errorf("after the retries the next job got %s (the left network's address %s); want it given back: %v", got, l.Addr, tt.deleted)
			}
			ta.releaseJobAddr(got.Addr())
			if tt.stuck { // held once: deleted now, the address is back
				mu.Lock()
				stuck = false
				mu.Unlock()
				ta.retryLeftNetsNow(t.Context())
				if got, err := ta.allocJobAddr(); err != nil || got.Addr() != l.Addr.Addr() {
					t.Errorf("once the left network is deleted the next job got %s, %v; want %s", got, err, l.Addr)
				}
			}
		})
	}
}

// TestRecoveryNetLeft: a job network a failed recovery made and could not delete (restore/recovery.Run)
// was only logged: not recorded as left, its address not held, so nothing deleted it again and the next
// job got the address the network still held on the wire.
func TestRecoveryNetLeft(t *testing.T) {
	ta, restart := leftAddrAgent(t)
	const id = "moved-0000000d"
	addr := netip.MustParsePrefix("127.0.0.200/8") // the pool's first
	name := jobNetName(ta.cfg.Name, id)
	act := ta.recoveryDeps(nil, nil, "node2").Jobs.(*recoveryActions)
	j := &recovery.Job{ID: id}
	act.records[j] = Job{ID: id, Net: &JobNet{Name: name, Kind: jobnet.MACVlan, Addr: addr}}
	act.NetLeft(j, errors.New("delete eth0: injected"))
	left, err := ta.readLeftNets()
	if err != nil {
		t.Fatal(err)
	}
	if l, ok := left[name]; !ok || l != (leftNet{Job: id, Addr: addr}) {
		t.Errorf("the record of left networks has %s as %+v (recorded: %v), want job %s with address %s", name, l, ok, id, addr)
	}
	check := func(when string) {
		t.Helper()
		got, err := ta.allocJobAddr()
		if err != nil {
			t.Fatal(err)
		}
		if got.Addr() == addr.Addr() {
			t.Errorf("%s: the next job got %s, which the failed recovery's undeleted network %s still holds", when, got, name)
		}
		ta.releaseJobAddr(got.Addr())
	}
	check("the recovery failed")
	restart()
	check("after a restart")
}
