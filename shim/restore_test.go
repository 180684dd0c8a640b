package shim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/testenv"
)

// The test binary plays the shim (shimRole: Run on its standard input and output) and the job (holderRole:
// in a mount namespace set up as the job's init does if mntnsEnv is set, holds the file holdEnv names open
// for reading and listens on the unix socket listenEnv names, each if set, says so in readyEnv's file,
// sleeps).
const (
	roleEnv    = "FTKIT_SHIM_TEST_ROLE"
	shimRole   = "shim"
	holderRole = "holder"
	holdEnv    = "FTKIT_HOLD"
	listenEnv  = "FTKIT_LISTEN"
	mntnsEnv   = "FTKIT_MNTNS"
	readyEnv   = "FTKIT_READY"
)

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case shimRole:
		os.Exit(Run(context.Background(), os.Stdin, os.Stdout))
	case holderRole:
		var keep []any
		err := func() error {
			if os.Getenv(mntnsEnv) == "1" {
				// As the job's init does: the mounts set up, then an exec with nothing opened before
				// (the runtime's, a test harness's), which CRIU could not dump: the host namespace's
				// mounts are not in the job's ("Can't lookup mount").
				if err := setupMounts(); err != nil {
					return err
				}
				null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
				if err != nil {
					return err
				}
				for fd := range 3 {
					if err := unix.Dup3(int(null.Fd()), fd, 0); err != nil {
						return err
					}
				}
				if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
					return err
				}
				env := slices.DeleteFunc(os.Environ(), func(e string) bool { return strings.HasPrefix(e, mntnsEnv+"=") })
				return unix.Exec("/proc/self/exe", os.Args, append(env, mntnsEnv+"=set up"))
			}
			if p := os.Getenv(holdEnv); p != "" {
				f, err := os.Open(p)
				if err != nil {
					return err
				}
				keep = append(keep, f)
			}
			if p := os.Getenv(listenEnv); p != "" {
				l, err := net.Listen("unix", p)
				if err != nil {
					return err
				}
				keep = append(keep, l)
			}
			return os.WriteFile(os.Getenv(readyEnv), nil, 0o600)
		}()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		_ = keep
		select {}
	}
	os.Exit(m.Run())
}

// user is the job's user in these tests.
const user = 65534

// dumped is a job of user's (run as root, as CRIU restores it, but holding only what user may) dumped by
// CRIU, in a directory of user's.
type dumped struct {
	dir, criu, images string
	ns                string // the job's network namespace: CRIU's network lock table goes with it
}

// newDumped makes the directory, lets prepare put the job's files there and say what the job holds (its
// environment: holdEnv, listenEnv; mntnsEnv for a mount namespace of its own, as the agent's jobs
// have), runs the job (holderRole), and dumps it once it holds them.
func newDumped(t *testing.T, prepare func(dir string) (env []string), beforeDump ...func()) dumped {
	t.Helper()
	testenv.RequireKernel(t, "CRIU")
	bin, _, err := criu.Require("")
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("/tmp", "shimrestore-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	must(t, os.Chmod(dir, 0o755))
	must(t, os.Chown(dir, user, user))
	env := prepare(dir)
	// The job's program where its user can reach it: its mapping is checked like any file.
	self, err := os.Executable()
	must(t, err)
	b, err := os.ReadFile(self)
	must(t, err)
	exe := filepath.Join(dir, "job")
	must(t, os.WriteFile(exe, b, 0o755))

	ready := filepath.Join(dir, "ready")
	job := exec.Command(exe)
	job.Dir = dir
	job.Env = append(append(os.Environ(), roleEnv+"="+holderRole, readyEnv+"="+ready), env...)
	job.Stderr = os.Stderr
	// Its own session and PID namespace, as the agent starts jobs, and mount namespace if asked.
	job.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	for _, e := range env {
		if strings.HasPrefix(e, mntnsEnv+"=") {
			job.SysProcAttr.Cloneflags |= syscall.CLONE_NEWNS
		}
	}
	ns := testenv.Netns(t, "ftshim")
	must(t, netnsthread.In(ns, job.Start))
	t.Cleanup(func() { job.Process.Kill(); job.Wait() })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the job did not hold its files within 30s")
		}
	}
	for _, f := range beforeDump {
		f()
	}
	d := dumped{dir: dir, criu: bin, images: filepath.Join(dir, "images"), ns: ns}
	must(t, os.Mkdir(d.images, 0o700))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (criu.Client{Binary: bin}).Dump(ctx, criu.DumpOptions{PID: job.Process.Pid, ImagesDir: d.images, Netns: ns}); err != nil {
		t.Fatal(err)
	}
	job.Wait() // killed by the dump
	// A restore reads every thread's credentials from CRIU's own images (agent.checkImageCreds): the dump's
	// are read, and they are those the job ran with here (root's: CRIU in this sandbox cannot dump a task of
	// another user without CAP_SYS_RESOURCE).
	threads, err := image.Credentials(d.images)
	if err != nil || len(threads) == 0 {
		t.Fatalf("the credentials of the dump's threads: %v (%d threads)", err, len(threads))
	}
	for _, c := range threads {
		if c.UID != 0 || c.EUID != 0 || c.FSGID != 0 {
			t.Fatalf("thread %d of the dump has uids %d/%d, fsgid %d; the job ran as root", c.TID, c.UID, c.EUID, c.FSGID)
		}
	}
	return d
}

