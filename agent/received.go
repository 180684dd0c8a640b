package agent

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/shim"
	"github.com/ftkit/ftkit/tcpflow"
)

// Checking re-sent bytes: restore/recovery does the check; this file holds the agent's part of it (the
// receive records it serves, the prefix CRC at a dump, the log it reads re-sent bytes from, the kill).
// After a restore, the restored job re-emits the bytes its surviving peers already received since the
// snapshot, and the peers' TCP discards them unread. A program whose output depends on
// anything but its inputs (the clock, a random source, the order in which it reads its sockets) re-sends
// different bytes and silently diverges from what its peers saw. So every host records what its protected
// sockets receive, as a CRC-32C per 64 KiB block (recvdigest, fed by an eBPF cgroup ingress tap), and the
// target of a recovery fetches the surviving peers' records before the restore and checks EVERY re-sent
// byte against them before the job is re-protected. At the first difference, or at a byte it cannot
// check, it kills the job: a recovery never reports success with an unchecked byte.
//
// The check of a connection starts at the snapshot's write_seq, usually inside a block the receiver
// digested whole; the snapshot carries the CRC of that block's bytes before write_seq
// (ckpt.Conn.SentPrefix), taken from this host's log and the image's send queue at the dump. Log trims
// stop at block starts (serveTrim) so that those bytes are still logged then.

// resentLogWait bounds how long the target waits for its log to hold the re-sent bytes: the ring
// buffer's consumer may lag the socket.
const resentLogWait = 5 * time.Second

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// startReceiveDigests loads the receive tap and starts recording into a book; protect attaches the tap
// to each job's cgroup.
func (a *Agent) startReceiveDigests() (*ebpfprobes.RecvTap, *recvdigest.Book, *recvdigest.Recorder, error) {
	// Polled as the sender-side log is: a book is read at a recovery, after the failure's detection, never
	// byte by byte as it is written.
	tap, err := ebpfprobes.NewRecvTap(ebpfprobes.RecvTapOptions{RingBufferSize: a.cfg.Log.RingMiB << 20, PollInterval: capture.DefaultPollInterval, Logger: a.log})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("load the receive tap (re-sent bytes could not be checked without it): %w", err)
	}
	// Segments past a hole wait in the book until the retransmission that fills it: up to a window.
	book := recvdigest.NewBook(recvdigest.BookOptions{MaxReorderBytes: 8 << 20})
	return tap, book, recvdigest.NewRecorder(tap, book, a.log), nil
}

// sentPrefix computes ckpt.Conn.SentPrefix of a dumped connection of job j. Its bytes end at write_seq:
// the last ones are in the image's send queue (written, not yet acknowledged), those before in this host's
// log (transmitted). They start at write_seq's block start, or at the connection's first byte (ISN+1, from
// the log's live state) if that lies inside the block: the receiver's record starts there too.
//
// A job restored on this host sent its bytes before the restored snapshot's write_seq from another host:
// this host's log never had them, and its live state never saw the SYN. When write_seq is still in the
// block of an earlier snapshot's of this copy of the job, that snapshot's prefix is extended by the bytes
// sent since (often none: a receiver's side of a one-way stream), instead of asking the log for bytes it
// cannot have (which made every such snapshot wait resentLogWait, 5 s, and then go without a prefix).
func (a *Agent) sentPrefix(ctx context.Context, images string, c image.TCPConn, copySnaps func() []*ckpt.Manifest) (*ckpt.SentPrefix, error) {
	conn := c.Tuple
	start := recvdigest.BlockStart(c.OutqSeq)
	isn := false
	if a.netlog != nil {
		// Inside the block: fewer bytes back from write_seq than the block's start is. A signed difference
		// took an ISN+1 2 to 4 GiB back (mod 4 GiB) for one inside: such connections' snapshots asked the log
		// for gigabytes, waited 5 s, and went without a prefix, their re-sent bytes unverifiable.
		if fs, ok, err := a.netlog.node.FlowState(conn); err == nil && ok && fs.HasISN && c.OutqSeq-(fs.ISN+1) < c.OutqSeq-start {
			start, isn = fs.ISN+1, true
		}
	}
	if !isn {
		if base, ok := prefixBaseOf(copySnaps(), conn, c.OutqSeq); ok {
			h := crc32New(base.CRC)
			if err := a.sentBytes(ctx, h, images, c, base.From, c.OutqSeq-base.From); err != nil {
				return nil, err
			}
			return &ckpt.SentPrefix{Len: base.Len + (c.OutqSeq - base.From), CRC: h.Sum32()}, nil
		}
	}
	p := &ckpt.SentPrefix{Len: c.OutqSeq - start}
	h := crc32.New(castagnoli)
	if err := a.sentBytes(ctx, h, images, c, start, p.Len); err != nil {
		return nil, err
	}
	p.CRC = h.Sum32()
	return p, nil
}

