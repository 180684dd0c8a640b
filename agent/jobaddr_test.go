package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/shim"
)

func TestJobNetName(t *testing.T) {
	long := strings.Repeat("a", 48) + "-0123abcd" // the longest job id newJobID makes
	for _, id := range []string{"rank1-0123abcd", long} {
		n1, n2 := jobNetName("node1", id), jobNetName("spare1", id)
		for _, n := range []string{n1, n2} {
			if err := jobnet.ValidName(n); err != nil {
				t.Errorf("jobNetName(%q) = %q: %v", id, n, err)
			}
			if !strings.HasSuffix(n, "-0123abcd") {
				t.Errorf("jobNetName(%q) = %q lost the id's random suffix", id, n)
			}
		}
		if n1 == n2 {
			t.Errorf("the job network of %s has the same name %q on two hosts (which share /run/netns in a lab)", id, n1)
		}
		if jobNetName("node1", id) != n1 {
			t.Error("jobNetName is not deterministic: a restarted agent would not find its job's network")
		}
	}
}

func TestPickJobAddr(t *testing.T) {
	own := netip.MustParsePrefix("10.1.0.11/24")
	ip := netip.MustParseAddr
	tests := []struct {
		name, pool string
		used       []string
		own        netip.Prefix
		want       string // "" for none
	}{
		{name: "first of the pool, with the cluster's length", pool: "10.1.0.200/30", want: "10.1.0.200/24"},
		{name: "held ones skipped", pool: "10.1.0.200/30", used: []string{"10.1.0.200", "10.1.0.201"}, want: "10.1.0.202/24"},
		{name: "exhausted", pool: "10.1.0.200/31", used: []string{"10.1.0.200", "10.1.0.201"}},
		{name: "the cluster's broadcast is not handed out", pool: "10.1.0.254/31", used: []string{"10.1.0.254"}},
		{name: "the cluster's network address is not handed out", pool: "10.1.0.0/31", want: "10.1.0.1/24"},
		{name: "outside the cluster network: none", pool: "10.2.0.0/30"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			used := map[netip.Addr]bool{}
			for _, u := range tt.used {
				used[ip(u)] = true
			}
			got, ok := pickJobAddr(netip.MustParsePrefix(tt.pool), own, used)
			if tt.want == "" && ok || tt.want != "" && (!ok || got.String() != tt.want) {
				t.Errorf("pickJobAddr = %v, %v; want %q", got, ok, tt.want)
			}
		})
	}
}

// TestCheckPeerJobNet: what a job record from another node may say about its job network.
func TestCheckPeerJobNet(t *testing.T) {
	cluster := netip.MustParsePrefix("10.1.0.12/24") // this host's own address
	members := []netip.Addr{netip.MustParseAddr("10.1.0.11"), netip.MustParseAddr("10.1.0.12"), netip.MustParseAddr("10.1.0.101")}
	good := JobNet{Name: jobNetName("node2", "rank1-0123abcd"), Kind: jobnet.MACVlan, Addr: netip.MustParsePrefix("10.1.0.204/24")}
	tests := []struct {
		name    string
		edit    func(n *JobNet)
		wantErr string
	}{
		{name: "a job address of the cluster network", edit: func(*JobNet) {}},
		{name: "ipvlan", edit: func(n *JobNet) { n.Kind = jobnet.IPVlan }},
		{name: "a name escaping /run/netns", edit: func(n *JobNet) { n.Name = "../etc" }, wantErr: "net.name"},
		{name: "no name", edit: func(n *JobNet) { n.Name = "" }, wantErr: "net.name"},
		{name: "unknown kind", edit: func(n *JobNet) { n.Kind = "veth" }, wantErr: "kind"},
		{name: "another subnet", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("10.2.0.204/24") }, wantErr: "cluster network 10.1.0.0/24"},
		{name: "another prefix length", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("10.1.0.204/25") }, wantErr: "prefix length"},
		{name: "a member's host address", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("10.1.0.11/24") }, wantErr: "a member's host address"},
		{name: "this host's own address", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("10.1.0.12/24") }, wantErr: "a member's host address"},
		{name: "the broadcast address", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("10.1.0.255/24") }, wantErr: "broadcast"},
		{name: "the network address", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("10.1.0.0/24") }, wantErr: "network or broadcast"},
		{name: "IPv6", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("fd00::5/64") }, wantErr: "IPv4"},
		{name: "multicast", edit: func(n *JobNet) { n.Addr = netip.MustParsePrefix("224.0.0.5/24") }, wantErr: "unicast"},
		{name: "no address", edit: func(n *JobNet) { n.Addr = netip.Prefix{} }, wantErr: "IPv4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := good
			tt.edit(&n)
			err := checkPeerJobNet(&n, cluster, members)
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Errorf("checkPeerJobNet(%+v) = %v; want error containing %q", n, err, tt.wantErr)
			}
		})
	}
	if err := checkPeerJobNet(nil, cluster, members); err != nil {
		t.Errorf("a record without a job network: %v", err)
	}
}

