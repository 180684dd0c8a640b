//go:build linux

package ebpfprobes

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/netlog/park"
	"github.com/ftkit/ftkit/tcpflow"
)

// RecordHeaderLen is the size of the fixed header of a ring buffer record:
// saddr u32, daddr u32, sport u16, dport u16 (addresses and ports in network
// byte order), seq u32, len u32, cgroup_id u64, ktime_ns u64, all packed and
// little-endian, followed by len payload bytes. netlog.DecodeRecord decodes it.
const RecordHeaderLen = 36

// DefaultRingBufferSize is used when TCPLoggerOptions.RingBufferSize is 0.
const DefaultRingBufferSize = 64 << 20

// ErrClosed is returned by Read after Close.
var ErrClosed = os.ErrClosed

// TCPLoggerOptions configure NewTCPLogger.
type TCPLoggerOptions struct {
	// RingBufferSize in bytes: a power of two and a multiple of the page
	// size (the kernel's rules for BPF ring buffers). It bounds how far the
	// reader may fall behind before segments are dropped for backpressure,
	// and it must hold the largest segment plus 44 bytes: 64 KiB covers GSO
	// on a 1500-byte MTU, BIG TCP needs more. 0 means DefaultRingBufferSize.
	RingBufferSize int
	// PollInterval is how long a ReadBatch that keeps finding records sleeps
	// before it looks again, unless woken (0: a millisecond). Longer costs the
	// consumer less per byte on slow links (fewer wakeups, larger batches);
	// the program wakes it anyway once an eighth of the ring is waiting.
	PollInterval time.Duration
	// MaxFlows is how many protected flows keep a live state (FlowState) at
	// once: the least recently active is evicted beyond it. 0 means
	// DefaultMaxFlows.
	MaxFlows int
	// Logger receives attach/detach events; nil discards them.
	Logger *slog.Logger
	// Park, when its Ifindex is set, parks segments in a tap device's queues instead of copying them into
	// the ring (see ParkOptions); nothing is parked until SetParkCap.
	Park ParkOptions
}

// ParkOptions name the park a logger clones segments into: a tap device (netlog/park) with Buckets
// queues per CPU, one per bucket of destination addresses (park.Bucket), whose steering program takes
// the queue from the clone's mark. A segment of MinLen..MaxLen payload bytes is cloned into queue
// cpu*Buckets + its destination's bucket, if below Queues (the clone shares the segment's pages: no byte
// is copied), and only a header record goes into the ring (netlog.Record.Parked). A segment of another
// size, one whose queue the park lacks, or one the park refuses, is copied into the ring as always.
type ParkOptions struct {
	Ifindex int
	Queues  int
	Buckets int // a power of 2 up to park.MaxBuckets; 0 means 1
	MinLen  uint32
	MaxLen  uint32
}

// DefaultMaxFlows is TCPLoggerOptions.MaxFlows' default: an MPI job over TCP
// opens a connection per pair of ranks that talk, and each host of an
// all-to-all over 17 hosts of 64 ranks holds 64 x 64 x 16 = 65,536 of them
// (8192, the bound until 2026-11-30, was reached at 3 such hosts and passed
// at 4).
// The kernel preallocates every entry of the LRU map: 120 bytes each
// (bpftool's memlock: 0.98 MB for 8192, 7.9 MB for the default, 126 MB for
// 2^20). MaxMaxFlows bounds what a configuration may ask.
const (
	DefaultMaxFlows = 1 << 16
	MaxMaxFlows     = 1 << 22
)

