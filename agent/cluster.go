package agent

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// Agent-to-agent traffic runs over mutual TLS on the cluster address. Each connection starts with one
// request header (a JSON line, read byte by byte so that nothing after it is buffered away from the
// operation's own protocol); the operation then owns the connection.

// clusterOp names an operation between agents.
type clusterOp string

const (
	opPing     clusterOp = "ping"     // liveness and the peer's running jobs
	opSnapshot clusterOp = "snapshot" // the caller ships a snapshot to us (we are its protector)
	opFetch    clusterOp = "fetch"    // the caller asks for a snapshot we hold (to restore it)
	opLocate   clusterOp = "locate"   // which job does a snapshot id we hold belong to
	// Sender-side log.
	opTrim          clusterOp = "trim"           // the caller's snapshot covers these receive points: drop older log data
	opLogRange      clusterOp = "log-range"      // bytes we logged on a connection from a sequence number on
	opCheckpointNow clusterOp = "checkpoint-now" // the caller's log is under pressure: snapshot our jobs
	opReceived      clusterOp = "received"       // our record of what one of our sockets received (CRC-32C per block)
	opLogWatermark  clusterOp = "log-watermark"  // how old is our oldest restore point: the caller frees finished connections' logs older than it
	// Failure detection and recovery.
	opHeartbeat clusterOp = "heartbeat" // a stream of heartbeats from our predecessor in the ring
	opProbe     clusterOp = "probe"     // does this host reach a suspect's agent
	opView      clusterOp = "view"      // exchange membership views (and failure timelines)
	opClaim     clusterOp = "claim"     // claim this spare for a failed node
	opRecover   clusterOp = "recover"   // restore a failed node's jobs here
	opReplica   clusterOp = "replica"   // the newest verified replica of a job from a node that we hold
	// opRecoveryStatus: how a recovery we were the target of went (the caller's progress stream broke).
	opRecoveryStatus clusterOp = "recovery-status"
	opGrant          clusterOp = "grant" // grant (or give back) the next incarnation of a job to a restore
)

type clusterRequest struct {
	Op clusterOp `json:"op"`
}

// PingReply is the answer to opPing.
type PingReply struct {
	Node string   `json:"node"`
	Jobs []string `json:"jobs"` // ids of the jobs running there
}

// maxHeader bounds a request header; maxMessage bounds the larger messages (views, recovery requests)
// that are sent the same way, and every reply a caller reads.
const (
	maxHeader  = 4096
	maxMessage = 1 << 20
)

// Default deadlines of the agent-to-agent protocol. Every read and write of a request or a reply has a
// deadline, so a member that connects and stalls (or a network that silently drops it) never holds a
// goroutine or a connection for good.
const (
	// defaultMessageTimeout bounds reading or writing one request or reply line.
	defaultMessageTimeout = 10 * time.Second
	// defaultIdleTimeout bounds the silence inside a stream that may last long as a whole (logged bytes,
	// recovery progress): the stream goes on as long as it keeps moving.
	defaultIdleTimeout = time.Minute
	// defaultPerMiB is the time a large message may take per MiB beyond the message timeout: the
	// slowest link allowed for carries 1 MiB/s.
	defaultPerMiB = time.Second
)

// wireTimeouts are the agent's protocol deadlines; a zero field takes its default (tests shorten them).
type wireTimeouts struct {
	Message time.Duration
	Idle    time.Duration
	PerMiB  time.Duration
}

func (a *Agent) msgTimeout() time.Duration {
	if a.wire.Message > 0 {
		return a.wire.Message
	}
	return defaultMessageTimeout
}

func (a *Agent) idleTimeout() time.Duration {
	if a.wire.Idle > 0 {
		return a.wire.Idle
	}
	return defaultIdleTimeout
}

