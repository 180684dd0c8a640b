//go:build linux

package ebpfprobes

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/tickgrid"
)

// Ring buffer record header bits (linux/bpf.h: BPF_RINGBUF_BUSY_BIT,
// BPF_RINGBUF_DISCARD_BIT, BPF_RINGBUF_HDR_SZ).
const (
	ringBusyBit    = 1 << 31
	ringDiscardBit = 1 << 30
	ringHdrLen     = 8
)

// Consumer polling: how long a consumer that found records sleeps before it
// looks again without being woken, and how long an idle one sleeps at most
// (a safety net for the race between clearing consumer_polling and a record
// submitted without a wakeup just before).
const (
	pollInterval = time.Millisecond
	idleTimeout  = 100 * time.Millisecond
)

// checkRingSize validates a ring buffer size for the program name (0 means
// DefaultRingBufferSize) and returns the size to use.
func checkRingSize(name string, size int) (int, error) {
	if size == 0 {
		size = DefaultRingBufferSize
	}
	page := os.Getpagesize()
	if size < page || size&(size-1) != 0 || size > 1<<31 {
		return 0, fmt.Errorf("%s: ring buffer size %d: must be a power of two between the page size (%d) and 2 GiB, for example %d",
			name, size, page, DefaultRingBufferSize)
	}
	return size, nil
}

// ringReader consumes a BPF ring buffer in place. It maps the ring like
// cilium/ebpf's ringbuf.Reader does, but hands out records as slices of the
// mapping instead of copying them out: the consumer copies each payload once,
// straight into the log. Only one goroutine may read; Flush and Close may be
// called from any goroutine.
type ringReader struct {
	// life guards the mapping: the reader and pending hold it for reading
	// (the reader also while it waits), close takes it for writing to unmap.
	life   sync.RWMutex
	closed atomic.Bool
	epfd   int
	// ep is epfd in the Go runtime's poller: a wait parks the goroutine instead of holding a thread in
	// epoll_wait. A thread blocked in a system call for more than 10 ms has its P taken back by the
	// runtime's sysmon, which then polls at 20 us intervals for a while: three readers waiting 100 ms at a
	// time kept each agent's sysmon awake thousands of times a second (with the other wakeups, 45% of the
	// agents' CPU samples during the compare benchmark). nil if the runtime cannot poll it: wait then blocks.
	ep     *os.File
	epc    syscall.RawConn
	evfd   int // eventfd: Flush and Close write it to interrupt a wait
	cons   []byte
	prod   []byte
	data   []byte // the ring, mapped twice in a row so a record never wraps
	mask   uint64
	events []unix.EpollEvent

	name      string // the program's name, prefixed to errors
	errClosed error  // what reading returns after close
}

func newRingReader(name string, mapFD, size int) (*ringReader, error) {
	page := os.Getpagesize()
	cons, err := unix.Mmap(mapFD, 0, page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap ring buffer consumer page: %w", err)
	}
	prod, err := unix.Mmap(mapFD, int64(page), page+2*size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		_ = unix.Munmap(cons)
		return nil, fmt.Errorf("mmap ring buffer data pages: %w", err)
	}
	r := &ringReader{name: name, errClosed: fmt.Errorf("%s: read: %w", name, ErrClosed),
		epfd: -1, evfd: -1, cons: cons, prod: prod, data: prod[page:], mask: uint64(size - 1),
		events: make([]unix.EpollEvent, 2)}
	fail := func(err error) (*ringReader, error) {
		r.release()
		return nil, err
	}
	if r.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return fail(fmt.Errorf("epoll_create: %w", err))
	}
	if r.evfd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		return fail(fmt.Errorf("eventfd: %w", err))
	}
	for _, fd := range []int{mapFD, r.evfd} {
		if err := unix.EpollCtl(r.epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			return fail(fmt.Errorf("epoll_ctl add fd %d: %w", fd, err))
		}
	}
	if err := unix.SetNonblock(r.epfd, true); err != nil {
		return fail(fmt.Errorf("epoll fd non-blocking: %w", err))
	}
	// The file owns epfd from here on (release closes it through the file).
	r.ep = os.NewFile(uintptr(r.epfd), name+" ring buffer epoll")
	if err := r.ep.SetReadDeadline(time.Time{}); err != nil {
		// Not in the runtime's poller (os.ErrNoDeadline): wait blocks in epoll_wait, as before.
		if err := unix.SetNonblock(r.epfd, false); err != nil {
			return fail(fmt.Errorf("epoll fd blocking: %w", err))
		}
		return r, nil
	}
	if r.epc, err = r.ep.SyscallConn(); err != nil {
		return fail(fmt.Errorf("epoll fd raw conn: %w", err))
	}
	return r, nil
}

