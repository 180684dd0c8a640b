package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/procfs"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/internal/hostnet"
	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/internal/sockowner"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/netlog/controller"
	"github.com/ftkit/ftkit/netlog/node"
	"github.com/ftkit/ftkit/netlog/release"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

// logState is the agent's sender-side log (netlog/node) and its record of what this host's protected
// sockets received.
type logState struct {
	node *node.Node
	// What this host's protected sockets received, to check a restored peer's re-sent bytes (received.go).
	tap      *ebpfprobes.RecvTap
	book     *recvdigest.Book
	recorder *recvdigest.Recorder
	mu       sync.Mutex
	// lo logs only the flows a recovery asks for: what a job restored next to its peers (basic mode)
	// re-sends to them over loopback, to check it (received.go). It exists only while loUsers > 0.
	lo      *capture.Capture
	loUsers int
	// socket reads a local socket's state where it lives (nil: sock_diag in its network namespace).
	socket func(conn tcpflow.Tuple) (sockdiag.Socket, error)
}

// ReleaseCounters count the logs of finished connections freed since the agent started.
type ReleaseCounters = node.Released

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
	tap, book, recorder, err := a.startReceiveDigests()
	if err != nil {
		return err
	}
	n, err := node.Start(node.StartConfig{
		Interface: iface, RingMiB: lc.RingMiB, MaxFlows: lc.MaxFlows, MemoryMiB: lc.MemoryMiB, SpillDir: lc.SpillDir, High: lc.High, Low: lc.Low,
		Park: lc.Park, ParkMiB: lc.ParkMiB,
		MaxRange: maxLogRange, Members: logMembers{a}, Logger: a.log,
		Event: func(k controller.EventKind) { a.metrics.ControllerEvent(string(k)) },
		ReceiveHoles: func() uint64 {
			c, err := tap.Counters()
			if err != nil {
				return 0
			}
			return c.UnrecordedPassed
		},
		SocketGone: a.sendingSocketGone,
	})
	if err != nil {
		recorder.Close()
		tap.Close()
		return err
	}
	a.netlog = &logState{node: n, tap: tap, book: book, recorder: recorder}
	a.log.Info("sender-side log attached", "interface", iface, "ring_mib", lc.RingMiB, "max_flows", lc.MaxFlows, "memory_cap_mib", n.CapBytes()>>20,
		"park_mib", n.ParkCapBytes()>>20)
	return nil
}

// logMembers is what the log needs of the cluster (node.Members).
type logMembers struct{ a *Agent }

func (m logMembers) Owner(addr netip.Addr) string { return m.a.memberByIP(addr) }

func (m logMembers) RequestSnapshot(ctx context.Context, node string) error {
	return m.a.peers().CheckpointNow(ctx, node)
}

func (m logMembers) Watermark(ctx context.Context, node string) (release.Watermark, error) {
	return m.a.LogWatermarkOf(ctx, node)
}

func (m logMembers) Others() []string { return m.a.otherMembers() }

// interfaceOf names the interface that holds addr in this network namespace.
func interfaceOf(addr netip.Addr) (string, error) {
	name, _, err := hostInterface(addr)
	return name, err
}

// hostInterface finds the interface that holds addr and the prefix addr has on it.
func hostInterface(addr netip.Addr) (string, netip.Prefix, error) { return hostnet.Interface(addr) }

