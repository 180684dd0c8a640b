package clusterapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"time"
)

// A determinant stream carries a member's receive-order determinants to one protector: one batch after
// another on one connection (switched from HTTP like a snapshot transfer). OpDeterminants makes an HTTPS
// request of each batch instead, and a member ships a round every log.receive_order_ship_every (20 ms) for
// each job that received anything: on 2 vCPUs that cost about 1 ms of CPU a batch over both agents, most
// of it the request's handoffs between the HTTP client's and server's goroutines.
//
// On OpDeterminantStream every batch is answered before the next is sent. On OpDeterminantStream2 the
// member asks for an answer only now and then (DeterminantsRequest.Ack), and writes the other batches
// without waiting: an answer cost the protector as much as the batch (a write across the network to a
// waiting reader), and the member needs one only to learn what it may forget and when a held process may
// go on. A batch reaches the protector as soon either way. The protector answers a refused batch at once
// and ends the stream, so that it stores nothing sent after it: the member sends again, on a new stream,
// all it has not seen answered.
//
// OpDeterminantStream3 is OpDeterminantStream2 with each batch's packed determinants as raw bytes after
// its line (DeterminantsRequest.PackedLen) instead of base64 inside it: scanning and decoding that JSON
// string was a third of the protector's CPU on a job receiving a million 64-byte messages (ftbench
// receive-order's message stream). A member opens the newest stream its protector serves.

// DeterminantsAck answers one batch of a determinant stream: Error is nil when the protector stored it
// (and on OpDeterminantStream2 and 3, every batch before it on the stream).
type DeterminantsAck struct {
	Error *Error `json:"error,omitempty"`
}

// DeterminantStream is an open determinant stream (OpDeterminantStream3, or 2) to a member, for one
// goroutine at a time.
type DeterminantStream struct {
	op      Op // OpDeterminantStream3, or 2 to an agent of an earlier version
	peer    string
	conn    net.Conn
	r       *bufio.Reader
	timeout time.Duration // of one batch and its answer
	idle    time.Duration // the server closes a stream silent for longer
	used    time.Time     // when the stream was opened or last sent on
}

// DeterminantStream opens a determinant stream to peer, of the newest kind it serves. An agent of an
// earlier version refuses both as an unknown operation (CodeUnknownOp): send it requests.
func (c *Client) DeterminantStream(ctx context.Context, peer string) (*DeterminantStream, error) {
	op := OpDeterminantStream3
	conn, err := c.upgrade(ctx, peer, op, nil)
	if e := Refusal(err); e != nil && e.Code == CodeUnknownOp {
		op = OpDeterminantStream2
		conn, err = c.upgrade(ctx, peer, op, nil)
	}
	if err != nil {
		return nil, err
	}
	bc := conn.(bufferedConn)
	return &DeterminantStream{op: op, peer: peer, conn: bc.Conn, r: bc.r, timeout: c.cfg.Timeouts.LargeTimeout(MaxMessage),
		idle: c.cfg.Timeouts.IdleTimeout(), used: time.Now()}, nil
}

// Stale reports whether the stream has been silent for so long that the server may be closing it: open a
// new one rather than send on it.
func (s *DeterminantStream) Stale() bool { return time.Since(s.used) > s.idle/2 }

// Send ships one batch within ctx and the protocol's bound for a message. With req.Ack it then waits for
// the protector's answer, which covers every batch sent before on the stream: nil when all are stored, a
// refusal (an *Error, after which the protector stored none that followed and ended the stream) or a
// broken stream (a *StreamError). Without it, nil says only that the batch was written. After any error,
// close the stream.
func (s *DeterminantStream) Send(ctx context.Context, req DeterminantsRequest) error {
	ctx, cancel := within(ctx, s.timeout)
	defer cancel()
	broke := func(err error) error {
		return &StreamError{Op: s.op, Peer: s.peer, Err: withCause(ctx, err)}
	}
	dl, _ := ctx.Deadline()
	if err := s.conn.SetDeadline(dl); err != nil {
		return broke(err)
	}
	defer endOnDone(ctx, s.conn)()
	if err := s.write(req); err != nil {
		return broke(err)
	}
	s.used = time.Now()
	if !req.Ack {
		return nil
	}
	var ack DeterminantsAck
	if err := ReadLine(s.r, &ack, MaxHeader); err != nil {
		return broke(err)
	}
	if ack.Error != nil {
		ack.Error.Op, ack.Error.Peer, ack.Error.Status = s.op, s.peer, statusOf(ack.Error.Code)
		return ack.Error
	}
	return nil
}

