//go:build linux

package threadcpu

import (
	"runtime"
	"testing"
	"time"
)

// spin keeps the thread busy for d of its own CPU time.
func spin(d time.Duration) {
	for start := Now(); Now()-start < d; {
	}
}

// A clock counts from its start. Its thread may have run other work before: the runtime reuses a thread
// a goroutine unlocked, and the bench's per-run consumer CPU (netlog,
// *_consumer_thread_cpu_s_per_GB_logged) once read 6.6 s per GB at 1 Gbit/s, the thread's whole life.
func TestClockStartsAtZero(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	spin(50 * time.Millisecond)
	clock := Start()
	if used := clock.Used(); used > 20*time.Millisecond {
		t.Fatalf("a clock started on a thread that had used 50 ms reads %v at once", used)
	}
	spin(10 * time.Millisecond)
	if used := clock.Used(); used < 10*time.Millisecond {
		t.Fatalf("10 ms of work on the thread after the start read %v", used)
	}
}

// Of counts work, not waiting: the agent paces its connection checks by what they cost, and on a busy
// host a check that waited for a CPU once spaced the next ones past a short job's end (ci301).
func TestOfCountsWorkNotWaiting(t *testing.T) {
	if got := Of(func() { time.Sleep(50 * time.Millisecond) }); got > 20*time.Millisecond {
		t.Errorf("50 ms asleep cost %v of CPU", got)
	}
	if got := Of(func() { spin(20 * time.Millisecond) }); got < 20*time.Millisecond {
		t.Errorf("20 ms of work cost %v of CPU", got)
	}
}

// TestReadAdvances: Read reports no error on Linux and counts the thread's work.
func TestReadAdvances(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	before, err := Read()
	if err != nil {
		t.Fatal(err)
	}
	spin(10 * time.Millisecond)
	after, err := Read()
	if err != nil || after-before < 10*time.Millisecond {
		t.Fatalf("10 ms of work read %v (%v)", after-before, err)
	}
}
