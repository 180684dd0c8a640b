package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// maxExitRecord bounds what ReadExit reads: a record is about 100 bytes.
const maxExitRecord = 64 << 10

// ReadExit returns the job's exit record if its shim wrote one. The agent reads it as root, so a link or
// a FIFO (in a job directory an older agent handed to the user) is refused, not followed or waited on, and
// so is a record root did not write: the user could forge one there.
func ReadExit(path string) (*ExitStatus, error) {
	f, fi, err := openRegular(path, "exit record")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok && sys.Uid != 0 {
		return nil, fmt.Errorf("exit record %s belongs to uid %d, so no shim wrote it: not read", path, sys.Uid)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxExitRecord+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxExitRecord {
		return nil, fmt.Errorf("exit record %s is larger than %d bytes", path, maxExitRecord)
	}
	var st ExitStatus
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("exit record %s: %w", path, err)
	}
	return &st, nil
}

// openRegular opens a file root reads (what names the file), refusing a link, which it does not follow, and
// anything but a regular file, which it neither waits on (a FIFO) nor lets become its terminal.
func openRegular(path, what string) (*os.File, os.FileInfo, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if errors.Is(err, syscall.ELOOP) {
		return nil, nil, fmt.Errorf("%s %s is a symbolic link: not read", what, path)
	}
	if err != nil {
		return nil, nil, err
	}
	st, err := f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = fmt.Errorf("%s %s is not a regular file: not read", what, path)
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, st, nil
}

// ErrJobGone means the job's root process is gone: it exited, or its PID now names another process.
var ErrJobGone = errors.New("the job's process is gone")

// Signal sends sig to the job's root process and to nothing else. A PID alone may be reused between
// the check of the job and the signal, by any process of any user; a pidfd cannot be. The pidfd is opened
// first and the process it names is then confirmed to be in the job's cgroup (where a non-root job cannot
// leave and no other process can enter), so the signal reaches the job or nobody.
func Signal(pid int, cgroup string, sig unix.Signal) error {
	if pid <= 0 {
		return fmt.Errorf("%w: no pid recorded", ErrJobGone)
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("%w: pid %d has exited", ErrJobGone, pid)
	}
	if err != nil {
		return fmt.Errorf("open a pidfd for pid %d: %w", pid, err)
	}
	defer unix.Close(fd)
	// If the process died and its PID was reused after PidfdOpen, the check below sees the newcomer; it
	// then either fails, or passes for a process of the job while the pidfd still names the dead one, and
	// the signal fails with ESRCH. Either way no process outside the job is signalled.
	procs, err := os.ReadFile(filepath.Join(cgroup, "cgroup.procs"))
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: its cgroup %s was removed", ErrJobGone, cgroup)
	}
	if err != nil {
		return fmt.Errorf("read the job's cgroup %s: %w", cgroup, err)
	}
	if !pidListed(procs, pid) {
		return fmt.Errorf("%w: pid %d is no longer in the job's cgroup %s", ErrJobGone, pid, cgroup)
	}
	if err := delivered(pid, sig); err != nil {
		return err
	}
	if err := unix.PidfdSendSignal(fd, sig, nil, 0); errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("%w: pid %d has exited", ErrJobGone, pid)
	} else if err != nil {
		return fmt.Errorf("send %s to pid %d: %w", unix.SignalName(sig), pid, err)
	}
	return nil
}

// ErrNotDelivered means the kernel would drop the signal: the job's root is the init of its PID namespace,
// which gets a signal from outside only if it has a handler for it (or SIGKILL, SIGSTOP).
var ErrNotDelivered = errors.New("the job's root would not get the signal")

// delivered refuses a signal the kernel would silently drop: one whose default action would stop or end
// PROG run alone, sent to a root that is the init of its PID namespace (every job this shim starts or
// restores) and neither handles nor ignores it. Sent, it would vanish, and the caller would take the job
// for signalled. A root whose status cannot be read is signalled as before.
func delivered(pid int, sig unix.Signal) error {
	switch sig {
	case unix.SIGKILL, unix.SIGSTOP, unix.SIGCHLD, unix.SIGURG, unix.SIGWINCH, unix.SIGCONT:
		return nil // forced from outside the namespace, or ignored (SIGCONT resumes anyway) by default
	}
	if sig < 1 || sig > 64 {
		return nil
	}
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return nil
	}
	var nsInit, caught bool
	for line := range strings.Lines(string(b)) {
		k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
		switch k {
		case "NSpid":
			f := strings.Fields(v)
			nsInit = len(f) > 1 && f[len(f)-1] == "1"
		case "SigCgt", "SigIgn":
			if m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil || m&(1<<(sig-1)) != 0 {
				caught = true // or ignored, as by PROG alone; unreadable: send it as before
			}
		}
	}
	if nsInit && !caught {
		return fmt.Errorf("%w: pid %d is the init of the job's PID namespace and has no handler for %s, so the kernel would drop it; SIGKILL ends the job",
			ErrNotDelivered, pid, unix.SignalName(sig))
	}
	return nil
}

// pidListed reports whether a cgroup.procs file (one PID a line) lists pid.
func pidListed(procs []byte, pid int) bool {
	for line := range strings.Lines(string(procs)) {
		if p, err := strconv.Atoi(strings.TrimSpace(line)); err == nil && p == pid {
			return true
		}
	}
	return false
}