// restore restores the job as user's through the shim, and returns the shim's report.
func (d dumped) restore(t *testing.T) Report {
	t.Helper()
	return restoreWithShim(t, d.ns, Spec{JobID: "j", Mode: ModeRestore, CRIU: d.criu, ImagesDir: d.images, UID: user, GID: user,
		ExitFile: filepath.Join(d.dir, "exit"), Node: "n"})
}

// refused fails the test unless rep is a refusal whose error holds every one of want.
func refused(t *testing.T, rep Report, what string, want ...string) {
	t.Helper()
	if rep.PID != 0 {
		var held []string
		fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", rep.PID))
		for _, fd := range fds {
			l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", rep.PID, fd.Name()))
			held = append(held, fd.Name()+" "+l)
		}
		t.Fatalf("the restore of a job whose %s succeeded (pid %d, descriptors: %s)", what, rep.PID, strings.Join(held, ", "))
	}
	for _, w := range want {
		if !strings.Contains(rep.Error, w) {
			t.Fatalf("the restore failed with %q, want a refusal with %q", rep.Error, w)
		}
	}
	t.Logf("refused: %s", rep.Error)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// A job of uid 65534 that had its own file "data" open is dumped; its user then swaps "data" for a link to a
// file of root's of the same size and mode (all CRIU compares):
//   - root's secret in a directory the user cannot search;
//   - /proc/PID/fd/N of a root process holding a deleted root-only file, which the restored job would hold
//     with no name left, which the shim's check must not take for one CRIU made from the snapshot.
//
// CRIU, as root, followed the link (and the magic link behind it): the old shim handed the restored job a
// descriptor of the secret. Now CRIU opens it as the user (patches/0007) and the restore is refused (the
// shim's check of what the restored job holds stands behind, for a CRIU without the patch), and the same
// snapshot restores once "data" is back.
func TestRestoreRefusesSwappedFile(t *testing.T) {
	for _, tc := range []struct {
		name   string
		secret func(t *testing.T, dir string) (link string) // root's secret, where the link leads
	}{
		{"root's secret", func(t *testing.T, dir string) string {
			secret := filepath.Join(dir, "closed", "secret")
			must(t, os.Mkdir(filepath.Dir(secret), 0o700))
			must(t, os.WriteFile(secret, []byte(strings.Repeat("s", 8192)), 0o600))
			return secret
		}},
		{"root's deleted secret", func(t *testing.T, dir string) string {
			// Held open by root (this test) and deleted: its only name left is /proc/PID/fd/N.
			p := filepath.Join(dir, "secret")
			must(t, os.WriteFile(p, []byte(strings.Repeat("s", 8192)), 0o600))
			f, err := os.Open(p)
			must(t, err)
			t.Cleanup(func() { f.Close() })
			must(t, os.Remove(p))
			return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), f.Fd())
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var data, link string
			d := newDumped(t, func(dir string) []string {
				data = filepath.Join(dir, "data")
				must(t, os.WriteFile(data, make([]byte, 8192), 0o600))
				must(t, os.Chown(data, user, user))
				link = tc.secret(t, dir)
				return []string{holdEnv + "=" + data}
			})
			putBack := testenv.SwapForLink(t, data, link)
			refused(t, d.restore(t), "file was swapped for a link to "+tc.name, "Can't open file", "/data", "Permission denied")

			putBack()
			if rep := d.restore(t); rep.PID == 0 {
				t.Fatalf("the restore with the job's file back failed: %s", rep.Error)
			}
		})
	}
}

