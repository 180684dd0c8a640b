package clusterapi

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/spare"
)

// ClientConfig configures a Client.
type ClientConfig struct {
	// TLS returns the credentials to dial with; it is called for every connection, so that a rotated
	// certificate or a changed membership takes effect.
	TLS func() clustertls.Config
	// Resolve returns the cluster address (host:port) of member name.
	Resolve  func(name string) (addr string, ok bool)
	Timeouts Timeouts
	Logger   *slog.Logger
}

// Client calls other members. It keeps connections to them open between calls.
type Client struct {
	cfg ClientConfig
	hc  *http.Client
	tr  *http.Transport
}

// NewClient returns a client; Close it to drop its idle connections.
func NewClient(cfg ClientConfig) *Client {
	c := &Client{cfg: cfg}
	c.tr = &http.Transport{
		// The URL's host is the member name: the connection is to its cluster address, authenticated as it.
		DialTLSContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			name, _, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			return c.dial(ctx, name)
		},
		ForceAttemptHTTP2:   false,
		TLSNextProto:        map[string]func(string, *tls.Conn) http.RoundTripper{}, // HTTP/1.1 only
		DisableCompression:  true,
		MaxIdleConnsPerHost: 4,
		// Sooner than the server closes them (its idle timeout): a request is never sent on a connection
		// the server is closing.
		IdleConnTimeout:        cfg.Timeouts.IdleTimeout() / 2,
		MaxResponseHeaderBytes: MaxHeader,
	}
	c.hc = &http.Client{Transport: c.tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	return c
}

// Close drops the idle connections.
func (c *Client) Close() { c.tr.CloseIdleConnections() }

func (c *Client) dial(ctx context.Context, name string) (net.Conn, error) {
	addr, ok := c.cfg.Resolve(name)
	if !ok {
		return nil, fmt.Errorf("%s is not a cluster member", name)
	}
	return clustertls.Dial(ctx, addr, name, c.cfg.TLS())
}

// dialAcked is dial over an ackedConn, which it returns too: it stamps the writes after the TLS handshake
// and the first of them.
func (c *Client) dialAcked(ctx context.Context, name string) (net.Conn, *ackedConn, error) {
	addr, ok := c.cfg.Resolve(name)
	if !ok {
		return nil, nil, fmt.Errorf("%s is not a cluster member", name)
	}
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err == nil {
		ac := &ackedConn{TCPConn: raw.(*net.TCPConn)}
		var conn net.Conn
		if conn, err = clustertls.Client(ctx, ac, name, c.cfg.TLS()); err == nil {
			ac.skipFrom(1) // the request's headers, alone or with the first beat
			return conn, ac, nil
		}
		raw.Close()
	}
	return nil, nil, fmt.Errorf("dial %s (%s): %w", name, addr, err)
}

// HostAnswers returns nil if peer's host completes a TCP handshake on peer's cluster address or refuses
// the connection: either is its kernel's answer, given while its agent may be too busy to answer a ping.
// The connection is closed at once (the agent logs a TLS handshake that ended early).
func (c *Client) HostAnswers(ctx context.Context, peer string) error {
	addr, ok := c.cfg.Resolve(peer)
	if !ok {
		return fmt.Errorf("%s is not a cluster member", peer)
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	switch {
	case err == nil:
		conn.Close()
		return nil
	case errors.Is(err, syscall.ECONNREFUSED):
		return nil
	}
	return fmt.Errorf("TCP handshake with %s (%s): %w", peer, addr, err)
}

// within bounds ctx by d from now.
func within(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}

// endOnDone ends conn's reads and writes when ctx ends, by setting a deadline in the past (the error shows
// there); stop undoes it.
func endOnDone(ctx context.Context, conn net.Conn) (stop func() bool) {
	return context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
}

// withCause adds why ctx ended to err, the error of a read or write that endOnDone cut short (else just
// "i/o timeout").
func withCause(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%v)", context.Cause(ctx), err)
	}
	return err
}