// Counters are the program's counters summed over all CPUs.
type Counters struct {
	PacketsLogged     uint64 // records written
	BytesLogged       uint64 // payload bytes written
	DropsBackpressure uint64 // segments dropped because the ring buffer was full
	DropsOversize     uint64 // segments dropped because their record can never fit the ring
	DropsError        uint64 // segments dropped because copying them failed
	SeqRegressions    uint64 // logged segments starting below the flow's highest logged byte (retransmissions, approximate)
	FragmentsPassed   uint64 // IP fragments of protected sockets, passed unlogged (a hole: PMTU discovery is off)
	HeadersPulled     uint64 // segments whose TCP header was not all in the skb's linear part (forwarded ones)
	LoggedPassed      uint64 // segments passed unlogged while the ring was full: every byte had a record already
	Kicks             uint64 // sockets KickStalled pushed after a drop
	ReserveLogged     uint64 // segments of flows held back 2 s or more, logged into the ring's reserve (ReadPaused)
	UnloggedPassed    uint64 // segments passed unlogged: the ring was full and its consumer had taken nothing for 4 s (a hole)
	PacketsParked     uint64 // segments cloned into the park, a header record in the ring
	BytesParked       uint64 // their payload bytes
	ParkFailed        uint64 // segments the park refused (a queue full): copied into the ring instead
	ParkFull          uint64 // segments copied into the ring because the park held its cap (SetParkCap)
}

// tcplogLoaded holds only the objects the logger uses: LoadAndAssign loads
// exactly these (and the maps the program references), nothing else in the ELF.
type tcplogLoaded struct {
	Program          *ebpf.Program `ebpf:"tcplog_egress"`
	Kick             *ebpf.Program `ebpf:"tcplog_kick"`
	Events           *ebpf.Map     `ebpf:"events"`
	ProtectedCgroups *ebpf.Map     `ebpf:"protected_cgroups"`
	ProtectedFlows   *ebpf.Map     `ebpf:"protected_flows"`
	Stats            *ebpf.Map     `ebpf:"stats"`
	FlowStates       *ebpf.Map     `ebpf:"flow_states"`
	StalledFlows     *ebpf.Map     `ebpf:"stalled_flows"`
	Bss              *ebpf.Map     `ebpf:".bss"`
	// ConsumerPolling lives in the mmapped .bss: setting it is a store, not a syscall.
	ConsumerPolling *ebpf.Variable `ebpf:"consumer_polling"`
	// StalledPending says a segment was dropped for backpressure since KickStalled last ran.
	StalledPending *ebpf.Variable `ebpf:"stalled_pending"`
	// ConsumerPaused says the consumer reads with ReadPaused, which keeps the ring's reserve free;
	// PausedSeen when it last did (CLOCK_MONOTONIC ns): a paused consumer is not gone.
	ConsumerPaused *ebpf.Variable `ebpf:"consumer_paused"`
	PausedSeen     *ebpf.Variable `ebpf:"paused_seen_ns"`
	// The park's account (park_cap in bpf/tcplog.c): bytes freed so far
	// (the consumer's) and how many may wait at once.
	ParkedFreed *ebpf.Variable `ebpf:"parked_freed"`
	ParkCap     *ebpf.Variable `ebpf:"park_cap"`
}

// TCPLogger is the loaded TCX egress logger. Attach, Protect*, Counters and
// Close may be called from any goroutine; Read has a single consumer.
type TCPLogger struct {
	log      *slog.Logger
	objs     tcplogLoaded
	ring     *ringReader
	consumer ringConsumer

	mu    sync.Mutex // guards links, netns and kick
	links []link.Link
	// netns is the network namespace of the first Attach: the sockets KickStalled looks at.
	netns *os.File
	kick  *link.Iter // nil if the kernel refused it: stalled flows then wait for TCP's timers

	buf        []byte // Read's copy of the last record: only the reading goroutine touches it
	paused     bool   // mirror of consumer_paused: only the reading goroutine touches it
	kickErrors atomic.Uint64
}

