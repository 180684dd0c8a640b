package agent

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/ftkit/ftkit/internal/testenv"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
	"github.com/ftkit/ftkit/tcpflow"
)

// Tests of the agent's callers and server over mutual TLS on loopback: the member under test talks to
// members that stall or answer as scripted, and answers a member's well-formed requests.

// testPKI issues member certificates of one test CA.
type testPKI struct {
	ca  *clustertls.CA
	dir string
}

func newTestPKI(t *testing.T) *testPKI {
	ca, err := clustertls.NewCA("ftkit-test", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return &testPKI{ca: ca, dir: t.TempDir()}
}

// creds installs member name's certificate; the configuration accepts any member of the CA.
func (p *testPKI) creds(t *testing.T, name string) clustertls.Config {
	t.Helper()
	cert, key, err := p.ca.Issue(name, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clustertls.WriteFiles(filepath.Join(p.dir, name), name, p.ca.CertPEM(), cert, key)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Members = func(string) bool { return true }
	return cfg
}

// listenAs listens as member name on loopback and returns the listener and its port.
func listenAs(t *testing.T, pki *testPKI, name string) (net.Listener, uint16) {
	t.Helper()
	ln, err := clustertls.Listen("127.0.0.1:0", pki.creds(t, name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln, ln.Addr().(*net.TCPAddr).AddrPort().Port()
}

// stalledPeer listens as member name, completes the handshake of every connection, reads what comes and
// never answers. It returns the port.
func stalledPeer(t *testing.T, pki *testPKI, name string) uint16 {
	ln, port := listenAs(t, pki, name)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
				}
			}()
		}
	}()
	return port
}

// scriptedPeer serves the protocol as member name over svc (a Service embedding nil for the operations
// a test does not expect). It returns the port.
func scriptedPeer(t *testing.T, pki *testPKI, name string, svc clusterapi.Service) uint16 {
	ln, port := listenAs(t, pki, name)
	srv := clusterapi.NewServer(t.Context(), svc, clusterapi.ServerOptions{Timeouts: testWire}).HTTPServer()
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return port
}

// clientAgent is member n1 with its certificate, in a cluster where the members in ports listen there.
func clientAgent(t *testing.T, pki *testPKI, ports map[string]uint16) (*Agent, *testenv.SyncBuffer) {
	t.Helper()
	a, logs := newWireAgent(t, "n1", testMembers(ports))
	cfg := pki.creds(t, "n1")
	a.cfg.Cluster.CA, a.cfg.Cluster.Cert, a.cfg.Cluster.Key = cfg.CAFile, cfg.CertFile, cfg.KeyFile
	t.Cleanup(func() { a.peers().Close() })
	return a, logs
}

// TestCallersGiveUpOnAStalledPeer has every caller of the protocol talk, without a deadline of its own
// (context.Background), to a member that accepts the connection and never answers: each must give up
// with an error on its own deadline.
func TestCallersGiveUpOnAStalledPeer(t *testing.T) {
	pki := newTestPKI(t)
	port := stalledPeer(t, pki, "n2")
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": port})
	bg := context.Background()
	calls := []struct {
		name string
		call func() error
	}{
		{"Ping", func() error { _, err := a.Ping(bg, "n2"); return err }},
		{"sendTrim", func() error { return a.sendTrim(bg, "n2", []TrimPoint{{}}) }},
		{"LogRange", func() error { _, _, err := a.LogRange(bg, "n2", LogRangeRequest{}); return err }},
		{"exchangeView", func() error { return a.exchangeView(bg, "n2") }},
		{"requestClaim", func() error { return a.requestClaim(bg, "n2", spare.Claim{}) }},
		{"remoteReplica", func() error { _, err := a.remoteReplica(bg, "job-1", "n3"); return err }},
		{"receivedOf", func() error { _, err := a.receivedOf(bg, "n2", tcpflow.Tuple{}, 0); return err }},
		{"remoteRecover", func() error {
			// The stream breaks before it starts: the caller then asks the target, bounded.
			a.wire.Idle, a.cfg.Heartbeat.Timeout.Duration = testWire.Idle, testWire.Idle
			return a.remoteRecover(bg, "n2", RecoverRequest{Jobs: []RecoverJob{{Job: "job-1"}}}, func(Stage) {})
		}},
		{"fetchFrom", func() error { return a.fetchFrom(bg, "n2", "job-1", "x", 0) }},
		{"SignalElsewhere", func() error {
			_, err := a.SignalElsewhere(bg, Job{ID: "job-1", State: JobMoved, MovedTo: "n2"}, 1000, 2)
			return err
		}},
		{"shipTo", func() error {
			_, err := a.shipTo(bg, "n2", &ckpt.Manifest{Job: "job-1", ID: "x"}, ship.SendOptions{})
			return err
		}},
		{"recoveryStatus", func() error { _, err := a.recoveryStatus(bg, "n2", "f", nil); return err }},
		{"LogWatermarkOf", func() error { _, err := a.LogWatermarkOf(bg, "n2"); return err }},
		{"askGrant", func() error { return a.askGrant(bg, "n2", grantMessage{Job: "job-1", Incarnation: 1, Holder: "h"}).Err }},
		{"remoteJobOfSnapshot", func() error {
			if r := a.remoteJobOfSnapshot(bg, "n2", "x"); r.Job != "" {
				return nil
			}
			return errors.New("no answer")
		}},
		{"askReach", func() error {
			if a.askReach(bg, "n2", "n3") {
				return nil
			}
			return errors.New("no answer")
		}},
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			var err error
			testenv.ReturnsWithin(t, failAfter, func() { err = c.call() })
			if err == nil {
				t.Error("a peer that never answered was taken for an answer")
			}
		})
	}
}