// largeTimeout is the deadline for one message of up to limit bytes: the message timeout plus the time the
// slowest link we allow for takes to carry it.
func (a *Agent) largeTimeout(limit int) time.Duration {
	perMiB := a.wire.PerMiB
	if perMiB <= 0 {
		perMiB = defaultPerMiB
	}
	return a.msgTimeout() + time.Duration(limit>>20)*perMiB
}

func writeHeader(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

func readHeader(r io.Reader, v any) error { return readLine(r, v, maxHeader) }

// readHeaderLarge reads a JSON line of up to maxMessage bytes (writeHeader writes any size).
func readHeaderLarge(r io.Reader, v any) error { return readLine(r, v, maxMessage) }

// readLine reads one JSON line of at most limit bytes (the newline excluded) into v. It reads byte by byte,
// so that nothing after the line is buffered away from the operation's own protocol, and never holds more
// than limit bytes, whatever the peer sends.
func readLine(r io.Reader, v any, limit int) error {
	var buf []byte
	one := make([]byte, 1)
	for len(buf) <= limit {
		if _, err := io.ReadFull(r, one); err != nil {
			if err == io.EOF && len(buf) > 0 {
				err = io.ErrUnexpectedEOF // the stream ended inside the line
			}
			return fmt.Errorf("read message line: %w", err)
		}
		if one[0] == '\n' {
			if err := json.Unmarshal(buf, v); err != nil {
				return fmt.Errorf("message line of %d bytes is not the expected JSON: %w", len(buf), err)
			}
			return nil
		}
		buf = append(buf, one[0])
	}
	return fmt.Errorf("%w: longer than %d bytes", errTooLong, limit)
}

// errTooLong means a peer sent a message line longer than the operation allows.
var errTooLong = errors.New("message line too long")

// readRequest reads the operation's request line (at most limit bytes) within the deadline for that size.
func (a *Agent) readRequest(c net.Conn, v any, limit int) error {
	c.SetReadDeadline(time.Now().Add(a.largeTimeout(limit)))
	return readLine(c, v, limit)
}

// reply writes one reply line within the message timeout. A peer that does not read it is only logged:
// the operation's own work is done.
func (a *Agent) reply(c net.Conn, peer string, op clusterOp, v any) error {
	c.SetWriteDeadline(time.Now().Add(a.msgTimeout()))
	if err := writeHeader(c, v); err != nil {
		a.log.Warn("cluster reply not delivered", "peer", peer, "op", op, "err", err)
		return err
	}
	return nil
}

// refuse logs why a peer's request was refused (the connection then closes).
func (a *Agent) refuse(peer string, op clusterOp, err error) {
	a.log.Warn("cluster request refused", "peer", peer, "op", op, "err", err)
}

func (a *Agent) tlsConfig() clustertls.Config {
	return clustertls.Config{
		CAFile: a.cfg.Cluster.CA, CertFile: a.cfg.Cluster.Cert, KeyFile: a.cfg.Cluster.Key,
		Members: func(name string) bool { _, ok := a.member(name); return ok },
	}
}

// serveCluster accepts authenticated connections from other agents until ctx ends.
func (a *Agent) serveCluster(ctx context.Context) (io.Closer, error) {
	ln, err := clustertls.Listen(a.cfg.Cluster.Listen.String(), a.tlsConfig())
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
					a.log.Error("cluster listener stopped", "err", err)
				}
				return
			}
			go a.handleCluster(ctx, c)
		}
	}()
	a.log.Info("cluster API listening", "addr", a.cfg.Cluster.Listen)
	return ln, nil
}

