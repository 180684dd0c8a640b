package clusterapi

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestDeterminantStreamEndsOnGarbage: a line that is not a batch ends the stream (the server closes it and
// logs why); nothing of it reaches the service.
func TestDeterminantStreamEndsOnGarbage(t *testing.T) {
	f := &fakeService{}
	c, logs := serve(t, f)
	conn, err := c.upgrade(t.Context(), "n2", OpDeterminantStream, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, `{"job":"j1","unknown":1}`+"\n"); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(failAfter))
	if n, err := io.ReadAll(conn); err != nil || len(n) != 0 {
		t.Fatalf("the server answered %q (%v); want the stream closed", n, err)
	}
	if peer, req := f.last(); peer != "" || req != nil {
		t.Errorf("the service got %+v from %q", req, peer)
	}
	if !strings.Contains(logs.String(), "cluster stream failed") || !strings.Contains(logs.String(), "unknown field") {
		t.Errorf("the server did not log why it ended the stream:\n%s", logs.String())
	}
}

// TestDeterminantStreamIdle: the server closes a stream silent for its idle timeout, and the client calls
// a stream stale once it has been silent for half of its own, before the server could close it under a
// batch.
func TestDeterminantStreamIdle(t *testing.T) {
	// The client's idle timeout is long, so that only the test makes its stream stale; the server's is short.
	clientIdle := time.Hour
	c, _, _ := serveWith(t, &fakeService{}, Timeouts{Idle: 300 * time.Millisecond}, Timeouts{Idle: clientIdle})
	st, err := c.DeterminantStream(t.Context(), "n2")
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if st.Stale() {
		t.Fatal("a new stream is stale")
	}
	st.used = time.Now().Add(-clientIdle/2 - time.Second)
	if !st.Stale() {
		t.Error("a stream silent for half the idle timeout is not stale")
	}
	// The server's close shows as the end of the stream.
	st.conn.SetReadDeadline(time.Now().Add(failAfter))
	var one [1]byte
	if _, err := st.r.Read(one[:]); !errors.Is(err, io.EOF) {
		t.Fatalf("read on an idle stream: %v; want the server's close", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), failAfter)
	defer cancel()
	var se *StreamError
	if err := st.Send(ctx, DeterminantsRequest{Job: "j1", Ack: true}); !errors.As(err, &se) {
		t.Errorf("send on a closed stream: %v; want a broken stream", err)
	}
}

// TestDeterminantStreamUnknownToOlderAgents: an agent of an earlier version that serves no determinant
// streams refuses them as an unknown operation, which tells the caller to send requests instead; one that
// serves OpDeterminantStream2 but not 3 gets a stream of 2, whose batches carry their packed bytes inside
// their lines.
func TestDeterminantStreamUnknownToOlderAgents(t *testing.T) {
	packed, err := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		unknown []Op
		want    Op // "": no stream
	}{
		{"serves none", []Op{OpDeterminantStream2, OpDeterminantStream3}, ""},
		{"serves 2", []Op{OpDeterminantStream3}, OpDeterminantStream2},
		{"serves 3", nil, OpDeterminantStream3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pki := newTestPKI(t)
			f := &fakeService{}
			s := NewServer(t.Context(), f, ServerOptions{Timeouts: testTimeouts, Logger: slog.New(slog.DiscardHandler)})
			older := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				for _, op := range tc.unknown {
					if r.URL.Path == op.Path() {
						r.URL.Path = "/v1/not-yet-an-operation"
					}
				}
				s.ServeHTTP(w, r)
			})
			c := clientOf(t, pki, "n1", map[string]string{"n2": serveHandler(t, pki, "n2", older, "n1")}, testTimeouts)
			st, err := c.DeterminantStream(t.Context(), "n2")
			if tc.want == "" {
				if e := Refusal(err); e == nil || e.Code != CodeUnknownOp {
					t.Fatalf("stream to an older agent: %v; want its refusal as an unknown operation", err)
				}
				if err := c.Determinants(t.Context(), "n2", DeterminantsRequest{Job: "j1", Packed: packed}); err != nil {
					t.Errorf("a request to the same agent: %v", err)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				defer st.Close()
				if st.op != tc.want {
					t.Errorf("opened a stream of %s, want %s", st.op, tc.want)
				}
				if err := st.Send(t.Context(), DeterminantsRequest{Job: "j1", Packed: packed, Ack: true}); err != nil {
					t.Fatal(err)
				}
			}
			_, req := f.last()
			if r, ok := req.(DeterminantsRequest); !ok || r.Job != "j1" || !bytes.Equal(r.Packed, packed) {
				t.Errorf("the service got %+v, want job j1's batch with its %d packed bytes", req, len(packed))
			}
		})
	}
}

