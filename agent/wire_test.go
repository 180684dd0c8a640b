package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
	"github.com/ftkit/ftkit/tcpflow"
)

// Tests of the agent's side of the agent-to-agent protocol (package clusterapi tests the protocol itself:
// bounds, deadlines, refusals): the serve* methods called directly with typed requests, on a minimal agent
// (temporary directories, no sender-side log, no CRIU, no eBPF, no root).

// testWire are the shortened protocol deadlines of the tests.
var testWire = wireTimeouts{Message: 500 * time.Millisecond, Idle: 500 * time.Millisecond, PerMiB: 10 * time.Millisecond}

// Host addresses of the test members (never used on the wire: the cluster addresses are on loopback).
var (
	addrN1 = netip.MustParseAddr("10.77.0.1")
	addrN2 = netip.MustParseAddr("10.77.0.2")
	addrN3 = netip.MustParseAddr("10.77.0.3")
)

// testMembers is a ring of three nodes and two spares; cluster addresses are loopback ports from ports
// (a distinct low port, where nothing listens, when absent).
func testMembers(ports map[string]uint16) []ring.Member {
	closed := map[string]uint16{"n1": 1, "n2": 2, "n3": 3, "s1": 4, "s2": 5}
	port := func(name string) netip.AddrPort {
		p, ok := ports[name]
		if !ok {
			p = closed[name]
		}
		return netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), p)
	}
	return []ring.Member{
		{Name: "n1", Address: port("n1"), Role: ring.RoleNode, Addrs: []netip.Addr{addrN1}},
		{Name: "n2", Address: port("n2"), Role: ring.RoleNode, Addrs: []netip.Addr{addrN2}},
		{Name: "n3", Address: port("n3"), Role: ring.RoleNode, Addrs: []netip.Addr{addrN3}},
		{Name: "s1", Address: port("s1"), Role: ring.RoleSpare, Addrs: []netip.Addr{netip.MustParseAddr("10.77.0.11")}},
		{Name: "s2", Address: port("s2"), Role: ring.RoleSpare, Addrs: []netip.Addr{netip.MustParseAddr("10.77.0.12")}},
	}
}

// newWireAgent builds agent name with the members' view and its state in a temporary directory. A nil
// sender-side log, clamp and CRIU are legal states: the protocol handlers must cope.
func newWireAgent(t *testing.T, name string, members []ring.Member) (*Agent, *testenv.SyncBuffer) {
	t.Helper()
	dir := t.TempDir()
	logs := &testenv.SyncBuffer{}
	a := &Agent{
		log:  slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})).With("node", name),
		byID: map[string]*Job{}, changed: make(chan struct{}),
		wire: testWire,
	}
	a.cfg.Name = name
	a.cfg.StateDir = dir
	a.cfg.Heartbeat.Timeout.Duration = 50 * time.Millisecond
	v, err := ring.New(members)
	if err != nil {
		t.Fatal(err)
	}
	a.members.view, a.members.path = v, filepath.Join(dir, viewFile)
	if a.failures, err = failurelog.Open(dir, name); err != nil {
		t.Fatal(err)
	}
	if a.claims, err = spare.OpenHolder(filepath.Join(dir, "claim.json")); err != nil {
		t.Fatal(err)
	}
	if a.store, err = ckpt.Open(filepath.Join(dir, "snapshots"), ckpt.Options{Node: name, Logger: a.log}); err != nil {
		t.Fatal(err)
	}
	a.watchdog = detect.NewWatchdog(detect.Config{Timeout: a.cfg.Heartbeat.Timeout.Duration})
	return a, logs
}

