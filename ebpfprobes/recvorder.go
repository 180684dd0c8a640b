//go:build linux

package ebpfprobes

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/cgroupv2"
	"github.com/ftkit/ftkit/tcpflow"
)

// RecvOrderOptions configure NewRecvOrder.
type RecvOrderOptions struct {
	// CgroupParent is the cgroup v2 directory (absolute path) whose children
	// are the job cgroups, e.g. /sys/fs/cgroup/unified/ftkit: receive calls
	// of tasks below it are recorded, each under the id of the job cgroup
	// (the parent's child) it is in.
	CgroupParent string
	// RingBufferSize in bytes: a power of two and a multiple of the page
	// size. Each event takes 48 bytes of it. 0 means DefaultRingBufferSize.
	RingBufferSize int
	// WakeEveryEvent wakes a waiting ReadBatch for every event (initially:
	// SetWakeEveryEvent switches it later). By default,
	// while ReadBatch keeps finding events it polls the ring every
	// PollInterval instead of being woken (cheaper per event, as for
	// TCPLogger), so an event can reach it up to a poll interval late. A
	// consumer that waits for one particular event (the spare's replay,
	// which injects the next bytes once the restored process asked for
	// them) wants it at once.
	WakeEveryEvent bool
	// PollInterval is how long a ReadBatch that keeps finding events sleeps before it looks again unless
	// woken, as TCPLoggerOptions.PollInterval (0: a millisecond).
	PollInterval time.Duration
	// Positions counts each job thread's readiness calls (RecvEvent.Polls, PollCounts, stops at readiness
	// calls): every system call of the host then takes the kernel's traced exit path.
	Positions bool
	// Logger receives load/attach events; nil discards them.
	Logger *slog.Logger
}

// RecvEvent is one recorded receive call (bpf/recvorder.c), or, if PollStop, the stop of a thread at an
// armed readiness call (only Cgroup, Pid, Tid, Thread, Proc, Polls and Stopped are set).
type RecvEvent struct {
	Cgroup    uint64        // the job cgroup's id (CgroupID of its directory)
	Conn      tcpflow.Tuple // Local is the receiving socket, Remote its peer
	CopiedSeq uint32        // the socket's copied_seq after the call: the next byte it will hand out (one more once the peer's FIN is consumed)
	Len       uint32        // bytes the call returned (> 0); 0: it found nothing (EAGAIN)
	Flags     uint32        // the call's MSG_* flags (MSG_PEEK, MSG_ERRQUEUE, MSG_OOB: copied_seq did not move)
	Pid       uint32        // the caller's process (tgid)
	Tid       uint32        // the caller's thread
	Thread    uint32        // the caller's thread id in its job's PID namespace (CRIU restores it)
	Proc      uint32        // the caller's process id in that namespace
	PollStop  bool          // the event is an armed stop at a readiness call, not a receive call
	Stopped   bool          // the thread was sent SIGSTOP at this event (an armed stop)
	Held      bool          // a pessimistic job's receive call: its thread was sent SIGSTOP (unless StopErr), for the agent to continue once the determinant is stored (SetPessimistic)
	StopErr   unix.Errno    // an armed stop's or a hold's SIGSTOP could not be sent: why
	Polls     uint64        // the readiness calls the thread had made when it made this call
}

// Peek reports whether the call only looked at the bytes (MSG_PEEK).
func (e RecvEvent) Peek() bool { return e.Flags&unix.MSG_PEEK != 0 }

// RecvEventSize is the size of a raw event (struct recv_event).
const RecvEventSize = 64

// ErrBadRecvEvent means a raw event does not have struct recv_event's size.
var ErrBadRecvEvent = errors.New("malformed receive event")