// openStream serves svc and opens a determinant stream to it, within a context of failAfter; both end with
// the test.
func openStream(t *testing.T, svc Service) (context.Context, *Client, *DeterminantStream) {
	c, _ := serve(t, svc)
	ctx, cancel := context.WithTimeout(t.Context(), failAfter)
	t.Cleanup(cancel)
	st, err := c.DeterminantStream(ctx, "n2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return ctx, c, st
}

// TestDeterminantStream3Frames: on OpDeterminantStream3 each batch's packed bytes follow its line. Batches
// of every size up to the bound reach the service whole and in order; a line that carries packed bytes
// itself, or announces more than the bound, ends the stream with nothing of it stored.
func TestDeterminantStream3Frames(t *testing.T) {
	f := &fakeService{}
	ctx, c, st := openStream(t, f)
	var dets []intercept.Det
	for i := range intercept.MaxBatch {
		dets = append(dets, intercept.Det{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: uint32(i + 1), Len: 1, Pos: uint64(i)})
	}
	var sent [][]byte
	for i, n := range []int{1, 0, 2, intercept.MaxBatch, 7} {
		packed, err := intercept.Pack(dets[:n])
		if err != nil {
			t.Fatal(err)
		}
		sent = append(sent, packed)
		if err := st.Send(ctx, DeterminantsRequest{Job: "j1", First: uint64(i), Packed: packed, Ack: i == 4}); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
	}
	f.mu.Lock()
	if len(f.reqs) != len(sent) {
		t.Fatalf("the service got %d batches, want %d", len(f.reqs), len(sent))
	}
	for i, r := range f.reqs {
		if r := r.(DeterminantsRequest); r.First != uint64(i) || !bytes.Equal(r.Packed, sent[i]) || r.PackedLen != len(sent[i]) {
			t.Errorf("batch %d arrived as number %d with %d packed bytes (%d announced), want %d", i, r.First, len(r.Packed), r.PackedLen, len(sent[i]))
		}
	}
	f.mu.Unlock()

	for _, line := range []string{
		`{"job":"j2","packed":"AAAA","packed_len":3}` + "\nAAA",
		fmt.Sprintf(`{"job":"j2","packed_len":%d}`, MaxMessage+1) + "\n",
		`{"job":"j2","packed_len":-1}` + "\n",
	} {
		conn, err := c.upgrade(ctx, "n2", OpDeterminantStream3, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(conn, line); err != nil {
			t.Fatal(err)
		}
		conn.SetReadDeadline(time.Now().Add(failAfter))
		if n, err := io.ReadAll(conn); err != nil || len(n) != 0 {
			t.Errorf("after %q the server answered %q (%v); want the stream closed", line, n, err)
		}
		conn.Close()
	}
	if _, req := f.last(); req.(DeterminantsRequest).Job != "j1" {
		t.Errorf("the service got %+v from a bad frame", req)
	}
}

// refuseJob is a service that refuses the determinants of one job.
type refuseJob struct {
	fakeService
	job string
}

func (f *refuseJob) Determinants(ctx context.Context, peer string, req DeterminantsRequest) error {
	if req.Job == f.job {
		return errTest
	}
	return f.fakeService.Determinants(ctx, peer, req)
}

// takeDeterminants takes every batch and keeps none (the fake keeps every request).
type takeDeterminants struct{ fakeService }

func (*takeDeterminants) Determinants(context.Context, string, DeterminantsRequest) error { return nil }

// TestDeterminantStream2AnswersWhenAsked: the server answers only a batch that asks, and a refused one,
// after which it ends the stream and stores nothing that followed on it.
func TestDeterminantStream2AnswersWhenAsked(t *testing.T) {
	f := &refuseJob{job: "bad"}
	ctx, _, st := openStream(t, f)
	for i, req := range []DeterminantsRequest{{Job: "j1", First: 0}, {Job: "j1", First: 1}, {Job: "j1", First: 2, Ack: true},
		{Job: "bad", First: 3}, {Job: "j1", First: 4}} {
		if err := st.Send(ctx, req); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
	}
	// Had the server answered the first two, the answer read for the third would have been the first's,
	// and the rest would come before the refusal.
	st.conn.SetReadDeadline(time.Now().Add(failAfter))
	rest, err := io.ReadAll(st.r)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("after the refused batch: %v", err)
	}
	var ack DeterminantsAck
	if lines := strings.Split(strings.TrimSuffix(string(rest), "\n"), "\n"); len(lines) != 1 || decodeStrict([]byte(lines[0]), &ack) != nil ||
		ack.Error == nil || ack.Error.Code != CodeRefused {
		t.Fatalf("the server sent %q after the answered batch; want only the refusal, then the stream's end", rest)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.reqs) != 3 {
		t.Errorf("the service stored %d batches, want the 3 before the refused one: %+v", len(f.reqs), f.reqs)
	}
}

// BenchmarkDeterminantStream ships a stencil rank's round (two determinants) every pace, client and server
// in this process over loopback TLS, answered every batch (OpDeterminantStream's way) or one in 12 (a
// member's default: one answer in 250 ms of 20 ms rounds). cpu-us/batch is the process's CPU, user and
// system, per batch: paced, each batch wakes both ends as it does between two agents.
func BenchmarkDeterminantStream(b *testing.B) {
	const pace = 2 * time.Millisecond
	packed, err := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9},
		{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 18, Len: 9}})
	if err != nil {
		b.Fatal(err)
	}
	for _, every := range []int{1, 12} {
		b.Run(fmt.Sprintf("answer-every-%d", every), func(b *testing.B) {
			c, _ := serve(b, &takeDeterminants{})
			st, err := c.DeterminantStream(b.Context(), "n2")
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			cpu := func() time.Duration {
				var ru syscall.Rusage
				syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
				return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
			}
			tick := time.NewTicker(pace)
			defer tick.Stop()
			b.ResetTimer()
			start := cpu()
			for i := range b.N {
				<-tick.C
				req := DeterminantsRequest{Job: "j1", First: uint64(2 * i), Packed: packed, Ack: (i+1)%every == 0 || i == b.N-1}
				if err := st.Send(b.Context(), req); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(cpu()-start)/float64(b.N)/1e3, "cpu-us/batch")
		})
	}
}

