package node

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

// Point is where a receiver's durable snapshot starts receiving on one connection: the log before it
// may go. Conn is the flow seen from this host's (the sender's) socket.
type Point struct {
	Conn tcpflow.Tuple
	Seq  uint32 // the receiver's rcv_nxt in the snapshot
}

// Trim drops the log data that receiving member peer's snapshot covers and returns how many
// connections it trimmed, or, while a snapshot holds the trims (HoldTrims), how many it will trim then.
// The caller checked that peer holds each point's receiving end.
func (n *Node) Trim(peer string, pts []Point) int {
	pts = n.sentPoints(peer, pts)
	// A held point is kept with the store it was checked against: the release applies it to that store only,
	// not to a new connection on the same 4-tuple that started one meanwhile (a connection with no store
	// has nothing to trim now, as without the hold).
	stores := make([]*netlog.Store, len(pts))
	for i, p := range pts {
		stores[i], _ = n.Log().Store(p.Conn)
	}
	n.mu.Lock()
	if n.holds > 0 {
		held := 0
		for i, p := range pts {
			if stores[i] == nil {
				continue
			}
			if old, ok := n.held[p.Conn]; !ok || old.st != stores[i] || int32(p.Seq-old.seq) > 0 {
				n.held[p.Conn] = heldPoint{st: stores[i], seq: p.Seq}
			}
			held++
		}
		n.heldFrom[peer] = true
		n.mu.Unlock()
		return held
	}
	n.mu.Unlock()
	trimmed := 0
	for _, p := range pts {
		if n.trim(p.Conn, p.Seq) {
			trimmed++
		}
	}
	n.relieved(peer)
	return trimmed
}

// sentPoints returns the points of pts that are not beyond what this host has sent on their connection so
// far (the live state's snd_nxt); the others are ignored (the next one trims), before a snapshot's hold
// could let one displace a good point of its connection. The log, which places a sequence number within
// 2^31 of its position, would take such a point for one ahead and drop everything sent up to it. A job
// restored here that still re-sends what its peer already had is behind its peer's points for a moment;
// otherwise no receiver holds bytes never sent, and the point is a bad one. Without a live state, the
// log's own position decides (unplaceable).
func (n *Node) sentPoints(peer string, pts []Point) []Point {
	return slices.DeleteFunc(slices.Clone(pts), func(p Point) bool {
		fs, ok, err := n.src.FlowState(p.Conn)
		if err != nil || !ok {
			return n.unplaceable(peer, p)
		}
		if int32(p.Seq-fs.SndNxt) > 0 {
			n.log.Info("trim point ignored: beyond what this host has sent on the connection so far", "peer", peer, "conn", p.Conn,
				"seq", p.Seq, "snd_nxt", fs.SndNxt)
			return true
		}
		// The trim applies at the point's block start: one more than 2^31 behind snd_nxt (a point just
		// within it) would be placed about 2^31 ahead of the log's position, and drop all it holds.
		if bs := recvdigest.BlockStart(p.Seq); int32(bs-fs.SndNxt) > 0 {
			n.log.Info("trim point ignored: its receive-digest block starts more than 2^31 behind what this host has sent on the connection",
				"peer", peer, "conn", p.Conn, "seq", p.Seq, "block_start", bs, "snd_nxt", fs.SndNxt)
			return true
		}
		return false
	})
}

// unplaceable says whether p, of a connection with no live state, would trim (at its block's start,
// unwrapped within 2^31 of the log's position as the log's Trim does) beyond every byte the log has seen
// of it, and logs why it is ignored. Such a point is ahead of what was sent, or more than 2^31 behind the
// log's position (a stale snapshot's), which reads as about 2^32 ahead: trimming there would drop bytes a
// recovery from it needs. Keeping them is safe; the next good point, or the release, frees them. A point
// just past the last byte (the receiver has the FIN) trims at its block's start, at most one past all the
// log has seen: ignored, it would be ignored for good (the receiver's point stays there).
func (n *Node) unplaceable(peer string, p Point) bool {
	b, err := n.Log().Bounds(p.Conn)
	if err != nil || !b.Anchored {
		return false // nothing logged that the trim could drop
	}
	// Seen+1: the FIN's end, a block start one time in BlockSize, is just past the last byte too.
	if netlog.UnwrapNear(b.Seen, recvdigest.BlockStart(p.Seq)) <= b.Seen+1 {
		return false
	}
	n.log.Info("trim point ignored: the connection has no live state, and the point is beyond all the log has seen of it (ahead of what was sent, or more than 2^31 behind)",
		"peer", peer, "conn", p.Conn, "seq", p.Seq, "seen", netlog.Wire(b.Seen))
	return true
}

// trim drops the log of conn before the receive-digest block of seq (a snapshot of ours taken meanwhile may
// need the bytes before its write_seq in that block: sentPrefix) and reports whether the connection was there.
func (n *Node) trim(conn tcpflow.Tuple, seq uint32) bool {
	_, err := n.Log().Trim(conn, recvdigest.BlockStart(seq))
	return err == nil
}

func (n *Node) relieved(peer string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.seen[peer] = time.Now()
	n.ctl.Relieved(peer)
}

