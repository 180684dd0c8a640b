package clusterapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/spare"
)

// Service is what a server does for its peers: one method per operation, given the authenticated name of
// the calling member and its decoded, bounded request. An error is sent back as a refusal (*Error: its
// code and message as given; any other error: CodeRefused with its text).
//
// ctx is the server's (the agent's) lifetime, not the request's: an operation the caller started goes on
// if the caller goes away (a recovery does); streams end on their own deadlines.
type Service interface {
	Ping(ctx context.Context, peer string) (PingReply, error)
	// ReceiveSnapshot receives a snapshot over conn (ckpt/ship framing).
	ReceiveSnapshot(ctx context.Context, peer string, conn net.Conn) error
	// Fetch ships the snapshot asked for over conn (ckpt/ship framing).
	Fetch(ctx context.Context, peer string, req FetchRequest, conn net.Conn) error
	Locate(ctx context.Context, peer string, req LocateRequest) (LocateReply, error)
	Trim(ctx context.Context, peer string, req TrimRequest) (TrimReply, error)
	// Logged says which of req's flows (validated) the server does not log.
	Logged(ctx context.Context, peer string, req LoggedRequest) (LoggedReply, error)
	// LogRange answers with the reply and the function that writes its Len bytes (nil if Len is 0).
	LogRange(ctx context.Context, peer string, req LogRangeRequest) (LogRangeReply, func(w io.Writer) error, error)
	CheckpointNow(ctx context.Context, peer string) error
	Received(ctx context.Context, peer string, req ReceivedRequest) (ReceivedReply, error)
	LogWatermark(ctx context.Context, peer string) (LogWatermark, error)
	// Determinants stores a batch of a job's receive-order determinants peer sent.
	Determinants(ctx context.Context, peer string, req DeterminantsRequest) error
	DeterminantsSince(ctx context.Context, peer string, req DeterminantsSinceRequest) (DeterminantsSinceReply, error)
	// Beat records one heartbeat of peer's stream.
	Beat(peer string, b detect.Beat)
	Probe(ctx context.Context, peer string, req ProbeRequest) (ProbeReply, error)
	View(ctx context.Context, peer string, req ViewMessage) (ViewMessage, error)
	Claim(ctx context.Context, peer string, req spare.Claim) (ClaimReply, error)
	Replica(ctx context.Context, peer string, req ReplicaRequest) (ReplicaReply, error)
	// Forget drops the replicas of peer's ended job that peer took; req is validated.
	Forget(ctx context.Context, peer string, req ForgetRequest) (ForgetReply, error)
	// Recover runs a recovery and reports it through progress. An error before the first progress is a
	// refusal; after it, the stream ends with it (Done).
	Recover(ctx context.Context, peer string, req RecoverRequest, progress func(RecoverProgress) error) error
	RecoveryStatus(ctx context.Context, peer string, req RecoveryStatusRequest) (RecoveryStatusReply, error)
	Grant(ctx context.Context, peer string, req GrantRequest) (GrantReply, error)
	// Rejoin admits peer, a failed member, back as a spare and answers with the new view.
	Rejoin(ctx context.Context, peer string, req RejoinRequest) (ViewMessage, error)
	// Vouch answers peer, back from a stall of its own, whether it is still a member (OpVouch).
	Vouch(ctx context.Context, peer string, req VouchRequest) (VouchReply, error)
	// StartJob starts a job as req.UID for a caller of peer; req is validated.
	StartJob(ctx context.Context, peer string, req StartJobRequest) (StartJobReply, error)
	// Signal signals the server's copy of a job for a caller of peer; req is validated.
	Signal(ctx context.Context, peer string, req SignalRequest) error
	// Coordinate runs one phase of a coordinated snapshot or rollback of a run; req is validated.
	Coordinate(ctx context.Context, peer string, req CoordinateRequest) (CoordinateReply, error)
}

// ServerOptions configure a Server.
type ServerOptions struct {
	Timeouts Timeouts
	// BeatSilence ends a heartbeat stream that falls silent this long (the watchdog has suspected the
	// sender long before; a sender that comes back dials again). Zero: the idle timeout.
	BeatSilence time.Duration
	Logger      *slog.Logger
	// Operators serves operator certificates (operator.go); nil refuses them.
	Operators OperatorService
}

