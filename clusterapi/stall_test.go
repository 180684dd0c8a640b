package clusterapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/ftkit/ftkit/internal/testenv"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// TestServerDropsStalledPeers connects as member n1 and stalls at every point of an exchange: the server
// must close the connection on its own deadline, not when the peer goes away.
func TestServerDropsStalledPeers(t *testing.T) {
	beat, _ := json.Marshal(detect.Beat{Seq: 1})
	tests := []struct {
		name    string
		send    string
		wantLog string // "" when the server's http layer drops it without a word
	}{
		{"nothing after the handshake", "", ""},
		{"half the request headers", "POST /v1/trim HTTP/1.1\r\nHost: n2\r\n", ""},
		{"half a body", "POST /v1/trim HTTP/1.1\r\nHost: n2\r\nContent-Length: 100\r\n\r\n{\"points\":", "i/o timeout"},
		{"a chunked body that stops", "POST /v1/view HTTP/1.1\r\nHost: n2\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"vie\r\n", "i/o timeout"},
		{"a heartbeat, then silence", "POST /v1/heartbeat HTTP/1.1\r\nHost: n2\r\nTransfer-Encoding: chunked\r\n\r\n" +
			fmt.Sprintf("%x\r\n%s\n\r\n", len(beat)+1, beat), "i/o timeout"},
		{"half a heartbeat", "POST /v1/heartbeat HTTP/1.1\r\nHost: n2\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"f\r\n", "i/o timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := &fakeService{}
			_, logs, at := serveWith(t, f, shortTimeouts, shortTimeouts)
			c, err := clustertls.Dial(t.Context(), at.addr, "n2", at.pki.creds(t, "n1"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := io.WriteString(c, tt.send); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(failAfter))
			_, err = io.Copy(io.Discard, c)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("the server still holds the connection after %s", failAfter)
			}
			deadline := time.Now().Add(failAfter) // the handler's last log line may follow the close
			for !strings.Contains(logs.String(), tt.wantLog) {
				if time.Now().After(deadline) {
					t.Fatalf("log does not say %q:\n%s", tt.wantLog, logs.String())
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}

// stalling is a handler that answers as script says and then holds the exchange until the test ends.
func stalling(t *testing.T, script func(w http.ResponseWriter, r *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		script(w, r)
		<-t.Context().Done()
	})
}

// TestClientDropsStalledPeers has the client talk, without a deadline of its own (context.Background), to
// members that stall at every point: each call must end with an error on the protocol's deadlines.
func TestClientDropsStalledPeers(t *testing.T) {
	bg := context.Background()
	line := func(w http.ResponseWriter, v any) {
		WriteLine(w, v)
		w.(http.Flusher).Flush()
	}
	tests := []struct {
		name    string
		handler func(w http.ResponseWriter, r *http.Request)
		call    func(c *Client) error
		wantErr string
	}{
		{"a reply that never comes", func(http.ResponseWriter, *http.Request) {},
			func(c *Client) error { _, err := c.Ping(bg, "n2"); return err }, "deadline exceeded"},
		{"half a reply", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", "100")
			io.WriteString(w, `{"node":`)
			w.(http.Flusher).Flush()
		}, func(c *Client) error { _, err := c.Ping(bg, "n2"); return err }, "deadline exceeded"},
		{"no log-range reply", func(http.ResponseWriter, *http.Request) {},
			func(c *Client) error { _, _, err := c.LogRange(bg, "n2", LogRangeRequest{}); return err }, "stalled"},
		{"logged bytes that stop", func(w http.ResponseWriter, _ *http.Request) {
			line(w, LogRangeReply{Len: 1 << 20})
			io.WriteString(w, "some bytes")
			w.(http.Flusher).Flush()
		}, func(c *Client) error { _, _, err := c.LogRange(bg, "n2", LogRangeRequest{}); return err }, "stalled"},
		{"no recovery progress", func(http.ResponseWriter, *http.Request) {},
			func(c *Client) error { return recoverErr(c) }, "stalled"},
		{"recovery progress that stops", func(w http.ResponseWriter, _ *http.Request) {
			line(w, RecoverProgress{})
			line(w, RecoverProgress{Stage: json.RawMessage(`{}`)})
		}, func(c *Client) error {
			err := recoverErr(c)
			var se *StreamError
			if !errors.As(err, &se) {
				return fmt.Errorf("not a broken stream: %w", err)
			}
			return err
		}, "stalled"},
		{"a snapshot transfer never accepted", func(http.ResponseWriter, *http.Request) {},
			func(c *Client) error { conn, err := c.Ship(bg, "n2"); closeIf(conn); return err }, "timeout"},
		{"a fetch answered in part", func(w http.ResponseWriter, _ *http.Request) {
			conn, brw, err := http.NewResponseController(w).Hijack()
			if err == nil {
				brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: ftkit-ship/1\r\n")
				brw.Flush()
				go func() { <-t.Context().Done(); conn.Close() }()
			}
		}, func(c *Client) error { conn, err := c.Fetch(bg, "n2", FetchRequest{}); closeIf(conn); return err }, "timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", stalling(t, tt.handler))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, shortTimeouts)
			var err error
			testenv.ReturnsWithin(t, failAfter, func() { err = tt.call(c) })
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want one saying %q", err, tt.wantErr)
			}
		})
	}
}

func recoverErr(c *Client) error {
	_, err := c.Recover(context.Background(), "n2", RecoverRequest{Jobs: []RecoverJob{{}}}, failAfter, func(RecoverProgress) {})
	return err
}

