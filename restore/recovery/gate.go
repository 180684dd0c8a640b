package recovery

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/ebpfprobes"
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
	held     int64 // of injected: what the peers sent during the replay (deliverHeld)
	err      error
	done     time.Time // when the gate delivered its last byte
}

// planGate decides whether job j's receive order is replayed, and if so defers its connections' receive
// bytes to a gate. peers is the live state of each connection's peer. The images in j.Work are read (the
// receive queues), not changed: Rewrite empties the queues of deferred connections.
func planGate(ctx context.Context, d Deps, j *Job, peers map[tcpflow.Tuple]restore.Peer) {
	if d.Determinants == nil {
		j.gateWhy = "this host records no receive order"
		return
	}
	dets, err := d.Determinants.Since(ctx, j.Source, j.Manifest, j.Ran)
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
		data := cp.Inject // the gate only reads it: no copy of what may be tens of MB
		if len(q) > 0 {
			data = append(q, cp.Inject...)
		}
		sources[c.Tuple] = intercept.Source{Seq: c.InqSeq - c.InqLen, Data: data}
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
	if m := j.Manifest; m.Positions && d.Determinants.Positions() {
		if err := g.UsePositions(m.Polls); err != nil {
			d.Logger.Warn("receive positions cannot be replayed: the receive order is replayed without them", "job", j.ID, "err", err)
		}
	}
	preload := g.Preload()
	for i := range j.Plan.Conns {
		cp := &j.Plan.Conns[i]
		cp.Deferred = true
		cp.Preload = sources[cp.Conn.Tuple].Data[:preload[cp.Conn.Tuple.Unmap()]]
	}
	j.gate = g
	if g.Positions() {
		j.BeforeRun = func() error {
			stops := d.Determinants.Stopper(j.ID)
			if stops == nil {
				return errors.New("this host cannot stop the restored job's threads, which its receive positions need")
			}
			return g.ArmFirst(stops)
		}
	}
}

// startGate runs j's gate once j is restored; ReplayAndVerify waits for its end. events were subscribed
// before the restore, so that no receive call of the restored job is missed.
func startGate(ctx context.Context, d Deps, j *Job, events <-chan intercept.Event, stop func()) {
	j.gateDone = make(chan gateResult, 1)
	var stops intercept.Stopper
	if j.gate.Positions() {
		stops = d.Determinants.Stopper(j.ID) // nil: Run fails, and the job is killed as diverged
	}
	go func() {
		defer stop()
		ctx, cancel := context.WithTimeoutCause(ctx, d.ReplayTimeout, fmt.Errorf("failover.replay_timeout (%s) passed", d.ReplayTimeout))
		defer cancel()
		n, err := j.gate.Run(ctx, gateInjector{ctx: ctx, d: d, j: j, net: netOf(d, j)}, events, stops)
		endHold(d, j)
		var held int64
		if err == nil {
			held = deliverHeld(ctx, d, j)
		}
		j.gateDone <- gateResult{dets: j.gate.Len(), injected: n + held, held: held, err: err, done: time.Now()}
	}()
}

// deliverHeldWait bounds deliverHeld.
const deliverHeldWait = 10 * time.Second

// deliverHeld delivers to j's deferred connections, once their hold has ended, what each peer sent after
// the gate's bytes (its log as planned): the hold dropped those segments, and a peer that sent nothing
// after them (its program waits for the restored job) learns of their loss only by its retransmission
// timer. The replay's ACKs of its bytes sent seconds before, some echoing an old timestamp, leave that
// timer at tens of seconds (measured: 22.9 s, the survivor's ring stalled 14 s). It returns the bytes
// delivered. A failure costs only that wait, as before: it is logged.
func deliverHeld(ctx context.Context, d Deps, j *Job) int64 {
	// The peer sent those bytes into the window the restored socket announced: they fit at once. A socket
	// that does not take them in does not hold up the recovery for long.
	ctx, cancel := context.WithTimeout(ctx, deliverHeldWait)
	defer cancel()
	net := netOf(d, j)
	var (
		wg        sync.WaitGroup
		delivered atomic.Int64
	)
	for _, cp := range j.Plan.Conns {
		if !cp.Deferred {
			continue
		}
		c := deferredConn(cp)
		wg.Go(func() {
			// One connection's bytes may wait for the job to read another: all at once.
			n, err := deliverLogged(ctx, d, net, c, c.InqSeq+uint32(len(cp.Inject)), nil)
			if err != nil {
				d.Logger.Warn("could not deliver what a peer sent during the replay: it retransmits it on its timer", "job", j.ID, "conn", c.Tuple, "err", err)
			}
			delivered.Add(n)
		})
	}
	wg.Wait()
	return delivered.Load()
}

