package ship

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/klauspost/compress/s2"
)

// SendOptions configure Send.
type SendOptions struct {
	// Peer is the protector's node name as authenticated by the caller (TLS);
	// it is recorded as a replica once the protector acknowledges. Required.
	Peer string
	// IdleTimeout bounds waiting on the protector (connections with
	// deadlines only); 0 means DefaultIdleTimeout.
	IdleTimeout time.Duration
	// CompressConcurrency is the number of goroutines compressing each file;
	// 0 means 1 (the agent shares the node with the job).
	CompressConcurrency int
	// NoDelta sends every file whole even when the protector offers a base.
	NoDelta bool
	// DeltaBlock is the block size of diffs (a power of two from 4 KiB to
	// 1 MiB); 0 means DefaultDeltaBlock.
	DeltaBlock int
	// JustCommitted says the caller committed the snapshot moments ago (the commit hashed every file),
	// so its files are not hashed again as they are read, only their sizes checked: the protector checks
	// every byte it gets against the manifest anyway, so a local copy damaged in between is refused there
	// (a NACK) instead of here (a *ckpt.VerifyError). A migration, whose stop includes the transfer, saves
	// a pass over the dump (docs/design.md, planned migration).
	JustCommitted bool
	// Base, if set, is an index of a base built ahead (IndexBase, or the Sent.Index of its own transfer),
	// used when the protector offers that snapshot as the base: the transfer then does not read the base
	// first.
	Base *BaseIndex
	// KeepIndex asks for Sent.Index: the block hashes of the snapshot's large files, taken as they are read
	// (one xxhash64 pass over a file sent whole; a diff hashes its blocks anyway), so that the job's next
	// transfer can diff against this snapshot without reading it again.
	KeepIndex bool
	Logger    *slog.Logger
}

// deltaBlockOr is block, or DefaultDeltaBlock if block is 0.
func deltaBlockOr(block int) int {
	if block == 0 {
		return DefaultDeltaBlock
	}
	return block
}

// BaseIndex is a sender's index of a snapshot as the base of a diff (IndexBase).
type BaseIndex struct {
	idx  *baseIndex
	want int // the block size asked for
}

// ID is the snapshot the index is of.
func (b *BaseIndex) ID() string { return b.idx.id }

// Size is about the memory the index holds, in bytes.
func (b *BaseIndex) Size() int64 {
	var n int64
	for _, hs := range b.idx.hashes {
		n += 8 * int64(len(hs))
	}
	return n + 40*int64(len(b.idx.where))
}

// IndexBase indexes committed snapshot job/id of store as the base of a later Send's diff
// (SendOptions.Base, with the same DeltaBlock). A migration builds it while the job still runs: reading
// and hashing a 100 MiB base took 14 ms here, which the job's stop then does not include.
func IndexBase(ctx context.Context, store *ckpt.Store, job, id string, block int) (*BaseIndex, error) {
	block = deltaBlockOr(block)
	m, err := store.Manifest(job, id)
	if err != nil {
		return nil, fmt.Errorf("index base %s/%s: %w", job, id, err)
	}
	idx, err := indexBase(ctx, store.Path(job, id), m, block)
	if err != nil {
		return nil, fmt.Errorf("index base %s/%s: %w", job, id, err)
	}
	return &BaseIndex{idx: idx, want: block}, nil
}

// Sent describes one completed outgoing transfer.
type Sent struct {
	Manifest *ckpt.Manifest // with the new replica recorded
	// AlreadyPresent is true when the protector already had a verified copy.
	AlreadyPresent bool
	Bytes          int64 // snapshot bytes read and sent
	WireBytes      int64 // bytes written to the connection
	// BaseID is the snapshot, held by both sides, that large files were
	// diffed against ("" if every file went whole); CopiedBytes is what the
	// protector took from it instead of the wire.
	BaseID      string
	CopiedBytes int64
	// DeltaRefused is true when the protector could not apply the diff and
	// the snapshot was resent in full.
	DeltaRefused bool
	Duration     time.Duration
	// Index is the snapshot's own index as a base (SendOptions.KeepIndex), for its job's next transfer
	// (SendOptions.Base); nil unless asked for, or if the protector already had the snapshot.
	Index *BaseIndex
}

// RemoteError is a refusal reported by the receiver.
type RemoteError struct {
	Reason string // sanitized
}