// post sends op's request body to peer and returns the response once its status is 200 (a refusal is an
// *Error). The caller closes the body.
func (c *Client) post(ctx context.Context, peer string, op Op, body io.Reader) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+peer+op.Path(), body)
	if err != nil {
		return nil, fmt.Errorf("%s request to %s: %w", op, peer, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s request to %s: %w", op, peer, err)
	}
	if resp.StatusCode != http.StatusOK {
		defer resp.Body.Close()
		return nil, readRefusal(resp, op, peer)
	}
	return resp, nil
}

// readRefusal decodes a refusal body (bounded).
func readRefusal(resp *http.Response, op Op, peer string) error {
	e := &Error{}
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxHeader))
	if err != nil || json.Unmarshal(b, e) != nil || e.Code == "" {
		e = &Error{Code: CodeRefused, Message: fmt.Sprintf("HTTP status %s", resp.Status)}
	}
	e.Op, e.Peer, e.Status = op, peer, resp.StatusCode
	if len(e.Message) > MaxHeader/2 {
		e.Message = e.Message[:MaxHeader/2] + "..."
	}
	return e
}

// postJSON posts req (nil: no body) encoded as JSON to peer's op.
func (c *Client) postJSON(ctx context.Context, peer string, op Op, req any) (*http.Response, error) {
	var body io.Reader = http.NoBody
	if req != nil {
		b, err := json.Marshal(req)
		if err != nil {
			return nil, fmt.Errorf("encode the %s request: %w", op, err)
		}
		body = bytes.NewReader(b)
	}
	return c.post(ctx, peer, op, body)
}

// call runs one request/reply exchange within the operation's bound d (or ctx's deadline if sooner).
func call[Rep any](c *Client, ctx context.Context, peer string, op Op, d time.Duration, req any) (Rep, error) {
	return callBounded[Rep](c, ctx, peer, op, d, MaxMessage, req)
}

// callBounded is call for a reply of up to limit bytes.
func callBounded[Rep any](c *Client, ctx context.Context, peer string, op Op, d time.Duration, limit int, req any) (Rep, error) {
	var rep Rep
	ctx, cancel := within(ctx, d)
	defer cancel()
	resp, err := c.postJSON(ctx, peer, op, req)
	if err != nil {
		return rep, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, int64(limit)+2))
	switch {
	case err != nil:
		return rep, fmt.Errorf("%s reply from %s: %w", op, peer, err)
	case len(b) > limit+1:
		return rep, fmt.Errorf("%s reply from %s: %w: longer than %d bytes", op, peer, ErrTooLong, limit)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		return rep, fmt.Errorf("%s reply from %s is not the expected JSON: %w", op, peer, err)
	}
	return rep, nil
}

func (c *Client) msg() time.Duration { return c.cfg.Timeouts.MessageTimeout() }

// Ping asks member peer whether it is alive and which jobs it runs.
func (c *Client) Ping(ctx context.Context, peer string) (PingReply, error) {
	return call[PingReply](c, ctx, peer, OpPing, c.msg(), nil)
}

// Locate asks which job snapshot id belongs to.
func (c *Client) Locate(ctx context.Context, peer string, req LocateRequest) (LocateReply, error) {
	return call[LocateReply](c, ctx, peer, OpLocate, c.msg(), req)
}

// Trim tells peer where the caller's snapshot starts receiving on connections from peer.
func (c *Client) Trim(ctx context.Context, peer string, req TrimRequest) (TrimReply, error) {
	if err := req.Validate(); err != nil {
		return TrimReply{}, err
	}
	return call[TrimReply](c, ctx, peer, OpTrim, c.cfg.Timeouts.LargeTimeout(MaxMessage), req)
}

// Logged asks peer which of req's flows it does not log.
func (c *Client) Logged(ctx context.Context, peer string, req LoggedRequest) (LoggedReply, error) {
	if err := req.Validate(); err != nil {
		return LoggedReply{}, err
	}
	rep, err := call[LoggedReply](c, ctx, peer, OpLogged, c.cfg.Timeouts.LargeTimeout(MaxMessage), req)
	if err == nil {
		err = rep.Check(req)
	}
	return rep, err
}

// CheckpointNow asks peer to snapshot its jobs now.
func (c *Client) CheckpointNow(ctx context.Context, peer string) error {
	_, err := call[struct{}](c, ctx, peer, OpCheckpointNow, c.msg(), nil)
	return err
}

