//go:build linux

package capture

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync/atomic"

	"github.com/cilium/ebpf"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/park"
	"github.com/ftkit/ftkit/tcpflow"
)

// ParkOptions make a capture park segments instead of copying them into its ring (package netlog/park,
// docs/design.md): the program clones each segment of MinLen..MaxLen payload bytes into the park, a tap
// device with a queue per CPU and bucket of destinations, where it waits, sharing the sender's pages,
// until a receiver's snapshot covers its bytes (freed by reading its headers only) or they are needed
// (read into the log: a replay, which takes its destination's bucket only, or the park at three
// quarters of Cap). Segments sent while the park holds Cap bytes, or by CPUs past park.MaxQueues, go
// through the ring as before.
type ParkOptions struct {
	// Device is the tap device's name, in the capture's network namespace; "" means DefaultParkDevice.
	Device string
	// Cap bounds the payload bytes waiting in the park; 0 means DefaultParkCap. The clones' memory is
	// the kernel's, outside the log's (Options.MemoryCap): the two caps add up.
	Cap int64
	// MinLen is the shortest payload parked (0: DefaultParkMinLen): a clone costs a packet's metadata
	// and a read whatever its length, so short segments are cheaper copied.
	MinLen uint32
	// MaxLen is the longest (0: DefaultParkMaxLen): the size of the consumer's buffer for a clone.
	MaxLen uint32
}

// The park's defaults.
const (
	DefaultParkDevice = "ftpark0"
	// DefaultParkCap bounds what a survivor does before it can send a restored job its bytes: a
	// recovery's read of the log first takes the clones of its destination's bucket into it (those of
	// the failed job are bytes it replays), up to the whole park if every clone is for that bucket. It
	// holds what a 20 Gbit/s sender sends in 80 ms, so that receivers' snapshots, and the bench's trims
	// every 50 ms, free the clones unread (at 64 MiB 40% were taken into the log first).
	DefaultParkCap           = 256 << 20
	DefaultParkMinLen uint32 = 4096
	DefaultParkMaxLen uint32 = 256 << 10
	// maxParkQueueLen bounds each queue: a queue that is full makes the program copy into the ring.
	maxParkQueueLen = 1 << 16
	// parkSlots bounds the slots of all queues together: the kernel allocates a pointer per slot and
	// queue when the park opens (16 MiB for these), and a queue of 8192 slots (256 queues) still holds
	// 512 MiB of 64 KiB segments.
	parkSlots = 1 << 21
	// A recovery's read takes the queues of its destination's bucket only; more buckets leave more of
	// the other destinations' clones parked. maxParkBuckets bounds them: 8 on hosts of up to 32 CPUs,
	// then as many as the tap's queues allow (4 up to 64 CPUs, 2 up to 128, 1 above).
	maxParkBuckets = 8
)

// parkBuckets is how many buckets of destinations a park gets on a host of cpus possible CPUs: a power
// of 2, at most maxParkBuckets, with a queue per CPU and bucket within park.MaxQueues (but 1 bucket
// whatever the CPUs).
func parkBuckets(cpus int) int {
	b := maxParkBuckets
	for b > 1 && b*cpus > park.MaxQueues {
		b /= 2
	}
	return b
}

// parkQueueLen is each queue's length for a park of queues queues: the clones of cap bytes of segments
// of minLen, within maxParkQueueLen and parkSlots.
func parkQueueLen(cap int64, minLen uint32, queues int) int {
	return int(min(max(cap/int64(minLen), 1), maxParkQueueLen, max(parkSlots/int64(queues), 1)))
}

func (o ParkOptions) withDefaults() ParkOptions {
	if o.Device == "" {
		o.Device = DefaultParkDevice
	}
	if o.Cap == 0 {
		o.Cap = DefaultParkCap
	}
	if o.MinLen == 0 {
		o.MinLen = DefaultParkMinLen
	}
	if o.MaxLen == 0 {
		o.MaxLen = DefaultParkMaxLen
	}
	return o
}

// openPark opens the park opts describe, in the calling thread's network namespace, with a queue per
// possible CPU and bucket (up to park.MaxQueues), and returns it with its buckets.
func openPark(opts ParkOptions) (*park.Park, int, error) {
	if opts.Cap < 0 || opts.MaxLen < opts.MinLen || opts.MaxLen > netlog.MaxPayload {
		return nil, 0, fmt.Errorf("capture: park cap %d bytes, segments of %d..%d bytes: want a cap of 0 or more and 0 < MinLen <= MaxLen <= %d",
			opts.Cap, opts.MinLen, opts.MaxLen, netlog.MaxPayload)
	}
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, 0, fmt.Errorf("capture: count the CPUs for the park's queues: %w", err)
	}
	buckets := parkBuckets(cpus)
	queues := min(cpus*buckets, park.MaxQueues)
	p, err := park.Open(opts.Device, queues, parkQueueLen(opts.Cap, opts.MinLen, queues))
	if err != nil {
		return nil, 0, fmt.Errorf("capture: %w", err)
	}
	return p, buckets, nil
}

