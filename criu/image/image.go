// Package image reads and edits the two CRIU 4.x image files ftkit needs to
// move a TCP endpoint: tcp-stream-<ino>.img (one TcpStreamEntry, then the raw
// receive queue, then the raw send queue) and files.img (one FileEntry per
// open file, inet sockets and regular files among them).
//
// Messages are the go-criu v7 protobufs; the framing is parsed here instead of
// with go-criu's crit because crit allocates whatever length an image claims
// and does not check short reads, and these bytes arrive over the network.
// Every length is checked against the bytes actually present before use.
//
// Fields written by CRIU versions newer than go-criu's protos are kept as
// protobuf unknown fields and written back unchanged. files.img entries that
// are not edited are written back byte for byte, so entry types go-criu does
// not know (pidfd, ...) survive too.
package image

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Image magics from CRIU's criu/include/magic.h (go-criu's magic package has
// the same values; magic_test.go checks that).
const (
	magicImgCommon = 0x54564319
	magicTCPStream = 0x51465506
	magicFiles     = 0x56303138
)

// ErrFormat marks an image that is truncated, corrupt or not the expected
// kind. The image is left untouched; re-take the dump or re-fetch the image.
var ErrFormat = errors.New("malformed CRIU image")

// ErrInconsistent marks an edit refused because the resulting image would be
// rejected by CRIU or the kernel at restore time. Nothing was written.
var ErrInconsistent = errors.New("edit would make the CRIU image inconsistent")

// readMagic checks the two leading magic words of an image and returns the
// bytes that follow them.
func readMagic(name string, b []byte, want uint32) ([]byte, error) {
	if len(b) < 8 {
		return nil, fmt.Errorf("image %s: %d bytes, too short for the 8-byte magic header: %w", name, len(b), ErrFormat)
	}
	common, kind := binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:])
	if common != magicImgCommon || kind != want {
		return nil, fmt.Errorf("image %s: magic %#x/%#x, want %#x/%#x: %w",
			name, common, kind, uint32(magicImgCommon), want, ErrFormat)
	}
	return b[8:], nil
}

// nextEntry splits one size-prefixed protobuf entry off b. off is b's offset
// in the file, for error messages.
func nextEntry(name string, b []byte, off int) (payload, rest []byte, err error) {
	if len(b) < 4 {
		return nil, nil, fmt.Errorf("image %s: offset %d: %d bytes left, too short for an entry size: %w", name, off, len(b), ErrFormat)
	}
	n := binary.LittleEndian.Uint32(b)
	if uint64(n) > uint64(len(b)-4) {
		return nil, nil, fmt.Errorf("image %s: offset %d: entry claims %d bytes, only %d follow: %w", name, off, n, len(b)-4, ErrFormat)
	}
	b = b[4:] // not b[4:4+n]: 4+n is 32-bit and wraps for an entry of nearly 4 GiB
	return b[:n], b[n:], nil
}

// maxEntries bounds the entries of an image decodeEntries decodes: 2^21 open files, far above the kernel's
// default limit of 2^20 descriptors per process (fs.nr_open) for any job the agent can dump in time.
const maxEntries = 1 << 21

// maxMessages bounds the messages, nested ones included, that decodeEntries decodes from one image: an
// empty message in a repeated field (a VMA of mm-<pid>.img, an epoll target of a files.img entry) is 2
// bytes of image and some 100 bytes of memory, inside one entry, which maxEntries does not bound. An
// honest image of maxEntries entries has a few messages in each.
const maxMessages = 4 * maxEntries

