package agent

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/jobnet"
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
		a.reservedAddrs = map[netip.Addr]int{}
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
