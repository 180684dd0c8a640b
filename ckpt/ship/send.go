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
	"github.com/pierrec/lz4/v4"
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
	Logger              *slog.Logger
}

// Sent describes one completed outgoing transfer.
type Sent struct {
	Manifest *ckpt.Manifest // with the new replica recorded
	// AlreadyPresent is true when the protector already had a verified copy.
	AlreadyPresent bool
	Bytes          int64 // snapshot bytes read and sent
	WireBytes      int64 // bytes written to the connection
	Duration       time.Duration
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
			return protoErr("unexpected %v before DONE", r.t)
		default:
			return nil
		}
	}

	zw := lz4.NewWriter(nil)
	if err := zw.Apply(lz4.ConcurrencyOption(max(opts.CompressConcurrency, 1))); err != nil {
		return fail("configure lz4", err)
	}
	dw := &dataWriter{w: bw}
	buf := make([]byte, 1<<20)
	var sent int64
	for _, f := range m.Files {
		if err := early(); err != nil {
			return fail("stream", err)
		}
		if err := ctx.Err(); err != nil {
			return fail("stream", err)
		}
		n, err := sendFile(store.Path(job, id), f, bw, zw, dw, buf, early)
		sent += n
		if verr, ok := errors.AsType[*ckpt.VerifyError](err); ok {
			verr.Job, verr.ID = job, id
			// Tell the protector why; it discards the partial copy.
			writeFrame(bw, frameAbort, reason(err))
			bw.Flush()
			return nil, fmt.Errorf("send snapshot %s/%s: local copy is damaged, not sent: %w", job, id, err)
		}
		if err != nil {
			if rerr := early(); rerr != nil {
				err = rerr // the protector's reason explains the broken pipe
			}
			return fail("stream "+f.Name, err)
		}
	}
	if err := writeFrame(bw, frameDone, nil); err != nil {
		return fail("write DONE", err)
	}
	if err := bw.Flush(); err != nil {
		return fail("write DONE", err)
	}
	// The protector re-hashes and fsyncs everything before it answers.
	g.allow(hashAllowance(m.TotalSize()))
	var r replyFrame
	select {
	case r = <-replies:
	case <-ctx.Done():
		// The reader goroutine ends when the guard's past deadline (or the
		// caller closing conn) fails its read; the channel is buffered.
		return fail("wait for acknowledgement", ctx.Err())
	}
	if r.err != nil {
		return fail("wait for acknowledgement", r.err)
	}
	switch r.t {
	case frameOK:
		return finish(store, job, id, opts.Peer, r.p, log, &Sent{Bytes: sent, WireBytes: aw.n, Duration: time.Since(start)})
	case frameNack:
		return fail("commit on protector", &RemoteError{Reason: sanitize(r.p)})
	default:
		return fail("wait for acknowledgement", protoErr("got %v, want OK or NACK", r.t))
	}
}

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
		"wire_bytes", s.WireBytes, "already_present", s.AlreadyPresent, "duration", s.Duration)
	return s, nil
}

// sendFile streams one file as FILE, DATA*, END. It hashes what it reads and
// returns a *ckpt.VerifyError (before END is written) if the file no longer
// matches the manifest.
func sendFile(dir string, f ckpt.FileEntry, bw *bufio.Writer, zw *lz4.Writer, dw *dataWriter, buf []byte, early func() error) (int64, error) {
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
			h.Write(buf[:k])
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
	if hex.EncodeToString(h.Sum(nil)) != f.SHA256 {
		return n, &ckpt.VerifyError{File: f.Name, Err: ckpt.ErrCorrupt, Detail: "sha256 differs from the manifest"}
	}
	return n, writeFrame(bw, frameEnd, nil)
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
