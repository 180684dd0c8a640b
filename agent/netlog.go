package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/netlog/controller"
	"github.com/ftkit/ftkit/netlog/release"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

// logState is the agent's sender-side log: the eBPF capture, its resource controller, and recent events.
type logState struct {
	cap *capture.Capture
	ctl *controller.Controller
	// What this host's protected sockets received, to check a restored peer's re-sent bytes (received.go).
	tap      *ebpfprobes.RecvTap
	book     *recvdigest.Book
	recorder *recvdigest.Recorder
	mu       sync.Mutex
	ev       []controller.Event   // the last maxEvents decisions, for `ftctl status`
	seen     map[string]time.Time // destination node -> when its log data was last trimmed (or first seen)
	aged     time.Time            // last Age of the log (controlLog only)
	// lo logs only the flows a recovery asks for: what a job restored next to its peers (basic mode)
	// re-sends to them over loopback, to check it (received.go). It exists only while loUsers > 0.
	lo      *capture.Capture
	loUsers int

	// Freeing finished connections (releaseFinished).
	marks    map[string]release.Watermark      // receiving node -> its latest watermark, on our clock
	asked    map[string]time.Time              // receiving node -> when we last asked it for its watermark
	asking   map[string]bool                   // a question to that node is in flight
	verdicts map[tcpflow.Tuple]release.Verdict // the last decision on each logged connection
	released ReleaseCounters
}

// ReleaseCounters count the logs of finished connections freed since the agent started.
type ReleaseCounters struct {
	Conns int64 `json:"conns"`
	Bytes int64 `json:"bytes"` // logged bytes they still retained
}

const maxEvents = 50

// startLog attaches the probe to the cluster interface (in this agent's network namespace).
func (a *Agent) startLog() error {
	lc := a.cfg.Log
	iface := lc.Interface
	if iface == "" {
		var err error
		if iface, err = interfaceOf(a.cfg.Cluster.Listen.Addr()); err != nil {
			return err
		}
	}
	capMiB := lc.MemoryMiB
	if capMiB == 0 {
		capMiB = int(memTotalMiB() / 10)
	}
	capBytes := int64(capMiB) << 20
	opts := netlog.Options{Logger: a.log}
	if lc.SpillDir != "" {
		opts.SpillDir = lc.SpillDir
		opts.SpillAboveRAM = int64(float64(capBytes) * lc.Low)
	}
	c, err := capture.New(capture.Options{Interface: iface, RingBufferSize: lc.RingMiB << 20, Log: opts, Logger: a.log, MemoryCap: capBytes})
	if err != nil {
		return fmt.Errorf("start the sender-side log on %s: %w", iface, err)
	}
	ctl, err := controller.New(controller.Config{Cap: capBytes, High: lc.High, Low: lc.Low})
	if err != nil {
		c.Close()
		return err
	}
	tap, book, recorder, err := a.startReceiveDigests()
	if err != nil {
		c.Close()
		return err
	}
	a.netlog = &logState{cap: c, ctl: ctl, tap: tap, book: book, recorder: recorder, seen: map[string]time.Time{},
		marks: map[string]release.Watermark{}, asked: map[string]time.Time{}, asking: map[string]bool{}}
	a.log.Info("sender-side log attached", "interface", iface, "ring_mib", lc.RingMiB, "memory_cap_mib", capMiB)
	return nil
}

// interfaceOf names the interface that holds addr in this network namespace.
func interfaceOf(addr netip.Addr) (string, error) {
	name, _, err := hostInterface(addr)
	return name, err
}

// hostInterface finds the interface that holds addr and the prefix addr has on it.
func hostInterface(addr netip.Addr) (string, netip.Prefix, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return "", netip.Prefix{}, err
	}
	for _, x := range addrs {
		if ip, ok := netip.AddrFromSlice(x.IP); ok && ip.Unmap() == addr {
			l, err := netlink.LinkByIndex(x.LinkIndex)
			if err != nil {
				return "", netip.Prefix{}, err
			}
			bits, _ := x.Mask.Size()
			return l.Attrs().Name, netip.PrefixFrom(addr, bits), nil
		}
	}
	return "", netip.Prefix{}, fmt.Errorf("no interface holds the cluster address %s; set log.interface", addr)
}

