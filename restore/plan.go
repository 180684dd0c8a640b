//go:build linux

package restore

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/tcpflow"
)

// ErrNotRecoverable marks a connection the snapshot cannot be made to agree
// with its peer: restoring it would lose or duplicate bytes, or stall. Take
// the job from a newer snapshot (or restart it) instead.
var ErrNotRecoverable = errors.New("connection not recoverable from this snapshot")

// Tunables of the plan. They are generous on purpose: too much costs a little
// memory or an early burst, too little stalls the connection for good.
const (
	// TimestampMargin is added to the peer's last echoed timestamp, beyond
	// the age of that reading, to cover clock-rate and measurement error:
	// the restored clock must not be behind what the peer saw (PAWS).
	TimestampMargin = time.Second
	// MaxLiveAge bounds the age of the peer's live state (Peer.LiveAge): Linux's TCP_PAWS_24DAYS, a
	// little below the 2^31 ms (24.8 days) past which TSecr plus the age wraps behind TSecr in the
	// timestamps' serial arithmetic, where the peer's PAWS check drops every segment of the restored
	// socket for good. The peer's host measures the age on its monotonic clock from its last segment on
	// the connection: an honest peer reports more only for a connection it left silent 24 days, whose
	// restore is refused too (the failed node's clock may have moved anywhere since).
	MaxLiveAge = 24 * 24 * time.Hour
	// CwndMargin segments are added to what the re-sent range needs.
	CwndMargin = 10
	// MinInitCwnd is Linux's own initial window (RFC 6928).
	MinInitCwnd = 10
	// WindowMargin bytes of send window are allowed beyond the re-sent
	// range, for the new bytes that follow it in the same burst.
	WindowMargin = 64 << 10
	// SegmentOverhead is the send-buffer memory one queued segment costs
	// beyond its payload (an skb head with its fclone and shared info, as
	// charged to sk_wmem_queued): a program that writes 8-byte messages
	// with TCP_NODELAY queues one skb per message.
	SegmentOverhead = 2048
	// RestoredMSS is the segment size a restored socket sends until its
	// route's MTU changes (TCP_MSS_DEFAULT 536 less 12 bytes of timestamp
	// option): LowerPathMTU makes it resync to the snapshot's MSS after the
	// restore, but the re-sent burst may leave before, so plans count with it.
	RestoredMSS = 524
)

// Peer is what the restorer learned from the peer's agent about one
// connection of the snapshot (the peer is the remote end).
type Peer struct {
	// Live is the peer's egress state of this connection: its snd_nxt,
	// its ack (= its rcv_nxt), its TSecr (= the failed node's last TSval
	// it accepted). Read it once the peer is quiet toward the failed node.
	Live ebpfprobes.FlowState
	// LiveAge is how old Live was when read (by the peer's monotonic
	// clock, FlowState.Age) plus the time it took to get here. PlanConn
	// refuses a connection with timestamps whose age is outside 0 to
	// MaxLiveAge.
	LiveAge time.Duration
	// Logged are the peer's logged bytes of this connection from the
	// snapshot's InqSeq on: what the peer sent after the snapshot's
	// receive point. It may run past Live.DataEnd(); the excess is unused.
	Logged []byte
}

