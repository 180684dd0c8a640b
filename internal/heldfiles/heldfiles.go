// Package heldfiles checks that a process tree holds only files its user could have opened itself.
//
// CRIU restores a job as root: it reopens every file of the snapshot by path, following links, and maps
// every mapped file the same way. A user who swapped one of the job's files for a link to another file
// of the same size and mode (the only things CRIU compares), or for a path through a directory the user
// cannot search, would have root open that file for the job. Checking the paths before CRIU runs leaves a
// window to swap them in; Check instead looks at what the restored tree holds, once CRIU built it and
// before any of it runs (CRIU's post-restore notification): every descriptor, file mapping and working
// directory of every process. Each is looked up again from its path, as the user (its fsuid and fsgid, no
// supplementary group, no capability) with no link followed, must lead to the same inode, and must grant
// the user the access it is held with. A pass proves that the user could have opened the very inode;
// a swap during the check can only make it fail.
//
// An inode with no name left (nlink 0: a file deleted while open, a memfd, shared anonymous memory) is
// not looked up: CRIU recreates those from the snapshot's own copy, which the job held before. Only those the
// snapshot says it recreates (Restored): a link the user put in a file's place can lead CRIU to a root process's
// deleted file or memfd (/proc/PID/fd/N), which has no name left either.
package heldfiles

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/procstate"
)

// Held is one file a process holds, with the access it holds it with.
type Held struct {
	PID    int
	What   string // "descriptor 3", "mapping 7f00-7f10", "working directory"
	Path   string // as the kernel names it, from the process's root
	Dev    uint64
	Ino    uint64
	Access uint32 // unix.R_OK, W_OK, X_OK bits; 0: only reaching it (an O_PATH descriptor)
	// Nameless: an inode with no name left that the snapshot does not recreate: it cannot be the job's.
	Nameless bool
}

// Restored returns what a restore gives a task, by its PID in its own PID namespace (as dumped): its
// descriptors (CRIU's own service descriptors sit beside them at the post-restore notification, and
// CRIU's own shared anonymous mappings beside its mappings), and which of them the restore makes with no
// name left, from the snapshot's own copy.
type Restored func(nsPID int) (*image.Files, error)

// Check verifies that every file the tree rooted at pid holds is one user uid (group gid, no supplementary
// group: as the agent runs jobs) could open with the access it is held with. With restored, only the
// descriptors and mappings it names are the tree's, and an inode with no name left is taken only where it
// says the restore made it; with restored nil, every descriptor is checked and every such inode taken.
// uid 0 holds anything.
func Check(pid int, uid, gid uint32, restored Restored) error {
	if uid == 0 {
		return nil
	}
	pids, err := procstate.Tree(pid)
	if err != nil {
		return err
	}
	for _, p := range pids {
		if zombie(p) { // it holds nothing
			continue
		}
		var task *image.Files
		if restored != nil {
			ns, err := nsPID(p)
			if err == nil {
				task, err = restored(ns)
			}
			if err != nil {
				return fmt.Errorf("what the snapshot restores to process %d: %w", p, err)
			}
		}
		held, err := List(p, task)
		if err != nil {
			return err
		}
		root, err := unix.Open(fmt.Sprintf("/proc/%d/root", p), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open the root directory of process %d: %w", p, err)
		}
		err = asUser(uid, gid, func() error {
			for _, h := range held {
				if err := reach(root, h); err != nil {
					return fmt.Errorf("process %d holds %s, %s, which its user (uid %d, gid %d) could not open itself: %w; "+
						"a file of the job was replaced by a link, or its permissions changed, since the snapshot: put it back and retry",
						h.PID, h.What, h.Path, uid, gid, err)
				}
			}
			return nil
		})
		unix.Close(root)
		if err != nil {
			return err
		}
	}
	return nil
}

// zombie reports whether process pid has exited, unreaped.
func zombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// "pid (comm) state ...": comm may hold spaces and parentheses.
	i := strings.LastIndexByte(string(b), ')')
	return i >= 0 && i+2 < len(b) && b[i+2] == 'Z'
}

// nsPID is process pid's PID in its own PID namespace, the innermost.
func nsPID(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			if len(f) == 0 {
				break
			}
			return strconv.Atoi(f[len(f)-1])
		}
	}
	return 0, fmt.Errorf("process %d: no NSpid in its status", pid)
}