// FuzzCheckPeerJobNet: whatever a replica's job record says about its job network, an accepted one names a
// namespace that stays under /run/netns and an address of this host's cluster network that no member has.
func FuzzCheckPeerJobNet(f *testing.F) {
	f.Add(`{"name":"ftj-1234abcd-rank1-0123abcd","kind":"macvlan","addr":"10.1.0.204/24"}`)
	f.Add(`{"name":"../x","kind":"ipvlan","addr":"10.1.0.11/24"}`)
	f.Add(`{"name":"a","kind":"macvlan","addr":"10.1.0.255/24"}`)
	f.Add(`{"name":"a","kind":"macvlan","addr":"::ffff:10.1.0.5/120"}`)
	cluster := netip.MustParsePrefix("10.1.0.12/24")
	members := []netip.Addr{netip.MustParseAddr("10.1.0.11"), netip.MustParseAddr("10.1.0.12")}
	f.Fuzz(func(t *testing.T, record string) {
		var n JobNet
		if json.Unmarshal([]byte(record), &n) != nil {
			return
		}
		if checkPeerJobNet(&n, cluster, members) != nil {
			return
		}
		a := n.Addr.Addr()
		if jobnet.ValidName(n.Name) != nil || strings.Contains(n.Name, "/") || !a.Is4() || n.Addr.Bits() != 24 ||
			!cluster.Masked().Contains(a) || slices.Contains(members, a) || a == cluster.Masked().Addr() {
			t.Fatalf("accepted %+v", n)
		}
	})
}

// TestStartJobAddressWithoutPool: a job that asks for a job address on an agent without a pool is refused
// with a reason the user can act on, before anything is created for it.
func TestStartJobAddressWithoutPool(t *testing.T) {
	a := newTestAgent(t)
	before, _ := os.ReadDir(a.cfg.JobsDir)
	_, err := a.StartJob(t.Context(), JobSpec{Name: "srv", Argv: []string{"/bin/true"}, JobAddress: true}, 1000, 1000)
	if err == nil || !strings.Contains(err.Error(), "[job_network] pool is not set") {
		t.Fatalf("StartJob with a job address and no pool = %v, want a refusal naming job_network.pool", err)
	}
	after, _ := os.ReadDir(a.cfg.JobsDir)
	if len(after) != len(before) {
		t.Errorf("the refused job left %d new entries in jobs_dir", len(after)-len(before))
	}
	for _, j := range a.Jobs(0) {
		if j.Spec.Name == "srv" {
			t.Errorf("the refused job is listed: %+v", j)
		}
	}
}