// sentBytes writes to w the n bytes connection c carried before the dump's write_seq, from sequence from:
// the tail of the image's send queue, and before it what this host's log holds.
func (a *Agent) sentBytes(ctx context.Context, w io.Writer, images string, c image.TCPConn, from, n uint32) error {
	if n == 0 {
		return nil
	}
	q, err := image.SendQueue(images, c.Inode)
	if err != nil {
		return err
	}
	if uint64(len(q)) >= uint64(n) {
		_, err := w.Write(q[uint32(len(q))-n:])
		return err
	}
	// Acknowledged before the dump, so transmitted, but the log's consumer may lag the ring.
	logged := n - uint32(len(q))
	a.waitLogged(ctx, c.Tuple, from, from+logged)
	if err := a.loggedRange(ctx, w, c.Tuple, from, logged); err != nil {
		return err
	}
	_, err = w.Write(q)
	return err
}

// copySnapshots are the snapshots of this copy of job j that a dump's sent prefixes may extend (prefixBaseOf):
// those taken on this host since it was restored here, newest first, then the one it was restored from. Read
// once per dump (sentPrefix asks for each connection).
//
// This host's snapshots of this copy are told by the job record each carries (the copy's restored snapshot
// and incarnation), not by comparing ids with j.Restored: ids carry their host's clock, and the restored
// snapshot may be another host's, whose clock behind this one's made an earlier copy's snapshots here pass
// for this copy's (as did, whatever the clocks, those newer than an older snapshot of this host the job was
// restored from): the prefix then extended bytes this copy never sent.
func (a *Agent) copySnapshots(j Job) []*ckpt.Manifest {
	ids, err := a.store.List(j.ID, a.cfg.Name)
	if err != nil {
		return nil
	}
	var out []*ckpt.Manifest
	for _, id := range ids {
		if id == j.Restored {
			continue // last: the copy's oldest
		}
		m, err := a.store.Manifest(j.ID, id)
		if err != nil {
			continue
		}
		if rec, err := a.snapshotRecord(m); err != nil || rec.Restored != j.Restored || rec.Incarnation != j.Incarnation {
			continue // another copy's (or one whose record is unreadable)
		}
		out = append(out, m)
	}
	if j.Restored != "" {
		if m, err := a.store.Manifest(j.ID, j.Restored); err == nil {
			out = append(out, m)
		}
	}
	return out
}

// prefixBaseOf finds, among snaps (copySnapshots, in order), the first whose record of conn has a prefix that
// the dump at write_seq outq extends (prefixExtends).
func prefixBaseOf(snaps []*ckpt.Manifest, conn tcpflow.Tuple, outq uint32) (prefixBase, bool) {
	for _, m := range snaps {
		if b, ok := connPrefixBase(m, conn, outq); ok {
			return b, true
		}
	}
	return prefixBase{}, false
}

// connPrefixBase is snapshot m's base for conn's dump at write_seq outq (prefixExtends).
func connPrefixBase(m *ckpt.Manifest, conn tcpflow.Tuple, outq uint32) (prefixBase, bool) {
	for _, bc := range m.Conns {
		if bc.Tuple == conn {
			if b, ok := prefixExtends(bc, outq); ok {
				return b, true
			}
		}
	}
	return prefixBase{}, false
}

// prefixBase is an earlier snapshot's SentPrefix of a connection: the CRC-32C of the Len bytes up to From
// (that snapshot's write_seq).
type prefixBase struct {
	From, Len, CRC uint32
}

// prefixExtends says whether an earlier snapshot's record b of a connection gives the prefix of a dump at
// write_seq outq: b has a prefix, and outq is at or after b's write_seq in the same receive-digest block,
// so the new prefix starts where b's starts (the block start, or the connection's first byte) and
// continues with the bytes sent between the two.
func prefixExtends(b ckpt.Conn, outq uint32) (prefixBase, bool) {
	if b.SentPrefix == nil || int32(outq-b.OutqSeq) < 0 || recvdigest.BlockStart(outq) != recvdigest.BlockStart(b.OutqSeq) {
		return prefixBase{}, false
	}
	if b.SentPrefix.Len > b.OutqSeq-recvdigest.BlockStart(b.OutqSeq) {
		return prefixBase{}, false // not a prefix within its block: not one this agent wrote
	}
	return prefixBase{From: b.OutqSeq, Len: b.SentPrefix.Len, CRC: b.SentPrefix.CRC}, true
}