// endHold lets the peers' own data segments through again on j's deferred connections, and unregisters
// from the ACK clamp those that were clamped only to be held (nothing to re-send).
func endHold(d Deps, j *Job) {
	if d.Clamp == nil {
		return
	}
	for _, c := range j.Plan.Conns {
		if !c.Deferred {
			continue
		}
		if err := d.Clamp.Hold(c.Conn.Tuple, false); err != nil {
			d.Logger.Warn("could not stop holding a peer's segments: the connection stalls", "job", j.ID, "conn", c.Conn.Tuple, "err", err)
		}
		if c.Resend == 0 {
			d.Clamp.Release(c.Conn.Tuple)
		}
	}
}

// waitGate waits for j's gate, if it has one, and says how it went.
func waitGate(j *Job) (string, error) {
	if j.gateDone == nil {
		if j.gateWhy == "" {
			return "", nil
		}
		return "receive order not replayed: " + j.gateWhy + "; ", nil
	}
	r := <-j.gateDone
	if r.err != nil {
		return "", fmt.Errorf("receive order: %w", r.err)
	}
	how := "receive order"
	if j.gate.Positions() {
		how = "receive order and positions"
	}
	return fmt.Sprintf("%s replayed: %d receive calls, %d bytes delivered, %d of them sent during the replay (done %s after the restore); ", how, r.dets, r.injected, r.held, r.done.Sub(j.RestoredAt).Round(time.Millisecond)), nil
}

// gateInjector delivers a restored job's receive bytes as its peers' segments.
type gateInjector struct {
	ctx context.Context
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
	live := g.j.peers[c.Conn.Tuple].Live
	// The peer's clock as the ACK clamp last saw it, rather than at the recovery's start: the restored
	// socket echoes this TSval, and the peer takes now minus the echo for a round trip (bpf/ackclamp.c,
	// peer_timestamp). The peer's own, so never ahead of its later segments (PAWS).
	if g.d.Clamp != nil && live.HasTS {
		if ts, ok := g.d.Clamp.PeerTSval(c.Conn.Tuple); ok && int32(ts-live.TSval) > 0 {
			live.TSval = ts
		}
	}
	h := peerHeader(g.d, live, c.Conn.Tuple, c.Conn.OutqSeq)
	h.Seq = seq
	// The restored socket counts what it received from the snapshot's first unread byte on: CRIU sets
	// rcv_nxt there and sends the restored queue (the preload) through it.
	return g.net.DeliverFromPeer(g.ctx, conn, h, data, c.Conn.InqSeq-c.Conn.InqLen)
}

// peerHeader is the header of the segments that deliver a peer's bytes to a restored socket of flow
// (Local: the restored end), live being the peer's state and outqSeq the snapshot's write_seq.
func peerHeader(d Deps, live ebpfprobes.FlowState, flow tcpflow.Tuple, outqSeq uint32) restore.PeerHeader {
	// The ACK must lie between the restored socket's snd_una and snd_nxt, and never acknowledge a byte
	// the peer does not have: what the peer acknowledged, capped at what the socket has sent (at least
	// the snapshot's write_seq, which CRIU restores as sent).
	sent := outqSeq
	if s, ok := d.Log.SentUpTo(flow); ok && int32(s-sent) > 0 {
		sent = s
	}
	ack := live.Ack
	if int32(ack-sent) > 0 {
		ack = sent
	}
	// TSval: the peer's latest, never ahead of its clock (PAWS on its later segments). The window field
	// becomes the restored socket's idea of the peer's window: the peer's own last one (unscaled, as the
	// socket scales it), the largest if it was closed when read.
	win := live.Window
	if win == 0 {
		win = 0xffff
	}
	return restore.PeerHeader{Ack: ack, Window: win, TS: live.HasTS, TSval: live.TSval}
}