// ConnPlan is the edit of one connection and the numbers behind it.
type ConnPlan struct {
	Conn ckpt.Conn
	// Inject are the peer's bytes the snapshot never received:
	// Logged[:Live.DataEnd()-InqSeq] (not a copy). They are appended to the
	// restored receive queue, whose end then matches the peer's snd_nxt.
	Inject []byte
	// Fin says the peer closed its side after the snapshot: its FIN follows Inject, and is delivered
	// after the restore (DeliverFIN; an image cannot hold it).
	Fin bool
	// Deferred says the connection's receive bytes are delivered after the restore, one receive call at
	// a time (intercept.Gate): Rewrite empties the snapshot's receive queue and injects nothing, and the
	// gate delivers the queue's bytes, then Inject, as the peer's segments.
	Deferred bool
	// Preload, for a Deferred connection, are the first of those bytes, which the restored queue holds
	// before the job runs (a gate replaying receive positions: what the job reads before its first
	// readiness call); the gate delivers the rest.
	Preload []byte
	// HasTimestamp says the connection uses TCP timestamps and Timestamp
	// must be set: at least Live.MinRestoredTimestamp(LiveAge +
	// TimestampMargin) and the snapshot's own value, even.
	HasTimestamp bool
	Timestamp    uint32
	// Resend is how many bytes past the snapshot's write_seq the peer
	// already has (Live.Ack - OutqSeq, 0 if none): the restored job
	// re-emits them (same program, same bytes, same sequence numbers) and
	// the peer discards them. Until the restored socket has re-sent them it
	// drops every segment of the peer ("ACK of unsent data"), so the
	// out-queue and the re-sent range must leave at once, without an ACK:
	// the fields below make room for that.
	Resend uint32
	// Segments is how many segments that burst may take: OutqLen+Resend
	// split by the segment size given to PlanConn, plus CwndMargin. The
	// spare's route needs an initial cwnd of at least that (Plan.InitCwnd).
	Segments int
	// SndWnd, MaxWindow (bytes) and SndBuf (SO_SNDBUF as getsockopt reports
	// it) are the least values that let the burst through; Rewrite raises
	// the image's values to them and never lowers one. 0 when nothing is
	// re-sent: the snapshot's own values carried its out-queue.
	SndWnd, MaxWindow, SndBuf uint32
}

// seqBefore is serial-number a < b (RFC 1982, as the kernel's before()).
func seqBefore(a, b uint32) bool { return int32(a-b) < 0 }

// PlanConn plans one connection. segBytes is the payload size to assume per
// re-sent segment: the restored socket's MSS for a program that writes at
// least that much at a time (or lets Nagle coalesce), its message size for
// one that writes small messages with TCP_NODELAY (each write then leaves
// as its own segment, and the initial cwnd and send buffer must count them
// all: with fewer, the socket stalls for good, measured). Note that a socket
// CRIU 4.2.1 restores on Linux 6.18 sends 524-byte segments whatever the
// path MTU (measured: ss shows mss:524 with pmtu:1500, TCP_MSS_DEFAULT less
// the timestamp option, computed at the repaired connect before CRIU
// restores mss_clamp) until LowerPathMTU's put-back makes it resync, so do
// not count on more than RestoredMSS.
//
// It is pure; all sequence arithmetic is modulo 2^32. Errors wrap
// ErrNotRecoverable: the peer reset the connection, never acknowledged
// anything, acknowledges less than the snapshot knows was acknowledged, sent
// less than the snapshot received, the log holds less than the peer sent, or
// the peer's live state is older than MaxLiveAge (or younger than 0).
func PlanConn(c ckpt.Conn, p Peer, segBytes int) (ConnPlan, error) {
	k := c.Tuple
	fail := func(format string, args ...any) (ConnPlan, error) {
		return ConnPlan{}, fmt.Errorf("connection %v (socket inode %d): %s: %w", k, c.Inode, fmt.Sprintf(format, args...), ErrNotRecoverable)
	}
	if segBytes <= 0 {
		return ConnPlan{}, fmt.Errorf("segment size %d: give at most RestoredMSS, or the program's message size", segBytes)
	}
	l := p.Live
	switch {
	case l.RstSent:
		return fail("the peer reset it (sent RST): there is nothing to restore; the peer's program gave up on it")
	case !l.HasAck:
		return fail("the peer's state has no ACK: it never acknowledged anything, so where it stands is unknown")
	}

	// Receive side: the restored queue must end where the peer's payload ends.
	dataEnd := l.DataEnd()
	inject := dataEnd - c.InqSeq
	if int32(inject) < 0 {
		if !(l.FinSent && l.SndNxt == c.InqSeq) { // the FIN is already in the snapshot: nothing to add
			return fail("the peer's data ends at sequence %d, %d bytes before the snapshot's receive point %d: the peer cannot have sent less than was received (wrong peer state or wrong snapshot)",
				dataEnd, -int32(inject), c.InqSeq)
		}
		inject = 0
	}
	if uint64(len(p.Logged)) < uint64(inject) {
		return fail("the peer sent %d bytes after the snapshot's receive point (sequence %d to %d) but its log holds only %d of them: the log was trimmed or lost",
			inject, c.InqSeq, dataEnd, len(p.Logged))
	}

	// Send side: the peer may hold bytes past the snapshot's write_seq.
	sndUna := c.OutqSeq - c.OutqLen
	if c.FinUnacked {
		// CRIU's outq_seq counts the FIN the program queued, its outq_len does not: the peer may still
		// stand at the first unacknowledged byte, one before.
		sndUna--
	}
	if seqBefore(l.Ack, sndUna) {
		return fail("the peer acknowledges up to sequence %d, %d bytes before what the snapshot knows it acknowledged (%d): inconsistent (wrong peer state or wrong snapshot)",
			l.Ack, sndUna-l.Ack, sndUna)
	}
	var resend uint32 // below 2^31: seqBefore says so
	if seqBefore(c.OutqSeq, l.Ack) {
		resend = l.Ack - c.OutqSeq
	}

	// The FIN is in the snapshot only if the socket had taken it in: rcv_nxt one past the data's end.
	cp := ConnPlan{Conn: c, Inject: p.Logged[:inject:inject], Resend: resend, Fin: l.FinSent && l.SndNxt != c.InqSeq}

	if l.HasTS {
		if c.Timestamp&1 != 0 {
			return fail("the snapshot's TCP timestamp %#x has the low bit set: the connection uses microsecond timestamps, which this restorer does not adjust", c.Timestamp)
		}
		if p.LiveAge < 0 || p.LiveAge > MaxLiveAge {
			// The restored clock starts at TSecr plus the age: past 2^31 ms it wraps behind TSecr, and the
			// peer's PAWS check would drop the restored socket's segments for good.
			return fail("the peer's host says its live state is %v old, not within 0 to %v: no timestamp can be trusted to be past what the peer saw (check that agent's version and clock)", p.LiveAge, MaxLiveAge)
		}
		ts := l.MinRestoredTimestamp(p.LiveAge + TimestampMargin)
		if seqBefore(ts, c.Timestamp) {
			ts = c.Timestamp
		}
		cp.HasTimestamp, cp.Timestamp = true, ts
	}

	burst := uint64(c.OutqLen) + uint64(resend)
	segs := (burst + uint64(segBytes) - 1) / uint64(segBytes)
	if segs > math.MaxInt32-CwndMargin {
		return fail("%d bytes must leave at once in %d-byte segments: more segments than a congestion window holds", burst, segBytes)
	}
	cp.Segments = int(segs) + CwndMargin
	if resend > 0 {
		wnd := burst + WindowMargin
		buf := 2*burst + uint64(cp.Segments)*SegmentOverhead + WindowMargin
		if wnd > math.MaxInt32 || buf > math.MaxInt32 {
			return fail("%d bytes must leave at once: the send window (%d) or buffer (%d) would exceed 2 GiB", burst, wnd, buf)
		}
		cp.SndWnd, cp.MaxWindow, cp.SndBuf = uint32(wnd), uint32(wnd), uint32(buf)
	}
	return cp, nil
}

