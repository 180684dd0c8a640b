// Package release decides when a sender may free the log of a finished connection: the
// receiver's trims (sender-based logging's GC) only release bytes that a snapshot covers, so a
// connection that closes, or whose receiving job ends, before a snapshot covers its last byte
// would otherwise stay in the log for good.
//
// A receiving node N computes a watermark W_N (ReceiveWatermark): the oldest, over its running
// jobs, of the creation time of the snapshot each would be restored from (its newest replicated
// one; a job without one counts from its start, because its first snapshot may be on its way);
// W_N is N's present moment if it runs no job. Any restore of a job on N then starts from a
// snapshot taken at or after W_N, and such a snapshot already holds every byte that reached N
// before it. So once sender P has finished sending on a connection to N (a FIN or a RST left,
// the sending socket is gone, or the sending job ended) and its last segment left more than a margin (the time a segment
// may spend in flight) before W_N, no restore can need the connection's log again: Decide
// frees it. Clocks differ between hosts, so N reports W_N as an age and P places it on its own
// clock, at the moment it sent the question (never later than W_N really was).
//
// The package holds only decisions; the agent gathers the facts and carries them out.
package release

import (
	"net/netip"
	"slices"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// DefaultMargin is how long before the watermark a connection's last segment must have left:
// a segment in flight (queued on the way, or still in the receiver's backlog) when the
// receiver dumped is not in its snapshot. A retransmission counts as a new segment, so the
// margin only covers queueing, which is far below a second.
const DefaultMargin = 3 * time.Second

// OrphanKeep bounds how long a finished flow to an address no alive member holds is kept: a failed node's
// jobs are restored within minutes of its failure (a restore after that finds the log gone and is refused,
// loudly), and an address that is no member's (a host outside the cluster) would have its flows kept for
// good, unbounded, each finished flow's bytes held until the log's cap stopped every sender of the host.
// It counts from when the flow became an orphan (Flow.OrphanSince) as well as from its last segment: a
// flow held for a receiver whose restore point is older than an hour (interval auto, or snapshots that
// kept failing) must survive its receiver's failure until the restore that follows it.
const OrphanKeep = time.Hour

// Flow is what the sender knows about one logged connection.
type Flow struct {
	// Node is the member that holds the destination address now ("" if no alive member does).
	Node string
	// Conn is the logged connection seen from the sender (Remote is the receiving end).
	Conn tcpflow.Tuple
	// HasState says the eBPF flow state below is known (it is kept for the most recently
	// active flows only).
	HasState bool
	// FinSent, RstSent: the sender sent a FIN (no byte follows it) or a RST (it aborted).
	FinSent, RstSent bool
	// StateAge is how long ago the flow's last egress segment (of any kind) left.
	StateAge time.Duration
	// SenderGone says the sending job ended: its sockets are closed, nothing more is logged.
	SenderGone bool
	// SocketGone says the flow's sending socket no longer exists (sock_diag found none where it lived)
	// while its job runs on: nothing more is sent on it. Asked of flows without a flow state only: the
	// state says FIN or RST sooner, and its eviction (more active flows than the probe keeps) left a
	// finished flow open until its job ended.
	SocketGone bool
	// SentAge is how long ago the newest logged segment of the flow left (from its record's
	// kernel timestamp); valid if HasSentAge.
	SentAge    time.Duration
	HasSentAge bool
	// LastAppend is when the log was last offered a segment of the flow (zero if never): later
	// than the segment left, by the time its record waited in the ring buffer. Used when the
	// records carry no timestamp.
	LastAppend time.Time
	// OrphanSince is when the sender first found no alive member holding the destination (Node "") in
	// the run of decisions that still finds none; zero: now.
	OrphanSince time.Time
}

// Finished reports whether the sender will log no new byte on the flow.
func (f Flow) Finished() bool {
	return f.HasState && (f.FinSent || f.RstSent) || f.SenderGone || f.SocketGone
}

// lastSent is the latest moment the sender is known to have transmitted on the flow, by its
// own clock: the later of the newest logged segment (its record's timestamp, else the append,
// which follows the transmission) and the flow state's last segment of any kind.
func (f Flow) lastSent(now time.Time) time.Time {
	t := f.LastAppend
	if f.HasSentAge {
		t = now.Add(-max(f.SentAge, 0))
	}
	if f.HasState {
		if s := now.Add(-max(f.StateAge, 0)); s.After(t) {
			t = s
		}
	}
	return t
}

// Watermark is a receiving node's answer, placed on the sender's clock.
type Watermark struct {
	// At: every restore of a job on the node starts from a snapshot taken at or after At.
	At time.Time
	// Held says a running job of the node holds At back: a snapshot there would advance it.
	// If false the node ran no job and At is the moment it answered.
	Held bool
	// Addrs are the addresses the node held when it answered. At says nothing about a job
	// that arrived with another address later (a failed node's jobs restored there), so it
	// applies only to flows to these addresses.
	Addrs []netip.Addr
}

// covers reports whether w applies to flows to dst.
func (w Watermark) covers(dst netip.Addr) bool { return slices.Contains(w.Addrs, dst.Unmap()) }

// Verdict is what to do with one flow's log.
type Verdict int

const (
	// Open: the sender may still send; the receiver's trims release the log, as before.
	Open Verdict = iota
	// Orphan: finished, but no alive member holds the destination address (its node failed and
	// a spare has not taken it over yet, or it is no member's): kept for the restore that may follow,
	// for OrphanKeep after its last segment.
	Orphan
	// Unknown: finished, but no watermark of the receiving node covers the destination yet.
	Unknown
	// Held: finished, but the receiving node's oldest restorable snapshot is older than the
	// last segment (plus the margin): a snapshot there would let it go.
	Held
	// Settling: finished, the receiving node holds nothing back, but the last segment is too
	// recent: the next watermark frees it.
	Settling
	// Free: no restore can need the log any more: remove it.
	Free
)

var verdictNames = [...]string{"open", "orphan", "awaiting-watermark", "held-by-receiver-snapshot", "settling", "free"}

func (v Verdict) String() string {
	if int(v) < len(verdictNames) {
		return verdictNames[v]
	}
	return "invalid"
}

// SnapshotHelps reports whether a snapshot of the receiving node would free the flow's log:
// only such flows count when the log controller picks nodes to ask for a snapshot. A finished
// flow that waits for time or for an answer does not: a node whose jobs are gone cannot trim
// anything by snapshotting.
func (v Verdict) SnapshotHelps() bool { return v == Open || v == Held }

// Decision is the verdict on one flow.
type Decision struct {
	Verdict Verdict
	// Ask says a watermark fetched now could free the flow: ask its node (the caller
	// rate-limits the questions).
	Ask bool
}

// Input is everything Decide needs.
type Input struct {
	Now    time.Time
	Margin time.Duration // DefaultMargin if 0
	Flows  []Flow
	// Marks holds the latest watermark of each node that answered.
	Marks map[string]Watermark
}

// Decide returns the decision on each flow of in.Flows, in order.
func Decide(in Input) []Decision {
	margin := in.Margin
	if margin <= 0 {
		margin = DefaultMargin
	}
	out := make([]Decision, len(in.Flows))
	for i, f := range in.Flows {
		out[i] = decide(f, in.Marks, in.Now, margin)
	}
	return out
}

func decide(f Flow, marks map[string]Watermark, now time.Time, margin time.Duration) Decision {
	if !f.Finished() {
		return Decision{Verdict: Open}
	}
	last := f.lastSent(now)
	if f.Node == "" {
		// From the orphaning too, not the last segment alone: a flow whose receiver's restore point was
		// older than OrphanKeep (Held) was freed the moment its receiver failed, and the restore refused.
		since := f.OrphanSince
		if since.IsZero() {
			since = now
		}
		if !last.IsZero() && now.Sub(last) >= OrphanKeep && now.Sub(since) >= OrphanKeep {
			return Decision{Verdict: Free}
		}
		return Decision{Verdict: Orphan}
	}
	if last.IsZero() {
		return Decision{Verdict: Unknown} // nothing says when it last sent: never free it
	}
	needed := last.Add(margin) // a snapshot taken at or after this holds everything sent
	// Even a watermark of "now" can free the flow only once the margin has passed.
	ask := !needed.After(now)
	w, ok := marks[f.Node]
	if !ok || !w.covers(f.Conn.Remote.Addr()) {
		return Decision{Verdict: Unknown, Ask: ask}
	}
	if !needed.After(w.At) {
		return Decision{Verdict: Free}
	}
	if w.Held {
		return Decision{Verdict: Held, Ask: ask}
	}
	return Decision{Verdict: Settling, Ask: ask}
}

// Job is one job of the receiving node, as its watermark needs it.
type Job struct {
	Running bool
	// Started is when the job was created: any snapshot of it is younger.
	Started time.Time
	// Replicated is the creation time of its newest snapshot that another node holds (the one
	// a restore would use); zero if it has none.
	Replicated time.Time
}

// ReceiveWatermark returns the receiving node's watermark: the oldest restore point of its
// running jobs, and whether any running job holds it (if none does, it is now).
//
// A running job without a replicated snapshot counts from its start: a snapshot of it may be
// on its way to the protector right now, and once there it would be the restore point. Jobs
// that ended count no more: the restorer restores running jobs of a failed node only.
func ReceiveWatermark(now time.Time, jobs []Job) (time.Time, bool) {
	w, held := now, false
	for _, j := range jobs {
		if !j.Running {
			continue
		}
		at := j.Replicated
		if at.IsZero() {
			at = j.Started
		}
		if at.Before(w) {
			w = at
		}
		held = true
	}
	return w, held
}
