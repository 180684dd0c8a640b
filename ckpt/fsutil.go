package ckpt

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// Snapshots hold process memory: only root may read them. Every directory
// of a store is dirPerm and every file filePerm, whatever the umask or the
// modes CRIU or a sender chose.
const (
	dirPerm  fs.FileMode = 0o700
	filePerm fs.FileMode = 0o600
)

// lockDir opens dir and takes an exclusive flock on it. The kernel drops the
// lock when the process dies, which is how Open tells a crashed writer's
// temp directory from a live one (in this process or another).
func lockDir(dir string, wait bool) (*os.File, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	how := unix.LOCK_EX
	if !wait {
		how |= unix.LOCK_NB
	}
	for {
		err = unix.Flock(int(d.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// StartWriteback asks the kernel to start writing f's dirty pages to disk now, without waiting
// (sync_file_range SYNC_FILE_RANGE_WRITE): a later fsync then waits only for what is still in flight. It
// is a hint; an error changes nothing (the fsync still makes the file durable).
func StartWriteback(f *os.File) {
	_ = unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
}

// writeFileSync writes data to path with filePerm and fsyncs it (not its
// directory).
func writeFileSync(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, filePerm)
	if err != nil {
		return err
	}
	// A file left by a crash keeps its old mode through O_TRUNC.
	if err := f.Chmod(filePerm); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// removeHidden removes path by first renaming it to a hidden name in the same
// directory, so a crash mid-removal never leaves a visible half snapshot.
func removeHidden(path, hiddenName string) error {
	dir := filepath.Dir(path)
	hidden := filepath.Join(dir, hiddenName)
	if err := os.Rename(path, hidden); err != nil {
		return err
	}
	if err := atomicfile.SyncDir(dir); err != nil {
		return err
	}
	return os.RemoveAll(hidden)
}

// uniqueDelName is a hidden name for a directory about to be removed that no
// Delete of the same snapshot can collide with.
func uniqueDelName(id string) string {
	return delPrefix + id + "." + strconv.FormatInt(time.Now().UnixNano(), 36)
}

// exchange atomically swaps two directory entries (renameat2
// RENAME_EXCHANGE): at every instant, each name holds one of the two.
func exchange(a, b string) error {
	for {
		err := unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return &os.LinkError{Op: "renameat2 RENAME_EXCHANGE", Old: a, New: b, Err: err}
		}
		return nil
	}
}

// tightenTree gives dir and everything in it the store's modes: dirPerm for
// directories, filePerm for regular files. Symbolic links are left alone
// (chmod would follow them); nothing else is expected in a store. changed says
// whether any mode was not already the store's.
func tightenTree(dir string) (changed bool, err error) {
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var want fs.FileMode
		switch {
		case d.IsDir():
			want = dirPerm
		case d.Type().IsRegular():
			want = filePerm
		default:
			return nil
		}
		c, err := tighten(path, d, want)
		changed = changed || c
		return err
	})
	return changed, err
}

// tighten sets path's permission bits to want unless they already are, and
// says whether it changed them.
func tighten(path string, d fs.DirEntry, want fs.FileMode) (bool, error) {
	info, err := d.Info()
	if err != nil {
		return false, err
	}
	if info.Mode().Perm() == want {
		return false, nil
	}
	if err := os.Chmod(path, want); err != nil {
		return false, fmt.Errorf("restrict %s to %v: %w", path, want, err)
	}
	return true, nil
}