// DecodeRecvEvent decodes a raw ring buffer record of bpf/recvorder.c.
// Addresses and ports are in network byte order, the rest in host order.
func DecodeRecvEvent(raw []byte) (RecvEvent, error) {
	if len(raw) != RecvEventSize {
		return RecvEvent{}, fmt.Errorf("%w: %d bytes, want %d", ErrBadRecvEvent, len(raw), RecvEventSize)
	}
	h := binary.NativeEndian
	kind, stopped := h.Uint32(raw[48:]), h.Uint32(raw[52:])
	switch {
	case kind > evHeld:
		return RecvEvent{}, fmt.Errorf("%w: kind %d", ErrBadRecvEvent, kind)
	case kind == evHeld && stopped == 0, stopped == 2:
		return RecvEvent{}, fmt.Errorf("%w: kind %d with stop result %d", ErrBadRecvEvent, kind, stopped)
	}
	return RecvEvent{
		Cgroup: h.Uint64(raw[0:]),
		Conn: tcpflow.Tuple{
			Local:  netip.AddrPortFrom(netip.AddrFrom4([4]byte(raw[8:12])), binary.BigEndian.Uint16(raw[16:])),
			Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte(raw[12:16])), binary.BigEndian.Uint16(raw[18:])),
		},
		CopiedSeq: h.Uint32(raw[20:]),
		Len:       h.Uint32(raw[24:]),
		Flags:     h.Uint32(raw[28:]),
		Pid:       h.Uint32(raw[32:]),
		Tid:       h.Uint32(raw[36:]),
		Thread:    h.Uint32(raw[40:]),
		Proc:      h.Uint32(raw[44:]),
		PollStop:  kind == evPollStop,
		Stopped:   kind != evHeld && stopped == 1,
		Held:      kind == evHeld,
		StopErr:   stopErr(stopped),
		Polls:     h.Uint64(raw[56:]),
	}, nil
}

// recv_event.kind (EV_*).
const (
	evPollStop = 1
	evHeld     = 2
)

// stopErr decodes recv_event.stopped's error (2 + errno).
func stopErr(v uint32) unix.Errno {
	if v < 2 {
		return 0
	}
	return unix.Errno(v - 2)
}

// RecvOrderCounters are the recorder's counters summed over all CPUs.
type RecvOrderCounters struct {
	Recorded         uint64 // events written
	Lost             uint64 // events lost: the ring buffer was full (per job: RecvOrder.Lost)
	LostUnattributed uint64 // of those, lost without knowing the job: every job's record is incomplete
	NotInJob         uint64 // consuming calls of tasks in the parent cgroup itself, not recorded
	NonIPv4          uint64 // consuming calls of jobs on sockets that are not IPv4 TCP, not recorded
	Untracked        uint64 // readiness calls not counted (the positions map was full), each also counted lost to its job
}

// recvorderLoaded holds the objects the recorder uses.
type recvorderLoaded struct {
	Program         *ebpf.Program  `ebpf:"recvorder"`
	PollExit        *ebpf.Program  `ebpf:"pollexit"`
	PosExit         *ebpf.Program  `ebpf:"posexit"`
	Positions       *ebpf.Map      `ebpf:"positions"`
	Stops           *ebpf.Map      `ebpf:"stops"`
	StopsArmed      *ebpf.Variable `ebpf:"stops_armed"`
	Pessimistic     *ebpf.Map      `ebpf:"pessimistic"`
	PessimisticAny  *ebpf.Variable `ebpf:"pessimistic_any"`
	Events          *ebpf.Map      `ebpf:"events"`
	Parent          *ebpf.Map      `ebpf:"parent"`
	Lost            *ebpf.Map      `ebpf:"lost"`
	Stats           *ebpf.Map      `ebpf:"stats"`
	Bss             *ebpf.Map      `ebpf:".bss"`
	ConsumerPolling *ebpf.Variable `ebpf:"consumer_polling"`
	WakeEvery       *ebpf.Variable `ebpf:"wake_every"`
	LostTotal       *ebpf.Variable `ebpf:"lost_total"`
}

