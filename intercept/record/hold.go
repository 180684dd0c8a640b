package record

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/procstate"
)

// anyHeld reports whether some process waits for its determinants to be shipped.
func (r *Recorder) anyHeld() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.byJob {
		if len(s.held) > 0 {
			return true
		}
	}
	return false
}

// releaseHeld continues s's held processes whose determinants are stored (before s.first), or all.
func (r *Recorder) releaseHeld(s *stream, all bool) {
	s.holdMu.Lock()
	defer s.holdMu.Unlock()
	r.mu.Lock()
	var pids []uint32
	keep := s.held[:0]
	for _, h := range s.held {
		if all || h.upTo <= s.first {
			pids = append(pids, h.pid)
		} else {
			keep = append(keep, h)
		}
	}
	s.held = keep
	r.mu.Unlock()
	r.continueHeld(s.job, pids)
}

// continueHeld continues processes the recorder held after a receive call (job: theirs, "" if none),
// whether or not its SIGSTOP took effect yet: SIGCONT also discards a pending one.
func (r *Recorder) continueHeld(job string, pids []uint32) {
	for _, pid := range pids {
		if err := unix.Kill(int(pid), unix.SIGCONT); err != nil && !errors.Is(err, unix.ESRCH) {
			r.log.Error("could not continue a process held for its determinant: it stays stopped", "job", job, "pid", pid, "err", err)
		}
	}
}

// ReleaseForDump prepares frozen job's dump (its cgroup is cgroupDir) when it is held after receive calls: a process stopped (or
// about to stop) by a hold would be dumped stopped and restored stopped, with nobody to continue it. Each
// such process is continued while frozen (it stays frozen), and restop, called once CRIU is done and
// before the thaw, stops it again: it stops as soon as it is thawed and waits for its release as before.
func (r *Recorder) ReleaseForDump(job, cgroupDir string) (restop func(), err error) {
	if !r.Pessimistic() {
		return func() {}, nil
	}
	r.mu.Lock()
	s := r.byJob[job]
	r.mu.Unlock()
	if s == nil {
		return func() {}, nil
	}
	s.holdMu.Lock() // no release while the job is dumped: restop would stop a released process for good
	pids, err := stoppingProcs(cgroupDir)
	for _, pid := range pids {
		if kerr := unix.Kill(pid, unix.SIGCONT); kerr != nil && !errors.Is(kerr, unix.ESRCH) && err == nil {
			err = fmt.Errorf("continue held process %d for the dump: %w", pid, kerr)
		}
	}
	return sync.OnceFunc(func() {
		defer s.holdMu.Unlock()
		for _, pid := range pids {
			if err := unix.Kill(pid, unix.SIGSTOP); err != nil && !errors.Is(err, unix.ESRCH) {
				r.log.Error("could not hold a process again after its dump: it runs on before its determinant is stored", "job", job, "pid", pid, "err", err)
			}
		}
	}), err
}

// stoppingProcs lists the processes of cgroup dir that are stopped or have a SIGSTOP pending.
func stoppingProcs(dir string) ([]int, error) {
	pids, err := jobProcs(dir)
	return slices.DeleteFunc(pids, func(pid int) bool { return !stopping(pid) }), err
}

// jobProcs lists the processes of the job cgroup dir.
func jobProcs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, fmt.Errorf("list the job's processes: %w", err)
	}
	var pids []int
	for f := range strings.FieldsSeq(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// stopping reports whether process pid is stopped, or a SIGSTOP is pending for it or one of its threads.
func stopping(pid int) bool {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return false
	}
	const stopBit = 1 << (unix.SIGSTOP - 1)
	for _, e := range ents {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, e.Name()))
		if err != nil {
			continue
		}
		for l := range strings.Lines(string(b)) {
			k, v, ok := strings.Cut(l, ":")
			if !ok {
				continue
			}
			v = strings.TrimSpace(v)
			switch k {
			case "State":
				if strings.HasPrefix(v, "T") {
					return true
				}
			case "SigPnd", "ShdPnd":
				if m, err := strconv.ParseUint(v, 16, 64); err == nil && m&stopBit != 0 {
					return true
				}
			}
		}
	}
	return false
}

// ContinueStopped continues each process of the job cgroup dir whose threads are all stopped.
func ContinueStopped(dir string) error {
	pids, err := jobProcs(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, pid := range pids {
		if running, err := procstate.RunningThreads(pid); err != nil || len(running) > 0 {
			continue // gone, or not stopped
		}
		if err := unix.Kill(pid, unix.SIGCONT); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("continue process %d: %w", pid, err))
		}
	}
	return errors.Join(errs...)
}
