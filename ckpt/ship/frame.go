// Package ship streams committed snapshots from a node to its protector
// over an already authenticated connection (the caller dials mutual TLS).
//
// Wire format: a sequence of frames, each a 1-byte type, a 4-byte big-endian
// payload length, and the payload; every type has its own length limit, so
// a hostile or truncated stream cannot make the receiver allocate or write
// without bound. One transfer (protocols 2 and 3) is:
//
//	sender:   HELLO MANIFEST
//	receiver: ACCEPT <bases offered> | HAVE <node> | NACK <reason>
//	sender:   BASE <id, file-list digest, block size | empty>
//	          { (FILE | DFILE) <name,size> DATA* (END | ABORT <reason>) }* DONE
//	receiver: OK <node> | NACK <reason> | RETRY <reason>  (NACK, RETRY may come early)
//	after RETRY: sender ABORT (unless DONE was sent); receiver ACCEPT <none>;
//	          sender BASE <empty> and every file whole, as above.
//
// File contents are S2 streams (github.com/klauspost/compress/s2; LZ4
// frames, github.com/pierrec/lz4/v4, from a protocol-1 or -2 sender) cut
// into DATA frames. A DFILE's content is its diff against the base (delta.go): the
// receiver offers the snapshots of the same job and node it holds, the
// sender picks the newest it holds too, and the receiver answers RETRY when
// the diff does not apply to its copy. Files are sent in manifest order and
// must match it by name and size; the receiver checks every sha256 while
// writing, and its commit takes those checked entries instead of reading the
// files back (ckpt.Pending.Written). A protocol-1
// sender (no BASE, whole files only) is still received.
package ship

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/klauspost/compress/s2"
	"github.com/pierrec/lz4/v4"
)

type frameType byte

const (
	frameHello    frameType = 1
	frameManifest frameType = 2
	frameFile     frameType = 3
	frameData     frameType = 4
	frameEnd      frameType = 5
	frameDone     frameType = 6
	frameAbort    frameType = 7
	frameBase     frameType = 8 // v2: the base the files are diffed against (empty: none)
	frameDFile    frameType = 9 // v2: a file sent as a diff against the base

	frameAccept frameType = 16
	frameHave   frameType = 17
	frameOK     frameType = 18
	frameNack   frameType = 19
	frameRetry  frameType = 20 // v2: the diff does not apply here; resend in full
)

const (
	headerLen = 5
	// maxDataPayload bounds one DATA frame; the sender cuts at dataChunk.
	maxDataPayload = 1 << 20
	dataChunk      = 256 << 10
	maxReasonLen   = 4096
	// protoVersion 2 adds diffs against a base (BASE, DFILE, RETRY, the
	// offers in ACCEPT); 3 compresses with S2 instead of LZ4. A receiver
	// still accepts senders of every earlier version.
	protoVersion = 3
	// s2Block is the S2 block size of the sender, and the largest block a
	// receiver decodes (what it allocates for one).
	s2Block = 1 << 20
	// maxOffers bounds the base snapshots a receiver offers in ACCEPT.
	maxOffers = 8
)

var helloMagic = [8]byte{'F', 'T', 'K', 'S', 'H', 'I', 'P', 0}

// maxPayload is the largest payload accepted for each frame type; unknown
// types get -1 and are refused.
func maxPayload(t frameType) int {
	switch t {
	case frameHello:
		return len(helloMagic) + 2
	case frameManifest:
		return ckpt.MaxManifestBytes
	case frameFile:
		return 2 + 4096 + 8
	case frameData:
		return maxDataPayload
	case frameEnd, frameDone:
		return 0
	case frameAccept:
		return 1 + maxOffers*(1+ckpt.MaxIDLen)
	case frameBase:
		return 1 + ckpt.MaxIDLen + 32 + 4
	case frameDFile:
		return 2 + 4096 + 8
	case frameAbort, frameNack, frameRetry:
		return maxReasonLen
	case frameHave, frameOK:
		return ckpt.MaxNameLen
	}
	return -1
}

func (t frameType) String() string {
	names := map[frameType]string{
		frameHello: "HELLO", frameManifest: "MANIFEST", frameFile: "FILE", frameData: "DATA",
		frameEnd: "END", frameDone: "DONE", frameAbort: "ABORT", frameAccept: "ACCEPT",
		frameHave: "HAVE", frameOK: "OK", frameNack: "NACK", frameBase: "BASE", frameDFile: "DFILE",
		frameRetry: "RETRY",
	}
	if n, ok := names[t]; ok {
		return n
	}
	return fmt.Sprintf("type %d", byte(t))
}