// TestAddressHeld: which job records keep their job address from being handed out again.
func TestAddressHeld(t *testing.T) {
	n := &JobNet{Name: "ftj-1-a-00000001", Kind: jobnet.MACVlan, Addr: netip.MustParsePrefix("10.1.0.200/24")}
	tests := []struct {
		name string
		job  Job
		want bool
	}{
		{"running", Job{Net: n, State: JobRunning}, true},
		{"lost: it may have been restored elsewhere with its address", Job{Net: n, State: JobLost}, true},
		{"killed by self-fencing: its protector restores it elsewhere", Job{Net: n, State: JobExited, Fenced: true}, true},
		{"migrated: it runs on the target with its address", Job{Net: n, State: JobMoved, MovedTo: "node3"}, true},
		{"exited here", Job{Net: n, State: JobExited}, false},
		{"no job address", Job{State: JobRunning}, false},
	}
	for _, tt := range tests {
		if got := addressHeld(&tt.job); got != tt.want {
			t.Errorf("%s: addressHeld = %v, want %v", tt.name, got, tt.want)
		}
	}
}

func TestLingerNets(t *testing.T) {
	var l lingerNets
	var removed []string
	l.add("ftj-a", "job-a", netip.Prefix{})
	l.add("ftj-b", "job-b", netip.Prefix{})
	if !l.has("ftj-a") || l.has("ftj-c") {
		t.Fatal("has: want ftj-a only among ftj-a and ftj-c")
	}
	l.take("ftj-a", func(id string, _ netip.Prefix) { removed = append(removed, "end "+id) })
	if l.has("ftj-a") {
		t.Error("ftj-a still lingers after its end")
	}
	if !l.take("ftj-b", func(id string, _ netip.Prefix) { removed = append(removed, "claim "+id) }) {
		t.Error("a claim of the lingering ftj-b = false")
	}
	if l.take("ftj-b", func(string, netip.Prefix) { removed = append(removed, "claim again") }) {
		t.Error("a second claim of ftj-b = true")
	}
	l.take("ftj-b", func(string, netip.Prefix) { removed = append(removed, "end ftj-b") })
	if want := []string{"end job-a", "claim job-b"}; !slices.Equal(removed, want) {
		t.Errorf("removals %q, want %q", removed, want)
	}
}

// TestEndedJobAddressNotReused: the address of a job whose network lingers after it exited is held from
// the instant anyone can see the job ended, so a job started by a client that watched for the end (as
// TestJobAddressLastBytes does) gets another one. The agent once reserved it only after it had marked the
// job exited and released its other resources, and a start in between got it (CI, 2026-12-01); and a job
// that ended before its StartJob returned lost the hold when StartJob released its own.
func TestEndedJobAddressNotReused(t *testing.T) {
	ta := newTestAgent(t)
	a := ta.Agent
	a.reservedAddrs = map[netip.Addr]int{}
	a.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
	a.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
	a.cfg.JobNetwork.Linger = Duration{Duration: time.Minute}
	// start lists a job that holds an address, as StartJob does before it releases its own hold.
	start := func(id string) (*Job, netip.Prefix) {
		addr, err := a.allocJobAddr()
		if err != nil {
			t.Fatal(err)
		}
		return ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: jobNetName(a.cfg.Name, id), Kind: jobnet.MACVlan, Addr: addr}}), addr
	}
	// endThenStart ends job j (finish) and, as a client woken by the end, runs between and starts the next job
	// at once: the address it gets. The lingering's wait cannot start meanwhile, nor end and give the address
	// back before the next job has one.
	endThenStart := func(j *Job, between func()) netip.Prefix {
		_, changed, err := a.Job(j.ID, 0)
		if err != nil {
			t.Fatal(err)
		}
		a.lingering.mu.Lock()
		done := make(chan struct{})
		go func() {
			defer close(done)
			a.finish(j, JobExited, &shim.ExitStatus{})
		}()
		<-changed
		between()
		p, err := a.allocJobAddr()
		a.lingering.mu.Unlock()
		<-done
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	for i := range 50 {
		j, addr := start(fmt.Sprintf("last-%08x", i))
		a.releaseJobAddr(addr.Addr()) // StartJob returns
		p := endThenStart(j, func() {})
		if p.Addr() == addr.Addr() {
			t.Fatalf("round %d: a job started as soon as %s was seen ended got %s, which its lingering network holds", i, j.ID, p)
		}
		a.releaseJobAddr(p.Addr())
		if !a.netLingers(j, JobExited) {
			t.Fatalf("round %d: the network of %s does not linger", i, j.ID)
		}
		// With no network made, the wait ends at its first look and gives the address back.
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
			a.mu.Lock()
			held := a.reservedAddrs[addr.Addr()] > 0
			a.mu.Unlock()
			if !held {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("round %d: %s still reserved a minute after its network's lingering ended", i, addr)
			}
		}
	}

	// A job that ends before its StartJob returns: StartJob's release of its own hold leaves the lingering's.
	j, addr := start("quick-00000001")
	if p := endThenStart(j, func() { a.releaseJobAddr(addr.Addr()) }); p.Addr() == addr.Addr() {
		t.Errorf("a job started after %s ended before its StartJob returned got %s, which its lingering network holds", j.ID, p)
	}
}