// Plan is the edit of every connection of a snapshot.
type Plan struct {
	Conns []ConnPlan
	// InitCwnd is the initial congestion window, in segments, the spare's
	// routes need: the largest ConnPlan.Segments, at least MinInitCwnd.
	InitCwnd int
}

// NewPlan plans every connection of a snapshot with the peer state found
// under its key (see PlanConn for segBytes). The error joins the problem of
// every connection that cannot be planned, including those with no peer.
func NewPlan(conns []ckpt.Conn, peers map[tcpflow.Tuple]Peer, segBytes int) (Plan, error) {
	p := Plan{InitCwnd: MinInitCwnd}
	var errs []error
	seen := make(map[tcpflow.Tuple]bool, len(conns))
	for _, c := range conns {
		k := c.Tuple
		if seen[k] {
			errs = append(errs, fmt.Errorf("connection %v appears twice in the snapshot (inode %d): the manifest is inconsistent", k, c.Inode))
			continue
		}
		seen[k] = true
		peer, ok := peers[k]
		if !ok {
			errs = append(errs, fmt.Errorf("connection %v (socket inode %d): no state from the peer's agent: %w", k, c.Inode, ErrNotRecoverable))
			continue
		}
		cp, err := PlanConn(c, peer, segBytes)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		p.Conns = append(p.Conns, cp)
		p.InitCwnd = max(p.InitCwnd, cp.Segments)
	}
	if err := errors.Join(errs...); err != nil {
		return Plan{}, err
	}
	slices.SortFunc(p.Conns, func(a, b ConnPlan) int { return cmp.Compare(a.Conn.Inode, b.Conn.Inode) })
	return p, nil
}
