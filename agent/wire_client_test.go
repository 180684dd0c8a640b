package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/spare"
	"github.com/ftkit/ftkit/tcpflow"
)

// Tests of the callers' side of the agent-to-agent protocol and of handleCluster, over mutual TLS on
// loopback: the member under test talks to scripted peers that stall, lie about lengths or answer in
// pieces.

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

// scriptedPeer listens as member name; on each connection it reads the request header and hands the
// connection to script. It returns the port.
func scriptedPeer(t *testing.T, pki *testPKI, name string, script func(c net.Conn, op clusterOp)) uint16 {
	t.Helper()
	ln, err := clustertls.Listen("127.0.0.1:0", pki.creds(t, name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var req clusterRequest
				if err := readHeader(c, &req); err != nil {
					return
				}
				script(c, req.Op)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort().Port()
}

// stall reads (and drops) whatever the caller sends and never answers, until the caller goes away.
func stall(c net.Conn, _ clusterOp) { io.Copy(io.Discard, c) }

// clientAgent is member n1 with its certificate, in a cluster where the members in ports listen there.
func clientAgent(t *testing.T, pki *testPKI, ports map[string]uint16) (*Agent, *syncBuffer) {
	t.Helper()
	a, logs := newWireAgent(t, "n1", testMembers(ports))
	cfg := pki.creds(t, "n1")
	a.cfg.Cluster.CA, a.cfg.Cluster.Cert, a.cfg.Cluster.Key = cfg.CAFile, cfg.CertFile, cfg.KeyFile
	return a, logs
}

// returnsWithin runs fn and fails the test if it has not returned after failAfter.
func returnsWithin(t *testing.T, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
	case <-time.After(failAfter):
		t.Fatalf("still waiting after %s: the call has no deadline", failAfter)
	}
}

// TestCallersGiveUpOnAStalledPeer has every caller of the protocol talk, without a deadline of its own
// (context.Background), to a member that accepts the connection and never answers: each must give up
// with an error on its own deadline.
func TestCallersGiveUpOnAStalledPeer(t *testing.T) {
	pki := newTestPKI(t)
	port := scriptedPeer(t, pki, "n2", stall)
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
		{"remoteRecover", func() error { return a.remoteRecover(bg, "n2", RecoverRequest{}, func(Stage) {}) }},
		{"fetchFrom", func() error { return a.fetchFrom(bg, "n2", "job-1", "x") }},
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
			t.Parallel()
			var err error
			returnsWithin(t, func() { err = c.call() })
			if err == nil {
				t.Error("a peer that never answered was taken for an answer")
			}
		})
	}
}

// TestLogRangeLyingPeer has the peer announce more logged bytes than it sends, a negative or a huge
// length: the caller must refuse, and never allocate what was announced.
func TestLogRangeLyingPeer(t *testing.T) {
	tests := []struct {
		name    string
		len     int64
		send    int
		then    string // "close" or "stall"
		wantErr string // "" for success
	}{
		{"as announced", 1000, 1000, "close", ""},
		{"nothing announced", 0, 0, "close", ""},
		{"1 GiB announced, 10 bytes sent", 1 << 30, 10, "close", "got 10"},
		{"more announced than sent, then silence", 1 << 20, 10, "stall", "i/o timeout"},
		{"a negative length", -1, 0, "close", "announces -1 logged bytes"},
		{"a huge length", 1 << 40, 0, "close", "announces 1099511627776 logged bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pki := newTestPKI(t)
			port := scriptedPeer(t, pki, "n2", func(c net.Conn, op clusterOp) {
				var req LogRangeRequest
				if op != opLogRange || readHeader(c, &req) != nil {
					return
				}
				writeHeader(c, LogRangeReply{From: req.From, Len: tt.len})
				c.Write(bytes.Repeat([]byte{'b'}, tt.send))
				if tt.then == "stall" {
					io.Copy(io.Discard, c)
				}
			})
			a, _ := clientAgent(t, pki, map[string]uint16{"n2": port})
			runtime.GC()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			var (
				data []byte
				err  error
			)
			returnsWithin(t, func() { _, data, err = a.LogRange(context.Background(), "n2", LogRangeRequest{From: 7}) })
			runtime.ReadMemStats(&after)
			if tt.wantErr == "" {
				if err != nil || len(data) != tt.send {
					t.Fatalf("%d bytes, %v; want %d", len(data), err, tt.send)
				}
			} else if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want one saying %q", err, tt.wantErr)
			}
			// TLS, the handshake and the reply take well under a few MiB; the announced length must not
			// show up (it is 1 GiB and more in the lying cases).
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 64<<20 {
				t.Errorf("the call allocated %d MiB for %d bytes sent", alloc>>20, tt.send)
			}
		})
	}
}