// RecvOrder records the order and amounts in which the jobs below a cgroup
// consume their TCP connections' bytes: one RecvEvent per successful receive
// call (bpf/recvorder.c has what is and is not seen). Events come in ring
// order, a total order consistent with each thread's program order and with
// the causality between threads. An event that finds the ring full is lost
// and counted against its job (Lost): a job whose count is not 0 has an
// incomplete record, which must never be replayed.
// Lost, Forget, Counters and Close may be called from any goroutine;
// ReadBatch has a single consumer.
type RecvOrder struct {
	log      *slog.Logger
	objs     recvorderLoaded
	link     link.Link
	pollLink link.Link // nil: readiness calls are not counted (Positions)
	exitLink link.Link // frees an exiting thread's position; set when pollLink is
	ring     *ringReader
	consumer ringConsumer

	closeOnce sync.Once
	closeErr  error
}

// NewRecvOrder loads the recorder and attaches it to the sock_recv_length
// tracepoint: from its return on, the receive calls of the tasks below
// opts.CgroupParent are recorded. The parent must exist; job cgroups may be
// created below it at any time.
func NewRecvOrder(opts RecvOrderOptions) (*RecvOrder, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if !filepath.IsAbs(opts.CgroupParent) {
		return nil, fmt.Errorf("recvorder: cgroup parent %q: the path must be absolute", opts.CgroupParent)
	}
	dir := filepath.Clean(opts.CgroupParent)
	size, err := checkRingSize("recvorder", opts.RingBufferSize)
	if err != nil {
		return nil, err
	}
	pfd, err := cgroupv2.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("recvorder: cgroup parent: %w", err)
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return nil, fmt.Errorf("recvorder: stat cgroup parent %s: %w", dir, err)
	}

	spec, err := loadRecvorder()
	if err != nil {
		return nil, fmt.Errorf("recvorder: parse embedded BPF object: %w", err)
	}
	spec.Maps[recvorderMapEvents].MaxEntries = uint32(size)
	var positionsOn uint32
	if opts.Positions {
		positionsOn = 1
	}
	for name, v := range map[string]any{
		recvorderVarRingSize:    uint32(size),
		recvorderVarWakeBytes:   uint32(size / 8), // an eighth of the ring, as for TCPLogger
		recvorderVarParentCgid:  st.Ino,
		recvorderVarPollNr:      pollSyscalls,
		recvorderVarRestartNr:   uint32(unix.SYS_RESTART_SYSCALL),
		recvorderVarPositionsOn: positionsOn,
	} {
		if err := spec.Variables[name].Set(v); err != nil {
			return nil, fmt.Errorf("recvorder: set %s: %w", name, err)
		}
	}

	r := &RecvOrder{log: log}
	if err := spec.LoadAndAssign(&r.objs, nil); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			log.Error("recvorder: verifier rejected the program", "log", fmt.Sprintf("%+v", ve))
		}
		return nil, fmt.Errorf("recvorder: load BPF program and maps (needs root, Linux 6.6+ with BTF): %w", err)
	}
	// The array holds its own reference to the cgroup: pfd may be closed.
	if err := r.objs.Parent.Update(uint32(0), uint32(pfd), ebpf.UpdateAny); err != nil {
		_ = r.closeObjects()
		return nil, fmt.Errorf("recvorder: put cgroup parent %s in the cgroup array: %w", dir, err)
	}
	r.ring, err = newRingReader("recvorder", r.objs.Events.FD(), size)
	if err != nil {
		_ = r.closeObjects()
		return nil, fmt.Errorf("recvorder: open ring buffer reader: %w", err)
	}
	r.consumer = ringConsumer{log: log, ring: r.ring, flag: r.objs.ConsumerPolling, poll: opts.PollInterval}
	if err := r.SetWakeEveryEvent(opts.WakeEveryEvent); err != nil {
		_ = r.ring.close()
		_ = r.closeObjects()
		return nil, err
	}
	r.link, err = link.AttachTracing(link.TracingOptions{Program: r.objs.Program})
	if err != nil {
		_ = r.ring.close()
		_ = r.closeObjects()
		return nil, fmt.Errorf("recvorder: attach to tracepoint sock_recv_length (needs root and a kernel with BTF): %w", err)
	}
	// Counting every thread's readiness calls puts every system call of the host on the kernel's traced
	// exit path (tens of nanoseconds each): without it receive calls are recorded all the same, with no
	// positions, and a replay keeps their order only.
	// Positions are not counted without the program that frees an exited thread's: a job that churns
	// threads would fill the map with the dead, and its new threads would go uncounted unnoticed.
	if opts.Positions {
		if r.exitLink, err = link.AttachTracing(link.TracingOptions{Program: r.objs.PosExit}); err != nil {
			log.Warn("recvorder: exited threads' positions cannot be freed (tracepoint sched_process_exit): receive positions are not recorded", "err", err)
			r.exitLink = nil
		} else if r.pollLink, err = link.AttachTracing(link.TracingOptions{Program: r.objs.PollExit}); err != nil {
			log.Warn("recvorder: readiness calls are not counted (tracepoint sys_exit): receive positions are not recorded", "err", err)
			r.pollLink = nil
		}
	}
	log.Info("recvorder: attached", "cgroup_parent", dir, "cgroup_parent_id", st.Ino, "ring_bytes", size, "positions", r.pollLink != nil)
	return r, nil
}

