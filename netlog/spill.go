package netlog

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"math/rand/v2"
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
	dfd, err := openSpillDir(dir)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dfd)
	// Logged bytes are other programs' traffic: 0600, and with O_TMPFILE the file never has a name
	// at all, so no crash leaves one behind and nobody can open it by name.
	fd, err := unix.Openat(dfd, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err == nil {
		return &spillFile{f: os.NewFile(uintptr(fd), filepath.Join(dir, "(netlog spill, unlinked)"))}, nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EISDIR) && !errors.Is(err, unix.EINVAL) {
		return nil, fmt.Errorf("open netlog spill file in %q: %w (set Options.SpillDir to a writable local directory)", dir, err)
	}
	// A file system without O_TMPFILE: create (0600, never through a link) and unlink at once.
	for range 100 {
		name := fmt.Sprintf("netlog-spill-%d", rand.Uint64())
		fd, err = unix.Openat(dfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open netlog spill file in %q: %w (set Options.SpillDir to a writable local directory)", dir, err)
		}
		f := os.NewFile(uintptr(fd), filepath.Join(dir, name))
		if err := unix.Unlinkat(dfd, name, 0); err != nil {
			f.Close()
			return nil, fmt.Errorf("unlink netlog spill file %q: %w", f.Name(), err)
		}
		return &spillFile{f: f}, nil
	}
	return nil, fmt.Errorf("open netlog spill file in %q: %w", dir, unix.EEXIST)
}

// openSpillDir opens dir, which must be a directory of this user's that no one else may write to, and not a
// link (as ftagent --check-config wants log.spill_dir): the spill file is created through the descriptor,
// so what was checked is where the logged bytes go. In a directory others may write to they could rename
// or replace its entries; through a link of theirs, or in a directory of theirs, put the file where they
// choose (a file system they serve).
func openSpillDir(dir string) (int, error) {
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open netlog spill directory %q: %w (set Options.SpillDir to a local directory of this user's, not a link: mkdir -m 700)", dir, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(dfd, &st); err != nil {
		unix.Close(dfd)
		return -1, fmt.Errorf("stat netlog spill directory %q: %w", dir, err)
	}
	if int(st.Uid) != os.Geteuid() || st.Mode&0o022 != 0 {
		unix.Close(dfd)
		return -1, fmt.Errorf("netlog spill directory %q is owned by uid %d with mode %04o: %w (it holds other programs' traffic: chown it to uid %d and chmod go-w it, or 700)",
			dir, st.Uid, st.Mode&0o7777, fs.ErrPermission, os.Geteuid())
	}
	return dfd, nil
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
