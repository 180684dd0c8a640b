// Package ship streams committed snapshots from a node to its protector
// over an already authenticated connection (the caller dials mutual TLS).
//
// Wire format: a sequence of frames, each a 1-byte type, a 4-byte big-endian
// payload length, and the payload; every type has its own length limit, so
// a hostile or truncated stream cannot make the receiver allocate or write
// without bound. One transfer is:
//
//	sender:   HELLO MANIFEST
//	receiver: ACCEPT | HAVE <node> | NACK <reason>
//	sender:   { FILE <name,size> DATA* (END | ABORT <reason>) }* DONE
//	receiver: OK <node> | NACK <reason>   (NACK may come early)
//
// File contents are LZ4 frames (github.com/pierrec/lz4/v4) cut into DATA
// frames. Files are sent in manifest order and must match it by name and
// size; the receiver checks every sha256 while writing and again (from
// disk) when it commits into its store.
package ship

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/ftkit/ftkit/ckpt"
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

	frameAccept frameType = 16
	frameHave   frameType = 17
	frameOK     frameType = 18
	frameNack   frameType = 19
)

const (
	headerLen = 5
	// maxDataPayload bounds one DATA frame; the sender cuts at dataChunk.
	maxDataPayload = 1 << 20
	dataChunk      = 256 << 10
	maxReasonLen   = 4096
	protoVersion   = 1
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
	case frameEnd, frameDone, frameAccept:
		return 0
	case frameAbort, frameNack:
		return maxReasonLen
	case frameHave, frameOK:
		return 128
	}
	return -1
}

func (t frameType) String() string {
	names := map[frameType]string{
		frameHello: "HELLO", frameManifest: "MANIFEST", frameFile: "FILE", frameData: "DATA",
		frameEnd: "END", frameDone: "DONE", frameAbort: "ABORT", frameAccept: "ACCEPT",
		frameHave: "HAVE", frameOK: "OK", frameNack: "NACK",
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

func checkHello(p []byte) error {
	if len(p) != len(helloMagic)+2 || string(p[:len(helloMagic)]) != string(helloMagic[:]) {
		return protoErr("not an ftkit snapshot stream (bad HELLO)")
	}
	if v := binary.BigEndian.Uint16(p[len(helloMagic):]); v != protoVersion {
		return protoErr("sender speaks protocol version %d, this node speaks %d (upgrade the older node)", v, protoVersion)
	}
	return nil
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
