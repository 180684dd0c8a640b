package clusterapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// calls counts the requests the service saw.
func (f *fakeService) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.reqs)
}

// TestUnknownPeersRefused: only a member with a certificate of the cluster CA whose name the server's
// membership accepts gets an operation served.
func TestUnknownPeersRefused(t *testing.T) {
	f := &fakeService{}
	_, _, at := serveWith(t, f, testTimeouts, testTimeouts) // accepts n1 only
	ctx := t.Context()

	t.Run("a certificate of the CA, not a member", func(t *testing.T) {
		c := clientOf(t, at.pki, "intruder", map[string]string{"n2": at.addr}, testTimeouts)
		if _, err := c.Ping(ctx, "n2"); err == nil || !strings.Contains(err.Error(), "ping request to n2") {
			t.Errorf("ping by a non-member: %v; want a failed request", err)
		}
	})
	t.Run("a certificate of another CA", func(t *testing.T) {
		c := clientOf(t, newTestPKI(t), "n1", map[string]string{"n2": at.addr}, testTimeouts)
		if _, err := c.Ping(ctx, "n2"); err == nil {
			t.Error("ping with another CA's certificate answered")
		}
	})
	t.Run("no TLS at all", func(t *testing.T) {
		s := NewServer(ctx, f, ServerOptions{Timeouts: testTimeouts})
		hs := httptest.NewServer(s) // plain HTTP: no verified certificate
		defer hs.Close()
		resp, err := http.Post(hs.URL+OpPing.Path(), "application/json", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var e Error
		json.NewDecoder(resp.Body).Decode(&e)
		if resp.StatusCode != http.StatusForbidden || e.Code != CodeUnauthenticated || e.Op != OpPing {
			t.Errorf("status %d, refusal %+v; want 403 %s", resp.StatusCode, e, CodeUnauthenticated)
		}
	})
	if n := f.calls(); n != 0 {
		t.Errorf("the service served %d requests of unknown peers", n)
	}
}

// TestMalformedRequestsRefused sends requests the protocol does not allow: each is refused with its
// typed error, and the service never sees it.
func TestMalformedRequestsRefused(t *testing.T) {
	f := &fakeService{}
	_, _, at := serveWith(t, f, testTimeouts, testTimeouts)
	hc := rawClient(t, at.pki, "n1", "n2", at.addr)
	tests := []struct {
		name, method string
		op           Op
		body         []byte
		header       string // an Upgrade header
		status       int
		code         string
	}{
		{"a body where none belongs", "POST", OpPing, []byte("{}"), "", 413, CodeTooLarge},
		{"a trim longer than a message", "POST", OpTrim, bytes.Repeat([]byte(" "), MaxMessage+1), "", 413, CodeTooLarge},
		{"a locate longer than a header", "POST", OpLocate, bytes.Repeat([]byte(" "), MaxHeader+1), "", 413, CodeTooLarge},
		{"a recovery request longer than its bound", "POST", OpRecover, bytes.Repeat([]byte(" "), MaxRecoverRequest+1), "", 413, CodeTooLarge},
		{"invalid JSON", "POST", OpLocate, []byte(`{"id": nope}`), "", 400, CodeBadRequest},
		{"an empty body", "POST", OpClaim, nil, "", 400, CodeBadRequest},
		{"an unknown field", "POST", OpLocate, []byte(`{"id":"x","shell":"rm -rf /"}`), "", 400, CodeBadRequest},
		{"two values", "POST", OpProbe, []byte(`{"name":"n3"} {"name":"n4"}`), "", 400, CodeBadRequest},
		{"the wrong type", "POST", OpGrant, []byte(`{"incarnation":"three"}`), "", 400, CodeBadRequest},
		{"more trim points than one request carries", "POST", OpTrim, trimBody(MaxTrimPoints + 1), "", 422, CodeRefused},
		{"more flows than one logged request carries", "POST", OpLogged, loggedBody(MaxLoggedFlows + 1), "", 422, CodeRefused},
		{"a recovery of no job", "POST", OpRecover, []byte(`{"failure":"f","jobs":[]}`), "", 422, CodeRefused},
		{"a status question about too many jobs", "POST", OpRecoveryStatus, jobsBody(MaxRecoveryStatusJobs + 1), "", 422, CodeRefused},
		{"a GET", "GET", OpPing, nil, "", 405, CodeMethod},
		{"an unknown operation", "POST", Op("shutdown"), nil, "", 404, CodeUnknownOp},
		{"a snapshot that does not switch protocols", "POST", OpSnapshot, nil, "", 400, CodeBadRequest},
		{"a fetch that switches to another protocol", "POST", OpFetch, []byte(`{"job":"j","id":"x"}`), "websocket", 400, CodeBadRequest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), tt.method, "https://n2"+tt.op.Path(), bytes.NewReader(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if tt.header != "" {
				req.Header.Set("Connection", "Upgrade")
				req.Header.Set("Upgrade", tt.header)
			}
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var e Error
			if err := json.NewDecoder(io.LimitReader(resp.Body, MaxHeader)).Decode(&e); err != nil {
				t.Fatalf("status %d, body not a refusal: %v", resp.StatusCode, err)
			}
			if resp.StatusCode != tt.status || e.Code != tt.code || e.Op != tt.op || e.Message == "" {
				t.Errorf("status %d, refusal %+v; want %d %s", resp.StatusCode, e, tt.status, tt.code)
			}
		})
	}
	if n := f.calls(); n != 0 {
		t.Errorf("the service saw %d malformed requests", n)
	}
}

