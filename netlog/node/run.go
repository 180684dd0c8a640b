package node

import (
	"context"
	"errors"
	"maps"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/netlog/controller"
	"github.com/ftkit/ftkit/netlog/release"
	"github.com/ftkit/ftkit/tcpflow"
)

// Run runs the resource controller until ctx ends: measure, decide, act, every 250 ms, on multiples of
// 250 ms (tickgrid), so that every other round wakes the agent with its loops on 100 ms grids.
func (n *Node) Run(ctx context.Context) {
	tickgrid.Every(ctx, 250*time.Millisecond, func() { n.step(ctx, time.Now()) })
}

// step is one round of the controller at now.
func (n *Node) step(ctx context.Context, now time.Time) {
	l := n.Log()
	verdicts := n.releaseFinished(ctx, l, now)
	bytesBy := map[string]int64{}
	for _, conn := range l.Conns() {
		if v, ok := verdicts[conn]; ok && !v.SnapshotHelps() {
			continue // finished: a snapshot of its receiver would not free it (the stall)
		}
		st, err := l.ConnStats(conn)
		if err != nil {
			continue
		}
		if node := n.cfg.Members.Owner(conn.Remote.Addr()); node != "" {
			bytesBy[node] += st.MemoryBytes()
		}
	}
	// The consumer's pause is the cap: it stops short of it by one append's worst case.
	cnt, err := n.src.Counters()
	paused := err == nil && cnt.ConsumerPaused
	n.mu.Lock()
	var dests []controller.Destination
	for node, b := range bytesBy {
		if _, ok := n.seen[node]; !ok {
			n.seen[node] = now
		}
		dests = append(dests, controller.Destination{Node: node, Bytes: b, Oldest: n.seen[node]})
	}
	act, events := n.ctl.Step(controller.State{Now: now, Memory: l.Stats().LiveBytes(), Destinations: dests, CanSpill: n.cfg.CanSpill, Paused: paused})
	n.mu.Unlock()
	for _, node := range act.RequestSnapshots {
		go n.RequestSnapshot(ctx, node)
	}
	n.checkHoles(ctx, now)
	// Age compresses old slabs, spills when the controller says so (only then: the receivers' snapshots
	// come first; the periodic pass spilled at the low watermark before any was asked for), and hands
	// slab buffers that were not reused since the last call back to the heap.
	switch {
	case act.SpillBytes > 0:
		n.aged = now
		if _, err := l.Age(ctx, now); err != nil {
			n.log.Error("age the log (compress, spill)", "err", err)
		}
	case now.Sub(n.aged) > 5*time.Second:
		n.aged = now
		if _, err := l.Compress(ctx, now); err != nil {
			n.log.Error("age the log (compress)", "err", err)
		}
	}
	if len(events) > 0 {
		n.addEvents(events)
		for _, e := range events {
			n.cfg.Event(e.Kind)
			n.log.Info("log controller", "event", e.Kind, "node", e.Node, "bytes", e.Bytes, "memory", e.Memory)
		}
	}
}

// RequestSnapshot asks member node to snapshot its jobs now, so that this host can trim its log; a
// failure is logged (the controller asks again at the next pressure).
func (n *Node) RequestSnapshot(ctx context.Context, node string) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := n.cfg.Members.RequestSnapshot(cctx, node); err != nil {
		n.log.Warn("could not ask for a snapshot", "node", node, "err", err)
	}
}

// EventHole is the log event of a new hole: every other member was asked for a snapshot.
const EventHole controller.EventKind = "hole-snapshots-requested"

// A log that keeps losing bytes (IP fragments on a path with a small MTU, a consumer that stalls again and
// again) asks every member for a snapshot at most every holeAskEvery, a gap that doubles, up to
// holeAskMax, while the losses go on: every member's snapshots every 5 s would load the whole cluster.
const (
	holeAskEvery = 5 * time.Second
	holeAskMax   = 5 * time.Minute
)

// holes counts what was sent but never reached the log: segments passed unlogged (IP fragments; segments
// passed while the consumer was gone, a stopped or hung agent), records the consumer rejected or could
// not append, and parked clones lost.
func holes(c capture.Counters) uint64 {
	return c.FragmentsPassed + c.UnloggedPassed + c.BadRecords + c.AppendErrors + c.ParkLost
}

