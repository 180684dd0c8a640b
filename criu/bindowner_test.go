package criu

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/testenv"
)

// listenerRole is the process TestBindAsOwner dumps: it listens on the unix socket FTKIT_SOCK names, connects
// to it without accepting (a pending connection, which CRIU restores by connecting to the name), writes
// FTKIT_DIR/ready and sleeps.
const listenerRole = "usk-listener"

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

// TestBindAsOwner (patches/0006): CRIU binds a dumped unix socket, removes the stale file at its name and
// connects to it as the job's user (RestoreUIDEnv, RestoreGIDEnv), not as root. A dump of a listener whose
// directory and socket file uid 65534 owns, after its directory was made a link to a root directory holding
// root's socket of the same name: unpatched CRIU removed root's socket and bound the job's there, chowned to
// uid 65534; patched, the restore fails and root's socket is untouched. With the directory back, the same
// dump restores (its pending connection connected again as the user), its socket file uid 65534's.
func TestBindAsOwner(t *testing.T) {
	bin := requireCRIU(t, "CRIU")
	const user = 65534
	work, err := os.MkdirTemp("/tmp", "bindowner-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(work) })
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Chmod(work, 0o755))
	run, rootDir := filepath.Join(work, "run"), filepath.Join(work, "rootrun")
	must(os.Mkdir(run, 0o755))
	must(os.Chown(run, user, user))
	must(os.Mkdir(rootDir, 0o755))
	sock := filepath.Join(run, "job.sock")

	self, err := os.Executable()
	must(err)
	child := exec.Command(self)
	child.Env = append(os.Environ(), "FTKIT_CRIU_TEST_ROLE="+listenerRole, "FTKIT_DIR="+work, "FTKIT_SOCK="+sock)
	child.Stderr = os.Stderr
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	ns := testenv.Netns(t, "ftbo") // CRIU's network lock table goes with it, whatever the test's end
	must(netnsthread.In(ns, child.Start))
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(work, "ready")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the listener was not ready within 30s")
		}
	}
	must(os.Lchown(sock, user, user)) // as the user's job binds it
	images := filepath.Join(work, "images")
	must(os.Mkdir(images, 0o700))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	c := Client{Binary: bin}
	if _, err := c.Dump(ctx, DumpOptions{PID: child.Process.Pid, ImagesDir: images, Netns: ns}); err != nil {
		t.Fatal(err)
	}
	child.Wait() // killed by the dump

	// Root's socket where the link leads.
	rootSock := filepath.Join(rootDir, "job.sock")
	l, err := net.Listen("unix", rootSock)
	must(err)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	var before unix.Stat_t
	must(unix.Lstat(rootSock, &before))
	must(os.Rename(run, run+".orig"))
	must(os.Symlink(rootDir, run))
	// The job's user, as ftkit's shim names it to CRIU (CRIU inherits this process's environment).
	t.Setenv(RestoreUIDEnv, fmt.Sprint(user))
	t.Setenv(RestoreGIDEnv, fmt.Sprint(user))
	pid, err := restoreIn(ctx, ns, c, RestoreOptions{ImagesDir: images})
	if err == nil {
		reap(pid)
	}
	var after unix.Stat_t
	if serr := unix.Lstat(rootSock, &after); serr != nil || after.Ino != before.Ino || after.Uid != 0 {
		t.Errorf("root's socket after the restore: %v, inode %d (was %d), owner %d: CRIU replaced it as root", serr, after.Ino, before.Ino, after.Uid)
	}
	if err == nil {
		level, _ := BinaryPatchLevel(bin)
		t.Fatalf("the restore bound the job's socket through a link into root's directory; %s (patch level %d, want %d) lacks patches/0006", bin, level, PatchLevel())
	}
	t.Logf("refused: %v", err)

	must(os.Remove(run))
	must(os.Rename(run+".orig", run))
	pid, err = restoreIn(ctx, ns, c, RestoreOptions{ImagesDir: images})
	if err != nil {
		t.Fatalf("the restore with the directory back: %v", err)
	}
	defer reap(pid)
	var st unix.Stat_t
	if err := unix.Lstat(sock, &st); err != nil || st.Uid != user || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		t.Fatalf("the restored socket file: %v, owner %d, mode %#o; want a socket of uid %d", err, st.Uid, st.Mode, user)
	}
}

// reap kills and reaps a restored tree, the caller's child (rst_sibling).
func reap(pid int) {
	var ws unix.WaitStatus
	unix.Kill(pid, unix.SIGKILL)
	unix.Wait4(pid, &ws, 0, nil)
}
