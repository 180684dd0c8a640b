//go:build linux

// Package capture runs the sender-side TCP log of one node: it loads the eBPF
// TCX egress logger (ebpfprobes), attaches it to one interface, and feeds every
// record from the ring buffer into a netlog.Log with one consumer goroutine.
// It is the glue the agent runs; the log itself (ranges, trimming, ageing)
// is netlog's.
package capture

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/internal/sockdiag"
	"github.com/ftkit/ftkit/internal/threadcpu"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/park"
	"github.com/ftkit/ftkit/tcpflow"
)

// Options configure New.
type Options struct {
	// Interface is the name of the egress interface to log (e.g. "eth0"),
	// resolved in the calling thread's network namespace.
	Interface string
	// RingBufferSize is the BPF ring buffer size in bytes, a power of two
	// (see ebpfprobes.TCPLoggerOptions); 0 means ebpfprobes.DefaultRingBufferSize.
	RingBufferSize int
	// Log configures the netlog.Log the records go to. A nil Log.Logger
	// becomes Logger.
	Log netlog.Options
	// Logger receives attach/detach events and consumer errors; nil discards them.
	Logger *slog.Logger
	// PollInterval is how long the consumer sleeps between two drains of the ring while segments keep
	// coming (ebpfprobes.TCPLoggerOptions); 0 means DefaultPollInterval.
	PollInterval time.Duration
	// MaxFlows is how many protected flows keep a live state at once (ebpfprobes.TCPLoggerOptions); 0
	// means ebpfprobes.DefaultMaxFlows.
	MaxFlows int
	// MemoryCap, if positive, bounds the log's memory (netlog.Stats.MemoryBytes): the consumer stops
	// draining the ring rather than let one more append exceed it (TCP backpressure, never loss).
	MemoryCap int64
	// Park, if set, parks segments in the kernel instead of copying them into the ring (ParkOptions).
	Park *ParkOptions

	// afterRecord, when set, runs after each record is appended: tests use it
	// to slow the consumer down and provoke backpressure drops.
	afterRecord func()
}

// DefaultPollInterval is the capture's: the log is read for a replay or a trim, never byte by byte as it
// is written, so its consumer need not look every millisecond. On slow links the wakeups cost it most per
// byte (bench netlog, tbf_1gbit_consumer_thread_cpu_s_per_GB_logged: 0.12 s/GB at 10 ms, 0.09 at 25 ms);
// at high rates the program wakes it sooner (an eighth of the ring waiting), and a caller that needs the
// ring's bytes now wakes it (Wake, Urge). A multiple of the receive-order recorder's default interval
// (20 ms), on the same grid: an agent wakes once for both.
const DefaultPollInterval = 40 * time.Millisecond

// Capture is a running logger: probe attached, consumer goroutine running.
// All methods are safe for concurrent use.
type Capture struct {
	log     *slog.Logger
	iface   string
	ring    int
	probe   *ebpfprobes.TCPLogger
	netlog  *netlog.Log
	cancel  context.CancelFunc
	done    chan struct{} // closed when the consumer returns
	consErr error         // the consumer's fatal error, readable after done

	poll         time.Duration // Options.PollInterval
	park         *parked       // nil without Options.Park
	parkWant     atomic.Uint64 // bucketMask: callers wait for the bytes of these buckets' parked clones (Want)
	parkRounds   atomic.Uint64 // rounds of the consumer that took the clones of the buckets wanted (TakeParked)
	memCap       int64         // Options.MemoryCap
	headroom     int64         // the most one append can add to the log's memory
	paused       atomic.Bool   // the consumer is waiting for memory under the cap
	urgent       atomic.Int32  // callers waiting for bytes still in the ring (Urge): the cap gives way by the ring's size
	consumerCPU  atomic.Int64  // CPU time of the consumer's thread, ns (Counters.ConsumerCPU)
	records      atomic.Uint64 // records consumed
	badRecords   atomic.Uint64 // records DecodeRecord rejected
	appendErrors atomic.Uint64 // Append errors other than conflicts (conflicts are in netlog.Stats)

	mu         sync.Mutex
	protected  map[string]uint64  // cleaned cgroup directory -> cgroup id
	readCancel context.CancelFunc // ends the consumer's wait for records, which has a park to service
	closed     bool
}

