package clusterapi

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/internal/testenv"
)

// fakeOperators answers every operator operation and records the operator and request.
type fakeOperators struct {
	mu        sync.Mutex
	operators []string
	reqs      []any
	err       error
}

func (f *fakeOperators) seen(op string, req any) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.operators = append(f.operators, op)
	f.reqs = append(f.reqs, req)
	return f.err
}

func (f *fakeOperators) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.reqs)
}

func (f *fakeOperators) Status(_ context.Context, op string) (OperatorStatusReply, error) {
	return OperatorStatusReply{Status: json.RawMessage(`{"node":"n2"}`)}, f.seen(op, OpOperatorStatus)
}

func (f *fakeOperators) Snapshots(_ context.Context, op string, req OperatorSnapshotsRequest) (OperatorSnapshotsReply, error) {
	return OperatorSnapshotsReply{Snapshots: []*ckpt.Manifest{testManifest("job-1", "n2")}}, f.seen(op, req)
}

func (f *fakeOperators) Events(_ context.Context, op string) (OperatorEventsReply, error) {
	return OperatorEventsReply{Failures: json.RawMessage(`[{"id":"n3-1"}]`)}, f.seen(op, OpOperatorEvents)
}

func (f *fakeOperators) Checkpoint(_ context.Context, op string, req OperatorCheckpointRequest) (OperatorCheckpointReply, error) {
	return OperatorCheckpointReply{Results: json.RawMessage(`[]`), Error: "job-2: busy"}, f.seen(op, req)
}

func (f *fakeOperators) Restore(_ context.Context, op string, req OperatorRestoreRequest) (OperatorRestoreReply, error) {
	return OperatorRestoreReply{Job: json.RawMessage(`{"id":"` + req.Job + `"}`)}, f.seen(op, req)
}

func (f *fakeOperators) Migrate(_ context.Context, op string, req OperatorMigrateRequest) (OperatorMigrateReply, error) {
	return OperatorMigrateReply{Migration: json.RawMessage(`{"job":"` + req.Job + `","to":"` + req.To + `"}`)}, f.seen(op, req)
}

func (f *fakeOperators) Drain(_ context.Context, op string, req OperatorDrainRequest) (OperatorDrainReply, error) {
	return OperatorDrainReply{Result: json.RawMessage(`{"node":"n2"}`)}, f.seen(op, req)
}