// write sends req as the stream's kind wants it: on OpDeterminantStream3 its line, then its packed bytes,
// in one write.
func (s *DeterminantStream) write(req DeterminantsRequest) error {
	if s.op != OpDeterminantStream3 {
		return WriteLine(s.conn, req)
	}
	packed := req.Packed
	req.Packed, req.PackedLen = nil, len(packed)
	line, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("encode message: %w", err)
	}
	if _, err := s.conn.Write(slices.Concat(line, []byte{'\n'}, packed)); err != nil {
		return fmt.Errorf("write message: %w", err)
	}
	return nil
}

// Close ends the stream.
func (s *DeterminantStream) Close() error { return s.conn.Close() }

// readBatch reads the next batch of a determinant stream of kind op from in. On OpDeterminantStream3 the
// line is bounded as a header and the bytes after it by the protocol's bound for a message.
func readBatch(in *bufio.Reader, op Op) (DeterminantsRequest, error) {
	var req DeterminantsRequest
	if op != OpDeterminantStream3 {
		if err := ReadLine(in, &req, MaxMessage); err != nil {
			return DeterminantsRequest{}, err
		}
		if req.PackedLen != 0 {
			return DeterminantsRequest{}, fmt.Errorf("a batch of %s announces packed bytes after its line", op)
		}
		return req, nil
	}
	if err := ReadLine(in, &req, MaxHeader); err != nil {
		return DeterminantsRequest{}, err
	}
	if len(req.Packed) != 0 || req.PackedLen < 0 || req.PackedLen > MaxMessage {
		return DeterminantsRequest{}, fmt.Errorf("a batch of %s with %d packed bytes in its line and %d after it (at most %d)", op, len(req.Packed), req.PackedLen, MaxMessage)
	}
	req.Packed = make([]byte, req.PackedLen)
	if _, err := io.ReadFull(in, req.Packed); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF // the stream ended between a line and its bytes
		}
		return DeterminantsRequest{}, fmt.Errorf("read the packed determinants after a batch's line: %w", err)
	}
	return req, nil
}

// determinantStream serves op (OpDeterminantStream, 2 or 3): it switches to a
// determinant stream and serves it.
func (s *Server) determinantStream(op Op) opHandler {
	return func(w http.ResponseWriter, r *http.Request, peer string) {
		var none struct{}
		if err := s.readRequest(w, r, op, 0, &none); err != nil {
			s.refuse(w, op, peer, err)
			return
		}
		s.upgrade(w, r, op, peer, func(c net.Conn) error { return s.serveDeterminants(op, peer, c) })
	}
}

// serveDeterminants hands each batch of peer's stream on c to the service, until peer closes the stream,
// it is silent for the idle timeout, or the server stops. A line that is no batch ends the stream. On
// OpDeterminantStream every batch is answered, a refusal too; on OpDeterminantStream2 and 3 only the
// batches that ask, and a refusal ends the stream (detstream.go).
func (s *Server) serveDeterminants(op Op, peer string, c net.Conn) error {
	defer endOnDone(s.base, c)()
	answerAll := op == OpDeterminantStream
	in := bufio.NewReader(c)
	for {
		if err := c.SetReadDeadline(time.Now().Add(s.opts.Timeouts.IdleTimeout())); err != nil {
			return err
		}
		req, err := readBatch(in, op)
		if err != nil {
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
			ack.Error.Op = op
			s.log.Warn("cluster request refused", "peer", peer, "op", op, "code", ack.Error.Code, "err", ack.Error.Message)
			ack.Error = ack.Error.wire() // the member reads an answer of up to MaxHeader bytes
		} else if !answerAll && !req.Ack {
			continue
		}
		if err := c.SetWriteDeadline(time.Now().Add(s.opts.Timeouts.MessageTimeout())); err != nil {
			return err
		}
		if err := WriteLine(c, ack); err != nil {
			return err
		}
		if ack.Error != nil && !answerAll {
			return nil // the member sends again what followed, on a new stream
		}
	}
}
