package ship

// Incremental transfer of large files (CRIU's pages-N.img) against a base
// snapshot that both sides hold. The kernel here has no soft-dirty bit, so
// CRIU cannot pre-dump; instead the sender cuts each large file into fixed
// blocks, hashes them (xxhash64, for matching only), and describes the file
// as a sequence of operations, LZ4-compressed and framed like a whole file:
//
//	COPY: 0x01 file u32, block u64, count u32, check u64
//	      count blocks of base file number `file` (index into the base
//	      manifest's Files) from block `block`; check is the xxhash64 of the
//	      copied bytes, so a base copy that differs is caught at once.
//	LIT:  0x02 count u32, then the bytes of count blocks (the file's last
//	      block may be short).
//
// The operations must cover the file exactly; the rebuilt file is verified
// against the manifest's sha256 as a whole file is, so the fast hash never
// decides what is committed.

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"maps"
	"os"
	"slices"

	"github.com/cespare/xxhash/v2"
	"github.com/ftkit/ftkit/ckpt"
)

const (
	// DefaultDeltaBlock is the block size of the diff: one page, so that a
	// rewritten page costs one page on the wire and pages that moved by a
	// whole number of pages still match (see docs/design.md for the measure).
	DefaultDeltaBlock = 4096
	minDeltaBlock     = 4096
	maxDeltaBlock     = 1 << 20
	// MinDeltaFile is the size from which a file is sent as a diff; smaller
	// files (every image but the pages) are sent whole.
	MinDeltaFile = 1 << 20
	// maxIndexBlocks bounds the sender's index of the base (about 40 bytes a
	// block); a larger base is indexed with larger blocks.
	maxIndexBlocks = 1 << 23
	// maxLitBlocks bounds one LIT operation on the sender (the receiver only
	// bounds it by the file size).
	maxLitBlocks = 256

	opCopy byte = 1
	opLit  byte = 2

	copyOpLen = 1 + 4 + 8 + 4 + 8
	copyChunk = 1 << 20
)

// errDeltaRefused marks a diff the receiver cannot apply to its base (base
// missing or different); the sender then resends in full.
var errDeltaRefused = errors.New("delta refused")

type blockLoc struct {
	file  uint32
	block uint64
}

// baseIndex is the sender's view of the base snapshot: the hash of every
// full block of its large files.
type baseIndex struct {
	id     string
	digest [32]byte // filesDigest of the base manifest
	bs     int
	hashes map[uint32][]uint64 // by index into the base manifest's Files
	where  map[uint64]blockLoc // one location per distinct hash
	byName map[string]uint32   // index of each indexed base file
}

// filesDigest identifies a manifest's file list, so both sides agree on what
// file number i of the base is before any block is copied.
func filesDigest(files []ckpt.FileEntry) [32]byte {
	h := sha256.New()
	for _, f := range files {
		var b [8]byte
		binary.BigEndian.PutUint64(b[:], uint64(f.Size))
		h.Write([]byte(f.Name))
		h.Write([]byte{0})
		h.Write(b[:])
		h.Write([]byte(f.SHA256))
	}
	var d [32]byte
	h.Sum(d[:0])
	return d
}

// deltaBlockFor returns the block size to index a base of total bytes in
// large files with, starting from want.
func deltaBlockFor(total int64, want int) int {
	bs := want
	for bs < maxDeltaBlock && total/int64(bs) > maxIndexBlocks {
		bs *= 2
	}
	return bs
}

// newBaseIndex is an empty index of snapshot m as a base, with the block size its large files take
// (deltaBlockFor) when want is asked for; its files are added by add, then located by locate.
func newBaseIndex(m *ckpt.Manifest, want int) *baseIndex {
	var total int64
	for _, f := range m.Files {
		if f.Size >= MinDeltaFile {
			total += f.Size
		}
	}
	return &baseIndex{id: m.ID, digest: filesDigest(m.Files), bs: deltaBlockFor(total, want),
		hashes: map[uint32][]uint64{}, byName: map[string]uint32{}}
}

// add records the block hashes of base file number i.
func (idx *baseIndex) add(i uint32, name string, hs []uint64) {
	idx.hashes[i], idx.byName[name] = hs, i
}

