package slurm

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// Proc identifies a daemon the lab started: a pid alone could be reused by an unrelated process after
// the daemon died, so its start time (clock ticks since boot, from /proc/PID/stat) is recorded with it.
type Proc struct {
	Name  string `json:"name"`
	Host  string `json:"host,omitempty"` // the lab host it runs in; empty for the root namespace
	PID   int    `json:"pid"`
	Start uint64 `json:"start"`
}

// procStat returns the state and start time of pid.
func procStat(pid int) (state string, start uint64, err error) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return "", 0, err
	}
	s, err := p.Stat()
	return s.State, s.Starttime, err
}

// Identify records the running process pid as name on host.
func Identify(name, host string, pid int) (Proc, error) {
	_, start, err := procStat(pid)
	if err != nil {
		return Proc{}, fmt.Errorf("identify %s (pid %d): %w", name, pid, err)
	}
	return Proc{Name: name, Host: host, PID: pid, Start: start}, nil
}

// Alive says whether the recorded process still runs: same pid, same start time, not a zombie.
func (p Proc) Alive() bool {
	if p.PID <= 0 {
		return false
	}
	state, start, err := procStat(p.PID)
	return err == nil && start == p.Start && state != "Z" && state != "X"
}

// Stop sends SIGTERM, waits up to grace for the process to exit, then SIGKILLs it and waits again as
// long. A process that is already gone (or whose pid now belongs to another process) is fine.
func Stop(ctx context.Context, p Proc, grace time.Duration) error {
	for _, sig := range []unix.Signal{unix.SIGTERM, unix.SIGKILL} {
		if !p.Alive() {
			return nil
		}
		if err := unix.Kill(p.PID, sig); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("signal %s (pid %d): %w", p.Name, p.PID, err)
		}
		deadline := time.Now().Add(grace)
		for p.Alive() && time.Now().Before(deadline) && ctx.Err() == nil {
			time.Sleep(20 * time.Millisecond)
		}
	}
	if p.Alive() {
		return fmt.Errorf("%s (pid %d) survives SIGKILL after %s; check `ps -o pid,stat,wchan -p %d`", p.Name, p.PID, grace, p.PID)
	}
	return nil
}

// StopAll stops the processes concurrently (so that n daemons cost one grace period, not n).
func StopAll(ctx context.Context, procs []Proc, grace time.Duration) error {
	errs := make([]error, len(procs))
	done := make(chan struct{})
	for i, p := range procs {
		go func() { errs[i] = Stop(ctx, p, grace); done <- struct{}{} }()
	}
	for range procs {
		<-done
	}
	return errors.Join(errs...)
}
