package ship

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path"
	"slices"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"golang.org/x/sys/unix"
)

// DefaultMaxSnapshotBytes bounds the uncompressed size of one received snapshot.
const DefaultMaxSnapshotBytes int64 = 256 << 30

// DefaultPerMiB is how long a receive may take per MiB of the snapshot beyond its idle timeout: the
// slowest link allowed for carries 1 MiB/s (as clusterapi.DefaultPerMiB).
const DefaultPerMiB = time.Second

// ErrTransferLimit marks a transfer refused for taking longer, or more bytes on the wire, than an honest
// sender of its snapshot can.
var ErrTransferLimit = errors.New("snapshot transfer over its limit")

// ReceiveOptions configure Receive.
type ReceiveOptions struct {
	// Peer is the sender's node name as authenticated by the caller (from
	// its TLS certificate). It is recorded as the replica holder of what is
	// received; empty records none.
	Peer string
	// Authorize, if set, may refuse a snapshot by its manifest before any
	// file is transferred (e.g. FromNode(peer) on a protector).
	Authorize func(*ckpt.Manifest) error
	// BeforeCommit, if set, is asked once every file has arrived and verified, just before the commit:
	// an error refuses the snapshot (the sender gets a NACK with it, the copy is discarded); otherwise
	// done, if not nil, is called with the commit's result when it is over, so that the caller can hold a
	// lock across it (a protector that declares the sender failed meanwhile must not see its replica
	// commit after it chose which one to restore).
	BeforeCommit func(*ckpt.Manifest) (done func(error), err error)
	// MaxSnapshotBytes bounds the sum of file sizes; 0 means DefaultMaxSnapshotBytes.
	MaxSnapshotBytes int64
	// IdleTimeout bounds waiting for the sender (connections with deadlines
	// only); 0 means DefaultIdleTimeout.
	IdleTimeout time.Duration
	// PerMiB bounds the whole transfer, from its MANIFEST on, to the idle timeout plus PerMiB per MiB of the
	// snapshot (twice: a refused diff and its resend in full; plus the sender's hashing of a base), and its
	// bytes on the wire to what the snapshot can take: a sender that trickles just inside the idle timeout,
	// or sends frames that carry nothing, is refused instead of holding the pending copy, its lock and a
	// goroutine without end. 0 means DefaultPerMiB.
	PerMiB time.Duration
	// NoDelta offers no base snapshot, so every file comes whole.
	NoDelta bool
	// ShareBlocks has a file rebuilt from a base share the blocks the diff takes from the base instead of
	// writing them again, where the file system can share blocks between files (FICLONERANGE: XFS with
	// reflink, the default of current mkfs.xfs, and btrfs): a replica that changed a tenth costs a tenth
	// of its size in writes and disk space. The shared blocks are not cached under the new file's name,
	// and are one copy on disk: a bad block damages every replica that shares it (the verification of
	// each then refuses it).
	ShareBlocks bool
	Logger      *slog.Logger
}

// Received describes one completed incoming transfer.
type Received struct {
	// Manifest describes the local copy, which was verified during the call:
	// hashed against the manifest at commit, or re-verified when AlreadyHad.
	Manifest *ckpt.Manifest
	// AlreadyHad is true when a verified copy was already in the store and
	// no file was transferred.
	AlreadyHad bool
	Bytes      int64 // snapshot bytes written
	WireBytes  int64 // bytes read from the connection
	// BaseID is the snapshot the sender diffed against ("" if it sent every
	// file whole), and CopiedBytes what was taken from it.
	BaseID      string
	CopiedBytes int64
	// DeltaRefused is true when a diff did not apply here and the sender
	// resent the snapshot in full.
	DeltaRefused bool
	// SharedBytes is what of CopiedBytes shares the base's disk blocks instead of being written
	// (ReceiveOptions.ShareBlocks).
	SharedBytes int64
	Duration    time.Duration
}