// Determinants ships a batch of a job's receive-order determinants to peer, its protector.
func (c *Client) Determinants(ctx context.Context, peer string, req DeterminantsRequest) error {
	_, err := call[struct{}](c, ctx, peer, OpDeterminants, c.cfg.Timeouts.LargeTimeout(MaxMessage), req)
	return err
}

// maxDeterminantsSince bounds what DeterminantsSince collects: what a Store keeps of a job, and a page.
const maxDeterminantsSince = intercept.DefaultMaxPerJob + intercept.MaxBatch

// DeterminantsSince asks peer, the holder of a snapshot, for what its job consumed after the dump, when it
// last ran from the snapshot on host ran ("": the snapshot's): every page, decoded and checked.
func (c *Client) DeterminantsSince(ctx context.Context, peer string, job, snapshot, ran string) ([]intercept.Det, error) {
	var all []intercept.Det
	for {
		rep, err := call[DeterminantsSinceReply](c, ctx, peer, OpDeterminantsSince, c.cfg.Timeouts.LargeTimeout(MaxMessage),
			DeterminantsSinceRequest{Job: job, Snapshot: snapshot, From: uint64(len(all)), Ran: ran})
		if err != nil {
			return nil, err
		}
		dets, err := intercept.Unpack(rep.Packed)
		if err != nil {
			return nil, fmt.Errorf("determinants of job %s from %s: %w", job, peer, err)
		}
		all = append(all, dets...)
		if len(all) > maxDeterminantsSince {
			return nil, fmt.Errorf("determinants of job %s from %s: more than %d", job, peer, maxDeterminantsSince)
		}
		if !rep.More || len(dets) == 0 {
			return all, nil
		}
	}
}

// Received asks peer for its record of what one of its sockets received, and checks it is well formed
// and of that connection.
func (c *Client) Received(ctx context.Context, peer string, req ReceivedRequest) (ReceivedReply, error) {
	rep, err := call[ReceivedReply](c, ctx, peer, OpReceived, c.msg(), req)
	if err == nil {
		if err = rep.Check(req); err != nil {
			err = fmt.Errorf("record from %s: %w", peer, err)
		}
	}
	return rep, err
}

// LogWatermark asks peer for its log watermark (validate it with Placed).
func (c *Client) LogWatermark(ctx context.Context, peer string) (LogWatermark, error) {
	return call[LogWatermark](c, ctx, peer, OpLogWatermark, c.msg(), nil)
}

// Probe asks peer whether it reaches member req.Name.
func (c *Client) Probe(ctx context.Context, peer string, req ProbeRequest) (ProbeReply, error) {
	rep, err := call[ProbeReply](c, ctx, peer, OpProbe, c.msg(), req)
	if err == nil && rep.Name != req.Name {
		// "Reachable" about another member would keep the suspect asked about from being failed over.
		err = fmt.Errorf("%s answered about %q, not %q", peer, rep.Name, req.Name)
	}
	return rep, err
}

// View sends the caller's view and failure timelines and returns peer's.
func (c *Client) View(ctx context.Context, peer string, req ViewMessage) (ViewMessage, error) {
	return callBounded[ViewMessage](c, ctx, peer, OpView, c.cfg.Timeouts.LargeTimeout(MaxViewMessage), MaxViewMessage, req)
}

// Claim claims spare peer for a failed node.
func (c *Client) Claim(ctx context.Context, peer string, req spare.Claim) error {
	_, err := call[ClaimReply](c, ctx, peer, OpClaim, c.msg(), req)
	return err
}

// Replica asks peer for its newest verified replica of a job from a node, and checks the answer is one.
// The holder verifies its replicas (reads and hashes them) before it answers: more than one message
// timeout, and the answer carries the whole manifest (up to MaxReplicaReply).
func (c *Client) Replica(ctx context.Context, peer string, req ReplicaRequest) (ReplicaReply, error) {
	rep, err := callBounded[ReplicaReply](c, ctx, peer, OpReplica, 2*c.msg()+c.cfg.Timeouts.LargeTimeout(MaxReplicaReply), MaxReplicaReply, req)
	if err == nil {
		err = rep.Check(req)
	}
	return rep, err
}