func (a *Agent) protect(j *Job) {
	if a.netlog == nil {
		return
	}
	if err := a.netlog.node.Protect(j.Cgroup); err != nil {
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
	if err := a.netlog.node.Unprotect(j.Cgroup); err != nil && !errors.Is(err, os.ErrNotExist) {
		a.log.Debug("unprotect job cgroup", "job", j.ID, "err", err)
	}
	if err := a.netlog.tap.DetachCgroup(j.Cgroup); err != nil && !errors.Is(err, os.ErrNotExist) {
		a.log.Debug("detach the receive tap from the job cgroup", "job", j.ID, "err", err)
	}
}

// announceReceivePoints tells every sender of bytes to the snapshotted job where its new durable snapshot
// starts receiving, so that each sender drops the log data before it (sender-based logging's GC).
func (a *Agent) announceReceivePoints(ctx context.Context, m *ckpt.Manifest) {
	owner := a.ownerLookup(ctx)
	for peer, pts := range receivePoints(m.Conns, owner, a.cfg.Name) {
		if err := a.sendTrim(ctx, peer, pts); err != nil {
			// Not fatal: the peer keeps the data a little longer and trims at the next snapshot.
			a.log.Warn("could not tell a sender to trim its log", "peer", peer, "snapshot", m.ID, "err", err)
		}
	}
}

// receivePoints groups by sending member the receive points of a snapshot's connections (owner names the
// member that holds an address; self is this host).
func receivePoints(conns []ckpt.Conn, owner func(netip.Addr) string, self string) map[string][]TrimPoint {
	byPeer := map[string][]TrimPoint{}
	for _, c := range conns {
		if c.Connecting {
			// Its InqSeq is the kernel's 0, no point of the peer's stream: a trim there could land ahead of
			// everything the peer's log holds of the connection once it is accepted, and the log would drop
			// all the peer sends next (ci138: a recovery refused as unverifiable).
			continue
		}
		peer := owner(c.Remote.Addr())
		if peer == "" || peer == self {
			continue // not cluster traffic, or traffic inside this host (never logged)
		}
		byPeer[peer] = append(byPeer[peer], TrimPoint{Tuple: c.Reverse(), Seq: c.InqSeq})
	}
	return byPeer
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
func (a *Agent) serveTrim(ctx context.Context, peer string, pts []TrimPoint) clusterapi.TrimReply {
	own, foreign := ownTrimPoints(pts, peer, a.ownerLookup(ctx))
	if foreign > 0 {
		a.log.Warn("trim refused for connections the peer does not hold: a member may only release data destined for itself",
			"peer", peer, "refused", foreign, "accepted", len(own))
	}
	n := 0
	if a.netlog != nil {
		np := make([]node.Point, len(own))
		for i, p := range own {
			np[i] = node.Point{Conn: p.Tuple, Seq: p.Seq}
		}
		n = a.netlog.node.Trim(peer, np)
	}
	return clusterapi.TrimReply{Trimmed: n}
}

// ownTrimPoints keeps the points whose receiving end (Dst) member peer holds now (owner names the member
// that holds an address), and counts the others.
func ownTrimPoints(pts []TrimPoint, peer string, owner func(netip.Addr) string) (own []TrimPoint, foreign int) {
	for _, p := range pts {
		if !destinedFor(p.Tuple, peer, owner) {
			foreign++
			continue
		}
		own = append(own, p)
	}
	return own, foreign
}

// destinedFor says whether member peer holds the receiving end (Remote) of flow f now: a member may only ask
// about, or release the log of, what is destined for itself.
func destinedFor(f tcpflow.Tuple, peer string, owner func(netip.Addr) string) bool {
	return f.Remote.IsValid() && owner(f.Remote.Addr()) == peer
}

// unloggedConns names the connections of snapshot m whose peer is on another member host that logs
// nothing that peer sends on them: a process there not started under ftkit, or a host whose sender-side
// log is off. A restore of the job from m could not be given what such a peer sent after m, so a failure
// of this host would end in the recovery's refusal; said now, when m is replicated. Each member is asked
// about its connections once per replica, a few members at a time; a member that cannot answer flags
// nothing, and the log says so (a warning if it is unreachable, at debug level for an older agent).
func (a *Agent) unloggedConns(ctx context.Context, m *ckpt.Manifest) []string {
	var (
		mu  sync.Mutex
		out []string
		wg  sync.WaitGroup
	)
	sem := make(chan struct{}, maxLoggedQuestions)
	owner := a.ownerLookup(ctx)
	for peer, pts := range receivePoints(m.Conns, owner, a.cfg.Name) {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			bad, err := a.askLogged(ctx, peer, pts)
			if e := clusterapi.Refusal(err); e != nil && e.Code == clusterapi.CodeUnknownOp {
				// An agent older than the question (a rolling upgrade): not worth a warning at every replica.
				a.log.Debug("a member's agent does not answer whether it logs what it sends to this job (an older version)", "job", m.Job, "peer", peer)
			} else if err != nil {
				a.log.Warn("could not ask a member whether it logs what it sends to this job: if it does not, a failure of this host ends in a refusal not announced now",
					"job", m.Job, "snapshot", m.ID, "peer", peer, "err", err)
			}
			mu.Lock()
			out = append(out, bad...)
			mu.Unlock()
		})
	}
	wg.Wait()
	slices.Sort(out)
	return out
}

// maxLoggedQuestions bounds the members unloggedConns asks at once; loggedTimeout bounds one question.
// They delay the trims and pruning after a replica.
const (
	maxLoggedQuestions = 8
	loggedTimeout      = 2 * time.Second
)