// locate returns idx with where filled in (one location per distinct hash, the first in file order),
// sharing its hashes: an index kept for a later transfer (Sent.Index) holds only its hashes, a sixth of
// its memory.
func (idx *baseIndex) locate() *baseIndex {
	out := *idx
	out.where = map[uint64]blockLoc{}
	files := slices.Sorted(maps.Keys(idx.hashes))
	for _, i := range files {
		for b, h := range idx.hashes[i] {
			if _, ok := out.where[h]; !ok {
				out.where[h] = blockLoc{i, uint64(b)}
			}
		}
	}
	return &out
}

// blockHashes collects the xxhash64 of every full block of a file whose bytes are written to it in
// order, so that a snapshot being sent can be the next diff's base without being read again.
type blockHashes struct {
	bs   int
	part []byte // the bytes of the block begun
	hs   []uint64
}

func newBlockHashes(bs int, size int64) *blockHashes {
	return &blockHashes{bs: bs, part: make([]byte, 0, bs), hs: make([]uint64, 0, size/int64(bs))}
}

func (b *blockHashes) Write(p []byte) (int, error) {
	n := len(p)
	if len(b.part) > 0 {
		k := min(b.bs-len(b.part), len(p))
		b.part = append(b.part, p[:k]...)
		p = p[k:]
		if len(b.part) < b.bs {
			return n, nil
		}
		b.hs = append(b.hs, xxhash.Sum64(b.part))
		b.part = b.part[:0]
	}
	for ; len(p) >= b.bs; p = p[b.bs:] {
		b.hs = append(b.hs, xxhash.Sum64(p[:b.bs]))
	}
	b.part = append(b.part, p...)
	return n, nil
}

// indexBase hashes the blocks of the base's large files in dir.
func indexBase(ctx context.Context, dir string, m *ckpt.Manifest, want int) (*baseIndex, error) {
	idx := newBaseIndex(m, want)
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	buf := make([]byte, idx.bs)
	for i, f := range m.Files {
		if f.Size < MinDeltaFile {
			continue
		}
		in, err := root.Open(f.Name)
		if err != nil {
			return nil, fmt.Errorf("index base file %s: %w", f.Name, err)
		}
		br := bufio.NewReaderSize(in, 1<<20)
		n := f.Size / int64(idx.bs)
		hs := make([]uint64, 0, n)
		for b := int64(0); b < n; b++ {
			if b%4096 == 0 && ctx.Err() != nil {
				in.Close()
				return nil, ctx.Err()
			}
			if _, err := io.ReadFull(br, buf); err != nil {
				in.Close()
				return nil, fmt.Errorf("index base file %s: %w", f.Name, err)
			}
			hs = append(hs, xxhash.Sum64(buf))
		}
		in.Close()
		idx.add(uint32(i), f.Name, hs)
	}
	return idx.locate(), nil
}

// has reports whether block b of base file f hashes to h.
func (idx *baseIndex) has(f uint32, b uint64, h uint64) bool {
	hs := idx.hashes[f]
	return b < uint64(len(hs)) && hs[b] == h
}