// HoldTrims holds back the trims that arrive until every holder has called its release, which applies
// them. A snapshot of a job of this host holds them from before its dump until it has read, from the log,
// what each connection sent of its last receive-digest block (sentPrefix): the job runs again before that,
// and a receiver's snapshot taken meanwhile could trim the block away: the snapshot's sent prefix would be
// unknown, and a recovery from it refused as unverifiable. Trims that came before the dump cannot reach
// that block: the receiver had not got beyond it.
func (n *Node) HoldTrims() (release func()) {
	n.mu.Lock()
	n.holds++
	n.mu.Unlock()
	return sync.OnceFunc(func() {
		n.mu.Lock()
		n.holds--
		if n.holds > 0 {
			n.mu.Unlock()
			return
		}
		held, peers := n.held, n.heldFrom
		n.held, n.heldFrom = map[tcpflow.Tuple]heldPoint{}, map[string]bool{}
		n.mu.Unlock()
		for conn, h := range held {
			// A connection gone meanwhile has nothing to trim, and a new one on its 4-tuple is not trimmed.
			n.Log().TrimStore(conn, h.st, recvdigest.BlockStart(h.seq))
		}
		for peer := range peers {
			n.relieved(peer)
		}
	})
}

// Range is the logged bytes of one connection from a sequence number to the highest contiguous byte,
// with the sender's live state of the connection.
type Range struct {
	From uint32 // wire sequence number of the first byte
	Len  int64
	Live *ebpfprobes.FlowState
	// LiveAge is how old Live was when the range was read (this host's clock measured it).
	LiveAge time.Duration
	// Write writes the range's bytes; nil when there are none. The range may be large: it writes as long
	// as w takes them.
	Write func(w io.Writer) error
}

// Range reads what this host logged on conn from wire sequence from on, for member peer restoring the
// connection's receiver. A hole or trimmed data is refused before any byte is sent.
func (n *Node) Range(ctx context.Context, peer string, conn tcpflow.Tuple, from uint32) (Range, error) {
	l := n.Log()
	n.catchUp(ctx, conn, from)
	if live, ok := n.sentNothingSince(conn, from); ok {
		// A one-way stream toward the restored job (or a peer that has been silent since the snapshot):
		// nothing logged because nothing was sent, which the live state shows; nothing to replay.
		age, _ := live.Age()
		return Range{From: from, Live: &live, LiveAge: age}, nil
	}
	abs, b, err := l.UnwrapServable(conn, from)
	if err != nil {
		return Range{}, err
	}
	st, err := l.Store(conn)
	if err != nil {
		return Range{}, err
	}
	// To the end of the run from abs on: a hole below abs (a segment lost before the receiver's snapshot)
	// is none of this range's business.
	to := max(abs, st.RunEnd(abs))
	if to == abs && abs < b.Last {
		if err := st.Check(abs, abs+1); err != nil {
			return Range{}, err // trimmed, or a hole at abs: named
		}
	}
	if to-abs > uint64(n.cfg.MaxRange) {
		return Range{}, fmt.Errorf("%d logged bytes of %s from sequence %d: more than the %d one range may carry", to-abs, conn, from, n.cfg.MaxRange)
	}
	if err := st.Check(abs, to); err != nil {
		return Range{}, err
	}
	r := Range{From: from, Len: int64(to - abs)}
	if fs, ok, err := n.src.FlowState(conn); err == nil && ok {
		r.Live = &fs
		r.LiveAge, _ = fs.Age()
	}
	r.Write = func(w io.Writer) error {
		if _, err := l.WriteRange(ctx, w, conn, abs, to); err != nil {
			return fmt.Errorf("log range of %s to %s cut short: %w", conn, peer, err)
		}
		return nil
	}
	return r, nil
}

// catchUpWait bounds how long Range waits for the log to hold what the live state says was sent, once
// the parked clones are taken, which parkTakeWait bounds (a failure bound: it takes a fraction of a second
// per 100 MB parked).
const (
	catchUpWait  = 250 * time.Millisecond
	parkTakeWait = 30 * time.Second
)

// catchUp waits, briefly, until the log holds every byte the probe's live state says conn sent after
// wire sequence from (a hole below from is not waited on: the range does not read it): the consumer reads
// the ring at its poll interval, and a range read between two polls would end short of the live state,
// which the restorer takes for bytes the log lost.
func (n *Node) catchUp(ctx context.Context, conn tcpflow.Tuple, from uint32) {
	live, ok, err := n.src.FlowState(conn)
	// Nothing sent after from (the receiver has the FIN, or a job restored here re-sends what its peer had):
	// [from, DataEnd) would read as a range of almost 4 GiB, waited on to the end.
	if err != nil || !ok || int32(live.DataEnd()-from) <= 0 {
		return
	}
	if c, err := n.src.Counters(); err == nil && c.ParkWaitingBytes > 0 {
		// Parked bytes are taken into the log first, every clone of the queues conn's are in, in queue
		// order: however long that takes.
		tctx, cancel := context.WithTimeout(ctx, parkTakeWait)
		if err := n.src.TakeParked(tctx, conn); err != nil {
			n.log.Warn("a range read goes on without the bytes still parked", "conn", conn, "err", err)
		}
		cancel()
	}
	ctx, cancel := context.WithTimeout(ctx, catchUpWait)
	defer cancel()
	n.Log().WaitHolds(ctx, conn, from, live.DataEnd(), 2*time.Millisecond, func() { n.src.Want(conn) })
}

// sentNothingSince says whether this host's log has no store of conn because the sender sent no payload
// on it after wire sequence from: the live state's data end is there, or before it (the receiver has the
// FIN: a finished connection's log is freed once its receiver's restore point holds it, and a restore from
// there needs the live state only; the restorer judges a live state behind its snapshot). A store that
// exists, or a live state that went further, are for the log to answer (bytes, or a hole it names).
func (n *Node) sentNothingSince(conn tcpflow.Tuple, from uint32) (ebpfprobes.FlowState, bool) {
	if n.logHolds(conn) {
		return ebpfprobes.FlowState{}, false
	}
	live, ok, err := n.src.FlowState(conn)
	if err != nil || !ok || int32(live.DataEnd()-from) > 0 {
		return ebpfprobes.FlowState{}, false
	}
	return live, true
}