// New loads the probe, attaches it to the egress of opts.Interface and starts
// the consumer. Both the interface lookup and the TCX attachment happen in the
// calling thread's network namespace, so New must be called from inside the
// namespace whose traffic is to be logged: the agent runs in its host's
// namespace; tests call New inside lab.Lab.Do. Nothing is logged until
// ProtectCgroup. Close releases everything.
func New(opts Options) (*Capture, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opts.Interface == "" {
		return nil, errors.New("capture: no interface given: set Options.Interface (e.g. \"eth0\")")
	}
	lk, err := netlink.LinkByName(opts.Interface)
	if err != nil {
		return nil, fmt.Errorf("capture: find interface %q in this thread's network namespace (call New from inside the node's namespace): %w", opts.Interface, err)
	}
	lopts := opts.Log
	if lopts.Logger == nil {
		lopts.Logger = log
	}
	nl, err := netlog.NewLog(lopts)
	if err != nil {
		return nil, fmt.Errorf("capture: %w", err)
	}
	poll := opts.PollInterval
	if poll <= 0 {
		poll = DefaultPollInterval
	}
	popts := ebpfprobes.TCPLoggerOptions{RingBufferSize: opts.RingBufferSize, PollInterval: poll, MaxFlows: opts.MaxFlows, Logger: log}
	var pk *park.Park
	var parkOpts ParkOptions
	var buckets int
	if opts.Park != nil {
		parkOpts = opts.Park.withDefaults()
		if pk, buckets, err = openPark(parkOpts); err != nil {
			nl.Close()
			return nil, err
		}
		popts.Park = ebpfprobes.ParkOptions{Ifindex: pk.Ifindex(), Queues: pk.Queues(), Buckets: buckets, MinLen: parkOpts.MinLen, MaxLen: parkOpts.MaxLen}
	}
	probe, err := ebpfprobes.NewTCPLogger(popts)
	if err == nil && pk != nil {
		err = probe.SetParkCap(uint64(parkOpts.Cap))
	}
	if err == nil {
		err = probe.Attach(lk.Attrs().Index)
	}
	if err != nil {
		if probe != nil {
			probe.Close()
		}
		if pk != nil {
			pk.Close()
		}
		nl.Close()
		return nil, fmt.Errorf("capture: %w", err)
	}
	ring := opts.RingBufferSize
	if ring == 0 {
		ring = ebpfprobes.DefaultRingBufferSize
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &Capture{
		log:       log.With("iface", opts.Interface),
		iface:     opts.Interface,
		ring:      ring,
		probe:     probe,
		netlog:    nl,
		cancel:    cancel,
		done:      make(chan struct{}),
		protected: make(map[string]uint64),
		memCap:    opts.MemoryCap,
		poll:      poll,
	}
	if pk != nil {
		c.park = newParked(c.log, pk, buckets, probe, parkOpts)
	}
	// One append of a record of up to 64 KiB can open at most two new slabs (and use a pooled one).
	slab := int64(opts.Log.SlabSize)
	if slab == 0 {
		slab = netlog.DefaultSlabSize
	}
	c.headroom = 2*slab + 64<<10
	if c.memCap > 0 && c.memCap < 2*c.headroom {
		cancel()
		probe.Close()
		if pk != nil {
			pk.Close()
		}
		nl.Close()
		return nil, fmt.Errorf("capture: memory cap %d bytes is below twice one append's worst case (%d): raise it", c.memCap, c.headroom)
	}
	go c.consume(ctx, opts.afterRecord)
	return c, nil
}

// errAtCap stops a batch at the memory cap, leaving the record in the ring.
var errAtCap = errors.New("capture: log at its memory cap")

// consume moves records from the ring buffer into the log until ctx is
// cancelled or reading fails. Each payload is copied once, from its place in
// the ring straight into the log's slab (ReadBatch hands out the ring's
// memory, DecodeRecord aliases it, Append copies).
func (c *Capture) consume(ctx context.Context, afterRecord func()) {
	defer close(c.done)
	// A thread of its own, so that what logging costs in user space is its thread's CPU time, read after
	// every wait (CLOCK_THREAD_CPUTIME_ID, a fraction of a microsecond).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	clock := threadcpu.Start()
	account := func() { c.consumerCPU.Store(int64(clock.Used())) }
	defer account()
	a := appender{log: c.netlog}
	atCap := func() bool {
		if c.memCap <= 0 {
			return false
		}
		limit := c.memCap
		if c.urgent.Load() > 0 {
			limit += int64(c.ring)
		}
		// Pooled slab buffers are reused before the log allocates anything: only live data counts.
		return c.netlog.Stats().LiveBytes()+c.headroom > limit
	}
	// logged classifies an error of the log: only a closed log stops the consumer.
	logged := func(err error) error {
		switch {
		case err == nil:
		case errors.Is(err, netlog.ErrClosed):
			return err
		case errors.Is(err, netlog.ErrConflict):
			// Counted in netlog.Stats.Conflicts; log a few.
			if n := c.netlog.Stats().Conflicts; isPow2(uint64(n)) {
				c.log.Warn("capture: segment conflicts with logged bytes, kept the first version", "err", err, "count", n)
			}
		default:
			if n := c.appendErrors.Add(1); isPow2(n) {
				c.log.Error("capture: append to log", "err", err, "count", n)
			}
		}
		return nil
	}
	take := func(raw []byte) error {
		c.records.Add(1)
		rec, err := netlog.DecodeRecord(raw)
		if err == nil && rec.Parked > 0 && c.park == nil {
			err = errors.New("a parked record, and no park")
		}
		if err != nil {
			if n := c.badRecords.Add(1); isPow2(n) {
				c.log.Error("capture: bad ring buffer record (probe and netlog disagree on the layout?)", "err", err, "count", n)
			}
			return nil
		}
		if rec.Parked > 0 {
			// Booked even if the log refuses the note: the clone is in its queue all the same.
			c.park.push(rec)
			return logged(a.noteParked(rec))
		}
		if err := logged(a.append(rec)); err != nil {
			return err
		}
		if afterRecord != nil {
			afterRecord()
		}
		return nil
	}
	handle := func(raw []byte) error {
		// At the memory cap: leave the records in the ring. Once it is full the probe drops segments and
		// TCP retransmits them later, so senders slow down, the cap holds, and nothing is lost.
		if atCap() {
			return errAtCap
		}
		return take(raw)
	}
	// stopped says whether the consumer must stop after err from the probe.
	stopped := func(err error) bool {
		switch {
		case err == nil, errors.Is(err, errAtCap):
			return false
		case ctx.Err() != nil, errors.Is(err, ebpfprobes.ErrClosed), errors.Is(err, netlog.ErrClosed):
		default:
			c.consErr = fmt.Errorf("capture: consumer stopped: %w", err)
			c.log.Error("capture: consumer stopped, nothing more is logged", "err", err)
		}
		return true
	}
	// servicePark frees the parked clones receivers' snapshots have trimmed and takes those the log must
	// hold now, while it has room (parked.service).
	servicePark := func() error {
		if c.park == nil {
			return nil
		}
		take := bucketMask(c.parkWant.Swap(0))
		err := c.park.service(c.netlog, func(rec netlog.Record) error { return logged(a.append(rec)) }, take, func() bool { return !atCap() })
		if take != 0 {
			c.parkRounds.Add(1)
		}
		return err
	}
	for {
		// Stop as soon as Close asks: the log is freed right after, so
		// draining what is left in the ring would be wasted work.
		if ctx.Err() != nil {
			return
		}
		account()
		if atCap() {
			c.paused.Store(true)
			// Even so, keep the ring's reserve free: the probe gives it to the flows it has held back
			// longest, one segment each every 2 s, or TCP would give up on them. And free the clones the
			// snapshots that will end the pause trim: the park goes on holding the jobs' segments.
			if _, err := c.probe.ReadPaused(take); stopped(err) {
				return
			}
			if err := servicePark(); stopped(err) {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(5 * time.Millisecond):
			}
			continue
		}
		c.paused.Store(false)
		if _, err := c.readBatch(ctx, handle); stopped(err) {
			return
		}
		if err := servicePark(); stopped(err) {
			return
		}
	}
}

// readBatch is the probe's ReadBatch, which with a park also returns when Wake asks (Want does, and
// TakeParked waits for the consumer's rounds), and after the poll interval if a clone waits in the park
// (service frees clones as receivers' snapshots trim the log, records or not).
func (c *Capture) readBatch(ctx context.Context, fn func(raw []byte) error) (int, error) {
	if c.park == nil {
		return c.probe.ReadBatch(ctx, 0, fn)
	}
	var rctx context.Context
	var cancel context.CancelFunc
	if c.park.holding() {
		rctx, cancel = context.WithTimeout(ctx, c.poll)
	} else {
		rctx, cancel = context.WithCancel(ctx)
	}
	c.mu.Lock()
	c.readCancel = cancel
	c.mu.Unlock()
	n, err := c.probe.ReadBatch(rctx, 0, fn)
	c.mu.Lock()
	c.readCancel = nil
	c.mu.Unlock()
	cancel()
	if err != nil && ctx.Err() == nil && rctx.Err() != nil {
		err = nil
	}
	return n, err
}

// Urge lets the consumer drain the ring past the memory cap, by up to the ring's size, until the returned
// function is called. It is for a caller that waits for bytes still in the ring: a snapshot reading what
// its job sent before the dump, while the log sits at its cap. The log's memory is freed by the receivers'
// snapshots, and a receiver's snapshot may be that very one (its job sends too): without the extra room
// both would wait for each other until the caller's timeout.
func (c *Capture) Urge() (done func()) {
	c.urgent.Add(1)
	c.Wake()
	var once sync.Once
	return func() { once.Do(func() { c.urgent.Add(-1) }) }
}

// Wake makes the consumer look at the ring now instead of at its next poll (Options.PollInterval): for a
// caller waiting for bytes that may be in it. Bytes parked stay there: Want asks for them.
func (c *Capture) Wake() {
	if c.park != nil {
		c.mu.Lock()
		if c.readCancel != nil {
			c.readCancel()
		}
		c.mu.Unlock()
	}
	if err := c.probe.Wake(); err != nil && !errors.Is(err, ebpfprobes.ErrClosed) {
		c.log.Warn("capture: wake the consumer", "err", err)
	}
}

// Want wakes the consumer (Wake) and has its next round take into the log every clone parked in the
// queues that hold conn's (those of its destination's bucket): for a caller waiting for conn's bytes,
// as the poke of netlog.Log.WaitHolds. The clones of other destinations' buckets stay parked.
func (c *Capture) Want(conn tcpflow.Tuple) {
	if c.park != nil {
		c.parkWant.Or(uint64(c.park.maskOf(conn.Remote.Addr())))
	}
	c.Wake()
}

// TakeParked has the consumer take every clone parked so far in the queues that hold conn's into the
// log, and returns once it has (or ctx ends): once a round of the consumer that began after the call has
// taken every such clone it could (the log at its cap stops it; WaitHolds says whether the bytes are
// there). For a reader that needs conn's parked bytes now: a recovery's range read, the check of re-sent
// bytes. What it costs is the parked bytes of conn's bucket of destinations, not the whole park's.
// Without a park it returns at once.
func (c *Capture) TakeParked(ctx context.Context, conn tcpflow.Tuple) error {
	if c.park == nil {
		return nil
	}
	// The round under way when the call came may have begun before the records of the latest clones
	// were read from the ring, or before the call asked for conn's bucket: the one after it does both.
	want := c.parkRounds.Load() + 2
	for c.parkRounds.Load() < want {
		c.Want(conn)
		select {
		case <-ctx.Done():
			return fmt.Errorf("capture: take the parked clones into the log: %w", ctx.Err())
		case <-c.done:
			return errors.New("capture: take the parked clones into the log: the consumer stopped")
		case <-time.After(2 * time.Millisecond):
		}
	}
	return nil
}

// appender appends records to a log, remembering the store of the last
// connection: bulk traffic comes in long runs of one connection, and this
// skips the log's connection map and its lock for each of them.
type appender struct {
	log  *netlog.Log
	conn tcpflow.Tuple
	st   *netlog.Store
}

func (a *appender) append(rec netlog.Record) error {
	if len(rec.Payload) == 0 {
		return nil
	}
	if a.st != nil && rec.Conn == a.conn {
		err := a.st.AppendRecord(rec)
		if !errors.Is(err, netlog.ErrClosed) {
			if err != nil {
				return fmt.Errorf("netlog %v: %w", rec.Conn, err)
			}
			return nil
		}
		// Removed meanwhile: the log makes a fresh store (or is closed).
	}
	a.st = nil
	if err := a.log.Append(rec); err != nil {
		return err
	}
	if st, err := a.log.Store(rec.Conn); err == nil {
		a.conn, a.st = rec.Conn, st
	}
	return nil
}

// noteParked is append for a parked record (netlog.Store.NoteParked).
func (a *appender) noteParked(rec netlog.Record) error {
	if a.st != nil && rec.Conn == a.conn {
		if err := a.st.NoteParked(rec); !errors.Is(err, netlog.ErrClosed) {
			return err
		}
	}
	a.st = nil
	if err := a.log.NoteParked(rec); err != nil {
		return fmt.Errorf("netlog %v: %w", rec.Conn, err)
	}
	if st, err := a.log.Store(rec.Conn); err == nil {
		a.conn, a.st = rec.Conn, st
	}
	return nil
}

// FlowState is the live state of conn as its last egress segment showed it (the sender's snd_nxt, its
// rcv_nxt as the ACK number, TSval/TSecr): what a restorer needs about a peer. ok is false if no segment
// of conn was seen.
func (c *Capture) FlowState(conn tcpflow.Tuple) (ebpfprobes.FlowState, bool, error) {
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return ebpfprobes.FlowState{}, false, fmt.Errorf("capture: flow state: %w", netlog.ErrClosed)
	}
	return c.probe.FlowState(conn)
}

