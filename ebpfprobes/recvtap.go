//go:build linux

package ebpfprobes

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/cgroupv2"
)

// ErrAlreadyAttached is returned by AttachCgroup for a cgroup the tap is
// attached to already.
var ErrAlreadyAttached = errors.New("already attached")

// RecvTapOptions configure NewRecvTap.
type RecvTapOptions struct {
	// RingBufferSize in bytes, as TCPLoggerOptions.RingBufferSize: a power
	// of two and a multiple of the page size, holding the largest received
	// (GRO) segment plus 44 bytes. 0 means DefaultRingBufferSize.
	RingBufferSize int
	// PollInterval is how long a ReadBatch that keeps finding records sleeps before it looks again, as
	// TCPLoggerOptions.PollInterval (0: a millisecond).
	PollInterval time.Duration
	// Logger receives attach/detach events; nil discards them.
	Logger *slog.Logger
}

// RecvCounters are the receive tap's counters summed over all CPUs.
type RecvCounters struct {
	PacketsRecorded   uint64 // records written
	BytesRecorded     uint64 // payload bytes written
	DropsBackpressure uint64 // segments dropped because the ring buffer was full
	DropsOversize     uint64 // segments dropped because their record can never fit the ring
	DropsError        uint64 // segments dropped because copying them or updating the flow map failed
	OutOfOrder        uint64 // segments recorded with bytes before them not recorded yet (loss, reordering): the consumer holds them
	DuplicatesPassed  uint64 // segments passed unrecorded: their bytes were recorded before
	NoTCPSock         uint64 // segments with payload passed unrecorded: no TCP socket that can take them
	NonIPv4           uint64 // packets that are not IPv4, passed unrecorded
	NonTCP            uint64 // IPv4 packets that are not TCP, passed
	Resyncs           uint64 // flows whose socket had accepted bytes never recorded (attached mid-flow): the records jump
	SYNIgnored        uint64 // SYNs with payload to established sockets, passed unrecorded (TCP takes none of it)
	// UnrecordedPassed counts segments passed unrecorded because the ring was full and its consumer had
	// taken nothing for 4 s (a stopped or hung agent): a hole in what the sockets received is recorded.
	UnrecordedPassed uint64
}

// tcprecvLoaded holds the objects the tap uses (LoadAndAssign loads exactly these).
type tcprecvLoaded struct {
	Program    *ebpf.Program `ebpf:"tcprecv_ingress"`
	Events     *ebpf.Map     `ebpf:"events"`
	RxFlows    *ebpf.Map     `ebpf:"rx_flows"`
	Stats      *ebpf.Map     `ebpf:"stats"`
	Handshakes *ebpf.Map     `ebpf:"handshakes"`
	Bss        *ebpf.Map     `ebpf:".bss"`
	// ConsumerPolling lives in the mmapped .bss: setting it is a store, not a syscall.
	ConsumerPolling *ebpf.Variable `ebpf:"consumer_polling"`
}

// RecvTap records, for the TCP sockets of the cgroups it is attached to,
// every payload byte they receive (bpf/tcprecv.c has the guarantees): one
// ring buffer record per received segment in TCPLogger's format, with
// the flow named from the sender's side: Local the remote sender and Remote the
// local socket (netlog.DecodeRecord decodes them). A segment whose record cannot be written is dropped, so TCP
// retransmits it: the tap slows a flow down rather than miss a byte.
// AttachCgroup, DetachCgroup, Counters and Close may be called from any
// goroutine; ReadBatch has a single consumer.
type RecvTap struct {
	log      *slog.Logger
	objs     tcprecvLoaded
	ring     *ringReader
	consumer ringConsumer

	mu     sync.Mutex // guards links and closed
	links  map[string]link.Link
	closed bool
}

