package netlog

import (
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// spillRef locates one slab's bytes in the spill file. The CRC covers the raw (uncompressed)
// bytes so a read verifies both the disk and the decompression.
type spillRef struct {
	off    int64
	n      int    // bytes in the file
	comp   bool   // the file holds the lz4 block, not the raw bytes
	rawLen uint32 // bytes after decompression
	crc    uint32
}

// spillFile is an append-only scratch file. It is unlinked as soon as it is created: spilled
// bytes are memory overflow, not a durable log, and must not outlive the process. Regions
// are released by punching holes, and the file is truncated when nothing is referenced.
type spillFile struct {
	mu   sync.Mutex
	f    *os.File
	end  int64 // next write offset
	live int64 // referenced bytes
}

func openSpill(dir string) (*spillFile, error) {
	// Logged bytes are other programs' traffic: 0600, and with O_TMPFILE the file never has a name
	// at all, so no crash leaves one behind and nobody can open it by name.
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err == nil {
		return &spillFile{f: os.NewFile(uintptr(fd), filepath.Join(dir, "(netlog spill, unlinked)"))}, nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EISDIR) && !errors.Is(err, unix.EINVAL) {
		return nil, fmt.Errorf("open netlog spill file in %q: %w (set Options.SpillDir to a writable local directory)", dir, err)
	}
	// A file system without O_TMPFILE: create (0600, never through a link) and unlink at once.
	f, err := os.CreateTemp(dir, "netlog-spill-*")
	if err != nil {
		return nil, fmt.Errorf("open netlog spill file in %q: %w (set Options.SpillDir to a writable local directory)", dir, err)
	}
	if err := os.Remove(f.Name()); err != nil {
		f.Close()
		return nil, fmt.Errorf("unlink netlog spill file %q: %w", f.Name(), err)
	}
	return &spillFile{f: f}, nil
}

// spillAlign aligns every region of the spill file to a block: a region's punch then frees every block it
// used, where one that shared a block with its neighbour left that block allocated until the file emptied.
const spillAlign = 4096

// write appends p at the next aligned offset and returns that offset. The data is not durable until sync.
func (s *spillFile) write(p []byte) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	off := (s.end + spillAlign - 1) &^ (spillAlign - 1)
	if _, err := s.f.WriteAt(p, off); err != nil {
		return 0, fmt.Errorf("write %d bytes to netlog spill file at %d: %w", len(p), off, err)
	}
	s.end = off + int64(len(p))
	s.live += int64(len(p))
	return off, nil
}

func (s *spillFile) sync() error {
	if err := s.f.Sync(); err != nil {
		return fmt.Errorf("fsync netlog spill file: %w (spilled slabs stay in memory)", err)
	}
	return nil
}

func (s *spillFile) readAt(p []byte, off int64) error {
	n, err := s.f.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil {
		err = errors.New("short read")
	}
	return fmt.Errorf("read %d bytes of netlog spill file at %d: %w", len(p), off, err)
}

// release gives a region back. Punching is best effort: a filesystem without hole punching
// keeps the blocks until the file empties and is truncated.
func (s *spillFile) release(off int64, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.live -= int64(n)
	if s.live == 0 {
		if s.f.Truncate(0) == nil {
			s.end = 0
		}
		return
	}
	// To the end of its last block: the next region starts on the block after.
	_ = unix.Fallocate(int(s.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, (int64(n)+spillAlign-1)&^(spillAlign-1))
}

func (s *spillFile) close() error { return s.f.Close() }