// askLogged asks member peer which of the connections of pts (seen from its end) it does not log, and
// says why for each.
func (a *Agent) askLogged(ctx context.Context, peer string, pts []TrimPoint) ([]string, error) {
	var out []string
	for chunk := range slices.Chunk(pts, clusterapi.MaxLoggedFlows) {
		req := clusterapi.LoggedRequest{Flows: make([]tcpflow.Tuple, len(chunk))}
		for i, p := range chunk {
			req.Flows[i] = p.Tuple
		}
		cctx, cancel := context.WithTimeout(ctx, loggedTimeout)
		rep, err := a.peers().Logged(cctx, peer, req)
		cancel()
		if err != nil {
			return out, err
		}
		out = append(out, unloggedReasons(peer, rep)...)
	}
	return out, nil
}

// unloggedReasons says, for each connection member peer named in rep, why a restore of this host's job
// could not be given what the peer sent after the snapshot (the job's end first).
func unloggedReasons(peer string, rep clusterapi.LoggedReply) []string {
	why := fmt.Sprintf("a process of %s not started under ftkit, whose sends nobody logs (run it under ftwrap, or as a job)", peer)
	if rep.LogOff {
		why = fmt.Sprintf("on %s, whose sender-side log is off", peer)
	}
	lost := setOf(rep.StateLost)
	var out []string
	for _, f := range rep.Unlogged {
		if lost[f] {
			out = append(out, fmt.Sprintf("%s -> %s: the peer is a protected process of %s, but that host's log has lost the connection's live state "+
				"(its capture keeps the most recently active connections only): a restore could not be told what it sent after the snapshot "+
				"until the connection carries a segment again", f.Remote, f.Local, peer))
			continue
		}
		out = append(out, fmt.Sprintf("%s -> %s: the peer is %s: a restore could not be given what it sent after the snapshot", f.Remote, f.Local, why))
	}
	return out
}

// serveLogged answers which of flows (seen from this host's end) this host does not log. Only flows
// whose other end the caller holds are answered: a member may ask only about its own connections.
func (a *Agent) serveLogged(ctx context.Context, peer string, flows []tcpflow.Tuple) clusterapi.LoggedReply {
	rep := clusterapi.LoggedReply{LogOff: a.netlog == nil}
	owner := a.ownerLookup(ctx)
	for _, f := range flows {
		if !destinedFor(f, peer, owner) {
			continue
		}
		if rep.LogOff || !a.netlog.node.Knows(f) {
			rep.Unlogged = append(rep.Unlogged, f)
			if !rep.LogOff && a.lostState(f) {
				rep.StateLost = append(rep.StateLost, f)
			}
		}
	}
	// This host's operator is told too: the process is here, the job that cannot be recovered there.
	named, unnamed := a.unloggedSeen.fresh(rep.Unlogged, time.Now())
	msg := "a process of this host not started under ftkit talks to a job of another member: nothing logs what it sends, so that job cannot be recovered if its host fails (run the process under ftwrap, or as a job)"
	if rep.LogOff {
		msg = "this host's sender-side log is off: a job of another member talks to a process of this host, and cannot be recovered if its host fails"
	}
	lost := setOf(rep.StateLost)
	var plain []tcpflow.Tuple
	for _, f := range named {
		if lost[f] {
			a.log.Warn("a connection of a protected process of this host has no live state in the sender-side log's capture any more (it keeps those of the log.max_flows most recently active connections; this one sent nothing meanwhile): the job of another member it talks to cannot be recovered if its host fails until the connection carries a segment again",
				"local", f.Local, "remote", f.Remote, "member", peer, "max_flows", a.cfg.Log.MaxFlows)
			continue
		}
		plain = append(plain, f)
	}
	if len(plain) > 0 {
		// Naming each connection's process takes a pass over /proc: not on the asking member's time.
		go func() {
			owners := a.socketOwners(plain)
			for _, f := range plain {
				a.log.Warn(msg, append([]any{"local", f.Local, "remote", f.Remote, "member", peer}, owners[f]...)...)
			}
		}()
	}
	if unnamed > 0 {
		a.log.Warn("more connections of processes of this host that nothing logs were asked about this hour than the log names one by one (said once an hour): ftctl status on the asking members lists their jobs' connections", "member", peer, "unnamed", unnamed)
	}
	return rep
}

// inSocketNet runs fn in the network namespace where f's local socket lives: the job network of the
// running job of this host that holds f's local address, or else the agent's own.
func (a *Agent) inSocketNet(f tcpflow.Tuple, fn func() error) error {
	return inJobNet(a.runningJobNet(f.Local.Addr()), fn)
}

