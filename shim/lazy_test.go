package shim

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLazyDone: when the lazy-pages daemon has put every page in (exit 0) the images go and the job runs
// on; when it failed, the job is killed (its missing pages would read as zeros); other children change
// nothing.
func TestLazyDone(t *testing.T) {
	for _, tc := range []struct {
		name       string
		ws         unix.WaitStatus
		daemon     bool // the reaped child is the daemon
		jobKilled  bool
		imagesGone bool
	}{
		{"every page in", 0, true, false, true},
		{"daemon failed", unix.WaitStatus(1 << 8), true, true, false},
		{"daemon killed", unix.WaitStatus(syscall.SIGKILL), true, true, false},
		{"another child", unix.WaitStatus(1 << 8), false, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			images := filepath.Join(t.TempDir(), "work")
			if err := os.MkdirAll(filepath.Join(images, "images"), 0o700); err != nil {
				t.Fatal(err)
			}
			job := exec.Command("sleep", "60")
			if err := job.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan struct{})
			go func() { job.Wait(); close(exited) }()
			t.Cleanup(func() { job.Process.Kill(); <-exited })
			const daemon = 1 << 22 // a pid no process has
			got := daemon
			if !tc.daemon {
				got = daemon + 1
			}
			var reason string
			lazyDone(Spec{JobID: "j", ImagesDir: images}, job.Process.Pid, daemon, &reason)(got, tc.ws)
			// A job killed so says why in its exit record: a bare SIGKILL looks like the OOM killer's.
			if (reason != "") != tc.jobKilled {
				t.Errorf("reason for the kill %q, want one %v", reason, tc.jobKilled)
			}
			// lazyDone signals synchronously: a job it did not kill is running now; one it killed ends, as
			// soon as the machine gets to it, by SIGKILL.
			if tc.jobKilled {
				select {
				case <-exited:
					if ws, ok := job.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
						t.Errorf("the job ended with %v, want SIGKILL", job.ProcessState)
					}
				case <-time.After(30 * time.Second):
					t.Error("the job runs on")
				}
			} else {
				select {
				case <-exited:
					t.Errorf("the job ended: %v", job.ProcessState)
				default:
				}
			}
			if _, err := os.Stat(images); (err != nil) != tc.imagesGone {
				t.Errorf("images dir: %v, want gone %v", err, tc.imagesGone)
			}
		})
	}
}

// TestWaitRestoredEndsDaemon: a lazily restored job that ends before its lazy-pages daemon leaves no daemon
// behind (running as root, reading the images the agent removes on the job's end); a daemon that failed
// first gets the job killed, with the reason in its record, and is not waited for twice.
func TestWaitRestoredEndsDaemon(t *testing.T) {
	start := func(name string, args ...string) *exec.Cmd {
		t.Helper()
		cmd := exec.Command(name, args...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// waitRestored reaps by wait4(-1): a process still our child (neither it nor Wait reaped it) is
		// ended and reaped here.
		t.Cleanup(func() {
			var info unix.Siginfo
			if unix.Waitid(unix.P_PID, cmd.Process.Pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil) == nil {
				cmd.Process.Kill()
				cmd.Wait()
			}
		})
		return cmd
	}
	images := filepath.Join(t.TempDir(), "work")
	if err := os.MkdirAll(images, 0o700); err != nil {
		t.Fatal(err)
	}
	spec := Spec{JobID: "j", ImagesDir: images}

	t.Run("job ends first", func(t *testing.T) {
		daemon := start("sleep", "60")
		job := start("sh", "-c", "exit 3")
		st := waitRestored(spec, job.Process.Pid, daemon)
		if st.Code != 3 || st.Reason != "" {
			t.Errorf("exit status %+v, want code 3 and no reason", st)
		}
		if daemon.ProcessState == nil {
			t.Fatal("the lazy-pages daemon was left running after the job ended")
		}
		if ws, ok := daemon.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
			t.Errorf("the daemon ended with %v, want SIGKILL", daemon.ProcessState)
		}
	})

	t.Run("daemon fails first", func(t *testing.T) {
		daemon := start("sh", "-c", "exit 1")
		job := start("sleep", "60")
		st := waitRestored(spec, job.Process.Pid, daemon)
		if st.Signal != "SIGKILL" || st.Reason == "" {
			t.Errorf("exit status %+v, want SIGKILL with a reason", st)
		}
		if daemon.ProcessState != nil {
			t.Errorf("the daemon, reaped by waitJob, was waited for again: %v", daemon.ProcessState)
		}
	})
}