func TestServeTrim(t *testing.T) {
	points := func(n int, dst netip.Addr) []TrimPoint {
		pts := make([]TrimPoint, n)
		for i := range pts {
			pts[i] = TrimPoint{Tuple: tcpflow.Tuple{Local: netip.AddrPortFrom(addrN1, uint16(10000+i)), Remote: netip.AddrPortFrom(dst, uint16(20000+i))}, Seq: uint32(i)}
		}
		return pts
	}
	tests := []struct {
		name    string
		pts     []TrimPoint
		wantLog string
	}{
		// More points than the old 4 KiB header bound held: a snapshot with many connections to one peer.
		{"many connections of the peer", points(200, addrN2), ""},
		{"connections the peer does not hold", points(5, addrN3), "refused=5"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, logs := newWireAgent(t, "n1", testMembers(nil))
			// No sender-side log here: nothing to trim, whoever asks.
			if r := a.serveTrim(context.Background(), "n2", tt.pts); r.Trimmed != 0 {
				t.Errorf("trimmed %d; want 0", r.Trimmed)
			}
			if !strings.Contains(logs.String(), tt.wantLog) {
				t.Errorf("log does not say %q:\n%s", tt.wantLog, logs.String())
			}
		})
	}
}

func TestOwnTrimPoints(t *testing.T) {
	owner := func(ip netip.Addr) string {
		return map[netip.Addr]string{addrN1: "n1", addrN2: "n2"}[ip]
	}
	mine := TrimPoint{Tuple: tcpflow.Tuple{Local: netip.AddrPortFrom(addrN1, 1), Remote: netip.AddrPortFrom(addrN2, 2)}, Seq: 7}
	other := TrimPoint{Tuple: tcpflow.Tuple{Local: netip.AddrPortFrom(addrN2, 1), Remote: netip.AddrPortFrom(addrN1, 2)}, Seq: 7}
	unknown := TrimPoint{Tuple: tcpflow.Tuple{Local: netip.AddrPortFrom(addrN1, 1), Remote: netip.AddrPortFrom(addrN3, 2)}}
	tests := []struct {
		name        string
		pts         []TrimPoint
		wantOwn     int
		wantForeign int
	}{
		{"none", nil, 0, 0},
		{"the peer's own", []TrimPoint{mine, mine}, 2, 0},
		{"another member's", []TrimPoint{mine, other}, 1, 1},
		{"no member's", []TrimPoint{unknown}, 0, 1},
		{"no address", []TrimPoint{{}}, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			own, foreign := ownTrimPoints(tt.pts, "n2", owner)
			if len(own) != tt.wantOwn || foreign != tt.wantForeign {
				t.Errorf("own %d, foreign %d; want %d, %d", len(own), foreign, tt.wantOwn, tt.wantForeign)
			}
			for _, p := range own {
				if owner(p.Remote.Addr()) != "n2" {
					t.Errorf("kept %v, which n2 does not hold", p)
				}
			}
		})
	}
}