// crc32New is a CRC-32C hash that continues from crc, the checksum of the bytes before: CRC-32C(A||B) is
// crc32.Update(CRC-32C(A), B).
func crc32New(crc uint32) *crcFrom { return &crcFrom{crc: crc} }

type crcFrom struct{ crc uint32 }

func (h *crcFrom) Write(p []byte) (int, error) {
	h.crc = crc32.Update(h.crc, castagnoli, p)
	return len(p), nil
}

func (h *crcFrom) Sum32() uint32 { return h.crc }

// logOf is the log that holds what this host's jobs sent on conn, and its capture's Urge: the cluster
// interface's, or for a peer on this host the loopback capture's, which logs only the re-sent bytes of jobs
// restored next to their peers.
func (a *Agent) logOf(conn tcpflow.Tuple) (*netlog.Log, logConsumer, error) {
	if a.netlog == nil {
		return nil, nil, errors.New("the sender-side log is disabled on " + a.cfg.Name)
	}
	if conn.Remote.Addr().Unmap().IsLoopback() || a.memberByIP(conn.Remote.Addr()) == a.cfg.Name {
		a.netlog.mu.Lock()
		defer a.netlog.mu.Unlock()
		if a.netlog.lo == nil {
			return nil, nil, fmt.Errorf("%s is on this host, and no loopback log is running for this connection", conn.Remote)
		}
		return a.netlog.lo.Log(), a.netlog.lo, nil
	}
	return a.netlog.node.Log(), a.netlog.node, nil
}

// logConsumer is what a caller waiting for logged bytes, or for a flow's live state, asks of the log's
// capture.
type logConsumer interface {
	FlowState(conn tcpflow.Tuple) (ebpfprobes.FlowState, bool, error)
	Urge() (done func())
	Want(conn tcpflow.Tuple)
	TakeParked(ctx context.Context, conn tcpflow.Tuple) error
}

// keepResends makes sure the bytes a restored job re-sends stay readable until they are checked: those
// to peers on other hosts are held in the log (the peer's next snapshot would trim them away otherwise),
// and those to peers on this host (a restore on the protector, RADIC's basic mode), which the cluster
// interface never sees, are logged by the loopback capture. The returned function ends both.
func (a *Agent) keepResends(p restore.Plan) (stop func()) {
	if a.netlog == nil {
		return func() {}
	}
	var local []tcpflow.Tuple
	var release []func()
	for _, c := range p.Conns {
		if c.Resend == 0 {
			continue
		}
		if a.memberByIP(c.Conn.Remote.Addr()) == a.cfg.Name {
			local = append(local, c.Conn.Tuple)
			continue
		}
		release = append(release, a.netlog.node.Log().Hold(c.Conn.Tuple, c.Conn.OutqSeq))
	}
	stopLocal := a.logLocalResends(local)
	return func() {
		stopLocal()
		for _, f := range release {
			f()
		}
	}
}

// logLocalResends has the loopback capture log the local flows; the returned function stops it and frees
// what was logged.
func (a *Agent) logLocalResends(local []tcpflow.Tuple) (stop func()) {
	if len(local) == 0 {
		return func() {}
	}
	lo, err := a.acquireLocalLog()
	if err != nil {
		a.log.Error("re-sent bytes to peers on this host are not logged: the recovery will refuse them as unverifiable", "flows", local, "err", err)
		return func() {}
	}
	var flows []tcpflow.Tuple
	for _, f := range local {
		if err := lo.ProtectFlow(f); err != nil {
			a.log.Error("re-sent bytes to a peer on this host are not logged: the recovery will refuse them as unverifiable", "flow", f, "err", err)
			continue
		}
		flows = append(flows, f)
	}
	return func() {
		for _, f := range flows {
			if err := lo.UnprotectFlow(f); err != nil {
				a.log.Warn("stop logging re-sent bytes on loopback", "flow", f, "err", err)
			}
		}
		a.releaseLocalLog()
	}
}

