//go:build linux

package capture

import (
	"runtime"
	"testing"
	"time"
)

// A consumer's CPU time counts from its start. Its thread may have run other work before: the runtime
// reuses a thread a goroutine unlocked, and the bench's per-run consumer CPU (netlog,
// *_consumer_thread_cpu_s_per_GB_logged) once read 6.6 s per GB at 1 Gbit/s, the thread's whole life.
func TestThreadClockStartsAtZero(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for start := threadCPU(); threadCPU()-start < 50*time.Millisecond; {
	}
	clock := startThreadClock()
	if used := clock.used(); used > 20*time.Millisecond {
		t.Fatalf("a clock started on a thread that had used 50 ms reads %v at once", used)
	}
	for start := threadCPU(); threadCPU()-start < 10*time.Millisecond; {
	}
	if used := clock.used(); used < 10*time.Millisecond {
		t.Fatalf("10 ms of work on the thread after the start read %v", used)
	}
}