// Forget tells peer that the caller's job req.Job ended: the replicas of it the caller took may go.
func (c *Client) Forget(ctx context.Context, peer string, req ForgetRequest) (ForgetReply, error) {
	return call[ForgetReply](c, ctx, peer, OpForget, c.msg(), req)
}

// RecoveryStatus asks the target of a recovery how it went.
func (c *Client) RecoveryStatus(ctx context.Context, peer string, req RecoveryStatusRequest) (RecoveryStatusReply, error) {
	if err := req.Validate(); err != nil {
		return RecoveryStatusReply{}, err
	}
	rep, err := call[RecoveryStatusReply](c, ctx, peer, OpRecoveryStatus, c.msg(), req)
	if err == nil && rep.Failure != req.Failure {
		err = fmt.Errorf("%s answered about failure %q", peer, rep.Failure)
	}
	return rep, err
}

// Grant asks peer to grant (or take back) an incarnation.
func (c *Client) Grant(ctx context.Context, peer string, req GrantRequest) (GrantReply, error) {
	rep, err := call[GrantReply](c, ctx, peer, OpGrant, c.msg(), req)
	if err == nil && rep.Conflict != nil {
		if verr := rep.Conflict.Validate(); verr != nil {
			err = fmt.Errorf("invalid refusal from %s: %w", peer, verr)
		}
	}
	return rep, err
}

// Vouch asks peer, this member's protector, whether it still holds this member alive (OpVouch), within
// ctx's deadline.
func (c *Client) Vouch(ctx context.Context, peer string, req VouchRequest) (VouchReply, error) {
	return call[VouchReply](c, ctx, peer, OpVouch, c.msg(), req)
}

// Rejoin asks peer to admit this member, failed as incarnation req.Incarnation, back as a spare; the
// answer is peer's view after it (the caller decodes and checks it like any view). The peer asks the
// caller whether it is idle before it answers: two message timeouts.
func (c *Client) Rejoin(ctx context.Context, peer string, req RejoinRequest) (ViewMessage, error) {
	return callBounded[ViewMessage](c, ctx, peer, OpRejoin, c.msg()+c.cfg.Timeouts.LargeTimeout(MaxViewMessage), MaxViewMessage, req)
}

// StartJob asks peer to start a job for a local caller of this agent, and checks the answer is a job's
// record. Starting a job takes a fork and a cgroup: a few message timeouts under load.
func (c *Client) StartJob(ctx context.Context, peer string, req StartJobRequest) (StartJobReply, error) {
	if err := req.Validate(); err != nil {
		return StartJobReply{}, err
	}
	rep, err := call[StartJobReply](c, ctx, peer, OpStartJob, c.cfg.Timeouts.LargeTimeout(MaxMessage)+2*c.msg(), req)
	if err == nil {
		if err = rep.Check(); err != nil {
			err = fmt.Errorf("reply from %s: %w", peer, err)
		}
	}
	return rep, err
}