// acquireLocalLog returns the loopback capture, started for its first user: its TCX program runs for every
// loopback packet of the host, other users' processes included, so it is attached only while a recovery
// checks bytes re-sent over loopback. releaseLocalLog closes it with its last user.
func (a *Agent) acquireLocalLog() (*capture.Capture, error) {
	a.netlog.mu.Lock()
	defer a.netlog.mu.Unlock()
	if a.netlog.lo == nil {
		lo, err := capture.New(capture.Options{Interface: "lo", RingBufferSize: 16 << 20, Log: netlog.Options{Logger: a.log}, Logger: a.log, MemoryCap: 256 << 20})
		if err != nil {
			return nil, fmt.Errorf("start the loopback log of re-sent bytes: %w", err)
		}
		a.netlog.lo = lo
	}
	a.netlog.loUsers++
	return a.netlog.lo, nil
}

// warmLocalLog starts the loopback log in the background when a recovery's restored jobs may re-send bytes
// to peers on this host (this host's log holds connections to the failed node), so that starting it, about
// 50 ms of loading and attaching its eBPF program, overlaps fetching the snapshot and the peers' logs
// instead of delaying the restore (keepResends then finds it started). The returned function drops this
// reference once the recovery is over.
func (a *Agent) warmLocalLog(req RecoverRequest) (release func()) {
	if a.netlog == nil || req.Migration {
		return func() {} // a migration re-sends nothing
	}
	peer := slices.ContainsFunc(a.LoggedConns(), func(c LoggedConn) bool {
		return c.DstNode == req.Failed || slices.Contains(req.Addrs, c.Dst.Addr().Unmap())
	})
	if !peer {
		return func() {}
	}
	started := make(chan bool, 1)
	go func() {
		_, err := a.acquireLocalLog() // a failure is logged by keepResends, which tries again
		started <- err == nil
	}()
	return func() {
		if <-started {
			a.releaseLocalLog()
		}
	}
}

func (a *Agent) releaseLocalLog() {
	a.netlog.mu.Lock()
	defer a.netlog.mu.Unlock()
	if a.netlog.loUsers--; a.netlog.loUsers == 0 {
		if err := a.netlog.lo.Close(); err != nil {
			a.log.Warn("close the loopback log of re-sent bytes", "err", err)
		}
		a.netlog.lo = nil
	}
}

// loggedRange writes the n bytes this host's log holds of conn from wire sequence seq on to w.
func (a *Agent) loggedRange(ctx context.Context, w io.Writer, conn tcpflow.Tuple, seq, n uint32) error {
	l, _, err := a.logOf(conn)
	if err != nil {
		return err
	}
	abs, _, err := l.UnwrapServable(conn, seq)
	if err != nil {
		return fmt.Errorf("bytes from sequence %d not in %s's log: %w", seq, a.cfg.Name, err)
	}
	got, err := l.WriteRange(ctx, w, conn, abs, abs+uint64(n))
	if err == nil && got != int64(n) {
		err = fmt.Errorf("%s's log holds %d of the %d bytes of %s from sequence %d", a.cfg.Name, got, n, conn, seq)
	}
	return err
}

// serveReceived answers from this host's book what one of its sockets received on a flow.
func (a *Agent) serveReceived(req clusterapi.ReceivedRequest) (clusterapi.ReceivedReply, error) {
	conn := req.Tuple
	if a.netlog == nil || a.netlog.book == nil {
		return clusterapi.ReceivedReply{}, errors.New("the receive tap is disabled on " + a.cfg.Name)
	}
	// The tap records IPv4 headers; the asker names a dual-stack socket's IPv4 connection as its images do,
	// by IPv4-mapped addresses. The record is looked up in the tap's form and named as asked (the asker
	// checks it is the connection it asked about).
	rec, ok := a.netlog.book.Received(conn.Unmap(), req.From)
	if !ok {
		return clusterapi.ReceivedReply{}, fmt.Errorf("%s has no record of what it received on %s: the socket is not a protected job's, or the agent restarted since", a.cfg.Name, conn)
	}
	rec.Fin = a.finReceivedAt(rec, req.From) // by the tap's form, as sock_diag and the flow states know it
	rec.Conn = conn
	return clusterapi.ReceivedReply{Received: &rec}, nil
}

// finAckWait is how long a socket that took in its peer's FIN may take to acknowledge it: Linux's
// delayed-ACK maximum (200 ms), and some.
const finAckWait = 250 * time.Millisecond