// FuzzDeterminantStream3 reads arbitrary bytes as a determinant stream of each kind: nothing may panic,
// and no batch may hold more packed bytes than the protocol's bound for a message.
func FuzzDeterminantStream3(f *testing.F) {
	packed, err := intercept.Pack([]intercept.Det{{Conn: tcpflow.Tuple{Local: testSrc, Remote: testDst}, End: 9, Len: 9}})
	if err != nil {
		f.Fatal(err)
	}
	f.Add([]byte(fmt.Sprintf(`{"job":"j1","packed_len":%d}`+"\n", len(packed)) + string(packed) + `{"job":"j1","packed_len":0,"ack":true}` + "\n"))
	f.Add([]byte(`{"job":"j1","packed_len":1048576}` + "\nabc"))
	f.Add([]byte(`{"job":"j1","packed":"AAAA"}` + "\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, op := range []Op{OpDeterminantStream2, OpDeterminantStream3} {
			in := bufio.NewReader(bytes.NewReader(data))
			for {
				req, err := readBatch(in, op)
				if err != nil {
					break
				}
				if len(req.Packed) > MaxMessage {
					t.Fatalf("%s: a batch of %d packed bytes read", op, len(req.Packed))
				}
				if b, err := req.Batch(); err == nil && len(b.Dets) > intercept.MaxBatch {
					t.Fatalf("%s: a batch of %d determinants read", op, len(b.Dets))
				}
			}
		}
	})
}