// LogRange fetches from peer the bytes it logged on a connection from a sequence number on, with peer's
// live state of the connection. The reply has the message timeout; the bytes may take as long as they
// keep moving (the idle timeout), within ctx.
func (c *Client) LogRange(ctx context.Context, peer string, req LogRangeRequest) (LogRangeReply, []byte, error) {
	var rep LogRangeReply
	b, err := json.Marshal(req)
	if err != nil {
		return rep, nil, fmt.Errorf("encode the log-range request: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	watch := newIdleWatch(c.msg(), cancel) // the reply line: the message timeout
	defer watch.stop()
	resp, err := c.post(ctx, peer, OpLogRange, bytes.NewReader(b))
	if err != nil {
		return rep, nil, watch.err(err)
	}
	defer resp.Body.Close()
	in := bufio.NewReader(idleReader{r: resp.Body, w: watch})
	if err := ReadLine(in, &rep, MaxMessage); err != nil {
		return rep, nil, fmt.Errorf("log-range reply from %s: %w", peer, err)
	}
	if err := rep.Validate(); err != nil {
		return rep, nil, err
	}
	watch.setIdle(c.cfg.Timeouts.IdleTimeout()) // the bytes: as long as they keep moving
	data, err := ReadLogBytes(in, rep.Len, MaxLogRange)
	if err != nil {
		return rep, nil, fmt.Errorf("logged bytes of %s from %s: %w", req.Tuple, peer, err)
	}
	return rep, data, nil
}

// Recover has peer run a recovery and calls each with every progress line until the last (Done), which
// it returns. A refusal is an *Error; a stream that breaks after peer accepted the request is a
// *StreamError (the recovery may go on there). It follows the stream for at most limit, within ctx.
func (c *Client) Recover(ctx context.Context, peer string, req RecoverRequest, limit time.Duration, each func(RecoverProgress)) (RecoverProgress, error) {
	if err := req.Validate(); err != nil {
		return RecoverProgress{}, err
	}
	b, err := json.Marshal(req)
	if err != nil {
		return RecoverProgress{}, fmt.Errorf("encode the recover request: %w", err)
	}
	if len(b) > MaxRecoverRequest {
		return RecoverProgress{}, fmt.Errorf("%w: a recover request of %d bytes, at most %d", ErrTooLong, len(b), MaxRecoverRequest)
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	// The request and the first line have the deadline for the request's size; then each line the idle
	// timeout (the target sends keepalives between stages).
	watch := newIdleWatch(c.cfg.Timeouts.LargeTimeout(MaxRecoverRequest), cancel)
	defer watch.stop()
	resp, err := c.post(ctx, peer, OpRecover, bytes.NewReader(b))
	if err != nil {
		return RecoverProgress{}, watch.err(err)
	}
	defer resp.Body.Close()
	watch.setIdle(c.cfg.Timeouts.IdleTimeout())
	in := bufio.NewReader(idleReader{r: resp.Body, w: watch})
	for {
		var m RecoverProgress
		if err := ReadLine(in, &m, MaxMessage); err != nil {
			return RecoverProgress{}, &StreamError{Op: OpRecover, Peer: peer, Err: err}
		}
		if m.Done {
			return m, nil
		}
		each(m)
	}
}

// BeatStream is an open heartbeat stream to a member.
type BeatStream struct {
	peer   string
	pw     *io.PipeWriter
	watch  *idleWatch
	cancel context.CancelFunc
	done   chan error
	mu     sync.Mutex
	conn   atomic.Pointer[ackedConn] // the stream's connection, once dialed
}

// Heartbeats opens a heartbeat stream to peer; every Send must be written within timeout.
func (c *Client) Heartbeats(ctx context.Context, peer string, timeout time.Duration) (*BeatStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	pr, pw := io.Pipe()
	// Only a beat being written has the timeout: the stream is silent between beats on purpose (the
	// server bounds that silence).
	s := &BeatStream{peer: peer, pw: pw, cancel: cancel, done: make(chan error, 1), watch: newIdleWatch(timeout, cancel)}
	s.watch.pause()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+peer+OpHeartbeat.Path(), pr)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("heartbeat stream to %s: %w", peer, err)
	}
	req.Header.Set("Content-Type", "application/x-ndjson")
	// A connection of its own, whose acknowledgements Acked reads.
	tr := c.tr.Clone()
	tr.DisableKeepAlives = true
	tr.DialTLSContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		conn, ac, err := c.dialAcked(ctx, peer)
		if err == nil {
			s.conn.Store(ac)
		}
		return conn, err
	}
	go func() {
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, CheckRedirect: c.hc.CheckRedirect}).Do(req)
		if err == nil {
			if resp.StatusCode != http.StatusOK {
				err = readRefusal(resp, OpHeartbeat, peer)
			} else {
				err = fmt.Errorf("heartbeat stream to %s: the peer ended it", peer)
			}
			resp.Body.Close()
		}
		pr.CloseWithError(err)
		s.done <- err
	}()
	return s, nil
}

// Send writes one beat (its write must not take longer than the stream's timeout).
func (s *BeatStream) Send(b detect.Beat) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.watch.kick()
	err := WriteLine(s.pw, b)
	s.watch.pause()
	if err != nil {
		return fmt.Errorf("heartbeat to %s: %w", s.peer, s.watch.err(err))
	}
	return nil
}