// Server serves the protocol to authenticated members.
type Server struct {
	svc  Service
	opts ServerOptions
	log  *slog.Logger
	base context.Context
	mux  *http.ServeMux
	ops  *http.ServeMux // operator operations (operator.go)
}

// NewServer returns the protocol's handler over svc; ctx is handed to svc's methods.
func NewServer(ctx context.Context, svc Service, opts ServerOptions) *Server {
	s := &Server{svc: svc, opts: opts, log: opts.Logger, base: ctx, mux: http.NewServeMux()}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.opts.BeatSilence <= 0 {
		s.opts.BeatSilence = opts.Timeouts.IdleTimeout()
	}
	handle(s, OpPing, 0, func(ctx context.Context, peer string, _ struct{}) (PingReply, error) { return svc.Ping(ctx, peer) })
	handle(s, OpLocate, MaxHeader, svc.Locate)
	handle(s, OpTrim, MaxMessage, func(ctx context.Context, peer string, req TrimRequest) (TrimReply, error) {
		if err := req.Validate(); err != nil {
			return TrimReply{}, err
		}
		return svc.Trim(ctx, peer, req)
	})
	handle(s, OpLogged, MaxMessage, func(ctx context.Context, peer string, req LoggedRequest) (LoggedReply, error) {
		if err := req.Validate(); err != nil {
			return LoggedReply{}, err
		}
		return svc.Logged(ctx, peer, req)
	})
	handle(s, OpCheckpointNow, 0, func(ctx context.Context, peer string, _ struct{}) (struct{}, error) {
		return struct{}{}, svc.CheckpointNow(ctx, peer)
	})
	handle(s, OpReceived, MaxHeader, svc.Received)
	handle(s, OpLogWatermark, 0, func(ctx context.Context, peer string, _ struct{}) (LogWatermark, error) {
		return svc.LogWatermark(ctx, peer)
	})
	handle(s, OpDeterminants, MaxMessage, func(ctx context.Context, peer string, req DeterminantsRequest) (struct{}, error) {
		return struct{}{}, svc.Determinants(ctx, peer, req)
	})
	handle(s, OpDeterminantsSince, MaxHeader, svc.DeterminantsSince)
	handle(s, OpProbe, MaxHeader, svc.Probe)
	handle(s, OpView, MaxViewMessage, svc.View)
	handle(s, OpClaim, MaxClaim, svc.Claim)
	handle(s, OpReplica, MaxHeader, svc.Replica)
	handle(s, OpForget, MaxHeader, func(ctx context.Context, peer string, req ForgetRequest) (ForgetReply, error) {
		if err := req.Validate(); err != nil {
			return ForgetReply{}, &Error{Code: CodeBadRequest, Message: err.Error()}
		}
		return svc.Forget(ctx, peer, req)
	})
	handle(s, OpRecoveryStatus, MaxMessage, func(ctx context.Context, peer string, req RecoveryStatusRequest) (RecoveryStatusReply, error) {
		if err := req.Validate(); err != nil {
			return RecoveryStatusReply{}, err
		}
		return svc.RecoveryStatus(ctx, peer, req)
	})
	handle(s, OpGrant, MaxHeader, svc.Grant)
	handle(s, OpRejoin, MaxHeader, svc.Rejoin)
	handle(s, OpVouch, MaxHeader, svc.Vouch)
	handle(s, OpStartJob, MaxMessage, func(ctx context.Context, peer string, req StartJobRequest) (StartJobReply, error) {
		if err := req.Validate(); err != nil {
			return StartJobReply{}, &Error{Code: CodeBadRequest, Message: err.Error()}
		}
		return svc.StartJob(ctx, peer, req)
	})
	handle(s, OpSignal, MaxHeader, func(ctx context.Context, peer string, req SignalRequest) (struct{}, error) {
		if err := req.Validate(); err != nil {
			return struct{}{}, &Error{Code: CodeBadRequest, Message: err.Error()}
		}
		return struct{}{}, svc.Signal(ctx, peer, req)
	})
	handle(s, OpCoordinate, MaxMessage, func(ctx context.Context, peer string, req CoordinateRequest) (CoordinateReply, error) {
		if err := req.Validate(); err != nil {
			return CoordinateReply{}, &Error{Code: CodeBadRequest, Message: err.Error()}
		}
		return svc.Coordinate(ctx, peer, req)
	})
	s.route(OpLogRange, s.logRange)
	s.route(OpRecover, s.recover)
	s.route(OpHeartbeat, s.heartbeat)
	s.route(OpSnapshot, s.snapshot)
	s.route(OpFetch, s.fetch)
	s.route(OpDeterminantStream, s.determinantStream(OpDeterminantStream))
	s.route(OpDeterminantStream2, s.determinantStream(OpDeterminantStream2))
	s.route(OpDeterminantStream3, s.determinantStream(OpDeterminantStream3))
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.refuse(w, Op(strings.TrimPrefix(r.URL.Path, "/v1/")), "", &Error{Code: CodeUnknownOp, Message: "no such operation: " + r.URL.Path})
	})
	s.operatorRoutes(opts.Operators)
	return s
}