// LogsSocket reports whether the probe logs what conn's local socket sends: the socket's cgroup (the one
// the probe reads from each segment) is protected. It asks the socket itself (sock_diag, in the calling
// thread's network namespace), where FlowState answers from the probe's live state, which keeps the
// most recently active flows only (Options.MaxFlows): a protected flow that sent nothing while more than that many
// others did has none. A socket that does not exist is logged by no one.
func (c *Capture) LogsSocket(conn tcpflow.Tuple) (bool, error) {
	s, err := sockdiag.Lookup(conn)
	if errors.Is(err, sockdiag.ErrNoSocket) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("capture: whose socket %v is: %w", conn, err)
	}
	return s.CgroupID != 0 && c.Protects(s.CgroupID), nil
}

// isPow2 rate-limits repeated error logs to counts 1, 2, 4, 8, ...
func isPow2(n uint64) bool { return n != 0 && n&(n-1) == 0 }

// ParkCap is the park's cap in bytes, 0 without a park.
func (c *Capture) ParkCap() int64 {
	if c.park == nil {
		return 0
	}
	return c.park.cap
}

// Log returns the log the consumer appends to. It is freed by Close.
func (c *Capture) Log() *netlog.Log { return c.netlog }

// ProtectCgroup logs the TCP bytes sent by sockets created in the cgroup v2
// directory dir (not its descendants: each cgroup is protected on its own).
// A socket belongs to the cgroup its creator was in when it was created, so
// protect the cgroup before the job starts (clone it into the cgroup).
func (c *Capture) ProtectCgroup(dir string) error {
	dir = filepath.Clean(dir)
	id, err := cgroupv2.ID(dir)
	if err != nil {
		return fmt.Errorf("capture: protect: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("capture: protect %s: %w", dir, netlog.ErrClosed)
	}
	return c.protectID(c.probe, dir, id)
}

// cgroupProbe is what protecting a cgroup takes of the probe (ebpfprobes.TCPLogger; a fake in tests).
type cgroupProbe interface {
	Protect(cgroupID uint64) error
	Unprotect(cgroupID uint64) error
}

// protectID protects cgroup id, the one at dir now. c.mu is held.
func (c *Capture) protectID(p cgroupProbe, dir string, id uint64) error {
	if err := p.Protect(id); err != nil {
		return fmt.Errorf("capture: protect %s: %w", dir, err)
	}
	// A directory protected before under another id was removed and made again: its old cgroup is gone
	// as if UnprotectCgroup had been called, which would now find only the new id. Left in the probe's
	// map, the old id took one of its entries for good.
	if old, ok := c.protected[dir]; ok && old != id {
		if err := p.Unprotect(old); err != nil {
			c.log.Error("capture: the removed cgroup's id stays in the probe's map: its sockets are still logged", "cgroup", dir, "id", old, "err", err)
		}
	}
	c.protected[dir] = id
	c.log.Info("capture: protecting cgroup", "cgroup", dir, "id", id)
	return nil
}

// UnprotectCgroup stops logging dir. It works after the directory was
// removed if it was protected through this Capture; unprotecting a cgroup
// that is not protected is not an error. Bytes already logged stay in the log.
func (c *Capture) UnprotectCgroup(dir string) error {
	dir = filepath.Clean(dir)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("capture: unprotect %s: %w", dir, netlog.ErrClosed)
	}
	id, ok := c.protected[dir]
	if !ok {
		var err error
		if id, err = cgroupv2.ID(dir); err != nil {
			return fmt.Errorf("capture: unprotect: %w", err)
		}
	}
	if err := c.probe.Unprotect(id); err != nil {
		return fmt.Errorf("capture: unprotect %s: %w", dir, err)
	}
	delete(c.protected, dir)
	c.log.Info("capture: unprotected cgroup", "cgroup", dir, "id", id)
	return nil
}

