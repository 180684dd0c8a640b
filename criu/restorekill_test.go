package criu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// restorerRole is the test binary restoring through a fake CRIU (FTKIT_FAKE_CRIU_SLOW) with no deadline,
// as the agent's shim does, until it is killed.
const restorerRole = "restorer"

func runRestorer(dir string) int {
	self, err := os.Executable()
	if err != nil {
		return 2
	}
	os.Unsetenv("FTKIT_CRIU_TEST_ROLE") // its CRIU, this binary too, plays CRIU
	Client{Binary: self}.Restore(context.Background(), RestoreOptions{ImagesDir: dir})
	return 0
}

// slowCRIU is the fake CRIU of FTKIT_FAKE_CRIU_SLOW working in dir: it writes its PID to dir/ran once it
// has the request, and answers only once dir/stop exists (then it writes dir/done first).
type slowCRIU struct{ dir string }

func newSlowCRIU(t *testing.T) slowCRIU {
	c := slowCRIU{t.TempDir()}
	t.Setenv("FTKIT_FAKE_CRIU_SLOW", c.dir)
	t.Cleanup(func() { os.WriteFile(filepath.Join(c.dir, "stop"), nil, 0o600) })
	return c
}

func (c slowCRIU) pid() int {
	b, err := os.ReadFile(filepath.Join(c.dir, "ran"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(string(b))
	return pid
}

// waitStarted waits until the fake CRIU has its request.
func (c slowCRIU) waitStarted(t *testing.T) int {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if pid := c.pid(); pid > 0 {
			return pid
		}
	}
	t.Fatal("the fake CRIU never got its request")
	return 0
}

func (c slowCRIU) finished() bool {
	_, err := os.Stat(filepath.Join(c.dir, "done"))
	return err == nil
}

// cancelOnceStarted returns a context cancelled once the fake CRIU has its request (at most 30 s on).
func (c slowCRIU) cancelOnceStarted(t *testing.T) context.Context {
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline) && c.pid() == 0; time.Sleep(5 * time.Millisecond) {
		}
		cancel()
	}()
	return ctx
}

// checkKilled checks that the fake CRIU ran, is gone, and did not finish its request (what).
func (c slowCRIU) checkKilled(t *testing.T, what string) {
	t.Helper()
	pid := c.pid()
	if pid == 0 {
		t.Fatal("the fake CRIU never ran")
	}
	if running(pid) {
		t.Fatalf("the %s returned on its cancelled context with its CRIU (pid %d) still running", what, pid)
	}
	if c.finished() {
		t.Errorf("the fake CRIU finished its %s: it was not killed", what)
	}
}

// running reports whether pid runs (a zombie does not: it waits for whichever process reaps it).
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	_, after, ok := strings.Cut(string(b), ") ")
	return ok && !strings.HasPrefix(after, "Z") && !strings.HasPrefix(after, "X")
}

// TestRestoreCancelledKillsCRIU: a restore whose context ends while CRIU runs kills CRIU and returns only
// once it is gone. The old code returned at once and left CRIU building the job's tree in the background,
// in the cgroup and network its caller then gave back.
func TestRestoreCancelledKillsCRIU(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	fake := newSlowCRIU(t)
	if _, err := (Client{Binary: self}).Restore(fake.cancelOnceStarted(t), RestoreOptions{ImagesDir: t.TempDir()}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Restore with its context cancelled while CRIU runs = %v, want context.Canceled", err)
	}
	fake.checkKilled(t, "restore")
}

// TestRestoreCRIUDiesWithItsCaller: the agent kills a restore's shim at the restore's deadline; the CRIU the
// shim runs dies with it. The old code's CRIU (go-criu's) went on restoring, parentless.
func TestRestoreCRIUDiesWithItsCaller(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	fake := newSlowCRIU(t)
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), "FTKIT_CRIU_TEST_ROLE="+restorerRole, "FTKIT_DIR="+t.TempDir())
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := fake.waitStarted(t)
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	for deadline := time.Now().Add(30 * time.Second); running(pid); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the restore's CRIU (pid %d) still runs 30 s after its caller was killed", pid)
		}
	}
	if fake.finished() {
		t.Error("the fake CRIU finished its restore: it was not killed")
	}
}