// parkQueues is what the consumer reads the park through: a *park.Park.
type parkQueues interface {
	Ifindex() int
	Queues() int
	Free(q int, hdr []byte) (park.Frame, error)
	Take(q int, buf []byte) (park.Frame, error)
	Close() error
}

// parked is the consumer's book of the park: the clones each queue holds, in order. Only the consumer's
// goroutine touches it, but for the counters.
type parked struct {
	log     *slog.Logger
	p       parkQueues
	probe   *ebpfprobes.TCPLogger
	cap     int64
	buckets int           // queue i holds the clones of destinations in bucket i % buckets
	q       [][]parkEntry // per queue, oldest first, from head[i]
	head    []int
	bytes   int64  // payload bytes waiting
	left    uint64 // payload bytes that left the park so far (the program's parked_freed)
	hdr     []byte // Free's buffer
	buf     []byte // Take's

	waiting atomic.Int64  // bytes, for Counters
	freed   atomic.Uint64 // payload bytes freed unread: what parking saved
	taken   atomic.Uint64 // payload bytes read into the log
	lost    atomic.Uint64 // clones missing or not the one expected: their bytes are a hole
	strays  atomic.Uint64 // frames in the park no record names, skipped
	// misfiled is set once a record's queue is not of its destination's bucket (park.Bucket disagrees
	// with the program's): from then on a take for one destination takes every queue.
	misfiled atomic.Bool
}

type parkEntry struct {
	conn     tcpflow.Tuple
	seq, len uint32
	cgroup   uint64
	ktime    uint64
}

func newParked(log *slog.Logger, p parkQueues, buckets int, probe *ebpfprobes.TCPLogger, opts ParkOptions) *parked {
	return &parked{
		log: log, p: p, probe: probe, cap: opts.Cap, buckets: buckets,
		q: make([][]parkEntry, p.Queues()), head: make([]int, p.Queues()),
		hdr: make([]byte, park.HeaderRoom), buf: make([]byte, int(opts.MaxLen)+park.HeaderRoom+1),
	}
}

// push books a parked record: its clone is the last in its queue.
func (k *parked) push(rec netlog.Record) {
	if int(rec.Queue) >= len(k.q) {
		// The program parks only on CPUs below the queue count: a record naming another is not its.
		k.lose(rec.Conn, rec.Seq, fmt.Errorf("a record names park queue %d of %d", rec.Queue, len(k.q)))
		return
	}
	if int(rec.Queue)%k.buckets != park.Bucket(rec.Conn.Remote.Addr(), k.buckets) && !k.misfiled.Swap(true) {
		k.log.Error("capture: a parked record's queue is not of its destination's bucket: recoveries take every parked clone",
			"conn", rec.Conn, "queue", rec.Queue, "buckets", k.buckets)
	}
	k.q[rec.Queue] = append(k.q[rec.Queue], parkEntry{conn: rec.Conn, seq: rec.Seq, len: rec.Parked, cgroup: rec.CgroupID, ktime: rec.KtimeNs})
	k.bytes += int64(rec.Parked)
	k.waiting.Store(k.bytes)
}

// bucketMask is the set of buckets take asks service for, a bit per bucket.
type bucketMask uint64

// allBuckets asks for every bucket.
const allBuckets = ^bucketMask(0)

// maskOf is the set holding the bucket of destination dst.
func (k *parked) maskOf(dst netip.Addr) bucketMask {
	if k.misfiled.Load() {
		return allBuckets
	}
	return 1 << park.Bucket(dst, k.buckets)
}

// service frees the clones at the queues' heads whose bytes the log has trimmed, and takes into the log
// those it must keep while their bucket is in take (a caller waits for them) or the park holds more
// than three quarters of its cap; room says whether the log may grow by one more. A queue waits at the
// first clone that is neither. Each clone read is checked against its record: a frame no record names
// is skipped, and the clones a later one's turn shows missing count as lost.
func (k *parked) service(log *netlog.Log, store func(netlog.Record) error, take bucketMask, room func() bool) error {
	var err error
	for qi := range k.q {
		if err = k.serviceQueue(qi, log, store, take&(1<<(qi%k.buckets)) != 0, room); err != nil {
			break
		}
	}
	k.waiting.Store(k.bytes)
	return errors.Join(err, k.probe.ParkFreed(k.left))
}