func trimBody(n int) []byte {
	b, _ := json.Marshal(TrimRequest{Points: make([]TrimPoint, n)})
	return b
}

func loggedBody(n int) []byte {
	b, _ := json.Marshal(LoggedRequest{Flows: make([]tcpflow.Tuple, n)})
	return b
}

func jobsBody(n int) []byte {
	b, _ := json.Marshal(RecoveryStatusRequest{Failure: "f", Jobs: make([]string, n)})
	return b
}

// TestClientRefusesWhatItCannotSend: requests beyond the protocol's bounds are refused before they leave.
func TestClientRefusesWhatItCannotSend(t *testing.T) {
	f := &fakeService{}
	c, _ := serve(t, f)
	ctx := t.Context()
	if _, err := c.Trim(ctx, "n2", TrimRequest{Points: make([]TrimPoint, MaxTrimPoints+1)}); err == nil {
		t.Error("a trim of too many points was sent")
	}
	if _, err := c.Logged(ctx, "n2", LoggedRequest{Flows: make([]tcpflow.Tuple, MaxLoggedFlows+1)}); err == nil {
		t.Error("a logged request of too many flows was sent")
	}
	if _, err := c.Recover(ctx, "n2", RecoverRequest{}, failAfter, func(RecoverProgress) {}); err == nil {
		t.Error("a recovery of no job was sent")
	}
	if _, err := c.Ping(ctx, "stranger"); err == nil || !strings.Contains(err.Error(), "not a cluster member") {
		t.Errorf("ping of a non-member: %v", err)
	}
	if n := f.calls(); n != 0 {
		t.Errorf("the service saw %d requests", n)
	}
}

// TestRefusalBodies: the client reads any refusal body, bounded, as a typed error.
func TestRefusalBodies(t *testing.T) {
	tests := []struct {
		name, body string
		status     int
		wantCode   string
		wantText   string
	}{
		{"a refusal", `{"op":"ping","code":"refused","message":"busy"}`, 422, CodeRefused, "busy"},
		{"not JSON", "<html>teapot</html>", 418, CodeRefused, "HTTP status 418"},
		{"no code", `{"message":"x"}`, 500, CodeRefused, "HTTP status 500"},
		{"a huge message", `{"code":"refused","message":"` + strings.Repeat("x", 3*MaxHeader) + `"}`, 422, CodeRefused, "HTTP status 422"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := &http.Response{StatusCode: tt.status, Status: fmt.Sprintf("%d %s", tt.status, http.StatusText(tt.status)),
				Body: io.NopCloser(strings.NewReader(tt.body))}
			err := readRefusal(resp, OpPing, "n2")
			e := Refusal(err)
			if e == nil || e.Code != tt.wantCode || !strings.Contains(e.Message, tt.wantText) || e.Status != tt.status || len(e.Message) > MaxHeader {
				t.Errorf("refusal %+v; want code %s saying %q", e, tt.wantCode, tt.wantText)
			}
		})
	}
}

