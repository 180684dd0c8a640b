// Package procstate tells from /proc whether a process or thread runs. The stat line is parsed by
// prometheus/procfs, which reads the state after the command name's last ')' (a name may hold blanks
// and parentheses).
package procstate

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// Halted reports whether a state from /proc/PID/stat is that of a task that runs no code until something
// acts on it: stopped by a signal (T) or by a tracer (t), a zombie (Z), dead (X).
func Halted(state string) bool {
	switch state {
	case "T", "t", "Z", "X":
		return true
	}
	return false
}

// Of returns the state of process or thread id (/proc lists a thread's id like a process's).
func Of(id int) (string, error) {
	p, err := procfs.NewProc(id)
	if err != nil {
		return "", fmt.Errorf("process %d: %w", id, err)
	}
	s, err := p.Stat()
	if err != nil {
		return "", fmt.Errorf("state of process %d: %w", id, err)
	}
	return s.State, nil
}

// RunningThreads lists the threads of process pid that are not halted; a thread that exits while they
// are read is not listed.
func RunningThreads(pid int) ([]int, error) {
	threads, err := procfs.AllThreads(pid)
	if err != nil {
		return nil, fmt.Errorf("list the threads of process %d: %w", pid, err)
	}
	var running []int
	for _, t := range threads {
		s, err := t.Stat()
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH) {
			continue // it exited
		}
		if err != nil {
			return nil, fmt.Errorf("thread %d of process %d: %w", t.PID, pid, err)
		}
		if !Halted(s.State) {
			running = append(running, t.PID)
		}
	}
	return running, nil
}

// Tree lists pid and its descendants (every thread's children). A descendant or thread that exits while
// they are read is left out: the tree is read while it runs (a dump CRIU left unfinished), and one short-
// lived child must not cost the caller every other process.
func Tree(pid int) ([]int, error) { return tree("/proc", pid) }

// tree is Tree on the procfs mounted at proc.
func tree(proc string, pid int) ([]int, error) {
	var out []int
	for next := []int{pid}; len(next) > 0; {
		p := next[0]
		next = next[1:]
		tasks, err := os.ReadDir(fmt.Sprintf("%s/%d/task", proc, p))
		if err != nil && p != pid && exited(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("list the threads of process %d: %w", p, err)
		}
		out = append(out, p)
		for _, t := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("%s/%d/task/%s/children", proc, p, t.Name()))
			if exited(err) {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("list the children of thread %s of process %d: %w", t.Name(), p, err)
			}
			for _, f := range strings.Fields(string(b)) {
				c, err := strconv.Atoi(f)
				if err != nil {
					return nil, fmt.Errorf("children of process %d: %q", p, f)
				}
				next = append(next, c)
			}
		}
	}
	return out, nil
}

// exited reports whether err is what /proc answers for a process or thread that is gone.
func exited(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH)
}