// hookHandler runs hook on each record it handles (a test's way into a moment of the agent's work).
type hookHandler struct{ hook func(slog.Record) }

func (h hookHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h hookHandler) Handle(_ context.Context, r slog.Record) error {
	h.hook(r)
	return nil
}
func (h hookHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h hookHandler) WithGroup(string) slog.Handler      { return h }

// TestEndedJobAddressHeldUntilNetworkDeleted: the address of a job that ended without a lingering network
// (job_network.linger 0) is not handed out before its network is deleted: until then the old network still
// holds it on the wire, and a job started meanwhile would have a second network on this host with it.
func TestEndedJobAddressHeldUntilNetworkDeleted(t *testing.T) {
	ta := newTestAgent(t)
	a := ta.Agent
	a.reservedAddrs = map[netip.Addr]int{}
	a.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
	a.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
	a.cfg.JobNetwork.Linger = Duration{} // no lingering: the network goes as the job ends
	addr, err := a.allocJobAddr()
	if err != nil {
		t.Fatal(err)
	}
	id := "nolinger-00000001"
	j := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: jobNetName(a.cfg.Name, id), Kind: jobnet.MACVlan, Addr: addr}})
	a.releaseJobAddr(addr.Addr()) // StartJob returns
	// A record whose cgroup is not this agent's (restored from an older agent's snapshot): releasing the
	// job logs it, after the job is seen ended and before its network is deleted. A start comes then.
	j.Cgroup = filepath.Join(t.TempDir(), "elsewhere")
	var mu sync.Mutex
	deleted, started := false, false
	var got netip.Prefix
	a.log = slog.New(hookHandler{func(r slog.Record) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case strings.HasPrefix(r.Message, "job network deleted"):
			deleted = true
		case strings.Contains(r.Message, "cgroup that is not this agent's") && !started:
			started = true
			if got, err = a.allocJobAddr(); err != nil {
				t.Error(err)
			}
			if !deleted && got.Addr() == addr.Addr() {
				t.Errorf("a job started after %s ended, before its network was deleted, got %s, which that network still holds", id, got)
			}
		}
	}})
	a.finish(j, JobExited, &shim.ExitStatus{})
	if !started || !deleted {
		t.Fatalf("the start ran: %v; the network was deleted: %v", started, deleted)
	}
	a.releaseJobAddr(got.Addr())
	a.mu.Lock()
	defer a.mu.Unlock()
	if n := a.reservedAddrs[addr.Addr()]; n != 0 {
		t.Errorf("%s is still reserved %d times once the ended job's network is deleted", addr, n)
	}
}