func (r *ringReader) consPos() *uint64 { return (*uint64)(unsafe.Pointer(&r.cons[0])) }
func (r *ringReader) prodPos() *uint64 { return (*uint64)(unsafe.Pointer(&r.prod[0])) }

// pending returns the bytes of records (and their headers) not yet consumed.
func (r *ringReader) pending() int {
	r.life.RLock()
	defer r.life.RUnlock()
	if r.closed.Load() {
		return 0
	}
	return int(r.filled())
}

// drain calls fn with each committed record in order, at most max of them,
// and gives each record's space back to the kernel when fn returns nil. If fn
// fails, the record stays in the ring and drain returns the error. The caller
// holds r.life for reading.
//
// It takes only the records reserved before it began: a batch ends even while
// the producers keep the ring busy, so that a consumer with work besides the
// ring gets to it (one that read on while records kept coming never did, under
// load: ci277's park was never serviced).
func (r *ringReader) drain(max int, fn func(raw []byte) error) (int, error) {
	consp, prodp := r.consPos(), r.prodPos()
	cons := atomic.LoadUint64(consp)
	prod := atomic.LoadUint64(prodp)
	n := 0
	for n < max && cons != prod {
		if prod-cons < ringHdrLen {
			return n, fmt.Errorf("%s: read ring buffer record header: %w", r.name, io.ErrUnexpectedEOF)
		}
		hdr := atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.data[cons&r.mask])))
		if hdr&ringBusyBit != 0 {
			// Reserved and being filled on another CPU: the copy of one
			// segment takes microseconds, and records are consumed in order.
			runtime.Gosched()
			continue
		}
		size := uint64(hdr &^ (ringBusyBit | ringDiscardBit))
		start := (cons + ringHdrLen) & r.mask
		next := cons + ringHdrLen + (size+7)&^7
		if next-cons > prod-cons {
			return n, fmt.Errorf("%s: read ring buffer record of %d bytes: %w", r.name, size, io.ErrUnexpectedEOF)
		}
		if hdr&ringDiscardBit == 0 {
			if err := fn(r.data[start : start+size : start+size]); err != nil {
				return n, err
			}
			n++
		}
		cons = next
		atomic.StoreUint64(consp, cons)
	}
	return n, nil
}

// errFree stops drainUntilFree's drain.
var errFree = errors.New("enough of the ring is free")

// drainUntilFree is drain for as long as fewer than free bytes of the ring are free (all of its records
// while it is smaller). It never blocks.
func (r *ringReader) drainUntilFree(free uint64, fn func(raw []byte) error) (int, error) {
	r.life.RLock()
	defer r.life.RUnlock()
	if r.closed.Load() {
		return 0, r.errClosed
	}
	size := r.mask + 1
	n, err := r.drain(int(^uint(0)>>1), func(raw []byte) error {
		if size-r.filled() >= free {
			return errFree
		}
		return fn(raw)
	})
	if errors.Is(err, errFree) {
		err = nil
	}
	return n, err
}

// filled returns the bytes of records (and their headers) not yet consumed. The caller holds r.life for
// reading (pending takes it).
func (r *ringReader) filled() uint64 {
	return atomic.LoadUint64(r.prodPos()) - atomic.LoadUint64(r.consPos())
}

// empty reports whether every committed record was consumed. The caller holds r.life for reading.
func (r *ringReader) empty() bool {
	return atomic.LoadUint64(r.prodPos()) == atomic.LoadUint64(r.consPos())
}

// wait sleeps until the kernel wakes the ring, Flush or Close is called, or
// timeout passes. It reports whether it was flushed. The caller holds r.life for reading.
func (r *ringReader) wait(timeout time.Duration) (flushed bool, err error) {
	var n int
	if r.epc == nil {
		n, err = unix.EpollWait(r.epfd, r.events, int(timeout.Milliseconds()))
	} else {
		n, err = r.pollWait(timeout)
	}
	if err != nil && !errors.Is(err, unix.EINTR) {
		return false, fmt.Errorf("%s: wait for ring buffer: %w", r.name, err)
	}
	for _, ev := range r.events[:max(n, 0)] {
		if int(ev.Fd) == r.evfd {
			var buf [8]byte
			_, _ = unix.Read(r.evfd, buf[:]) // reset the counter; EAGAIN if raced with another read
			flushed = true
		}
	}
	return flushed, nil
}

// pollWait is wait's epoll_wait through the runtime's poller: it looks without blocking and, if nothing
// is ready, parks until the epoll fd turns readable or timeout passes (0 events, no error).
func (r *ringReader) pollWait(timeout time.Duration) (n int, err error) {
	if err := r.ep.SetReadDeadline(time.Now().Add(timeout)); err != nil {
		return 0, err
	}
	rerr := r.epc.Read(func(fd uintptr) bool {
		n, err = unix.EpollWait(int(fd), r.events, 0)
		return n > 0 || (err != nil && !errors.Is(err, unix.EINTR))
	})
	if errors.Is(rerr, os.ErrDeadlineExceeded) {
		return 0, nil
	}
	if err == nil {
		err = rerr
	}
	return n, err
}

