package clusterapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/tcpflow"
	"io"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/spare"
)

func testManifest(job, node string) *ckpt.Manifest {
	return &ckpt.Manifest{Job: job, Node: node, ID: "20260301T120304.000Z-" + node + "-000007",
		Created: time.Date(2026, 3, 1, 12, 3, 4, 0, time.UTC), Info: ckpt.Info{Mode: ckpt.ModeUncoordinated}}
}

var (
	testSrc = netip.MustParseAddrPort("10.77.0.2:5000")
	testDst = netip.MustParseAddrPort("10.77.0.1:6000")
)

// TestEveryOperation calls each operation through the Client against a Server over mutual TLS: the
// service gets the typed request and the caller's authenticated name, the caller gets the typed reply.
func TestEveryOperation(t *testing.T) {
	tests := []struct {
		op   Op
		call func(ctx context.Context, c *Client, f *fakeService) (sent, got any, err error)
		want any // the reply the caller must get ("" for none to check)
	}{
		{OpPing, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			r, err := c.Ping(ctx, "n2")
			return nil, r, err
		}, PingReply{Node: "n2", Jobs: []string{"job-1"}}},
		{OpLocate, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := LocateRequest{ID: "x"}
			r, err := c.Locate(ctx, "n2", req)
			return req, r, err
		}, LocateReply{ID: "x", Job: "job-1"}},
		{OpTrim, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := TrimRequest{Points: []TrimPoint{{Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}, Seq: 7}, {Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}, Seq: 9}}}
			r, err := c.Trim(ctx, "n2", req)
			return req, r, err
		}, TrimReply{Trimmed: 2}},
		{OpLogged, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := LoggedRequest{Flows: []tcpflow.Tuple{{Local: testSrc, Remote: testDst}, {Local: testDst, Remote: testSrc}}}
			r, err := c.Logged(ctx, "n2", req)
			return req, r, err
		}, LoggedReply{Unlogged: []tcpflow.Tuple{{Local: testDst, Remote: testSrc}}}},
		{OpCheckpointNow, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			return OpCheckpointNow, "", c.CheckpointNow(ctx, "n2")
		}, ""},
		{OpReceived, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := ReceivedRequest{Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}, From: 77}
			_, err := c.Received(ctx, "n2", req)
			if err != nil && strings.Contains(err.Error(), "sent no record") {
				err = nil // the fake has none: the client's check says so (TestReceivedChecksTheRecord)
			}
			return req, "", err
		}, ""},
		{OpDeterminants, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			packed, _ := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9}})
			req := DeterminantsRequest{Job: "j1", Stream: 3, First: 7, Packed: packed}
			return req, "", c.Determinants(ctx, "n2", req)
		}, ""},
		{OpDeterminantStream, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			// An agent of an earlier version's stream: every batch is answered.
			conn, err := c.upgrade(ctx, "n2", OpDeterminantStream, nil)
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close()
			packed, _ := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9}})
			var req DeterminantsRequest
			for first := range uint64(3) { // one connection carries batch after batch
				req = DeterminantsRequest{Job: "j1", Stream: 3, First: first, Packed: packed}
				if err := WriteLine(conn, req); err != nil {
					return nil, nil, err
				}
				var ack DeterminantsAck
				if err := ReadLine(conn.(bufferedConn).r, &ack, MaxHeader); err != nil || ack.Error != nil {
					return nil, nil, fmt.Errorf("answer %+v: %w", ack, err)
				}
			}
			return req, "", nil
		}, ""},
		{OpDeterminantStream2, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			conn, err := c.upgrade(ctx, "n2", OpDeterminantStream2, nil) // what an agent of an earlier version opens
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close()
			st := &DeterminantStream{op: OpDeterminantStream2, peer: "n2", conn: conn, r: conn.(bufferedConn).r, timeout: failAfter}
			req, err := sendThreeBatches(ctx, st)
			return req, "", err
		}, ""},
		{OpDeterminantStream3, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			st, err := c.DeterminantStream(ctx, "n2")
			if err != nil {
				return nil, nil, err
			}
			defer st.Close()
			if st.op != OpDeterminantStream3 {
				return nil, nil, fmt.Errorf("opened a stream of %s", st.op)
			}
			req, err := sendThreeBatches(ctx, st)
			req.PackedLen = len(req.Packed) // as the server read it
			return req, "", err
		}, ""},
		{OpDeterminantsSince, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			dets, err := c.DeterminantsSince(ctx, "n2", "j1", "s1", "")
			return DeterminantsSinceRequest{Job: "j1", Snapshot: "s1"}, len(dets), err
		}, 1},
		{OpLogWatermark, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			r, err := c.LogWatermark(ctx, "n2")
			return OpLogWatermark, r, err
		}, LogWatermark{Age: time.Second, Held: true, Addrs: []netip.Addr{netip.MustParseAddr("10.77.0.2")}}},
		{OpProbe, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := ProbeRequest{Name: "n3"}
			r, err := c.Probe(ctx, "n2", req)
			return req, r, err
		}, ProbeReply{Name: "n3", Reachable: true}},
		{OpView, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := ViewMessage{View: []byte("n1's view"), Failures: json.RawMessage(`[{"id":"f1"}]`)}
			r, err := c.View(ctx, "n2", req)
			return req, r, err
		}, ViewMessage{View: []byte("n2's view"), Failures: json.RawMessage(`[{"id":"f1"}]`)}},
		{OpClaim, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := spare.Claim{Failure: "n3-1", By: "n1", Failed: "n3", Need: spare.Need{Jobs: 1, MemoryBytes: 1 << 20}, At: time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)}
			return req, "", c.Claim(ctx, "n2", req)
		}, ""},
		{OpReplica, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := ReplicaRequest{Job: "job-1", Node: "n3"}
			r, err := c.Replica(ctx, "n2", req)
			return req, r, err
		}, ReplicaReply{Manifest: testManifest("job-1", "n3")}},
		{OpForget, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := ForgetRequest{Job: "job-1", Ended: time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)}
			r, err := c.Forget(ctx, "n2", req)
			return req, r, err
		}, ForgetReply{Deleted: 2, Kept: 1}},
		{OpRecoveryStatus, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := RecoveryStatusRequest{Failure: "n3-1", Jobs: []string{"job-1"}}
			r, err := c.RecoveryStatus(ctx, "n2", req)
			return req, r, err
		}, RecoveryStatusReply{Failure: "n3-1", Known: true, Running: []string{"job-1"}}},
		{OpGrant, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := GrantRequest{Job: "job-1", Incarnation: 3, Holder: "restore:ab"}
			r, err := c.Grant(ctx, "n2", req)
			return req, r, err
		}, GrantReply{Granted: true}},
		{OpRejoin, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := RejoinRequest{Incarnation: 2}
			r, err := c.Rejoin(ctx, "n2", req)
			return req, r, err
		}, ViewMessage{View: []byte("view")}},
		{OpVouch, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := VouchRequest{Incarnation: 2}
			r, err := c.Vouch(ctx, "n2", req)
			return req, r, err
		}, VouchReply{Member: true}},
		{OpLogRange, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			f.logBytes = bytes.Repeat([]byte("logged "), 100_000) // several flushes
			req := LogRangeRequest{Tuple: tcpflow.Tuple{Local: testSrc, Remote: testDst}, From: 77}
			r, data, err := c.LogRange(ctx, "n2", req)
			if err == nil && !bytes.Equal(data, f.logBytes) {
				t.Errorf("log-range: %d bytes received, %d sent", len(data), len(f.logBytes))
			}
			return req, r, err
		}, LogRangeReply{From: 77, Len: 700_000}},
		{OpRecover, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			f.progress = []RecoverProgress{{}, {Stage: json.RawMessage(`{"name":"fetched"}`)}, {}, {Done: true, Error: "no luck"}}
			req := RecoverRequest{Failure: "n3-1", Failed: "n3", Jobs: []RecoverJob{{Job: "job-1", Snapshot: "x"}}, Source: "n1"}
			var seen []RecoverProgress
			end, err := c.Recover(ctx, "n2", req, time.Minute, func(m RecoverProgress) { seen = append(seen, m) })
			if len(seen) != 3 || string(seen[1].Stage) != `{"name":"fetched"}` {
				t.Errorf("recover: progress %+v; want the three lines before the end", seen)
			}
			return req, end, err
		}, RecoverProgress{Done: true, Error: "no luck"}},
		{OpHeartbeat, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			f.beats = make(chan detect.Beat, 2)
			s, err := c.Heartbeats(ctx, "n2", failAfter)
			if err != nil {
				return nil, nil, err
			}
			defer s.Close()
			sent := time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)
			for seq := range uint64(2) {
				if err := s.Send(detect.Beat{From: "forged", Seq: seq, Sent: sent}); err != nil {
					return nil, nil, err
				}
			}
			var got detect.Beat
			for range 2 {
				got = <-f.beats // the stream delivers each beat as it is sent
			}
			// The authenticated name counts, never what the message says.
			return detect.Beat{From: "n1", Seq: 1, Sent: sent}, got, nil
		}, detect.Beat{From: "n1", Seq: 1, Sent: time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)}},
		{OpStartJob, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := testStartJob()
			r, err := c.StartJob(ctx, "n2", req)
			return req, r, err
		}, StartJobReply{ID: "run-node2-0a0b0c0d", Node: "n2", PID: 42, Dir: "/jobs/run-node2-0a0b0c0d"}},
		{OpSignal, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := SignalRequest{Job: "run-node2-0a0b0c0d", UID: 1000, Signal: 2}
			return req, nil, c.Signal(ctx, "n2", req)
		}, nil},
		{OpCoordinate, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := testCoordinate()
			r, err := c.Coordinate(ctx, "n2", req)
			return req, r, err
		}, CoordinateReply{Jobs: []string{"run1-0a0b0c0d"}}},
		{OpSnapshot, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			conn, err := c.Ship(ctx, "n2")
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close()
			if _, err := conn.Write([]byte("hello")); err != nil {
				return nil, nil, err
			}
			got := make([]byte, 5)
			_, err = io.ReadFull(conn, got)
			return OpSnapshot, string(got), err
		}, "hello"},
		{OpFetch, func(ctx context.Context, c *Client, f *fakeService) (any, any, error) {
			req := FetchRequest{Job: "job-1", ID: "snapshot-id"}
			conn, err := c.Fetch(ctx, "n2", req)
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close()
			got, err := io.ReadAll(conn)
			return req, string(got), err
		}, "snapshot-id"},
	}
	tested := map[Op]bool{}
	for _, tt := range tests {
		tested[tt.op] = true
	}
	for _, op := range Ops() {
		if !tested[op] {
			t.Errorf("operation %s is not tested", op)
		}
	}
	for _, tt := range tests {
		t.Run(string(tt.op), func(t *testing.T) {
			f := &fakeService{}
			c, logs := serve(t, f)
			ctx, cancel := context.WithTimeout(t.Context(), failAfter)
			defer cancel()
			sent, got, err := tt.call(ctx, c, f)
			if err != nil {
				t.Fatalf("%v; server log:\n%s", err, logs.String())
			}
			if tt.want != "" && !reflect.DeepEqual(got, tt.want) {
				t.Errorf("reply %+v; want %+v", got, tt.want)
			}
			peer, req := f.last()
			if peer != "n1" {
				t.Errorf("the service saw peer %q; want the caller's certificate name n1", peer)
			}
			if sent != nil && !reflect.DeepEqual(req, sent) {
				t.Errorf("the service got %+v; want %+v", req, sent)
			}
		})
	}
}