// TestAllocJobAddrSkipsGateway: the job networks' gateway, a router of the cluster network, is never handed
// out as a job address, though the pool holds it (the configuration allows it): a job given the router's
// address cannot be started (jobnet.Spec.Validate refuses it), and every later start would get it again.
func TestAllocJobAddrSkipsGateway(t *testing.T) {
	ta := newTestAgent(t)
	a := ta.Agent
	a.reservedAddrs = map[netip.Addr]int{}
	a.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
	a.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
	a.cfg.JobNetwork.Gateway = netip.MustParseAddr("127.0.0.200")
	if err := a.cfg.CheckJobNetwork(); err != nil {
		t.Fatalf("the configuration is refused (%v): nothing to allocate", err)
	}
	p, err := a.allocJobAddr()
	if err != nil {
		t.Fatal(err)
	}
	defer a.releaseJobAddr(p.Addr())
	if p.Addr() == a.cfg.JobNetwork.Gateway {
		t.Errorf("allocJobAddr handed out the job networks' gateway %s", p)
	}
}

// TestRestoreRefusesAnAddressHeldByAnotherJob: a job that ended gave its address back, and a new job got
// it; a restore of the old job from one of its snapshots (`ftctl restore`) would put the address on two
// jobs of this host. It is refused before anything of the user's changes; the new job runs on.
func TestRestoreRefusesAnAddressHeldByAnotherJob(t *testing.T) {
	ta := newTestAgent(t)
	addr := netip.MustParsePrefix("10.9.0.5/24")
	ta.addJob(t, Job{ID: "new-00000001", State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: jobNetName("node1", "new-00000001"), Addr: addr}})
	old := Job{ID: "old-00000001", Net: &JobNet{Name: jobNetName("node1", "old-00000001"), Addr: addr}}
	m := &ckpt.Manifest{Job: old.ID, ID: "20261206T120000.000Z-node1-000001"}
	_, err := ta.restoreJob(t.Context(), m, old, filepath.Join(ta.dir, "restore", "work"), nil)
	if err == nil || !strings.Contains(err.Error(), "held by job new-00000001") {
		t.Fatalf("restore of a job whose address another running job holds: %v, want a refusal naming that job", err)
	}
	// The job's own record (moved or lost here) does not count against it.
	ta.addJob(t, Job{ID: old.ID, State: JobMoved, Net: old.Net})
	if got := ta.otherHolder(Job{ID: "new-00000001", Net: old.Net}); got != old.ID {
		t.Errorf("otherHolder = %q, want %s (its moved record holds the address)", got, old.ID)
	}
	if got := ta.otherHolder(Job{ID: old.ID, Net: old.Net}); got != "new-00000001" {
		t.Errorf("otherHolder of the job itself = %q, want only the other job", got)
	}
}