// ProtectFlow logs the bytes of one flow (Local the local sender), whatever its socket's cgroup: for a
// capture that logs only chosen flows (on loopback, the re-sent bytes of a job restored next to its peer).
func (c *Capture) ProtectFlow(f tcpflow.Tuple) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("capture: protect flow %v: %w", f, netlog.ErrClosed)
	}
	return c.probe.ProtectFlow(f)
}

// UnprotectFlow stops logging a flow ProtectFlow protected and drops what the log holds of it.
func (c *Capture) UnprotectFlow(f tcpflow.Tuple) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("capture: unprotect flow %v: %w", f, netlog.ErrClosed)
	}
	err := c.probe.UnprotectFlow(f)
	if rerr := c.netlog.Remove(f); rerr != nil && !errors.Is(rerr, netlog.ErrUnknownConn) {
		err = errors.Join(err, rerr)
	}
	return err
}

// Protects reports whether cgroup id is protected now. A connection whose records came from a
// cgroup that no longer is belongs to a job that ended (the agent unprotects a job's cgroup when
// it ends).
func (c *Capture) Protects(id uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.protected {
		if p == id {
			return true
		}
	}
	return false
}

// Counters is the state of a Capture for `ftctl status`: the probe's
// counters, the consumer's and the log's accounting.
type Counters struct {
	Interface        string `json:"interface"`
	RingBufferBytes  int    `json:"ring_buffer_bytes"`
	RingPendingBytes int    `json:"ring_pending_bytes"` // records waiting for the consumer
	ProtectedCgroups int    `json:"protected_cgroups"`

	// Probe (in-kernel) counters, summed over CPUs.
	PacketsLogged     uint64 `json:"packets_logged"`
	BytesLogged       uint64 `json:"bytes_logged"`       // payload bytes written to the ring, retransmissions included
	DropsBackpressure uint64 `json:"drops_backpressure"` // segments dropped (and later retransmitted by TCP) because the ring was full
	DropsOversize     uint64 `json:"drops_oversize"`
	DropsError        uint64 `json:"drops_error"`
	SeqRegressions    uint64 `json:"seq_regressions"`  // retransmissions seen, approximate
	FragmentsPassed   uint64 `json:"fragments_passed"` // IP fragments passed unlogged: a hole, must stay 0
	LoggedPassed      uint64 `json:"logged_passed"`    // segments passed unlogged while the ring was full: all their bytes had a record
	Kicks             uint64 `json:"kicks"`            // sockets pushed after a backpressure drop instead of waiting for TCP's timers
	ReserveLogged     uint64 `json:"reserve_logged"`   // segments of flows held back 2 s or more, let through the ring's reserve while paused
	UnloggedPassed    uint64 `json:"unlogged_passed"`  // segments passed unlogged while the consumer was gone (a stopped or hung agent): a hole
	PacketsParked     uint64 `json:"packets_parked"`   // segments cloned into the park (Options.Park), not copied
	BytesParked       uint64 `json:"bytes_parked"`
	ParkFailed        uint64 `json:"park_failed"` // segments the park refused (a queue full): copied into the ring
	ParkFull          uint64 `json:"park_full"`   // segments copied into the ring because the park held its cap

	// The park's book (Options.Park).
	ParkWaitingBytes int64  `json:"park_waiting_bytes"` // payload bytes waiting in clones
	ParkFreedBytes   uint64 `json:"park_freed_bytes"`   // freed unread: trimmed while parked, never copied
	ParkTakenBytes   uint64 `json:"park_taken_bytes"`   // read into the log (a replay waited, or the park was full)
	ParkLost         uint64 `json:"park_lost"`          // clones missing or not the one expected: a hole, must stay 0
	ParkStrays       uint64 `json:"park_strays"`        // frames in the park no record names (something else sent them), skipped

	// Consumer.
	RecordsConsumed uint64 `json:"records_consumed"`
	BadRecords      uint64 `json:"bad_records"`
	AppendErrors    uint64 `json:"append_errors"`
	ConsumerRunning bool   `json:"consumer_running"`
	ConsumerPaused  bool   `json:"consumer_paused"`
	ConsumerError   string `json:"consumer_error,omitempty"`
	// ConsumerCPU is the CPU time the consumer's thread has used: the user-space cost of logging (the
	// in-kernel copy into the ring runs in the senders' context).
	ConsumerCPU time.Duration `json:"consumer_cpu_ns"`

	// Log (netlog.Stats).
	Conns              int   `json:"conns"`
	RetainedBytes      int64 `json:"retained_bytes"`
	MemoryBytes        int64 `json:"memory_bytes"` // RAM + pooled + compressed: compare with a memory cap
	RAMBytes           int64 `json:"ram_bytes"`
	PooledBytes        int64 `json:"pooled_bytes"`
	CompressedBytes    int64 `json:"compressed_bytes"`
	CompressedRawBytes int64 `json:"compressed_raw_bytes"`
	SpilledBytes       int64 `json:"spilled_bytes"`
	SpilledRawBytes    int64 `json:"spilled_raw_bytes"`
	AppendedBytes      int64 `json:"appended_bytes"`
	DuplicateBytes     int64 `json:"duplicate_bytes"` // retransmitted bytes verified equal to the log
	BelowFloorBytes    int64 `json:"below_floor_bytes"`
	Conflicts          int64 `json:"conflicts"`
}