// HTTPServer is an http.Server of this handler with the protocol's header and idle deadlines. Serve it on
// a clustertls listener: the TLS handshake has the message timeout.
func (s *Server) HTTPServer() *http.Server {
	t := s.opts.Timeouts
	return &http.Server{
		Handler:           s,
		ReadHeaderTimeout: t.MessageTimeout(), // also bounds the TLS handshake
		IdleTimeout:       t.IdleTimeout(),
		MaxHeaderBytes:    MaxHeader,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		BaseContext:       func(net.Listener) context.Context { return s.base },
	}
}

// ServeHTTP authenticates the peer and dispatches to the operation: an operator's certificate to the
// operator operations only, a member's to the member operations only.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	op := Op(strings.TrimPrefix(r.URL.Path, "/v1/"))
	if _, err := clustertls.OperatorName(r.TLS); err == nil {
		s.serveOperator(w, r, op)
		return
	}
	if _, err := clustertls.PeerName(r.TLS); err != nil {
		s.refuse(w, op, "", &Error{Code: CodeUnauthenticated, Message: err.Error()})
		return
	}
	if r.Method != http.MethodPost {
		s.refuse(w, op, "", &Error{Code: CodeMethod, Message: "operations are POST requests, not " + r.Method})
		return
	}
	s.mux.ServeHTTP(w, r)
}

type opHandler func(w http.ResponseWriter, r *http.Request, peer string)

func (s *Server) route(op Op, h opHandler) {
	s.mux.HandleFunc(op.Path(), func(w http.ResponseWriter, r *http.Request) {
		peer, _ := clustertls.PeerName(r.TLS) // ServeHTTP checked it
		h(w, r, peer)
	})
}

// handle routes a request/reply operation: the body (at most limit bytes, none if 0) decoded into Req,
// fn's reply as the response.
func handle[Req, Rep any](s *Server, op Op, limit int, fn func(context.Context, string, Req) (Rep, error)) {
	s.route(op, func(w http.ResponseWriter, r *http.Request, peer string) {
		var req Req
		if err := s.readRequest(w, r, op, limit, &req); err != nil {
			s.refuse(w, op, peer, err)
			return
		}
		rep, err := fn(s.base, peer, req)
		if err != nil {
			s.refuse(w, op, peer, err)
			return
		}
		s.reply(w, r, op, peer, rep)
	})
}

// readRequest reads and strictly decodes the body of up to limit bytes (0: it must be empty) within the
// deadline for that size.
func (s *Server) readRequest(w http.ResponseWriter, r *http.Request, op Op, limit int, v any) error {
	rc := http.NewResponseController(w)
	if err := rc.SetReadDeadline(time.Now().Add(s.opts.Timeouts.LargeTimeout(limit))); err != nil {
		return fmt.Errorf("arm the read deadline: %w", err)
	}
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, int64(limit)))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return &Error{Code: CodeTooLarge, Message: fmt.Sprintf("%v: the %s request is longer than %d bytes", ErrTooLong, op, limit)}
	case err != nil:
		return &Error{Code: CodeBadRequest, Message: fmt.Sprintf("read the %s request: %v", op, err)}
	case limit == 0:
		return nil
	}
	if err := decodeStrict(b, v); err != nil {
		return &Error{Code: CodeBadRequest, Message: fmt.Sprintf("the %s request (%d bytes) is not the expected JSON: %v", op, len(b), err)}
	}
	return nil
}

