package agent

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestKillJob: the agent kills a restored job that is not transparently recoverable by its root's PID only
// while that PID is a process of the job (listed in the job's cgroup): a PID the job's root left may name
// another user's process by the time the agent acts on its record.
func TestKillJob(t *testing.T) {
	ta := newTestAgent(t)
	start := func() *exec.Cmd {
		cmd := exec.Command("sleep", "600")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	root, stranger := start(), start()
	ended := func(cmd *exec.Cmd) <-chan error {
		ch := make(chan error, 1)
		go func() { ch <- cmd.Wait() }()
		return ch
	}
	rootEnded, strangerEnded := ended(root), ended(stranger)

	// The job's record names root, which its cgroup lists: killed.
	ta.addJob(t, Job{ID: "job-restored", State: JobRunning, PID: root.Process.Pid})
	ta.killJob("job-restored", errors.New("re-sent bytes differ"))
	if err := endedBy(rootEnded, syscall.SIGKILL); err != nil {
		t.Errorf("the job's root: %v", err)
	}
	// Its shim is told why, for the exit record ftwrap prints.
	if b, err := os.ReadFile(ta.refusalMark("job-restored", 0)); err != nil || !strings.Contains(string(b), "killed by ftkit on node1") || !strings.Contains(string(b), "re-sent bytes differ") {
		t.Errorf("the reason left for the job's shim: %q, %v", b, err)
	}

	// This record's PID names a process its cgroup does not list (the root exited, the PID was reused):
	// not signalled.
	j := ta.addJob(t, Job{ID: "job-pid-reused", State: JobRunning, PID: stranger.Process.Pid})
	ta.setProcs(t, j)
	ta.killJob("job-pid-reused", errors.New("test"))
	// Then this test ends it with SIGTERM: it dies of SIGKILL only if the agent had sent one.
	if err := stranger.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("a process outside the job is gone: the agent killed it (%v)", err)
	}
	if err := endedBy(strangerEnded, syscall.SIGTERM); err != nil {
		t.Errorf("a process outside the job, which only this test signalled: %v", err)
	}
}

// endedBy waits for a process's Wait result on ended and says how it differs from death by sig.
func endedBy(ended <-chan error, sig syscall.Signal) error {
	select {
	case err := <-ended:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != sig {
			return fmt.Errorf("ended with %v, want %v", err, sig)
		}
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("did not end within 30s, want %v", sig)
	}
}