// flush interrupts a wait. It holds life so that it never writes to the
// eventfd's number after close released it.
func (r *ringReader) flush() error {
	r.life.RLock()
	defer r.life.RUnlock()
	if r.closed.Load() {
		return r.errClosed
	}
	one := [8]byte{1}
	if _, err := unix.Write(r.evfd, one[:]); err != nil && !errors.Is(err, unix.EAGAIN) {
		return fmt.Errorf("%s: flush ring buffer reader: %w", r.name, err)
	}
	return nil
}

// close interrupts a wait, waits for the reader to let go of the mapping and
// frees it.
func (r *ringReader) close() error {
	if r.closed.Swap(true) {
		return nil
	}
	one := [8]byte{1}
	_, _ = unix.Write(r.evfd, one[:])
	r.life.Lock()
	defer r.life.Unlock()
	return r.release()
}

func (r *ringReader) release() error {
	var errs []error
	if r.ep != nil {
		if err := r.ep.Close(); err != nil {
			errs = append(errs, err)
		}
		r.ep, r.epc, r.epfd = nil, nil, -1
	}
	for _, fd := range []int{r.epfd, r.evfd} {
		if fd >= 0 {
			if err := unix.Close(fd); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, m := range [][]byte{r.prod, r.cons} {
		if m != nil {
			if err := unix.Munmap(m); err != nil {
				errs = append(errs, err)
			}
		}
	}
	r.epfd, r.evfd, r.prod, r.cons, r.data = -1, -1, nil, nil, nil
	if len(errs) > 0 {
		return fmt.Errorf("%s: free ring buffer reader: %w", r.name, errors.Join(errs...))
	}
	return nil
}

// ringConsumer is the reading side of a program's ring buffer with the
// consumer_polling wakeup scheme of bpf/tcplog.c, shared by TCPLogger and
// RecvTap. Only one goroutine reads.
type ringConsumer struct {
	log  *slog.Logger
	ring *ringReader
	flag *ebpf.Variable // the program's consumer_polling, in its mmapped .bss
	poll time.Duration  // how long it sleeps between looks while it polls; 0: pollInterval

	// The reader's state: only the reading goroutine touches these.
	polling     bool // mirror of flag
	watchedDone <-chan struct{}
	stopWatch   func() bool
}

// readBatch implements TCPLogger.ReadBatch and RecvTap.ReadBatch (see
// TCPLogger.ReadBatch for the contract).
func (c *ringConsumer) readBatch(ctx context.Context, max int, fn func(raw []byte) error) (int, error) {
	if max <= 0 {
		max = int(^uint(0) >> 1)
	}
	if ctx.Err() == nil {
		c.watch(ctx)
	}
	r := c.ring
	r.life.RLock()
	defer r.life.RUnlock()
	quiet := false // the last poll found nothing
	for {
		if r.closed.Load() {
			return 0, r.errClosed
		}
		n, err := r.drain(max, fn)
		if n > 0 || err != nil {
			c.setPolling(true)
			return n, err
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		timeout := pollInterval
		if c.poll > 0 {
			timeout = c.poll
		}
		if !c.polling || quiet {
			// Idle: ask the program for a wakeup again, then look once
			// more, since a record submitted before the flag was cleared
			// may not have woken us.
			c.setPolling(false)
			if !r.empty() {
				continue
			}
			timeout = idleTimeout
		}
		// On the grid of the interval: the agent's other loops, on multiples of theirs, wake it then too.
		flushed, err := r.wait(tickgrid.Until(time.Now(), timeout))
		if err != nil {
			return 0, err
		}
		quiet = !flushed && r.empty()
	}
}

// setPolling tells the program whether the consumer polls by itself.
func (c *ringConsumer) setPolling(on bool) {
	if on == c.polling {
		return
	}
	c.polling = on
	if err := setFlag(c.flag, on); err != nil {
		c.log.Warn(c.ring.name+": set consumer_polling", "err", err)
	}
}

// setFlag sets a program's uint32 flag to 1 (on) or 0. It cannot fail for a variable in a loaded .bss;
// without mmap support it is a map update, which also works.
func setFlag(v *ebpf.Variable, on bool) error {
	var x uint32
	if on {
		x = 1
	}
	return v.Set(x)
}

// watch makes the cancellation of ctx interrupt a blocked readBatch. One
// registration serves every call with the same context.
func (c *ringConsumer) watch(ctx context.Context) {
	done := ctx.Done()
	if done == nil || done == c.watchedDone {
		return
	}
	if c.stopWatch != nil {
		c.stopWatch()
	}
	r := c.ring
	c.watchedDone = done
	c.stopWatch = context.AfterFunc(ctx, func() { _ = r.flush() })
}
