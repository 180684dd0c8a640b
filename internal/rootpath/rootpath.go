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
// middle of the path too, whose directory's owner could point it elsewhere), and of their targets. Each
// link on the way is listed too, after its directory: in a sticky one its own owner can point it elsewhere.
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
			if !seen[next] {
				seen[next] = true
				dirs = append(dirs, next)
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

// CheckOnlyRoot checks that only root can change what path leads to: the file it resolves to, which kind
// (if set) accepts first, is root's and writable by root alone (RootOnly), and so is every directory on the
// way (OnTheWay). risk says what another user could do otherwise, for the errors.
func CheckOnlyRoot(path, risk string, kind func(real string, fi fs.FileInfo) error) error {
	real, dirs, err := Resolve(path)
	if err != nil {
		return err
	}
	fi, err := os.Stat(real)
	if err != nil {
		return err
	}
	if kind != nil {
		if err := kind(real, fi); err != nil {
			return err
		}
	}
	if err := RootOnly(real, fi, risk); err != nil {
		return err
	}
	return OnTheWay(dirs, risk)
}

// OnTheWay checks directories a path passes through (of Resolve): each root's and writable by root alone,
// but a sticky one of root's (others cannot rename or remove root's entries there, and the next directory
// on the way, which exists, is checked too). A link on the way (of Resolve too) must be root's where others
// may write its directory: a sticky directory keeps them from replacing root's entries, not their own.
func OnTheWay(dirs []string, risk string) error {
	for _, d := range dirs {
		di, err := os.Lstat(d)
		if err != nil {
			return err
		}
		if di.Mode()&fs.ModeSymlink != 0 {
			pi, err := os.Stat(filepath.Dir(d))
			if err != nil {
				return err
			}
			if uid := Owner(di); !Trusted(uid) && pi.Mode().Perm()&0o022 != 0 {
				return fmt.Errorf("link %s is owned by uid %d in a directory others can write, who could point it elsewhere and %s: replace it with root's own link or choose a path of root's", d, uid, risk)
			}
			continue
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

// SafeDir checks that no user but root can replace or pre-create dir or anything on its way: every
// existing directory the path passes through, as the kernel resolves it (a symbolic link's directory and
// its target's too), is root's and writable by root alone, unless it is sticky and the path goes on in it
// through an entry that exists (others cannot rename root's entries there). dir itself, if it exists, must be
// a real directory, not a link (the agent opens it as it is). Missing components are created by the agent
// with the modes their contents need, so the deepest existing one must be root's alone.
// A shared directory (jobs_dir) may itself be sticky and writable by others.
func SafeDir(dir string, shared bool) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if fi, err := os.Lstat(abs); err == nil && !fi.IsDir() {
		return fmt.Errorf("is not a directory (mode %v): remove it or change the configuration", fi.Mode())
	}
	have := ExistingPart(abs)
	real, dirs, err := Resolve(have)
	if err != nil {
		return err
	}
	const risk = "swap what root writes there"
	if err := OnTheWay(dirs, risk); err != nil {
		return err
	}
	fi, err := os.Stat(real)
	if err != nil {
		return err
	}
	switch {
	case !fi.IsDir():
		return fmt.Errorf("%s is not a directory (mode %v)", real, fi.Mode())
	case !Trusted(Owner(fi)):
		return fmt.Errorf("%s is owned by uid %d: another user could %s; chown root it or choose a path of root's", real, Owner(fi), risk)
	case fi.Mode().Perm()&0o022 == 0:
		return nil
	case fi.Mode()&fs.ModeSticky == 0:
		return fmt.Errorf("%s is writable by group or others (mode %04o) and not sticky: chmod go-w it or choose another path", real, fi.Mode().Perm())
	case have != abs:
		return fmt.Errorf("%s does not exist yet in %s, which anyone may write to (mode %04o): another user could create it first; create it as root (mkdir -m 700) or choose another path",
			abs, real, fi.Mode().Perm())
	case !shared:
		return fmt.Errorf("%s is writable by others (mode %04o): the agent's directory must be root's alone", real, fi.Mode().Perm())
	}
	return nil // a sticky jobs_dir: users may add entries, not touch root's
}
