package recovery

import (
	"context"
	"fmt"
	"time"

	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// Replaying the receive order (package intercept). A job whose determinants since its snapshot are
// complete is restored with empty receive queues on its connections to surviving peers; once it runs, a
// gate delivers each connection's bytes (the snapshot's queue, then the peer's log) one recorded receive
// call at a time, so the restored program reads its sockets in the order and amounts the original did.
// A job without them is restored as before, every byte in its queues at once; either way every byte it
// re-sends is checked.

type gateResult struct {
	dets     int
	injected int64
	err      error
}

// planGate decides whether job j's receive order is replayed, and if so defers its connections' receive
// bytes to a gate. peers is the live state of each connection's peer. The images in j.Work are read (the
// receive queues), not changed: Rewrite empties the queues of deferred connections.
func planGate(ctx context.Context, d Deps, j *Job, peers map[tcpflow.Tuple]restore.Peer) {
	if d.Determinants == nil {
		j.gateWhy = "this host records no receive order"
		return
	}
	dets, err := d.Determinants.Since(ctx, j.Source, j.Manifest)
	switch {
	case err != nil:
		j.gateWhy = err.Error()
		return
	case len(dets) == 0:
		j.gateWhy = "it consumed nothing since the snapshot"
		return
	}
	sources := make(map[tcpflow.Tuple]intercept.Source, len(j.Plan.Conns))
	for _, cp := range j.Plan.Conns {
		c := cp.Conn
		if peers[c.Tuple].Live.FinSent {
			j.gateWhy = fmt.Sprintf("the peer of %s closed it (its FIN cannot be delivered by the gate)", c.Tuple)
			return
		}
		q, err := image.ReceiveQueue(j.Work, uint32(c.Inode))
		if err != nil {
			j.gateWhy = fmt.Sprintf("receive queue of %s: %v", c.Tuple, err)
			return
		}
		if uint32(len(q)) != c.InqLen {
			j.gateWhy = fmt.Sprintf("receive queue of %s holds %d bytes, the manifest says %d", c.Tuple, len(q), c.InqLen)
			return
		}
		sources[c.Tuple] = intercept.Source{Seq: c.InqSeq - c.InqLen, Data: append(q, cp.Inject...)}
	}
	g, err := intercept.NewGate(dets, sources)
	switch {
	case err != nil:
		j.gateWhy = err.Error()
		return
	case g.Conns() < 2:
		// One stream read in any chunks is the same stream: every byte in the queue at once is what it
		// reads anyway, without a round trip per receive call.
		j.gateWhy = fmt.Sprintf("it read %d connection(s) to surviving peers since the snapshot: no order to keep", g.Conns())
		return
	}
	for i := range j.Plan.Conns {
		j.Plan.Conns[i].Deferred = true
	}
	j.gate, j.gateLive = g, peers
}

// startGate runs j's gate once j is restored; ReplayAndVerify waits for its end. events were subscribed
// before the restore, so that no receive call of the restored job is missed.
func startGate(ctx context.Context, d Deps, j *Job, events <-chan intercept.Det, stop func()) {
	j.gateDone = make(chan gateResult, 1)
	go func() {
		defer stop()
		ctx, cancel := context.WithTimeoutCause(ctx, d.ReplayTimeout, fmt.Errorf("failover.replay_timeout (%s) passed", d.ReplayTimeout))
		defer cancel()
		n, err := j.gate.Run(ctx, gateInjector{d: d, j: j, net: netOf(d, j)}, events)
		j.gateDone <- gateResult{dets: j.gate.Len(), injected: n, err: err}
	}()
}

// waitGate waits for j's gate, if it has one, and says how it went.
func waitGate(j *Job) (string, error) {
	if j.gateDone == nil {
		if j.gateWhy == "" {
			return "", nil
		}
		return "receive order not replayed: " + j.gateWhy + "; ", nil
	}
	start := time.Now()
	r := <-j.gateDone
	if r.err != nil {
		return "", fmt.Errorf("receive order: %w", r.err)
	}
	return fmt.Sprintf("receive order replayed: %d receive calls, %d bytes delivered (%s after the restore); ", r.dets, r.injected, start.Sub(j.RestoredAt).Round(time.Millisecond)), nil
}

// gateInjector delivers a restored job's receive bytes as its peers' segments.
type gateInjector struct {
	d   Deps
	j   *Job
	net Network
}

func (g gateInjector) Inject(conn tcpflow.Tuple, seq uint32, data []byte) error {
	var c restore.ConnPlan
	for _, cp := range g.j.Plan.Conns {
		if cp.Conn.Tuple.Unmap() == conn {
			c = cp
			break
		}
	}
	live := g.j.gateLive[c.Conn.Tuple].Live
	// The ACK must lie between the restored socket's snd_una and snd_nxt, and never acknowledge a byte
	// the peer does not have: what the peer acknowledged, capped at what the socket has sent (at least
	// the snapshot's write_seq, which CRIU restores as sent).
	sent := c.Conn.OutqSeq
	if s, ok := g.d.Log.SentUpTo(c.Conn.Tuple); ok && int32(s-sent) > 0 {
		sent = s
	}
	ack := live.Ack
	if int32(ack-sent) > 0 {
		ack = sent
	}
	// TSval: the peer's latest, never ahead of its clock (PAWS on its later segments); the window: the
	// largest, the restored socket's own send window edits stand for the peer's.
	h := restore.PeerHeader{Seq: seq, Ack: ack, Window: 0xffff, TS: live.HasTS, TSval: live.TSval}
	return g.net.InjectFromPeer(conn, h, data)
}