// encodeDelta reads size bytes of the new file named name from r and writes
// its operations to w. It returns the bytes described by COPY operations.
// tick is called every few MiB (to notice a refusal early). The hash of every
// full block goes to keep too, unless it is nil (its block size must be idx's).
func encodeDelta(name string, r io.Reader, w io.Writer, size int64, idx *baseIndex, keep *blockHashes, tick func() error) (int64, error) {
	same, hasSame := idx.byName[name]
	bs := idx.bs
	bw := bufio.NewWriterSize(w, 256<<10)
	var copied int64
	// The current COPY run, if run > 0.
	var run uint32
	var runAt blockLoc
	runHash := xxhash.New()
	// Pending literal blocks.
	lit := make([]byte, 0, maxLitBlocks*bs)
	var litBlocks uint32
	var hdr [copyOpLen]byte
	flushCopy := func() error {
		if run == 0 {
			return nil
		}
		hdr[0] = opCopy
		binary.BigEndian.PutUint32(hdr[1:], runAt.file)
		binary.BigEndian.PutUint64(hdr[5:], runAt.block)
		binary.BigEndian.PutUint32(hdr[13:], run)
		binary.BigEndian.PutUint64(hdr[17:], runHash.Sum64())
		copied += int64(run) * int64(bs)
		run = 0
		runHash.Reset()
		_, err := bw.Write(hdr[:])
		return err
	}
	flushLit := func() error {
		if litBlocks == 0 {
			return nil
		}
		hdr[0] = opLit
		binary.BigEndian.PutUint32(hdr[1:], litBlocks)
		if _, err := bw.Write(hdr[:5]); err != nil {
			return err
		}
		_, err := bw.Write(lit)
		lit, litBlocks = lit[:0], 0
		return err
	}
	buf := make([]byte, bs)
	for pos := int64(0); pos < size; pos += int64(bs) {
		if (pos/int64(bs))%1024 == 0 {
			if err := tick(); err != nil {
				return copied, err
			}
		}
		n := int(min(int64(bs), size-pos))
		if _, err := io.ReadFull(r, buf[:n]); err != nil {
			return copied, err
		}
		if n == bs {
			h := xxhash.Sum64(buf)
			if keep != nil {
				keep.hs = append(keep.hs, h)
			}
			// Prefer extending the current run, then the same place in the
			// base file of the same name, then any location: duplicate
			// blocks (zero or repeated pages) would otherwise cut runs short.
			if run > 0 && idx.has(runAt.file, runAt.block+uint64(run), h) {
				run++
				runHash.Write(buf)
				continue
			}
			at, ok := idx.where[h]
			if b := uint64(pos / int64(bs)); hasSame && idx.has(same, b, h) {
				at, ok = blockLoc{same, b}, true
			}
			if ok {
				if err := flushCopy(); err != nil {
					return copied, err
				}
				if err := flushLit(); err != nil {
					return copied, err
				}
				run, runAt = 1, at
				runHash.Write(buf)
				continue
			}
		}
		if err := flushCopy(); err != nil {
			return copied, err
		}
		lit = append(lit, buf[:n]...)
		litBlocks++
		if litBlocks == maxLitBlocks {
			if err := flushLit(); err != nil {
				return copied, err
			}
		}
	}
	if err := flushCopy(); err != nil {
		return copied, err
	}
	if err := flushLit(); err != nil {
		return copied, err
	}
	return copied, bw.Flush()
}

// baseFiles is the receiver's base: the files of a committed snapshot, by
// their index in its manifest.
type baseFiles interface {
	// Size returns the size of file i, or false if there is no file i.
	Size(i uint32) (int64, bool)
	// ReadAt reads len(p) bytes of file i at off.
	ReadAt(i uint32, p []byte, off int64) error
}

// blockSharer is a destination that can take bytes of a base file by sharing the base's disk blocks
// instead of writing them (receive.go's rebuiltFile: FICLONERANGE, on XFS and btrfs).
type blockSharer interface {
	// share makes p, the bytes at off of base file i, the destination's next bytes; false, with nothing
	// done, if it cannot, and the caller writes p.
	share(i uint32, off int64, p []byte) (bool, error)
}