// sendingSocketGone reports whether f's local socket no longer exists where it would live (inSocketNet):
// what finishes a logged connection whose live state the capture evicted (node.Config.SocketGone).
func (a *Agent) sendingSocketGone(f tcpflow.Tuple) (bool, error) {
	err := a.inSocketNet(f, func() error { _, err := sockdiag.Lookup(f); return err })
	if errors.Is(err, sockdiag.ErrNoSocket) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("look up the sending socket of %v (its log stays until a lookup answers): %w", f, err)
	}
	return false, nil
}

// lostState asks the log whether f's local socket, unknown to it, is a protected process's that lost its
// live state (node.LostState), where that socket lives.
func (a *Agent) lostState(f tcpflow.Tuple) bool {
	lost := false
	err := a.inSocketNet(f, func() error { lost = a.netlog.node.LostState(f); return nil })
	return err == nil && lost
}

// socketOwners names, for the operator, the process of this host that holds each flow's local socket
// and the socket's owner, as log attributes ("uid", then "pid" and "command" when a process was found);
// a flow whose socket is gone has none. Each socket is looked up where it lives (inSocketNet), the
// processes in one pass over /proc.
func (a *Agent) socketOwners(flows []tcpflow.Tuple) map[tcpflow.Tuple][]any {
	attrs := map[tcpflow.Tuple][]any{}
	inodes := map[tcpflow.Tuple]uint32{}
	for _, f := range flows {
		var s sockdiag.Socket
		err := a.inSocketNet(f, func() (err error) { s, err = sockdiag.Lookup(f); return err })
		if err != nil || s.TimeWait() { // a TIME_WAIT socket has neither owner nor inode any more
			continue
		}
		attrs[f], inodes[f] = []any{"uid", s.UID}, s.Inode
	}
	if len(inodes) == 0 {
		return attrs
	}
	proc, err := procfs.NewDefaultFS()
	if err != nil {
		return attrs
	}
	owners, err := sockowner.Find(proc, slices.Collect(maps.Values(inodes)))
	if err != nil {
		a.log.Debug("the processes of connections that nothing logs could not be named", "err", err)
		return attrs
	}
	for f, ino := range inodes {
		if p, ok := owners[ino]; ok {
			attrs[f] = append(attrs[f], "pid", p.PID, "command", p.Comm)
		}
	}
	return attrs
}

// setOf is flows as a set.
func setOf(flows []tcpflow.Tuple) map[tcpflow.Tuple]bool {
	s := make(map[tcpflow.Tuple]bool, len(flows))
	for _, f := range flows {
		s[f] = true
	}
	return s
}

// unloggedReports remembers the connections members were told this host does not log (serveLogged), so
// that its log names each once a day rather than at every replica of the job, and at most a few hundred an
// hour: a member's questions, however many or wrong, cannot flood the log.
type unloggedReports struct {
	mu     sync.Mutex
	seen   map[tcpflow.Tuple]time.Time // when each was last named
	window time.Time                   // the start of the hour whose names are counted
	named  int                         // connections named since window
	told   bool                        // fresh reported connections kept back since window
}

// unloggedReportEvery is how often one connection is named again, unloggedReportsPerHour how many are
// named in an hour at most, and maxUnloggedReports how many are remembered, the oldest forgotten first.
const (
	unloggedReportEvery    = 24 * time.Hour
	unloggedReportsPerHour = 256
	maxUnloggedReports     = 4096
)