// NewTCPLogger loads the logger's program and maps into the kernel. Nothing
// is logged until Attach and Protect/ProtectPort/ProtectFlow.
func NewTCPLogger(opts TCPLoggerOptions) (*TCPLogger, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	size, err := checkRingSize("tcplog", opts.RingBufferSize)
	if err != nil {
		return nil, err
	}

	spec, err := loadTcplog()
	if err != nil {
		return nil, fmt.Errorf("tcplog: parse embedded BPF object: %w", err)
	}
	spec.Maps[tcplogMapEvents].MaxEntries = uint32(size)
	flows := opts.MaxFlows
	if flows == 0 {
		flows = DefaultMaxFlows
	}
	if flows < 0 || flows > MaxMaxFlows {
		return nil, fmt.Errorf("tcplog: %d flows with a live state: use 1..%d", flows, MaxMaxFlows)
	}
	spec.Maps[tcplogMapFlowStates].MaxEntries = uint32(flows)
	if err := spec.Variables[tcplogVarRingSize].Set(uint32(size)); err != nil {
		return nil, fmt.Errorf("tcplog: set ring_size: %w", err)
	}
	// An eighth of the ring: at tens of Gbit/s that is a millisecond or
	// more of traffic, so a polling consumer is rarely woken, and 7/8 of the
	// ring is left before backpressure.
	if err := spec.Variables[tcplogVarWakeBytes].Set(uint32(size / 8)); err != nil {
		return nil, fmt.Errorf("tcplog: set wake_bytes: %w", err)
	}
	if err := setPark(spec, opts.Park, size); err != nil {
		return nil, err
	}

	l := &TCPLogger{log: log}
	if err := spec.LoadAndAssign(&l.objs, nil); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			log.Error("tcplog: verifier rejected the program", "log", fmt.Sprintf("%+v", ve))
		}
		return nil, fmt.Errorf("tcplog: load BPF program and maps (needs root, Linux 6.6+ with BTF): %w", err)
	}
	l.ring, err = newRingReader("tcplog", l.objs.Events.FD(), size)
	if err != nil {
		l.closeObjects()
		return nil, fmt.Errorf("tcplog: open ring buffer reader: %w", err)
	}
	l.consumer = ringConsumer{log: log, ring: l.ring, flag: l.objs.ConsumerPolling, poll: opts.PollInterval}
	if l.kick, err = link.AttachIter(link.IterOptions{Program: l.objs.Kick}); err != nil {
		log.Warn("tcplog: cannot attach the iterator that resumes flows stalled by a full ring: after a drop, TCP's own timers resume them (200 ms or more)", "err", err)
		l.kick = nil
	}
	log.Debug("tcplog: loaded", "ring_bytes", size)
	return l, nil
}

// Attach attaches the logger to the egress of interface ifindex, first in the
// TCX chain so that no other program's verdict can hide a segment from it.
// The interface is looked up in the calling thread's network namespace: enter
// the right one first (runtime.LockOSThread + netns.Set).
func (l *TCPLogger) Attach(ifindex int) error {
	nl, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return fmt.Errorf("tcplog: look up interface %d in this thread's network namespace: %w", ifindex, err)
	}
	attrs := nl.Attrs()
	// The program parses an Ethernet header at the start of the frame.
	if attrs.EncapType != "ether" && attrs.EncapType != "loopback" {
		return fmt.Errorf("tcplog: interface %s (%d) has link type %q: only Ethernet devices are supported", attrs.Name, ifindex, attrs.EncapType)
	}
	lk, err := link.AttachTCX(link.TCXOptions{
		Interface: ifindex,
		Program:   l.objs.Program,
		Attach:    ebpf.AttachTCXEgress,
		Anchor:    link.Head(),
	})
	if err != nil {
		return fmt.Errorf("tcplog: attach TCX egress to %s (%d) (needs Linux 6.6+): %w", attrs.Name, ifindex, err)
	}
	l.mu.Lock()
	l.links = append(l.links, lk)
	if l.netns == nil {
		// /proc/thread-self: the calling thread's namespace, which the caller entered for this Attach.
		if l.netns, err = os.Open("/proc/thread-self/ns/net"); err != nil {
			l.log.Warn("tcplog: open this thread's network namespace: flows stalled by a full ring wait for TCP's timers", "err", err)
			l.netns = nil
		}
	}
	l.mu.Unlock()
	l.log.Info("tcplog: attached", "ifname", attrs.Name, "ifindex", ifindex)
	return nil
}