// finReceivedAt is where the sender's FIN is in rec, a record of this host's: the tap records no FIN, but
// the socket's state says it took one in (so its rcv_nxt is the FIN's sequence number plus one), and
// this host's own ACK on the reverse flow says where, once it acknowledged it. It is set only right at the
// end of the record: a FIN elsewhere, an ACK not yet sent, a socket gone or a state not known leave it
// unknown, and a restored sender's FIN is then refused as an unverified byte, as without this. A record of
// no byte from from on ends at from: a sender that sent nothing after its snapshot but its FIN.
func (a *Agent) finReceivedAt(rec recvdigest.Received, from uint32) *uint32 {
	own := rec.Conn.Reverse() // this host's socket: Local is the receiver
	lookup := a.netlog.socket
	if lookup == nil {
		lookup = func(f tcpflow.Tuple) (s sockdiag.Socket, err error) {
			err = a.inSocketNet(f, func() (err error) { s, err = sockdiag.Lookup(f); return err })
			return s, err
		}
	}
	if s, err := lookup(own); err != nil || !s.FinReceived() {
		return nil
	}
	end := from
	if len(rec.Pieces) > 0 {
		end = rec.Pieces[len(rec.Pieces)-1].End()
	}
	acked := func() bool {
		fs, ok, err := a.netlog.node.FlowState(own)
		return err == nil && ok && fs.HasAck && fs.Ack == end+1
	}
	if !acked() {
		time.Sleep(finAckWait)
		if !acked() {
			return nil
		}
	}
	return &end
}

// receivedOf fetches member peer's record of what it received on conn from sequence from on; the client
// checks it is well formed and of that connection.
func (a *Agent) receivedOf(ctx context.Context, peer string, conn tcpflow.Tuple, from uint32) (*recvdigest.Received, error) {
	r, err := a.peers().Received(ctx, peer, clusterapi.ReceivedRequest{Tuple: conn, From: from})
	if err != nil {
		return nil, err
	}
	return r.Received, nil
}

// waitLogged waits (a little) until this host's log holds conn's bytes from wire sequence from up to end:
// a hole below from, which the reader does not read, is not waited on.
func (a *Agent) waitLogged(ctx context.Context, conn tcpflow.Tuple, from, end uint32) {
	l, consumer, err := a.logOf(conn)
	if err != nil {
		return
	}
	// The bytes may be in the ring behind a consumer paused at the log's memory cap, or waiting for its
	// next poll.
	defer consumer.Urge()()
	ctx, cancel := context.WithTimeout(ctx, resentLogWait)
	defer cancel()
	if !l.Holds(conn, from, end) {
		if err := consumer.TakeParked(ctx, conn); err != nil {
			a.log.Warn("reading logged bytes without those still parked", "conn", conn, "err", err)
		}
	}
	l.WaitHolds(ctx, conn, from, end, 10*time.Millisecond, func() { consumer.Want(conn) })
}

// killJob stops a restored job that cannot continue (recovery.ReplayAndVerify decides); the shim records the signal and the agent marks the
// job ended.
func (a *Agent) killJob(id string, why error) {
	j, _, err := a.Job(id, 0)
	if err != nil || j.State != JobRunning {
		return
	}
	if a.cutRecords().RollsBack(id) {
		// Its run rolls back to its cut (rollbackAfterFailure): take it off this host without a word to its
		// peers or an exit record, as a rollback stops a job.
		a.log.Error("restored job is not transparently recoverable: stopping it for its run's rollback", "job", id, "run", j.Spec.Run, "err", why)
		if err := a.leaveHost(context.Background(), j, a.cfg.Name); err != nil {
			a.log.Error("could not stop restored job", "job", id, "err", err)
		}
		return
	}
	a.log.Error("killing restored job: it is not transparently recoverable", "job", id, "pid", j.PID, "err", why)
	// Its shim puts why into the exit record, which ftwrap prints: the job's user learns that ftkit refused.
	reason := fmt.Sprintf("killed by ftkit on %s: the job's restore could not reproduce the failure-free run: %v", a.cfg.Name, why)
	if err := writeMark(a.refusalMark(id, j.Incarnation), reason); err != nil {
		a.log.Warn("could not record why the job is killed: its exit record will not say", "job", id, "err", err)
	}
	// By pidfd, checked in the job's cgroup: the PID alone may name another process by now.
	if err := shim.Signal(j.PID, j.Cgroup, unix.SIGKILL); err != nil && !errors.Is(err, shim.ErrJobGone) {
		a.log.Error("could not kill restored job", "job", id, "pid", j.PID, "err", err)
	}
}