// ReadBatch appends to dst the events waiting in the ring buffer, in ring
// order, at most cap(dst)-len(dst) of them (256 if dst has no room), and
// returns it. It blocks until there is at least one, ctx is done (after
// draining what is there: ReadBatch then returns the events with ctx.Err()
// only once the ring is empty) or the recorder is closed (ErrClosed).
func (r *RecvOrder) ReadBatch(ctx context.Context, dst []RecvEvent) ([]RecvEvent, error) {
	room := cap(dst) - len(dst)
	if room <= 0 {
		room = 256
	}
	var decodeErr error
	_, err := r.consumer.readBatch(ctx, room, func(raw []byte) error {
		e, err := DecodeRecvEvent(raw)
		if err != nil {
			// Cannot happen (the program writes only these): report it,
			// but do not leave it blocking the ring.
			decodeErr = err
			return nil
		}
		dst = append(dst, e)
		return nil
	})
	if decodeErr != nil {
		return dst, fmt.Errorf("recvorder: %w", decodeErr)
	}
	return dst, err
}

// SetWakeEveryEvent switches RecvOrderOptions.WakeEveryEvent on or off while
// the recorder runs: a consumer that gates on each event turns it on for as
// long as it gates.
func (r *RecvOrder) SetWakeEveryEvent(on bool) error {
	var v uint32
	if on {
		v = 1
	}
	if err := r.objs.WakeEvery.Set(v); err != nil {
		return fmt.Errorf("recvorder: set wake_every: %w", err)
	}
	return nil
}

// Lost returns how many events of the job cgroup with id cgroup were lost,
// plus those lost without knowing their job: any other value than 0 means
// the job's record is incomplete. Read it after draining the ring: 0 then
// means every event of the job up to that moment was read.
func (r *RecvOrder) Lost(cgroup uint64) (uint64, error) {
	var n uint64
	if err := r.objs.Lost.Lookup(cgroup, &n); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return 0, fmt.Errorf("recvorder: read lost events of cgroup %d: %w", cgroup, err)
	}
	c, err := r.Counters()
	if err != nil {
		return 0, err
	}
	return n + c.LostUnattributed, nil
}

// LostTotal returns how many events were lost so far, every job's together (Counters' Lost), read from
// the program's mmapped .bss without a system call: the recorder reads it after each drain and looks each
// job's count up (Lost) only when it moved. Summing the per-CPU counters (Counters) takes a system call and
// a decoding of every CPU's values: 3.1 us a read against 57 ns here (2026-12-01).
func (r *RecvOrder) LostTotal() (uint64, error) {
	var n uint64
	if err := r.objs.LostTotal.Get(&n); err != nil {
		return 0, fmt.Errorf("recvorder: read lost_total: %w", err)
	}
	return n, nil
}