// KickStalled resumes the flows whose segments the program dropped for backpressure since its last call:
// each such socket of the network namespace of the first Attach that still has data queued has it sent now
// (tcplog_kick in bpf/tcplog.c), instead of when an ACK comes or its window probe timer fires (200 ms or
// more, doubling). ReadBatch calls it whenever half the ring is free again: kicks into a fuller ring drop
// again and again, and each drop cuts the flow's congestion window (with an eighth free, HPCC's ring
// exchange ran at a quarter of the bandwidth, docs/mpi.md). It costs a load when nothing was dropped, a
// walk over the namespace's TCP sockets when something was. It reports whether it walked them.
func (l *TCPLogger) KickStalled() (bool, error) {
	var pending uint32
	if err := l.objs.StalledPending.Get(&pending); err != nil {
		return false, fmt.Errorf("tcplog: read stalled_pending: %w", err)
	}
	if pending == 0 {
		return false, nil
	}
	// Held throughout: Close must not close the namespace or the iterator under the walk.
	l.mu.Lock()
	defer l.mu.Unlock()
	ns := l.netns
	if l.kick == nil || ns == nil {
		return false, nil
	}
	// Cleared before the walk: a drop from here on raises it again, and its flow is in the map the walk reads.
	if err := l.objs.StalledPending.Set(uint32(0)); err != nil {
		return false, fmt.Errorf("tcplog: clear stalled_pending: %w", err)
	}
	walk := func() error {
		rd, err := l.kick.Open() // the iterator walks the namespace of the thread that opens it
		if err != nil {
			return fmt.Errorf("tcplog: open the kick iterator: %w", err)
		}
		defer rd.Close()
		if _, err := io.Copy(io.Discard, rd); err != nil {
			return fmt.Errorf("tcplog: run the kick iterator: %w", err)
		}
		return nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	same, err := inNetns(ns)
	if err != nil {
		return false, err
	}
	if same {
		return true, walk()
	}
	return true, netnsthread.In("/proc/self/fd/"+strconv.Itoa(int(ns.Fd())), walk)
}

// inNetns reports whether the calling thread is in the network namespace ns.
func inNetns(ns *os.File) (bool, error) {
	var want, have unix.Stat_t
	if err := unix.Fstat(int(ns.Fd()), &want); err != nil {
		return false, fmt.Errorf("tcplog: stat the attach's network namespace: %w", err)
	}
	if err := unix.Stat("/proc/thread-self/ns/net", &have); err != nil {
		return false, fmt.Errorf("tcplog: stat this thread's network namespace: %w", err)
	}
	return want.Dev == have.Dev && want.Ino == have.Ino, nil
}

// Protect logs the flows of sockets created in cgroup v2 cgroupID (the inode
// number of the cgroup's directory). A socket's cgroup is the one its creator
// was in when it was created; accepted sockets inherit the listener's.
func (l *TCPLogger) Protect(cgroupID uint64) error {
	if err := l.objs.ProtectedCgroups.Put(cgroupID, uint8(1)); err != nil {
		return fmt.Errorf("tcplog: protect cgroup %d (at most 1024 cgroups): %w", cgroupID, err)
	}
	return nil
}

// Unprotect stops logging cgroupID. Unprotecting an unknown cgroup is not an error.
func (l *TCPLogger) Unprotect(cgroupID uint64) error {
	if err := l.objs.ProtectedCgroups.Delete(cgroupID); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("tcplog: unprotect cgroup %d: %w", cgroupID, err)
	}
	return nil
}

// ProtectPort logs every segment sent from local TCP port port, whatever its
// socket's cgroup. Use it (or ProtectFlow) where skbs carry no socket, such
// as forwarded traffic.
func (l *TCPLogger) ProtectPort(port uint16) error {
	if err := l.objs.ProtectedFlows.Put(portKey(port), uint8(1)); err != nil {
		return fmt.Errorf("tcplog: protect local port %d (at most 4096 ports and flows): %w", port, err)
	}
	return nil
}

// UnprotectPort undoes ProtectPort.
func (l *TCPLogger) UnprotectPort(port uint16) error {
	if err := l.objs.ProtectedFlows.Delete(portKey(port)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("tcplog: unprotect local port %d: %w", port, err)
	}
	return nil
}

// ProtectFlow logs the segments of one IPv4 flow, whatever its socket's cgroup.
func (l *TCPLogger) ProtectFlow(f tcpflow.Tuple) error {
	k, err := flowKey(f)
	if err != nil {
		return err
	}
	if err := l.objs.ProtectedFlows.Put(k, uint8(1)); err != nil {
		return fmt.Errorf("tcplog: protect flow %v->%v (at most 4096 ports and flows): %w", f.Local, f.Remote, err)
	}
	return nil
}