func memTotalMiB() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 1024
	}
	var kb int64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "MemTotal:") {
			fmt.Sscanf(strings.TrimPrefix(line, "MemTotal:"), "%d", &kb)
		}
	}
	return kb / 1024
}

func (a *Agent) protect(j *Job) {
	if a.netlog == nil {
		return
	}
	if err := a.netlog.cap.ProtectCgroup(j.Cgroup); err != nil {
		a.log.Error("job's traffic is not logged", "job", j.ID, "err", err)
	}
	if err := a.netlog.tap.AttachCgroup(j.Cgroup); err != nil {
		a.log.Error("what the job receives is not recorded: a restored peer's re-sent bytes cannot be checked", "job", j.ID, "err", err)
	}
}

func (a *Agent) unprotect(j *Job) {
	if a.netlog == nil {
		return
	}
	if err := a.netlog.cap.UnprotectCgroup(j.Cgroup); err != nil && !errors.Is(err, os.ErrNotExist) {
		a.log.Debug("unprotect job cgroup", "job", j.ID, "err", err)
	}
	if err := a.netlog.tap.DetachCgroup(j.Cgroup); err != nil && !errors.Is(err, os.ErrNotExist) {
		a.log.Debug("detach the receive tap from the job cgroup", "job", j.ID, "err", err)
	}
}

// announceReceivePoints tells every sender of bytes to the snapshotted job where its new durable snapshot
// starts receiving, so that each sender drops the log data before it (sender-based logging's GC).
func (a *Agent) announceReceivePoints(ctx context.Context, m *ckpt.Manifest) {
	byPeer := map[string][]TrimPoint{}
	for _, c := range m.Conns {
		peer := a.memberByIP(c.Remote.Addr())
		if peer == "" || peer == a.cfg.Name {
			continue // not cluster traffic, or traffic inside this host (never logged)
		}
		byPeer[peer] = append(byPeer[peer], TrimPoint{Tuple: c.Reverse(), Seq: c.InqSeq})
	}
	for peer, pts := range byPeer {
		if err := a.sendTrim(ctx, peer, pts); err != nil {
			// Not fatal: the peer keeps the data a little longer and trims at the next snapshot.
			a.log.Warn("could not tell a sender to trim its log", "peer", peer, "snapshot", m.ID, "err", err)
		}
	}
}

// maxTrimPoints bounds one trim request; a snapshot with more connections to one peer is announced in
// several.
const maxTrimPoints = clusterapi.MaxTrimPoints

func (a *Agent) sendTrim(ctx context.Context, peer string, pts []TrimPoint) error {
	for len(pts) > 0 {
		n := min(len(pts), maxTrimPoints)
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := a.peers().Trim(cctx, peer, clusterapi.TrimRequest{Points: pts[:n]})
		cancel()
		if err != nil {
			return err
		}
		pts = pts[n:]
	}
	return nil
}

// serveTrim drops log data the caller's snapshot covers (the protocol bounds the points).
func (a *Agent) serveTrim(peer string, pts []TrimPoint) clusterapi.TrimReply {
	own, foreign := ownTrimPoints(pts, peer, a.memberByIP)
	if foreign > 0 {
		a.log.Warn("trim refused for connections the peer does not hold: a member may only release data destined for itself",
			"peer", peer, "refused", foreign, "accepted", len(own))
	}
	n := 0
	if a.netlog != nil {
		for _, p := range own {
			// Down to the start of the receive-digest block: a snapshot of ours taken meanwhile may need
			// the bytes before its write_seq in that block (sentPrefix).
			if _, err := a.netlog.cap.Log().Trim(p.Tuple, recvdigest.BlockStart(p.Seq)); err == nil {
				n++
			}
		}
		a.netlog.mu.Lock()
		a.netlog.seen[peer] = time.Now()
		a.netlog.ctl.Relieved(peer)
		a.netlog.mu.Unlock()
	}
	return clusterapi.TrimReply{Trimmed: n}
}

// ownTrimPoints keeps the points whose receiving end (Dst) member peer holds now (owner names the member
// that holds an address), and counts the others.
func ownTrimPoints(pts []TrimPoint, peer string, owner func(netip.Addr) string) (own []TrimPoint, foreign int) {
	for _, p := range pts {
		if !p.Remote.IsValid() || owner(p.Remote.Addr()) != peer {
			foreign++
			continue
		}
		own = append(own, p)
	}
	return own, foreign
}