// TestRestoreHoldsItsAddress: a restore checks and holds its job's address in one step. The old code only
// looked at the other jobs' records (otherHolder) and held nothing: a job whose StartJob had been handed the
// address (not listed yet), or another ended job's network still holding it (lingering until its closes are
// acknowledged), did not stop the restore, and a job started while CRIU restored got the address the
// restored job's network holds: two job networks of this host on one address, the second user's job
// answering for (or stealing the connections of) the first.
func TestRestoreHoldsItsAddress(t *testing.T) {
	setup := func(t *testing.T) (*testAgent, netip.Prefix) {
		ta := newTestAgent(t)
		a := ta.Agent
		a.reservedAddrs = map[netip.Addr]int{}
		a.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
		a.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
		// No job network is ever made here: a restore that gets as far as making one fails on the parent's
		// name before anything of the host is touched.
		a.cfg.JobNetwork.Parent = "no/such/parent"
		return ta, netip.MustParsePrefix("127.0.0.200/8") // the first address the pool hands out
	}
	restore := func(ta *testAgent, id string, addr netip.Prefix) error {
		j := Job{ID: id, Net: &JobNet{Name: jobNetName("node2", id), Kind: jobnet.MACVlan, Addr: addr}}
		m := &ckpt.Manifest{Job: id, ID: "20261206T120000.000Z-node2-000001"}
		work := filepath.Join(ta.dir, "restore", id)
		if err := os.MkdirAll(work, 0o755); err != nil {
			t.Fatal(err)
		}
		_, err := ta.restoreJob(context.Background(), m, j, work, nil)
		return err
	}
	refused := func(err error) bool { return err != nil && strings.Contains(err.Error(), "cannot be restored here") }

	t.Run("a start holds it", func(t *testing.T) {
		ta, _ := setup(t)
		addr, err := ta.allocJobAddr() // StartJob, making the new job's network; not listed yet
		if err != nil {
			t.Fatal(err)
		}
		defer ta.releaseJobAddr(addr.Addr())
		if err := restore(ta, "old-00000001", addr); !refused(err) {
			t.Errorf("restore of a job on %s while a starting job was handed it: %v, want a refusal", addr, err)
		}
	})

	t.Run("another ended job's network holds it", func(t *testing.T) {
		ta, _ := setup(t)
		ta.cfg.JobNetwork.Linger = Duration{Duration: time.Minute}
		addr, err := ta.allocJobAddr()
		if err != nil {
			t.Fatal(err)
		}
		id := "ended-00000001"
		j := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: jobNetName(ta.cfg.Name, id), Kind: jobnet.MACVlan, Addr: addr}})
		ta.releaseJobAddr(addr.Addr())
		// Its network lingers (held by the test: the wait would end at once, no network being there).
		ta.lingering.mu.Lock()
		go ta.finish(j, JobExited, &shim.ExitStatus{})
		for !func() bool { ta.mu.Lock(); defer ta.mu.Unlock(); return ta.reservedAddrs[addr.Addr()] > 0 }() {
			time.Sleep(time.Millisecond)
		}
		err = restore(ta, "old-00000001", addr)
		ta.lingering.mu.Unlock()
		if !refused(err) {
			t.Errorf("restore of a job on %s while an ended job's network still holds it: %v, want a refusal", addr, err)
		}
	})

	t.Run("a start during the restore gets another", func(t *testing.T) {
		ta, addr := setup(t)
		var got netip.Prefix
		var startErr error
		started := false
		// The restore fails at making the network and deletes it: the one moment of a restore a unit test
		// sees without making a namespace. The address is still the restore's then.
		ta.log = slog.New(hookHandler{func(r slog.Record) {
			if strings.HasPrefix(r.Message, "job network deleted") && !started {
				started = true
				got, startErr = ta.allocJobAddr()
			}
		}})
		err := restore(ta, "old-00000001", addr)
		if err == nil || refused(err) {
			t.Fatalf("restore: %v, want it to fail at making the job's network", err)
		}
		if !started || startErr != nil {
			t.Fatalf("no start during the restore (%v; restore: %v)", startErr, err)
		}
		if got.Addr() == addr.Addr() {
			t.Errorf("a job started while job old-00000001 was restored on %s got that address", addr)
		}
		ta.releaseJobAddr(got.Addr())
		ta.mu.Lock()
		defer ta.mu.Unlock()
		if n := ta.reservedAddrs[addr.Addr()]; n != 0 {
			t.Errorf("%s still reserved %d times after the failed restore deleted its network", addr, n)
		}
	})

	t.Run("its own ended copy's hold does not count", func(t *testing.T) {
		ta, _ := setup(t)
		ta.cfg.JobNetwork.Linger = Duration{Duration: time.Minute}
		addr, err := ta.allocJobAddr()
		if err != nil {
			t.Fatal(err)
		}
		id := "self-00000001"
		j := ta.addJob(t, Job{ID: id, State: JobRunning, PID: os.Getpid(), Net: &JobNet{Name: jobNetName(ta.cfg.Name, id), Kind: jobnet.MACVlan, Addr: addr}})
		ta.releaseJobAddr(addr.Addr())
		// finish's hold for the ended copy's lingering network (held by the test: the wait would end at once).
		ta.lingering.mu.Lock()
		go ta.finish(j, JobExited, &shim.ExitStatus{})
		for !func() bool { ta.mu.Lock(); defer ta.mu.Unlock(); return ta.reservedAddrs[addr.Addr()] > 0 }() {
			time.Sleep(time.Millisecond)
		}
		err = restore(ta, id, addr)
		ta.lingering.mu.Unlock()
		if refused(err) {
			t.Errorf("restore of job %s, whose own ended copy's network holds %s: %v", id, addr, err)
		}
	})

	// The ended copy's network is gone and its hold given back; a start then got the address, and is not
	// listed yet (making its network, launching its shim). Its hold was taken for the ended copy's, and the
	// restore let through: two job networks of this host on one address.
	t.Run("a start's hold after its own ended copy's network is gone", func(t *testing.T) {
		ta, _ := setup(t)
		addr, err := ta.allocJobAddr() // StartJob of another job, handed the address the ended copy gave back
		if err != nil {
			t.Fatal(err)
		}
		defer ta.releaseJobAddr(addr.Addr())
		id := "self-00000001"
		ta.addJob(t, Job{ID: id, State: JobExited, Net: &JobNet{Name: jobNetName(ta.cfg.Name, id), Kind: jobnet.MACVlan, Addr: addr}})
		if err := restore(ta, id, addr); !refused(err) {
			t.Errorf("restore of job %s on %s while a starting job was handed it: %v, want a refusal", id, addr, err)
		}
	})
}

