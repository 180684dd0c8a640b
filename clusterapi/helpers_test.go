package clusterapi

import (
	"context"
	"crypto/tls"
	"errors"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/tcpflow"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/spare"
)

// failAfter bounds every wait of these tests; it only serves as a failure timeout.
const failAfter = 20 * time.Second

// Deadlines of the tests: generous ones where nothing stalls (the machine may be loaded), short ones for
// the tests of stalls, which wait for them.
var (
	testTimeouts  = Timeouts{Message: failAfter / 4, Idle: failAfter / 4, PerMiB: 10 * time.Millisecond}
	shortTimeouts = Timeouts{Message: 500 * time.Millisecond, Idle: 500 * time.Millisecond, PerMiB: 10 * time.Millisecond}
)

// testPKI issues member certificates of one test CA.
type testPKI struct {
	ca  *clustertls.CA
	dir string
}

func newTestPKI(t testing.TB) *testPKI {
	t.Helper()
	ca, err := clustertls.NewCA("ftkit-test", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return &testPKI{ca: ca, dir: t.TempDir()}
}

// creds installs member name's certificate; the configuration accepts the members listed (any if none).
func (p *testPKI) creds(t testing.TB, name string, members ...string) clustertls.Config {
	t.Helper()
	cert, key, err := p.ca.Issue(name, []netip.Addr{netip.MustParseAddr("127.0.0.1")}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clustertls.WriteFiles(filepath.Join(p.dir, name), name, p.ca.CertPEM(), cert, key)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Members = func(n string) bool {
		if len(members) == 0 {
			return true
		}
		for _, m := range members {
			if m == n {
				return true
			}
		}
		return false
	}
	return cfg
}

// serveHandler serves h as member name on loopback over mutual TLS (members: who may connect) and returns
// its address.
func serveHandler(t testing.TB, pki *testPKI, name string, h http.Handler, members ...string) string {
	t.Helper()
	ln, err := clustertls.Listen("127.0.0.1:0", pki.creds(t, name, members...))
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: failAfter}
	if s, ok := h.(*Server); ok {
		srv = s.HTTPServer()
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// serve runs a protocol server over svc as member "n2" and returns a client of member "n1" that reaches it,
// and the server's log.
func serve(t testing.TB, svc Service) (*Client, *testenv.SyncBuffer) {
	c, logs, _ := serveWith(t, svc, testTimeouts, testTimeouts)
	return c, logs
}

// serveWith is serve with the server's and the client's deadlines; it also returns the server's address
// and the PKI, for raw clients.
func serveWith(t testing.TB, svc Service, server, client Timeouts) (*Client, *testenv.SyncBuffer, served) {
	t.Helper()
	pki := newTestPKI(t)
	logs := &testenv.SyncBuffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s := NewServer(t.Context(), svc, ServerOptions{Timeouts: server, BeatSilence: server.Idle, Logger: log})
	addr := serveHandler(t, pki, "n2", s, "n1")
	return clientOf(t, pki, "n1", map[string]string{"n2": addr}, client), logs, served{pki: pki, addr: addr}
}

// served is where a test server listens.
type served struct {
	pki  *testPKI
	addr string
}

// clientOf is a client of member self with the given member addresses.
func clientOf(t testing.TB, pki *testPKI, self string, addrs map[string]string, timeouts Timeouts) *Client {
	t.Helper()
	cfg := pki.creds(t, self)
	c := NewClient(ClientConfig{
		TLS:      func() clustertls.Config { return cfg },
		Resolve:  func(name string) (string, bool) { a, ok := addrs[name]; return a, ok },
		Timeouts: timeouts,
	})
	t.Cleanup(c.Close)
	return c
}

// rawClient is an HTTP client of member self to member peer at addr that sends whatever it is given.
func rawClient(t testing.TB, pki *testPKI, self, peer, addr string) *http.Client {
	t.Helper()
	cfg := pki.creds(t, self)
	tr := &http.Transport{
		DialTLSContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return clustertls.Dial(ctx, addr, peer, cfg)
		},
		TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: failAfter}
}

// fakeService answers every operation with what its fields say and records the requests and the peer.
type fakeService struct {
	mu    sync.Mutex
	peers []string
	reqs  []any
	beats chan detect.Beat

	err   error         // every request/reply operation refuses with it when set
	block chan struct{} // when set, every operation waits for it (or the test's end) before answering

	logBytes []byte
	progress []RecoverProgress
}

func (f *fakeService) seen(peer string, req any) error {
	f.mu.Lock()
	f.peers = append(f.peers, peer)
	f.reqs = append(f.reqs, req)
	f.mu.Unlock()
	if f.block != nil {
		<-f.block
	}
	return f.err
}

func (f *fakeService) last() (string, any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.reqs) == 0 {
		return "", nil
	}
	return f.peers[len(f.peers)-1], f.reqs[len(f.reqs)-1]
}

func (f *fakeService) Ping(_ context.Context, peer string) (PingReply, error) {
	return PingReply{Node: "n2", Jobs: []string{"job-1"}}, f.seen(peer, nil)
}

func (f *fakeService) ReceiveSnapshot(_ context.Context, peer string, c net.Conn) error {
	if err := f.seen(peer, OpSnapshot); err != nil {
		return err
	}
	_, err := io.Copy(c, io.LimitReader(c, 5)) // echo 5 bytes: both directions work
	return err
}

func (f *fakeService) Fetch(_ context.Context, peer string, req FetchRequest, c net.Conn) error {
	if err := f.seen(peer, req); err != nil {
		return err
	}
	_, err := io.WriteString(c, req.ID)
	return err
}

func (f *fakeService) Locate(_ context.Context, peer string, req LocateRequest) (LocateReply, error) {
	return LocateReply{ID: req.ID, Job: "job-1"}, f.seen(peer, req)
}

func (f *fakeService) Trim(_ context.Context, peer string, req TrimRequest) (TrimReply, error) {
	return TrimReply{Trimmed: len(req.Points)}, f.seen(peer, req)
}

func (f *fakeService) Logged(_ context.Context, peer string, req LoggedRequest) (LoggedReply, error) {
	return LoggedReply{Unlogged: req.Flows[len(req.Flows)/2:]}, f.seen(peer, req)
}

func (f *fakeService) LogRange(_ context.Context, peer string, req LogRangeRequest) (LogRangeReply, func(io.Writer) error, error) {
	if err := f.seen(peer, req); err != nil {
		return LogRangeReply{}, nil, err
	}
	return LogRangeReply{From: req.From, Len: int64(len(f.logBytes))}, func(w io.Writer) error {
		_, err := w.Write(f.logBytes)
		return err
	}, nil
}

func (f *fakeService) CheckpointNow(_ context.Context, peer string) error {
	return f.seen(peer, OpCheckpointNow)
}

func (f *fakeService) Received(_ context.Context, peer string, req ReceivedRequest) (ReceivedReply, error) {
	return ReceivedReply{}, f.seen(peer, req)
}

func (f *fakeService) LogWatermark(_ context.Context, peer string) (LogWatermark, error) {
	return LogWatermark{Age: time.Second, Held: true, Addrs: []netip.Addr{netip.MustParseAddr("10.77.0.2")}}, f.seen(peer, OpLogWatermark)
}

func (f *fakeService) Determinants(_ context.Context, peer string, req DeterminantsRequest) error {
	return f.seen(peer, req)
}

func (f *fakeService) DeterminantsSince(_ context.Context, peer string, req DeterminantsSinceRequest) (DeterminantsSinceReply, error) {
	packed, _ := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9}})
	return DeterminantsSinceReply{Packed: packed}, f.seen(peer, req)
}

