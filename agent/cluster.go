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
	opDigests       clusterOp = "digests"        // CRC-32C of the blocks the caller's log holds (we are its protector)
	// Failure detection and recovery.
	opHeartbeat clusterOp = "heartbeat" // a stream of heartbeats from our predecessor in the ring
	opProbe     clusterOp = "probe"     // does this host reach a suspect's agent
	opView      clusterOp = "view"      // exchange membership views (and failure timelines)
	opClaim     clusterOp = "claim"     // claim this spare for a failed node
	opRecover   clusterOp = "recover"   // restore a failed node's jobs here
	opReplica   clusterOp = "replica"   // the newest verified replica of a job from a node that we hold
	opGrant     clusterOp = "grant"     // grant (or give back) the next incarnation of a job to a restore
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
// that are sent the same way.
const (
	maxHeader  = 4096
	maxMessage = 1 << 20
)

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

func readLine(r io.Reader, v any, limit int) error {
	var buf []byte
	one := make([]byte, 1)
	for len(buf) < limit {
		if _, err := io.ReadFull(r, one); err != nil {
			return fmt.Errorf("read request header: %w", err)
		}
		if one[0] == '\n' {
			return json.Unmarshal(buf, v)
		}
		buf = append(buf, one[0])
	}
	return fmt.Errorf("request header longer than %d bytes", limit)
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
	hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
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
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var req clusterRequest
	if err := readHeader(c, &req); err != nil {
		a.log.Warn("bad cluster request", "peer", peer, "err", err)
		return
	}
	c.SetReadDeadline(time.Time{})
	switch req.Op {
	case opPing:
		var jobs []string
		for _, j := range a.Jobs(0) {
			if j.State == JobRunning {
				jobs = append(jobs, j.ID)
			}
		}
		writeHeader(c, PingReply{Node: a.cfg.Name, Jobs: jobs})
	case opSnapshot:
		got, err := ship.Receive(ctx, c, a.store, ship.ReceiveOptions{Peer: peer, Authorize: ship.FromNode(peer), Logger: a.log})
		if err != nil {
			a.log.Warn("snapshot from peer refused", "peer", peer, "err", err)
			return
		}
		a.digests.prune(peer, got.Manifest.Conns)
		a.log.Info("replica stored", "peer", peer, "job", got.Manifest.Job, "snapshot", got.Manifest.ID,
			"bytes", got.Bytes, "wire_bytes", got.WireBytes, "ms", got.Duration.Milliseconds())
	case opLocate:
		var req fetchRequest
		if err := readHeader(c, &req); err != nil {
			return
		}
		writeHeader(c, a.locateReply(req.ID))
	case opTrim:
		a.serveTrim(c, peer)
	case opLogRange:
		a.serveLogRange(ctx, c)
	case opDigests:
		a.serveDigests(c, peer)
	case opCheckpointNow:
		a.log.Info("snapshot requested by a sender whose log is under pressure", "peer", peer)
		go func() {
			if _, err := a.Checkpoint(context.WithoutCancel(ctx), nil, 0); err != nil {
				a.log.Warn("requested snapshot failed", "err", err)
			}
		}()
	case opHeartbeat:
		a.serveBeats(c, peer)
	case opProbe:
		a.serveProbe(c)
	case opView:
		a.serveView(c, peer)
	case opClaim:
		a.serveClaim(c, peer)
	case opReplica:
		a.serveReplica(ctx, c)
	case opRecover:
		a.serveRecover(ctx, c, peer)
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

// dialPeer opens an authenticated connection to member name and sends the request header.
func (a *Agent) dialPeer(ctx context.Context, name string, op clusterOp) (net.Conn, error) {
	m, ok := a.member(name)
	if !ok {
		return nil, fmt.Errorf("%s is not a cluster member", name)
	}
	c, err := clustertls.Dial(ctx, m.Address.String(), name, a.tlsConfig())
	if err != nil {
		return nil, err
	}
	if err := writeHeader(c, clusterRequest{Op: op}); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Ping asks member name's agent whether it is alive and which jobs it runs.
func (a *Agent) Ping(ctx context.Context, name string) (PingReply, error) {
	c, err := a.dialPeer(ctx, name, opPing)
	if err != nil {
		return PingReply{}, err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	var r PingReply
	return r, readHeader(c, &r)
}

func connState(c net.Conn) *tls.ConnectionState {
	st := c.(*tls.Conn).ConnectionState()
	return &st
}
