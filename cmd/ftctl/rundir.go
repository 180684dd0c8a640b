package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// checkRunDirParents refuses, for root, a run directory that another user could redirect or whose files
// another user could replace: mpirun (as root) executes the run directory's launcher script and every rank
// preloads its library. Each existing ancestor of dir (links resolved) must be owned by root and writable
// by no one else, unless sticky (as /tmp: others cannot replace root's entries there). Run as another
// user, ftctl only writes with that user's rights, and nothing is checked.
func checkRunDirParents(dir string, euid int) error {
	if euid != 0 {
		return nil
	}
	p := filepath.Dir(dir)
	for {
		if _, err := os.Lstat(p); err == nil {
			break
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		p = filepath.Dir(p)
	}
	real, err := filepath.EvalSymlinks(p)
	if err != nil {
		return fmt.Errorf("resolve the run directory's parent %s: %w", p, err)
	}
	for d := real; ; d = filepath.Dir(d) {
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
		if d == "/" || d == "." {
			return nil
		}
	}
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