// TestStartJobNetworkCreateFailsHalfWay: a start whose job network is made only in part (here its
// namespace: the client went away, and Create stopped there) deletes what was made before the address goes
// back to the pool. It was left: a namespace per failed start, and one that got its interface up held the
// address the next job was then given.
func TestStartJobNetworkCreateFailsHalfWay(t *testing.T) {
	testenv.RequireKernel(t, "network namespaces")
	// The host: a namespace of the test's whose interface holds the cluster network.
	host := testenv.Netns(t, "ftstart")
	if err := netnsthread.In(host, func() error {
		d := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "clu0"}, PeerName: "clu1"} // no dummy module here
		if err := netlink.LinkAdd(d); err != nil {
			return err
		}
		if err := netlink.AddrAdd(d, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("10.98.0.1"), Mask: net.CIDRMask(24, 32)}}); err != nil {
			return err
		}
		return netlink.LinkSetUp(d)
	}); err != nil {
		t.Fatal(err)
	}
	a := newTestAgent(t)
	a.reservedAddrs = map[netip.Addr]int{}
	a.cfg.Cluster.Listen = netip.MustParseAddrPort("10.98.0.1:1")
	a.cfg.JobNetwork.Pool = netip.MustParsePrefix("10.98.0.200/30")
	ctx, cancel := context.WithCancel(t.Context())
	cancel() // the client is gone: jobnet.Create stops after it made the namespace
	before := jobNets(t)
	t.Cleanup(func() {
		for _, n := range jobNets(t) {
			if !slices.Contains(before, n) && strings.HasPrefix(n, "ftj-") {
				jobnet.Delete(context.Background(), n, "")
			}
		}
	})
	var err error
	netnsthread.In(host, func() error {
		_, err = a.StartJob(ctx, JobSpec{Name: "srv", Argv: []string{"/bin/true"}, JobAddress: true}, 1000, 1000)
		return nil
	})
	if err == nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("StartJob with its client gone: %v, want it to fail creating the job's network", err)
	}
	for _, n := range jobNets(t) {
		if !slices.Contains(before, n) && strings.HasPrefix(n, "ftj-") {
			t.Errorf("the failed start (%v) left job network %s", err, n)
		}
	}
}

// jobNets lists the named network namespaces of this host.
func jobNets(t *testing.T) []string {
	t.Helper()
	des, err := os.ReadDir(filepath.Dir(jobnet.Path("x")))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, de := range des {
		out = append(out, de.Name())
	}
	return out
}