// TestReceivePoints: a snapshot announces each connection's receive point to the member that sends on it,
// except for a socket still connecting, whose InqSeq (the kernel's 0) is no point of the peer's stream.
func TestReceivePoints(t *testing.T) {
	owner := func(ip netip.Addr) string {
		return map[netip.Addr]string{addrN1: "n1", addrN2: "n2", addrN3: "n3"}[ip]
	}
	conn := func(port uint16, remote netip.Addr, inq uint32, connecting bool) ckpt.Conn {
		return ckpt.Conn{Tuple: tcpflow.Tuple{Local: netip.AddrPortFrom(addrN1, port), Remote: netip.AddrPortFrom(remote, 7000)}, InqSeq: inq, Connecting: connecting}
	}
	got := receivePoints([]ckpt.Conn{
		conn(1, addrN2, 3000000000, false),
		conn(2, addrN2, 0, true), // connecting: no point
		conn(3, addrN3, 12, false),
		conn(4, addrN1, 5, false),                           // inside this host: never logged
		conn(5, netip.MustParseAddr("192.0.2.9"), 5, false), // no member's
	}, owner, "n1")
	want := map[string][]TrimPoint{
		"n2": {{Tuple: conn(1, addrN2, 0, false).Reverse(), Seq: 3000000000}},
		"n3": {{Tuple: conn(3, addrN3, 0, false).Reverse(), Seq: 12}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("receivePoints = %+v, want %+v", got, want)
	}
}

func TestServeViewBoundsFailures(t *testing.T) {
	many := func(n, stages int) []*Failure {
		fs := make([]*Failure, n)
		for i := range fs {
			fs[i] = &Failure{ID: fmt.Sprintf("f%d", i), Node: "n3", Protector: "n2", Updated: time.Now(), Stages: make([]Stage, stages)}
		}
		return fs
	}
	tests := []struct {
		name     string
		failures json.RawMessage
		kept     int
		wantLog  string
	}{
		{"within the bounds", mustJSON(many(3, 7)), 3, ""},
		{"more timelines than an agent keeps", mustJSON(many(failurelog.MaxFailures+1, 1)), 0, "failure timelines from peer refused"},
		{"a timeline longer than a recovery writes", mustJSON(many(1, maxWireStages+1)), 0, "4097 stages"},
		{"not timelines", json.RawMessage(`{"id":"f1"}`), 0, "not the expected JSON"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, logs := newWireAgent(t, "n1", testMembers(nil))
			peer, _ := newWireAgent(t, "n2", testMembers(nil))
			var err error
			if peer.failures, err = failurelog.Open(t.TempDir(), "n2"); err != nil { // none of its own
				t.Fatal(err)
			}
			msg := peer.viewMessage()
			msg.Failures = tt.failures
			back := a.serveView("n2", msg)
			if _, err := ring.Decode(back.View); err != nil {
				t.Errorf("the answer carries no view: %v", err)
			}
			if got := len(a.Failures()); got != tt.kept {
				t.Errorf("%d failure timelines kept; want %d", got, tt.kept)
			}
			if !strings.Contains(logs.String(), tt.wantLog) {
				t.Errorf("log does not say %q:\n%s", tt.wantLog, logs.String())
			}
		})
	}
}

func mustJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

func TestServeClaim(t *testing.T) {
	claim := spare.Claim{Failure: "n3-1", Failed: "n3", Need: spare.Need{Jobs: 1, MemoryBytes: 1 << 10}}
	tests := []struct {
		name    string
		self    string // the agent claimed
		by      string // the authenticated peer
		claim   spare.Claim
		wantErr string // "" for accepted
	}{
		{"a node's protector claims a spare", "s1", "n2", claim, ""},
		{"a node is no spare", "n1", "n2", claim, "n1 is not a free spare"},
		{"a spare claims a spare", "s1", "s2", claim, "s2 is not an alive node of the ring"},
		{"for a member that is not a node", "s1", "n2", spare.Claim{Failure: "x", Failed: "s2"}, `"s2" is not another node of the ring`},
		{"for a stranger", "s1", "n2", spare.Claim{Failure: "x", Failed: "nobody"}, `"nobody" is not another node of the ring`},
		{"for the claimer itself", "s1", "n2", spare.Claim{Failure: "x", Failed: "n2"}, `"n2" is not another node of the ring`},
		{"a negative need", "s1", "n2", spare.Claim{Failure: "x", Failed: "n3", Need: spare.Need{MemoryBytes: -1}}, "negative need"},
		{"more memory than the host has", "s1", "n2", spare.Claim{Failure: "x", Failed: "n3", Need: spare.Need{MemoryBytes: 1 << 60}}, "bytes available"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, tt.self, testMembers(nil))
			tt.claim.By = "forged" // the authenticated name counts, never what the message says
			err := a.serveClaim(tt.by, tt.claim)
			cur, claimed := a.claims.Current()
			if tt.wantErr == "" {
				if err != nil || !claimed || cur.By != tt.by {
					t.Fatalf("refused (%v) or not recorded (%+v)", err, cur)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want one saying %q", err, tt.wantErr)
			}
			if claimed {
				t.Errorf("claim recorded: %+v", cur)
			}
		})
	}
}