// maxLogRange bounds one log range (clusterapi.MaxLogRange says why). The log's memory cap is no bound:
// compressed and spilled slabs hold more raw bytes than the cap.
const maxLogRange = clusterapi.MaxLogRange

// serveLogRange streams the logged bytes of one connection from a sequence number to the highest
// contiguous byte, for the restorer: the reply, and the function that writes its bytes.
func (a *Agent) serveLogRange(ctx context.Context, peer string, req LogRangeRequest) (LogRangeReply, func(io.Writer) error, error) {
	if a.netlog == nil {
		return LogRangeReply{}, nil, errors.New("the sender-side log is disabled on " + a.cfg.Name)
	}
	l := a.netlog.cap.Log()
	conn := req.Tuple
	if live, ok := sentNothingSince(a.netlog.cap, conn, req.From); ok {
		// A one-way stream toward the restored job (or a peer that has been silent since the snapshot):
		// nothing logged because nothing was sent, which the live state shows; nothing to replay.
		age, _ := live.Age()
		return LogRangeReply{From: req.From, Live: &live, LiveAge: age}, nil, nil
	}
	from, err := l.Unwrap(conn, req.From)
	var b netlog.Bounds
	if err == nil {
		b, err = l.Bounds(conn)
	}
	if err != nil {
		return LogRangeReply{}, nil, err
	}
	to := b.Contiguous
	if to < from {
		to = from
	}
	if to-from > maxLogRange {
		return LogRangeReply{}, nil, (fmt.Errorf("%d logged bytes of %s from sequence %d: more than the %d one range may carry", to-from, conn, req.From, int64(maxLogRange)))
	}
	st, err := l.Store(conn)
	if err == nil {
		err = st.Check(from, to) // a hole or trimmed data is refused before any byte is sent
	}
	if err != nil {
		return LogRangeReply{}, nil, err
	}
	reply := LogRangeReply{From: req.From, Len: int64(to - from)}
	if fs, ok, err := a.netlog.cap.FlowState(conn); err == nil && ok {
		reply.Live = &fs
		reply.LiveAge, _ = fs.Age()
	}
	// The range may be large: the server writes it as long as the caller keeps reading.
	return reply, func(w io.Writer) error {
		if _, err := l.WriteRange(ctx, w, conn, from, to); err != nil {
			return fmt.Errorf("log range of %s to %s cut short: %w", conn, peer, err)
		}
		return nil
	}, nil
}

// sentNothingSince says whether this host's log has no store of conn because the sender sent no payload
// on it after wire sequence from: the live state's data end is exactly there. A store that exists, or a
// live state that went further, are for the log to answer (bytes, or a hole it names).
func sentNothingSince(c *capture.Capture, conn tcpflow.Tuple, from uint32) (ebpfprobes.FlowState, bool) {
	if _, err := c.Log().Bounds(conn); !errors.Is(err, netlog.ErrUnknownConn) {
		return ebpfprobes.FlowState{}, false
	}
	live, ok, err := c.FlowState(conn)
	if err != nil || !ok || live.DataEnd() != from {
		return ebpfprobes.FlowState{}, false
	}
	return live, true
}

// LogRange fetches from member peer the bytes it logged on src->dst from sequence from on, with the
// peer's live state of the connection.
func (a *Agent) LogRange(ctx context.Context, peer string, req LogRangeRequest) (LogRangeReply, []byte, error) {
	return a.peers().LogRange(ctx, peer, req)
}