// TestStrangerListenerRefused: a listener with another member's certificate is not taken for the member
// asked for.
func TestStrangerListenerRefused(t *testing.T) {
	pki := newTestPKI(t)
	s := NewServer(t.Context(), &fakeService{}, ServerOptions{Timeouts: testTimeouts})
	addr := serveHandler(t, pki, "n3", s) // n3 answers where n2 is expected
	c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, testTimeouts)
	_, err := c.Ping(t.Context(), "n2")
	var ne net.Error
	if err == nil || errors.As(err, &ne) && ne.Timeout() {
		t.Errorf("ping of n2 answered by n3: %v; want a refused handshake", err)
	}
}

// TestConnectionRefusedShows: a host whose kernel refuses the connection (up, agent down) is told apart
// from one that does not answer: the agent does not fail such a host over.
func TestConnectionRefusedShows(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	c := clientOf(t, newTestPKI(t), "n1", map[string]string{"n2": addr}, testTimeouts)
	if _, err := c.Ping(t.Context(), "n2"); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("ping of a closed port: %v; want ECONNREFUSED visible to errors.Is", err)
	}
}

// TestForgetRefusesBadRequests: a forget names a job the server uses in a path: refused before the service.
func TestForgetRefusesBadRequests(t *testing.T) {
	f := &fakeService{}
	c, _ := serve(t, f)
	for name, req := range map[string]ForgetRequest{
		"a job with a slash":   {Job: "../etc", Ended: time.Unix(1, 0)},
		"no job":               {Ended: time.Unix(1, 0)},
		"a job starting a dot": {Job: ".hidden", Ended: time.Unix(1, 0)},
		"no end":               {Job: "job-1"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := c.Forget(t.Context(), "n2", req)
			if e := Refusal(err); e == nil || e.Code != CodeBadRequest {
				t.Errorf("Forget(%+v): %v; want a bad request", req, err)
			}
		})
	}
	if n := f.calls(); n != 0 {
		t.Errorf("the service saw %d requests; want none", n)
	}
}

// TestLongRefusalsKeepTheirCode: a refusal whose message is longer than a refusal body the client reads
// (MaxHeader) still reaches it with its code and the start of its message, as an answer to a request and
// on a determinant stream. The server sent it whole: the client could decode none of it, and took a
// refusal to retry for one for good (HTTP status only), and a stream's refusal for a broken stream.
func TestLongRefusalsKeepTheirCode(t *testing.T) {
	for _, tt := range []struct {
		name string
		msg  string
	}{
		{"long", "frozen job's listen queue " + strings.Repeat("x", 2*MaxHeader)},
		{"long once quoted", "frozen job's listen queue " + strings.Repeat("<\x01", MaxHeader/2)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeService{err: &Error{Code: CodeRetry, Message: tt.msg}}
			c, logs := serve(t, f)
			_, err := c.Ping(t.Context(), "n2")
			if e := Refusal(err); e == nil || !Retry(err) || !strings.HasPrefix(e.Message, "frozen job's listen queue") {
				t.Errorf("ping: %v; want the retry refusal", err)
			}
			st, err := c.DeterminantStream(t.Context(), "n2")
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			err = st.Send(t.Context(), DeterminantsRequest{Job: "j1", Ack: true})
			if e := Refusal(err); e == nil || e.Code != CodeRetry || !strings.HasPrefix(e.Message, "frozen job's listen queue") {
				t.Errorf("determinant stream: %v; want the retry refusal", err)
			}
			// The server's log keeps the whole message.
			if !strings.Contains(logs.String(), strings.Repeat("x", 2*MaxHeader)) && tt.name == "long" {
				t.Errorf("the server's log lost the refusal's message")
			}
		})
	}
}