// Receive reads one snapshot transfer from conn into store, verifies it,
// commits it, and acknowledges. It returns io.EOF if the sender closed the
// connection cleanly before starting a transfer, so a caller can loop:
//
//	for { if _, err := ship.Receive(ctx, conn, store, opts); err != nil { break } }
//
// On any failure the pending copy is discarded, the sender gets a NACK with
// the reason when the stream still allows it, nothing becomes visible, and
// a local copy of the same snapshot (damaged or different, being replaced)
// stays as it was; the caller must then close conn.
func Receive(ctx context.Context, conn io.ReadWriter, store *ckpt.Store, opts ReceiveOptions) (*Received, error) {
	start := time.Now()
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opts.MaxSnapshotBytes <= 0 {
		opts.MaxSnapshotBytes = DefaultMaxSnapshotBytes
	}
	if opts.PerMiB <= 0 {
		opts.PerMiB = DefaultPerMiB
	}
	g := newGuard(ctx, conn, opts.IdleTimeout)
	defer g.release()
	fr := newFrameReader(&armedReader{r: conn, g: g})
	bw := bufio.NewWriterSize(&armedWriter{w: conn, g: g}, 4096)
	reply := func(t frameType, payload []byte) error {
		if err := writeFrame(bw, t, payload); err != nil {
			return err
		}
		return bw.Flush()
	}

	t, p, err := fr.next()
	if err == io.EOF {
		return nil, io.EOF
	}
	if err != nil {
		return nil, wrapCtx(ctx, "receive snapshot: read HELLO", err)
	}
	var version uint16
	if t != frameHello {
		err = protoErr("stream starts with %v, want HELLO", t)
	} else {
		version, err = checkHello(p)
	}
	if err != nil {
		reply(frameNack, reason(err))
		return nil, fmt.Errorf("receive snapshot: %w", err)
	}
	// The transfer has begun: the manifest may take as long as one of the largest (run then bounds the
	// rest by the manifest's size).
	d := transferTime(ckpt.MaxManifestBytes, g.idle, opts.PerMiB, 0)
	g.limit(time.Now().Add(d), fmt.Errorf("%w: no manifest within %v of HELLO: the sender stalls or trickles; check its link and agent", ErrTransferLimit, d))

	rc := &receiver{ctx: ctx, fr: fr, g: g, store: store, opts: opts, log: log, version: version}
	res, err := rc.run(reply)
	if err != nil {
		if rc.pending != nil {
			if aerr := rc.pending.Abort(); aerr != nil {
				log.Warn("could not discard failed incoming snapshot", "err", aerr)
			}
		}
		err = wrapCtx(ctx, "receive snapshot", err)
		if !rc.peerAborted {
			if rerr := reply(frameNack, reason(err)); rerr == nil {
				drain(conn, g)
			}
		}
		log.Warn("incoming snapshot refused", "err", err)
		return nil, err
	}
	res.WireBytes = fr.n
	res.Duration = time.Since(start)
	log.Info("snapshot received", "job", res.Manifest.Job, "id", res.Manifest.ID,
		"bytes", res.Bytes, "wire_bytes", res.WireBytes, "already_had", res.AlreadyHad, "base", res.BaseID,
		"copied_bytes", res.CopiedBytes, "shared_bytes", res.SharedBytes, "delta_refused", res.DeltaRefused, "duration", res.Duration)
	return res, nil
}

// drain discards what the sender is still sending, briefly, so our NACK is
// read before the connection closes (closing with unread data sends a RST
// that can destroy the NACK in flight).
func drain(conn io.ReadWriter, g *guard) {
	if g.d == nil {
		return
	}
	g.mu.Lock()
	if !g.cancelled {
		g.d.SetDeadline(time.Now().Add(min(2*time.Second, g.idle)))
	}
	g.mu.Unlock()
	io.Copy(io.Discard, io.LimitReader(conn, 64<<20))
}

