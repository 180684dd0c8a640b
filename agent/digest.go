package agent

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/netlog"
)

// Re-sent byte digests. After a restore, the restored job re-emits the bytes its peers already received
// after the snapshot, and the peers' TCP discards them as duplicates without looking at them. A program
// whose output depends on something other than its inputs (the clock, a random source) re-sends different
// bytes and silently diverges from what its peers saw. So every agent digests (CRC-32C) each whole 64 KiB
// block of what its jobs sent, as its sender-side log holds it, and ships the digests to its protector,
// which keeps them beside the node's snapshots. The recovery target compares the restored job's re-sent
// blocks, as its own log captures them, with the failed node's digests, and stops the job at a mismatch.

// DigestBlockSize is the block a digest covers: wire sequence range [k*B, (k+1)*B). 2^32 is a multiple of
// it, so blocks are the same on absolute and on wrapping 32-bit sequence numbers.
const DigestBlockSize = 64 << 10

const (
	digestPeriod = 250 * time.Millisecond
	// digestFlushPeriod is how often a protector writes the digests it keeps to disk (for an agent restart).
	digestFlushPeriod = time.Second
	// maxDigestBlocksPerConn bounds what a protector keeps per connection (1 GiB of stream), well inside
	// half the sequence space, so block numbers stay unambiguous.
	maxDigestBlocksPerConn = 1 << 14
	// maxDigestBlocksPerNode bounds a protector's memory per protected node (8 GiB of stream).
	maxDigestBlocksPerNode = 1 << 17
	// maxPendingDigests bounds what a sender holds while its protector does not answer.
	maxPendingDigests = 1 << 16
	// maxDigestBatch bounds one opDigests exchange; maxDigestsPerTick bounds the bytes one tick reads back
	// from the log (1 GiB), e.g. after a protector change re-digests everything still logged.
	maxDigestBatch    = 8192
	maxDigestsPerTick = 1 << 14
	// maxRecoverRequest bounds a recovery request, which carries the failed node's digests.
	maxRecoverRequest = 32 << 20
	// resentLogWait bounds how long the target waits for its log to hold the re-sent bytes.
	resentLogWait = 5 * time.Second
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrNondeterministic means a restored job re-sent bytes that differ from what its peer had received: the
// program is not deterministic, so it cannot be recovered transparently.
var ErrNondeterministic = errors.New("the program re-sent different bytes than its peer already received (non-deterministic), so it is not transparently recoverable")

// BlockDigest is the CRC-32C of one whole block a sender's log holds: one line of opDigests.
type BlockDigest struct {
	Src netip.AddrPort `json:"src"`
	Dst netip.AddrPort `json:"dst"`
	Seq uint32         `json:"seq"` // wire sequence of the block's first byte, a multiple of DigestBlockSize
	CRC uint32         `json:"crc"`
}

// ConnDigests are the digests of one connection: runs of consecutive blocks.
type ConnDigests struct {
	Src  netip.AddrPort `json:"src"`
	Dst  netip.AddrPort `json:"dst"`
	Runs []DigestRun    `json:"runs"`
}

// DigestRun is the digests of consecutive blocks from wire sequence Seq: CRCs holds one big-endian CRC-32C
// per block (4 bytes each, base64 in JSON: compact enough to ride in a recovery request).
type DigestRun struct {
	Seq  uint32 `json:"seq"`
	CRCs []byte `json:"crcs"`
}

// wholeBlocks returns the start of the first block at or after from and how many whole blocks lie in
// [from, to) (absolute sequence numbers); a partial block at either end is left out.
func wholeBlocks(from, to uint64) (first, n uint64) {
	first = (from + DigestBlockSize - 1) &^ (DigestBlockSize - 1)
	if to <= first {
		return first, 0
	}
	return first, (to - first) / DigestBlockSize
}

// resentBlocks is wholeBlocks on the wire: the whole blocks inside [from, from+length), wrapping at 2^32.
func resentBlocks(from, length uint32) (first uint32, n int) {
	skip := (DigestBlockSize - from%DigestBlockSize) % DigestBlockSize
	if length < skip {
		return from + skip, 0
	}
	return from + skip, int((length - skip) / DigestBlockSize)
}

// encodeRuns lays out blocks (by wire sequence) as runs, oldest first; newest is the newest block's
// sequence, which orders the others across a wrap.
func encodeRuns(blocks map[uint32]uint32, newest uint32) []DigestRun {
	seqs := make([]uint32, 0, len(blocks))
	for s := range blocks {
		seqs = append(seqs, s)
	}
	ref := newest + DigestBlockSize // seq-ref grows with age order, wrap or not
	slices.SortFunc(seqs, func(x, y uint32) int {
		dx, dy := x-ref, y-ref
		switch {
		case dx < dy:
			return -1
		case dx > dy:
			return 1
		}
		return 0
	})
	var runs []DigestRun
	for i, s := range seqs {
		if i == 0 || s != seqs[i-1]+DigestBlockSize {
			runs = append(runs, DigestRun{Seq: s})
		}
		r := &runs[len(runs)-1]
		r.CRCs = binary.BigEndian.AppendUint32(r.CRCs, blocks[s])
	}
	return runs
}

// index turns the runs into block sequence -> CRC, refusing malformed runs; newest is the last run's last
// block (encodeRuns writes oldest first).
func (cd ConnDigests) index() (blocks map[uint32]uint32, newest uint32, err error) {
	blocks = map[uint32]uint32{}
	n := 0
	for _, r := range cd.Runs {
		if r.Seq%DigestBlockSize != 0 {
			return nil, 0, fmt.Errorf("digests of %s -> %s: run at %d is not on a %d-byte block boundary", cd.Src, cd.Dst, r.Seq, DigestBlockSize)
		}
		if len(r.CRCs) == 0 {
			return nil, 0, fmt.Errorf("digests of %s -> %s: run at %d is empty", cd.Src, cd.Dst, r.Seq)
		}
		if len(r.CRCs)%4 != 0 {
			return nil, 0, fmt.Errorf("digests of %s -> %s: run at %d has %d bytes of CRCs, not a multiple of 4", cd.Src, cd.Dst, r.Seq, len(r.CRCs))
		}
		if n += len(r.CRCs) / 4; n > maxDigestBlocksPerConn {
			return nil, 0, fmt.Errorf("digests of %s -> %s: more than %d blocks", cd.Src, cd.Dst, maxDigestBlocksPerConn)
		}
		for i := 0; i < len(r.CRCs); i += 4 {
			newest = r.Seq + uint32(i/4)*DigestBlockSize
			blocks[newest] = binary.BigEndian.Uint32(r.CRCs[i:])
		}
	}
	return blocks, newest, nil
}

// blockLog is what the digester reads from a sender-side log (*netlog.Log).
type blockLog interface {
	Conns() []netlog.Conn
	Bounds(netlog.Conn) (netlog.Bounds, error)
	WriteRange(ctx context.Context, w io.Writer, conn netlog.Conn, from, to uint64) (int64, error)
}

// digester is a sender's progress: which blocks of its log it has digested, and digests not yet shipped.
type digester struct {
	next    map[netlog.Conn]uint64 // absolute start of the first block not yet digested
	pending []BlockDigest
}

// digestNew digests the blocks that became whole in the log since the last call (at most limit), oldest
// first. A partial first block (the connection was first seen mid-block) is skipped.
func (d *digester) digestNew(ctx context.Context, l blockLog, limit int) {
	if d.next == nil {
		d.next = map[netlog.Conn]uint64{}
	}
	conns := l.Conns()
	for c := range d.next {
		if !slices.Contains(conns, c) {
			delete(d.next, c) // removed from the log: a later store of the same 4-tuple starts afresh
		}
	}
	for _, conn := range conns {
		b, err := l.Bounds(conn)
		if err != nil || !b.Anchored {
			continue
		}
		from, seen := d.next[conn]
		if !seen || from < b.First || from > b.Last {
			from = b.First // new, trimmed past, or a fresh store of a reused 4-tuple
		}
		first, n := wholeBlocks(from, b.Contiguous)
		for i := range n {
			if limit <= 0 {
				break
			}
			s := first + i*DigestBlockSize
			h := crc32.New(castagnoli)
			if _, err := l.WriteRange(ctx, h, conn, s, s+DigestBlockSize); err != nil {
				break // trimmed under us, or the log closed: the next tick starts from the new bounds
			}
			d.pending = append(d.pending, BlockDigest{Src: conn.Src, Dst: conn.Dst, Seq: netlog.Wire(s), CRC: h.Sum32()})
			from = s + DigestBlockSize
			limit--
		}
		d.next[conn] = max(from, first)
	}
	if over := len(d.pending) - maxPendingDigests; over > 0 {
		d.pending = slices.Delete(d.pending, 0, over) // the protector is away: the oldest go unverified
	}
}

// reset forgets what was digested: a new protector gets the digests of everything still logged.
func (d *digester) reset() {
	d.next, d.pending = nil, nil
}

// digestLoop digests this host's log and ships the digests to its protector, and writes the digests this
// host keeps for the nodes it protects to disk.
func (a *Agent) digestLoop(ctx context.Context) {
	var d digester
	protector := ""
	var flushed time.Time
	every(ctx, digestPeriod, func() {
		if time.Since(flushed) >= digestFlushPeriod { // fsync at most this often; memory is what recovery reads
			flushed = time.Now()
			if err := a.digests.flush(); err != nil {
				a.log.Warn("could not save protected nodes' digests; they stay in memory", "err", err)
			}
		}
		if a.netlog == nil {
			return
		}
		p, ok := a.protector()
		if !ok || p.Name == a.cfg.Name {
			return
		}
		if p.Name != protector {
			d.reset()
			protector = p.Name
		}
		d.digestNew(ctx, a.netlog.cap.Log(), maxDigestsPerTick)
		for len(d.pending) > 0 {
			n := min(len(d.pending), maxDigestBatch)
			if err := a.sendDigests(ctx, p.Name, d.pending[:n]); err != nil {
				a.log.Debug("digests not delivered; retrying", "protector", p.Name, "pending", len(d.pending), "err", err)
				return
			}
			d.pending = d.pending[n:]
		}
		d.pending = nil // release the shipped backing array
	})
}

// digestBatch precedes Count BlockDigest lines on an opDigests connection.
type digestBatch struct {
	Count int `json:"count"`
}

func (a *Agent) sendDigests(ctx context.Context, peer string, ds []BlockDigest) error {
	c, err := a.open(ctx, peer, opDigests, 5*time.Second, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	w := bufio.NewWriter(c)
	if err := writeHeader(w, digestBatch{Count: len(ds)}); err != nil {
		return err
	}
	enc := json.NewEncoder(w) // one JSON line per digest
	for _, d := range ds {
		if err := enc.Encode(d); err != nil {
			return err
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	var ack struct{ Stored int }
	return c.readReply(&ack)
}

// serveDigests stores the digests a protected node ships.
func (a *Agent) serveDigests(c net.Conn, peer string) {
	var b digestBatch
	if err := a.readRequest(c, &b, maxHeader); err != nil {
		a.refuse(peer, opDigests, err)
		return
	}
	if b.Count < 0 || b.Count > maxDigestBatch {
		a.refuse(peer, opDigests, fmt.Errorf("batch of %d digests: 0 to %d", b.Count, maxDigestBatch))
		return
	}
	c.SetReadDeadline(time.Now().Add(a.largeTimeout(maxDigestBatch * maxDigestLine)))
	ds, err := readDigests(c, b.Count)
	if err != nil {
		a.refuse(peer, opDigests, err)
		return
	}
	a.digests.add(peer, ds, time.Now())
	a.reply(c, peer, opDigests, struct{ Stored int }{len(ds)})
}

// maxDigestLine bounds one BlockDigest line (with two IPv6 endpoints it is under 150 bytes).
const maxDigestLine = 256

// readDigests reads the count BlockDigest lines of a batch (count already bounded by maxDigestBatch),
// never more than count*maxDigestLine bytes, and refuses a digest that is not of a whole block.
func readDigests(r io.Reader, count int) ([]BlockDigest, error) {
	dec := json.NewDecoder(io.LimitReader(r, int64(count)*maxDigestLine+1))
	ds := make([]BlockDigest, 0, count)
	for range count {
		var d BlockDigest
		if err := dec.Decode(&d); err != nil {
			return nil, fmt.Errorf("digest %d of %d: %w", len(ds)+1, count, err)
		}
		if d.Seq%DigestBlockSize != 0 || !d.Src.IsValid() || !d.Dst.IsValid() {
			return nil, fmt.Errorf("digest %+v is not a block of a connection", d)
		}
		ds = append(ds, d)
	}
	return ds, nil
}

// digestStore holds, on a protector, the digests of the nodes it protects, in memory and on disk.
type digestStore struct {
	dir   string
	mu    sync.Mutex
	nodes map[string]*nodeDigests
}

type nodeDigests struct {
	conns map[netlog.Conn]*connBlocks
	dirty bool
}

type connBlocks struct {
	crc     map[uint32]uint32 // block wire sequence -> CRC-32C
	newest  uint32
	updated time.Time
}

func (cb *connBlocks) put(seq, crc uint32) {
	if len(cb.crc) == 0 || int32(seq-cb.newest) > 0 {
		cb.newest = seq
	}
	cb.crc[seq] = crc
}

// trimOld keeps the newest maxDigestBlocksPerConn blocks' worth of stream.
func (cb *connBlocks) trimOld() {
	if len(cb.crc) <= maxDigestBlocksPerConn {
		return
	}
	for s := range cb.crc {
		if cb.newest-s >= maxDigestBlocksPerConn*DigestBlockSize {
			delete(cb.crc, s)
		}
	}
}

// openDigestStore loads the digests kept in dir. An unreadable file is reported and skipped: those
// digests are missing, which a recovery reports as unverified blocks.
func openDigestStore(dir string, log interface{ Warn(string, ...any) }) (*digestStore, error) {
	s := &digestStore{dir: dir, nodes: map[string]*nodeDigests{}}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create digest directory: %w", err)
	}
	// Root only, also when an older version made it otherwise; files are written 0600 (atomicfile).
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("restrict digest directory %s to root: %w", dir, err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		node, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || e.IsDir() {
			continue
		}
		nd, err := loadNodeDigests(filepath.Join(dir, e.Name()))
		if err != nil {
			log.Warn("digests of a protected node unreadable; its re-sent bytes will not be verified", "node", node, "err", err)
			continue
		}
		s.nodes[node] = nd
	}
	return s, nil
}

func loadNodeDigests(path string) (*nodeDigests, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var cds []ConnDigests
	if err := json.Unmarshal(b, &cds); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	nd := &nodeDigests{conns: map[netlog.Conn]*connBlocks{}}
	for _, cd := range cds {
		blocks, newest, err := cd.index()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		nd.conns[netlog.Conn{Src: cd.Src, Dst: cd.Dst}] = &connBlocks{crc: blocks, newest: newest}
	}
	return nd, nil
}

// validNodeName keeps a member name usable as a file name.
func validNodeName(node string) bool {
	return node != "" && node != "." && node != ".." && !strings.ContainsAny(node, `/\`)
}

func (s *digestStore) add(node string, ds []BlockDigest, now time.Time) {
	if s == nil || !validNodeName(node) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	nd := s.nodes[node]
	if nd == nil {
		nd = &nodeDigests{conns: map[netlog.Conn]*connBlocks{}}
		s.nodes[node] = nd
	}
	touched := map[*connBlocks]bool{}
	for _, d := range ds {
		k := netlog.Conn{Src: d.Src, Dst: d.Dst}
		cb := nd.conns[k]
		if cb == nil {
			cb = &connBlocks{crc: map[uint32]uint32{}}
			nd.conns[k] = cb
		}
		cb.put(d.Seq, d.CRC)
		cb.updated = now
		touched[cb] = true
	}
	for cb := range touched {
		cb.trimOld()
	}
	nd.limit()
	nd.dirty = true
}

// limit drops the connections updated longest ago until the node is within maxDigestBlocksPerNode.
func (nd *nodeDigests) limit() {
	total := 0
	for _, cb := range nd.conns {
		total += len(cb.crc)
	}
	for total > maxDigestBlocksPerNode {
		var oldest netlog.Conn
		var at time.Time
		for k, cb := range nd.conns {
			if at.IsZero() || cb.updated.Before(at) {
				oldest, at = k, cb.updated
			}
		}
		total -= len(nd.conns[oldest].crc)
		delete(nd.conns, oldest)
	}
}

// prune drops the digests a new snapshot of node makes useless: blocks that end at or before the
// snapshot's write_seq are never re-sent from it.
func (s *digestStore) prune(node string, conns []ckpt.Conn) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	nd := s.nodes[node]
	if nd == nil {
		return
	}
	for _, c := range conns {
		cb := nd.conns[netlog.Conn{Src: c.Local, Dst: c.Remote}]
		if cb == nil {
			continue
		}
		for seq := range cb.crc {
			if int32(seq+DigestBlockSize-c.OutqSeq) <= 0 {
				delete(cb.crc, seq)
				nd.dirty = true
			}
		}
	}
}

// forRecovery is node's digests of the blocks that a restore from snapshots with these connections may
// re-send: those past each connection's write_seq.
func (s *digestStore) forRecovery(node string, conns []ckpt.Conn) []ConnDigests {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	nd := s.nodes[node]
	if nd == nil {
		return nil
	}
	var out []ConnDigests
	for _, c := range conns {
		cb := nd.conns[netlog.Conn{Src: c.Local, Dst: c.Remote}]
		if cb == nil {
			continue
		}
		sel := map[uint32]uint32{}
		for seq, crc := range cb.crc {
			if int32(seq+DigestBlockSize-c.OutqSeq) > 0 { // the block ends past write_seq
				sel[seq] = crc
			}
		}
		if len(sel) > 0 {
			out = append(out, ConnDigests{Src: c.Local, Dst: c.Remote, Runs: encodeRuns(sel, cb.newest)})
		}
	}
	return out
}

// drop forgets node's digests (its recovery is over).
func (s *digestStore) drop(node string) error {
	if s == nil || !validNodeName(node) {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.nodes, node)
	if err := os.Remove(filepath.Join(s.dir, node+".json")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// flush writes every node whose digests changed (write, fsync, rename).
func (s *digestStore) flush() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for node, nd := range s.nodes {
		if !nd.dirty {
			continue
		}
		var cds []ConnDigests
		for k, cb := range nd.conns {
			if len(cb.crc) > 0 {
				cds = append(cds, ConnDigests{Src: k.Src, Dst: k.Dst, Runs: encodeRuns(cb.crc, cb.newest)})
			}
		}
		if err := atomicfile.WriteJSON(filepath.Join(s.dir, node+".json"), cds); err != nil {
			errs = append(errs, fmt.Errorf("digests of %s: %w", node, err))
			continue
		}
		nd.dirty = false
	}
	return errors.Join(errs...)
}

// resentCheck counts the whole blocks of a re-sent range and what became of each.
type resentCheck struct {
	Blocks, Verified, NoDigest, NotLogged int
}

func (r *resentCheck) addUp(o resentCheck) {
	r.Blocks += o.Blocks
	r.Verified += o.Verified
	r.NoDigest += o.NoDigest
	r.NotLogged += o.NotLogged
}

// MismatchError names a re-sent block whose bytes differ from those the peer received.
type MismatchError struct {
	Conn      netlog.Conn
	From, To  uint32 // wire sequence range of the block
	Got, Want uint32 // CRC-32C of the re-sent bytes and of the bytes the peer received
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("connection %s: bytes [%d, %d) (TCP sequence numbers) re-sent with CRC-32C %08x, the peer received CRC-32C %08x: %v",
		e.Conn, e.From, e.To, e.Got, e.Want, ErrNondeterministic)
}

func (e *MismatchError) Unwrap() error { return ErrNondeterministic }

// checkResent compares every whole block of the re-sent range [from, from+length) that has a digest in
// want with crcOf's CRC of the re-sent bytes, and stops at the first mismatch. A block crcOf cannot read
// counts as not logged, never as verified.
func checkResent(conn netlog.Conn, from, length uint32, want map[uint32]uint32, crcOf func(seq uint32) (uint32, error)) (resentCheck, error) {
	first, n := resentBlocks(from, length)
	r := resentCheck{Blocks: n}
	for i := range n {
		seq := first + uint32(i)*DigestBlockSize
		w, ok := want[seq]
		if !ok {
			r.NoDigest++
			continue
		}
		got, err := crcOf(seq)
		if err != nil {
			r.NotLogged++
			continue
		}
		if got != w {
			return r, &MismatchError{Conn: conn, From: seq, To: seq + DigestBlockSize, Got: got, Want: w}
		}
		r.Verified++
	}
	return r, nil
}

// digestIndex turns a recovery request's digests into connection -> block -> CRC. A protector keeps at
// most maxDigestBlocksPerNode blocks of a node, so a request with more (or with a connection twice) is
// malformed.
func digestIndex(cds []ConnDigests) (map[netlog.Conn]map[uint32]uint32, error) {
	out := map[netlog.Conn]map[uint32]uint32{}
	total := 0
	for _, cd := range cds {
		k := netlog.Conn{Src: cd.Src, Dst: cd.Dst}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("digests of %s -> %s given twice", cd.Src, cd.Dst)
		}
		for _, r := range cd.Runs {
			if total += len(r.CRCs) / 4; total > maxDigestBlocksPerNode {
				return nil, fmt.Errorf("digests of more than %d blocks: more than a protector keeps of one node", maxDigestBlocksPerNode)
			}
		}
		blocks, _, err := cd.index()
		if err != nil {
			return nil, err
		}
		out[k] = blocks
	}
	return out, nil
}

// verifyResent compares the bytes a restored job re-sent, as this host's log captured them, with the failed
// node's digests of what the peers received. At a mismatch it kills the job: from there on its peers would
// get bytes of a different execution. The detail says how much was verified and why the rest was not.
func (a *Agent) verifyResent(ctx context.Context, r *restoring, want map[netlog.Conn]map[uint32]uint32) (string, error) {
	var sum resentCheck
	var why []string
	for _, c := range r.plan.Conns {
		if c.Resend == 0 {
			continue
		}
		conn := netlog.Conn{Src: c.Conn.Local, Dst: c.Conn.Remote}
		first, n := resentBlocks(c.Conn.OutqSeq, c.Resend)
		if n == 0 {
			continue // no whole block re-sent
		}
		digests := want[conn]
		if a.netlog == nil {
			sum.addUp(resentCheck{Blocks: n, NotLogged: n})
			why = append(why, "the sender-side log is disabled here")
			continue
		}
		if a.memberByIP(c.Conn.Remote.Addr()) == a.cfg.Name {
			sum.addUp(resentCheck{Blocks: n, NotLogged: n})
			why = append(why, fmt.Sprintf("%s is on this host, whose traffic is not logged", c.Conn.Remote))
			continue
		}
		if len(digests) > 0 {
			a.waitLogged(ctx, conn, first+uint32(n)*DigestBlockSize)
		}
		l := a.netlog.cap.Log()
		res, err := checkResent(conn, c.Conn.OutqSeq, c.Resend, digests, func(seq uint32) (uint32, error) {
			abs, err := l.Unwrap(conn, seq)
			if err != nil {
				return 0, err
			}
			h := crc32.New(castagnoli)
			_, err = l.WriteRange(ctx, h, conn, abs, abs+DigestBlockSize)
			return h.Sum32(), err
		})
		sum.addUp(res)
		if res.NotLogged > 0 {
			why = append(why, fmt.Sprintf("%d re-sent block(s) of %s missing from this host's log", res.NotLogged, conn))
		}
		if err != nil {
			a.killJob(r.job.ID, err)
			return verifySummary(sum, why), err
		}
	}
	return verifySummary(sum, why), nil
}

// waitLogged waits (a little) until this host's log holds conn's bytes up to wire sequence end: the ring
// buffer's consumer may lag the socket.
func (a *Agent) waitLogged(ctx context.Context, conn netlog.Conn, end uint32) {
	l := a.netlog.cap.Log()
	ctx, cancel := context.WithTimeout(ctx, resentLogWait)
	defer cancel()
	for {
		if b, err := l.Bounds(conn); err == nil && b.Anchored {
			if abs, err := l.Unwrap(conn, end); err == nil && b.Contiguous >= abs {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func verifySummary(s resentCheck, why []string) string {
	out := fmt.Sprintf("re-sent bytes verified: %d of %d blocks", s.Verified, s.Blocks)
	if s.NoDigest > 0 {
		out += fmt.Sprintf("; %d block(s) NOT verified: no digest (sent in the failed node's last ~%s, or never delivered to its protector)", s.NoDigest, digestPeriod)
	}
	if s.NotLogged > 0 {
		out += fmt.Sprintf("; %d block(s) NOT verified: %s", s.NotLogged, strings.Join(why, "; "))
	}
	return out
}

// killJob stops a restored job that cannot continue; the shim records the signal and the agent marks the
// job ended.
func (a *Agent) killJob(id string, why error) {
	j, _, err := a.Job(id, 0)
	if err != nil || j.State != JobRunning {
		return
	}
	a.log.Error("killing restored job: it is not transparently recoverable", "job", id, "pid", j.PID, "err", why)
	if err := unix.Kill(j.PID, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
		a.log.Error("could not kill restored job", "job", id, "pid", j.PID, "err", err)
	}
}