// ErrProtocol marks a malformed or unexpected stream.
var ErrProtocol = errors.New("ship protocol error")

func protoErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// frameReader decodes frames from an untrusted stream.
type frameReader struct {
	r   io.Reader
	buf []byte // reused for small and DATA payloads
	n   int64  // bytes consumed, for throughput accounting
	// max, if not 0, bounds n (a receive's wire budget): a frame that would take the stream past it fails
	// with maxErr, so frames that carry nothing (empty DATA) cannot go on without end.
	max    int64
	maxErr error
}

func newFrameReader(r io.Reader) *frameReader {
	return &frameReader{r: r, buf: make([]byte, 0, 64<<10)}
}

// next reads one frame. The payload is valid until the next call. A stream
// that ends cleanly before a header returns io.EOF; one that ends inside a
// frame returns io.ErrUnexpectedEOF.
func (fr *frameReader) next() (frameType, []byte, error) {
	var hdr [headerLen]byte
	k, err := io.ReadFull(fr.r, hdr[:])
	fr.n += int64(k)
	if err != nil {
		return 0, nil, err
	}
	t := frameType(hdr[0])
	n := binary.BigEndian.Uint32(hdr[1:])
	limit := maxPayload(t)
	if limit < 0 {
		return 0, nil, protoErr("unknown frame %v", t)
	}
	if int64(n) > int64(limit) {
		return 0, nil, protoErr("%v frame of %d bytes exceeds the %d limit", t, n, limit)
	}
	if fr.max > 0 && fr.n+int64(n) > fr.max {
		return 0, nil, fr.maxErr
	}
	if t == frameManifest {
		// Grow with the data actually received, not the claimed length.
		b, err := io.ReadAll(io.LimitReader(fr.r, int64(n)))
		fr.n += int64(len(b))
		if err != nil {
			return 0, nil, err
		}
		if len(b) != int(n) {
			return 0, nil, io.ErrUnexpectedEOF
		}
		return t, b, nil
	}
	if cap(fr.buf) < int(n) {
		fr.buf = make([]byte, n)
	}
	p := fr.buf[:n]
	k, err = io.ReadFull(fr.r, p)
	fr.n += int64(k)
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		return 0, nil, err
	}
	return t, p, nil
}

func writeFrame(w io.Writer, t frameType, payload []byte) error {
	var hdr [headerLen]byte
	hdr[0] = byte(t)
	binary.BigEndian.PutUint32(hdr[1:], uint32(len(payload)))
	if _, err := w.Write(hdr[:]); err != nil {
		return err
	}
	if len(payload) == 0 {
		return nil
	}
	_, err := w.Write(payload)
	return err
}

func helloPayload() []byte {
	b := append([]byte{}, helloMagic[:]...)
	return binary.BigEndian.AppendUint16(b, protoVersion)
}

// checkHello returns the sender's protocol version (1 to protoVersion).
func checkHello(p []byte) (uint16, error) {
	if len(p) != len(helloMagic)+2 || string(p[:len(helloMagic)]) != string(helloMagic[:]) {
		return 0, protoErr("not an ftkit snapshot stream (bad HELLO)")
	}
	v := binary.BigEndian.Uint16(p[len(helloMagic):])
	if v < 1 || v > protoVersion {
		return 0, protoErr("sender speaks protocol version %d, this node speaks 1 to %d (upgrade the older node)", v, protoVersion)
	}
	return v, nil
}

// offersPayload lists the base snapshot ids a receiver offers (ACCEPT).
func offersPayload(ids []string) []byte {
	ids = ids[:min(len(ids), maxOffers)]
	b := []byte{byte(len(ids))}
	for _, id := range ids {
		b = append(b, byte(len(id)))
		b = append(b, id...)
	}
	return b
}