func (a *Agent) handleCluster(ctx context.Context, c net.Conn) {
	defer c.Close()
	tc := c.(interface {
		HandshakeContext(context.Context) error
	})
	hctx, cancel := context.WithTimeout(ctx, a.msgTimeout())
	defer cancel()
	if err := tc.HandshakeContext(hctx); err != nil {
		a.log.Warn("cluster handshake refused", "remote", c.RemoteAddr(), "err", err)
		return
	}
	peer, err := clustertls.PeerName(connState(c))
	if err != nil {
		a.log.Warn("cluster peer refused", "remote", c.RemoteAddr(), "err", err)
		return
	}
	var req clusterRequest
	if err := a.readRequest(c, &req, maxHeader); err != nil {
		a.log.Warn("bad cluster request", "peer", peer, "err", err)
		return
	}
	// Each operation sets the deadlines of its own reads and writes from here on.
	c.SetDeadline(time.Time{})
	switch req.Op {
	case opPing:
		a.servePing(c, peer)
	case opSnapshot:
		got, err := ship.Receive(ctx, c, a.store, ship.ReceiveOptions{Peer: peer, Authorize: ship.FromNode(peer), Logger: a.log})
		if err != nil {
			a.log.Warn("snapshot from peer refused", "peer", peer, "err", err)
			return
		}
		a.keepReplicas(ctx, got)
		a.log.Info("replica stored", "peer", peer, "job", got.Manifest.Job, "snapshot", got.Manifest.ID,
			"bytes", got.Bytes, "wire_bytes", got.WireBytes, "ms", got.Duration.Milliseconds())
	case opLocate:
		a.serveLocate(c, peer)
	case opTrim:
		a.serveTrim(c, peer)
	case opLogRange:
		a.serveLogRange(ctx, c, peer)
	case opReceived:
		a.serveReceived(c, peer)
	case opLogWatermark:
		a.serveLogWatermark(c)
	case opCheckpointNow:
		a.serveCheckpointNow(ctx, peer)
	case opHeartbeat:
		a.serveBeats(c, peer)
	case opProbe:
		a.serveProbe(c, peer)
	case opView:
		a.serveView(c, peer)
	case opClaim:
		a.serveClaim(c, peer)
	case opReplica:
		a.serveReplica(ctx, c, peer)
	case opRecover:
		a.serveRecover(ctx, c, peer)
	case opRecoveryStatus:
		a.serveRecoveryStatus(c, peer)
	case opFetch:
		if err := a.serveFetch(ctx, c, peer); err != nil {
			a.log.Warn("snapshot fetch failed", "peer", peer, "err", err)
		}
	case opGrant:
		a.serveGrant(c, peer)
	default:
		a.log.Warn("unknown cluster operation", "peer", peer, "op", req.Op)
	}
}

// servePing answers opPing with this host's name and running jobs.
func (a *Agent) servePing(c net.Conn, peer string) {
	var jobs []string
	for _, j := range a.Jobs(0) {
		if j.State == JobRunning {
			jobs = append(jobs, j.ID)
		}
	}
	a.reply(c, peer, opPing, PingReply{Node: a.cfg.Name, Jobs: jobs})
}

// serveCheckpointNow snapshots this host's jobs for a sender whose log is under pressure. Requests that
// arrive while one is pending are folded into it: peers must not queue snapshots without bound. It
// reports whether it started one.
func (a *Agent) serveCheckpointNow(ctx context.Context, peer string) bool {
	if !a.asked.CompareAndSwap(false, true) {
		a.log.Info("snapshot requested by a sender whose log is under pressure; one is already pending", "peer", peer)
		return false
	}
	a.log.Info("snapshot requested by a sender whose log is under pressure", "peer", peer)
	go func() {
		defer a.asked.Store(false)
		if _, err := a.Checkpoint(context.WithoutCancel(ctx), nil, 0); err != nil {
			a.log.Warn("requested snapshot failed", "err", err)
		}
	}()
	return true
}

// serveLocate answers which job a snapshot id this host holds belongs to ("" if none).
func (a *Agent) serveLocate(c net.Conn, peer string) {
	var req fetchRequest
	if err := a.readRequest(c, &req, maxHeader); err != nil {
		a.refuse(peer, opLocate, err)
		return
	}
	a.reply(c, peer, opLocate, a.locateReply(req.ID))
}