// NewRecvTap loads the tap's program and maps into the kernel. Nothing is
// recorded until AttachCgroup.
func NewRecvTap(opts RecvTapOptions) (*RecvTap, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	size, err := checkRingSize("recvtap", opts.RingBufferSize)
	if err != nil {
		return nil, err
	}
	spec, err := loadTcprecv()
	if err != nil {
		return nil, fmt.Errorf("recvtap: parse embedded BPF object: %w", err)
	}
	spec.Maps[tcprecvMapEvents].MaxEntries = uint32(size)
	if err := spec.Variables[tcprecvVarRingSize].Set(uint32(size)); err != nil {
		return nil, fmt.Errorf("recvtap: set ring_size: %w", err)
	}
	// An eighth of the ring, as for TCPLogger.
	if err := spec.Variables[tcprecvVarWakeBytes].Set(uint32(size / 8)); err != nil {
		return nil, fmt.Errorf("recvtap: set wake_bytes: %w", err)
	}

	t := &RecvTap{log: log, links: map[string]link.Link{}}
	if err := spec.LoadAndAssign(&t.objs, nil); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			log.Error("recvtap: verifier rejected the program", "log", fmt.Sprintf("%+v", ve))
		}
		return nil, fmt.Errorf("recvtap: load BPF program and maps (needs root, Linux 6.6+ with BTF): %w", err)
	}
	t.ring, err = newRingReader("recvtap", t.objs.Events.FD(), size)
	if err != nil {
		_ = t.closeObjects()
		return nil, fmt.Errorf("recvtap: open ring buffer reader: %w", err)
	}
	t.consumer = ringConsumer{log: log, ring: t.ring, flag: t.objs.ConsumerPolling, poll: opts.PollInterval}
	log.Debug("recvtap: loaded", "ring_bytes", size)
	return t, nil
}

// AttachCgroup records what the sockets of the cgroup v2 directory dir (an
// absolute path) and of its descendants receive. A socket belongs to the
// cgroup its creator was in when it was created; accepted sockets inherit
// the listener's. Attaching a directory twice returns ErrAlreadyAttached.
// Attach before the job's connections are made: a connection already open
// is covered from its next received segment on (bytes the socket accepted
// before are not), and segments in flight at that moment can cost it a
// retransmission.
func (t *RecvTap) AttachCgroup(dir string) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("recvtap: attach to cgroup %q: the path must be absolute", dir)
	}
	dir = filepath.Clean(dir)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("recvtap: attach to cgroup %s: %w", dir, ErrClosed)
	}
	if _, ok := t.links[dir]; ok {
		return fmt.Errorf("recvtap: attach to cgroup %s: %w", dir, ErrAlreadyAttached)
	}
	fd, err := cgroupv2.Open(dir)
	if err != nil {
		return fmt.Errorf("recvtap: attach to cgroup: %w", err)
	}
	defer unix.Close(fd)
	// A bpf_link: other programs on the cgroup stay (multi-attach), and the
	// kernel detaches it when the last reference to it is closed.
	lk, err := link.AttachRawLink(link.RawLinkOptions{
		Target:  fd,
		Program: t.objs.Program,
		Attach:  ebpf.AttachCGroupInetIngress,
	})
	if err != nil {
		return fmt.Errorf("recvtap: attach to cgroup %s (needs root and cgroup v2): %w", dir, err)
	}
	t.links[dir] = lk
	t.log.Info("recvtap: attached", "cgroup", dir)
	return nil
}

// DetachCgroup stops recording for dir. Detaching a directory that is not
// attached is not an error.
func (t *RecvTap) DetachCgroup(dir string) error {
	dir = filepath.Clean(dir)
	t.mu.Lock()
	defer t.mu.Unlock()
	lk, ok := t.links[dir]
	if !ok {
		return nil
	}
	delete(t.links, dir)
	if err := lk.Close(); err != nil {
		return fmt.Errorf("recvtap: detach from cgroup %s: %w", dir, err)
	}
	for _, id := range cgroupIDs(dir) {
		_ = t.objs.Handshakes.Delete(id) // absent if no socket of it ever completed a handshake
	}
	t.sweepHandshakes()
	t.log.Info("recvtap: detached", "cgroup", dir)
	return nil
}

// sweepHandshakes deletes the counts of cgroups under no attached directory any more: sub-cgroups removed
// while their job ran are not found by the walk of its directory, and their entries filled the map (8192,
// shared by the host's jobs), after which new jobs' handshakes went uncounted. Call with t.mu held.
func (t *RecvTap) sweepHandshakes() {
	live := map[uint64]bool{}
	for d := range t.links {
		for _, id := range cgroupIDs(d) {
			live[id] = true
		}
	}
	var gone []uint64
	var id, n uint64
	it := t.objs.Handshakes.Iterate()
	for it.Next(&id, &n) {
		if !live[id] {
			gone = append(gone, id)
		}
	}
	if err := it.Err(); err != nil {
		t.log.Warn("recvtap: list handshake counts", "err", err)
	}
	// Collected first: deleting while iterating a hash map restarts the walk.
	for _, id := range gone {
		_ = t.objs.Handshakes.Delete(id)
	}
}

