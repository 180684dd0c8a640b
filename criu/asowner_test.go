package criu

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/testenv"
)

// listenerRole is the process TestBindAsOwner dumps: it listens on the unix socket FTKIT_SOCK names, connects
// to it without accepting (a pending connection, which CRIU restores by connecting to the name), writes
// FTKIT_DIR/ready and sleeps. fifoRole, the one TestOpenAsOwner dumps, holds the FIFO FTKIT_FIFO names open
// with fifoBytes in it.
const (
	listenerRole = "usk-listener"
	fifoRole     = "fifo-holder"

	fifoBytes = "the job's bytes"
)

func runListener(sock, work string) int {
	l, err := net.Listen("unix", sock)
	if err == nil {
		var c net.Conn
		if c, err = net.Dial("unix", sock); err == nil {
			defer c.Close()
			err = os.WriteFile(filepath.Join(work, "ready"), nil, 0o600)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "listener:", err)
		return 1
	}
	defer l.Close()
	select {}
}

func runFIFOHolder(fifo, work string) int {
	f, err := os.OpenFile(fifo, os.O_RDWR, 0) // both ends: the open does not wait for a peer
	if err == nil {
		defer f.Close()
		if _, err = f.WriteString(fifoBytes); err == nil {
			err = os.WriteFile(filepath.Join(work, "ready"), nil, 0o600)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fifo holder:", err)
		return 1
	}
	select {}
}

// asUser is the job's user in these tests.
const asUser = 65534

// ownersJob is a job of asUser's, run as root (as CRIU restores it) in its own session, PID and network
// namespace, as the test binary playing role in directory work (root's, which asUser may search), from a
// copy of the binary there (CRIU maps it as the user).
type ownersJob struct {
	cmd         *exec.Cmd
	work, ns    string
	bin, images string
}

// startOwnersJob starts the job with env and waits for its work/ready.
func startOwnersJob(t *testing.T, bin, work, role string, env ...string) ownersJob {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(work, "job")
	if err := os.WriteFile(exe, b, 0o755); err != nil {
		t.Fatal(err)
	}
	j := ownersJob{cmd: exec.Command(exe), work: work, bin: bin, images: filepath.Join(work, "images")}
	j.cmd.Env = append(append(os.Environ(), "FTKIT_CRIU_TEST_ROLE="+role, "FTKIT_DIR="+work), env...)
	j.cmd.Stderr = os.Stderr
	j.cmd.Dir = work // CRIU opens the working directory as the user too
	j.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	j.ns = testenv.Netns(t, "ftow") // CRIU's network lock table goes with it, whatever the test's end
	if err := netnsthread.In(j.ns, j.cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.cmd.Process.Kill(); j.cmd.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(work, "ready")); err == nil {
			return j
		}
		if time.Now().After(deadline) {
			t.Fatalf("the job (%s) was not ready within 30s", role)
		}
	}
}

// dump dumps the job into work/images.
func (j ownersJob) dump(t *testing.T) {
	t.Helper()
	if err := os.Mkdir(j.images, 0o700); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (Client{Binary: j.bin}).Dump(ctx, DumpOptions{PID: j.cmd.Process.Pid, ImagesDir: j.images, Netns: j.ns}); err != nil {
		t.Fatal(err)
	}
	j.cmd.Wait() // killed by the dump
}

// restore restores the dump as asUser's, as ftkit's shim names the user to CRIU (CRIU inherits this
// process's environment); the caller reaps a restored tree.
func (j ownersJob) restore(t *testing.T) (int, error) {
	t.Helper()
	t.Setenv(RestoreUIDEnv, fmt.Sprint(asUser))
	t.Setenv(RestoreGIDEnv, fmt.Sprint(asUser))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	return restoreIn(ctx, j.ns, Client{Binary: j.bin}, RestoreOptions{ImagesDir: j.images})
}