func (e *RemoteError) Error() string { return "protector refused the snapshot: " + e.Reason }

// Send streams the committed snapshot job/id from store to the protector on
// conn, waits for its acknowledgement, and only then records opts.Peer as a
// replica in the local manifest. Files are hashed while read; a local file
// that no longer matches its manifest aborts the transfer with a
// *ckpt.VerifyError. Several snapshots may be sent over one connection one
// after another, but after any error the caller must close it.
func Send(ctx context.Context, conn io.ReadWriter, store *ckpt.Store, job, id string, opts SendOptions) (*Sent, error) {
	start := time.Now()
	if err := ckpt.ValidName(opts.Peer); err != nil {
		return nil, fmt.Errorf("send snapshot %s/%s: peer: %w", job, id, err)
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := store.Manifest(job, id)
	if err != nil {
		return nil, fmt.Errorf("send snapshot %s/%s: %w", job, id, err)
	}
	// Send the manifest without our replica list: replicas are per holder.
	wire := *m
	wire.Replicas = nil
	mb, err := wire.Encode()
	if err != nil {
		return nil, fmt.Errorf("send snapshot %s/%s: %w", job, id, err)
	}

	g := newGuard(ctx, conn, opts.IdleTimeout)
	defer g.release()
	aw := &armedWriter{w: conn, g: g}
	bw := bufio.NewWriterSize(aw, 256<<10)
	fr := newFrameReader(&armedReader{r: conn, g: g})
	fail := func(what string, err error) (*Sent, error) {
		return nil, wrapCtx(ctx, fmt.Sprintf("send snapshot %s/%s to %s: %s", job, id, opts.Peer, what), err)
	}

	if err := writeFrame(bw, frameHello, helloPayload()); err != nil {
		return fail("write HELLO", err)
	}
	if err := writeFrame(bw, frameManifest, mb); err != nil {
		return fail("write manifest", err)
	}
	if err := bw.Flush(); err != nil {
		return fail("write manifest", err)
	}
	// The protector verifies an existing copy before answering.
	g.allow(hashAllowance(m.TotalSize()))
	t, p, err := fr.next()
	g.allow(0)
	if err != nil {
		return fail("read reply to manifest", err)
	}
	switch t {
	case frameAccept:
	case frameHave:
		return finish(store, job, id, opts.Peer, p, log, &Sent{AlreadyPresent: true, WireBytes: aw.n, Duration: time.Since(start)})
	case frameNack:
		return fail("manifest", &RemoteError{Reason: sanitize(p)})
	default:
		return fail("manifest", protoErr("got %v, want ACCEPT, HAVE or NACK", t))
	}
	offers, err := parseOffers(p)
	if err != nil {
		return fail("manifest", err)
	}

	// The base is what the protector says it holds, never what we last
	// sent it (it may have pruned, lost or never verified that one).
	var idx *baseIndex
	if !opts.NoDelta {
		idx = pickBase(ctx, store, job, id, offers, opts.DeltaBlock, opts.Base, log)
	}
	res := &Sent{}
	for attempt := 0; ; attempt++ {
		ok, rp, err := sendAttempt(ctx, store, m, idx, bw, fr, g, opts, res)
		if err != nil {
			if verr, isVerify := errors.AsType[*ckpt.VerifyError](err); isVerify {
				verr.Job, verr.ID = job, id
				return nil, fmt.Errorf("send snapshot %s/%s: local copy is damaged, not sent: %w", job, id, err)
			}
			return fail("stream", err)
		}
		if ok {
			res.WireBytes, res.Duration = aw.n, time.Since(start)
			return finish(store, job, id, opts.Peer, rp, log, res)
		}
		if attempt > 0 || idx == nil {
			return fail("stream", protoErr("RETRY for a snapshot sent whole"))
		}
		// The protector's base differs from ours: it asked for everything.
		log.Warn("protector refused the diff; resending the snapshot whole", "job", job, "id", id,
			"peer", opts.Peer, "base", idx.id, "reason", sanitize(rp))
		t, p, err := fr.next()
		if err != nil {
			return fail("read reply to RETRY", err)
		}
		if t == frameNack {
			return fail("retry", &RemoteError{Reason: sanitize(p)})
		}
		if t != frameAccept {
			return fail("retry", protoErr("got %v, want ACCEPT", t))
		}
		idx = nil
		*res = Sent{DeltaRefused: true}
	}
}

// pickBase indexes the newest offered snapshot that this store also holds
// and that was taken on the node snapshot id was; nil (send whole) if none
// or it cannot be read.
// ahead, if it indexes the base picked with block size bs, is used instead
// of indexing it again.
func pickBase(ctx context.Context, store *ckpt.Store, job, id string, offers []string, bs int, ahead *BaseIndex, log *slog.Logger) *baseIndex {
	bs = deltaBlockOr(bs)
	if bs < minDeltaBlock || bs > maxDeltaBlock || bs&(bs-1) != 0 {
		log.Warn("delta block size out of range; sending whole files", "block", bs)
		return nil
	}
	sid, err := ckpt.ParseID(id)
	if err != nil {
		return nil
	}
	for _, b := range offers {
		if b == id {
			continue
		}
		// Only id's lineage, as the receiver offers (receiver.offers): the COPY positions and checks of
		// a diff against a peer's snapshot held here would tell the protector about the peer's memory.
		if bid, err := ckpt.ParseID(b); err != nil || bid.Node != sid.Node {
			continue
		}
		bm, err := store.Manifest(job, b)
		if err != nil {
			continue
		}
		if ahead != nil && ahead.idx.id == b && ahead.want == bs && ahead.idx.digest == filesDigest(bm.Files) {
			if ahead.idx.where == nil { // a Sent.Index: hashes only
				return ahead.idx.locate()
			}
			return ahead.idx
		}
		idx, err := indexBase(ctx, store.Path(job, b), bm, bs)
		if err != nil {
			log.Warn("cannot index the base snapshot; sending whole files", "job", job, "base", b, "err", err)
			return nil
		}
		return idx
	}
	return nil
}

// sendAttempt sends BASE (to a v2 receiver), the files and DONE, and reads
// the verdict: ok with OK's payload, or !ok with RETRY's reason (the caller
// then resends whole). Any other outcome is an error.
func sendAttempt(ctx context.Context, store *ckpt.Store, m *ckpt.Manifest, idx *baseIndex, bw *bufio.Writer, fr *frameReader,
	g *guard, opts SendOptions, res *Sent) (bool, []byte, error) {
	if err := writeFrame(bw, frameBase, basePayload(idx)); err != nil {
		return false, nil, err
	}
	if idx != nil {
		res.BaseID = idx.id
	}
	// From here the protector may refuse at any time; read its reply
	// concurrently so a NACK stops us early instead of after the last byte.
	type replyFrame struct {
		t   frameType
		p   []byte
		err error
	}
	replies := make(chan replyFrame, 1)
	go func() {
		t, p, err := fr.next()
		replies <- replyFrame{t, append([]byte(nil), p...), err}
	}()
	early := func() error {
		select {
		case r := <-replies:
			replies <- r // keep it for the final read
			if r.err != nil {
				return fmt.Errorf("protector closed the connection: %w", r.err)
			}
			if r.t == frameNack {
				return &RemoteError{Reason: sanitize(r.p)}
			}
			if r.t == frameRetry {
				return errRetry
			}
			return protoErr("unexpected %v before DONE", r.t)
		default:
			return nil
		}
	}

	// S2 rather than LZ4 (protocol 3): on a stencil's grids it compressed 1.8 times as fast and 18% smaller,
	// on program text 1.8 times as fast, the same size (docs/design.md, incremental snapshots). Its
	// chunks' CRC duplicates the protector's sha256 of every file, but S2's writer always adds it.
	zw := newCompressor(opts.CompressConcurrency)
	dw := &dataWriter{w: bw}
	buf := make([]byte, 1<<20)
	dir := store.Path(m.Job, m.ID)
	var next *baseIndex // this snapshot's own index, for the next transfer (KeepIndex)
	if opts.KeepIndex {
		next = newBaseIndex(m, deltaBlockOr(opts.DeltaBlock))
	}
	streamErr := func() error {
		for i, f := range m.Files {
			if err := early(); err != nil {
				return err
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			var n int64
			var err error
			var bh *blockHashes
			if next != nil && f.Size >= MinDeltaFile {
				bh = newBlockHashes(next.bs, f.Size)
			}
			if idx != nil && f.Size >= MinDeltaFile {
				var copied int64
				n, copied, err = sendDeltaFile(dir, f, idx, bw, zw, dw, bh, early, !opts.JustCommitted)
				res.CopiedBytes += copied
			} else {
				n, err = sendFile(dir, f, bw, zw, dw, buf, bh, early, !opts.JustCommitted)
			}
			if err != nil {
				// End the file's compressing goroutines (CompressConcurrency > 1) before anything else is
				// written: they would leak, and write DATA after an ABORT.
				zw.Reset(nil)
			}
			if bh != nil && err == nil {
				next.add(uint32(i), f.Name, bh.hs)
			}
			res.Bytes += n
			if _, ok := errors.AsType[*ckpt.VerifyError](err); ok {
				// Tell the protector why; it discards the partial copy.
				writeFrame(bw, frameAbort, reason(err))
				bw.Flush()
				return err
			}
			if err != nil {
				if rerr := early(); rerr != nil {
					return rerr // the protector's reason explains the broken pipe
				}
				return fmt.Errorf("%s: %w", f.Name, err)
			}
		}
		return nil
	}()
	if errors.Is(streamErr, errRetry) {
		// Skipped by the protector up to here; end the refused attempt.
		if err := writeFrame(bw, frameAbort, []byte("diff refused; resending whole")); err != nil {
			return false, nil, err
		}
		if err := bw.Flush(); err != nil {
			return false, nil, err
		}
		r := <-replies
		return false, r.p, nil
	}
	if streamErr != nil {
		return false, nil, streamErr
	}
	if err := writeFrame(bw, frameDone, nil); err != nil {
		return false, nil, fmt.Errorf("write DONE: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return false, nil, fmt.Errorf("write DONE: %w", err)
	}
	// The protector fsyncs everything (and hashes what it did not hash as it arrived) before it answers.
	g.allow(hashAllowance(m.TotalSize()))
	defer g.allow(0)
	var r replyFrame
	select {
	case r = <-replies:
	case <-ctx.Done():
		// The reader goroutine ends when the guard's past deadline (or the
		// caller closing conn) fails its read; the channel is buffered.
		return false, nil, fmt.Errorf("wait for acknowledgement: %w", ctx.Err())
	}
	if r.err != nil {
		return false, nil, fmt.Errorf("wait for acknowledgement: %w", r.err)
	}
	switch r.t {
	case frameOK:
		if next != nil {
			res.Index = &BaseIndex{idx: next, want: deltaBlockOr(opts.DeltaBlock)}
		}
		return true, r.p, nil
	case frameRetry:
		return false, r.p, nil
	case frameNack:
		return false, nil, fmt.Errorf("commit on protector: %w", &RemoteError{Reason: sanitize(r.p)})
	default:
		return false, nil, fmt.Errorf("wait for acknowledgement: %w", protoErr("got %v, want OK or NACK", r.t))
	}
}

// errRetry is the protector's RETRY seen while streaming.
var errRetry = errors.New("protector asked for the whole snapshot")

// finish records the replica after a positive acknowledgement.
func finish(store *ckpt.Store, job, id, peer string, ackNode []byte, log *slog.Logger, s *Sent) (*Sent, error) {
	if got := sanitize(ackNode); got != peer {
		log.Warn("protector acknowledged under another name; recording the authenticated one",
			"job", job, "id", id, "authenticated", peer, "acknowledged_as", got)
	}
	m, err := store.AddReplica(job, id, peer)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s/%s is on %s but recording the replica failed: %w", job, id, peer, err)
	}
	s.Manifest = m
	log.Info("snapshot shipped", "job", job, "id", id, "peer", peer, "bytes", s.Bytes,
		"wire_bytes", s.WireBytes, "already_present", s.AlreadyPresent, "base", s.BaseID,
		"copied_bytes", s.CopiedBytes, "delta_refused", s.DeltaRefused, "duration", s.Duration)
	return s, nil
}

// sendFile streams one file as FILE, DATA*, END. It returns a
// *ckpt.VerifyError (before END is written) if the file no longer matches the
// manifest: its size, and its sha256 if verify.
// The file's block hashes go to bh unless it is nil.
func sendFile(dir string, f ckpt.FileEntry, bw *bufio.Writer, zw *s2.Writer, dw *dataWriter, buf []byte, bh *blockHashes, early func() error, verify bool) (int64, error) {
	in, err := os.Open(filepath.Join(dir, filepath.FromSlash(f.Name)))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrMissing}
		}
		return 0, err
	}
	defer in.Close()
	if err := writeFrame(bw, frameFile, filePayload(f.Name, f.Size)); err != nil {
		return 0, err
	}
	h := sha256.New()
	zw.Reset(dw)
	var n int64
	// Read at most the manifest size (+1 to notice growth).
	src := io.LimitReader(in, f.Size+1)
	for {
		k, rerr := src.Read(buf)
		if k > 0 {
			if verify {
				h.Write(buf[:k])
			}
			if bh != nil {
				bh.Write(buf[:k])
			}
			n += int64(k)
			if n > f.Size {
				return n, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrCorrupt, Detail: "file grew after commit"}
			}
			if _, err := zw.Write(buf[:k]); err != nil {
				return n, err
			}
			if err := early(); err != nil {
				return n, err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return n, rerr
		}
	}
	if err := zw.Close(); err != nil {
		return n, err
	}
	if err := dw.flush(); err != nil {
		return n, err
	}
	if n < f.Size {
		return n, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrTruncated, Detail: fmt.Sprintf("%d bytes, manifest says %d", n, f.Size)}
	}
	if verify && hex.EncodeToString(h.Sum(nil)) != f.SHA256 {
		return n, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrCorrupt, Detail: "sha256 differs from the manifest"}
	}
	return n, writeFrame(bw, frameEnd, nil)
}