// A job holding a file deleted before the dump restores, in the host's mount namespace and in one of its
// own as the agent's jobs run: CRIU recreates it from the snapshot's copy (its ghost, next to the old name),
// with no name, and the snapshot says so. If its user has made the file's directory a link to a root
// directory since, CRIU, as root, made the ghost there, linked it to the file's name there, and removed both
// names (the restore passed): a link swapped in between had root remove a file of root's. Now it does all
// that as the user (patches/0007): refused, nothing made in root's directory; the directory back, the same
// snapshot restores.
func TestRestoreTakesDeletedFile(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  []string
	}{{"host namespace", nil}, {"own mount namespace", []string{mntnsEnv + "=1"}}} {
		t.Run(tc.name, func(t *testing.T) {
			var sub, rootDir, data string
			d := newDumped(t, func(dir string) []string {
				sub, rootDir = filepath.Join(dir, "sub"), filepath.Join(dir, "rootdir")
				must(t, os.Mkdir(sub, 0o755))
				must(t, os.Chown(sub, user, user))
				must(t, os.Mkdir(rootDir, 0o755))
				data = filepath.Join(sub, "data")
				must(t, os.WriteFile(data, make([]byte, 8192), 0o600))
				must(t, os.Chown(data, user, user))
				return append([]string{holdEnv + "=" + data}, tc.env...)
			}, func() { must(t, os.Remove(data)) })

			putBack := testenv.SwapForLink(t, sub, rootDir)
			// An unpatched CRIU removes what it made there too: only the directory's times tell.
			var before, after unix.Stat_t
			must(t, unix.Lstat(rootDir, &before))
			refused(t, d.restore(t), "deleted file's directory was swapped for a link to a root directory", "ghost", "Permission denied")
			if left, err := os.ReadDir(rootDir); err != nil || len(left) != 0 {
				t.Errorf("root's directory after the refused restore: %v %v, want it empty", left, err)
			}
			must(t, unix.Lstat(rootDir, &after))
			if after.Mtim != before.Mtim || after.Ctim != before.Ctim {
				t.Errorf("root's directory was modified during the refused restore (mtime %v, was %v)", after.Mtim, before.Mtim)
			}

			putBack()
			rep := d.restore(t)
			if rep.PID == 0 {
				t.Fatalf("the restore of a job holding a deleted file failed: %s", rep.Error)
			}
			if left, err := os.ReadDir(sub); err != nil || len(left) != 0 {
				t.Errorf("the job's directory after the restore: %v %v, want the ghost gone", left, err)
			}
		})
	}
}

