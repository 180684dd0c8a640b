package lab

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/procstate"
)

// NetnsDir is where named network namespaces are bind-mounted (the `ip netns` convention).
const NetnsDir = "/var/run/netns"

// NetnsPath is the bind-mount path of a named namespace.
func NetnsPath(name string) string { return filepath.Join(NetnsDir, name) }

// InNetns runs fn on an OS thread that has joined the network namespace at path (netnsthread.In).
func InNetns(path string, fn func() error) error { return netnsthread.In(path, fn) }

// createNamedNetns makes a new named namespace without moving the calling goroutine's thread into it.
func createNamedNetns(name string) error { return netnsthread.CreateNamed(name) }

// deleteNamedNetns unmounts and removes a named namespace; a missing one is not an error.
func deleteNamedNetns(name string) error {
	p := NetnsPath(name)
	if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", p, err)
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", p, err)
	}
	return nil
}

// netnsIno identifies a namespace by the inode of its nsfs file.
func netnsIno(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// PIDsInNetns lists the processes whose network namespace is the one at path.
func PIDsInNetns(path string) ([]int, error) {
	ino, err := netnsIno(path)
	if err != nil {
		return nil, fmt.Errorf("stat network namespace %s: %w", path, err)
	}
	return pidsInNetnsIno(ino)
}

func pidsInNetnsIno(ino uint64) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list /proc: %w", err)
	}
	self := os.Getpid()
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		var st unix.Stat_t
		// Processes exit while we scan and zombies have no namespace: skip whatever cannot be read.
		if unix.Stat("/proc/"+e.Name()+"/ns/net", &st) != nil {
			continue
		}
		if st.Ino == ino {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// stopNetns SIGSTOPs every process in the namespace and waits, up to bound, until none runs: a power cut
// ends them all at once, where killed one by one a process could see another die, or the network go, and
// act on it first (ci130: a crashing spare's agent saw its network gone, killed the job it had just
// restored, and the job's shim recorded that exit for the test to read). A process that does not stop
// within bound (in the kernel, uninterruptible) is killed as it is.
func stopNetns(path string, bound time.Duration) error {
	ino, err := netnsIno(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stat network namespace %s: %w", path, err)
	}
	for deadline := time.Now().Add(bound); ; time.Sleep(time.Millisecond) {
		pids, err := pidsInNetnsIno(ino)
		if err != nil {
			return err
		}
		running := 0
		for _, pid := range pids {
			_ = unix.Kill(pid, unix.SIGSTOP) // ESRCH: already gone
			if !stopped(pid) {
				running++
			}
		}
		if running == 0 || time.Now().After(deadline) {
			return nil
		}
	}
}

// stopped says whether process pid is stopped, a zombie, or gone.
func stopped(pid int) bool {
	state, err := procstate.Of(pid)
	return err != nil || procstate.Halted(state)
}

// killNetns SIGKILLs every process in the namespace until none is left, like a power cut: processes that
// fork while we scan are caught by the next round.
func killNetns(ctx context.Context, path string, timeout time.Duration) error {
	ino, err := netnsIno(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stat network namespace %s: %w", path, err)
	}
	deadline := time.Now().Add(timeout)
	for {
		pids, err := pidsInNetnsIno(ino)
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		// Killed before the bounds are checked: an ended ctx must not leave the processes without even a
		// SIGKILL (stopNetns has SIGSTOPped them, so they would stay so).
		for _, pid := range pids {
			_ = unix.Kill(pid, unix.SIGKILL) // ESRCH: already gone
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("processes %v in %s survive SIGKILL after %s (stuck in the kernel?); check `ps -o pid,stat,wchan -p ...`", pids, path, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