// sendThreeBatches sends batch after batch of one determinant on st, the last asking for an answer, and
// returns the last.
func sendThreeBatches(ctx context.Context, st *DeterminantStream) (DeterminantsRequest, error) {
	packed, _ := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9}})
	var req DeterminantsRequest
	for first := range uint64(3) {
		req = DeterminantsRequest{Job: "j1", Stream: 3, First: first, Packed: packed, Ack: first == 2}
		if err := st.Send(ctx, req); err != nil {
			return req, err
		}
	}
	return req, nil
}

// TestRefusalsReadTheSame: an operation the service refuses comes back to the caller as the same typed
// error on every operation: the code, the HTTP status, the operation, the member and the reason.
func TestRefusalsReadTheSame(t *testing.T) {
	f := &fakeService{err: errTest}
	c, logs := serve(t, f)
	ctx := t.Context()
	calls := map[Op]func() error{
		OpPing:          func() error { _, err := c.Ping(ctx, "n2"); return err },
		OpLocate:        func() error { _, err := c.Locate(ctx, "n2", LocateRequest{}); return err },
		OpTrim:          func() error { _, err := c.Trim(ctx, "n2", TrimRequest{}); return err },
		OpLogged:        func() error { _, err := c.Logged(ctx, "n2", LoggedRequest{}); return err },
		OpCheckpointNow: func() error { return c.CheckpointNow(ctx, "n2") },
		OpReceived:      func() error { _, err := c.Received(ctx, "n2", ReceivedRequest{}); return err },
		OpLogWatermark:  func() error { _, err := c.LogWatermark(ctx, "n2"); return err },
		OpDeterminants:  func() error { return c.Determinants(ctx, "n2", DeterminantsRequest{}) },
		OpDeterminantStream3: func() error {
			st, err := c.DeterminantStream(ctx, "n2")
			if err != nil {
				return err
			}
			defer st.Close()
			return st.Send(ctx, DeterminantsRequest{Ack: true})
		},
		OpDeterminantsSince: func() error {
			_, err := c.DeterminantsSince(ctx, "n2", "", "", "")
			return err
		},
		OpProbe:   func() error { _, err := c.Probe(ctx, "n2", ProbeRequest{}); return err },
		OpView:    func() error { _, err := c.View(ctx, "n2", ViewMessage{}); return err },
		OpClaim:   func() error { return c.Claim(ctx, "n2", spare.Claim{}) },
		OpReplica: func() error { _, err := c.Replica(ctx, "n2", ReplicaRequest{}); return err },
		OpForget: func() error {
			_, err := c.Forget(ctx, "n2", ForgetRequest{Job: "job-1", Ended: time.Unix(1, 0)})
			return err
		},
		OpRecoveryStatus: func() error { _, err := c.RecoveryStatus(ctx, "n2", RecoveryStatusRequest{}); return err },
		OpGrant:          func() error { _, err := c.Grant(ctx, "n2", GrantRequest{}); return err },
		OpRejoin:         func() error { _, err := c.Rejoin(ctx, "n2", RejoinRequest{}); return err },
		OpVouch:          func() error { _, err := c.Vouch(ctx, "n2", VouchRequest{}); return err },
		OpLogRange:       func() error { _, _, err := c.LogRange(ctx, "n2", LogRangeRequest{}); return err },
		OpRecover: func() error {
			_, err := c.Recover(ctx, "n2", RecoverRequest{Jobs: []RecoverJob{{}}}, time.Minute, func(RecoverProgress) {})
			return err
		},
	}
	for op, call := range calls {
		t.Run(string(op), func(t *testing.T) {
			err := call()
			e := Refusal(err)
			if e == nil {
				t.Fatalf("error %v (%T); want a refusal", err, err)
			}
			if e.Op != op || e.Peer != "n2" || e.Code != CodeRefused || e.Status != 422 || e.Message != errTest.Error() {
				t.Errorf("refusal %+v", e)
			}
			if want := string(op) + " refused by n2 (refused): not today"; err.Error() != want {
				t.Errorf("error %q; want %q", err, want)
			}
		})
	}
	if !strings.Contains(logs.String(), "cluster request refused") {
		t.Errorf("the server did not log its refusals:\n%s", logs.String())
	}
}