// TestAgentAnswersEveryOperation has member n2 call the agent's server (spare s1, with nothing to find)
// with a well-formed request of each operation: each is answered, or refused with the agent's reason.
func TestAgentAnswersEveryOperation(t *testing.T) {
	pki := newTestPKI(t)
	a, logs := newWireAgent(t, "s1", testMembers(nil))
	cfg := pki.creds(t, "s1")
	a.cfg.Cluster.CA, a.cfg.Cluster.Cert, a.cfg.Cluster.Key = cfg.CAFile, cfg.CertFile, cfg.KeyFile
	a.cfg.Heartbeat.Timeout.Duration = failAfter / 4
	var err error
	if a.grants, err = grant.Open(filepath.Join(t.TempDir(), "grants.json"), grant.Options{}); err != nil {
		t.Fatal(err)
	}
	ln, err := clustertls.Listen("127.0.0.1:0", a.tlsConfig())
	if err != nil {
		t.Fatal(err)
	}
	srv := a.clusterServer(t.Context()).HTTPServer()
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	n2cfg := pki.creds(t, "n2")
	c := clusterapi.NewClient(clusterapi.ClientConfig{
		TLS:      func() clustertls.Config { return n2cfg },
		Resolve:  func(string) (string, bool) { return ln.Addr().String(), true },
		Timeouts: wireTimeouts{Message: failAfter / 2},
	})
	defer c.Close()
	ctx := t.Context()
	src, dst := netip.MustParseAddrPort("10.77.0.2:5000"), netip.MustParseAddrPort("10.77.0.1:6000")
	tests := []struct {
		op   clusterapi.Op
		call func() (any, error)
		want string // in the reply, or in the refusal
	}{
		{clusterapi.OpPing, func() (any, error) { return c.Ping(ctx, "s1") }, `"node":"s1"`},
		{clusterapi.OpLocate, func() (any, error) { return c.Locate(ctx, "s1", clusterapi.LocateRequest{ID: "x"}) }, `"job":""`},
		{clusterapi.OpTrim, func() (any, error) {
			return c.Trim(ctx, "s1", clusterapi.TrimRequest{Points: []TrimPoint{{Tuple: tcpflow.Tuple{Local: src, Remote: dst}}}})
		}, `"trimmed":0`},
		{clusterapi.OpLogged, func() (any, error) {
			// s1's log is off: the flow toward n2's address is unlogged, the one toward n1's is not n2's to ask about.
			mine, other := netip.AddrPortFrom(addrN2, 6000), netip.AddrPortFrom(addrN1, 6000)
			return c.Logged(ctx, "s1", clusterapi.LoggedRequest{Flows: []tcpflow.Tuple{{Local: src, Remote: mine}, {Local: src, Remote: other}}})
		}, `{"unlogged":[{"local":"10.77.0.2:5000","remote":"` + addrN2.String() + `:6000"}],"log_off":true}`},
		{clusterapi.OpLogRange, func() (any, error) {
			r, _, err := c.LogRange(ctx, "s1", LogRangeRequest{Tuple: tcpflow.Tuple{Local: src, Remote: dst}})
			return r, err
		}, "the sender-side log is disabled on s1"},
		{clusterapi.OpReceived, func() (any, error) {
			return c.Received(ctx, "s1", clusterapi.ReceivedRequest{Tuple: tcpflow.Tuple{Local: src, Remote: dst}})
		}, "the receive tap is disabled on s1"},
		{clusterapi.OpProbe, func() (any, error) { return c.Probe(ctx, "s1", clusterapi.ProbeRequest{Name: "nobody"}) }, `"nobody" is not a cluster member`},
		{clusterapi.OpView, func() (any, error) { return c.View(ctx, "s1", a.viewMessage()) }, `"view":`},
		{clusterapi.OpClaim, func() (any, error) {
			return nil, c.Claim(ctx, "s1", spare.Claim{Failure: "f", Failed: "n3", Need: spare.Need{Jobs: 1, MemoryBytes: 1}})
		}, "<nil>"},
		{clusterapi.OpReplica, func() (any, error) {
			return c.Replica(ctx, "s1", clusterapi.ReplicaRequest{Job: "job-1", Node: "n3"})
		}, "no verified replica of job job-1 from n3"},
		{clusterapi.OpRecover, func() (any, error) {
			return c.Recover(ctx, "s1", RecoverRequest{Failure: "other", Failed: "n3", Jobs: []RecoverJob{{Job: "job-1", Snapshot: "x"}}}, failAfter, func(clusterapi.RecoverProgress) {})
		}, "s1 was not claimed for failure other"},
		{clusterapi.OpRecoveryStatus, func() (any, error) {
			return c.RecoveryStatus(ctx, "s1", clusterapi.RecoveryStatusRequest{Failure: "n3-1", Jobs: []string{"job-1"}})
		}, `"failure":"n3-1"`},
		{clusterapi.OpGrant, func() (any, error) {
			return c.Grant(ctx, "s1", clusterapi.GrantRequest{Job: "job-1", Incarnation: 1, Holder: "restore:ab"})
		}, `"granted":true`},
		{clusterapi.OpVouch, func() (any, error) { return c.Vouch(ctx, "s1", clusterapi.VouchRequest{}) }, "this node does not watch it"},
		{clusterapi.OpCheckpointNow, func() (any, error) {
			a.ckptMu.Lock() // the snapshot it starts waits here; the test only checks the answer
			defer a.ckptMu.Unlock()
			return nil, c.CheckpointNow(ctx, "s1")
		}, "<nil>"},
	}
	for _, tt := range tests {
		t.Run(string(tt.op), func(t *testing.T) {
			r, err := tt.call()
			got := errString(err)
			if err == nil {
				b, _ := json.Marshal(r)
				got = string(b)
				if r == nil {
					got = "<nil>"
				}
			}
			if !strings.Contains(got, tt.want) {
				t.Errorf("got %s; want %q; log:\n%s", got, tt.want, logs.String())
			}
		})
	}
	for a.asked.Load() != askIdle { // let the requested snapshot finish before the agent's directory goes
		time.Sleep(time.Millisecond)
	}
}

