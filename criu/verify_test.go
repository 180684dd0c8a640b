package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/testenv"
)

// A restore whose Verify fails is refused, and CRIU kills the tree it built before the tree ran; with
// Verify passing, the tree runs.
func TestRestoreVerify(t *testing.T) {
	bin := requireCRIU(t, "CRIU")
	child := exec.Command("sleep", "1000")
	// Its own session and PID namespace, as the agent starts jobs: CRIU restores its PID.
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	ns := testenv.Netns(t, "ftcv") // CRIU's network lock table goes with it, whatever the test's end
	if err := netnsthread.In(ns, child.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	c := Client{Binary: bin}
	if _, err := c.Dump(ctx, DumpOptions{PID: child.Process.Pid, ImagesDir: dir, Netns: ns}); err != nil {
		t.Fatal(err)
	}
	_ = child.Wait() // killed by the dump

	var verified int
	refused := errors.New("refused by the test")
	_, err := restoreIn(ctx, ns, c, RestoreOptions{ImagesDir: dir, Verify: func(pid int) error {
		verified = pid
		if st := procState(pid); st != "S" && st != "t" && st != "T" && st != "R" {
			t.Errorf("restored root %d in state %q at Verify", pid, st)
		}
		return refused
	}})
	if !errors.Is(err, refused) {
		t.Fatalf("restore with a failing Verify = %v, want %v", err, refused)
	}
	if verified <= 0 {
		t.Fatal("Verify was not called")
	}
	// The tree is the caller's child (rst_sibling): reap it, and see how it ended.
	var ws unix.WaitStatus
	if _, err := unix.Wait4(verified, &ws, 0, nil); err != nil {
		t.Fatalf("reap the refused tree %d: %v", verified, err)
	}
	if !ws.Signaled() || ws.Signal() != unix.SIGKILL {
		t.Fatalf("the refused tree %d ended %#x, want killed by CRIU", verified, ws)
	}

	verified = 0
	pid, err := restoreIn(ctx, ns, c, RestoreOptions{ImagesDir: dir, Verify: func(pid int) error { verified = pid; return nil }})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		unix.Kill(pid, unix.SIGKILL)
		unix.Wait4(pid, &ws, 0, nil)
	}()
	if verified != pid {
		t.Fatalf("Verify saw pid %d, the restore returned %d", verified, pid)
	}
	if st := procState(pid); st != "S" && st != "R" {
		t.Fatalf("restored tree %d in state %q, want running", pid, st)
	}
}

// restoreIn restores with c inside network namespace ns (CRIU restores in its caller's).
func restoreIn(ctx context.Context, ns string, c Client, opts RestoreOptions) (int, error) {
	var pid int
	err := netnsthread.In(ns, func() error {
		var err error
		pid, err = c.Restore(ctx, opts)
		return err
	})
	return pid, err
}

// procState is the state letter of process pid, "" if it is gone.
func procState(pid int) string {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	b := string(raw)
	// pid (comm) state ...: comm may hold spaces and parentheses.
	i := strings.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return ""
	}
	return b[i+2 : i+3]
}
