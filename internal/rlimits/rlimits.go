// Package rlimits carries the resource limits of the program that asks for a job (ftwrap, mpirun's
// launcher) to the job, as Slurm propagates a submitting shell's limits to its tasks. Without it a job
// inherits the agent's: its service unit raises the locked-memory and open-files limits far beyond what
// a user's session has, for the agent's own BPF maps and sockets.
package rlimits

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// count is how many resources Linux has (RLIM_NLIMITS): RLIMIT_CPU (0) to RLIMIT_RTTIME (15).
const count = 16

// Limit is one resource's soft (Cur) and hard (Max) limit; unix.RLIM_INFINITY is no limit.
type Limit struct {
	Resource int    `json:"resource"`
	Cur      uint64 `json:"cur"`
	Max      uint64 `json:"max"`
}

// Of reads every resource limit of process pid (as root: any process).
func Of(pid int) ([]Limit, error) {
	out := make([]Limit, 0, count)
	for r := range count {
		var l unix.Rlimit
		if err := unix.Prlimit(pid, r, nil, &l); err != nil {
			return nil, fmt.Errorf("read resource limit %d of process %d: %w", r, pid, err)
		}
		out = append(out, Limit{Resource: r, Cur: l.Cur, Max: l.Max})
	}
	return out, nil
}

// Validate refuses a list no process can have: an unknown or repeated resource, a soft limit above the
// hard one.
func Validate(ls []Limit) error {
	if len(ls) > count {
		return fmt.Errorf("%d resource limits, Linux has %d", len(ls), count)
	}
	var seen [count]bool
	for _, l := range ls {
		switch {
		case l.Resource < 0 || l.Resource >= count:
			return fmt.Errorf("resource limit %d: no such resource", l.Resource)
		case seen[l.Resource]:
			return fmt.Errorf("resource limit %d given twice", l.Resource)
		case l.Cur > l.Max:
			return fmt.Errorf("resource limit %d: soft limit %d above the hard limit %d", l.Resource, l.Cur, l.Max)
		}
		seen[l.Resource] = true
	}
	return nil
}

// Session is what a job gets of the two limits the agent's unit raises when the asking program's limits
// are unknown (an API client whose process is gone, a request from an older agent): those of a login
// session on current distributions (systemd's DefaultLimitNOFILE, the kernel's 8 MiB of locked memory).
var Session = []Limit{
	{Resource: unix.RLIMIT_NOFILE, Cur: 1024, Max: 524288},
	{Resource: unix.RLIMIT_MEMLOCK, Cur: 8 << 20, Max: 8 << 20},
}

// Apply sets the calling process's limits to ls (Session if ls is empty). Run as root, before the
// process drops its privileges: only a process with CAP_SYS_RESOURCE raises a hard limit. Without it (a
// container), a limit is capped at the process's own hard limit, as slurmd caps what it propagates.
func Apply(ls []Limit) error {
	if len(ls) == 0 {
		ls = Session
	}
	if err := Validate(ls); err != nil {
		return err
	}
	var errs []error
	for _, l := range ls {
		lim := unix.Rlimit{Cur: l.Cur, Max: l.Max}
		err := unix.Setrlimit(l.Resource, &lim)
		if errors.Is(err, unix.EPERM) {
			var own unix.Rlimit
			if err = unix.Getrlimit(l.Resource, &own); err == nil {
				lim.Max = min(lim.Max, own.Max)
				lim.Cur = min(lim.Cur, lim.Max)
				err = unix.Setrlimit(l.Resource, &lim)
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("set resource limit %d to %d/%d: %w", l.Resource, lim.Cur, lim.Max, err))
		}
	}
	return errors.Join(errs...)
}