// recoverScript is a member whose recovery is scripted (every other operation is unexpected).
type recoverScript struct {
	clusterapi.Service
	lines []clusterapi.RecoverProgress
}

func (s recoverScript) Recover(_ context.Context, _ string, req RecoverRequest, progress func(clusterapi.RecoverProgress) error) error {
	for _, m := range s.lines {
		if err := progress(m); err != nil {
			return err
		}
	}
	return nil
}

// TestRemoteRecoverFollowsKeepalives: the caller reads the target's keepalive lines, relays stages and
// ends with the target's verdict.
func TestRemoteRecoverFollowsKeepalives(t *testing.T) {
	pki := newTestPKI(t)
	stage, _ := json.Marshal(Stage{Name: StageFetched, Job: "job-1"})
	port := scriptedPeer(t, pki, "s1", recoverScript{lines: []clusterapi.RecoverProgress{
		{}, {Stage: stage}, {}, {Stage: json.RawMessage(`"not a stage"`)}, {}, {Done: true, Error: "job job-1: no luck"}}})
	a, logs := clientAgent(t, pki, map[string]uint16{"s1": port})
	var stages []Stage
	var err error
	testenv.ReturnsWithin(t, failAfter, func() {
		err = a.remoteRecover(context.Background(), "s1", RecoverRequest{Failure: "f", Jobs: []RecoverJob{{Job: "job-1"}}}, func(s Stage) { stages = append(stages, s) })
	})
	if err == nil || !strings.Contains(err.Error(), "recovery on s1: job job-1: no luck") {
		t.Errorf("error %v; want the target's", err)
	}
	if len(stages) != 1 || stages[0].Name != StageFetched {
		t.Errorf("stages %+v; want the one sent", stages)
	}
	if !strings.Contains(logs.String(), "recovery stage from the target is not the expected JSON") {
		t.Errorf("the malformed stage was not reported:\n%s", logs.String())
	}
}

