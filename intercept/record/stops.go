package record

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/procstate"
)

// Stopper is the Stopper of job, restored here in cgroup cgroupDir; nil if this host records no
// positions or does not know the job.
func (r *Recorder) Stopper(job, cgroupDir string) intercept.Stopper {
	if !r.Positions() {
		return nil
	}
	r.mu.Lock()
	s := r.byJob[job]
	r.mu.Unlock()
	if s == nil || s.cgroup == 0 {
		return nil
	}
	return jobStops{rec: r.rec, cgroup: s.cgroup, dir: cgroupDir}
}

// jobStops stops the threads of a job restored here for a replay of its receive positions
// (intercept.Stopper), through this host's recorder.
type jobStops struct {
	rec    *ebpfprobes.RecvOrder
	cgroup uint64 // the job cgroup's id
	dir    string // its directory
}

func (s jobStops) Arm(thread uint32, st intercept.Stop) error {
	return s.rec.Arm(s.cgroup, thread, ebpfprobes.Stop{Polls: st.Polls, Conn: st.Conn, End: st.End, Len: st.Len})
}

func (s jobStops) Disarm(thread uint32) error { return s.rec.Disarm(s.cgroup, thread) }

// Describe says how many readiness calls the thread made since the restore and, from /proc, its state and
// the system call it is in.
func (s jobStops) Describe(thread uint32) string {
	var parts []string
	if s.rec != nil {
		if n, err := s.rec.PollCount(s.cgroup, thread); err == nil {
			parts = append(parts, fmt.Sprintf("%d readiness calls made since the restore", n))
		}
	}
	if tid, err := hostThread(s.dir, thread); err != nil {
		parts = append(parts, err.Error())
	} else {
		parts = append(parts, fmt.Sprintf("host thread %d %s", tid, threadState(tid)))
	}
	return strings.Join(parts, ", ")
}

// hostThread is the host id of the thread of the job cgroup dir whose id in the job's PID namespace is ns.
func hostThread(dir string, ns uint32) (int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.threads"))
	if err != nil {
		return 0, fmt.Errorf("list the job's threads: %w", err)
	}
	for f := range strings.FieldsSeq(string(b)) {
		status, err := os.ReadFile("/proc/" + f + "/status")
		if err != nil {
			continue // it exited
		}
		for l := range strings.Lines(string(status)) {
			if ids, ok := strings.CutPrefix(l, "NSpid:"); ok {
				if fs := strings.Fields(ids); len(fs) > 0 && fs[len(fs)-1] == strconv.FormatUint(uint64(ns), 10) {
					return strconv.Atoi(f)
				}
				break
			}
		}
	}
	return 0, fmt.Errorf("no thread of the job has id %d in its PID namespace", ns)
}

// threadState is a thread's state, the system call it is in and where it sleeps, from /proc.
func threadState(tid int) string {
	dir := fmt.Sprintf("/proc/%d", tid)
	state, err := procstate.Of(tid)
	if err != nil {
		state = "?"
	}
	call := "?"
	if b, err := os.ReadFile(dir + "/syscall"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			call = f[0] // a number, or "running"
		}
	}
	wchan, _ := os.ReadFile(dir + "/wchan")
	return fmt.Sprintf("(state %s, system call %s, waiting in %q)", state, call, wchan)
}

func (s jobStops) Continue(pid uint32) error {
	if err := unix.Kill(int(pid), unix.SIGCONT); err != nil {
		return fmt.Errorf("continue process %d: %w", pid, err)
	}
	return nil
}

// WaitStopped waits until every thread of process pid is stopped (a group stop reaches each thread in
// turn), until ctx ends (the replay's timeout: a process something continued never stops).
func (s jobStops) WaitStopped(ctx context.Context, pid uint32) error {
	for {
		running, err := procstate.RunningThreads(int(pid))
		if err != nil {
			return err
		}
		if len(running) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("process %d was sent SIGSTOP, and its threads %v still run (something continued it): %w", pid, running, context.Cause(ctx))
		case <-time.After(50 * time.Microsecond):
		}
	}
}