// parseOffers decodes ACCEPT's payload; a v1 receiver sends none (empty).
func parseOffers(p []byte) ([]string, error) {
	if len(p) == 0 {
		return nil, nil
	}
	n := int(p[0])
	if n > maxOffers {
		return nil, protoErr("ACCEPT offers %d bases, more than %d", n, maxOffers)
	}
	p = p[1:]
	ids := make([]string, 0, n)
	for range n {
		if len(p) < 1 || len(p) < 1+int(p[0]) {
			return nil, protoErr("short ACCEPT offer")
		}
		id := string(p[1 : 1+int(p[0])])
		if _, err := ckpt.ParseID(id); err != nil {
			return nil, protoErr("ACCEPT offer: %v", err)
		}
		ids = append(ids, id)
		p = p[1+int(p[0]):]
	}
	if len(p) != 0 {
		return nil, protoErr("trailing bytes after the ACCEPT offers")
	}
	return ids, nil
}

// basePayload names the base (id, digest of its file list, block size);
// idx nil sends the empty payload: no base.
func basePayload(idx *baseIndex) []byte {
	if idx == nil {
		return nil
	}
	b := []byte{byte(len(idx.id))}
	b = append(b, idx.id...)
	b = append(b, idx.digest[:]...)
	return binary.BigEndian.AppendUint32(b, uint32(idx.bs))
}

type baseRef struct {
	id     string
	digest [32]byte
	bs     int
}

// parseBase decodes BASE's payload; ok is false for "no base".
func parseBase(p []byte) (ref baseRef, ok bool, err error) {
	if len(p) == 0 {
		return ref, false, nil
	}
	n := int(p[0])
	if len(p) != 1+n+32+4 {
		return ref, false, protoErr("BASE frame of %d bytes does not match id length %d", len(p), n)
	}
	ref.id = string(p[1 : 1+n])
	if _, err := ckpt.ParseID(ref.id); err != nil {
		return ref, false, protoErr("BASE: %v", err)
	}
	copy(ref.digest[:], p[1+n:])
	bs := binary.BigEndian.Uint32(p[1+n+32:])
	if bs < minDeltaBlock || bs > maxDeltaBlock || bs&(bs-1) != 0 {
		return ref, false, protoErr("BASE: block size %d out of range", bs)
	}
	ref.bs = int(bs)
	return ref, true, nil
}

func filePayload(name string, size int64) []byte {
	b := binary.BigEndian.AppendUint16(nil, uint16(len(name)))
	b = append(b, name...)
	return binary.BigEndian.AppendUint64(b, uint64(size))
}

func parseFile(p []byte) (string, int64, error) {
	if len(p) < 2 {
		return "", 0, protoErr("short FILE frame")
	}
	n := int(binary.BigEndian.Uint16(p))
	if len(p) != 2+n+8 {
		return "", 0, protoErr("FILE frame length %d does not match name length %d", len(p), n)
	}
	name := string(p[2 : 2+n])
	size := binary.BigEndian.Uint64(p[2+n:])
	if size > 1<<62 {
		return "", 0, protoErr("FILE %q: size %d out of range", name, size)
	}
	if err := ckpt.ValidFileName(name); err != nil {
		return "", 0, protoErr("FILE: %v", err)
	}
	return name, int64(size), nil
}

// reason turns an error into a NACK/ABORT payload.
func reason(err error) []byte {
	s := err.Error()
	if len(s) > maxReasonLen {
		s = s[:maxReasonLen]
	}
	return []byte(s)
}

// sanitize makes a peer-supplied reason safe to log or show: printable
// ASCII only, so a hostile peer cannot inject terminal escapes or fake lines.
func sanitize(p []byte) string {
	var b strings.Builder
	for _, c := range p {
		if c >= 0x20 && c < 0x7f {
			b.WriteByte(c)
		} else {
			b.WriteByte('?')
		}
	}
	return b.String()
}

// decompressor reads a file's contents from its DATA frames.
type decompressor interface {
	io.Reader
	Reset(io.Reader)
}

// newCompressor writes file contents as this version sends them (protocol 3: S2 with s2Block blocks),
// compressing on n goroutines (at least one). Reset it onto each file's DATA frames.
func newCompressor(n int) *s2.Writer {
	return s2.NewWriter(nil, s2.WriterConcurrency(max(n, 1)), s2.WriterBlockSize(s2Block))
}

// newDecompressor reads what a sender of protocol version v compresses with.
func newDecompressor(v uint16) decompressor {
	if v < 3 {
		return lz4.NewReader(nil)
	}
	return s2.NewReader(nil, s2.ReaderMaxBlockSize(s2Block))
}