// applyDelta decodes the operations of a file of size bytes with block size
// bs from r, which holds untrusted bytes, and writes the file to w (base
// blocks by sharing them where w is a blockSharer that can). Every
// count and block number is checked against size and the base file before
// anything is read or written. A base block that does not hash as the sender
// said, or an unreadable base, is errDeltaRefused; a malformed stream is
// ErrProtocol. It returns the bytes copied from the base.
func applyDelta(r io.Reader, w io.Writer, size int64, bs int, base baseFiles) (int64, error) {
	if bs < minDeltaBlock || bs > maxDeltaBlock || bs&(bs-1) != 0 {
		return 0, protoErr("delta block size %d out of range", bs)
	}
	if size < 0 {
		return 0, protoErr("negative file size")
	}
	br := bufio.NewReaderSize(r, 64<<10)
	sharer, _ := w.(blockSharer)
	buf := make([]byte, max(bs, copyChunk))
	var hdr [copyOpLen]byte
	var copied int64
	var pos int64
	bsz := int64(bs)
	for pos < size {
		if _, err := io.ReadFull(br, hdr[:1]); err != nil {
			return copied, truncated(err, "delta operation")
		}
		left := size - pos
		switch hdr[0] {
		case opCopy:
			if _, err := io.ReadFull(br, hdr[1:]); err != nil {
				return copied, truncated(err, "COPY operation")
			}
			file := binary.BigEndian.Uint32(hdr[1:])
			block := binary.BigEndian.Uint64(hdr[5:])
			count := binary.BigEndian.Uint32(hdr[13:])
			check := binary.BigEndian.Uint64(hdr[17:])
			if count == 0 || uint64(count) > uint64(left/bsz) {
				return copied, protoErr("COPY of %d blocks at offset %d of a %d-byte file", count, pos, size)
			}
			bsize, ok := base.Size(file)
			if !ok {
				return copied, fmt.Errorf("%w: COPY from base file %d, which the base does not have", errDeltaRefused, file)
			}
			if block > uint64(bsize/bsz) || uint64(count) > uint64(bsize/bsz)-block {
				return copied, fmt.Errorf("%w: COPY of blocks %d+%d beyond base file %d of %d bytes", errDeltaRefused, block, count, file, bsize)
			}
			h := xxhash.New()
			// Read the run in chunks of up to copyChunk, not block by block.
			for off, end := int64(block)*bsz, int64(block+uint64(count))*bsz; off < end; {
				chunk := buf[:min(int64(len(buf)), end-off)]
				if err := base.ReadAt(file, chunk, off); err != nil {
					return copied, fmt.Errorf("%w: read base file %d: %v", errDeltaRefused, file, err)
				}
				h.Write(chunk)
				shared := false
				if sharer != nil {
					var err error
					if shared, err = sharer.share(file, off, chunk); err != nil {
						return copied, err
					}
				}
				if !shared {
					if _, err := w.Write(chunk); err != nil {
						return copied, err
					}
				}
				off += int64(len(chunk))
			}
			if h.Sum64() != check {
				return copied, fmt.Errorf("%w: blocks %d+%d of base file %d differ from the sender's base", errDeltaRefused, block, count, file)
			}
			n := int64(count) * bsz
			copied += n
			pos += n
		case opLit:
			if _, err := io.ReadFull(br, hdr[1:5]); err != nil {
				return copied, truncated(err, "LIT operation")
			}
			count := int64(binary.BigEndian.Uint32(hdr[1:]))
			// The last block of the file may be short.
			if count == 0 || count > (left+bsz-1)/bsz {
				return copied, protoErr("LIT of %d blocks at offset %d of a %d-byte file", count, pos, size)
			}
			n := min(count*bsz, left)
			if k, err := io.CopyN(w, br, n); err != nil {
				if k < n && (err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF)) {
					return copied, protoErr("LIT data ends after %d of %d bytes", k, n)
				}
				return copied, err
			}
			pos += n
		default:
			return copied, protoErr("unknown delta operation %d", hdr[0])
		}
	}
	if _, err := br.ReadByte(); err != io.EOF {
		if err == nil {
			return copied, protoErr("delta has data after the end of the file")
		}
		return copied, err
	}
	return copied, nil
}

func truncated(err error, what string) error {
	if err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF) {
		return protoErr("delta ends inside or before a %s", what)
	}
	return err
}

// rootBase reads the base snapshot's files through an os.Root on its
// directory, opening each file once.
type rootBase struct {
	root  *os.Root
	files []ckpt.FileEntry
	open  map[uint32]*os.File
}

func newRootBase(dir string, files []ckpt.FileEntry) (*rootBase, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	return &rootBase{root: root, files: files, open: map[uint32]*os.File{}}, nil
}

func (b *rootBase) Size(i uint32) (int64, bool) {
	if uint64(i) >= uint64(len(b.files)) {
		return 0, false
	}
	return b.files[i].Size, true
}

func (b *rootBase) ReadAt(i uint32, p []byte, off int64) error {
	f, err := b.file(i)
	if err != nil {
		return err
	}
	_, err = f.ReadAt(p, off)
	return err
}

// file is base file i, opened once.
func (b *rootBase) file(i uint32) (*os.File, error) {
	f, ok := b.open[i]
	if !ok {
		var err error
		if f, err = b.root.Open(b.files[i].Name); err != nil {
			return nil, err
		}
		b.open[i] = f
	}
	return f, nil
}

func (b *rootBase) Close() {
	for _, f := range b.open {
		f.Close()
	}
	b.root.Close()
}

// hashingReader counts what passes through it, and hashes it into h unless h is nil.
type hashingReader struct {
	r io.Reader
	h hash.Hash
	n int64
}

func (hr *hashingReader) Read(p []byte) (int, error) {
	n, err := hr.r.Read(p)
	if hr.h != nil {
		hr.h.Write(p[:n])
	}
	hr.n += int64(n)
	return n, err
}
