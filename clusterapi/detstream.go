package clusterapi

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

// A determinant stream carries a member's receive-order determinants to one protector: one batch after
// another on one connection (switched from HTTP like a snapshot transfer), each answered before the next
// is sent. OpDeterminants makes an HTTPS request of each batch instead, and a member ships a round every
// log.receive_order_ship_every (20 ms) for each job that received anything: on 2 vCPUs that cost about
// 1 ms of CPU a batch over both agents, most of it the request's handoffs between the HTTP client's and
// server's goroutines; on the stream a batch is one write and one read on each side.

// DeterminantsAck answers one batch of a determinant stream: Error is nil when the protector stored it.
type DeterminantsAck struct {
	Error *Error `json:"error,omitempty"`
}

// DeterminantStream is an open determinant stream to a member, for one goroutine at a time.
type DeterminantStream struct {
	peer    string
	conn    net.Conn
	r       *bufio.Reader
	timeout time.Duration // of one batch and its answer
	idle    time.Duration // the server closes a stream silent for longer
	used    time.Time     // when the stream was opened or last answered
}

// DeterminantStream opens a determinant stream to peer.
func (c *Client) DeterminantStream(ctx context.Context, peer string) (*DeterminantStream, error) {
	conn, err := c.upgrade(ctx, peer, OpDeterminantStream, nil)
	if err != nil {
		return nil, err
	}
	bc := conn.(bufferedConn)
	return &DeterminantStream{peer: peer, conn: bc.Conn, r: bc.r, timeout: c.cfg.Timeouts.LargeTimeout(MaxMessage),
		idle: c.cfg.Timeouts.IdleTimeout(), used: time.Now()}, nil
}

// Stale reports whether the stream has been silent for so long that the server may be closing it: open a
// new one rather than send on it.
func (s *DeterminantStream) Stale() bool { return time.Since(s.used) > s.idle/2 }

// Send ships one batch and waits for the protector's answer, within ctx and the protocol's bound for a
// message. A refusal of the batch is an *Error and leaves the stream usable; any other error breaks it
// (a *StreamError): close it.
func (s *DeterminantStream) Send(ctx context.Context, req DeterminantsRequest) error {
	ctx, cancel := within(ctx, s.timeout)
	defer cancel()
	broke := func(err error) error {
		return &StreamError{Op: OpDeterminantStream, Peer: s.peer, Err: withCause(ctx, err)}
	}
	dl, _ := ctx.Deadline()
	if err := s.conn.SetDeadline(dl); err != nil {
		return broke(err)
	}
	defer endOnDone(ctx, s.conn)()
	if err := WriteLine(s.conn, req); err != nil {
		return broke(err)
	}
	var ack DeterminantsAck
	if err := ReadLine(s.r, &ack, MaxHeader); err != nil {
		return broke(err)
	}
	s.used = time.Now()
	if ack.Error != nil {
		ack.Error.Op, ack.Error.Peer, ack.Error.Status = OpDeterminantStream, s.peer, statusOf(ack.Error.Code)
		return ack.Error
	}
	return nil
}

// Close ends the stream.
func (s *DeterminantStream) Close() error { return s.conn.Close() }

// determinantStream switches to a determinant stream and serves it.
func (s *Server) determinantStream(w http.ResponseWriter, r *http.Request, peer string) {
	var none struct{}
	if err := s.readRequest(w, r, OpDeterminantStream, 0, &none); err != nil {
		s.refuse(w, OpDeterminantStream, peer, err)
		return
	}
	s.upgrade(w, r, OpDeterminantStream, peer, func(c net.Conn) error { return s.serveDeterminants(peer, c) })
}

// serveDeterminants hands each batch of peer's stream on c to the service and answers it, until peer
// closes the stream, it is silent for the idle timeout, or the server stops. A batch the service refuses
// is answered with the refusal; a line that is no batch ends the stream.
func (s *Server) serveDeterminants(peer string, c net.Conn) error {
	defer endOnDone(s.base, c)()
	in := bufio.NewReader(c)
	for {
		if err := c.SetReadDeadline(time.Now().Add(s.opts.Timeouts.IdleTimeout())); err != nil {
			return err
		}
		var req DeterminantsRequest
		if err := ReadLine(in, &req, MaxMessage); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, os.ErrDeadlineExceeded) || s.base.Err() != nil {
				return nil // the member closed it, or stopped sending, between two batches; or this server stops
			}
			return err
		}
		var ack DeterminantsAck
		if err := s.svc.Determinants(s.base, peer, req); err != nil {
			ack.Error = Refusal(err)
			if ack.Error == nil {
				ack.Error = &Error{Code: CodeRefused, Message: err.Error()}
			}
			ack.Error.Op = OpDeterminantStream
			s.log.Warn("cluster request refused", "peer", peer, "op", OpDeterminantStream, "code", ack.Error.Code, "err", ack.Error.Message)
		}
		if err := c.SetWriteDeadline(time.Now().Add(s.opts.Timeouts.MessageTimeout())); err != nil {
			return err
		}
		if err := WriteLine(c, ack); err != nil {
			return err
		}
	}
}
