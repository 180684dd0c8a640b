// Package jobfs lets a root process read, write, create and truncate files in directories a job's user may
// control without ever following a link the user planted. Every name is resolved with openat2 beneath an
// open directory (RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS); an existing file is first
// opened with O_PATH, which has no side effect even on a FIFO or a device, and checked on that descriptor
// (a regular file, owned by the expected user) before it is reopened for reading or writing. Checks and use
// act on the same inode, so there is no window between them for the user to swap the name.
package jobfs

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrLink means a name, or a directory on the way to it, is a symbolic link: root does not follow it.
var ErrLink = errors.New("is a symbolic link, or a path through one")

// ErrEscape means a name leads outside the directory it is resolved beneath.
var ErrEscape = errors.New("leads outside its directory")

// ErrNotRegular means the name exists but is not a regular file (a directory, FIFO, device or socket).
var ErrNotRegular = errors.New("is not a regular file")

// ErrNotOwned means the file is owned by another user than the one it is handled for.
var ErrNotOwned = errors.New("is owned by another user")

// resolve forbids every link and every escape from the directory a name is resolved beneath.
const resolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// Dir is an open directory; names are resolved beneath it.
type Dir struct {
	f    *os.File
	path string // for messages only: operations use the descriptor
}

// OpenDir opens the directory at path, refusing a link as its last component. The components above it
// must be trusted, that is, root's own (such as the configured jobs_dir, which may well sit behind an
// administrator's symbolic link).
func OpenDir(path string) (*Dir, error) {
	fd, err := retry(func() (int, error) {
		return unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	})
	if errors.Is(err, unix.ENOTDIR) {
		// O_DIRECTORY|O_NOFOLLOW answers a link with ENOTDIR: say what it is.
		var st unix.Stat_t
		if unix.Lstat(path, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
			err = unix.ELOOP
		}
	}
	if err != nil {
		return nil, pathError("open directory", path, err)
	}
	return &Dir{f: os.NewFile(uintptr(fd), path), path: path}, nil
}

// OpenTrusted opens a directory root configured itself (such as jobs_dir), following links anywhere on
// its path: an administrator may well have put it behind one. Names beneath it are still resolved with
// no link.
func OpenTrusted(path string) (*Dir, error) {
	fd, err := retry(func() (int, error) {
		return unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	})
	if err != nil {
		return nil, pathError("open directory", path, err)
	}
	return &Dir{f: os.NewFile(uintptr(fd), path), path: path}, nil
}

// OpenRoot opens "/" so that an absolute path can be resolved with no link anywhere on it.
func OpenRoot() (*Dir, error) { return OpenDir("/") }

// Path is the directory's path, for messages.
func (d *Dir) Path() string { return d.path }

// Close closes the directory.
func (d *Dir) Close() error { return d.f.Close() }

func (d *Dir) fd() int { return int(d.f.Fd()) }

// join names a file beneath d in messages.
func (d *Dir) join(name string) string { return filepath.Join(d.path, name) }

// Rel turns an absolute path into a name beneath d ("/" for OpenRoot), or reports that it is not beneath d.
func (d *Dir) Rel(path string) (string, bool) {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return "", false
	}
	rel, err := filepath.Rel(d.path, path)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", false
	}
	return rel, true
}

// openat2 opens name beneath d with no link anywhere on the way.
func (d *Dir) openat2(name string, flags uint64, mode uint32) (int, error) {
	if name == "" || filepath.IsAbs(name) {
		return -1, fmt.Errorf("%q is not a relative name", name)
	}
	how := unix.OpenHow{Flags: flags | unix.O_CLOEXEC | unix.O_NOFOLLOW, Mode: uint64(mode), Resolve: resolve}
	return retry(func() (int, error) { return unix.Openat2(d.fd(), name, &how) })
}