// TestRetryRefusalTravels: a refusal that asks for the operation again (a cut's dump that met a connection
// in a frozen job's listen queue) reaches the coordinator as CodeRetry with HTTP 409, and Retry finds it
// wherever the coordinator's errors wrap or join it; other refusals ask for nothing.
func TestRetryRefusalTravels(t *testing.T) {
	f := &fakeService{err: &Error{Code: CodeRetry, Message: "dump job a-1: in flight"}}
	c, _ := serve(t, f)
	uid := uint32(0)
	_, err := c.Coordinate(t.Context(), "n2", CoordinateRequest{Run: "r", UID: &uid, Cut: "cut-1", Phase: CoordDump})
	if e := Refusal(err); e == nil || e.Code != CodeRetry || e.Status != 409 || e.Op != OpCoordinate {
		t.Fatalf("refusal %+v (%v); want %s with 409", e, err, CodeRetry)
	}
	refused := &Error{Code: CodeRefused, Message: "no"}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"the refusal as it came", err, true},
		{"wrapped", fmt.Errorf("dump on n2: %w", err), true},
		{"joined after another host's refusal", fmt.Errorf("given up: %w", errors.Join(fmt.Errorf("dump on n1: %w", refused), fmt.Errorf("dump on n2: %w", err))), true},
		{"another refusal", refused, false},
		{"a plain error", errTest, false},
		{"none", nil, false},
	} {
		if got := Retry(tc.err); got != tc.want {
			t.Errorf("%s: Retry = %v, want %v", tc.name, got, tc.want)
		}
	}
}