// Forget drops the lost-event count and the threads' positions of a job
// cgroup that ended, so that the maps never fill (a full lost map makes
// losses unattributed, a full positions map leaves threads uncounted).
func (r *RecvOrder) Forget(cgroup uint64) error {
	if err := r.objs.Lost.Delete(cgroup); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("recvorder: forget cgroup %d: %w", cgroup, err)
	}
	// Collected first: deleting while iterating a hash map restarts the walk.
	threads, err := r.PollCounts(cgroup)
	errs := []error{err}
	for tid := range threads {
		k := recvorderThreadKey{CgroupId: cgroup, Nstid: tid}
		if err := r.objs.Positions.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
		if err := r.objs.Stops.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("recvorder: forget the threads of cgroup %d: %w", cgroup, err)
	}
	return nil
}

// Positions reports whether readiness calls are counted: RecvEvent.Polls, PollCounts and the stops at
// readiness calls work only then.
func (r *RecvOrder) Positions() bool { return r.pollLink != nil }

// PollCounts returns, for each thread of the job cgroup that made a readiness call, how many it made, by
// its id in the job's PID namespace. Read it while the cgroup is frozen: the counts are then those at that
// point of the job's execution.
func (r *RecvOrder) PollCounts(cgroup uint64) (map[uint32]uint64, error) {
	out := map[uint32]uint64{}
	var k recvorderThreadKey
	var v recvorderPosition
	it := r.objs.Positions.Iterate()
	for it.Next(&k, &v) {
		if k.CgroupId == cgroup {
			out[k.Nstid] = v.Polls
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("recvorder: read the readiness calls of cgroup %d: %w", cgroup, err)
	}
	return out, nil
}

// PollCount returns how many readiness calls thread (its id in the job's PID namespace) of job cgroup
// made so far (0 if none).
func (r *RecvOrder) PollCount(cgroup uint64, thread uint32) (uint64, error) {
	var v recvorderPosition
	if err := r.objs.Positions.Lookup(recvorderThreadKey{CgroupId: cgroup, Nstid: thread}, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, nil
		}
		return 0, fmt.Errorf("recvorder: read the readiness calls of thread %d of cgroup %d: %w", thread, cgroup, err)
	}
	return v.Polls, nil
}

// A Stop is where a thread is stopped (SIGSTOP, before it runs any code of its own after the call): once
// it has made Polls readiness calls (a zero Conn), or right after a receive call it makes after Polls
// readiness calls on Conn that returns Len bytes (0: EAGAIN) and leaves the socket's copied_seq at End. The
// stop comes as a RecvEvent with Stopped set.
type Stop struct {
	Polls    uint64
	Conn     tcpflow.Tuple // Local is the thread's socket
	End, Len uint32
}

// Arm sets thread's stop in job cgroup (replacing any), and has the recorder look at stops.
func (r *RecvOrder) Arm(cgroup uint64, thread uint32, s Stop) error {
	v := recvorderStop{Polls: s.Polls}
	if s.Conn.Local.IsValid() {
		c := s.Conn.Unmap()
		v.End, v.Len, v.Lport, v.Rport = s.End, s.Len, htons(c.Local.Port()), htons(c.Remote.Port())
		if v.Lport == 0 || v.Rport == 0 {
			return fmt.Errorf("recvorder: stop thread %d of cgroup %d on %s: a port is 0", thread, cgroup, s.Conn)
		}
	}
	if err := r.objs.Stops.Update(recvorderThreadKey{CgroupId: cgroup, Nstid: thread}, v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("recvorder: arm the stop of thread %d of cgroup %d: %w", thread, cgroup, err)
	}
	if err := r.objs.StopsArmed.Set(uint32(1)); err != nil {
		return fmt.Errorf("recvorder: set stops_armed: %w", err)
	}
	return nil
}

// Disarm removes thread's stop in job cgroup; the recorder stops looking at stops once none is left.
func (r *RecvOrder) Disarm(cgroup uint64, thread uint32) error {
	if err := r.objs.Stops.Delete(recvorderThreadKey{CgroupId: cgroup, Nstid: thread}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("recvorder: disarm the stop of thread %d of cgroup %d: %w", thread, cgroup, err)
	}
	return clearWhenEmpty(r.objs.Stops, r.objs.StopsArmed, "stops_armed")
}

