package procstate

import (
	"os"
	"os/exec"
	"path/filepath"
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

// TestTreeSkipsTheExited: a thread or descendant that exits between the read that names it and the read
// of its own entries is left out, not an error that loses the whole tree. The /proc here is a directory
// that holds what such a race leaves: a thread listed without its entries, a child listed without its
// directory.
func TestTreeSkipsTheExited(t *testing.T) {
	proc := t.TempDir()
	write := func(path, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(proc, path)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, path), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("1/task/1/children", "2 3 4 ")
	if err := os.MkdirAll(filepath.Join(proc, "1/task/5"), 0o755); err != nil { // thread 5 exited
		t.Fatal(err)
	}
	write("2/task/2/children", "6 ")
	// Child 3 exited and was reaped: no /proc/3.
	write("4/task/4/children", "")
	write("4/task/7/children", "8 ")
	write("6/task/6/children", "")
	// Child 8 exited after it was listed, its directory still there but its threads gone.
	if err := os.MkdirAll(filepath.Join(proc, "8"), 0o755); err != nil {
		t.Fatal(err)
	}
	got, err := tree(proc, 1)
	if want := []int{1, 2, 4, 6}; err != nil || !slices.Equal(got, want) {
		t.Fatalf("tree = %v, %v; want %v", got, err, want)
	}
	// The root itself gone is an error: the caller asked about a process that does not exist.
	if got, err := tree(proc, 9); err == nil {
		t.Fatalf("tree of a process that does not exist = %v; want an error", got)
	}
}
