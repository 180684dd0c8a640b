package testenv

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/procstate"
)

// StartSleep starts a child that stands for a job's root process; it is killed and reaped at the end.
func StartSleep(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd
}

// WaitSignalled reaps cmd and checks that sig ended it.
func WaitSignalled(t *testing.T, cmd *exec.Cmd, sig syscall.Signal) {
	t.Helper()
	err := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != sig {
		t.Fatalf("process ended with %v, want signal %v", err, sig)
	}
}

// StillRuns checks that nothing killed cmd: it is not a zombie either.
func StillRuns(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	state, err := procstate.Of(cmd.Process.Pid)
	if err != nil {
		t.Fatalf("process %d is gone: %v", cmd.Process.Pid, err)
	}
	if state == "Z" {
		t.Fatalf("process %d was signalled: it is a zombie", cmd.Process.Pid)
	}
}

// ReturnsWithin fails the test if fn has not returned within limit: a call without a deadline shows up as a
// failure, not as a test that hangs until the suite's timeout.
func ReturnsWithin(t *testing.T, limit time.Duration, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
	case <-time.After(limit):
		t.Fatalf("still waiting after %s: the call has no deadline", limit)
	}
}

// SyncBuffer is a bytes.Buffer that a writer (a logger, a child's stderr copied by os/exec) and the test
// may use at the same time.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Len is the number of bytes written.
func (s *SyncBuffer) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Len()
}

// LiveCaller is the credentials of a live process of a user, for a local API call whose resource limits go
// with its caller's process: as root, a sleep of uid:gid, killed and reaped at the end; otherwise this test's
// own process (its uid, whatever uid says).
func LiveCaller(t *testing.T, uid, gid uint32) *unix.Ucred {
	t.Helper()
	if os.Geteuid() != 0 {
		return &unix.Ucred{Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid()), Pid: int32(os.Getpid())}
	}
	cmd := exec.Command("sleep", "600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	// Until its uid is the user's in every respect: the exec of sleep follows the change of credentials.
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if b, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/comm"); err == nil && string(b) == "sleep\n" {
			return &unix.Ucred{Uid: uid, Gid: gid, Pid: int32(cmd.Process.Pid)}
		}
	}
	t.Fatalf("process %d did not exec sleep", cmd.Process.Pid)
	return nil
}