// clearWhenEmpty sets flag, which lets the program skip its lookups in m, to 0 once m holds no key (or
// cannot be read).
func clearWhenEmpty(m *ebpf.Map, flag *ebpf.Variable, name string) error {
	if k, err := m.NextKeyBytes(nil); err == nil && k != nil {
		return nil
	}
	if err := flag.Set(uint32(0)); err != nil {
		return fmt.Errorf("recvorder: clear %s: %w", name, err)
	}
	return nil
}

// SetPessimistic makes every receive call of job cgroup that consumes bytes stop its thread's process
// (SIGSTOP, before the process runs any code of its own after the call; the call comes as a RecvEvent with
// Held set), or no longer. The caller continues the process once the call's determinant is safe.
func (r *RecvOrder) SetPessimistic(cgroup uint64, on bool) error {
	if on {
		if err := r.objs.Pessimistic.Update(cgroup, uint8(1), ebpf.UpdateAny); err != nil {
			return fmt.Errorf("recvorder: make cgroup %d pessimistic: %w", cgroup, err)
		}
		if err := r.objs.PessimisticAny.Set(uint32(1)); err != nil {
			return fmt.Errorf("recvorder: set pessimistic_any: %w", err)
		}
		return nil
	}
	if err := r.objs.Pessimistic.Delete(cgroup); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("recvorder: make cgroup %d optimistic: %w", cgroup, err)
	}
	return clearWhenEmpty(r.objs.Pessimistic, r.objs.PessimisticAny, "pessimistic_any")
}

// Counters sums the per-CPU counters.
func (r *RecvOrder) Counters() (RecvOrderCounters, error) {
	var per []recvorderOrderCounters
	if err := r.objs.Stats.Lookup(uint32(0), &per); err != nil {
		return RecvOrderCounters{}, fmt.Errorf("recvorder: read counters: %w", err)
	}
	var c RecvOrderCounters
	for _, p := range per {
		c.Recorded += p.Recorded
		c.Lost += p.Lost
		c.LostUnattributed += p.LostUnattributed
		c.NotInJob += p.NotInJob
		c.NonIPv4 += p.NonIpv4
		c.Untracked += p.Untracked
	}
	return c, nil
}

// Close detaches the recorder, interrupts ReadBatch and frees the program
// and maps.
func (r *RecvOrder) Close() error {
	r.closeOnce.Do(func() {
		var errs []error
		if err := r.link.Close(); err != nil {
			errs = append(errs, fmt.Errorf("recvorder: detach from sock_recv_length: %w", err))
		}
		if r.pollLink != nil {
			if err := r.pollLink.Close(); err != nil {
				errs = append(errs, fmt.Errorf("recvorder: detach from sys_exit: %w", err))
			}
		}
		if r.exitLink != nil {
			if err := r.exitLink.Close(); err != nil {
				errs = append(errs, fmt.Errorf("recvorder: detach from sched_process_exit: %w", err))
			}
		}
		if err := r.ring.close(); err != nil {
			errs = append(errs, fmt.Errorf("recvorder: close ring buffer reader: %w", err))
		}
		if err := r.closeObjects(); err != nil {
			errs = append(errs, err)
		}
		r.closeErr = errors.Join(errs...)
	})
	return r.closeErr
}

func (r *RecvOrder) closeObjects() error {
	var errs []error
	for _, c := range []interface{ Close() error }{r.objs.Program, r.objs.PollExit, r.objs.PosExit, r.objs.Positions, r.objs.Stops, r.objs.Pessimistic, r.objs.Events, r.objs.Parent, r.objs.Lost, r.objs.Stats, r.objs.Bss} {
		if err := c.Close(); err != nil {
			errs = append(errs, fmt.Errorf("recvorder: close BPF object: %w", err))
		}
	}
	return errors.Join(errs...)
}
