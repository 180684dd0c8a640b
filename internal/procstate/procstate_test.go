package procstate

import (
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestHalted(t *testing.T) {
	for _, tc := range []struct {
		state string
		want  bool
	}{
		{"R", false}, {"S", false}, {"D", false}, {"I", false},
		{"T", true}, {"t", true}, {"Z", true}, {"X", true},
	} {
		if got := Halted(tc.state); got != tc.want {
			t.Errorf("Halted(%q) = %v, want %v", tc.state, got, tc.want)
		}
	}
}

// TestOf: a process whose name holds blanks and parentheses is read right (the state follows the last
// ')'), running, then stopped, then a zombie, then gone.
func TestOf(t *testing.T) {
	dir := t.TempDir()
	name := dir + "/a) R (b"
	if err := os.Symlink("/bin/sleep", name); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(name, "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	pid := cmd.Process.Pid
	wait := func(want string) {
		t.Helper()
		for start := time.Now(); ; time.Sleep(time.Millisecond) {
			got, err := Of(pid)
			if err != nil {
				t.Fatal(err)
			}
			if got == want {
				return
			}
			if time.Since(start) > time.Minute {
				t.Fatalf("process %d is in state %q, want %q", pid, got, want)
			}
		}
	}
	wait("S") // asleep in nanosleep
	running, err := RunningThreads(pid)
	if err != nil || !slices.Equal(running, []int{pid}) {
		t.Fatalf("RunningThreads of a sleeping process = %v, %v; want [%d]", running, err, pid)
	}
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	wait("T")
	if running, err := RunningThreads(pid); err != nil || len(running) != 0 {
		t.Fatalf("RunningThreads of a stopped process = %v, %v; want none", running, err)
	}
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wait("Z") // not reaped yet
	cmd.Wait()
	if s, err := Of(pid); err == nil {
		t.Fatalf("Of a reaped process = %q, want an error", s)
	}
}