// fresh returns the flows to name now: those not named in the last unloggedReportEvery, within the hour's
// budget; it notes them as named at now. unnamed counts those the budget kept back (named at a later ask),
// once an hour: 0 after that.
func (u *unloggedReports) fresh(flows []tcpflow.Tuple, now time.Time) (named []tcpflow.Tuple, unnamed int) {
	if len(flows) == 0 {
		return nil, 0
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.seen == nil {
		u.seen = map[tcpflow.Tuple]time.Time{}
	}
	if now.Sub(u.window) >= time.Hour {
		u.window, u.named, u.told = now, 0, false
	}
	for _, f := range flows {
		at, ok := u.seen[f]
		if ok && now.Sub(at) < unloggedReportEvery {
			continue
		}
		if u.named >= unloggedReportsPerHour {
			unnamed++
			continue
		}
		if !ok && len(u.seen) >= maxUnloggedReports {
			oldest := now
			var drop tcpflow.Tuple
			for g, at := range u.seen {
				if !at.After(oldest) {
					oldest, drop = at, g
				}
			}
			delete(u.seen, drop)
		}
		u.seen[f] = now
		u.named++
		named = append(named, f)
	}
	if u.told {
		return named, 0
	}
	u.told = unnamed > 0
	return named, unnamed
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
	r, err := a.netlog.node.Range(ctx, peer, req.Tuple, req.From)
	if err != nil {
		return LogRangeReply{}, nil, err
	}
	return LogRangeReply{From: r.From, Len: r.Len, Live: r.Live, LiveAge: r.LiveAge}, r.Write, nil
}

// LogRange fetches from member peer the bytes it logged on src->dst from sequence from on, with the
// peer's live state of the connection. This host's own log is read in place: a recovery on a host that
// held one of the failed job's peers (its protector, in a ring) would otherwise encrypt, send, receive
// and decrypt that connection's bytes to itself, on the CPUs the restore needs.
func (a *Agent) LogRange(ctx context.Context, peer string, req LogRangeRequest) (LogRangeReply, []byte, error) {
	if peer != a.cfg.Name {
		return a.peers().LogRange(ctx, peer, req)
	}
	rep, write, err := a.serveLogRange(ctx, peer, req)
	if err == nil {
		err = rep.Validate()
	}
	if err != nil || write == nil || rep.Len == 0 {
		return rep, nil, err
	}
	var buf bytes.Buffer
	buf.Grow(int(rep.Len))
	if err := write(&buf); err != nil {
		return rep, nil, err
	}
	if int64(buf.Len()) != rep.Len {
		return rep, nil, fmt.Errorf("log range of %s: %d bytes announced, %d read", req.Tuple, rep.Len, buf.Len())
	}
	return rep, buf.Bytes(), nil
}

// controlLog runs the resource controller: measure, decide, act.
func (a *Agent) controlLog(ctx context.Context) {
	if a.netlog == nil {
		return
	}
	a.netlog.node.Run(ctx)
}

// requestSnapshot asks member node to snapshot its jobs now, so that this node can trim its log.
func (a *Agent) requestSnapshot(ctx context.Context, node string) {
	if a.netlog != nil {
		a.netlog.node.RequestSnapshot(ctx, node)
	}
}

// LogStatus is the log part of the agent's status.
type LogStatus struct {
	node.Status
	Received ReceiveStatus `json:"received"`
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
	rs := ReceiveStatus{Book: a.netlog.book.Stats(), Records: a.netlog.recorder.Stats().Records, Error: errString(a.netlog.recorder.Err())}
	rs.Tap, _ = a.netlog.tap.Counters()
	return &LogStatus{Status: a.netlog.node.Status(), Received: rs}
}

// LoggedConn describes what the log holds for one connection, in wire (32-bit) sequence numbers.
type LoggedConn = node.Conn

// LoggedConns lists the connections in this host's log.
func (a *Agent) LoggedConns() []LoggedConn {
	if a.netlog == nil {
		return nil
	}
	return a.netlog.node.Conns()
}

// maxWatermarkAddrs bounds the addresses a watermark may list.
const maxWatermarkAddrs = clusterapi.MaxWatermarkAddrs

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
	if a.busy.current() == detect.BusyRestore {
		return LogWatermark{}, errors.New("no log watermark now: a restore is in progress on " + a.cfg.Name)
	}
	now := time.Now()
	var jobs []release.Job
	for _, j := range a.Jobs(0) {
		if j.State != JobRunning {
			continue
		}
		rj := release.Job{Running: true, Started: j.startedHere()}
		if m := a.restoreFloor(j.ID); m != nil {
			rj.Replicated = m.Created
		}
		jobs = append(jobs, rj)
	}
	w, held := release.ReceiveWatermark(now, jobs)
	return LogWatermark{Age: now.Sub(w), Held: held, Addrs: addrs}, nil
}

// newestReplicated returns the newest snapshot of job taken on this host that another node holds too:
// the one a restore of the job would start from. A snapshot whose manifest is unreadable here is passed
// over (an older restore point only frees less). Only this host's own count: a restore after its failure
// starts from those (heldReplicas), and the copies it keeps of another host's snapshots of the job (it
// was restored here from them) are dated by that host's clock, which, ahead of this one, made a stale
// copy pass for the newest: the watermark became this host's present, and peers freed bytes a restore
// from this host's own snapshot needs.
func (a *Agent) newestReplicated(job string) *ckpt.Manifest {
	ids, err := a.store.List(job, a.cfg.Name)
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
	out, err := hostnet.Addrs()
	if err != nil {
		return nil, err
	}
	if len(out) > maxWatermarkAddrs {
		return nil, fmt.Errorf("this host has %d addresses, more than the %d a log watermark may list", len(out), maxWatermarkAddrs)
	}
	return out, nil
}
