//go:build linux

package ebpfprobes

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

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

// fakeRing is a ring reader over plain memory laid out as the kernel's mapping is: the data mapped twice
// in a row (put writes a record into both copies). No BPF: for drain's decoding.
type fakeRing struct {
	*ringReader
	size uint64
	prod uint64 // the producer position put advances
}

func newFakeRing(size int) *fakeRing {
	page := os.Getpagesize()
	words := func(n int) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(&make([]uint64, n/8)[0])), n) }
	prod := words(page + 2*size)
	r := &ringReader{name: "fake", cons: words(page), prod: prod, data: prod[page:], mask: uint64(size - 1)}
	return &fakeRing{ringReader: r, size: uint64(size)}
}

// put writes a record header (hdr: its length and flag bits) and payload at the producer position, in
// both copies of the data, and advances the producer position by the record's aligned length (or by
// adv when it is not 0).
func (f *fakeRing) put(hdr uint32, payload []byte, adv uint64) {
	at := f.prod & f.mask
	for _, off := range []uint64{at, at + f.size} {
		if off+ringHdrLen+uint64(len(payload)) > 2*f.size {
			continue // the second copy's tail falls past the mapping: the first copy holds it
		}
		binary.NativeEndian.PutUint32(f.data[off:], hdr)
		copy(f.data[off+ringHdrLen:], payload)
	}
	if adv == 0 {
		adv = ringHdrLen + (uint64(len(payload))+7)&^7
	}
	f.prod += adv
	binary.NativeEndian.PutUint64(f.ringReader.prod, f.prod)
}

func (f *fakeRing) cons() uint64 { return binary.NativeEndian.Uint64(f.ringReader.cons) }

// TestRingDrainDecodes: drain hands out committed records in order, skips discarded ones, leaves a refused
// record first, stops at max, follows a record across the ring's end, and refuses a header or a record the
// producer position does not cover, consuming nothing of it.
func TestRingDrainDecodes(t *testing.T) {
	page := os.Getpagesize()
	errRefused := errors.New("refused")
	drainAll := func(f *fakeRing, max int, refuse string) ([]string, error) {
		var got []string
		f.life.RLock()
		defer f.life.RUnlock()
		_, err := f.drain(max, func(raw []byte) error {
			if string(raw) == refuse {
				return errRefused
			}
			got = append(got, string(raw))
			return nil
		})
		return got, err
	}
	t.Run("order, discard, refusal, max", func(t *testing.T) {
		f := newFakeRing(page)
		f.put(3, []byte("one"), 0)
		f.put(ringDiscardBit|7, []byte("discard"), 0)
		f.put(3, []byte("two"), 0)
		f.put(5, []byte("three"), 0)
		got, err := drainAll(f, 1, "")
		if err != nil || !slices.Equal(got, []string{"one"}) {
			t.Fatalf("max 1: %q, %v", got, err)
		}
		got, err = drainAll(f, 0x7fffffff, "three")
		if !errors.Is(err, errRefused) || !slices.Equal(got, []string{"two"}) {
			t.Fatalf("refusing the third: %q, %v; want [two] and the refusal", got, err)
		}
		got, err = drainAll(f, 0x7fffffff, "")
		if err != nil || !slices.Equal(got, []string{"three"}) {
			t.Fatalf("after the refusal: %q, %v; want the refused record first", got, err)
		}
		if f.cons() != f.prod {
			t.Fatalf("consumer at %d, producer at %d", f.cons(), f.prod)
		}
	})
	t.Run("across the end", func(t *testing.T) {
		f := newFakeRing(page)
		big := bytes.Repeat([]byte{'x'}, page-32)
		f.put(uint32(len(big)), big, 0)
		if got, err := drainAll(f, 0x7fffffff, ""); err != nil || len(got) != 1 {
			t.Fatalf("%d records, %v", len(got), err)
		}
		wrap := bytes.Repeat([]byte("wrap"), 16) // starts 24 bytes before the end
		f.put(uint32(len(wrap)), wrap, 0)
		if got, err := drainAll(f, 0x7fffffff, ""); err != nil || !slices.Equal(got, []string{string(wrap)}) {
			t.Fatalf("across the end: %q, %v", got, err)
		}
	})
	for _, c := range []struct {
		name string
		hdr  uint32
		adv  uint64
	}{
		{"header cut short", 0, 4},
		{"record longer than committed", 64, ringHdrLen + 8},
		{"length past the ring", ringDiscardBit - 1, ringHdrLen + 8},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFakeRing(page)
			f.put(c.hdr, make([]byte, 8), c.adv)
			got, err := drainAll(f, 0x7fffffff, "")
			if !errors.Is(err, io.ErrUnexpectedEOF) || len(got) != 0 || f.cons() != 0 {
				t.Fatalf("%q, %v, consumer at %d; want io.ErrUnexpectedEOF and nothing consumed", got, err, f.cons())
			}
		})
	}
}

// FuzzRingDrain: whatever the records' headers say, drain hands out only bytes the producer position
// covers, never past them, and consumes only what it handed out or skipped.
func FuzzRingDrain(f *testing.F) {
	f.Add([]byte{3, 0, 0, 0, 0, 0, 0, 0, 'o', 'n', 'e'}, uint16(16), uint16(0))
	f.Add([]byte{0xff, 0xff, 0xff, 0x3f}, uint16(16), uint16(4090))
	f.Add([]byte{8, 0, 0, 0x40, 0, 0, 0, 0}, uint16(4), uint16(7))
	f.Fuzz(func(t *testing.T, ring []byte, filled, start uint16) {
		page := os.Getpagesize()
		fr := newFakeRing(page)
		for i := range fr.data {
			if len(ring) > 0 {
				fr.data[i] = ring[i%page%len(ring)]
			}
		}
		// No busy bit (drain waits for such a record to be committed), and positions 8-aligned as the
		// kernel's are.
		for off := 0; off+4 <= len(fr.data); off += 8 {
			fr.data[off+3] &^= 0x80
		}
		cons := uint64(start) &^ 7
		binary.NativeEndian.PutUint64(fr.ringReader.cons, cons)
		binary.NativeEndian.PutUint64(fr.ringReader.prod, cons+uint64(filled)%uint64(page+1))
		fr.life.RLock()
		defer fr.life.RUnlock()
		taken := uint64(0)
		_, _ = fr.drain(0x7fffffff, func(raw []byte) error {
			taken += uint64(len(raw))
			return nil
		})
		if fr.cons() < cons || fr.cons()-cons > uint64(filled)%uint64(page+1) {
			t.Fatalf("consumer moved from %d to %d, past the producer", cons, fr.cons())
		}
		if taken > fr.cons()-cons {
			t.Fatalf("handed out %d bytes, consumed %d", taken, fr.cons()-cons)
		}
	})
}