func wrapCtx(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil && !errors.Is(err, ctx.Err()) {
		return fmt.Errorf("%s: %w (%v)", what, ctx.Err(), err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

type receiver struct {
	ctx         context.Context
	fr          *frameReader
	g           *guard
	store       *ckpt.Store
	opts        ReceiveOptions
	log         *slog.Logger
	pending     *ckpt.Pending
	peerAborted bool
	version     uint16
	base        *rootBase // the base of the current attempt, if any
	baseBS      int
	baseID      string // of the attempt that succeeded
	copied      int64
	shared      int64 // of copied, the bytes that share the base's blocks
	noShare     bool  // the file system refused to share blocks: write them
	copyBuf     []byte
	// baseBytes is the size of the largest base offered, which the sender may read and hash whole before
	// BASE: a job whose memory shrank has bases far larger than its new snapshot.
	baseBytes int64
}

func (rc *receiver) run(reply func(frameType, []byte) error) (*Received, error) {
	t, p, err := rc.fr.next()
	if err != nil {
		return nil, fmt.Errorf("read MANIFEST: %w", err)
	}
	if t != frameManifest {
		return nil, protoErr("got %v, want MANIFEST", t)
	}
	m, err := ckpt.DecodeManifest(p)
	if err != nil {
		return nil, err
	}
	if rc.opts.Authorize != nil {
		if err := rc.opts.Authorize(m); err != nil {
			return nil, fmt.Errorf("snapshot %s/%s not authorized: %w", m.Job, m.ID, err)
		}
	}
	if total := m.TotalSize(); total > rc.opts.MaxSnapshotBytes {
		return nil, fmt.Errorf("snapshot %s/%s is %d bytes, more than the %d this receiver accepts", m.Job, m.ID, total, rc.opts.MaxSnapshotBytes)
	}

	if have, err := rc.store.Manifest(m.Job, m.ID); err == nil {
		if _, verr := rc.store.Verify(rc.ctx, m.Job, m.ID); verr == nil && sameFiles(have, m) {
			if err := reply(frameHave, []byte(rc.store.Node())); err != nil {
				return nil, err
			}
			return &Received{Manifest: have, AlreadyHad: true}, nil
		}
	}
	var offers []string
	if rc.version >= 2 && !rc.opts.NoDelta {
		offers = rc.offers(m)
	}
	rc.bound(m, len(offers) > 0)
	res := &Received{}
	for attempt := 0; ; attempt++ {
		n, err := rc.attempt(m, offers, reply)
		res.Bytes = n
		if err == nil {
			break
		}
		if !errors.Is(err, errDeltaRefused) || attempt > 0 {
			return nil, err
		}
		// The diff does not apply to our base: discard, ask for the whole
		// snapshot, and skip what the sender still sends of the diff.
		rc.log.Warn("snapshot diff does not apply to the local base; asking for the whole snapshot", "job", m.Job, "id", m.ID, "err", err)
		if aerr := rc.pending.Abort(); aerr != nil {
			return nil, aerr
		}
		rc.pending = nil
		if err := reply(frameRetry, reason(err)); err != nil {
			return nil, err
		}
		if err := rc.skipAttempt(); err != nil {
			return nil, err
		}
		offers = nil
		res.DeltaRefused = true
	}
	var done func(error)
	if rc.opts.BeforeCommit != nil {
		if done, err = rc.opts.BeforeCommit(m); err != nil {
			return nil, fmt.Errorf("snapshot %s/%s not committed: %w", m.Job, m.ID, err)
		}
	}
	got, err := rc.pending.CommitReceived(rc.ctx, rc.opts.Peer)
	if done != nil {
		done(err)
	}
	if err != nil {
		return nil, err
	}
	rc.pending = nil
	if err := reply(frameOK, []byte(rc.store.Node())); err != nil {
		// Committed but the sender will not record us as a replica; it
		// will resend and get HAVE.
		return nil, fmt.Errorf("snapshot committed but acknowledging failed: %w", err)
	}
	res.Manifest, res.CopiedBytes, res.BaseID, res.SharedBytes = got, rc.copied, rc.baseID, rc.shared
	return res, nil
}

// bound limits the rest of the transfer of m, from now on, to the time (transferTime) and the bytes on the
// wire (wireBudget) an honest sender of m can take; delta says a diff may come.
func (rc *receiver) bound(m *ckpt.Manifest, delta bool) {
	total := m.TotalSize()
	var hash int64
	if delta {
		hash = rc.hashBytes(m)
	}
	d := transferTime(total, rc.g.idle, rc.opts.PerMiB, hash)
	rc.g.limit(time.Now().Add(d), fmt.Errorf("%w: snapshot %s/%s of %d bytes not received within %v (%v per MiB after an idle timeout of %v): the sender stalls or trickles; check its link and agent",
		ErrTransferLimit, m.Job, m.ID, total, d, rc.opts.PerMiB, rc.g.idle))
	w := wireBudget(m)
	rc.fr.max = rc.fr.n + w
	rc.fr.maxErr = fmt.Errorf("%w: the sender of snapshot %s/%s of %d bytes sent more than the %d bytes it can take on the wire (frames that carry nothing?)",
		ErrTransferLimit, m.Job, m.ID, total, w)
}

// hashBytes is what the sender of m may read and hash before BASE: the largest base offered, or m's size
// if larger.
func (rc *receiver) hashBytes(m *ckpt.Manifest) int64 {
	return max(m.TotalSize(), rc.baseBytes)
}

// transferTime is how long a transfer of a snapshot of size bytes may take: the idle timeout, plus size at
// perMiB per MiB twice (a refused diff and its resend in full), plus, if hash > 0, the sender's hashing of
// a base of hash bytes first (hashAllowance).
func transferTime(size int64, idle, perMiB time.Duration, hash int64) time.Duration {
	const most = time.Duration(math.MaxInt64 / 4) // decades: no bound
	mib := size>>20 + 1
	if mib > int64(most/(2*perMiB)) {
		return most
	}
	d := idle + time.Duration(2*mib)*perMiB
	if hash > 0 {
		d += hashAllowance(hash)
	}
	return d
}

// wireBudget is the most an honest sender of m sends after its MANIFEST: every file compressed (which
// grows incompressible data by well under half, with the framing of S2, LZ4 and diffs) with its FILE,
// DATA and END frames, twice (a refused diff and its resend in full).
func wireBudget(m *ckpt.Manifest) int64 {
	total := m.TotalSize()
	if total > math.MaxInt64/8 {
		return math.MaxInt64
	}
	perFile := int64(2*headerLen + maxPayload(frameFile) + 1<<10)
	return 2 * (total + total/2 + int64(len(m.Files))*perFile + 1<<20)
}

// offers lists the committed snapshots of the same job taken on the same
// node that this store holds, newest first: the bases a diff may use. Only
// the snapshot's own node's, so that a sender can never probe the contents of
// another node's snapshots through the block checks.
func (rc *receiver) offers(m *ckpt.Manifest) []string {
	ids, err := rc.store.List(m.Job, m.Node)
	if err != nil {
		rc.log.Warn("cannot list base snapshots for a diff; receiving whole files", "job", m.Job, "err", err)
		return nil
	}
	var out []string
	for _, id := range ids {
		if id != m.ID && len(out) < maxOffers {
			out = append(out, id)
			// The sender hashes its copy of the base it picks, which readBase requires to list these files.
			if bm, err := rc.store.Manifest(m.Job, id); err == nil {
				rc.baseBytes = max(rc.baseBytes, bm.TotalSize())
			}
		}
	}
	return out
}

// attempt receives the files of m once (into a new pending copy) up to DONE.
func (rc *receiver) attempt(m *ckpt.Manifest, offers []string, reply func(frameType, []byte) error) (int64, error) {
	var err error
	if _, lerr := os.Lstat(rc.store.Path(m.Job, m.ID)); lerr == nil {
		// A damaged or different local copy: the sender's replaces it, but
		// only once the new copy has verified (the commit swaps them), so a
		// failed transfer loses nothing.
		rc.log.Warn("local copy of snapshot is damaged or differs from the sender's; receiving a replacement", "job", m.Job, "id", m.ID)
		rc.pending, err = rc.store.BeginReplace(m)
	} else {
		rc.pending, err = rc.store.BeginReceive(m)
	}
	if err != nil {
		return 0, err
	}
	root, err := os.OpenRoot(rc.pending.Dir())
	if err != nil {
		return 0, fmt.Errorf("open pending dir: %w", err)
	}
	defer root.Close()
	var accept []byte
	if rc.version >= 2 {
		accept = offersPayload(offers)
	}
	if err := reply(frameAccept, accept); err != nil {
		return 0, err
	}
	rc.baseID = ""
	if rc.version >= 2 {
		// A sender without the index of the base it picks reads and hashes the base first: up to the
		// largest offered base's size from its disk (hashBytes), far beyond the idle timeout for a large job.
		if len(offers) > 0 {
			rc.g.allow(hashAllowance(rc.hashBytes(m)))
		}
		err := rc.readBase(m, offers)
		rc.g.allow(0)
		if err != nil {
			return 0, err
		}
		if rc.base != nil {
			defer func() { rc.base.Close(); rc.base = nil }()
		}
	}

	var written int64
	zr := newDecompressor(rc.version)
	h := newHashPipe()
	rc.copied, rc.shared = 0, 0
	for _, want := range m.Files {
		if err := rc.ctx.Err(); err != nil {
			return written, err
		}
		n, err := rc.receiveFile(root, zr, h, want)
		written += n
		if err != nil {
			return written, err
		}
	}
	t, p, err := rc.fr.next()
	if err != nil {
		return written, fmt.Errorf("read DONE: %w", err)
	}
	if t == frameAbort {
		rc.peerAborted = true
		return written, fmt.Errorf("sender aborted: %s", sanitize(p))
	}
	if t != frameDone {
		return written, protoErr("got %v after the last file, want DONE", t)
	}
	return written, nil
}

// readBase reads BASE and opens the base it names, which must be one of
// offers and have the file list the sender indexed; otherwise the diff is
// refused (errDeltaRefused) before any file.
func (rc *receiver) readBase(m *ckpt.Manifest, offers []string) error {
	t, p, err := rc.fr.next()
	if err != nil {
		return fmt.Errorf("read BASE: %w", err)
	}
	if t == frameAbort {
		rc.peerAborted = true
		return fmt.Errorf("sender aborted: %s", sanitize(p))
	}
	if t != frameBase {
		return protoErr("got %v, want BASE", t)
	}
	ref, ok, err := parseBase(p)
	if err != nil || !ok {
		return err
	}
	if !slices.Contains(offers, ref.id) {
		return protoErr("BASE %s was not offered", ref.id)
	}
	bm, err := rc.store.Manifest(m.Job, ref.id)
	if err != nil {
		return fmt.Errorf("%w: base %s: %v", errDeltaRefused, ref.id, err)
	}
	if filesDigest(bm.Files) != ref.digest {
		return fmt.Errorf("%w: base %s here lists other files than the sender's", errDeltaRefused, ref.id)
	}
	b, err := newRootBase(rc.store.Path(m.Job, ref.id), bm.Files)
	if err != nil {
		return fmt.Errorf("%w: open base %s: %v", errDeltaRefused, ref.id, err)
	}
	rc.base, rc.baseBS, rc.baseID = b, ref.bs, ref.id
	return nil
}

// skipAttempt discards the rest of a refused attempt, up to the sender's
// ABORT or DONE, reading at most what the snapshot could take on the wire.
func (rc *receiver) skipAttempt() error {
	limit := rc.fr.n + rc.opts.MaxSnapshotBytes + rc.opts.MaxSnapshotBytes/2 + 1<<20
	for rc.fr.n <= limit {
		t, _, err := rc.fr.next()
		if err != nil {
			return fmt.Errorf("skip the refused diff: %w", err)
		}
		if t == frameAbort || t == frameDone {
			return nil
		}
	}
	return protoErr("sender keeps sending after the diff was refused")
}

// FromNode is an Authorize policy for a protector: the connection's
// authenticated peer may only push snapshots taken on that same node.
func FromNode(peer string) func(*ckpt.Manifest) error {
	return func(m *ckpt.Manifest) error {
		if m.Node != peer {
			return fmt.Errorf("peer %q may not send snapshots of node %q", peer, m.Node)
		}
		return nil
	}
}

func sameFiles(a, b *ckpt.Manifest) bool {
	if len(a.Files) != len(b.Files) {
		return false
	}
	for i := range a.Files {
		if a.Files[i] != b.Files[i] {
			return false
		}
	}
	return true
}

func (rc *receiver) receiveFile(root *os.Root, zr decompressor, h *hashPipe, want ckpt.FileEntry) (int64, error) {
	t, p, err := rc.fr.next()
	if err != nil {
		return 0, fmt.Errorf("read FILE %s: %w", want.Name, err)
	}
	if t == frameAbort {
		rc.peerAborted = true
		return 0, fmt.Errorf("sender aborted: %s", sanitize(p))
	}
	delta := t == frameDFile
	if t != frameFile && !delta {
		return 0, protoErr("got %v, want FILE %s", t, want.Name)
	}
	if delta && rc.base == nil {
		return 0, protoErr("DFILE %s without a base", want.Name)
	}
	name, size, err := parseFile(p)
	if err != nil {
		return 0, err
	}
	if name != want.Name || size != want.Size {
		return 0, protoErr("got FILE %q (%d bytes), manifest order wants %q (%d bytes)", name, size, want.Name, want.Size)
	}
	if dir := path.Dir(name); dir != "." {
		// Memory images: root only (the commit enforces it again).
		if err := root.MkdirAll(dir, 0o700); err != nil {
			return 0, fmt.Errorf("create directory for %s: %w", name, err)
		}
	}
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, fmt.Errorf("create %s: %w", name, err)
	}
	defer f.Close()
	h.start()
	hashing := true
	defer func() {
		if hashing {
			h.finish()
		}
	}()
	dr := &dataReader{rc: rc}
	zr.Reset(dr)
	wb := &writebackFile{f: f, size: size}
	lw := &limitedWriter{w: wb, h: h, left: size}
	var n int64
	if delta {
		var copied int64
		bw := bufio.NewWriterSize(lw, 1<<20)
		copied, err = applyDelta(zr, &rebuiltFile{rc: rc, bw: bw, lw: lw, wb: wb}, size, rc.baseBS, rc.base)
		if err == nil {
			err = bw.Flush()
		}
		n = size - lw.left
		rc.copied += copied
		if err != nil && (errors.Is(err, errDeltaRefused) || errors.Is(err, ErrProtocol)) {
			if dr.err != nil {
				return n, dr.err
			}
			return n, fmt.Errorf("file %s: %w", name, err)
		}
	} else {
		// Reads of an S2 block at a time: aligned writes, whose blocks of zeros wb finds whole.
		if rc.copyBuf == nil {
			rc.copyBuf = make([]byte, s2Block)
		}
		n, err = io.CopyBuffer(lw, zr, rc.copyBuf)
	}
	if err != nil {
		if lw.over {
			return n, fmt.Errorf("file %s decompresses to more than the %d bytes in the manifest", name, size)
		}
		if dr.err != nil {
			return n, dr.err
		}
		return n, fmt.Errorf("file %s: decompress: %w", name, err)
	}
	if !dr.ended {
		return n, protoErr("file %s: compressed data ended before END", name)
	}
	if n != size {
		return n, fmt.Errorf("file %s: %w (got %d bytes, manifest says %d)", name, ckpt.ErrTruncated, n, size)
	}
	if err := wb.finish(); err != nil {
		return n, fmt.Errorf("file %s: %w", name, err)
	}
	hashing = false
	if got := hex.EncodeToString(h.finish()); got != want.SHA256 {
		if delta {
			// The base blocks hashed right yet the whole differs (a fast
			// hash collision, or a base that changed under us): resend whole.
			return n, fmt.Errorf("file %s: %w: rebuilt from the base, its sha256 differs from the manifest", name, errDeltaRefused)
		}
		return n, fmt.Errorf("file %s: %w (sha256 differs from the manifest)", name, ckpt.ErrCorrupt)
	}
	if err := f.Close(); err != nil {
		return n, err
	}
	// Every byte of the file went through h on its way to the file: the commit need not read it back.
	rc.pending.Written(name, n, want.SHA256)
	return n, nil
}

// writebackEvery is how many bytes a received file takes between two starts of its writeback.
const writebackEvery = 8 << 20

// allocAhead is how far past what is written a received file's blocks are allocated.
const allocAhead = 64 << 20

// writebackFile writes to f (a file of size bytes) and starts the disk's writes every writebackEvery bytes,
// so that the commit's fsync waits only for the last few. It allocates the file's blocks allocAhead bytes
// at a time rather than one write at a time: with the hash on a goroutine of its own (hashPipe), a
// 100 MiB diff was received in 107-115 ms, against 139-158 without this (BenchmarkShipDelta). Ahead only
// so far, so that a sender announcing a huge file reserves little more of the disk than it sends; the
// file's size still grows only with what is written.
//
// Aligned blocks of zeros (holeBlock) are not written but left as holes, their blocks unallocated: a job's
// sparse output (a stdout it seeked 1 TiB into) costs the protector's disk what it holds, as the
// snapshot's own copy does (filecopy.Range), not its size. finish gives the file its size.
type writebackFile struct {
	f       *os.File
	size    int64
	written int64 // the file's bytes up to here are in: written, shared or left as holes
	alloc   int64 // blocks allocated up to here
	eof     int64 // the file's size
	since   int64
}

// holeBlock is the size and alignment of a block of zeros that a received file leaves as a hole.
const holeBlock = 64 << 10

func (w *writebackFile) Write(p []byte) (int, error) {
	total := len(p)
	for len(p) > 0 {
		data := dataBeforeHole(w.written, p)
		if err := w.write(p[:data]); err != nil {
			return total - len(p), err
		}
		p = p[data:]
		zeros := zeroBlocks(w.written, p)
		w.skip(int64(zeros))
		p = p[zeros:]
	}
	return total, nil
}

// dataBeforeHole is how many bytes of p, which goes at file offset off, come before its first aligned block
// of zeros.
func dataBeforeHole(off int64, p []byte) int {
	i := 0
	for i < len(p) {
		if (off+int64(i))%holeBlock == 0 && i+holeBlock <= len(p) && allZero(p[i:i+holeBlock]) {
			return i
		}
		i += int(holeBlock - (off+int64(i))%holeBlock)
	}
	return len(p)
}

// zeroBlocks is how many bytes of p, which goes at file offset off, are aligned blocks of zeros from its
// start.
func zeroBlocks(off int64, p []byte) int {
	if off%holeBlock != 0 {
		return 0
	}
	i := 0
	for i+holeBlock <= len(p) && allZero(p[i:i+holeBlock]) {
		i += holeBlock
	}
	return i
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.NativeEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// write writes p at the file's offset.
func (w *writebackFile) write(p []byte) error {
	if len(p) == 0 {
		return nil
	}
	if end := w.written + int64(len(p)); end > w.alloc && w.alloc < w.size {
		from := max(w.alloc, w.written) // past a hole, from here
		n := min(max(end-from, allocAhead), w.size-from)
		// A file system without fallocate allocates as the writes come, as before.
		_ = unix.Fallocate(int(w.f.Fd()), unix.FALLOC_FL_KEEP_SIZE, from, n)
		w.alloc = from + n
	}
	n, err := w.f.WriteAt(p, w.written)
	w.written += int64(n)
	w.eof = max(w.eof, w.written)
	if w.since += int64(n); w.since >= writebackEvery {
		ckpt.StartWriteback(w.f)
		w.since = 0
	}
	return err
}

// skip leaves n bytes of zeros as a hole, giving back what was allocated ahead for them.
func (w *writebackFile) skip(n int64) {
	if n == 0 {
		return
	}
	if end := min(w.written+n, w.alloc); w.written < end {
		// ext4 punches nothing past the end of the file: the size first. A file system that cannot punch
		// keeps those blocks: zeros all the same.
		if w.eof < end && w.f.Truncate(end) == nil {
			w.eof = end
		}
		_ = unix.Fallocate(int(w.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, w.written, end-w.written)
	}
	w.written += n
}

// shared counts n bytes that the file took by sharing blocks (rebuiltFile) as written: no allocation
// ahead from here on, since shared blocks replace what is allocated.
func (w *writebackFile) shared(n int64) {
	w.written += n
	w.eof = max(w.eof, w.written)
	w.alloc = w.size
}

// finish gives the file its size: a hole at its end was never written.
func (w *writebackFile) finish() error {
	if w.eof < w.written {
		if err := w.f.Truncate(w.written); err != nil {
			return err
		}
		w.eof = w.written
	}
	return nil
}

// rebuiltFile is the destination of a file rebuilt from a diff: writes are buffered (bw) on their way to
// the file (lw, then wb), and runs of base blocks share the base's disk blocks where the file system can
// (blockSharer), their bytes still hashed.
type rebuiltFile struct {
	rc *receiver
	bw *bufio.Writer
	lw *limitedWriter
	wb *writebackFile
}

func (d *rebuiltFile) Write(p []byte) (int, error) { return d.bw.Write(p) }

func (d *rebuiltFile) share(i uint32, off int64, p []byte) (bool, error) {
	rc := d.rc
	if rc.noShare || !rc.opts.ShareBlocks || int64(len(p)) > d.lw.left {
		return false, nil
	}
	src, err := rc.base.file(i)
	if err != nil {
		return false, nil // the caller's read just worked: let its write report what is wrong
	}
	if err := d.bw.Flush(); err != nil {
		return false, err
	}
	err = unix.IoctlFileCloneRange(int(d.wb.f.Fd()), &unix.FileCloneRange{
		Src_fd: int64(src.Fd()), Src_offset: uint64(off), Src_length: uint64(len(p)), Dest_offset: uint64(d.wb.written),
	})
	if err != nil {
		// ext4 and tmpfs cannot (EOPNOTSUPP), nor can two file systems (EXDEV), nor blocks larger than the
		// diff's (EINVAL): write this transfer's blocks, without asking again.
		rc.noShare = true
		rc.log.Debug("base blocks are written, not shared", "err", err)
		return false, nil
	}
	d.wb.shared(int64(len(p)))
	d.lw.h.Write(p)
	d.lw.left -= int64(len(p))
	rc.shared += int64(len(p))
	return true, nil
}

// dataReader yields the payloads of DATA frames up to the END frame.
type dataReader struct {
	rc    *receiver
	cur   []byte
	ended bool
	err   error
}

func (d *dataReader) Read(p []byte) (int, error) {
	for len(d.cur) == 0 {
		if d.ended {
			return 0, io.EOF
		}
		if d.err != nil {
			return 0, d.err
		}
		t, payload, err := d.rc.fr.next()
		switch {
		case err == io.EOF:
			d.err = io.ErrUnexpectedEOF
		case err != nil:
			d.err = err
		case t == frameData:
			d.cur = payload
		case t == frameEnd:
			d.ended = true
		case t == frameAbort:
			d.rc.peerAborted = true
			d.err = fmt.Errorf("sender aborted: %s", sanitize(payload))
		default:
			d.err = protoErr("got %v inside file data", t)
		}
	}
	n := copy(p, d.cur)
	d.cur = d.cur[n:]
	return n, nil
}

// limitedWriter writes and hashes at most left bytes; more is an error, so a
// decompression bomb cannot fill the disk.
type limitedWriter struct {
	w    io.Writer
	h    io.Writer // the sha256 of what is written
	left int64
	over bool
}

var errTooLong = errors.New("file longer than the manifest says")

func (l *limitedWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.left {
		l.over = true
		return 0, errTooLong
	}
	n, err := l.w.Write(p)
	l.h.Write(p[:n])
	l.left -= int64(n)
	return n, err
}