// UnprotectFlow undoes ProtectFlow.
func (l *TCPLogger) UnprotectFlow(f tcpflow.Tuple) error {
	k, err := flowKey(f)
	if err != nil {
		return err
	}
	if err := l.objs.ProtectedFlows.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("tcplog: unprotect flow %v->%v: %w", f.Local, f.Remote, err)
	}
	return nil
}

// Counters sums the per-CPU counters.
func (l *TCPLogger) Counters() (Counters, error) {
	var per []tcplogCounters
	if err := l.objs.Stats.Lookup(uint32(0), &per); err != nil {
		return Counters{}, fmt.Errorf("tcplog: read counters: %w", err)
	}
	var c Counters
	for _, p := range per {
		c.PacketsLogged += p.PacketsLogged
		c.BytesLogged += p.BytesLogged
		c.DropsBackpressure += p.DropsBackpressure
		c.DropsOversize += p.DropsOversize
		c.DropsError += p.DropsError
		c.SeqRegressions += p.SeqRegressions
		c.FragmentsPassed += p.FragmentsPassed
		c.HeadersPulled += p.HeadersPulled
		c.LoggedPassed += p.LoggedPassed
		c.Kicks += p.Kicks
		c.ReserveLogged += p.ReserveLogged
		c.UnloggedPassed += p.UnloggedPassed
		c.PacketsParked += p.PacketsParked
		c.BytesParked += p.BytesParked
		c.ParkFailed += p.ParkFailed
		c.ParkFull += p.ParkFull
	}
	return c, nil
}

// RunTime returns the CPU time the program has spent on the sending CPUs, and how many packets it ran
// for: what logging costs on the senders' path, copies into the ring included. The kernel counts both
// only while BPF statistics are enabled (ebpf.EnableStats with unix.BPF_STATS_RUN_TIME, or the sysctl
// kernel.bpf_stats_enabled), since timing every run costs two clock reads per packet.
func (l *TCPLogger) RunTime() (time.Duration, uint64, error) {
	st, err := l.objs.Program.Stats()
	if err != nil {
		return 0, 0, fmt.Errorf("tcplog: read program statistics: %w", err)
	}
	return st.Runtime, st.RunCount, nil
}

// Pending returns how many bytes of records wait in the ring buffer.
func (l *TCPLogger) Pending() int {
	return l.ring.pending()
}