func closeIf(c net.Conn) {
	if c != nil {
		c.Close()
	}
}

// TestClientDropsSilentListener: a member whose port accepts connections and never speaks TLS.
func TestClientDropsSilentListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { <-t.Context().Done(); c.Close() }()
		}
	}()
	c := clientOf(t, newTestPKI(t), "n1", map[string]string{"n2": ln.Addr().String()}, shortTimeouts)
	bg := context.Background()
	for name, call := range map[string]func() error{
		"ping":     func() error { _, err := c.Ping(bg, "n2"); return err },
		"ship":     func() error { conn, err := c.Ship(bg, "n2"); closeIf(conn); return err },
		"recover":  func() error { return recoverErr(c) },
		"logrange": func() error { _, _, err := c.LogRange(bg, "n2", LogRangeRequest{}); return err },
	} {
		var err error
		testenv.ReturnsWithin(t, failAfter, func() { err = call() })
		if err == nil {
			t.Errorf("%s: a silent listener was taken for an answer", name)
		}
	}
}

// TestHeartbeatStreamEndsOnSilence: the server ends a heartbeat stream that falls silent; the sender's
// next beat then fails, and it dials again.
func TestHeartbeatStreamEndsOnSilence(t *testing.T) {
	f := &fakeService{beats: make(chan detect.Beat, 1)}
	c, logs, _ := serveWith(t, f, shortTimeouts, testTimeouts)
	s, err := c.Heartbeats(t.Context(), "n2", failAfter)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Send(detect.Beat{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	<-f.beats
	deadline := time.Now().Add(failAfter)
	for !strings.Contains(logs.String(), "i/o timeout") {
		if time.Now().After(deadline) {
			t.Fatalf("the server still reads the silent stream after %s; its log:\n%s", failAfter, logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	for s.Send(detect.Beat{Seq: 2}) == nil { // the sender learns it once the server's answer is in
		if time.Now().After(deadline) {
			t.Fatal("beats still go out on the stream the server ended")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestContextCancelEndsCall: canceling the caller's context ends a call in progress at once, whatever the
// operation's own deadline.
func TestContextCancelEndsCall(t *testing.T) {
	tests := []struct {
		name string
		call func(ctx context.Context, c *Client) error
	}{
		{"ping", func(ctx context.Context, c *Client) error { _, err := c.Ping(ctx, "n2"); return err }},
		{"view", func(ctx context.Context, c *Client) error { _, err := c.View(ctx, "n2", ViewMessage{}); return err }},
		{"log range", func(ctx context.Context, c *Client) error {
			_, _, err := c.LogRange(ctx, "n2", LogRangeRequest{})
			return err
		}},
		{"recover", func(ctx context.Context, c *Client) error {
			_, err := c.Recover(ctx, "n2", RecoverRequest{Jobs: []RecoverJob{{}}}, time.Hour, func(RecoverProgress) {})
			return err
		}},
		{"fetch", func(ctx context.Context, c *Client) error {
			conn, err := c.Fetch(ctx, "n2", FetchRequest{})
			closeIf(conn)
			return err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The member holds every request until the test ends; the deadlines are far away.
			entered := make(chan struct{}, 1)
			slow := Timeouts{Message: time.Hour, Idle: time.Hour}
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", stalling(t, func(http.ResponseWriter, *http.Request) { entered <- struct{}{} }))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, slow)
			ctx, cancel := context.WithCancel(t.Context())
			go func() {
				<-entered
				cancel()
			}()
			var err error
			testenv.ReturnsWithin(t, failAfter, func() { err = tt.call(ctx, c) })
			if !errors.Is(err, context.Canceled) && (err == nil || !strings.Contains(err.Error(), "canceled")) {
				t.Errorf("error %v; want the cancellation", err)
			}
		})
	}
	t.Run("heartbeats", func(t *testing.T) {
		f := &fakeService{beats: make(chan detect.Beat, 1)}
		c, _ := serve(t, f)
		ctx, cancel := context.WithCancel(t.Context())
		s, err := c.Heartbeats(ctx, "n2", failAfter)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if err := s.Send(detect.Beat{}); err != nil {
			t.Fatal(err)
		}
		<-f.beats
		cancel()
		deadline := time.Now().Add(failAfter)
		for s.Send(detect.Beat{}) == nil {
			if time.Now().After(deadline) {
				t.Fatal("beats still go out after the context ended")
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// lateProgress keeps the progress function of the recovery it served.
type lateProgress struct {
	*fakeService
	kept chan func(RecoverProgress) error
}

func (l lateProgress) Recover(_ context.Context, _ string, _ RecoverRequest, progress func(RecoverProgress) error) error {
	if err := progress(RecoverProgress{Done: true}); err != nil {
		return err
	}
	l.kept <- progress
	return nil
}

// TestProgressAfterTheEnd: a goroutine the service left behind that reports progress after the recovery
// returned gets an error; the ended response is not touched.
func TestProgressAfterTheEnd(t *testing.T) {
	svc := lateProgress{fakeService: &fakeService{}, kept: make(chan func(RecoverProgress) error, 1)}
	c, _ := serve(t, svc)
	if _, err := c.Recover(t.Context(), "n2", RecoverRequest{Jobs: []RecoverJob{{}}}, failAfter, func(RecoverProgress) {}); err != nil {
		t.Fatal(err)
	}
	progress := <-svc.kept
	deadline := time.Now().Add(failAfter) // the handler returns just after Recover did
	for progress(RecoverProgress{}) == nil {
		if time.Now().After(deadline) {
			t.Fatal("progress after the end was taken")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