// A job listening on a unix socket in its user's directory "run" is dumped; its user then replaces "run"
// with a link to a root directory holding root's socket of the same name (as /run/dbus holds the system
// bus's). CRIU, as root, removed root's socket there and bound the job's in its place, chowned to the user.
// Now the restore is refused before CRIU runs, root's socket untouched; with "run" back, it restores.
func TestRestoreRefusesSocketThroughLink(t *testing.T) {
	var run, rootDir string
	d := newDumped(t, func(dir string) []string {
		run, rootDir = filepath.Join(dir, "run"), filepath.Join(dir, "rootrun")
		must(t, os.Mkdir(run, 0o755))
		must(t, os.Chown(run, user, user))
		must(t, os.Mkdir(rootDir, 0o755))
		return []string{listenEnv + "=" + filepath.Join(run, "job.sock")}
	}, func() { must(t, os.Lchown(filepath.Join(run, "job.sock"), user, user)) }) // as the user's job binds it
	l, err := net.Listen("unix", filepath.Join(rootDir, "job.sock"))
	must(t, err)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	var before unix.Stat_t
	must(t, unix.Lstat(filepath.Join(rootDir, "job.sock"), &before))

	putBack := testenv.SwapForLink(t, run, rootDir)
	rep := d.restore(t)
	var after unix.Stat_t
	if err := unix.Lstat(filepath.Join(rootDir, "job.sock"), &after); err != nil || after.Ino != before.Ino || after.Uid != 0 {
		t.Errorf("root's socket after the restore: %v, inode %d (was %d), owner %d: the restore, as root, replaced it with the job's socket and gave it to the user", err, after.Ino, before.Ino, after.Uid)
	}
	refused(t, rep, "socket directory was swapped for a link to a root directory", "could not restore itself", "look up its directory")

	putBack()
	if rep := d.restore(t); rep.PID == 0 {
		t.Fatalf("the restore with the job's directory back failed: %s", rep.Error)
	}
}

// restoreWithShim runs the shim on spec in network namespace ns and returns its report; a restored job is
// killed when the test ends.
func restoreWithShim(t *testing.T, ns string, spec Spec) Report {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	in, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), roleEnv+"="+shimRole)
	cmd.Stdin = strings.NewReader(string(in))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := netnsthread.In(ns, cmd.Start); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	var rep Report
	if jerr := json.Unmarshal([]byte(line), &rep); err != nil || jerr != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("shim report %q: %v %v", line, err, jerr)
	}
	t.Cleanup(func() {
		if rep.PID != 0 {
			syscall.Kill(rep.PID, syscall.SIGKILL)
		}
		cmd.Wait() // the shim ends with its job
	})
	return rep
}

