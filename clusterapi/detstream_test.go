package clusterapi

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"
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
	if err := st.Send(ctx, DeterminantsRequest{Job: "j1"}); !errors.As(err, &se) {
		t.Errorf("send on a closed stream: %v; want a broken stream", err)
	}
}

// TestDeterminantStreamUnknownToOlderAgents: an agent of an earlier version, which serves no determinant
// streams, refuses one as an unknown operation, which tells the caller to send requests instead.
func TestDeterminantStreamUnknownToOlderAgents(t *testing.T) {
	pki := newTestPKI(t)
	s := NewServer(t.Context(), &fakeService{}, ServerOptions{Timeouts: testTimeouts, Logger: slog.New(slog.DiscardHandler)})
	older := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == OpDeterminantStream.Path() {
			r.URL.Path = "/v1/not-yet-an-operation"
		}
		s.ServeHTTP(w, r)
	})
	c := clientOf(t, pki, "n1", map[string]string{"n2": serveHandler(t, pki, "n2", older, "n1")}, testTimeouts)
	_, err := c.DeterminantStream(t.Context(), "n2")
	if e := Refusal(err); e == nil || e.Code != CodeUnknownOp {
		t.Fatalf("stream to an older agent: %v; want its refusal as an unknown operation", err)
	}
	if err := c.Determinants(t.Context(), "n2", DeterminantsRequest{Job: "j1"}); err != nil {
		t.Errorf("a request to the same agent: %v", err)
	}
}