func TestReadLogBytes(t *testing.T) {
	tests := []struct {
		name    string
		n       int64
		in      string
		limit   int64
		want    string
		wantErr string
	}{
		{"all of it", 5, "hello, and more", 10, "hello", ""},
		{"nothing", 0, "", 10, "", ""},
		{"at the limit", 10, "0123456789", 10, "0123456789", ""},
		{"over the limit", 11, "0123456789a", 10, "", "a range holds 0 to 10"},
		{"negative", -1, "", 10, "", "announces -1"},
		{"short", 8, "abc", 10, "", "got 3: unexpected EOF"},
		{"longer than the first buffer", 3<<20 + 5, strings.Repeat("z", 3<<20+5), 4 << 20, strings.Repeat("z", 3<<20+5), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := readLogBytes(strings.NewReader(tt.in), tt.n, tt.limit)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v; want one saying %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || string(got) != tt.want {
				t.Fatalf("got %d bytes, %v; want %d", len(got), err, len(tt.want))
			}
			if int64(cap(got)) > max(tt.n, 1<<20) {
				t.Errorf("capacity %d for %d bytes", cap(got), tt.n)
			}
		})
	}
}

// TestRemoteRecoverFollowsKeepalives: the caller reads the target's keepalive lines, relays stages and
// ends with the target's verdict.
func TestRemoteRecoverFollowsKeepalives(t *testing.T) {
	pki := newTestPKI(t)
	port := scriptedPeer(t, pki, "s1", func(c net.Conn, op clusterOp) {
		var req RecoverRequest
		if op != opRecover || readLine(c, &req, maxRecoverRequest) != nil {
			return
		}
		for _, m := range []recoverMessage{{}, {Stage: &Stage{Name: StageFetched, Job: req.Jobs[0].Job}}, {}, {}, {Done: true, Error: "job job-1: no luck"}} {
			writeHeader(c, m)
		}
	})
	a, _ := clientAgent(t, pki, map[string]uint16{"s1": port})
	var stages []Stage
	var err error
	returnsWithin(t, func() {
		err = a.remoteRecover(context.Background(), "s1", RecoverRequest{Failure: "f", Jobs: []RecoverJob{{Job: "job-1"}}}, func(s Stage) { stages = append(stages, s) })
	})
	if err == nil || !strings.Contains(err.Error(), "recovery on s1: job job-1: no luck") {
		t.Errorf("error %v; want the target's", err)
	}
	if len(stages) != 1 || stages[0].Name != StageFetched {
		t.Errorf("stages %+v; want the one sent", stages)
	}
}