// OpenDir opens the directory name beneath d.
func (d *Dir) OpenDir(name string) (*Dir, error) {
	fd, err := d.openat2(name, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if errors.Is(err, unix.ENOTDIR) {
		var st unix.Stat_t
		if unix.Fstatat(d.fd(), name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
			err = unix.ELOOP
		}
	}
	if err != nil {
		return nil, pathError("open directory", d.join(name), err)
	}
	return &Dir{f: os.NewFile(uintptr(fd), d.join(name)), path: d.join(name)}, nil
}

// Mkdir creates the directory name (one component) in d with exactly perm, owned by the caller, and opens
// it. It fails if name exists already, whatever it is.
func (d *Dir) Mkdir(name string, perm os.FileMode) (*Dir, error) {
	if err := oneComponent(name); err != nil {
		return nil, err
	}
	if err := unix.Mkdirat(d.fd(), name, uint32(perm.Perm())); err != nil {
		return nil, pathError("create directory", d.join(name), err)
	}
	nd, err := d.OpenDir(name)
	if err != nil {
		return nil, err
	}
	// The umask may have taken bits away.
	if err := unix.Fchmod(nd.fd(), uint32(perm.Perm())); err != nil {
		nd.Close()
		return nil, pathError("set the mode of", nd.path, err)
	}
	return nd, nil
}

// Stat returns the directory's own status.
func (d *Dir) Stat() (unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstat(d.fd(), &st); err != nil {
		return st, pathError("stat", d.path, err)
	}
	return st, nil
}

// Chown changes the directory's owner, through its descriptor.
func (d *Dir) Chown(uid, gid uint32) error {
	if err := unix.Fchown(d.fd(), int(uid), int(gid)); err != nil {
		return pathError("change the owner of", d.path, err)
	}
	return nil
}

// Chmod changes the directory's mode, through its descriptor.
func (d *Dir) Chmod(perm os.FileMode) error {
	if err := unix.Fchmod(d.fd(), uint32(perm.Perm())); err != nil {
		return pathError("set the mode of", d.path, err)
	}
	return nil
}

// Open opens the existing regular file name beneath d for reading, whoever owns it. For trees only root
// writes to (snapshots); use OpenOwned where a user could have put the file there.
func (d *Dir) Open(name string) (*os.File, error) {
	return d.open(name, os.O_RDONLY, nil)
}

// OpenOwned opens the existing regular file name beneath d with flag (os.O_RDONLY, os.O_WRONLY or
// os.O_RDWR, optionally os.O_APPEND), provided uid owns it. A file owned by someone else, such as a hard
// link to root's file, is refused: root acts on the user's behalf only on what the user could change
// itself.
func (d *Dir) OpenOwned(name string, flag int, uid uint32) (*os.File, error) {
	return d.open(name, flag, &uid)
}

func (d *Dir) open(name string, flag int, uid *uint32) (*os.File, error) {
	if flag&^(os.O_RDONLY|os.O_WRONLY|os.O_RDWR|os.O_APPEND) != 0 {
		return nil, fmt.Errorf("open %s: flags %#x: only the access mode and O_APPEND are allowed", d.join(name), flag)
	}
	p := d.join(name)
	pfd, err := d.openat2(name, unix.O_PATH, 0)
	if err != nil {
		return nil, pathError("open", p, err)
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return nil, pathError("stat", p, err)
	}
	if err := check(p, &st, uid); err != nil {
		return nil, err
	}
	// Reopen the very inode just checked. Through /proc the O_PATH descriptor is a magic link that only
	// the kernel resolves: nothing the user controls is looked up again.
	fd, err := retry(func() (int, error) {
		return unix.Open("/proc/self/fd/"+strconv.Itoa(pfd), flag|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	})
	if err != nil {
		return nil, pathError("reopen", p, err)
	}
	return os.NewFile(uintptr(fd), p), nil
}

// check accepts a regular file owned by *uid (any owner if uid is nil).
func check(p string, st *unix.Stat_t, uid *uint32) error {
	// With O_PATH|O_NOFOLLOW, openat2 returns a link at the last component instead of failing.
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return &fs.PathError{Op: "open", Path: p, Err: ErrLink}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return &fs.PathError{Op: "open", Path: p, Err: ErrNotRegular}
	}
	if uid != nil && st.Uid != *uid {
		return &fs.PathError{Op: "open", Path: p, Err: fmt.Errorf("%w (uid %d, not uid %d)", ErrNotOwned, st.Uid, *uid)}
	}
	return nil
}

// Create creates the regular file name beneath d, which must not exist in any form (O_EXCL: not even as a
// dangling link), opened for writing, with exactly perm and owned by uid:gid.
func (d *Dir) Create(name string, perm os.FileMode, uid, gid uint32) (*os.File, error) {
	p := d.join(name)
	fd, err := d.openat2(name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL, uint32(perm.Perm()))
	if err != nil {
		return nil, pathError("create", p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	if err := unix.Fchmod(fd, uint32(perm.Perm())); err != nil {
		f.Close()
		unix.Unlinkat(d.fd(), name, 0)
		return nil, pathError("set the mode of", p, err)
	}
	if err := unix.Fchown(fd, int(uid), int(gid)); err != nil {
		f.Close()
		unix.Unlinkat(d.fd(), name, 0)
		return nil, pathError("hand to uid "+strconv.FormatUint(uint64(uid), 10), p, err)
	}
	return f, nil
}

// RemoveFile removes name (one component) from d if it is still the file f: a name the user has since
// pointed elsewhere is left alone.
func (d *Dir) RemoveFile(name string, f *os.File) error {
	if err := oneComponent(name); err != nil {
		return err
	}
	var now, was unix.Stat_t
	if err := unix.Fstatat(d.fd(), name, &now, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return pathError("stat", d.join(name), err)
	}
	if err := unix.Fstat(int(f.Fd()), &was); err != nil {
		return pathError("stat", d.join(name), err)
	}
	if now.Dev != was.Dev || now.Ino != was.Ino {
		return fmt.Errorf("remove %s: it is no longer the file created there; left alone", d.join(name))
	}
	if err := unix.Unlinkat(d.fd(), name, 0); err != nil {
		return pathError("remove", d.join(name), err)
	}
	return nil
}

// Rename renames oldName to newName (one component each) within d, replacing newName; a link is renamed
// as itself, never followed.
func (d *Dir) Rename(oldName, newName string) error {
	for _, n := range []string{oldName, newName} {
		if err := oneComponent(n); err != nil {
			return err
		}
	}
	if err := unix.Renameat(d.fd(), oldName, d.fd(), newName); err != nil {
		return pathError("rename", d.join(oldName), err)
	}
	return nil
}

// Remove removes name (one component, not a directory) from d; a link is removed, never followed.
func (d *Dir) Remove(name string) error {
	if err := oneComponent(name); err != nil {
		return err
	}
	if err := unix.Unlinkat(d.fd(), name, 0); err != nil {
		return pathError("remove", d.join(name), err)
	}
	return nil
}

// RemoveDir removes the empty directory name (one component) from d.
func (d *Dir) RemoveDir(name string) error {
	if err := oneComponent(name); err != nil {
		return err
	}
	if err := unix.Unlinkat(d.fd(), name, unix.AT_REMOVEDIR); err != nil {
		return pathError("remove directory", d.join(name), err)
	}
	return nil
}

// WriteFileAtomic replaces name (one component) in d with data, so that readers see the old content or
// the new, never a torn file: a fresh temporary file (O_EXCL), fsync, rename within d, fsync d. A link
// at name is replaced, never followed.
func (d *Dir) WriteFileAtomic(name string, data []byte, perm os.FileMode) error {
	if err := oneComponent(name); err != nil {
		return err
	}
	var rnd [6]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return err
	}
	tmp := "." + name + ".tmp-" + hex.EncodeToString(rnd[:])
	f, err := d.Create(tmp, perm, uint32(os.Geteuid()), uint32(os.Getegid()))
	if err != nil {
		return fmt.Errorf("write %s: %w", d.join(name), err)
	}
	fail := func(err error) error {
		f.Close()
		unix.Unlinkat(d.fd(), tmp, 0)
		return fmt.Errorf("write %s: %w", d.join(name), err)
	}
	if _, err := f.Write(data); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		unix.Unlinkat(d.fd(), tmp, 0)
		return fmt.Errorf("write %s: %w", d.join(name), err)
	}
	if err := unix.Renameat(d.fd(), tmp, d.fd(), name); err != nil {
		unix.Unlinkat(d.fd(), tmp, 0)
		return fmt.Errorf("write %s: %w", d.join(name), err)
	}
	if err := d.f.Sync(); err != nil {
		return fmt.Errorf("write %s: sync the directory: %w", d.join(name), err)
	}
	return nil
}

// oneComponent refuses a name with a directory part: it is looked up by a call (mkdirat, unlinkat,
// renameat) that would follow links in that part.
func oneComponent(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsRune(name, '/') {
		return fmt.Errorf("%q is not a single file name", name)
	}
	return nil
}

// retry repeats a call interrupted by a signal, or one openat2 could not resolve safely because of a
// concurrent rename (EAGAIN), a bounded number of times.
func retry(call func() (int, error)) (int, error) {
	for i := 0; ; i++ {
		fd, err := call()
		if (errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN)) && i < 100 {
			continue
		}
		return fd, err
	}
}

// pathError names the path and turns the kernel's answers to a link into ErrLink.
func pathError(op, path string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP):
		err = ErrLink
	case errors.Is(err, unix.EXDEV):
		err = ErrEscape
	}
	return &fs.PathError{Op: op, Path: path, Err: err}
}