// sendDeltaFile streams one large file as DFILE, DATA*, END: its diff
// against idx. Like sendFile it returns a *ckpt.VerifyError (before END) if
// the file no longer matches the manifest (its sha256 only if verify), and its block hashes go to bh
// unless it is nil.
func sendDeltaFile(dir string, f ckpt.FileEntry, idx *baseIndex, bw *bufio.Writer, zw *s2.Writer, dw *dataWriter, bh *blockHashes, early func() error, verify bool) (int64, int64, error) {
	in, err := os.Open(filepath.Join(dir, filepath.FromSlash(f.Name)))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, 0, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrMissing}
		}
		return 0, 0, err
	}
	defer in.Close()
	if err := writeFrame(bw, frameDFile, filePayload(f.Name, f.Size)); err != nil {
		return 0, 0, err
	}
	zw.Reset(dw)
	br := bufio.NewReaderSize(in, 1<<20)
	hr := &hashingReader{r: br}
	keep := bh // the diff hashes the blocks anyway, if they are the size the next index wants
	if bh != nil && bh.bs != idx.bs {
		hr.r, keep = io.TeeReader(br, bh), nil
	}
	if verify {
		hr.h = sha256.New()
	}
	copied, err := encodeDelta(f.Name, hr, zw, f.Size, idx, keep, early)
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return hr.n, copied, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrTruncated, Detail: fmt.Sprintf("%d bytes, manifest says %d", hr.n, f.Size)}
	}
	if err != nil {
		return hr.n, copied, err
	}
	// Notice growth after commit, as sendFile does.
	if _, err := br.ReadByte(); err != io.EOF {
		return hr.n, copied, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrCorrupt, Detail: "file grew after commit"}
	}
	if err := zw.Close(); err != nil {
		return hr.n, copied, err
	}
	if err := dw.flush(); err != nil {
		return hr.n, copied, err
	}
	if verify && hex.EncodeToString(hr.h.Sum(nil)) != f.SHA256 {
		return hr.n, copied, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrCorrupt, Detail: "sha256 differs from the manifest"}
	}
	return hr.n, copied, writeFrame(bw, frameEnd, nil)
}

// dataWriter cuts the compressed stream into DATA frames of dataChunk bytes.
type dataWriter struct {
	w   io.Writer
	buf []byte
}

func (d *dataWriter) Write(p []byte) (int, error) {
	total := len(p)
	for len(p) > 0 {
		if d.buf == nil {
			d.buf = make([]byte, 0, dataChunk)
		}
		k := min(len(p), dataChunk-len(d.buf))
		d.buf = append(d.buf, p[:k]...)
		p = p[k:]
		if len(d.buf) == dataChunk {
			if err := d.flush(); err != nil {
				return total - len(p), err
			}
		}
	}
	return total, nil
}

func (d *dataWriter) flush() error {
	if len(d.buf) == 0 {
		return nil
	}
	err := writeFrame(d.w, frameData, d.buf)
	d.buf = d.buf[:0]
	return err
}