// List returns the files process pid holds by name: descriptors (only task's, if task is not nil) and
// mappings of files with a name left, and its working directory; and, if task is not nil, the inodes with
// no name left it holds that task does not name as such (Held.Nameless).
func List(pid int, task *image.Files) ([]Held, error) {
	var held []Held
	add := func(what, link string, access uint32, nameless bool) error {
		path, err := os.Readlink(link)
		if err != nil {
			return fmt.Errorf("process %d, %s: %w", pid, what, err)
		}
		if !strings.HasPrefix(path, "/") { // a pipe, socket or anonymous inode: no name to open it by
			return nil
		}
		var st unix.Stat_t
		if err := unix.Stat(link, &st); err != nil {
			return fmt.Errorf("process %d, %s: %w", pid, what, err)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFSOCK || (st.Nlink == 0 && task == nil) {
			return nil
		}
		// What the snapshot recreates with no name: at the post-restore notification, the name CRIU opened a
		// file deleted before the dump by is gone, but its ghost copy (NAME.cr.ID.ghost) may still be linked.
		if nameless && (st.Nlink == 0 || strings.HasSuffix(path, " (deleted)")) {
			return nil
		}
		held = append(held, Held{PID: pid, What: what, Path: path, Dev: st.Dev, Ino: st.Ino, Access: access, Nameless: st.Nlink == 0})
		return nil
	}
	proc := fmt.Sprintf("/proc/%d", pid)
	if err := add("working directory", proc+"/cwd", unix.X_OK, false); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(proc + "/fd")
	if err != nil {
		return nil, fmt.Errorf("list the descriptors of process %d: %w", pid, err)
	}
	for _, fd := range ents {
		n, err := strconv.Atoi(fd.Name())
		if err != nil {
			return nil, fmt.Errorf("process %d: descriptor %q", pid, fd.Name())
		}
		if task != nil && !task.Fds[n] {
			continue
		}
		flags, err := fdFlags(proc, fd.Name())
		if err != nil {
			return nil, err
		}
		if err := add("descriptor "+fd.Name(), proc+"/fd/"+fd.Name(), openAccess(flags), task != nil && task.NamelessFds[n]); err != nil {
			if errors.Is(err, unix.ENOENT) { // closed meanwhile (not in a restored tree, which is held)
				continue
			}
			return nil, err
		}
	}
	maps, err := mappings(proc)
	if err != nil {
		return nil, err
	}
	for _, m := range maps {
		if err := add("mapping "+m.addr, proc+"/map_files/"+m.addr, m.access, task != nil && (task.NamelessMaps[m.start] || !task.Maps[m.start])); err != nil {
			return nil, err
		}
	}
	return held, nil
}

// fdFlags reads the open flags of descriptor fd from its fdinfo.
func fdFlags(proc, fd string) (int, error) {
	b, err := os.ReadFile(proc + "/fdinfo/" + fd)
	if err != nil {
		return 0, fmt.Errorf("%s, descriptor %s: %w", proc, fd, err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "flags:"); ok {
			f, err := strconv.ParseInt(strings.TrimSpace(v), 8, 64)
			if err != nil {
				return 0, fmt.Errorf("%s, descriptor %s: flags %q: %w", proc, fd, v, err)
			}
			return int(f), nil
		}
	}
	return 0, fmt.Errorf("%s, descriptor %s: no flags in its fdinfo", proc, fd)
}

// openAccess is the access open flags give.
func openAccess(flags int) uint32 {
	if flags&unix.O_PATH != 0 {
		return 0
	}
	switch flags & unix.O_ACCMODE {
	case unix.O_WRONLY:
		return unix.W_OK
	case unix.O_RDWR:
		return unix.R_OK | unix.W_OK
	}
	return unix.R_OK
}

// mapping is a file mapping: its map_files name and the access it needs.
type mapping struct {
	addr   string
	start  uint64
	access uint32
}

// mappings lists the file mappings of a process from its smaps: every one needs its file open for reading;
// a shared one that may be made writable (VmFlags "mw") for writing too.
func mappings(proc string) ([]mapping, error) {
	f, err := os.Open(proc + "/smaps")
	if err != nil {
		return nil, fmt.Errorf("read the mappings of %s: %w", proc, err)
	}
	defer f.Close()
	var out []mapping
	cur := -1 // index in out of the mapping whose lines follow, -1 if not a file's
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if flags, ok := strings.CutPrefix(line, "VmFlags:"); ok {
			if cur >= 0 && mayWriteShared(flags) {
				out[cur].access |= unix.W_OK
			}
			cur = -1
			continue
		}
		fields := strings.Fields(line)
		// A mapping's header: "start-end perms offset dev inode [path]"; other lines are "Key: value".
		if len(fields) < 5 || strings.HasSuffix(fields[0], ":") || !strings.Contains(fields[0], "-") {
			continue
		}
		cur = -1
		if fields[4] == "0" { // anonymous
			continue
		}
		// smaps pads addresses with zeros, map_files does not.
		start, end, _ := strings.Cut(fields[0], "-")
		s, err1 := strconv.ParseUint(start, 16, 64)
		e, err2 := strconv.ParseUint(end, 16, 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("read the mappings of %s: a mapping %q", proc, fields[0])
		}
		out = append(out, mapping{addr: fmt.Sprintf("%x-%x", s, e), start: s, access: unix.R_OK})
		cur = len(out) - 1
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read the mappings of %s: %w", proc, err)
	}
	return out, nil
}