// controlLog runs the resource controller: measure, decide, act.
func (a *Agent) controlLog(ctx context.Context) {
	if a.netlog == nil {
		return
	}
	every(ctx, 250*time.Millisecond, func() {
		l := a.netlog.cap.Log()
		now := time.Now()
		verdicts := a.releaseFinished(ctx, l, now)
		bytesBy := map[string]int64{}
		for _, conn := range l.Conns() {
			if v, ok := verdicts[conn]; ok && !v.SnapshotHelps() {
				continue // finished: a snapshot of its receiver would not free it (the stall)
			}
			st, err := l.ConnStats(conn)
			if err != nil {
				continue
			}
			if node := a.memberByIP(conn.Remote.Addr()); node != "" {
				bytesBy[node] += st.MemoryBytes()
			}
		}
		a.netlog.mu.Lock()
		var dests []controller.Destination
		for node, n := range bytesBy {
			if _, ok := a.netlog.seen[node]; !ok {
				a.netlog.seen[node] = now
			}
			dests = append(dests, controller.Destination{Node: node, Bytes: n, Oldest: a.netlog.seen[node]})
		}
		act, events := a.netlog.ctl.Step(controller.State{Now: now, Memory: l.Stats().LiveBytes(), Destinations: dests, CanSpill: a.cfg.Log.SpillDir != ""})
		a.netlog.mu.Unlock()
		for _, node := range act.RequestSnapshots {
			go a.requestSnapshot(ctx, node)
		}
		// Age compresses old slabs, spills when the controller says so, and hands slab buffers that
		// were not reused since the last call back to the heap.
		if act.SpillBytes > 0 || now.Sub(a.netlog.aged) > 5*time.Second {
			a.netlog.aged = now
			if _, err := l.Age(ctx, now); err != nil {
				a.log.Error("age the log (compress, spill)", "err", err)
			}
		}
		if len(events) > 0 {
			a.netlog.mu.Lock()
			a.netlog.ev = append(a.netlog.ev, events...)
			if len(a.netlog.ev) > maxEvents {
				a.netlog.ev = a.netlog.ev[len(a.netlog.ev)-maxEvents:]
			}
			a.netlog.mu.Unlock()
			for _, e := range events {
				a.metrics.ControllerEvent(string(e.Kind))
				a.log.Info("log controller", "event", e.Kind, "node", e.Node, "bytes", e.Bytes, "memory", e.Memory)
			}
		}
	})
}

// requestSnapshot asks member node to snapshot its jobs now, so that this node can trim its log.
func (a *Agent) requestSnapshot(ctx context.Context, node string) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := a.peers().CheckpointNow(cctx, node); err != nil {
		a.log.Warn("could not ask for a snapshot", "node", node, "err", err)
	}
}

// LogStatus is the log part of the agent's status.
type LogStatus struct {
	Counters capture.Counters   `json:"counters"`
	CapBytes int64              `json:"cap_bytes"`
	Events   []controller.Event `json:"events"`
	Released ReleaseCounters    `json:"released"` // logs of finished connections freed
	Received ReceiveStatus      `json:"received"`
}

// ReceiveStatus is this host's record of what its protected sockets received (received.go): the book the
// check of a restored peer's re-sent bytes reads, and the tap that feeds it.
type ReceiveStatus struct {
	Book    recvdigest.BookStats    `json:"book"`
	Tap     ebpfprobes.RecvCounters `json:"tap"`
	Records uint64                  `json:"records"`
	// Error is why the recorder stopped: from then on every recovery of a peer is refused as unverifiable.
	Error string `json:"error,omitempty"`
}

func (a *Agent) logStatus() *LogStatus {
	if a.netlog == nil {
		return nil
	}
	cnt, _ := a.netlog.cap.Counters()
	rs := ReceiveStatus{Book: a.netlog.book.Stats(), Records: a.netlog.recorder.Stats().Records, Error: errString(a.netlog.recorder.Err())}
	rs.Tap, _ = a.netlog.tap.Counters()
	a.netlog.mu.Lock()
	defer a.netlog.mu.Unlock()
	return &LogStatus{Counters: cnt, CapBytes: a.netlog.ctl.Config().Cap, Events: append([]controller.Event(nil), a.netlog.ev...),
		Released: a.netlog.released, Received: rs}
}

// LoggedConn describes what the log holds for one connection, in wire (32-bit) sequence numbers.
type LoggedConn struct {
	Src        netip.AddrPort `json:"src"`
	Dst        netip.AddrPort `json:"dst"`
	DstNode    string         `json:"dst_node,omitempty"`
	First      uint32         `json:"first"`      // lowest retained byte
	Contiguous uint32         `json:"contiguous"` // every byte of [first, contiguous) is retained
	Retained   int64          `json:"retained"`
	Trimmed    bool           `json:"trimmed"` // a receiver's snapshot released the bytes before first
	Hole       bool           `json:"hole"`    // bytes are missing between contiguous and the last byte (must never happen)
	// Live is the sender's current state of the connection from its last egress segment.
	Live *ebpfprobes.FlowState `json:"live,omitempty"`
	// Release is where the connection stands on the way to being freed (release.Verdict): "open"
	// while its sender may send; once it finished, what its log still waits for.
	Release string `json:"release,omitempty"`
}