// operatorCreds installs operator name's certificate of pki's CA.
func (p *testPKI) operatorCreds(t *testing.T, name string) clustertls.Config {
	t.Helper()
	cert, key, err := p.ca.IssueOperator(name, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clustertls.WriteFiles(filepath.Join(p.dir, "operator-"+name), "operator-"+name, p.ca.CertPEM(), cert, key)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// operatorServer serves member operations (svc) and operator operations (ops, nil: none) as member n2,
// admitting member n1 and every operator; it returns the server's address, PKI and log.
func operatorServer(t *testing.T, svc Service, ops OperatorService) (served, *testenv.SyncBuffer) {
	t.Helper()
	pki := newTestPKI(t)
	logs := &testenv.SyncBuffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s := NewServer(t.Context(), svc, ServerOptions{Timeouts: testTimeouts, Logger: log, Operators: ops})
	cfg := pki.creds(t, "n2", "n1")
	cfg.Operators = func(string) bool { return true }
	ln, err := clustertls.Listen("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := s.HTTPServer()
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return served{pki: pki, addr: ln.Addr().String()}, logs
}

// clientWith is a client with the given credentials that reaches n2 at addr.
func clientWith(t *testing.T, cfg clustertls.Config, addr string) *Client {
	t.Helper()
	c := NewClient(ClientConfig{
		TLS:      func() clustertls.Config { return cfg },
		Resolve:  func(name string) (string, bool) { return addr, name == "n2" },
		Timeouts: testTimeouts,
	})
	t.Cleanup(c.Close)
	return c
}

// rawWith is an HTTP client with the given credentials to n2 at addr that sends whatever it is given.
func rawWith(t *testing.T, cfg clustertls.Config, addr string) *http.Client {
	t.Helper()
	tr := &http.Transport{
		DialTLSContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return clustertls.Dial(ctx, addr, "n2", cfg)
		},
		TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: failAfter}
}

// TestOperatorOperations: an operator calls every operator operation over real mutual TLS; the service
// sees its name and request, and each request leaves an audit line naming operator, operation and target.
func TestOperatorOperations(t *testing.T) {
	ops := &fakeOperators{}
	at, logs := operatorServer(t, &fakeService{}, ops)
	c := clientWith(t, at.pki.operatorCreds(t, "alice"), at.addr)
	ctx := t.Context()
	snap := testManifest("job-1", "n2").ID

	st, err := c.OperatorStatus(ctx, "n2")
	if err != nil || string(st.Status) != `{"node":"n2"}` {
		t.Errorf("status: %s, %v", st.Status, err)
	}
	sn, err := c.OperatorSnapshots(ctx, "n2", OperatorSnapshotsRequest{Job: "job-1"})
	if err != nil || len(sn.Snapshots) != 1 || sn.Snapshots[0].Job != "job-1" {
		t.Errorf("snapshots: %+v, %v", sn, err)
	}
	ev, err := c.OperatorEvents(ctx, "n2")
	if err != nil || string(ev.Failures) != `[{"id":"n3-1"}]` {
		t.Errorf("events: %s, %v", ev.Failures, err)
	}
	cp, err := c.OperatorCheckpoint(ctx, "n2", OperatorCheckpointRequest{Jobs: []string{"job-1", "job-2"}})
	if err != nil || cp.Error != "job-2: busy" {
		t.Errorf("checkpoint: %+v, %v", cp, err)
	}
	rs, err := c.OperatorRestore(ctx, "n2", OperatorRestoreRequest{Snapshot: snap, Job: "job-1", Source: "n3"})
	if err != nil || string(rs.Job) != `{"id":"job-1"}` {
		t.Errorf("restore: %s, %v", rs.Job, err)
	}
	mg, err := c.OperatorMigrate(ctx, "n2", OperatorMigrateRequest{Job: "job-1", To: "n3"})
	if err != nil || string(mg.Migration) != `{"job":"job-1","to":"n3"}` {
		t.Errorf("migrate: %s, %v", mg.Migration, err)
	}

	dr, err := c.OperatorDrain(ctx, "n2", OperatorDrainRequest{To: []string{"n3"}})
	if err != nil || string(dr.Result) != `{"node":"n2"}` {
		t.Errorf("drain: %s, %v", dr.Result, err)
	}

	if ops.calls() != 7 {
		t.Fatalf("the service saw %d requests, want 7", ops.calls())
	}
	for _, op := range ops.operators {
		if op != "alice" {
			t.Errorf("the service was told the operator is %q, want alice", op)
		}
	}
	for _, want := range []string{
		"op=operator/status target=host",
		"op=operator/snapshots target=\"job job-1\"",
		"op=operator/events target=host",
		"op=operator/checkpoint target=\"jobs job-1,job-2\"",
		"op=operator/restore target=\"snapshot " + snap + " job job-1 from n3\"",
	} {
		if !strings.Contains(logs.String(), "msg=\"operator request\" operator=alice "+want) {
			t.Errorf("no audit line with %q in the log:\n%s", want, logs.String())
		}
	}
}

// TestOperatorRefusedForMemberOperations: an operator certificate, valid and admitted by the handshake, is
// refused for every member operation, and the member service never runs.
func TestOperatorRefusedForMemberOperations(t *testing.T) {
	f := &fakeService{}
	at, _ := operatorServer(t, f, &fakeOperators{})
	hc := rawWith(t, at.pki.operatorCreds(t, "alice"), at.addr)
	for _, op := range Ops() {
		t.Run(string(op), func(t *testing.T) {
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "https://n2"+op.Path(), bytes.NewReader([]byte("{}")))
			req.Header.Set("Upgrade", upgradeProto)
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var e Error
			json.NewDecoder(resp.Body).Decode(&e)
			if resp.StatusCode != http.StatusForbidden || e.Code != CodeUnauthenticated || e.Op != op {
				t.Errorf("status %d, refusal %+v; want 403 %s", resp.StatusCode, e, CodeUnauthenticated)
			}
		})
	}
	// Through the typed client too, on an operation that exists for both.
	c := clientWith(t, at.pki.operatorCreds(t, "bob"), at.addr)
	if _, err := c.Ping(t.Context(), "n2"); Refusal(err) == nil || Refusal(err).Code != CodeUnauthenticated {
		t.Errorf("ping by an operator: %v, want an %s refusal", err, CodeUnauthenticated)
	}
	if n := f.calls(); n != 0 {
		t.Errorf("the member service served %d requests of operators", n)
	}
}

// TestMemberRefusedForOperatorOperations: a member's certificate (a member the server accepts) is refused
// for every operator operation: a stolen agent key is no admin console.
func TestMemberRefusedForOperatorOperations(t *testing.T) {
	ops := &fakeOperators{}
	at, _ := operatorServer(t, &fakeService{}, ops)
	c := clientWith(t, at.pki.creds(t, "n1"), at.addr)
	ctx := t.Context()
	calls := map[Op]func() error{
		OpOperatorStatus:    func() error { _, err := c.OperatorStatus(ctx, "n2"); return err },
		OpOperatorSnapshots: func() error { _, err := c.OperatorSnapshots(ctx, "n2", OperatorSnapshotsRequest{}); return err },
		OpOperatorEvents:    func() error { _, err := c.OperatorEvents(ctx, "n2"); return err },
		OpOperatorCheckpoint: func() error {
			_, err := c.OperatorCheckpoint(ctx, "n2", OperatorCheckpointRequest{})
			return err
		},
		OpOperatorRestore: func() error {
			_, err := c.OperatorRestore(ctx, "n2", OperatorRestoreRequest{Snapshot: testManifest("job-1", "n2").ID})
			return err
		},
		OpOperatorMigrate: func() error {
			_, err := c.OperatorMigrate(ctx, "n2", OperatorMigrateRequest{Job: "job-1", To: "n3"})
			return err
		},
		OpOperatorDrain: func() error {
			_, err := c.OperatorDrain(ctx, "n2", OperatorDrainRequest{})
			return err
		},
	}
	for _, op := range OperatorOps() {
		err := calls[op]()
		if e := Refusal(err); e == nil || e.Code != CodeUnauthenticated || e.Status != http.StatusForbidden || !strings.Contains(e.Message, "operator certificate") {
			t.Errorf("%s by member n1: %v; want a 403 %s refusal", op, err, CodeUnauthenticated)
		}
	}
	if n := ops.calls(); n != 0 {
		t.Errorf("the operator service served %d requests of a member", n)
	}
}

// TestOperatorsNotAdmitted: an operator certificate of another CA fails the handshake, and a server with
// no operator service refuses a valid operator.
func TestOperatorsNotAdmitted(t *testing.T) {
	ops := &fakeOperators{}
	at, _ := operatorServer(t, &fakeService{}, ops)
	other := newTestPKI(t)
	// The other CA's operator trusts this cluster's CA, so only the server's check can refuse it.
	foreign := other.operatorCreds(t, "mallory")
	foreign.CAFile = at.pki.creds(t, "n9").CAFile
	if _, err := clientWith(t, foreign, at.addr).OperatorStatus(t.Context(), "n2"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("status by an operator of another CA: %v, want a TLS refusal", err)
	}
	if n := ops.calls(); n != 0 {
		t.Errorf("the operator service served %d requests of a foreign operator", n)
	}

	none, _ := operatorServer(t, &fakeService{}, nil)
	_, err := clientWith(t, none.pki.operatorCreds(t, "alice"), none.addr).OperatorStatus(t.Context(), "n2")
	if e := Refusal(err); e == nil || e.Code != CodeUnauthenticated || !strings.Contains(e.Message, "serves no operators") {
		t.Errorf("status on a server without operators: %v", err)
	}
}

// TestOperatorBadRequests: malformed or invalid operator requests are refused before the service (and
// before the audit line: nothing was done).
func TestOperatorBadRequests(t *testing.T) {
	ops := &fakeOperators{}
	at, _ := operatorServer(t, &fakeService{}, ops)
	hc := rawWith(t, at.pki.operatorCreds(t, "alice"), at.addr)
	tests := []struct {
		name, method string
		op           Op
		body         string
		status       int
		code         string
	}{
		{"a GET", http.MethodGet, OpOperatorStatus, "", 405, CodeMethod},
		{"a body where none belongs", http.MethodPost, OpOperatorStatus, "{}", 413, CodeTooLarge},
		{"an unknown field", http.MethodPost, OpOperatorSnapshots, `{"job":"a","uid":0}`, 400, CodeBadRequest},
		{"a job name with a slash", http.MethodPost, OpOperatorSnapshots, `{"job":"../etc"}`, 400, CodeBadRequest},
		{"a checkpoint of a bad job", http.MethodPost, OpOperatorCheckpoint, `{"jobs":["ok","a/b"]}`, 400, CodeBadRequest},
		{"a restore of no snapshot", http.MethodPost, OpOperatorRestore, `{"job":"a"}`, 400, CodeBadRequest},
		{"a restore from a bad source", http.MethodPost, OpOperatorRestore, `{"snapshot":"` + testManifest("a", "n2").ID + `","source":"10.0.0.1"}`, 400, CodeBadRequest},
		{"a migration to a bad host name", http.MethodPost, OpOperatorMigrate, `{"job":"a","to":"../n3"}`, 400, CodeBadRequest},
		{"a migration of no job", http.MethodPost, OpOperatorMigrate, `{"to":"n3"}`, 400, CodeBadRequest},
		{"a drain to a bad host name", http.MethodPost, OpOperatorDrain, `{"to":["n3","a b"]}`, 400, CodeBadRequest},
		{"an unknown operation", http.MethodPost, "operator/shutdown", "", 404, CodeUnknownOp},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequestWithContext(t.Context(), tc.method, "https://n2"+tc.op.Path(), strings.NewReader(tc.body))
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var e Error
			json.NewDecoder(resp.Body).Decode(&e)
			if resp.StatusCode != tc.status || e.Code != tc.code {
				t.Errorf("status %d, refusal %+v; want %d %s", resp.StatusCode, e, tc.status, tc.code)
			}
		})
	}
	if n := ops.calls(); n != 0 {
		t.Errorf("the operator service served %d bad requests", n)
	}
}