// checkHoles asks every other member for a snapshot when the log has lost bytes since it last asked. A
// recovery that needs bytes of a hole is refused (netlog.ErrHole) until the receiver's next snapshot
// covers them; asking now shortens that spell from a checkpoint interval to a snapshot's time. Which
// receivers the lost bytes were for is not known (a segment passed unlogged leaves no record), so every
// member is asked. The same for the receive tap's holes (Config.ReceiveHoles), which the senders'
// snapshots cure.
func (n *Node) checkHoles(ctx context.Context, now time.Time) {
	c, err := n.src.Counters()
	if err != nil {
		return
	}
	recv := n.cfg.ReceiveHoles()
	h := holes(c) + recv
	n.mu.Lock()
	since := now.Sub(n.holesAsked)
	if h <= n.holes || since < n.holeGap {
		n.mu.Unlock()
		return
	}
	if since < 2*n.holeGap {
		n.holeGap = min(2*n.holeGap, holeAskMax) // lost again soon after the last request
	} else {
		n.holeGap = holeAskEvery
	}
	lost := h - n.holes
	n.holes, n.holesAsked = h, now
	n.mu.Unlock()
	others := n.cfg.Members.Others()
	n.log.Error("the sender-side log lost bytes, or the receive tap left some unrecorded: recoveries of their receivers, or of their senders, are refused until their next snapshots; asking every member to snapshot now",
		"lost", lost, "fragments_passed", c.FragmentsPassed, "unlogged_passed", c.UnloggedPassed, "bad_records", c.BadRecords,
		"append_errors", c.AppendErrors, "park_lost", c.ParkLost, "received_unrecorded", recv, "members", others)
	n.addEvents([]controller.Event{{Time: now, Kind: EventHole, Memory: c.MemoryBytes}})
	n.cfg.Event(EventHole)
	for _, node := range others {
		go n.RequestSnapshot(ctx, node)
	}
}

// Freeing the logs of finished connections (netlog/release): a connection that closes, or whose receiving
// job ends, before a receiver's snapshot covers its last byte is never trimmed. Each receiving node tells
// its senders, when asked, how old its oldest restore point is; a sender frees a finished connection whose
// last segment left before that point.

const (
	// watermarkEvery bounds how often one receiving node is asked for its watermark.
	watermarkEvery = 2 * time.Second
	// EventReleased is the log event of freed connections (shown by `ftctl status`).
	EventReleased controller.EventKind = "finished-conns-freed"
	// A connection without a flow state has its socket looked up (Config.SocketGone) at most every
	// goneEvery, and a round looks up at most goneLookups: beyond the probe's 65,536 live flows there may
	// be as many idle ones again, and a lookup in a job network enters its namespace.
	goneEvery   = 10 * time.Second
	goneLookups = 64
)

// goneCheck is a lookup of a connection's sending socket: when, and whether it was gone.
type goneCheck struct {
	at   time.Time
	gone bool
}