// TestStartJobKeepsAddressOfUndeletedNetwork: a start that fails after its job network was made, or made
// in part, and whose network then cannot be deleted keeps its address reserved: that network may still
// hold it on the wire. The old code gave it back as StartJob returned, and the next job of this host got
// it: two job networks with one address.
func TestStartJobKeepsAddressOfUndeletedNetwork(t *testing.T) {
	for _, tt := range []struct {
		name   string
		create func(context.Context, *JobNet) error
	}{
		{"its network is made in part", func(context.Context, *JobNet) error { return errors.New("bring up eth0: injected") }},
		// Made: the launch then fails, the stand-in's namespace being nowhere.
		{"its launch fails", func(context.Context, *JobNet) error { return nil }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ta := newTestAgent(t)
			a := ta.Agent
			a.reservedAddrs = map[netip.Addr]int{}
			a.cfg.Cluster.Listen = netip.MustParseAddrPort("127.0.0.1:1") // the pool's cluster network: lo's 127/8
			a.cfg.JobNetwork.Pool = netip.MustParsePrefix("127.0.0.200/30")
			a.cfg.JobNetwork.Kind = jobnet.MACVlan
			var made string
			a.nets = jobNetOps{
				create: func(ctx context.Context, n *JobNet) error { made = n.Addr.Addr().String(); return tt.create(ctx, n) },
				delete: func(context.Context, string) error { return errors.New("delete eth0: injected") },
			}
			if _, err := a.StartJob(t.Context(), JobSpec{Name: "srv", Argv: []string{"/bin/true"}, JobAddress: true}, 1000, 1000); err == nil {
				t.Fatal("StartJob succeeded")
			}
			if made == "" {
				t.Fatal("StartJob failed before it made the job's network")
			}
			next, err := a.allocJobAddr()
			if err != nil {
				t.Fatal(err)
			}
			if next.Addr().String() == made {
				t.Errorf("the next job got %s, which the failed start's undeleted network may still hold", made)
			}
		})
	}
}

// TestRestoredJobNetIsThisHostsKind: a job restored here (a fail-over, a manual restore, a rollback) gets
// the kind of interface this host's job_network.kind names, as it gets this host's parent: the record's
// kind is the host's it came from. A site sets ipvlan where a switch port allows one MAC; a macvlan made
// there from another host's record put a MAC of its own on that port.
func TestRestoredJobNetIsThisHostsKind(t *testing.T) {
	ta := newTestAgent(t)
	ta.reservedAddrs = map[netip.Addr]int{}
	ta.cfg.JobNetwork.Kind = jobnet.IPVlan
	var kinds []jobnet.Kind
	ta.nets = jobNetOps{
		create: func(_ context.Context, n *JobNet) error {
			kinds = append(kinds, n.Kind)
			return errors.New("make the job's network: stopped by the test")
		},
		delete: func(context.Context, string) error { return nil },
	}
	id := "moved-00000001"
	j := Job{ID: id, Net: &JobNet{Name: jobNetName("node2", id), Kind: jobnet.MACVlan, Addr: netip.MustParsePrefix("10.9.0.5/24")}}
	m := &ckpt.Manifest{Job: id, ID: "20261206T120000.000Z-node2-000001"}
	work := filepath.Join(ta.dir, "restore", id)
	if err := os.MkdirAll(work, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := ta.restoreJob(t.Context(), m, j, work, nil); err == nil || !strings.Contains(err.Error(), "stopped by the test") {
		t.Fatalf("restore: %v, want it to stop at making the job's network", err)
	}
	ta.guardJobNet(t.Context(), j, m, dumpWithRunID(t)) // a rollback's
	if len(kinds) != 2 {
		t.Fatalf("%d job networks made, want the restore's and the rollback's", len(kinds))
	}
	for _, k := range kinds {
		if k != jobnet.IPVlan {
			t.Errorf("a restore made a %s job network on a host configured for %s", k, jobnet.IPVlan)
		}
	}
}