// Counters returns the current counters. The probe's, the consumer's and the
// log's numbers are read one after the other while traffic flows, so they
// may be mutually off by the records in flight.
func (c *Capture) Counters() (Counters, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return Counters{}, fmt.Errorf("capture: counters: %w", netlog.ErrClosed)
	}
	pc, err := c.probe.Counters()
	if err != nil {
		return Counters{}, fmt.Errorf("capture: %w", err)
	}
	ls := c.netlog.Stats()
	out := Counters{
		Interface:          c.iface,
		RingBufferBytes:    c.ring,
		RingPendingBytes:   c.probe.Pending(),
		ProtectedCgroups:   len(c.protected),
		PacketsLogged:      pc.PacketsLogged,
		BytesLogged:        pc.BytesLogged,
		DropsBackpressure:  pc.DropsBackpressure,
		DropsOversize:      pc.DropsOversize,
		DropsError:         pc.DropsError,
		SeqRegressions:     pc.SeqRegressions,
		LoggedPassed:       pc.LoggedPassed,
		Kicks:              pc.Kicks,
		ReserveLogged:      pc.ReserveLogged,
		UnloggedPassed:     pc.UnloggedPassed,
		FragmentsPassed:    pc.FragmentsPassed,
		PacketsParked:      pc.PacketsParked,
		BytesParked:        pc.BytesParked,
		ParkFailed:         pc.ParkFailed,
		ParkFull:           pc.ParkFull,
		RecordsConsumed:    c.records.Load(),
		BadRecords:         c.badRecords.Load(),
		AppendErrors:       c.appendErrors.Load(),
		ConsumerCPU:        time.Duration(c.consumerCPU.Load()),
		Conns:              ls.Conns,
		RetainedBytes:      ls.RetainedBytes,
		MemoryBytes:        ls.MemoryBytes(),
		RAMBytes:           ls.RAMBytes,
		PooledBytes:        ls.PooledBytes,
		CompressedBytes:    ls.CompressedBytes,
		CompressedRawBytes: ls.CompressedRawBytes,
		SpilledBytes:       ls.SpilledBytes,
		SpilledRawBytes:    ls.SpilledRawBytes,
		AppendedBytes:      ls.AppendedBytes,
		DuplicateBytes:     ls.DuplicateBytes,
		BelowFloorBytes:    ls.BelowFloorBytes,
		Conflicts:          ls.Conflicts,
	}
	select {
	case <-c.done:
		if c.consErr != nil {
			out.ConsumerError = c.consErr.Error()
		}
	default:
		out.ConsumerRunning = true
	}
	out.ConsumerPaused = c.paused.Load()
	if c.park != nil {
		out.ParkWaitingBytes = c.park.waiting.Load()
		out.ParkFreedBytes = c.park.freed.Load()
		out.ParkTakenBytes = c.park.taken.Load()
		out.ParkLost = c.park.lost.Load()
		out.ParkStrays = c.park.strays.Load()
	}
	return out, nil
}

// Close stops the consumer (cancelling its context flushes the ring reader,
// so a blocked read returns), then detaches the probe, frees its maps and
// frees the log. It returns the consumer's error, if it had stopped on one.
// Calling Close again does nothing.
func (c *Capture) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()

	c.cancel()
	<-c.done
	var errs []error
	if c.consErr != nil {
		errs = append(errs, c.consErr)
	}
	if err := c.probe.Close(); err != nil {
		errs = append(errs, fmt.Errorf("capture: %w", err))
	}
	if c.park != nil {
		if err := c.park.close(); err != nil {
			errs = append(errs, fmt.Errorf("capture: %w", err))
		}
	}
	if err := c.netlog.Close(); err != nil {
		errs = append(errs, fmt.Errorf("capture: %w", err))
	}
	c.log.Info("capture: closed")
	return errors.Join(errs...)
}