// Acked returns when the newest write of the stream that the peer's host acknowledged began (always a
// beat: the handshake and the request's headers are not stamped): the peer was reachable then or later.
// False before the first acknowledged beat, or if the kernel cannot say.
func (s *BeatStream) Acked() (time.Time, bool) {
	c := s.conn.Load()
	if c == nil {
		return time.Time{}, false
	}
	at, ok, err := c.Acked()
	return at, ok && err == nil
}

// Close ends the stream.
func (s *BeatStream) Close() error {
	s.watch.stop()
	s.pw.Close()
	s.cancel()
	<-s.done
	return nil
}

// Ship opens a snapshot transfer to peer (OpSnapshot) and returns the connection, for ckpt/ship.Send:
// connecting and switching protocols have the message timeout, within ctx; the transfer sets its own
// deadlines. Close the connection when done.
func (c *Client) Ship(ctx context.Context, peer string) (net.Conn, error) {
	return c.upgrade(ctx, peer, OpSnapshot, nil)
}

// Fetch asks peer for a snapshot it holds and returns the connection, for ckpt/ship.Receive.
func (c *Client) Fetch(ctx context.Context, peer string, req FetchRequest) (net.Conn, error) {
	return c.upgrade(ctx, peer, OpFetch, req)
}

// upgrade dials peer, posts op's request asking to switch to the ship protocol, and returns the
// connection once peer agreed (HTTP 101). Canceling ctx before then ends it; afterwards the connection is
// the caller's (ship maps ctx onto its deadlines).
func (c *Client) upgrade(ctx context.Context, peer string, op Op, body any) (net.Conn, error) {
	ctx, cancel := within(ctx, c.msg())
	defer cancel()
	var b []byte
	if body != nil {
		var err error
		if b, err = json.Marshal(body); err != nil {
			return nil, fmt.Errorf("encode the %s request: %w", op, err)
		}
	}
	conn, err := c.dial(ctx, peer)
	if err != nil {
		return nil, fmt.Errorf("%s request to %s: %w", op, peer, err)
	}
	stop := endOnDone(ctx, conn)
	ok := false
	defer func() {
		if !ok {
			stop()
			conn.Close()
		}
	}()
	if dl, has := ctx.Deadline(); has {
		if err := conn.SetDeadline(dl); err != nil {
			return nil, fmt.Errorf("%s request to %s: %w", op, peer, err)
		}
	}
	req, err := http.NewRequest(http.MethodPost, "https://"+peer+op.Path(), bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", upgradeProto)
	failed := func(err error) error { return fmt.Errorf("%s request to %s: %w", op, peer, withCause(ctx, err)) }
	if err := req.Write(conn); err != nil {
		return nil, failed(err)
	}
	// The response's head is bounded as the transport bounds every other (MaxResponseHeaderBytes); the
	// stream after it is ship's.
	head := &io.LimitedReader{R: conn, N: MaxHeader}
	br := bufio.NewReader(head)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		if head.N <= 0 {
			err = fmt.Errorf("%w: a response head longer than %d bytes", ErrTooLong, MaxHeader)
		}
		return nil, failed(err)
	}
	head.N = math.MaxInt64
	if resp.StatusCode != http.StatusSwitchingProtocols {
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return nil, fmt.Errorf("%s request to %s: answered without switching protocols", op, peer)
		}
		return nil, readRefusal(resp, op, peer)
	}
	if !strings.EqualFold(resp.Header.Get("Upgrade"), upgradeProto) {
		return nil, fmt.Errorf("%s request to %s: switched to %q, not %s", op, peer, resp.Header.Get("Upgrade"), upgradeProto)
	}
	if !stop() { // ctx ended meanwhile: the connection carries a past deadline
		return nil, fmt.Errorf("%s request to %s: %w", op, peer, context.Cause(ctx))
	}
	if err := conn.SetDeadline(time.Time{}); err != nil { // the transfer sets its own
		return nil, fmt.Errorf("%s request to %s: %w", op, peer, err)
	}
	ok = true
	return bufferedConn{Conn: conn, r: br}, nil
}