// lacks fails the test: the restore did what the patch named forbids.
func (j ownersJob) lacks(t *testing.T, what, patch string) {
	t.Helper()
	level, _ := BinaryPatchLevel(j.bin)
	t.Fatalf("%s; %s (patch level %d, want %d) lacks patches/%s", what, j.bin, level, PatchLevel(), patch)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// ownersWork is a directory of root's that asUser may search, removed when the test ends.
func ownersWork(t *testing.T, prefix string) string {
	t.Helper()
	work, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(work) })
	if err := os.Chmod(work, 0o755); err != nil {
		t.Fatal(err)
	}
	return work
}

// TestBindAsOwner (patches/0006): CRIU binds a dumped unix socket, removes the stale file at its name and
// connects to it as the job's user (RestoreUIDEnv, RestoreGIDEnv), not as root. A dump of a listener whose
// directory and socket file uid 65534 owns, after its directory was made a link to a root directory holding
// root's socket of the same name: unpatched CRIU removed root's socket and bound the job's there, chowned to
// uid 65534; patched, the restore fails and root's socket is untouched. With the directory back, the same
// dump restores (its pending connection connected again as the user), its socket file uid 65534's.
func TestBindAsOwner(t *testing.T) {
	bin := requireCRIU(t, "CRIU")
	work := ownersWork(t, "bindowner-")
	run, rootDir := filepath.Join(work, "run"), filepath.Join(work, "rootrun")
	must(t, os.Mkdir(run, 0o755))
	must(t, os.Chown(run, asUser, asUser))
	must(t, os.Mkdir(rootDir, 0o755))
	sock := filepath.Join(run, "job.sock")

	j := startOwnersJob(t, bin, work, listenerRole, "FTKIT_SOCK="+sock)
	must(t, os.Lchown(sock, asUser, asUser)) // as the user's job binds it
	j.dump(t)

	// Root's socket where the link leads.
	rootSock := filepath.Join(rootDir, "job.sock")
	l, err := net.Listen("unix", rootSock)
	must(t, err)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	var before unix.Stat_t
	must(t, unix.Lstat(rootSock, &before))
	putBack := testenv.SwapForLink(t, run, rootDir)
	pid, err := j.restore(t)
	if err == nil {
		reap(pid)
	}
	var after unix.Stat_t
	if serr := unix.Lstat(rootSock, &after); serr != nil || after.Ino != before.Ino || after.Uid != 0 {
		t.Errorf("root's socket after the restore: %v, inode %d (was %d), owner %d: CRIU replaced it as root", serr, after.Ino, before.Ino, after.Uid)
	}
	if err == nil {
		j.lacks(t, "the restore bound the job's socket through a link into root's directory", "0006")
	}
	t.Logf("refused: %v", err)

	putBack()
	pid, err = j.restore(t)
	if err != nil {
		t.Fatalf("the restore with the directory back: %v", err)
	}
	defer reap(pid)
	var st unix.Stat_t
	if err := unix.Lstat(sock, &st); err != nil || st.Uid != asUser || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		t.Fatalf("the restored socket file: %v, owner %d, mode %#o; want a socket of uid %d", err, st.Uid, st.Mode, asUser)
	}
}

