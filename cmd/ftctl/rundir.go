package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/cli"
)

// checkRunDirParents refuses, for root, a run directory that another user could redirect or whose files
// another user could replace: mpirun (as root) executes the run directory's launcher script and every rank
// preloads its library. Every directory the lookup of dir's existing part walks through (links resolved,
// lookupDirs) must be owned by root and writable by no one else, unless sticky (as /tmp: others cannot
// replace root's entries there): a link in another user's directory is theirs to point elsewhere later, even
// where it now leads to root's own directories. Run as another user, ftctl only writes with that user's
// rights, and nothing is checked.
func checkRunDirParents(dir string, euid int) error {
	if euid != 0 {
		return nil
	}
	dirs, links, err := lookupDirs(filepath.Dir(dir))
	if err != nil {
		return fmt.Errorf("resolve the run directory's parent %s: %w", filepath.Dir(dir), err)
	}
	for _, d := range dirs {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		switch {
		case !ok:
			return fmt.Errorf("%s: no owner to check", d)
		case st.Uid != 0:
			return fmt.Errorf("run directory %s: %s is owned by uid %d, not root: that user could replace what mpirun runs as root; run ftctl mpirun as that user, or give a --dir under directories only root can write", dir, d, st.Uid)
		case fi.Mode().Perm()&0o022 != 0 && fi.Mode()&fs.ModeSticky == 0:
			return fmt.Errorf("run directory %s: %s is writable by group or others (%s): they could replace what mpirun runs as root; give a --dir under directories only root can write", dir, d, fi.Mode().Perm())
		}
	}
	// A sticky directory keeps others from replacing root's entries, not their own: another user's link
	// there is theirs to point elsewhere.
	for _, l := range links {
		fi, err := os.Lstat(l)
		if err != nil {
			return err
		}
		pfi, err := os.Stat(filepath.Dir(l))
		if err != nil {
			return err
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid != 0 && pfi.Mode().Perm()&0o022 != 0 {
			return fmt.Errorf("run directory %s: link %s is owned by uid %d in a directory others can write: that user could point it elsewhere; give a --dir under directories only root can write", dir, l, st.Uid)
		}
	}
	return nil
}

// makeRunDirParent creates the missing parents of the run directory dir with mkdirAll (os.MkdirAll), once
// checkRunDirParents accepts them, and checks again once they all exist: the first check looks only up to
// the first missing component, and in a sticky directory (/tmp) another user may create that one, or a link
// by its name, before mkdirAll does, which then puts the run directory inside their directory. Once every
// component exists and passes, only root can change what the lookup finds.
func makeRunDirParent(dir string, euid int, mkdirAll func(string, fs.FileMode) error) error {
	if err := checkRunDirParents(dir, euid); err != nil {
		return cli.Usagef("%v", err)
	}
	if err := mkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return fmt.Errorf("create the run directory's parent: %w", err)
	}
	if err := checkRunDirParents(dir, euid); err != nil {
		return cli.Usagef("%v", err)
	}
	return nil
}

// maxLinks is how many links a lookup follows, as Linux's (ELOOP past it).
const maxLinks = 40

// lookupDirs returns the directories, links resolved, in which the lookup of the absolute path p looks up a
// name, as the kernel walks it, up to p's first missing component (MkdirAll creates the rest there): each
// one's owner can change what the lookup finds. Every ancestor of each is among them. links are the links
// the lookup follows.
func lookupDirs(p string) (dirs, links []string, err error) {
	if p, err = filepath.Abs(p); err != nil {
		return nil, nil, err
	}
	seen := map[string]bool{}
	add := func(d string) {
		if !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	cur := "/"
	rest := strings.Split(p, "/")
	for len(rest) > 0 {
		name := rest[0]
		rest = rest[1:]
		switch name {
		case "", ".":
			continue
		case "..":
			cur = filepath.Dir(cur)
			continue
		}
		add(cur)
		next := filepath.Join(cur, name)
		fi, err := os.Lstat(next)
		if errors.Is(err, fs.ErrNotExist) {
			return dirs, links, nil
		}
		if err != nil {
			return nil, nil, err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			cur = next
			continue
		}
		if links = append(links, next); len(links) > maxLinks {
			return nil, nil, fmt.Errorf("%s: %w", p, syscall.ELOOP)
		}
		target, err := os.Readlink(next)
		if err != nil {
			return nil, nil, err
		}
		if filepath.IsAbs(target) {
			cur = "/"
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	add(cur)
	return dirs, links, nil
}

// writeNewFile creates name with data, refusing an existing file or link: the run directory is new, so
// anything already there was not put there by this run.
func writeNewFile(name string, data []byte, perm fs.FileMode) error {
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
