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
			lazyDone(Spec{JobID: "j", ImagesDir: images}, job.Process.Pid, daemon)(got, tc.ws)
			select {
			case <-exited:
				if !tc.jobKilled {
					t.Error("the job was killed")
				}
			case <-time.After(200 * time.Millisecond):
				if tc.jobKilled {
					t.Error("the job runs on")
				}
			}
			if _, err := os.Stat(images); (err != nil) != tc.imagesGone {
				t.Errorf("images dir: %v, want gone %v", err, tc.imagesGone)
			}
		})
	}
}
