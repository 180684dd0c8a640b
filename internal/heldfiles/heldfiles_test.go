package heldfiles

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/procstate"
	"github.com/ftkit/ftkit/internal/testenv"
)

// The helper holds what FTKIT_HELD names (";"-separated "how:path" items) and sleeps; with FTKIT_HELD_CHILD
// set, it starts a copy of itself holding them instead and holds nothing itself.
const (
	heldEnv  = "FTKIT_HELD"
	childEnv = "FTKIT_HELD_CHILD"
)

func TestMain(m *testing.M) {
	if spec, ok := os.LookupEnv(heldEnv); ok {
		os.Exit(runHelper(spec))
	}
	os.Exit(m.Run())
}

func runHelper(spec string) int {
	if os.Getenv(childEnv) != "" {
		cmd := exec.Command("/proc/self/exe")
		cmd.Env = append(os.Environ(), childEnv+"=")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		return waitForever()
	}
	var keep []any
	for item := range strings.SplitSeq(spec, ";") {
		how, path, _ := strings.Cut(item, ":")
		var err error
		switch how {
		case "r", "w", "rw", "path":
			flags := map[string]int{"r": unix.O_RDONLY, "w": unix.O_WRONLY, "rw": unix.O_RDWR, "path": unix.O_PATH}[how]
			var fd int
			fd, err = unix.Open(path, flags|unix.O_CLOEXEC, 0)
			keep = append(keep, fd)
		case "map", "mapshared", "mapsharedrw":
			flags, prot, mode := unix.MAP_PRIVATE, unix.PROT_READ, unix.O_RDONLY
			if how != "map" {
				flags = unix.MAP_SHARED
			}
			if how == "mapsharedrw" {
				prot, mode = unix.PROT_READ|unix.PROT_WRITE, unix.O_RDWR
			}
			var fd int
			if fd, err = unix.Open(path, mode|unix.O_CLOEXEC, 0); err == nil {
				var b []byte
				b, err = unix.Mmap(fd, 0, 4096, prot, flags)
				unix.Close(fd) // the mapping alone holds the file
				keep = append(keep, b)
			}
		case "cwd":
			err = unix.Chdir(path)
		case "zombie": // a child that exited, never reaped
			_, err = syscall.ForkExec("/bin/true", []string{"true"}, &syscall.ProcAttr{})
		default:
			err = fmt.Errorf("unknown item %q", item)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	fmt.Println("ready")
	_ = keep
	return waitForever()
}

func waitForever() int {
	select {}
}

// fixture is a directory tree root made for a user (uid 65534): a directory the user can search holding
// a copy of the test binary (the helper: its own mapping must be reachable), the user's own file "own",
// root's world-readable "public" and root-only "secret", and a root-only directory "closed" holding a
// world-readable "inside" and a searchable "sub".
type fixture struct {
	dir string
	exe string
}

const user = 65534

func newFixture(t *testing.T) fixture {
	t.Helper()
	testenv.RequireKernel(t, "root, to check files as another user")
	dir, err := os.MkdirTemp("/tmp", "heldfiles-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Chmod(dir, 0o755))
	file := func(name string, mode os.FileMode, uid int) {
		p := filepath.Join(dir, name)
		must(os.WriteFile(p, make([]byte, 8192), mode))
		must(os.Chmod(p, mode))
		must(os.Chown(p, uid, uid))
	}
	file("own", 0o600, user)
	file("public", 0o644, 0)
	file("secret", 0o600, 0)
	must(os.Mkdir(filepath.Join(dir, "closed"), 0o700))
	must(os.Chmod(filepath.Join(dir, "closed"), 0o700))
	file("closed/inside", 0o644, 0)
	must(os.Mkdir(filepath.Join(dir, "closed", "sub"), 0o755))
	self, err := os.Executable()
	must(err)
	b, err := os.ReadFile(self)
	must(err)
	exe := filepath.Join(dir, "helper")
	must(os.WriteFile(exe, b, 0o755))
	return fixture{dir: dir, exe: exe}
}

// start runs the helper holding spec (paths relative to the fixture) and returns its pid once it holds it.
func (f fixture) start(t *testing.T, spec string, child bool) int {
	t.Helper()
	var items []string
	for item := range strings.SplitSeq(spec, ";") {
		how, path, _ := strings.Cut(item, ":")
		items = append(items, how+":"+filepath.Join(f.dir, path))
	}
	cmd := exec.Command(f.exe)
	cmd.Dir = f.dir
	cmd.Env = append(os.Environ(), heldEnv+"="+strings.Join(items, ";"))
	if child {
		cmd.Env = append(cmd.Env, childEnv+"=1")
	}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "ready\n" {
		t.Fatalf("helper holding %q: %q %v", spec, line, err)
	}
	go io.Copy(io.Discard, out)
	return cmd.Process.Pid
}

func TestCheck(t *testing.T) {
	f := newFixture(t)
	for _, tt := range []struct {
		name  string
		spec  string
		child bool
		want  string // in the error; "" for none
	}{
		{"the user's own file, read and written", "rw:own", false, ""},
		{"root's world-readable file, read", "r:public", false, ""},
		{"root's world-readable file, mapped shared from a read-only descriptor", "mapshared:public", false, ""},
		{"the user's own file, mapped shared and writable", "mapsharedrw:own", false, ""},
		{"root's world-readable file, written", "w:public", false, "could not open itself: write it"},
		{"root's world-readable file, mapped shared and writable", "mapsharedrw:public", false, "read and write it"},
		{"root's secret, read", "r:secret", false, "could not open itself: read it"},
		{"root's secret, mapped", "map:secret", false, "mapping"},
		{"a readable file in a directory the user cannot search", "r:closed/inside", false, "look it up"},
		{"an O_PATH descriptor in a directory the user cannot search", "path:closed/inside", false, "look it up"},
		{"a working directory below one the user cannot search", "cwd:closed/sub", false, "working directory"},
		{"root's secret, held by a child", "r:secret", true, "read it"},
		{"a zombie child", "zombie:", false, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pid := f.start(t, tt.spec, tt.child)
			if strings.HasPrefix(tt.spec, "zombie:") {
				waitZombie(t, pid)
			}
			if err := Check(pid, 0, 0, nil); err != nil {
				t.Fatalf("as root: %v", err)
			}
			err := Check(pid, user, user, nil)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("Check = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("Check = %v, want an error with %q", err, tt.want)
			}
			t.Logf("%v", err)
		})
	}
}

// waitZombie waits until process pid has a child that exited.
func waitZombie(t *testing.T, pid int) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		pids, err := procstate.Tree(pid)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pids[1:] {
			if zombie(p) {
				return
			}
		}
	}
	t.Fatalf("no zombie child of %d within 30s", pid)
}