func (f *fakeService) Beat(peer string, b detect.Beat) {
	f.seen(peer, b)
	if f.beats != nil {
		f.beats <- b
	}
}

func (f *fakeService) Probe(_ context.Context, peer string, req ProbeRequest) (ProbeReply, error) {
	return ProbeReply{Name: req.Name, Reachable: true}, f.seen(peer, req)
}

func (f *fakeService) View(_ context.Context, peer string, req ViewMessage) (ViewMessage, error) {
	return ViewMessage{View: []byte("n2's view"), Failures: req.Failures}, f.seen(peer, req)
}

func (f *fakeService) Claim(_ context.Context, peer string, req spare.Claim) (ClaimReply, error) {
	return ClaimReply{}, f.seen(peer, req)
}

func (f *fakeService) Replica(_ context.Context, peer string, req ReplicaRequest) (ReplicaReply, error) {
	return ReplicaReply{Manifest: testManifest(req.Job, req.Node)}, f.seen(peer, req)
}

func (f *fakeService) Forget(_ context.Context, peer string, req ForgetRequest) (ForgetReply, error) {
	return ForgetReply{Deleted: 2, Kept: 1}, f.seen(peer, req)
}

func (f *fakeService) Recover(_ context.Context, peer string, req RecoverRequest, progress func(RecoverProgress) error) error {
	if err := f.seen(peer, req); err != nil {
		return err
	}
	for _, m := range f.progress {
		if err := progress(m); err != nil {
			return err
		}
	}
	return nil
}

func (f *fakeService) RecoveryStatus(_ context.Context, peer string, req RecoveryStatusRequest) (RecoveryStatusReply, error) {
	return RecoveryStatusReply{Failure: req.Failure, Known: true, Running: req.Jobs}, f.seen(peer, req)
}

func (f *fakeService) Grant(_ context.Context, peer string, req GrantRequest) (GrantReply, error) {
	return GrantReply{Granted: !req.Release}, f.seen(peer, req)
}

func (f *fakeService) Rejoin(_ context.Context, peer string, req RejoinRequest) (ViewMessage, error) {
	return ViewMessage{View: []byte("view")}, f.seen(peer, req)
}

func (f *fakeService) Vouch(_ context.Context, peer string, req VouchRequest) (VouchReply, error) {
	return VouchReply{Member: true}, f.seen(peer, req)
}

func (f *fakeService) StartJob(_ context.Context, peer string, req StartJobRequest) (StartJobReply, error) {
	return StartJobReply{ID: req.Name + "-0a0b0c0d", Node: "n2", PID: 42, Dir: "/jobs/" + req.Name + "-0a0b0c0d"}, f.seen(peer, req)
}

func (f *fakeService) Signal(_ context.Context, peer string, req SignalRequest) error {
	return f.seen(peer, req)
}

func (f *fakeService) Coordinate(_ context.Context, peer string, req CoordinateRequest) (CoordinateReply, error) {
	return CoordinateReply{Jobs: []string{req.Run + "-0a0b0c0d"}}, f.seen(peer, req)
}

var errTest = errors.New("not today")