// A job of uid 65534 in a mount namespace of its own is dumped while a mount of its user's ("target", in the
// user's directory "u/x"; a tmpfs here, where the user would use fusermount) is in it: CRIU records it as
// external, to be bound again from the restoring host's path u/x/target. Its user then unmounts it and
// replaces "x" with a relative link to a root directory "srv/a/deep" (../srv/a/deep), where root keeps a
// read-only, noexec mount "target" (with a file hidden under a mount over its "hidden"). CRIU, as root,
// resolved the recorded source (open_tree follows every link but the last) and the target (move_mount)
// through the link: it cloned root's read-only mount, without the mounts below it, and bind-remounted it
// with the flags the user's mount had (rw, exec) at srv/target in the restored job's namespace, where the
// job could write to what the host holds read-only and read what the host hides. Now CRIU follows both
// with no link (patches/0008): the restore is refused. Root's mounts made before the job started (in its
// namespace and its images too) or after its dump.
func TestRestoreMountThroughLink(t *testing.T) {
	// The same job, its user's directory left as it was: the restore (which follows the same paths with no
	// link now) brings the user's mount back where it was, with what it held.
	t.Run("no link", func(t *testing.T) {
		var target string
		d := newDumped(t, func(dir string) []string {
			u := filepath.Join(dir, "u")
			x := filepath.Join(u, "x")
			target = filepath.Join(x, "target")
			for _, p := range []string{u, x, target} {
				must(t, os.Mkdir(p, 0o755))
				must(t, os.Chown(p, user, user))
			}
			must(t, unix.Mount("usermnt", target, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0777"))
			t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
			must(t, os.WriteFile(filepath.Join(target, "data"), []byte("the user's\n"), 0o644))
			return []string{mntnsEnv + "=1"}
		})
		rep := d.restore(t)
		if rep.PID == 0 {
			t.Fatalf("the restore of a job with its user's mount below the user's directory failed: %s", rep.Error)
		}
		b, err := os.ReadFile(filepath.Join(fmt.Sprintf("/proc/%d/root", rep.PID), target, "data"))
		if err != nil || string(b) != "the user's\n" {
			t.Errorf("the restored job reads %q (%v) in its user's mount %s, want %q", b, err, target, "the user's\n")
		}
	})
	for _, early := range []bool{false, true} {
		t.Run(fmt.Sprintf("root mounts before the job: %v", early), func(t *testing.T) {
			var u, x, srv, target string
			rootMounts := func() {
				rootTarget := filepath.Join(srv, "target")
				must(t, unix.Mount("rootmnt", rootTarget, "tmpfs", 0, "mode=0777"))
				t.Cleanup(func() { unix.Unmount(rootTarget, unix.MNT_DETACH) })
				must(t, os.WriteFile(filepath.Join(rootTarget, "data"), []byte("root's\n"), 0o666))
				hidden := filepath.Join(rootTarget, "hidden")
				must(t, os.Mkdir(hidden, 0o755))
				must(t, os.WriteFile(filepath.Join(hidden, "shadowed"), []byte("hidden by a mount\n"), 0o644))
				must(t, unix.Mount("cover", hidden, "tmpfs", 0, "mode=0755"))
				t.Cleanup(func() { unix.Unmount(hidden, unix.MNT_DETACH) })
				must(t, unix.Mount("", rootTarget, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOEXEC|unix.MS_NOSUID|unix.MS_NODEV, ""))
			}
			d := newDumped(t, func(dir string) []string {
				// Root's mount deeper than the user's (CRIU mounts the deeper siblings first: the user's then
				// covers it) and on the same filesystem as the user's directory (CRIU stats the mount point
				// through a clone of that filesystem's mount alone).
				u, srv = filepath.Join(dir, "u"), filepath.Join(dir, "srv", "a", "deep")
				x = filepath.Join(u, "x")
				target = filepath.Join(x, "target")
				for _, p := range []string{u, x, target} {
					must(t, os.Mkdir(p, 0o755))
					must(t, os.Chown(p, user, user))
				}
				must(t, os.MkdirAll(srv, 0o755))
				must(t, os.Mkdir(filepath.Join(srv, "target"), 0o777))
				// The user's own mount, as fusermount makes it (nosuid, nodev).
				must(t, unix.Mount("usermnt", target, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0777"))
				t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
				if early {
					rootMounts()
				}
				return []string{mntnsEnv + "=1"}
			})

			// The user: unmounts their mount, and puts a link where its directory was.
			must(t, unix.Unmount(target, 0))
			testenv.SwapForLink(t, x, "../srv/a/deep")
			must(t, unix.Lchown(x, user, user))
			if !early {
				rootMounts()
			}
			rootTarget := filepath.Join(srv, "target")
			if err := os.WriteFile(filepath.Join(rootTarget, "written"), nil, 0o666); err == nil || !strings.Contains(err.Error(), "read-only") {
				t.Fatalf("write into the host's read-only mount: %v, want EROFS", err)
			}

			rep := d.restore(t)
			if rep.PID == 0 {
				refused(t, rep, "mount's directory was swapped for a link to a root directory", "no link followed")
				if _, err := os.Stat(filepath.Join(rootTarget, "written")); err == nil {
					t.Error("root's read-only mount was written to during the refused restore")
				}
				return
			}
			t.Errorf("the restore of a job whose mount's directory was swapped for a link to a root directory succeeded (pid %d)", rep.PID)
			mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", rep.PID))
			must(t, err)
			for _, l := range strings.Split(string(mi), "\n") {
				if strings.Contains(l, "/u/x") || strings.Contains(l, "/deep/target") {
					t.Logf("restored job's mount: %s", l)
				}
			}
			// Through the restored job's namespace: what the job sees at srv/target.
			inJob := filepath.Join(fmt.Sprintf("/proc/%d/root", rep.PID), rootTarget)
			if b, err := os.ReadFile(filepath.Join(inJob, "hidden", "shadowed")); err == nil {
				t.Errorf("the restored job's namespace shows %q, hidden on the host by a mount: CRIU cloned root's mount without the mounts below it", b)
			}
			if err := os.WriteFile(filepath.Join(inJob, "written"), []byte("by the job\n"), 0o666); err == nil {
				b, _ := os.ReadFile(filepath.Join(rootTarget, "written"))
				t.Errorf("the restored job's namespace holds root's read-only mount %s writable (written through it; the host now reads %q): CRIU bound it there as root, through the user's link %s", rootTarget, b, x)
			} else {
				t.Logf("write through the job's namespace: %v", err)
			}
		})
	}
}