// reply writes v within the deadline for its size (a replica's manifest may be many MiB). A peer that does
// not read it is only logged: the operation's own work is done.
func (s *Server) reply(w http.ResponseWriter, r *http.Request, op Op, peer string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		s.refuse(w, op, peer, fmt.Errorf("encode the reply: %w", err))
		return
	}
	rc := http.NewResponseController(w)
	rc.SetWriteDeadline(time.Now().Add(s.opts.Timeouts.LargeTimeout(len(b)))) // an error here shows at the write
	w.Header().Set("Content-Type", "application/json")
	if _, err := w.Write(append(b, '\n')); err != nil {
		s.log.Warn("cluster reply not delivered", "peer", peer, "op", op, "err", err)
	}
}

// refuse logs why a peer's request was refused and sends the refusal.
func (s *Server) refuse(w http.ResponseWriter, op Op, peer string, err error) {
	e := Refusal(err)
	if e == nil {
		e = &Error{Code: CodeRefused, Message: err.Error()}
	}
	e.Op = op
	s.log.Warn("cluster request refused", "peer", peer, "op", op, "code", e.Code, "err", e.Message)
	b, _ := json.Marshal(e.wire())
	// An error arming the deadline shows at the write.
	http.NewResponseController(w).SetWriteDeadline(time.Now().Add(s.opts.Timeouts.MessageTimeout()))
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(statusOf(e.Code))
	if _, err := w.Write(append(b, '\n')); err != nil {
		s.log.Debug("refusal not delivered", "peer", peer, "op", op, "err", err)
	}
}

// logRange answers the reply line, then streams the bytes while the caller keeps reading.
func (s *Server) logRange(w http.ResponseWriter, r *http.Request, peer string) {
	var req LogRangeRequest
	if err := s.readRequest(w, r, OpLogRange, MaxHeader, &req); err != nil {
		s.refuse(w, OpLogRange, peer, err)
		return
	}
	rep, write, err := s.svc.LogRange(s.base, peer, req)
	if err == nil {
		err = rep.Validate()
	}
	if err != nil {
		s.refuse(w, OpLogRange, peer, err)
		return
	}
	rc := http.NewResponseController(w)
	out := flushWriter{w: w, rc: rc, idle: s.opts.Timeouts.IdleTimeout()}
	w.Header().Set("Content-Type", "application/octet-stream")
	if err := WriteLine(out, rep); err != nil {
		s.log.Warn("cluster reply not delivered", "peer", peer, "op", OpLogRange, "err", err)
		return
	}
	if write == nil || rep.Len == 0 {
		return
	}
	// The range may be large: it takes as long as it needs while the caller keeps reading.
	if err := write(out); err != nil {
		s.log.Warn("log range cut short", "peer", peer, "err", err)
	}
}

// recover streams the recovery's progress lines; the response starts with the first one, so that a
// refusal before it is an ordinary refusal.
func (s *Server) recover(w http.ResponseWriter, r *http.Request, peer string) {
	var req RecoverRequest
	if err := s.readRequest(w, r, OpRecover, MaxRecoverRequest, &req); err != nil {
		s.refuse(w, OpRecover, peer, err)
		return
	}
	if err := req.Validate(); err != nil {
		s.refuse(w, OpRecover, peer, err)
		return
	}
	out := flushWriter{w: w, rc: http.NewResponseController(w), idle: s.opts.Timeouts.IdleTimeout()}
	var (
		mu      sync.Mutex // progress may come from more than one goroutine (stages, keepalives)
		started bool
		broken  error // a write failed: the caller is gone, the recovery goes on
	)
	progress := func(m RecoverProgress) error {
		mu.Lock()
		defer mu.Unlock()
		if broken != nil {
			return broken
		}
		if !started {
			w.Header().Set("Content-Type", "application/x-ndjson")
			started = true
		}
		if err := WriteLine(out, m); err != nil {
			broken = err
			s.log.Warn("recovery progress not delivered", "peer", peer, "err", err)
		}
		return broken
	}
	err := s.svc.Recover(s.base, peer, req, progress)
	mu.Lock()
	begun := started
	if err != nil && begun && broken == nil {
		if werr := WriteLine(out, RecoverProgress{Done: true, Error: err.Error()}); werr != nil {
			s.log.Warn("recovery progress not delivered", "peer", peer, "err", werr)
		}
	}
	// The response ends with this handler: progress from a goroutine the service left behind must not
	// touch it.
	if broken == nil {
		broken = errStreamEnded
	}
	mu.Unlock()
	if err != nil && !begun {
		s.refuse(w, OpRecover, peer, err)
	}
}