// mayWriteShared reports whether VmFlags name a shared mapping that may be writable.
func mayWriteShared(flags string) bool {
	var sh, mw bool
	for _, f := range strings.Fields(flags) {
		sh = sh || f == "sh"
		mw = mw || f == "mw"
	}
	return sh && mw
}

// reach opens h's path beneath root (the process's root directory) as the calling thread's user, with no
// link followed, and checks it is h's inode and grants h's access.
func reach(root int, h Held) error {
	if h.Nameless {
		return errors.New("it has no name left, and the snapshot holds no copy of it: CRIU reached it through a link (to /proc/PID/fd/N?)")
	}
	fd, st, err := lookupStat(root, h.Path)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if st.Dev != h.Dev || st.Ino != h.Ino {
		return fmt.Errorf("its path leads to another file (device %d inode %d, not %d %d)", st.Dev, st.Ino, h.Dev, h.Ino)
	}
	if h.Access == 0 {
		return nil
	}
	if err := unix.Faccessat2(fd, "", h.Access, unix.AT_EMPTY_PATH|unix.AT_EACCESS); err != nil {
		return fmt.Errorf("%s it: %w", accessName(h.Access), err)
	}
	return nil
}

func accessName(a uint32) string {
	var s []string
	for _, x := range []struct {
		bit  uint32
		name string
	}{{unix.R_OK, "read"}, {unix.W_OK, "write"}, {unix.X_OK, "search"}} {
		if a&x.bit != 0 {
			s = append(s, x.name)
		}
	}
	return strings.Join(s, " and ")
}

// asUser runs fn on an OS thread whose file-system identity is uid and gid, with no supplementary group
// and no capability, and which the runtime discards afterwards (credentials are per thread in the kernel;
// x/sys/unix changes them on the calling thread only, unlike package syscall).
func asUser(uid, gid uint32, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		errc <- func() error {
			if err := unix.Setgroups(nil); err != nil {
				return fmt.Errorf("drop supplementary groups: %w", err)
			}
			if err := unix.Setfsgid(int(gid)); err != nil {
				return fmt.Errorf("set fsgid %d: %w", gid, err)
			}
			if err := unix.Setfsuid(int(uid)); err != nil {
				return fmt.Errorf("set fsuid %d: %w", uid, err)
			}
			// setfsuid reports no failure: the previous value a second call returns is the one in force.
			if prev, _ := unix.SetfsuidRetUid(int(uid)); prev != int(uid) {
				return fmt.Errorf("set fsuid %d: still %d", uid, prev)
			}
			hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
			var none [2]unix.CapUserData
			if err := unix.Capset(&hdr, &none[0]); err != nil {
				return fmt.Errorf("drop capabilities: %w", err)
			}
			return fn()
		}()
	}()
	return <-errc
}

// CheckNames verifies, before CRIU runs, that user uid (group gid) could itself do what a restore does as
// root at each of names: bind a unix socket in its directory (reached with no link, which the user may
// write and search), replacing only a socket file of its own there (CRIU removes a stale one first), or
// open a FIFO (reached with no link, with the access the job held it with). A user who made a directory on
// the way a link would otherwise have root remove another's socket (say, the host's D-Bus socket) and
// bind the job's in its place. uid 0 may do anything.
//
// It is a check of the paths before the restore uses them: a swap during the restore is not seen (CRIU
// binds, removes and changes owners by path as root; see docs/deploy.md).
func CheckNames(uid, gid uint32, names []image.NamedPath) error {
	if uid == 0 || len(names) == 0 {
		return nil
	}
	root, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(root)
	return asUser(uid, gid, func() error {
		for _, n := range names {
			what, err := "FIFO", checkFIFO(root, n)
			if n.Socket {
				what, err = "unix socket", checkSocket(root, n, uid)
			}
			if err != nil {
				return fmt.Errorf("the snapshot has a %s at %s, which its user (uid %d, gid %d) could not restore itself: %w; "+
					"a directory on its way was replaced by a link, or its owner or permissions changed, since the snapshot: put it back and retry",
					what, n.Path, uid, gid, err)
			}
		}
		return nil
	})
}