// DeferredConn is a connection whose receive bytes a gate delivers: what a recovery resumed by a
// restarted agent needs to deliver the rest (part of the agent's on-disk recovery record).
type DeferredConn struct {
	tcpflow.Tuple
	Inode   uint64 `json:"inode"`
	InqSeq  uint32 `json:"inq_seq"`
	InqLen  uint32 `json:"inq_len"`
	OutqSeq uint32 `json:"outq_seq"`
}

// Deferred lists j's connections whose receive bytes a gate delivers.
func Deferred(j *Job) []DeferredConn {
	var out []DeferredConn
	for _, c := range j.Plan.Conns {
		if c.Deferred {
			out = append(out, deferredConn(c))
		}
	}
	return out
}

func deferredConn(c restore.ConnPlan) DeferredConn {
	return DeferredConn{Tuple: c.Conn.Tuple, Inode: c.Conn.Inode, InqSeq: c.Conn.InqSeq, InqLen: c.Conn.InqLen, OutqSeq: c.Conn.OutqSeq}
}

// DeliverRest finishes, for a recovery resumed after the agent restarted, the delivery of a restored job's
// receive bytes that a gate had begun. The gate's progress died with the agent, so the order cannot be
// kept: every byte each peer sent that the socket lacks is delivered at once (from the snapshot's images
// in images, then the peer's log, asked again), and the peers' own segments pass again. The job reads
// freely from there; its re-sent bytes are still checked, so a program that then reads in another order
// fails loudly.
func DeliverRest(ctx context.Context, d Deps, net Network, images string, conns []DeferredConn) error {
	// Every connection at once: one connection's rest may wait for the job to read it (its window), while
	// the job first reads another.
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		if d.Clamp != nil {
			d.Clamp.Hold(c.Tuple, false) // a flow released already has nothing to hold
		}
		wg.Go(func() {
			if err := deliverRest(ctx, d, net, images, c); err != nil {
				errs[i] = fmt.Errorf("connection %s: %w", c.Tuple, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func deliverRest(ctx context.Context, d Deps, net Network, images string, c DeferredConn) error {
	q, err := image.ReceiveQueue(images, uint32(c.Inode))
	if err != nil {
		return err
	}
	_, err = deliverLogged(ctx, d, net, c, c.InqSeq, q)
	return err
}

// deliverLogged delivers to c's restored socket what its peer logged from sequence from on, after head
// (the bytes before from, which the socket lacks too). It returns how many logged bytes it delivered.
func deliverLogged(ctx context.Context, d Deps, net Network, c DeferredConn, from uint32, head []byte) (int64, error) {
	owner := d.Peers.Owner(ctx, c.Remote.Addr())
	if owner == "" {
		return 0, fmt.Errorf("no member holds the peer %s", c.Remote.Addr())
	}
	qctx, cancel := context.WithTimeout(ctx, time.Minute)
	reply, data, err := logRange(qctx, d.Peers, owner, c.Tuple, from)
	cancel()
	if err != nil {
		return 0, fmt.Errorf("log of %s: %w", owner, err)
	}
	if reply.Live == nil {
		return 0, fmt.Errorf("%s has no live state of it", owner)
	}
	n := reply.Live.DataEnd() - from
	if int32(n) < 0 {
		return 0, fmt.Errorf("%s logged %d bytes from %d, its data ends at %d", owner, len(data), from, reply.Live.DataEnd())
	}
	// The peer may have sent more since its log caught up: those segments pass, the hold is over.
	n = min(n, uint32(len(data)))
	if n == 0 && len(head) == 0 {
		return 0, nil
	}
	h := peerHeader(d, *reply.Live, c.Tuple, c.OutqSeq)
	h.Seq = from - uint32(len(head))
	if err := net.DeliverFromPeer(ctx, c.Tuple, h, append(head, data[:n]...), c.InqSeq-c.InqLen); err != nil {
		return 0, err
	}
	return int64(n), nil
}