// Read returns the next raw record (RecordHeaderLen bytes of header, then the
// payload), blocking until one arrives. The slice is reused: it is valid only
// until the next Read. Read copies the record out of the ring; ReadBatch
// avoids that copy. Only one goroutine may call Read, ReadBatch or ReadPaused.
//
// When ctx is done, Read still returns the records already in the ring, then
// ctx.Err(): cancel the context after detaching to drain the log. After
// Close it returns an error wrapping ErrClosed.
func (l *TCPLogger) Read(ctx context.Context) ([]byte, error) {
	_, err := l.ReadBatch(ctx, 1, func(raw []byte) error {
		l.buf = append(l.buf[:0], raw...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return l.buf, nil
}

// ReadBatch calls fn with each record waiting in the ring buffer, in order,
// at most max of them (max <= 0: no limit), blocking until there is at least
// one; records that come meanwhile wait for the next call. raw
// (RecordHeaderLen bytes of header, then the payload) is the record's place
// in the shared ring itself: it is valid only until fn
// returns, when its space is given back to the kernel. Nothing is copied, so
// fn can copy the payload once, straight to where it is kept. If fn returns
// an error, that record stays in the ring (the next ReadBatch offers it
// again) and ReadBatch returns the error. It returns how many records fn
// accepted. Only one goroutine may call Read, ReadBatch or ReadPaused.
//
// ReadBatch is also what keeps wakeups rare: while records keep coming, the
// consumer sleeps between batches (TCPLoggerOptions.PollInterval) instead of being woken by
// every record (see consumer_polling in bpf/tcplog.c); a full eighth of the
// ring still wakes it at once.
//
// When ctx is done, ReadBatch still returns the records already in the ring,
// then ctx.Err(). After Close it returns an error wrapping ErrClosed.
func (l *TCPLogger) ReadBatch(ctx context.Context, max int, fn func(raw []byte) error) (int, error) {
	l.setPaused(false)
	taken := 0
	n, err := l.consumer.readBatch(ctx, max, func(raw []byte) error {
		if err := fn(raw); err != nil {
			return err
		}
		// A drain takes up to a ring's worth of records (tens of milliseconds on 2 vCPUs): a flow stalled
		// by a drop need not wait for its end, only for room in the ring.
		if taken++; taken%kickEvery == 0 && l.ring.filled() <= l.ring.mask/2 {
			l.kickStalled()
		}
		return nil
	})
	if err == nil && l.ring.pending() <= int(l.ring.mask/2) {
		l.kickStalled() // the batch is consumed, and the ring has room
	}
	return n, err
}

// reserveShift makes the ring's last 1/2^reserveShift its reserve (RESERVE_SHIFT in bpf/tcplog.c).
const reserveShift = 4

// ReadPaused is ReadBatch for a consumer paused at its log's memory cap, which leaves the records in the
// ring: it takes only what keeps the ring's reserve free, its last sixteenth, which the program gives to
// flows whose segments it has dropped for 2 s or more (bpf/tcplog.c). Each of them then gets a segment
// through every 2 s: TCP gives up on a connection with nothing in flight once its own host has dropped 15
// window probes in a row, 7.9 s after the first (measured), and a pause at the cap can last longer. Each
// call also tells the program the consumer is alive: one that takes nothing for 4 s otherwise counts as
// gone, and the program then passes segments unlogged. It never blocks, and returns how many records fn
// accepted.
func (l *TCPLogger) ReadPaused(fn func(raw []byte) error) (int, error) {
	l.setPaused(true)
	var now unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &now); err == nil {
		// Else the program takes the consumer for gone after 4 s, and its segments pass unlogged.
		if err := l.objs.PausedSeen.Set(uint64(now.Nano())); err != nil {
			l.log.Warn("tcplog: set paused_seen_ns", "err", err)
		}
	}
	return l.ring.drainUntilFree((l.ring.mask+1)>>reserveShift, fn)
}

// setPaused tells the program whether the consumer reads with ReadPaused (consumer_paused); only the
// consumer's goroutine calls it.
func (l *TCPLogger) setPaused(on bool) {
	if on == l.paused {
		return
	}
	l.paused = on
	if err := setFlag(l.objs.ConsumerPaused, on); err != nil {
		l.log.Warn("tcplog: set consumer_paused", "err", err)
	}
}

// kickEvery is how many records a drain takes between two looks at stalled_pending (a load).
const kickEvery = 32

// kickStalled is KickStalled for the reader, which logs its errors (a few: they repeat).
func (l *TCPLogger) kickStalled() {
	if _, err := l.KickStalled(); err != nil {
		if n := l.kickErrors.Add(1); n&(n-1) == 0 {
			l.log.Warn("tcplog: resume flows stalled by a full ring (they wait for TCP's timers instead)", "err", err, "count", n)
		}
	}
}

// Wake interrupts a ReadBatch waiting for records, so that it looks at the ring now instead of at its
// next poll: for a caller that needs what is in the ring consumed soon. It may be called from any
// goroutine.
func (l *TCPLogger) Wake() error { return l.ring.flush() }

// Close detaches the program from every interface, interrupts Read and
// frees the program and maps. Segments are no longer logged after it.
func (l *TCPLogger) Close() error {
	var errs []error
	l.mu.Lock()
	for _, lk := range l.links {
		if err := lk.Close(); err != nil {
			errs = append(errs, fmt.Errorf("tcplog: detach: %w", err))
		}
	}
	l.links = nil
	if l.netns != nil {
		l.netns.Close()
		l.netns = nil
	}
	if l.kick != nil {
		if err := l.kick.Close(); err != nil {
			errs = append(errs, fmt.Errorf("tcplog: close the kick iterator: %w", err))
		}
		l.kick = nil
	}
	l.mu.Unlock()
	if err := l.ring.close(); err != nil {
		errs = append(errs, fmt.Errorf("tcplog: close ring buffer reader: %w", err))
	}
	if err := l.closeObjects(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (l *TCPLogger) closeObjects() error {
	var errs []error
	for _, c := range []interface{ Close() error }{l.objs.Program, l.objs.Kick, l.objs.Events, l.objs.ProtectedCgroups, l.objs.ProtectedFlows, l.objs.Stats, l.objs.FlowStates, l.objs.StalledFlows, l.objs.Bss} {
		if err := c.Close(); err != nil {
			errs = append(errs, fmt.Errorf("tcplog: close BPF object: %w", err))
		}
	}
	return errors.Join(errs...)
}

// setPark sets the park's constants (park_ifindex and the rest in bpf/tcplog.c) in spec.
func setPark(spec *ebpf.CollectionSpec, p ParkOptions, ring int) error {
	if p.Ifindex == 0 {
		return nil
	}
	switch {
	case p.Ifindex < 0 || p.Queues <= 0:
		return fmt.Errorf("tcplog: park on interface %d with %d queues: want a positive index and at least one queue", p.Ifindex, p.Queues)
	case p.Buckets < 0 || p.Buckets > park.MaxBuckets || p.Buckets&(p.Buckets-1) != 0:
		return fmt.Errorf("tcplog: park with %d buckets of destinations: want a power of 2 up to %d", p.Buckets, park.MaxBuckets)
	case p.MinLen == 0 || p.MaxLen < p.MinLen:
		return fmt.Errorf("tcplog: park segments of %d..%d bytes: want 0 < MinLen <= MaxLen", p.MinLen, p.MaxLen)
	}
	for name, v := range map[string]uint32{
		tcplogVarParkIfindex: uint32(p.Ifindex),
		tcplogVarParkQueues:  uint32(p.Queues),
		tcplogVarParkBuckets: uint32(max(p.Buckets, 1)),
		tcplogVarParkMin:     p.MinLen,
		tcplogVarParkMax:     p.MaxLen,
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return fmt.Errorf("tcplog: set %s: %w", name, err)
		}
	}
	return nil
}

// SetParkCap sets how many payload bytes may wait in the park at once (0: park nothing more).
func (l *TCPLogger) SetParkCap(bytes uint64) error {
	if err := l.objs.ParkCap.Set(bytes); err != nil {
		return fmt.Errorf("tcplog: set park_cap: %w", err)
	}
	return nil
}

// ParkFreed tells the program that total payload bytes have left the park so far (freed or taken into
// the log): what it may park again under its cap. Only the consumer calls it.
func (l *TCPLogger) ParkFreed(total uint64) error {
	if err := l.objs.ParkedFreed.Set(total); err != nil {
		return fmt.Errorf("tcplog: set parked_freed: %w", err)
	}
	return nil
}

// portKey is the protected_flows key that matches every segment sent from a
// local port: only sport set, in network byte order.
func portKey(port uint16) tcplogFlowKey {
	return tcplogFlowKey{Sport: htons(port)}
}

func flowKey(f tcpflow.Tuple) (tcplogFlowKey, error) {
	src, dst := f.Local.Addr().Unmap(), f.Remote.Addr().Unmap()
	if !src.Is4() || !dst.Is4() {
		return tcplogFlowKey{}, fmt.Errorf("tcplog: flow %v->%v: only IPv4 flows are logged", f.Local, f.Remote)
	}
	s, d := src.As4(), dst.As4()
	return tcplogFlowKey{
		// The kernel compares raw header bytes; reading them as a native
		// (little-endian) uint32 reproduces what the program stores.
		Saddr: binary.NativeEndian.Uint32(s[:]),
		Daddr: binary.NativeEndian.Uint32(d[:]),
		Sport: htons(f.Local.Port()),
		Dport: htons(f.Remote.Port()),
	}, nil
}

// htons converts to network byte order as a native uint16 (the generated
// code builds only for little-endian targets).
func htons(v uint16) uint16 {
	return v<<8 | v>>8
}