// releaseFinished frees the logs no restore can need any more and returns the decision on every
// connection it kept. It asks the receiving nodes for their watermarks when that could free something.
func (n *Node) releaseFinished(ctx context.Context, l *netlog.Log, now time.Time) map[tcpflow.Tuple]release.Verdict {
	var (
		conns []tcpflow.Tuple
		acts  []netlog.Activity
		flows []release.Flow
	)
	checks := make(map[tcpflow.Tuple]goneCheck, len(n.gone))
	orphans := make(map[tcpflow.Tuple]time.Time, len(n.orphans))
	type dueCheck struct {
		i  int       // in flows
		at time.Time // the last lookup, zero if none
	}
	var due []dueCheck
	for _, c := range l.Conns() {
		act, err := l.Activity(c)
		if err != nil {
			continue // removed meanwhile
		}
		f := release.Flow{Node: n.cfg.Members.Owner(c.Remote.Addr()), Conn: c, LastAppend: act.LastAppend,
			SenderGone: act.CgroupID != 0 && !n.src.Protects(act.CgroupID)}
		if act.LastKtimeNs != 0 {
			f.SentAge, f.HasSentAge = sinceKtime(act.LastKtimeNs)
		}
		if f.Node == "" {
			// OrphanKeep counts from here too: its receiver's node may have failed just now.
			since, ok := n.orphans[c]
			if !ok {
				since = now
			}
			orphans[c], f.OrphanSince = since, since
		}
		if fs, ok, err := n.src.FlowState(c); err == nil && ok {
			if age, err := fs.Age(); err == nil {
				f.HasState, f.FinSent, f.RstSent, f.StateAge = true, fs.FinSent, fs.RstSent, age
			}
		}
		if !f.HasState && !f.SenderGone && n.cfg.SocketGone != nil {
			// The capture evicted its flow state: only the socket tells a finished flow from an idle one.
			g, ok := n.gone[c]
			if ok {
				checks[c] = g
				f.SocketGone = g.gone && !act.LastAppend.After(g.at)
			}
			// Within the margin of its last append no watermark could free it: not looked up yet.
			if (!ok || now.Sub(g.at) >= goneEvery) && now.Sub(act.LastAppend) >= release.DefaultMargin {
				due = append(due, dueCheck{i: len(flows), at: g.at})
			}
		}
		conns, acts, flows = append(conns, c), append(acts, act), append(flows, f)
	}
	// The longest unchecked first: in Conns' order, the first 2,560 (goneLookups a round of 250 ms, over
	// goneEvery) would take every lookup, and the others would never be looked up.
	slices.SortStableFunc(due, func(a, b dueCheck) int { return a.at.Compare(b.at) })
	for _, d := range due[:min(len(due), goneLookups)] {
		c := conns[d.i]
		gone, err := n.cfg.SocketGone(c)
		if err != nil {
			n.log.Debug("cannot tell whether a connection's sending socket is gone; its log stays until it is known", "conn", c, "err", err)
		}
		g := goneCheck{at: now, gone: err == nil && gone}
		checks[c] = g
		// A segment appended since the lookup came from a socket (one of the tuple's again).
		flows[d.i].SocketGone = g.gone && !acts[d.i].LastAppend.After(g.at)
	}
	n.gone = checks     // forgets the connections the log no longer holds
	n.orphans = orphans // and those whose destination a member holds again
	n.mu.Lock()
	marks := maps.Clone(n.marks)
	n.mu.Unlock()
	decisions := release.Decide(release.Input{Now: now, Margin: release.DefaultMargin, Flows: flows, Marks: marks})

	verdicts := make(map[tcpflow.Tuple]release.Verdict, len(conns))
	type tally struct {
		conns int64
		bytes int64
	}
	freed := map[string]*tally{}
	ask := map[string]bool{}
	for i, d := range decisions {
		c, node := conns[i], flows[i].Node
		if d.Ask {
			ask[node] = true
		}
		if d.Verdict != release.Free {
			verdicts[c] = d.Verdict
			continue
		}
		ok, st, err := l.RemoveIdle(c, acts[i].LastAppend)
		if err != nil && !errors.Is(err, netlog.ErrUnknownConn) {
			n.log.Warn("free the log of a finished connection", "conn", c, "err", err)
		}
		if !ok {
			verdicts[c] = release.Open // it sent again since we looked: decide again next time
			continue
		}
		if freed[node] == nil {
			freed[node] = &tally{}
		}
		freed[node].conns++
		freed[node].bytes += st.RetainedBytes
	}

	n.mu.Lock()
	n.verdicts = verdicts
	for node, t := range freed {
		n.released.Conns += t.conns
		n.released.Bytes += t.bytes
		// Like a trim: the node's next pressure may ask it for a snapshot at once. A request made while
		// the connection was open may have found its job gone (and failed); waiting out the controller's
		// cooldown would leave the node's next job unrelieved at the cap.
		n.ctl.Relieved(node)
	}
	for node := range ask {
		if n.asking[node] || now.Sub(n.asked[node]) < watermarkEvery {
			continue
		}
		n.asking[node], n.asked[node] = true, now
		go n.askWatermark(ctx, node)
	}
	n.mu.Unlock()

	if len(freed) > 0 {
		mem := l.Stats().LiveBytes()
		var events []controller.Event
		for node, t := range freed {
			events = append(events, controller.Event{Time: now, Kind: EventReleased, Node: node, Bytes: t.bytes, Memory: mem})
			n.cfg.Event(EventReleased)
			n.log.Info("freed the log of finished connections", "node", node, "conns", t.conns, "bytes", t.bytes)
		}
		n.addEvents(events)
	}
	return verdicts
}

// sinceKtime is how long ago the probe's timestamp ns (bpf_ktime_get_ns: CLOCK_MONOTONIC) was.
func sinceKtime(ns uint64) (time.Duration, bool) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0, false
	}
	return time.Duration(ts.Nano() - int64(ns)), true
}

// askWatermark fetches node's watermark and keeps it for releaseFinished. Without an answer the node's
// watermark is forgotten: nothing destined for it is freed until it answers again.
func (n *Node) askWatermark(ctx context.Context, node string) {
	w, err := n.cfg.Members.Watermark(ctx, node)
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.asking, node)
	if err != nil {
		delete(n.marks, node)
		n.log.Debug("no log watermark from a receiving node; its finished connections stay logged", "node", node, "err", err)
		return
	}
	n.marks[node] = w
}