// LoggedConns lists the connections in this host's log.
func (a *Agent) LoggedConns() []LoggedConn {
	if a.netlog == nil {
		return nil
	}
	l := a.netlog.cap.Log()
	a.netlog.mu.Lock()
	verdicts := a.netlog.verdicts
	a.netlog.mu.Unlock()
	var out []LoggedConn
	for _, c := range l.Conns() {
		b, err := l.Bounds(c)
		if err != nil {
			continue
		}
		out = append(out, LoggedConn{Src: c.Local, Dst: c.Remote, DstNode: a.memberByIP(c.Remote.Addr()),
			First: netlog.Wire(b.First), Contiguous: netlog.Wire(b.Contiguous), Retained: b.Retained, Trimmed: b.Floor != 0,
			Hole: b.Contiguous != b.Last})
		if fs, ok, err := a.netlog.cap.FlowState(c); err == nil && ok {
			out[len(out)-1].Live = &fs
		}
		if v, ok := verdicts[c]; ok {
			out[len(out)-1].Release = v.String()
		}
	}
	return out
}

// Freeing the logs of finished connections (netlog/release): a connection that closes, or whose receiving
// job ends, before a receiver's snapshot covers its last byte is never trimmed. Each receiving node tells
// its senders, when asked, how old its oldest restore point is; a sender frees a finished connection whose
// last segment left before that point.

const (
	// watermarkEvery bounds how often one receiving node is asked for its watermark.
	watermarkEvery = 2 * time.Second
	// maxWatermarkAddrs bounds the addresses a watermark may list.
	maxWatermarkAddrs = clusterapi.MaxWatermarkAddrs
	// eventReleased is the log event of freed connections (shown by `ftctl status`).
	eventReleased controller.EventKind = "finished-conns-freed"
)