// countMessages returns how many messages decoding b as a message of descriptor md makes, md's own
// included; past limit it stops counting and returns more than limit. Malformed bytes end the count
// (Unmarshal then reports them), and so does nesting deeper than Unmarshal accepts.
func countMessages(b []byte, md protoreflect.MessageDescriptor, limit, depth int) int {
	n := 1
	if depth > protowire.DefaultRecursionLimit {
		return n
	}
	fields := md.Fields()
	for len(b) > 0 && n <= limit {
		num, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			return n
		}
		b = b[l:]
		if f := fields.ByNumber(num); f != nil && typ == protowire.BytesType && f.Message() != nil {
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return n
			}
			n += countMessages(v, f.Message(), limit-n, depth+1)
			b = b[m:]
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return n
		}
		b = b[m:]
	}
	return n
}

// decodeEntries decodes an image of kind magic made of size-prefixed protobuf entries of type what, each
// into a message from newMsg; raw keeps every entry's bytes as written, for entries written back unchanged.
func decodeEntries[M proto.Message](name string, b []byte, magic uint32, what string, newMsg func() M, opts proto.UnmarshalOptions) (raw [][]byte, msgs []M, err error) {
	rest, err := readMagic(name, b, magic)
	if err != nil {
		return nil, nil, err
	}
	md := newMsg().ProtoReflect().Descriptor()
	nmsgs := 0
	for off := 8; len(rest) > 0; {
		var payload []byte
		payload, rest, err = nextEntry(name, rest, off)
		if err != nil {
			return nil, nil, err
		}
		if len(msgs) == maxEntries {
			// A crafted image of empty entries decodes into a message per 4 bytes, each some 90 bytes of the
			// agent's memory: a snapshot from another node could have the root agent killed for memory.
			return nil, nil, fmt.Errorf("image %s: more than %d %s entries (no process holds that many): %w", name, maxEntries, what, ErrFormat)
		}
		if nmsgs += countMessages(payload, md, maxMessages-nmsgs, 0); nmsgs > maxMessages {
			// Counted on the wire before anything is decoded: an entry of a million empty repeated messages
			// took the agent's memory within the bound on entries.
			return nil, nil, fmt.Errorf("image %s: %s #%d at offset %d brings the image's messages over %d (no process holds that many): %w",
				name, what, len(msgs), off, maxMessages, ErrFormat)
		}
		m := newMsg()
		if err := opts.Unmarshal(payload, m); err != nil {
			return nil, nil, fmt.Errorf("image %s: %s #%d at offset %d: %v: %w", name, what, len(msgs), off, err, ErrFormat)
		}
		raw = append(raw, payload)
		msgs = append(msgs, m)
		off += 4 + len(payload)
	}
	return raw, msgs, nil
}

// encodeEntries writes an image of kind back from its raw entries (as decodeEntries returned them, edited).
func encodeEntries(kind uint32, raw [][]byte) []byte {
	n := 8
	for _, r := range raw {
		n += 4 + len(r)
	}
	buf := appendHeader(make([]byte, 0, n), kind)
	for _, r := range raw {
		buf = appendEntry(buf, r)
	}
	return buf
}

func appendHeader(buf []byte, kind uint32) []byte {
	buf = binary.LittleEndian.AppendUint32(buf, magicImgCommon)
	return binary.LittleEndian.AppendUint32(buf, kind)
}

func appendEntry(buf, payload []byte) []byte {
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(payload)))
	return append(buf, payload...)
}

// writeFileAtomic replaces path with data so that a crash leaves either the
// old or the new image, never a mix: temp file in the same directory, fsync,
// rename, fsync of the directory.
func writeFileAtomic(path string, data []byte) (err error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("stat image before rewrite: %w", err)
	}
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("create temp file next to %s: %w", path, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err = f.Chmod(fi.Mode().Perm()); err != nil {
		return fmt.Errorf("chmod %s: %w", tmp, err)
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", tmp, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename %s over %s: %w", tmp, path, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open %s to fsync the rename: %w", dir, err)
	}
	defer d.Close()
	if err = d.Sync(); err != nil {
		return fmt.Errorf("fsync directory %s after renaming %s: %w", dir, path, err)
	}
	return nil
}