// serveAgent runs a's cluster listener on loopback and returns its port.
func serveAgent(t *testing.T, a *Agent) uint16 {
	t.Helper()
	ln, err := clustertls.Listen("127.0.0.1:0", a.tlsConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go a.handleCluster(t.Context(), c)
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort().Port()
}

// TestHandleClusterDropsStalledPeers connects as member n2 to n1's cluster listener, sends a request, and
// waits for n1 to close the connection: a member that stalls at any point must not hold the handler.
func TestHandleClusterDropsStalledPeers(t *testing.T) {
	tests := []struct {
		name    string
		send    []byte
		wantLog string
	}{
		{"nothing after the handshake", nil, "bad cluster request"},
		{"a header longer than the bound", bytes.Repeat([]byte{' '}, maxHeader+1), "message line too long"},
		{"an unknown operation", line(clusterRequest{Op: "shutdown"}), "unknown cluster operation"},
		{"trim, then silence", line(clusterRequest{Op: opTrim}), "i/o timeout"},
		{"log range, then half a request", append(line(clusterRequest{Op: opLogRange}), `{"src":`...), "i/o timeout"},
		{"a view, then silence", line(clusterRequest{Op: opView}), "i/o timeout"},
		{"recover, then silence", line(clusterRequest{Op: opRecover}), "i/o timeout"},
		{"claim, then silence", line(clusterRequest{Op: opClaim}), "i/o timeout"},
		{"fetch, then silence", line(clusterRequest{Op: opFetch}), "i/o timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			pki := newTestPKI(t)
			a, logs := clientAgent(t, pki, nil)
			port := serveAgent(t, a)
			c, err := clustertls.Dial(t.Context(), netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port).String(), "n1", pki.creds(t, "n2"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := c.Write(tt.send); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(failAfter))
			_, err = io.Copy(io.Discard, c)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("the agent still holds the connection after %s", failAfter)
			}
			// The handler has returned once the connection is closed, but its last log line may follow.
			deadline := time.Now().Add(failAfter)
			for !strings.Contains(logs.String(), tt.wantLog) {
				if time.Now().After(deadline) {
					t.Fatalf("log does not say %q:\n%s", tt.wantLog, logs.String())
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}

// TestPingReadsLargeReplies: a member running many jobs answers a ping with more than the request
// header's bound; the caller reads replies up to maxMessage.
func TestPingReadsLargeReplies(t *testing.T) {
	pki := newTestPKI(t)
	jobs := make([]string, 500) // ~20 KB of job ids
	for i := range jobs {
		jobs[i] = "a-job-with-a-long-name-" + strings.Repeat("x", 10)
	}
	port := scriptedPeer(t, pki, "n2", func(c net.Conn, op clusterOp) {
		writeHeader(c, PingReply{Node: "n2", Jobs: jobs})
	})
	a, _ := clientAgent(t, pki, map[string]uint16{"n2": port})
	var r PingReply
	var err error
	returnsWithin(t, func() { r, err = a.Ping(context.Background(), "n2") })
	if err != nil || len(r.Jobs) != len(jobs) {
		t.Fatalf("%d jobs, %v; want %d", len(r.Jobs), err, len(jobs))
	}
}

// TestReceivedOfRefusesLyingPeers: a member's record of what it received is used only if it is of the
// connection asked about and well formed; a peer that says it has none is reported with its reason.
func TestReceivedOfRefusesLyingPeers(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.77.0.3:6000"), Remote: netip.MustParseAddrPort("10.77.0.2:5000")}
	other := tcpflow.Tuple{Local: conn.Local, Remote: netip.MustParseAddrPort("10.77.0.2:5001")}
	good := recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{{Seq: 100, Len: recvdigest.BlockSize - 100, CRC: 1}, {Seq: recvdigest.BlockSize, Len: 10, CRC: 2}}}
	tests := []struct {
		name    string
		reply   receivedReply
		wantErr string
	}{
		{"as asked", receivedReply{Received: &good}, ""},
		{"no record", receivedReply{Error: "n2 has no record"}, "n2 has no record"},
		{"nothing at all", receivedReply{}, "sent no record"},
		{"another connection", receivedReply{Received: &recvdigest.Received{Conn: other, Pieces: good.Pieces}}, "not of"},
		{"a piece across a block boundary", receivedReply{Received: &recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{{Seq: 100, Len: recvdigest.BlockSize, CRC: 1}}}}, "crosses a 65536-byte block boundary"},
		{"pieces out of order", receivedReply{Received: &recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{good.Pieces[1], good.Pieces[0]}}}, "overlaps or precedes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pki := newTestPKI(t)
			port := scriptedPeer(t, pki, "n2", func(c net.Conn, op clusterOp) {
				var req receivedRequest
				if op != opReceived || readHeader(c, &req) != nil {
					return
				}
				writeHeader(c, tt.reply)
			})
			a, _ := clientAgent(t, pki, map[string]uint16{"n2": port})
			got, err := a.receivedOf(t.Context(), "n2", conn, 0)
			if tt.wantErr == "" {
				if err != nil || got == nil || got.Conn != conn || len(got.Pieces) != 2 {
					t.Fatalf("receivedOf = %+v, %v; want the record", got, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("receivedOf error %v; want one saying %q", err, tt.wantErr)
			}
		})
	}
}