// releaseFinished frees the logs no restore can need any more and returns the decision on every
// connection it kept. It asks the receiving nodes for their watermarks when that could free something.
func (a *Agent) releaseFinished(ctx context.Context, l *netlog.Log, now time.Time) map[tcpflow.Tuple]release.Verdict {
	var (
		conns []tcpflow.Tuple
		acts  []netlog.Activity
		flows []release.Flow
	)
	for _, c := range l.Conns() {
		act, err := l.Activity(c)
		if err != nil {
			continue // removed meanwhile
		}
		f := release.Flow{Node: a.memberByIP(c.Remote.Addr()), Conn: c, LastAppend: act.LastAppend,
			SenderGone: act.CgroupID != 0 && !a.netlog.cap.Protects(act.CgroupID)}
		if act.LastKtimeNs != 0 {
			f.SentAge, f.HasSentAge = sinceKtime(act.LastKtimeNs)
		}
		if fs, ok, err := a.netlog.cap.FlowState(c); err == nil && ok {
			if age, err := fs.Age(); err == nil {
				f.HasState, f.FinSent, f.RstSent, f.StateAge = true, fs.FinSent, fs.RstSent, age
			}
		}
		conns, acts, flows = append(conns, c), append(acts, act), append(flows, f)
	}
	a.netlog.mu.Lock()
	marks := maps.Clone(a.netlog.marks)
	a.netlog.mu.Unlock()
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
			a.log.Warn("free the log of a finished connection", "conn", c, "err", err)
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

	a.netlog.mu.Lock()
	a.netlog.verdicts = verdicts
	for node, t := range freed {
		a.netlog.released.Conns += t.conns
		a.netlog.released.Bytes += t.bytes
		// Like a trim: the node's next pressure may ask it for a snapshot at once. A request made while
		// the connection was open may have found its job gone (and failed); waiting out the controller's
		// cooldown would leave the node's next job unrelieved at the cap.
		a.netlog.ctl.Relieved(node)
	}
	for node := range ask {
		if a.netlog.asking[node] || now.Sub(a.netlog.asked[node]) < watermarkEvery {
			continue
		}
		a.netlog.asking[node], a.netlog.asked[node] = true, now
		go a.askWatermark(ctx, node)
	}
	a.netlog.mu.Unlock()

	if len(freed) > 0 {
		mem := l.Stats().LiveBytes()
		var events []controller.Event
		for node, t := range freed {
			events = append(events, controller.Event{Time: now, Kind: eventReleased, Node: node, Bytes: t.bytes, Memory: mem})
			a.metrics.ControllerEvent(string(eventReleased))
			a.log.Info("freed the log of finished connections", "node", node, "conns", t.conns, "bytes", t.bytes)
		}
		a.netlog.mu.Lock()
		a.netlog.ev = append(a.netlog.ev, events...)
		if len(a.netlog.ev) > maxEvents {
			a.netlog.ev = a.netlog.ev[len(a.netlog.ev)-maxEvents:]
		}
		a.netlog.mu.Unlock()
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
func (a *Agent) askWatermark(ctx context.Context, node string) {
	w, err := a.LogWatermarkOf(ctx, node)
	a.netlog.mu.Lock()
	defer a.netlog.mu.Unlock()
	delete(a.netlog.asking, node)
	if err != nil {
		delete(a.netlog.marks, node)
		a.log.Debug("no log watermark from a receiving node; its finished connections stay logged", "node", node, "err", err)
		return
	}
	a.netlog.marks[node] = w
}

// LogWatermarkOf asks member node for its watermark and places it on this host's clock.
func (a *Agent) LogWatermarkOf(ctx context.Context, node string) (release.Watermark, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	// The question leaves after this moment and the node measures its watermark's age before it answers:
	// sent minus that age is never later than the watermark, whatever the two clocks say.
	sent := time.Now()
	r, err := a.peers().LogWatermark(ctx, node)
	if err != nil {
		return release.Watermark{}, fmt.Errorf("log watermark from %s: %w", node, err)
	}
	return r.Placed(node, sent)
}

// logWatermark computes this node's answer. The order matters: the addresses are read first, then a
// restore in progress is looked for, then the jobs. An address taken over for a failed node's jobs
// (prepareNetwork) is added while that restore runs and its jobs join a.byID before it ends, so an
// answer either lacks the address, or says a restore is in progress, or counts the restored jobs.
func (a *Agent) logWatermark() (LogWatermark, error) {
	addrs, err := hostAddrs()
	if err != nil {
		return LogWatermark{}, err
	}
	if busy, _ := a.busy.Load().(string); busy == "restore" {
		return LogWatermark{}, errors.New("no log watermark now: a restore is in progress on " + a.cfg.Name)
	}
	now := time.Now()
	var jobs []release.Job
	for _, j := range a.Jobs(0) {
		if j.State != JobRunning {
			continue
		}
		rj := release.Job{Running: true, Started: j.Created}
		if m := a.restoreFloor(j.ID); m != nil {
			rj.Replicated = m.Created
		}
		jobs = append(jobs, rj)
	}
	w, held := release.ReceiveWatermark(now, jobs)
	return LogWatermark{Age: now.Sub(w), Held: held, Addrs: addrs}, nil
}

// newestReplicated returns the newest snapshot of job in this host's store that another node holds too:
// the one a restore of the job would start from. A snapshot whose manifest is unreadable here is passed
// over (an older restore point only frees less).
func (a *Agent) newestReplicated(job string) *ckpt.Manifest {
	ids, err := a.store.List(job, "")
	if err != nil {
		return nil
	}
	for _, id := range ids {
		if m, err := a.store.Manifest(job, id); err == nil && m.Replicated() {
			return m
		}
	}
	return nil
}

// hostAddrs lists the addresses configured in this host's network namespace.
func hostAddrs() ([]netip.Addr, error) {
	list, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list this host's addresses: %w", err)
	}
	var out []netip.Addr
	for _, x := range list {
		if ip, ok := netip.AddrFromSlice(x.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	if len(out) > maxWatermarkAddrs {
		return nil, fmt.Errorf("this host has %d addresses, more than the %d a log watermark may list", len(out), maxWatermarkAddrs)
	}
	return out, nil
}