// dialPeer opens an authenticated connection to member name and sends the request header. The dial ends
// with ctx; the header write has the message timeout; the connection is returned without a deadline.
func (a *Agent) dialPeer(ctx context.Context, name string, op clusterOp) (net.Conn, error) {
	m, ok := a.member(name)
	if !ok {
		return nil, fmt.Errorf("%s is not a cluster member", name)
	}
	c, err := clustertls.Dial(ctx, m.Address.String(), name, a.tlsConfig())
	if err != nil {
		return nil, err
	}
	c.SetWriteDeadline(time.Now().Add(a.msgTimeout()))
	if err := writeHeader(c, clusterRequest{Op: op}); err != nil {
		c.Close()
		return nil, fmt.Errorf("send %s request to %s: %w", op, name, err)
	}
	c.SetWriteDeadline(time.Time{})
	return c, nil
}

// peerConn is a caller's connection to a member for one operation; the caller's context closes it when it
// ends first.
type peerConn struct {
	net.Conn
	peer string
	op   clusterOp
	stop func() bool
}

func (c *peerConn) Close() error {
	c.stop()
	return c.Conn.Close()
}

// open dials member peer for op, sends the request header and req (unless nil), and sets the connection's
// deadline to timeout from now, or to ctx's deadline if that comes first. Canceling ctx closes the
// connection, which ends any read or write in progress.
func (a *Agent) open(ctx context.Context, peer string, op clusterOp, timeout time.Duration, req any) (*peerConn, error) {
	deadline := time.Now().Add(timeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	dctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	nc, err := a.dialPeer(dctx, peer, op)
	if err != nil {
		return nil, err
	}
	c := &peerConn{Conn: nc, peer: peer, op: op, stop: context.AfterFunc(ctx, func() { nc.Close() })}
	c.SetDeadline(deadline)
	if req != nil {
		if err := writeHeader(c, req); err != nil {
			c.Close()
			return nil, fmt.Errorf("send %s request to %s: %w", op, peer, err)
		}
	}
	return c, nil
}

// readReply reads one reply line (at most maxMessage bytes) into v.
func (c *peerConn) readReply(v any) error {
	if err := readLine(c, v, maxMessage); err != nil {
		return fmt.Errorf("%s reply from %s: %w", c.op, c.peer, err)
	}
	return nil
}

// call runs one request/reply exchange with member peer: the operation header, req (unless nil), and one
// reply line into reply (unless nil), all within timeout or before ctx ends, whichever comes first.
func (a *Agent) call(ctx context.Context, peer string, op clusterOp, timeout time.Duration, req, reply any) error {
	c, err := a.open(ctx, peer, op, timeout, req)
	if err != nil {
		return err
	}
	defer c.Close()
	if reply == nil {
		return nil
	}
	return c.readReply(reply)
}

// idleConn re-arms a connection's deadline before every read and write, so that a long stream goes on as
// long as it keeps moving and a stalled peer is dropped after idle. It never arms past limit (zero: none).
type idleConn struct {
	net.Conn
	idle  time.Duration
	limit time.Time
}

func (c idleConn) arm() {
	d := time.Now().Add(c.idle)
	if !c.limit.IsZero() && c.limit.Before(d) {
		d = c.limit
	}
	c.SetDeadline(d)
}

func (c idleConn) Read(p []byte) (int, error) {
	c.arm()
	return c.Conn.Read(p)
}

func (c idleConn) Write(p []byte) (int, error) {
	c.arm()
	return c.Conn.Write(p)
}

// Ping asks member name's agent whether it is alive and which jobs it runs.
func (a *Agent) Ping(ctx context.Context, name string) (PingReply, error) {
	var r PingReply
	err := a.call(ctx, name, opPing, a.msgTimeout(), nil, &r)
	return r, err
}

func connState(c net.Conn) *tls.ConnectionState {
	st := c.(*tls.Conn).ConnectionState()
	return &st
}
