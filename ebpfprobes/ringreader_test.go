//go:build linux

package ebpfprobes

import (
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// newTestRing returns a ring reader over a fresh BPF ring buffer map.
func newTestRing(t *testing.T) *ringReader {
	t.Helper()
	r, _ := newTestRingMap(t)
	return r
}

// newTestRingMap is newTestRing that also returns the map.
func newTestRingMap(t *testing.T) (*ringReader, *ebpf.Map) {
	t.Helper()
	size := os.Getpagesize()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.RingBuf, MaxEntries: uint32(size)})
	if err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("SKIPPED: creating a BPF ring buffer needs root (CAP_BPF): %v", err)
		}
		t.Fatalf("create ring buffer map: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	r, err := newRingReader("test", m.FD(), size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.close() })
	return r, m
}

// TestRingDrainEndsWithItsBatch: a drain takes the records that were in the ring when it began and
// returns, even while a producer keeps adding more. Here each record taken makes the producer (a program
// run by BPF_PROG_TEST_RUN) add one: a drain that read on until the ring was empty would never end. It
// did (ci277): the capture's consumer never got back to its park, and a snapshot waiting for the parked
// clones gave up.
func TestRingDrainEndsWithItsBatch(t *testing.T) {
	r, m := newTestRingMap(t)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.SocketFilter,
		License: "GPL",
		Instructions: asm.Instructions{
			// bpf_ringbuf_output(map, &(u64){0}, 8, 0)
			asm.Mov.Imm(asm.R1, 0),
			asm.StoreMem(asm.R10, -8, asm.R1, asm.DWord),
			asm.LoadMapPtr(asm.R1, m.FD()),
			asm.Mov.Reg(asm.R2, asm.R10),
			asm.Add.Imm(asm.R2, -8),
			asm.Mov.Imm(asm.R3, 8),
			asm.Mov.Imm(asm.R4, 0),
			asm.FnRingbufOutput.Call(),
			asm.Mov.Imm(asm.R0, 0),
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("load a program that writes to the ring: %v", err)
	}
	defer prog.Close()
	produce := func() {
		t.Helper()
		if _, err := prog.Run(&ebpf.RunOptions{Data: make([]byte, 14)}); err != nil {
			t.Fatalf("run the producer: %v", err)
		}
	}
	const batch, bound = 3, 1000
	for range batch {
		produce()
	}
	if got := r.pending(); got != batch*16 {
		t.Fatalf("the ring holds %d bytes, want %d records of 16", got, batch)
	}
	produced := 0
	r.life.RLock()
	n, err := r.drain(int(^uint(0)>>1), func([]byte) error {
		if produced < bound { // the bound only keeps a failing drain from running for ever
			produce()
			produced++
		}
		return nil
	})
	r.life.RUnlock()
	if err != nil || n != batch {
		t.Fatalf("drain took %d records (%v) while each one taken made another; want the %d in the ring when it began", n, err, batch)
	}
	if got := r.pending(); got != batch*16 {
		t.Errorf("after the drain the ring holds %d bytes, want the %d records made during it", got, batch)
	}
}

// parkedWaits counts the goroutines parked in the runtime's poller inside a ring wait.
func parkedWaits() int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "[IO wait") && strings.Contains(g, "(*ringReader).pollWait") {
			n++
		}
	}
	return n
}

// TestRingWaitParks: a waiting reader parks its goroutine in the runtime's poller ("IO wait") instead of
// holding a thread in epoll_wait ("syscall"): a thread blocked in a system call for more than 10 ms makes
// the runtime's sysmon poll at 20 us intervals for a while, which was half of an idle agent's CPU.
func TestRingWaitParks(t *testing.T) {
	const readers = 5
	rings := make([]*ringReader, readers)
	for i := range rings {
		rings[i] = newTestRing(t)
		if rings[i].epc == nil {
			t.Fatal("the ring's epoll fd is not in the runtime's poller")
		}
	}
	var wg sync.WaitGroup
	for _, r := range rings {
		wg.Go(func() {
			r.life.RLock()
			defer r.life.RUnlock()
			if flushed, err := r.wait(time.Minute); err != nil || !flushed {
				t.Errorf("wait: flushed %v, err %v; want flushed", flushed, err)
			}
		})
	}
	parked := waitParked(t, readers)
	for _, r := range rings {
		if err := r.flush(); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	if parked != readers {
		t.Fatalf("%d of %d waiting readers parked in the runtime's poller within 10s", parked, readers)
	}
}

// waitParked waits until n ring waits are parked in the runtime's poller, 10 seconds at most, and returns
// how many were.
func waitParked(t *testing.T, n int) int {
	t.Helper()
	parked := 0
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if parked = parkedWaits(); parked == n {
			break
		}
	}
	return parked
}

// TestRingWaitTimeoutAndClose: a wait ends after its timeout without a flush, and close ends a wait.
func TestRingWaitTimeoutAndClose(t *testing.T) {
	r := newTestRing(t)
	r.life.RLock()
	start := time.Now()
	flushed, err := r.wait(30 * time.Millisecond)
	r.life.RUnlock()
	if err != nil || flushed {
		t.Fatalf("wait: flushed %v, err %v; want a timeout", flushed, err)
	}
	if d := time.Since(start); d < 30*time.Millisecond {
		t.Fatalf("wait returned after %s, before its 30ms timeout", d)
	}
	done := make(chan error, 1)
	go func() {
		r.life.RLock()
		_, err := r.wait(time.Minute)
		r.life.RUnlock()
		done <- err
	}()
	waitParked(t, 1)
	if err := r.close(); err != nil { // waits for the reader to let go of the mapping
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("wait interrupted by close: %v", err)
	}
}
