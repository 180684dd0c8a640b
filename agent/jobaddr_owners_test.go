package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
)

// pingScript is a member whose ping answer the test sets (every other operation is unexpected).
type pingScript struct {
	clusterapi.Service
	name  string
	pool  netip.Prefix
	mu    sync.Mutex
	addrs []netip.Addr
	pings int
}

func (s *pingScript) Ping(context.Context, string) (clusterapi.PingReply, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pings++
	return clusterapi.PingReply{Node: s.name, JobAddrs: s.addrs, JobPool: s.pool}, nil
}

func (s *pingScript) set(addrs ...netip.Addr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.addrs = addrs
}

func (s *pingScript) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pings
}

// TestHolderOfJobAddress: who holds a job address is asked of the members (their ping answers) and kept
// until the view changes: a member's job address resolves to it, this host's own jobs' without asking, an
// address two members claim to neither, what a member may not hold (outside the cluster network, a host's
// address) is ignored; after a view change the members are asked again (a moved job). A member whose pool
// overlaps this host's is named in an error, once.
func TestHolderOfJobAddress(t *testing.T) {
	pki := newTestPKI(t)
	n2 := &pingScript{name: "n2", pool: netip.MustParsePrefix("10.77.0.204/30")}
	n3 := &pingScript{name: "n3", pool: netip.MustParsePrefix("10.77.0.216/29")}
	a, logs := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2), "n3": scriptedPeer(t, pki, "n3", n3)})
	a.cfg.JobNetwork.Pool = netip.MustParsePrefix("10.77.0.200/29")
	a.clusterNet.once.Do(func() { a.clusterNet.prefix = netip.MustParsePrefix("10.77.0.0/24") })
	ip := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	n2.set(ip("10.77.0.201"), ip("10.77.0.205"), ip("10.9.9.9"), addrN3)
	n3.set(ip("10.77.0.202"), ip("10.77.0.205"))
	own := ip("10.77.0.210")
	a.byID["mine"] = &Job{ID: "mine", Node: "n1", State: JobRunning, Net: &JobNet{Addr: netip.PrefixFrom(own, 24)}}
	ctx := t.Context()
	for _, tc := range []struct{ addr, want string }{
		{"10.77.0.201", "n2"},
		{"10.77.0.202", "n3"},
		{"10.77.0.205", ""},          // claimed by both: neither
		{"10.77.0.203", ""},          // nobody's
		{addrN3.String(), "n3"},      // a host address: the view's answer, not n2's claim
		{"10.9.9.9", ""},             // outside the cluster network: never asked about
		{own.String(), "n1"},         // this host's running job
		{"::ffff:10.77.0.201", "n2"}, // mapped: the same address
	} {
		if got := a.memberByIPWait(ctx, ip(tc.addr)); got != tc.want {
			t.Errorf("holder of %s: %q, want %q", tc.addr, got, tc.want)
		}
	}
	// One refresh for the first address, then one for each address nobody holds (.205, .203): a waiting
	// caller wants an answer younger than its question (a job started a moment ago is in no older one).
	asked := n2.count()
	if asked != 3 {
		t.Errorf("n2 was pinged %d times for these lookups, want 3", asked)
	}
	if got := a.memberByIP(ip("10.77.0.201")); got != "n2" || n2.count() != asked {
		t.Errorf("a known address again: %q after %d more pings, want n2 from the directory, none", got, n2.count()-asked)
	}

	if out := logs.String(); strings.Count(out, "job_network.pool overlaps") != 1 || !strings.Contains(out, "member=n2") {
		t.Errorf("want one error about n2's overlapping pool (and none about n3's), logs:\n%s", out)
	}

	// n2 failed and its job with .201 was restored on n3: a new view, asked again.
	n3.set(ip("10.77.0.201"), ip("10.77.0.202"))
	v, err := a.View().Fail("n2")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.adoptView(v); err != nil {
		t.Fatal(err)
	}
	if got := a.memberByIPWait(ctx, ip("10.77.0.201")); got != "n3" {
		t.Errorf("after n2's failure the holder of 10.77.0.201 is %q, want n3", got)
	}

	// Without waiting, an address not asked about yet is unknown at first, then known once the members
	// answered (the log's capture loop must never wait for the network).
	n3.set(ip("10.77.0.201"), ip("10.77.0.202"), ip("10.77.0.206"))
	for deadline := time.Now().Add(10 * time.Second); a.memberByIP(ip("10.77.0.206")) != "n3"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("10.77.0.206 never resolved to n3 without waiting")
		}
	}
}