// TestPushViewOfManyMembers: a view of thousands of members is delivered. Until 2026-12-07 one of more than
// about 786 KB (some 8,000 members of short names; 10,005 here) was adopted by its maker and refused by
// every member it pushed it to, as longer than a message.
func TestPushViewOfManyMembers(t *testing.T) {
	pki := newTestPKI(t)
	n2, port := servedAgent(t, pki, "n2")

	ports := map[string]uint16{"n2": port}
	members := testMembers(ports)
	for i := range 10000 {
		ip := netip.AddrFrom4([4]byte{10, 78, byte(i >> 8), byte(i)})
		members = append(members, ring.Member{Name: fmt.Sprintf("spare-%05d", i), Address: netip.AddrPortFrom(ip, 7077), Role: ring.RoleSpare})
	}
	big, err := ring.New(members)
	if err != nil {
		t.Fatal(err)
	}
	big.Epoch = 2
	n1, _ := clientAgent(t, pki, ports)
	n1.members.view = big
	// The protocol's own deadlines: a loaded machine takes seconds to decode, check and save such a view.
	n1.wire, n2.wire = wireTimeouts{}, wireTimeouts{}
	if b, _ := ring.Encode(big); base64.StdEncoding.EncodedLen(len(b)) <= clusterapi.MaxMessage {
		t.Fatalf("the view takes %d bytes, %d in base64, not more than a message (%d): the test needs more members", len(b), base64.StdEncoding.EncodedLen(len(b)), clusterapi.MaxMessage)
	}
	if err := n1.exchangeView(t.Context(), "n2"); err != nil {
		t.Fatalf("push of a view of %d members: %v", len(big.Members), err)
	}
	if got := n2.View(); got.Epoch != big.Epoch || len(got.Members) != len(big.Members) {
		t.Errorf("n2's view: epoch %d with %d members; want epoch %d with %d", got.Epoch, len(got.Members), big.Epoch, len(big.Members))
	}
}

// TestPushViewBoundsExchangesAtOnce: a push runs at most viewFanout view exchanges at once, each holding the
// encoded view and the peer's answer. Before, it ran one per member at once: an agent of a site of
// thousands of members held gigabytes for one push.
func TestPushViewBoundsExchangesAtOnce(t *testing.T) {
	pki := newTestPKI(t)
	var open, most atomic.Int32
	ports := map[string]uint16{}
	var members []ring.Member
	for i := range viewFanout + 8 {
		name := fmt.Sprintf("stalled%d", i)
		ln, port := listenAs(t, pki, name)
		go func() { // accepts, reads and never answers: each exchange holds its slot until it gives up
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				n := open.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				go func() {
					defer open.Add(-1)
					defer c.Close()
					io.Copy(io.Discard, c) // until the caller closes it
				}()
			}
		}()
		ports[name] = port
		members = append(members, ring.Member{Name: name, Address: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port), Role: ring.RoleSpare,
			Addrs: []netip.Addr{netip.AddrFrom4([4]byte{10, 79, 0, byte(i + 1)})}})
	}
	a, _ := clientAgent(t, pki, ports)
	v, err := ring.New(append(testMembers(ports), members...))
	if err != nil {
		t.Fatal(err)
	}
	a.members.view = v
	// No exchange gives up before the push's deadline (the protocol's own deadlines are longer): the first
	// viewFanout hold their slots to the end, and the others find the deadline passed.
	a.wire = wireTimeouts{}
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	a.pushView(ctx)
	// The members of testMembers refuse at once (closed ports).
	if n := most.Load(); n > viewFanout || n == 0 {
		t.Errorf("%d exchanges at once with stalled members; want at most %d", n, viewFanout)
	}
}

// servedAgent is a wire agent named name that serves the cluster API over TLS (pki's credentials), and its
// port, until the test ends.
func servedAgent(t *testing.T, pki *testPKI, name string) (*Agent, uint16) {
	t.Helper()
	a, _ := newWireAgent(t, name, testMembers(nil))
	cfg := pki.creds(t, name)
	a.cfg.Cluster.CA, a.cfg.Cluster.Cert, a.cfg.Cluster.Key = cfg.CAFile, cfg.CertFile, cfg.KeyFile
	ln, port := listenAs(t, pki, name)
	srv := a.clusterServer(t.Context()).HTTPServer()
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return a, port
}

// storeOf is a's snapshot store as node's snapshots are kept in it (the replicas a holds of node's).
func storeOf(t *testing.T, a *Agent, node string) *ckpt.Store {
	t.Helper()
	st, err := ckpt.Open(a.store.Root(), ckpt.Options{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	return st
}