// ReadBatch calls fn with each record waiting in the ring buffer, exactly as
// TCPLogger.ReadBatch does (same contract: records in place, valid until fn
// returns, a refused record stays first, ctx cancellation drains the ring
// first). Within one flow, records come in the order bpf/tcprecv.c
// describes: each starts at or below the end of the ones before it, except
// at the flow's start and after a resync.
func (t *RecvTap) ReadBatch(ctx context.Context, max int, fn func(raw []byte) error) (int, error) {
	return t.consumer.readBatch(ctx, max, fn)
}

// Counters sums the per-CPU counters.
func (t *RecvTap) Counters() (RecvCounters, error) {
	var per []tcprecvRecvCounters
	if err := t.objs.Stats.Lookup(uint32(0), &per); err != nil {
		return RecvCounters{}, fmt.Errorf("recvtap: read counters: %w", err)
	}
	var c RecvCounters
	for _, p := range per {
		c.PacketsRecorded += p.PacketsRecorded
		c.BytesRecorded += p.BytesRecorded
		c.DropsBackpressure += p.DropsBackpressure
		c.DropsOversize += p.DropsOversize
		c.DropsError += p.DropsError
		c.OutOfOrder += p.OutOfOrder
		c.DuplicatesPassed += p.DuplicatesPassed
		c.NoTCPSock += p.NoTcpSock
		c.NonIPv4 += p.NonIpv4
		c.NonTCP += p.NonTcp
		c.Resyncs += p.Resyncs
		c.SYNIgnored += p.SynIgnored
		c.UnrecordedPassed += p.UnrecordedPassed
	}
	return c, nil
}

// Handshakes returns how many TCP handshakes the sockets of the cgroup v2 directory dir and of its
// descendants have completed since the tap was attached to it (a connect answered, or a connection
// completed on a listener before it is accepted): a caller looking for a job's new connections needs to
// look again only when this moves. It costs a map lookup per cgroup.
func (t *RecvTap) Handshakes(dir string) (uint64, error) {
	ids := cgroupIDs(dir)
	if len(ids) == 0 {
		return 0, fmt.Errorf("recvtap: handshakes of cgroup %s: not a readable cgroup directory", dir)
	}
	var sum uint64
	for _, id := range ids {
		var n uint64
		err := t.objs.Handshakes.Lookup(id, &n)
		switch {
		case err == nil:
			sum += n
		case !errors.Is(err, ebpf.ErrKeyNotExist):
			return 0, fmt.Errorf("recvtap: handshakes of cgroup %s: %w", dir, err)
		}
	}
	return sum, nil
}

// cgroupIDs are the ids of dir and of its descendant cgroups (those removed meanwhile left out).
func cgroupIDs(dir string) []uint64 {
	var ids []uint64
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		if id, err := cgroupv2.ID(path); err == nil {
			ids = append(ids, id)
		}
		return nil
	})
	return ids
}

// Close detaches the tap from every cgroup, interrupts ReadBatch and frees
// the program and maps.
func (t *RecvTap) Close() error {
	var errs []error
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	for dir, lk := range t.links {
		if err := lk.Close(); err != nil {
			errs = append(errs, fmt.Errorf("recvtap: detach from cgroup %s: %w", dir, err))
		}
	}
	t.links = nil
	t.mu.Unlock()
	if err := t.ring.close(); err != nil {
		errs = append(errs, fmt.Errorf("recvtap: close ring buffer reader: %w", err))
	}
	if err := t.closeObjects(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (t *RecvTap) closeObjects() error {
	var errs []error
	for _, c := range []interface{ Close() error }{t.objs.Program, t.objs.Events, t.objs.RxFlows, t.objs.Stats, t.objs.Handshakes, t.objs.Bss} {
		if err := c.Close(); err != nil {
			errs = append(errs, fmt.Errorf("recvtap: close BPF object: %w", err))
		}
	}
	return errors.Join(errs...)
}