// lookup opens path beneath root as the calling thread's user, with no link followed.
func lookup(root int, path string, flags int) (int, error) {
	return unix.Openat2(root, path, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC),
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
}

// lookupStat is lookup of a file (O_PATH, which a link's own inode answers at the end of path) with its
// status; the caller closes the descriptor.
func lookupStat(root int, path string) (int, unix.Stat_t, error) {
	var st unix.Stat_t
	fd, err := lookup(root, path, 0)
	if err != nil {
		return -1, st, fmt.Errorf("look it up: %w", err)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, st, err
	}
	return fd, st, nil
}

// checkSocket checks that the user could bind socket n itself: in a directory reached with no link that it
// may write (for a deleted socket, the restore first makes any missing directory: the nearest one there
// must be), replacing only a file of its own.
func checkSocket(root int, n image.NamedPath, uid uint32) error {
	dir, err := creatableDir(root, filepath.Dir(n.Path), n.Deleted)
	if err != nil || dir < 0 {
		return err
	}
	defer unix.Close(dir)
	var st unix.Stat_t
	switch err := unix.Fstatat(dir, filepath.Base(n.Path), &st, unix.AT_SYMLINK_NOFOLLOW); {
	case errors.Is(err, unix.ENOENT):
		return nil
	case err != nil:
		return fmt.Errorf("look it up: %w", err)
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return errors.New("it is a symbolic link")
	case st.Uid != uid && (n.Deleted || st.Mode&unix.S_IFMT == unix.S_IFSOCK):
		// CRIU removes a stale socket file there, or moves whatever is there aside for a deleted socket.
		return fmt.Errorf("the file there is owned by uid %d, which the restore would remove", st.Uid)
	}
	return nil
}

// creatableDir looks up directory dir with no link and checks the user may make a file in it, returning
// it open (O_PATH). With missingOK, a dir that does not exist is taken if the nearest directory above it
// that does is one the user may make a directory in (the restore makes the missing ones as root, then
// removes them): it then returns -1, there being nothing in dir yet.
func creatableDir(root int, dir string, missingOK bool) (int, error) {
	d := dir
	for {
		fd, err := lookup(root, d, unix.O_DIRECTORY)
		if errors.Is(err, unix.ENOENT) && missingOK && d != "/" {
			d = filepath.Dir(d)
			continue
		}
		if err != nil {
			return -1, fmt.Errorf("look up its directory %s: %w", d, err)
		}
		if err := unix.Faccessat2(fd, "", unix.W_OK|unix.X_OK, unix.AT_EMPTY_PATH|unix.AT_EACCESS); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("write in its directory %s: %w", d, err)
		}
		if d != dir {
			unix.Close(fd)
			return -1, nil
		}
		return fd, nil
	}
}

// checkFIFO checks that the user could open FIFO n itself: reached with no link, with the job's access. A
// FIFO the dump found deleted the restore makes afresh at its name from CRIU's ghost copy, then removes:
// the user could, in its directory.
func checkFIFO(root int, n image.NamedPath) error {
	if n.Deleted {
		dir, err := creatableDir(root, filepath.Dir(n.Path), true)
		if dir >= 0 {
			unix.Close(dir)
		}
		return err
	}
	fd, st, err := lookupStat(root, n.Path)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFIFO:
	case unix.S_IFLNK: // O_PATH|O_NOFOLLOW opens a link itself
		return errors.New("it is a symbolic link")
	default:
		return errors.New("it is not a FIFO")
	}
	if a := openAccess(int(n.Flags)); a != 0 {
		if err := unix.Faccessat2(fd, "", a, unix.AT_EMPTY_PATH|unix.AT_EACCESS); err != nil {
			return fmt.Errorf("%s it: %w", accessName(a), err)
		}
	}
	return nil
}
