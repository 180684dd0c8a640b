//go:build linux

// Package threadcpu measures the CPU time of one OS thread (CLOCK_THREAD_CPUTIME_ID: its user and system
// time, not the time it waited for a CPU). The caller must be locked to its thread (runtime.LockOSThread)
// for a reading to mean anything, or use Of.
package threadcpu

import (
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// Read is the CPU time the calling thread has used since it was made, or why the clock cannot be read.
func Read() (time.Duration, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0, fmt.Errorf("thread CPU clock: %w", err)
	}
	return time.Duration(ts.Nano()), nil
}

// Now is Read for a caller that counts a clock it cannot read as 0 (an account, not a decision).
func Now() time.Duration {
	d, _ := Read()
	return d
}

// Clock measures the CPU time of the calling thread from its start. The runtime hands a thread that was
// locked to a goroutine back to others when it unlocks, so a goroutine may get one that already ran
// earlier work: its clock does not start at 0.
type Clock struct{ base time.Duration }

// Start starts a clock on the calling thread.
func Start() Clock { return Clock{base: Now()} }

// Used is the CPU time the thread used since Start; call it on the same thread.
func (c Clock) Used() time.Duration { return max(Now()-c.base, 0) }

// Of runs fn locked to the calling goroutine's thread and returns the CPU time fn used on it (not what it
// ran on other goroutines' threads).
func Of(fn func()) time.Duration {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c := Start()
	fn()
	return c.Used()
}