// FuzzOperatorRequest feeds arbitrary bytes to the server's decoding and validation of every operator
// request: nothing may panic, and what validates holds only names the agent may use.
func FuzzOperatorRequest(f *testing.F) {
	snap := testManifest("job-1", "n2").ID
	for _, m := range []any{
		OperatorSnapshotsRequest{Job: "job-1"},
		OperatorCheckpointRequest{Jobs: []string{"job-1", "job-2"}},
		OperatorRestoreRequest{Snapshot: snap, Job: "job-1", Source: "n3", Force: true},
		OperatorStatusReply{Status: json.RawMessage(`{"node":"n2"}`)},
	} {
		b, _ := json.Marshal(m)
		f.Add(b)
	}
	f.Add([]byte(`{"jobs":["../x"]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		request := func(v any, limit int) bool { return len(body) <= limit && decodeStrict(body, v) == nil }
		var sr OperatorSnapshotsRequest
		if request(&sr, MaxHeader) && sr.Validate() == nil && sr.Job != "" && strings.ContainsAny(sr.Job, "/\x00") {
			t.Fatalf("job %q validated", sr.Job)
		}
		var cr OperatorCheckpointRequest
		if request(&cr, MaxMessage) && cr.Validate() == nil {
			if len(cr.Jobs) > MaxOperatorJobs {
				t.Fatalf("%d jobs validated", len(cr.Jobs))
			}
			for _, j := range cr.Jobs {
				if strings.ContainsAny(j, "/\x00") || j == "" {
					t.Fatalf("job %q validated", j)
				}
			}
		}
		var rr OperatorRestoreRequest
		if request(&rr, MaxHeader) && rr.Validate() == nil {
			if strings.ContainsAny(rr.Snapshot+rr.Job, "/\x00") || clustertls.ValidateMemberName(rr.Source) != nil && rr.Source != "" {
				t.Fatalf("restore request %+v validated", rr)
			}
		}
	})
}

// TestOperatorAuditNamesRestoreSource: the audit line of a restore names the member the snapshot is to be
// fetched from; the agent acts on it, so the audit must say which copy an operator chose.
func TestOperatorAuditNamesRestoreSource(t *testing.T) {
	ops := &fakeOperators{}
	at, logs := operatorServer(t, &fakeService{}, ops)
	c := clientWith(t, at.pki.operatorCreds(t, "alice"), at.addr)
	snap := testManifest("job-1", "n2").ID
	if _, err := c.OperatorRestore(t.Context(), "n2", OperatorRestoreRequest{Snapshot: snap, Job: "job-1", Source: "n3", Force: true}); err != nil {
		t.Fatal(err)
	}
	want := "op=operator/restore target=\"snapshot " + snap + " job job-1 from n3 (forced)\""
	if !strings.Contains(logs.String(), "msg=\"operator request\" operator=alice "+want) {
		t.Errorf("no audit line with %q in the log:\n%s", want, logs.String())
	}
}