// errStreamEnded is what progress returns once the recovery's response has ended.
var errStreamEnded = errors.New("the progress stream has ended")

// heartbeat records the beats of one member's stream until it ends or falls silent.
func (s *Server) heartbeat(w http.ResponseWriter, r *http.Request, peer string) {
	in := bufio.NewReader(idleBodyReader{r: r.Body, rc: http.NewResponseController(w), idle: s.opts.BeatSilence})
	for {
		var b detect.Beat
		if err := ReadLine(in, &b, MaxMessage); err != nil {
			if !errors.Is(err, io.EOF) {
				s.log.Warn("cluster request refused", "peer", peer, "op", OpHeartbeat, "err", err)
			}
			return
		}
		b.From = peer // the authenticated name, never what the message says
		s.svc.Beat(peer, b)
	}
}

// snapshot and fetch run ckpt/ship's framing, which talks both ways (data one way, acknowledgements and
// refusals the other, with its own idle deadlines on the connection): they switch protocols (HTTP 101)
// and hand the connection itself to the service. A streaming body and response would need full duplex on
// both ends and would hide the connection's deadlines from ship.
func (s *Server) snapshot(w http.ResponseWriter, r *http.Request, peer string) {
	var none struct{}
	if err := s.readRequest(w, r, OpSnapshot, 0, &none); err != nil {
		s.refuse(w, OpSnapshot, peer, err)
		return
	}
	s.upgrade(w, r, OpSnapshot, peer, func(c net.Conn) error { return s.svc.ReceiveSnapshot(s.base, peer, c) })
}

func (s *Server) fetch(w http.ResponseWriter, r *http.Request, peer string) {
	var req FetchRequest
	if err := s.readRequest(w, r, OpFetch, MaxHeader, &req); err != nil {
		s.refuse(w, OpFetch, peer, err)
		return
	}
	s.upgrade(w, r, OpFetch, peer, func(c net.Conn) error { return s.svc.Fetch(s.base, peer, req, c) })
}

func (s *Server) upgrade(w http.ResponseWriter, r *http.Request, op Op, peer string, run func(net.Conn) error) {
	if !strings.EqualFold(r.Header.Get("Upgrade"), upgradeProto) {
		s.refuse(w, op, peer, &Error{Code: CodeBadRequest, Message: "the " + string(op) + " operation switches to " + upgradeProto})
		return
	}
	c, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		s.refuse(w, op, peer, fmt.Errorf("take over the connection: %w", err))
		return
	}
	defer c.Close()
	err = c.SetDeadline(time.Now().Add(s.opts.Timeouts.MessageTimeout()))
	if err == nil {
		_, err = io.WriteString(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: "+upgradeProto+"\r\n\r\n")
	}
	if err == nil {
		err = brw.Flush()
	}
	if err == nil {
		err = c.SetDeadline(time.Time{}) // ship sets its own
	}
	if err != nil {
		s.log.Warn("cluster reply not delivered", "peer", peer, "op", op, "err", err)
		return
	}
	if err := run(bufferedConn{Conn: c, r: brw.Reader}); err != nil {
		s.log.Warn("cluster stream failed", "peer", peer, "op", op, "err", err)
	}
}

// bufferedConn reads what a bufio.Reader already holds before the connection.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }
