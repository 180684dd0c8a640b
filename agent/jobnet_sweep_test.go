package agent

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/shim"
)

// sweepNets stands in for /run/netns: the names there, the ones that cannot be deleted, and what each holds.
type sweepNets struct {
	mu      sync.Mutex
	names   []string
	stuck   map[string]bool
	addrs   map[string][]netip.Addr
	deleted []string
}

func (s *sweepNets) ops() jobNetOps {
	return jobNetOps{
		list: func(prefix string) ([]string, error) {
			s.mu.Lock()
			defer s.mu.Unlock()
			var out []string
			for _, n := range s.names {
				if strings.HasPrefix(n, prefix) {
					out = append(out, n)
				}
			}
			return out, nil
		},
		delete: func(_ context.Context, name string) error {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.stuck[name] {
				return errors.New("delete eth0: injected")
			}
			s.deleted = append(s.deleted, name)
			return nil
		},
		addrs: func(name string) ([]netip.Addr, error) { return s.addrs[name], nil },
	}
}

// sweepAgent is a test agent with a pool of four job addresses, 127.0.0.200-203.
func sweepAgent(t *testing.T, nets *sweepNets) *testAgent {
	ta := newTestAgent(t)
	ta.reservedAddrs = map[netip.Addr]int{}
	ta.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
	ta.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
	ta.cfg.JobNetwork.Kind = jobnet.MACVlan
	ta.nets = nets.ops()
	return ta
}

// TestAdoptSweepsLeftJobNets: the job networks a previous agent of this host left without a running job (a
// start or restore whose network could not be deleted: no record, or an ended one) are deleted at start,
// and those that still cannot be deleted keep their addresses reserved; another lab host's are not
// touched. The old code looked only for the networks of ended records, and never reserved the address of
// one it could not delete: after a restart, the next job got an address a left network still held on the
// wire.
func TestAdoptSweepsLeftJobNets(t *testing.T) {
	nets := &sweepNets{stuck: map[string]bool{}, addrs: map[string][]netip.Addr{}}
	ta := sweepAgent(t, nets)
	const ended = "ended-00000002"
	endedNet := jobNetName("node1", ended)
	rec := &Job{ID: ended, Node: "node1", State: JobExited, Exit: &shim.ExitStatus{},
		Net: &JobNet{Name: endedNet, Kind: jobnet.MACVlan, Addr: netip.MustParsePrefix("127.0.0.200/8")}}
	if err := ta.jobs.save(rec); err != nil {
		t.Fatal(err)
	}
	orphan := jobNetName("node1", "start-00000003")     // a failed start's: no record
	stuckNet := jobNetName("node1", "restore-00000004") // a failed restore's, which cannot be deleted either
	otherHost := jobNetName("node2", "theirs-00000005") // another lab host's, in the same /run/netns
	nets.names = []string{endedNet, orphan, stuckNet, otherHost}
	nets.stuck[endedNet], nets.stuck[stuckNet] = true, true
	nets.addrs[stuckNet] = []netip.Addr{netip.MustParseAddr("127.0.0.201")}

	if _, err := ta.adopt(); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(nets.deleted, orphan) {
		t.Errorf("the failed start's network %s was not deleted (deleted: %v)", orphan, nets.deleted)
	}
	if slices.Contains(nets.deleted, otherHost) {
		t.Errorf("another host's network %s was deleted", otherHost)
	}
	p, err := ta.allocJobAddr()
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Addr().String(); got == "127.0.0.200" || got == "127.0.0.201" {
		t.Errorf("a new job got %s, which a left network that could not be deleted still holds", got)
	}
}

// TestSweepJobNetsKeeps: the sweep leaves the network of an adopted running job, one that lingers for a job
// that ended as adopt settled it, and one whose job's record adopt could not read.
func TestSweepJobNetsKeeps(t *testing.T) {
	nets := &sweepNets{}
	ta := sweepAgent(t, nets)
	const running, corrupt = "run-00000002", "bad-00000003"
	runNet := jobNetName("node1", running)
	ta.addJob(t, Job{ID: running, State: JobRunning, PID: os.Getpid(),
		Net: &JobNet{Name: runNet, Kind: jobnet.MACVlan, Addr: netip.MustParsePrefix("127.0.0.200/8")}})
	lingers := jobNetName("node1", "exited-00000004")
	ta.lingering.add(lingers, "exited-00000004")
	if err := os.WriteFile(filepath.Join(ta.jobs.dir, corrupt+".json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	orphan := jobNetName("node1", "start-00000005")
	nets.names = []string{runNet, lingers, jobNetName("node1", corrupt), orphan}

	ta.sweepJobNets(t.Context())
	if !slices.Equal(nets.deleted, []string{orphan}) {
		t.Errorf("deleted %v, want only the orphan %s", nets.deleted, orphan)
	}
}