func TestServeRecoverRefuses(t *testing.T) {
	job := []RecoverJob{{Job: "job-1", Snapshot: "x"}}
	tests := []struct {
		name    string
		claimBy string // "" for an unclaimed spare
		peer    string
		req     RecoverRequest
		wantErr string
	}{
		{"an unclaimed spare", "", "n2", RecoverRequest{Failure: "f", Failed: "n3", Jobs: job}, "s1 was not claimed for failure f"},
		{"another failure", "n2", "n2", RecoverRequest{Failure: "g", Failed: "n3", Jobs: job}, "s1 was not claimed for failure g"},
		{"another member than the claimer", "n2", "n1", RecoverRequest{Failure: "f", Failed: "n3", Jobs: job}, "by n2 for node n3, not by n1"},
		{"another failed node", "n2", "n2", RecoverRequest{Failure: "f", Failed: "n1", Jobs: job}, "by n2 for node n3, not by n2 for node n1"},
		{"no job", "n2", "n2", RecoverRequest{Failure: "f", Failed: "n3"}, "names 0 jobs"},
		{"too many jobs", "n2", "n2", RecoverRequest{Failure: "f", Failed: "n3", Jobs: make([]RecoverJob, maxRecoverJobs+1)}, "names 1025 jobs"},
		{"an address the failed node does not hold", "n2", "n2", RecoverRequest{Failure: "f", Failed: "n3", Jobs: job, Addrs: []netip.Addr{addrN3, addrN1}},
			"address 10.77.0.1 is not one of the failed node n3's addresses"},
		// A claim comes before the view change, for any node of the ring; the restore only after it. Before,
		// a spare claimed for an alive node restored its job from a replica: a second copy.
		{"a node this host's view lists alive", "n2", "n2", RecoverRequest{Failure: "f", Failed: "n3", Jobs: job}, "n3 is alive in this host's view"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _ := newWireAgent(t, "s1", testMembers(nil))
			if !strings.Contains(tt.wantErr, "alive in this host's view") {
				if _, err := a.updateView(func(cur ring.View) (ring.View, error) { return cur.Fail("n3") }); err != nil {
					t.Fatal(err)
				}
			}
			if tt.claimBy != "" {
				if err := a.claims.Claim(spare.Claim{Failure: "f", By: tt.claimBy, Failed: "n3"}, 1<<40); err != nil {
					t.Fatal(err)
				}
			}
			started := false
			err := a.serveRecover(t.Context(), tt.peer, tt.req, func(clusterapi.RecoverProgress) error { started = true; return nil })
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want a refusal saying %q", err, tt.wantErr)
			}
			if started {
				t.Error("the refused recovery reported progress")
			}
		})
	}
}

// TestCheckpointNowCoalesces: a peer that asks for snapshots over and over gets the snapshot being taken
// and one more after it (the first may have been dumped before the bytes that made it ask), not one
// goroutine per request. Before, every request was folded into the one being taken (ci258).
func TestCheckpointNowCoalesces(t *testing.T) {
	a, logs := newWireAgent(t, "n1", testMembers(nil))
	a.ckptMu.Lock() // the first requested snapshot waits here: it stays pending
	started := 0
	for range 100 {
		if a.serveCheckpointNow(t.Context(), "n2") {
			started++
		}
	}
	a.ckptMu.Unlock()
	if started != 1 {
		t.Fatalf("%d snapshots started for 100 requests while one was pending; want 1", started)
	}
	deadline := time.Now().Add(failAfter)
	for a.asked.Load() != askIdle {
		if time.Now().After(deadline) {
			t.Fatal("the requested snapshots never finished")
		}
		time.Sleep(time.Millisecond)
	}
	if n := strings.Count(logs.String(), "taking the snapshot a sender asked for"); n != 2 {
		t.Errorf("%d snapshots taken for 100 requests, the first 99 while one was being taken; want 2:\n%s", n, logs.String())
	}
	if !a.serveCheckpointNow(t.Context(), "n2") {
		t.Error("a request after the pending snapshot finished was folded into it")
	}
	for a.asked.Load() != askIdle && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond) // let it finish before the agent's directory goes
	}
}