func (k *parked) serviceQueue(qi int, log *netlog.Log, store func(netlog.Record) error, takeAll bool, room func() bool) error {
	q := k.q[qi]
	defer func() {
		// Keep the slice short: reuse it once drained, move it down once half is done.
		switch h := k.head[qi]; {
		case h == len(k.q[qi]):
			k.q[qi], k.head[qi] = k.q[qi][:0], 0
		case h > 1024 && h > len(k.q[qi])/2:
			n := copy(k.q[qi], k.q[qi][h:])
			k.q[qi], k.head[qi] = k.q[qi][:n], 0
		}
	}()
	pop := func(e parkEntry) {
		k.head[qi]++
		k.bytes -= int64(e.len)
		k.left += uint64(e.len)
	}
	for k.head[qi] < len(q) {
		e := q[k.head[qi]]
		var f park.Frame
		var err error
		trimmed := storeTrimmed(log, e)
		switch {
		case trimmed:
			f, err = k.p.Free(qi, k.hdr)
		case takeAll || k.bytes > k.cap/4*3:
			if !room() {
				return nil // the log at its cap: this queue waits, the others may still free
			}
			f, err = k.p.Take(qi, k.buf)
		default:
			return nil
		}
		if errors.Is(err, park.ErrNotTCP) {
			// Read, and no clone: the program parks IPv4 TCP segments only, and anyone may send out of the
			// park (a socket bound to the device). A stray like any frame no record names: e is still queued.
			if n := k.strays.Add(1); isPow2(n) {
				k.log.Warn("capture: a frame in the park that is not a TCP segment, skipped", "queue", qi, "err", err, "count", n)
			}
			continue
		}
		if err != nil {
			// Empty: the program queues the clone before it submits the record, so it cannot be missing.
			// Else the clone read is lost, and presumably it was e.
			pop(e)
			k.lose(e.conn, e.seq, err)
			continue
		}
		if f.Conn != e.conn || f.Seq != e.seq {
			j := k.find(qi, f)
			if j < 0 {
				// Not a clone of ours (a frame something else sent out of the park): e is still queued.
				if n := k.strays.Add(1); isPow2(n) {
					k.log.Warn("capture: a frame in the park that no record names, skipped", "queue", qi, "conn", f.Conn, "seq", f.Seq, "count", n)
				}
				continue
			}
			// The clones before it are missing.
			for k.head[qi] < j {
				lost := q[k.head[qi]]
				pop(lost)
				k.lose(lost.conn, lost.seq, fmt.Errorf("the queue gave the clone of %v seq %d first", f.Conn, f.Seq))
			}
			e = q[j]
			if trimmed = storeTrimmed(log, e); !trimmed && len(f.Payload) != int(e.len) {
				pop(e)
				k.lose(e.conn, e.seq, errors.New("its clone was freed unread, out of turn"))
				continue
			}
		}
		pop(e)
		switch {
		case trimmed:
			k.freed.Add(uint64(e.len))
			continue
		case len(f.Payload) != int(e.len):
			k.lose(e.conn, e.seq, fmt.Errorf("its clone holds %d payload bytes, its record %d", len(f.Payload), e.len))
			continue
		}
		k.taken.Add(uint64(e.len))
		if err := store(netlog.Record{Conn: e.conn, Seq: e.seq, CgroupID: e.cgroup, KtimeNs: e.ktime, Payload: f.Payload}); err != nil {
			return err
		}
	}
	return nil
}

// findWindow bounds how far past a queue's head find looks for the clone a read gave.
const findWindow = 64

// find returns the index of the entry of queue qi, past its head and at most findWindow on, whose clone f
// is, or -1.
func (k *parked) find(qi int, f park.Frame) int {
	q := k.q[qi]
	for j := k.head[qi] + 1; j < len(q) && j <= k.head[qi]+findWindow; j++ {
		if q[j].conn == f.Conn && q[j].seq == f.Seq {
			return j
		}
	}
	return -1
}

// lose counts a clone lost, and logs a few: its bytes are a hole in the log (the node's controller asks
// every member for a snapshot, which covers it).
func (k *parked) lose(conn tcpflow.Tuple, seq uint32, err error) {
	if n := k.lost.Add(1); isPow2(n) {
		k.log.Error("capture: a parked clone is lost: its bytes are a hole in the log", "conn", conn, "seq", seq, "err", err, "count", n)
	}
}

// storeTrimmed says whether the log needs none of e's bytes: trimmed, or the connection's log removed.
func storeTrimmed(log *netlog.Log, e parkEntry) bool {
	st, err := log.Store(e.conn)
	return err != nil || st.Trimmed(e.seq+e.len)
}

// holding says whether any clone waits.
func (k *parked) holding() bool { return k.bytes > 0 }

func (k *parked) close() error { return k.p.Close() }
