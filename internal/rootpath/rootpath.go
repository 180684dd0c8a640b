// Package rootpath checks that root alone can change what a path leads to: what root runs, and the
// directories whose contents root creates, removes or trusts. A directory another user can write lets that
// user rename what root put there and put their own in its place, and a symbolic link on the way lets the
// owner of the link's directory point it elsewhere; both are followed here as the kernel follows them.
package rootpath

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// maxLinks bounds the symbolic links Resolve follows, as the kernel's ELOOP does.
const maxLinks = 40

// Resolve follows path one component at a time, as the kernel does when it opens it, and returns the file
// it names and every directory it passes through: those of the path, of each link on the way (a link in the
// middle of the path too, whose directory's owner could point it elsewhere), and of their targets.
func Resolve(path string) (string, []string, error) {
	abs := path // not cleaned: ".." after a link is the link's target's parent, as for the kernel
	if !filepath.IsAbs(path) {
		wd, err := os.Getwd()
		if err != nil {
			return "", nil, err
		}
		abs = wd + "/" + path
	}
	todo := strings.Split(abs, "/")
	cur, dirs, seen, links := "/", []string{"/"}, map[string]bool{"/": true}, 0
	for len(todo) > 0 {
		c := todo[0]
		todo = todo[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			cur = filepath.Dir(cur)
			continue
		}
		next := filepath.Join(cur, c)
		fi, err := os.Lstat(next)
		if err != nil {
			return "", nil, err
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			if links++; links > maxLinks {
				return "", nil, fmt.Errorf("%s: too many levels of symbolic links", path)
			}
			target, err := os.Readlink(next)
			if err != nil {
				return "", nil, err
			}
			if filepath.IsAbs(target) {
				cur = "/"
			}
			todo = append(strings.Split(target, "/"), todo...)
			continue
		}
		cur = next
		if len(todo) > 0 && !seen[cur] { // a directory on the way
			seen[cur] = true
			dirs = append(dirs, cur)
		}
	}
	return cur, dirs, nil
}

// ExistingPart is path, or its deepest ancestor that exists (a link counts as existing, dangling or not).
func ExistingPart(path string) string {
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil || filepath.Dir(p) == p {
			return p
		}
	}
}

// Trusted reports whether files of uid may decide what this process does as root: root's and its own (an
// agent run by another user, in tests, acts as that user).
func Trusted(uid uint32) bool { return uid == 0 || int64(uid) == int64(os.Geteuid()) }

// Owner is the uid that owns fi, or one Trusted never accepts when fi says none.
func Owner(fi fs.FileInfo) uint32 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Uid
	}
	return ^uint32(0)
}

// RootOnly checks that fi (of path) is root's and writable by root alone. risk says what another user
// could do otherwise, for the error ("change what runs as root").
func RootOnly(path string, fi fs.FileInfo, risk string) error {
	if uid := Owner(fi); !Trusted(uid) {
		return fmt.Errorf("%s is owned by uid %d, who could %s: chown root it or choose a path of root's", path, uid, risk)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%s has mode %04o, so others could %s: chmod go-w it or choose another path", path, fi.Mode().Perm(), risk)
	}
	return nil
}

// OnTheWay checks directories a path passes through (of Resolve): each root's and writable by root alone,
// but a sticky one of root's (others cannot rename or remove root's entries there, and the next directory
// on the way, which exists, is checked too).
func OnTheWay(dirs []string, risk string) error {
	for _, d := range dirs {
		di, err := os.Stat(d)
		if err != nil {
			return err
		}
		if di.Mode()&fs.ModeSticky != 0 && Trusted(Owner(di)) {
			continue
		}
		if err := RootOnly(d, di, risk); err != nil {
			return err
		}
	}
	return nil
}
