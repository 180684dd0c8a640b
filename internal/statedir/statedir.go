// Package statedir creates a root daemon's directories with the modes their contents need, whatever the
// umask, and restricts what an older version left readable, without following a link anywhere a user
// could have made one.
package statedir

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/ftkit/ftkit/internal/rootpath"
	"golang.org/x/sys/unix"
)

// Modes of the directories. A private directory holds root's own data (memory images, records): root
// only. Users reach public directories through it or beside it (a job's directory, a socket's): a private
// directory on the way to one of those is traverse-only for others.
const (
	privateDir  fs.FileMode = 0o700
	passDir     fs.FileMode = 0o711 // others may pass through to a public directory below, not list
	publicDir   fs.FileMode = 0o755
	privateFile fs.FileMode = 0o600
)

// Prepare creates the private directories 0700, or 0711 when a public one lies below them, and the public
// directories, and any missing parent of these, 0755; an existing public directory keeps the mode its
// administrator gave it. Root's own files directly in a private directory become 0600, and its
// subdirectories 0700 (0711 on the way to a public one). Paths are made absolute first.
func Prepare(private, public []string) error {
	abs := func(ps []string) ([]string, error) {
		var out []string
		for _, p := range ps {
			a, err := filepath.Abs(p)
			if err != nil {
				return nil, fmt.Errorf("resolve %s: %w", p, err)
			}
			out = append(out, a)
		}
		return out, nil
	}
	private, err := abs(private)
	if err != nil {
		return err
	}
	if public, err = abs(public); err != nil {
		return err
	}
	for _, d := range private {
		if err := makePrivateDir(d, public); err != nil {
			return err
		}
	}
	for _, d := range public {
		if err := makePublicDir(d); err != nil {
			return err
		}
	}
	for _, d := range private {
		if err := restrictEntries(d, public); err != nil {
			return err
		}
	}
	return nil
}

// isPublic reports whether dir is one of the public directories.
func isPublic(dir string, public []string) bool {
	for _, p := range public {
		if p == dir {
			return true
		}
	}
	return false
}

// within reports whether p is dir or lies below it.
func within(p, dir string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// makePrivateDir creates dir and gives it privateDir, or passDir if a public directory lies below it. A
// directory that is itself public is left to makePublicDir.
func makePrivateDir(dir string, public []string) error {
	if isPublic(dir, public) {
		return nil
	}
	perm := privateDir
	for _, p := range public {
		if within(p, dir) {
			perm = passDir
		}
	}
	// Missing parents may be shared with jobs_dir (the lab puts each host's state_dir beside the cluster's
	// jobs_dir): they are created as a plain mkdir -p would without the unit's umask.
	if err := makePublicDir(filepath.Dir(dir)); err != nil {
		return err
	}
	if err := os.Mkdir(dir, privateDir); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	// One that existed may not be root's: a link (root would chmod its target, and restrict the files of
	// root's in it) or another user's directory (who could read and change what root keeps there).
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s without following a link: %w: it must be a directory, not a link; remove it or change the configuration", dir, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("restrict %s: %w", dir, err)
	}
	if !rootpath.Trusted(st.Uid) {
		return fmt.Errorf("%s is owned by uid %d, who could read and change what root keeps there: chown root it or choose a path of root's", dir, st.Uid)
	}
	if err := unix.Fchmod(fd, uint32(perm)); err != nil {
		return fmt.Errorf("restrict %s to %v: %w", dir, perm, err)
	}
	return nil
}

// makePublicDir creates the missing components of dir as publicDir exactly (the umask would make them
// 0700); existing ones keep their mode.
func makePublicDir(dir string) error {
	var missing []string
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil {
			break
		} else if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("create %s: %w", dir, err)
		}
		missing = append(missing, d)
		if filepath.Dir(d) == d {
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		if err := os.Mkdir(d, publicDir); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("create %s: %w", d, err)
		}
		if err := os.Chmod(d, publicDir); err != nil {
			return fmt.Errorf("create %s: %w", d, err)
		}
	}
	return nil
}

// restrictEntries gives root's regular files directly in dir privateFile and, unless dir is public (the
// records directory is jobs_dir by default: its subdirectories are the jobs'), root's subdirectories
// privateDir (passDir on the way to a public directory; a public one is left alone). A user who can
// create entries in dir (a jobs_dir made world-writable) cannot make root chmod anything else: files are
// opened without following links and only root's are touched.
func restrictEntries(dir string, public []string) error {
	withDirs := !isPublic(dir, public)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("list %s: %w", dir, err)
	}
	var errs []error
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		switch {
		case e.Type().IsRegular():
			if err := restrictFile(p, privateFile); err != nil {
				errs = append(errs, err)
			}
		case e.IsDir() && withDirs:
			if isPublic(p, public) {
				continue
			}
			perm := privateDir
			for _, pub := range public {
				if within(pub, p) {
					perm = passDir
				}
			}
			if err := restrictFile(p, perm); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// restrictFile sets the mode of path, a root-owned file (with one link) or directory, to perm unless it already is;
// anything else (a link, another user's file) is left alone.
func restrictFile(path string, perm fs.FileMode) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("restrict %s: %w", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("restrict %s: %w", path, err)
	}
	kind := st.Mode & unix.S_IFMT
	if st.Uid != 0 || (kind != unix.S_IFREG && kind != unix.S_IFDIR) || fs.FileMode(st.Mode&0o7777) == perm {
		return nil
	}
	// O_NOFOLLOW stops a symbolic link, not a hard one: a user who can create entries in dir could link
	// root's file from elsewhere (a world-writable one, or any with fs.protected_hardlinks off). Root's
	// own state files have a single link.
	if kind == unix.S_IFREG && st.Nlink != 1 {
		return nil
	}
	if err := unix.Fchmod(fd, uint32(perm)); err != nil {
		return fmt.Errorf("restrict %s to %v: %w", path, perm, err)
	}
	return nil
}