// TestOwnerLookupAsksOncePerBatch: a batch of addresses nobody holds (a peer's trim, a snapshot's
// connections) asks the members once, and an address seen twice in it is looked up once; a new batch asks
// again. Each such address used to ask every member again (a trim of 300 pinged each member 300 times).
func TestOwnerLookupAsksOncePerBatch(t *testing.T) {
	pki := newTestPKI(t)
	n2 := &pingScript{name: "n2"}
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2)})
	a.clusterNet.once.Do(func() { a.clusterNet.prefix = netip.MustParsePrefix("10.77.0.0/24") })
	n2.set(netip.MustParseAddr("10.77.0.201"))
	owner := a.ownerLookup(t.Context())
	for i := range 50 {
		addr := netip.AddrFrom4([4]byte{10, 77, 0, byte(100 + i%25)}) // nobody's, each twice
		if got := owner(addr); got != "" {
			t.Fatalf("holder of %s: %q, want none", addr, got)
		}
	}
	if got := owner(netip.MustParseAddr("10.77.0.201")); got != "n2" {
		t.Errorf("holder of 10.77.0.201 in the same batch: %q, want n2", got)
	}
	if n := n2.count(); n != 1 {
		t.Errorf("n2 was pinged %d times for one batch of 51 lookups, want 1", n)
	}
	if got := a.ownerLookup(t.Context())(netip.MustParseAddr("10.77.0.100")); got != "" || n2.count() != 2 {
		t.Errorf("a new batch: holder %q after %d pings in all, want none after 2 (the new batch asks again)", got, n2.count())
	}
}

// TestValidJobAddrsLogsOncePerReply: a member's claims this host ignores (not job addresses, or beyond
// maxJobAddrsPerMember) are logged once per reply, with their count. A warning per address let a member's
// ping reply (up to clusterapi.MaxMessage, some 100 000 addresses) have the root daemon write that many log
// lines at every refresh of the directory.
func TestValidJobAddrsLogsOncePerReply(t *testing.T) {
	ta := newTestAgent(t)
	a := ta.Agent
	a.clusterNet.once.Do(func() { a.clusterNet.prefix = netip.MustParsePrefix("10.77.0.0/16") })
	var mu sync.Mutex
	var warnings []slog.Record
	a.log = slog.New(hookHandler{func(r slog.Record) {
		mu.Lock()
		defer mu.Unlock()
		if r.Level >= slog.LevelWarn {
			warnings = append(warnings, r)
		}
	}})
	var claims []netip.Addr
	for i := range 1000 { // outside the cluster network
		claims = append(claims, netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)}))
	}
	for i := range maxJobAddrsPerMember + 1000 { // inside, 1000 beyond the bound
		claims = append(claims, netip.AddrFrom4([4]byte{10, 77, byte(1 + i>>8), byte(i)}))
	}
	got := a.validJobAddrs("n2", claims)
	if len(got) != maxJobAddrsPerMember {
		t.Errorf("kept %d addresses, want %d", len(got), maxJobAddrsPerMember)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(warnings) == 0 || len(warnings) > 2 {
		t.Fatalf("%d warnings for one reply's 2000 ignored claims, want one or two (each with a count)", len(warnings))
	}
	ignored := int64(0)
	for _, r := range warnings {
		r.Attrs(func(at slog.Attr) bool {
			if at.Key == "ignored" {
				ignored += at.Value.Int64()
			}
			return true
		})
	}
	if ignored != 2000 {
		t.Errorf("the warnings count %d ignored claims, want 2000", ignored)
	}
}

// A member that claims thousands of the addresses another member's jobs hold makes them nobody's (two
// copies of a job), but each refresh, which any member's trim may start, logs a bounded number of lines
// about them, not one per address.
func TestAmbiguousJobAddrsLogBounded(t *testing.T) {
	pki := newTestPKI(t)
	n2 := &pingScript{name: "n2"}
	n3 := &pingScript{name: "n3"}
	a, logs := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2), "n3": scriptedPeer(t, pki, "n3", n3)})
	a.clusterNet.once.Do(func() { a.clusterNet.prefix = netip.MustParsePrefix("10.77.0.0/16") })
	var addrs []netip.Addr
	for i := range 1000 {
		addrs = append(addrs, netip.AddrFrom4([4]byte{10, 77, byte(1 + i/250), byte(1 + i%250)}))
	}
	n2.set(addrs...)
	n3.set(addrs...)
	if got := a.memberByIPWait(t.Context(), addrs[0]); got != "" {
		t.Fatalf("holder of %s, claimed by both n2 and n3: %q, want none", addrs[0], got)
	}
	out := logs.String()
	if n := strings.Count(out, "claimed by two members"); n > maxAmbiguousLogged+1 {
		t.Fatalf("%d addresses claimed by two members logged %d lines, want at most %d", len(addrs), n, maxAmbiguousLogged+1)
	}
	if want := fmt.Sprintf("not_logged=%d", len(addrs)-maxAmbiguousLogged); !strings.Contains(out, want) {
		t.Fatalf("no line counts the addresses not logged (%s):\n%s", want, out)
	}
}