// TestCheckNames: the user must be able to bind each socket (its directory reached with no link, writable
// by the user; a socket file there only its own, as the restore removes it) and open each FIFO (reached
// with no link, with the job's access) itself.
func TestCheckNames(t *testing.T) {
	f := newFixture(t)
	at := func(p string) string { return filepath.Join(f.dir, p) }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Mkdir(at("udir"), 0o755))
	must(os.Chown(at("udir"), user, user))
	must(os.Symlink(at("closed"), at("udir/link")))
	must(os.Symlink(at("closed/sub"), at("udir/sublink")))
	sock := func(p string, uid int) {
		l, err := net.Listen("unix", p)
		must(err)
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		l.Close()
		must(os.Lchown(p, uid, uid))
	}
	sock(at("udir/own.sock"), user)
	sock(at("udir/root.sock"), 0)
	must(os.Chmod(at("closed/sub"), 0o777))
	must(unix.Mkfifo(at("udir/own.fifo"), 0o600))
	must(os.Chown(at("udir/own.fifo"), user, user))
	must(unix.Mkfifo(at("root.fifo"), 0o600))
	must(os.Symlink(at("udir/own.fifo"), at("udir/fifolink")))
	for _, tt := range []struct {
		name string
		n    image.NamedPath
		want string // in the error; "" for none
	}{
		{"a new socket in the user's directory", image.NamedPath{Path: at("udir/new.sock"), Socket: true}, ""},
		{"the user's own stale socket", image.NamedPath{Path: at("udir/own.sock"), Socket: true}, ""},
		{"root's socket in the user's directory", image.NamedPath{Path: at("udir/root.sock"), Socket: true}, "owned by uid 0"},
		{"a socket in a directory the user cannot write", image.NamedPath{Path: at("x.sock"), Socket: true}, "write in its directory"},
		{"a socket through a link to a directory", image.NamedPath{Path: at("udir/sublink/x.sock"), Socket: true}, "look up its directory"},
		{"a socket that is a link", image.NamedPath{Path: at("udir/link"), Socket: true}, "symbolic link"},
		{"a deleted socket where another's file is", image.NamedPath{Path: at("udir/link"), Socket: true, Deleted: true}, "symbolic link"},
		{"the user's FIFO, read and written", image.NamedPath{Path: at("udir/own.fifo"), Flags: unix.O_RDWR}, ""},
		{"root's FIFO", image.NamedPath{Path: at("root.fifo"), Flags: unix.O_RDONLY}, "read it"},
		{"a FIFO that is a link", image.NamedPath{Path: at("udir/fifolink")}, "symbolic link"},
		{"a FIFO through a link to a directory", image.NamedPath{Path: at("udir/sublink/x.fifo")}, "look it up"},
		{"a regular file as a FIFO", image.NamedPath{Path: at("own")}, "not a FIFO"},
		// The restore makes a deleted FIFO afresh at its name (CRIU's ghost), and a deleted socket's missing
		// directories (then removes them): the user could, in a directory of its own.
		{"a deleted FIFO in the user's directory", image.NamedPath{Path: at("udir/gone.fifo"), Deleted: true, Flags: unix.O_RDONLY}, ""},
		{"a deleted FIFO in a directory the user cannot write", image.NamedPath{Path: at("gone.fifo"), Deleted: true}, "write in its directory"},
		{"a deleted FIFO through a link to a directory", image.NamedPath{Path: at("udir/sublink/gone.fifo"), Deleted: true}, "look up its directory"},
		{"a deleted socket in a directory gone", image.NamedPath{Path: at("udir/gone/deeper/x.sock"), Socket: true, Deleted: true}, ""},
		{"a deleted socket in a directory gone, under root's", image.NamedPath{Path: at("gone/x.sock"), Socket: true, Deleted: true}, "write in its directory"},
		{"a deleted socket in a directory gone, through a link", image.NamedPath{Path: at("udir/sublink/gone/x.sock"), Socket: true, Deleted: true}, "look up its directory"},
		{"a socket in a directory gone", image.NamedPath{Path: at("udir/gone/x.sock"), Socket: true}, "look up its directory"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if err := CheckNames(0, 0, []image.NamedPath{tt.n}); err != nil {
				t.Fatalf("as root: %v", err)
			}
			err := CheckNames(user, user, []image.NamedPath{tt.n})
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("CheckNames = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("CheckNames = %v, want an error with %q", err, tt.want)
			}
		})
	}
}
