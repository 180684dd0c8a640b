package testenv

import (
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
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
	b, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/stat")
	if err != nil {
		t.Fatalf("process %d is gone: %v", cmd.Process.Pid, err)
	}
	// Field 3, after the parenthesised command name, is the state.
	if _, rest, _ := strings.Cut(string(b), ") "); strings.HasPrefix(rest, "Z") {
		t.Fatalf("process %d was signalled: it is a zombie", cmd.Process.Pid)
	}
}