// TestOpenAsOwner (patches/0007): CRIU opens a job's files as the job's user. A dump of a job holding its
// user's FIFO with bytes in it, after the FIFO was swapped for a link to root's (mode 0600): unpatched CRIU
// opened root's FIFO as root and wrote the job's bytes into it, for whatever reads it (the shim's check of
// the name comes before CRIU, which leaves the time between for the swap); patched, the restore fails and
// root's FIFO gets nothing. With the job's FIFO back, the same dump restores, the job's bytes in its FIFO.
func TestOpenAsOwner(t *testing.T) {
	bin := requireCRIU(t, "CRIU")
	work := ownersWork(t, "openowner-")
	fifo, rootFIFO := filepath.Join(work, "run", "fifo"), filepath.Join(work, "rootrun", "fifo")
	for _, d := range []string{filepath.Dir(fifo), filepath.Dir(rootFIFO)} {
		must(t, os.Mkdir(d, 0o755))
	}
	must(t, os.Chown(filepath.Dir(fifo), asUser, asUser))
	must(t, unix.Mkfifo(fifo, 0o600))
	must(t, os.Chown(fifo, asUser, asUser))
	must(t, unix.Mkfifo(rootFIFO, 0o600))

	j := startOwnersJob(t, bin, work, fifoRole, "FTKIT_FIFO="+fifo)
	j.dump(t)

	// Root's reader, as a daemon reading its FIFO would be.
	r, err := os.OpenFile(rootFIFO, os.O_RDONLY|unix.O_NONBLOCK, 0)
	must(t, err)
	defer r.Close()
	putBack := testenv.SwapForLink(t, fifo, rootFIFO)
	pid, err := j.restore(t)
	if err == nil {
		reap(pid)
	}
	buf := make([]byte, 64)
	// Nothing to read: end of file with no writer left, EAGAIN with one.
	if n, rerr := unix.Read(int(r.Fd()), buf); n > 0 {
		t.Errorf("root's FIFO after the restore holds %q: CRIU wrote the job's bytes into it as root", buf[:n])
	} else if rerr != nil && rerr != unix.EAGAIN {
		t.Fatalf("read root's FIFO: %v", rerr)
	}
	if err == nil {
		j.lacks(t, "the restore opened root's FIFO through a link", "0007")
	}
	// Refused for the open as the user, not for something else that would hide a missing patch.
	if !strings.Contains(err.Error(), "Can't open fake fifo") || !strings.Contains(err.Error(), "Permission denied") {
		t.Fatalf("the restore failed with %v, want the user's open of the FIFO refused (Permission denied)", err)
	}
	t.Logf("refused: %v", err)

	putBack()
	pid, err = j.restore(t)
	if err != nil {
		t.Fatalf("the restore with the job's FIFO back: %v", err)
	}
	defer reap(pid)
	f, err := os.OpenFile(fifo, os.O_RDONLY|unix.O_NONBLOCK, 0)
	must(t, err)
	defer f.Close()
	n, err := f.Read(buf)
	if got := string(buf[:max(n, 0)]); got != fifoBytes {
		t.Fatalf("the restored job's FIFO holds %q (%v), want %q", got, err, fifoBytes)
	}
}

// reap kills and reaps a restored tree, the caller's child (rst_sibling).
func reap(pid int) {
	var ws unix.WaitStatus
	unix.Kill(pid, unix.SIGKILL)
	unix.Wait4(pid, &ws, 0, nil)
}

// TestRestoreUserNamedBadly (patches/0006): a job's user named to CRIU in a way it cannot take (a uid
// without a gid; -1, which setresuid reads as "unchanged") fails the restore; CRIU took it for no user and
// did everything as root.
func TestRestoreUserNamedBadly(t *testing.T) {
	bin := requireCRIU(t, "CRIU")
	work := ownersWork(t, "badowner-")
	fifo := filepath.Join(work, "fifo")
	must(t, unix.Mkfifo(fifo, 0o600))
	must(t, os.Chown(fifo, asUser, asUser))
	j := startOwnersJob(t, bin, work, fifoRole, "FTKIT_FIFO="+fifo)
	j.dump(t)
	for _, tt := range []struct {
		name, uid, gid, want string
	}{
		{"a uid without a gid", "65534", "", "without FTKIT_RESTORE_GID"},
		{"uid -1", "4294967295", "65534", "bad FTKIT_RESTORE_UID"},
		{"gid -1", "65534", "4294967295", "bad FTKIT_RESTORE_GID"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(RestoreUIDEnv, tt.uid)
			t.Setenv(RestoreGIDEnv, tt.gid)
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
			defer cancel()
			pid, err := restoreIn(ctx, j.ns, Client{Binary: bin}, RestoreOptions{ImagesDir: j.images})
			if err == nil {
				reap(pid)
				j.lacks(t, "the restore went on as root", "0006")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("the restore failed with %v, want %q", err, tt.want)
			}
		})
	}
}
