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

// Tree lists pid and its descendants (every thread's children).
func Tree(pid int) ([]int, error) {
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", out[i]))
		if err != nil {
			return nil, fmt.Errorf("list the threads of process %d: %w", out[i], err)
		}
		for _, t := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", out[i], t.Name()))
			if err != nil {
				return nil, fmt.Errorf("list the children of thread %s of process %d: %w", t.Name(), out[i], err)
			}
			for _, f := range strings.Fields(string(b)) {
				c, err := strconv.Atoi(f)
				if err != nil {
					return nil, fmt.Errorf("children of process %d: %q", out[i], f)
				}
				out = append(out, c)
			}
		}
	}
	return out, nil
}
