// Package node is the sender-side log of one host, wired: the eBPF capture (netlog/capture) of the
// cluster interface, its resource controller (netlog/controller) that asks receiving nodes for snapshots
// and spills under pressure, and the freeing of finished connections' logs by the receivers' watermarks
// (netlog/release). What only the daemon knows (which member holds an address, how to ask a member for a
// snapshot or its watermark) comes in through small interfaces, so the package knows nothing of the
// agent or its protocol.
package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/netlog/controller"
	"github.com/ftkit/ftkit/netlog/release"
	"github.com/ftkit/ftkit/tcpflow"
)

// Source is what the node reads of its capture: *capture.Capture, or a fake in tests.
type Source interface {
	Log() *netlog.Log
	FlowState(conn tcpflow.Tuple) (ebpfprobes.FlowState, bool, error)
	LogsSocket(conn tcpflow.Tuple) (bool, error)
	Protects(cgroupID uint64) bool
	ProtectCgroup(dir string) error
	UnprotectCgroup(dir string) error
	Counters() (capture.Counters, error)
	Urge() (done func())
	Want(conn tcpflow.Tuple)
	TakeParked(ctx context.Context, conn tcpflow.Tuple) error
	Close() error
}

// Members is what the node needs of the cluster: who holds an address, and the questions it asks
// other members.
type Members interface {
	// Owner names the member that holds addr now, "" if none.
	Owner(addr netip.Addr) string
	// RequestSnapshot asks member node to snapshot its jobs now, so that this host can trim its log.
	RequestSnapshot(ctx context.Context, node string) error
	// Watermark asks member node for its receive watermark, placed on this host's clock.
	Watermark(ctx context.Context, node string) (release.Watermark, error)
	// Others names the cluster's other members.
	Others() []string
}

// Config is how the node runs.
type Config struct {
	Controller controller.Config
	CanSpill   bool  // the log has a spill directory
	MaxRange   int64 // bound of one Range (the protocol's)
	Members    Members
	Logger     *slog.Logger
	// Event is called for each controller decision and freeing of finished connections (metrics); nil
	// for none.
	Event func(kind controller.EventKind)
	// ReceiveHoles counts the segments this host's receive tap passed unrecorded
	// (ebpfprobes.RecvCounters.UnrecordedPassed): a check of a restored sender's re-sent bytes over them
	// fails until the sender's next snapshot, so they ask every member for snapshots as the log's holes
	// do. nil: none.
	ReceiveHoles func() uint64
	// SocketGone reports whether conn's local (sending) socket no longer exists, looked up where it
	// lives (a job network's namespace or the host's): the fact that finishes a flow whose live state
	// the capture evicted. nil: never asked, and such a flow stays logged until its job ends.
	SocketGone func(conn tcpflow.Tuple) (bool, error)
}

// Node is the sender-side log of one host.
type Node struct {
	src Source
	ctl *controller.Controller
	cfg Config
	log *slog.Logger

	mu   sync.Mutex
	ev   []controller.Event   // the last maxEvents decisions, for `ftctl status`
	seen map[string]time.Time // destination node -> when its log data was last trimmed (or first seen)
	aged time.Time            // last Age of the log (Run only)

	// Trims held back while a snapshot of this host reads its connections' last blocks (HoldTrims).
	holds    int
	held     map[tcpflow.Tuple]heldPoint // connection -> the furthest trim point asked meanwhile
	heldFrom map[string]bool             // the receiving nodes that asked

	// Freeing finished connections (releaseFinished).
	marks    map[string]release.Watermark      // receiving node -> its latest watermark, on our clock
	asked    map[string]time.Time              // receiving node -> when we last asked it for its watermark
	asking   map[string]bool                   // a question to that node is in flight
	verdicts map[tcpflow.Tuple]release.Verdict // the last decision on each logged connection
	released Released
	gone     map[tcpflow.Tuple]goneCheck // the last lookup of each idle connection's socket without a flow state (Run only)
	orphans  map[tcpflow.Tuple]time.Time // connection -> since when no alive member holds its destination (Run only)

	// Holes (checkHoles): the count of segments and records the log lost, as of the last request for
	// snapshots it made, when it made it, and the least time to the next.
	holes      uint64
	holesAsked time.Time
	holeGap    time.Duration
}

// heldPoint is a trim point held back (HoldTrims), with the store of its connection it was checked against.
type heldPoint struct {
	st  *netlog.Store
	seq uint32
}

// Released counts the logs of finished connections freed since the node started.
type Released struct {
	Conns int64 `json:"conns"`
	Bytes int64 `json:"bytes"` // logged bytes they still retained
}

const maxEvents = 50

// New runs the node's logic over src; the node owns src from then on (Close closes it).
func New(src Source, cfg Config) (*Node, error) {
	ctl, err := controller.New(cfg.Controller)
	if err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Event == nil {
		cfg.Event = func(controller.EventKind) {}
	}
	if cfg.ReceiveHoles == nil {
		cfg.ReceiveHoles = func() uint64 { return 0 }
	}
	n := &Node{src: src, ctl: ctl, cfg: cfg, log: cfg.Logger, seen: map[string]time.Time{},
		held: map[tcpflow.Tuple]heldPoint{}, heldFrom: map[string]bool{},
		marks: map[string]release.Watermark{}, asked: map[string]time.Time{}, asking: map[string]bool{}, gone: map[tcpflow.Tuple]goneCheck{},
		orphans: map[tcpflow.Tuple]time.Time{}, holeGap: holeAskEvery}
	if c, err := src.Counters(); err == nil {
		n.holes = holes(c) + cfg.ReceiveHoles()
	}
	return n, nil
}

// StartConfig is the capture to start (Start).
type StartConfig struct {
	Interface string // the cluster interface, in the caller's network namespace
	RingMiB   int
	MaxFlows  int     // protected flows with a live state at once; 0: ebpfprobes.DefaultMaxFlows
	MemoryMiB int     // the log's memory cap; 0: a tenth of this host's memory
	SpillDir  string  // "" for none
	Park      bool    // park segments in the kernel (capture.ParkOptions)
	ParkMiB   int     // the park's cap; 0: a quarter of the log's, at most capture.DefaultParkCap
	High, Low float64 // the controller's thresholds, fractions of the cap
	MaxRange  int64
	Members   Members
	Logger    *slog.Logger
	Event     func(kind controller.EventKind)
	// ReceiveHoles is Config.ReceiveHoles.
	ReceiveHoles func() uint64
	// SocketGone is Config.SocketGone.
	SocketGone func(conn tcpflow.Tuple) (bool, error)
}

// Start attaches the probe to the cluster interface and returns the node over it. The caller logs that
// the log is attached once the rest of its logging is ready (CapBytes is the cap Start chose).
func Start(sc StartConfig) (*Node, error) {
	if sc.Logger == nil {
		sc.Logger = slog.Default()
	}
	capMiB := sc.MemoryMiB
	if capMiB == 0 {
		capMiB = int(memTotalMiB() / 10)
	}
	capBytes := int64(capMiB) << 20
	opts := netlog.Options{Logger: sc.Logger}
	if sc.SpillDir != "" {
		opts.SpillDir = sc.SpillDir
		opts.SpillAboveRAM = int64(float64(capBytes) * sc.Low)
	}
	copts := capture.Options{Interface: sc.Interface, RingBufferSize: sc.RingMiB << 20, MaxFlows: sc.MaxFlows, Log: opts, Logger: sc.Logger, MemoryCap: capBytes}
	if sc.Park {
		copts.Park = &capture.ParkOptions{Cap: parkCap(sc.ParkMiB, capBytes)}
	}
	c, err := capture.New(copts)
	if err != nil && copts.Park != nil {
		// The log works without: every segment is copied into its ring, as before the park.
		sc.Logger.Warn("cannot park sent segments in the kernel: the log copies every segment instead (log.park = false silences this)", "err", err)
		copts.Park = nil
		c, err = capture.New(copts)
	}
	if err != nil {
		return nil, fmt.Errorf("start the sender-side log on %s: %w", sc.Interface, err)
	}
	n, err := New(c, Config{
		Controller: controller.Config{Cap: capBytes, High: sc.High, Low: sc.Low},
		CanSpill:   sc.SpillDir != "", MaxRange: sc.MaxRange, Members: sc.Members, Logger: sc.Logger, Event: sc.Event,
		ReceiveHoles: sc.ReceiveHoles, SocketGone: sc.SocketGone,
	})
	if err != nil {
		c.Close()
		return nil, err
	}
	return n, nil
}

func memTotalMiB() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 1024
	}
	var kb int64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "MemTotal:") {
			fmt.Sscanf(strings.TrimPrefix(line, "MemTotal:"), "%d", &kb)
		}
	}
	return kb / 1024
}

// Urge lets the capture's consumer drain the ring past the log's memory cap until done is called
// (capture.Capture.Urge): for a caller waiting for bytes still in the ring.
func (n *Node) Urge() (done func()) { return n.src.Urge() }

// Want wakes the capture's consumer and has it take the parked clones of conn's bucket of destinations
// into the log (capture.Capture.Want).
func (n *Node) Want(conn tcpflow.Tuple) { n.src.Want(conn) }

// parkCap is the park's cap in bytes for log.park_mib parkMiB and the log's cap: 0 means a quarter of the
// log's, at most capture.DefaultParkCap, which bounds what a recovery's read waits for (capture.ParkOptions).
func parkCap(parkMiB int, logCap int64) int64 {
	if parkMiB > 0 {
		return int64(parkMiB) << 20
	}
	return min(logCap/4, capture.DefaultParkCap)
}

// TakeParked has the capture take the parked clones of conn's bucket of destinations into the log, and
// waits until it has (capture.Capture.TakeParked).
func (n *Node) TakeParked(ctx context.Context, conn tcpflow.Tuple) error {
	return n.src.TakeParked(ctx, conn)
}

// Close detaches the capture.
func (n *Node) Close() error { return n.src.Close() }

// Log is the host's log.
func (n *Node) Log() *netlog.Log { return n.src.Log() }

// FlowState is the sender's live state of conn from its last egress segment.
func (n *Node) FlowState(conn tcpflow.Tuple) (ebpfprobes.FlowState, bool, error) {
	return n.src.FlowState(conn)
}

// Knows reports whether this host logs what it sends on conn: its log holds a store of conn, or the
// capture has seen a segment of it (it keeps the live state of protected flows only). A connection of a
// process the host does not protect is neither: a restore of its peer could be given nothing it sent.
func (n *Node) Knows(conn tcpflow.Tuple) bool {
	if n.logHolds(conn) {
		return true
	}
	_, ok, err := n.src.FlowState(conn)
	return ok || err != nil
}

// LostState reports, for a connection Knows does not know, whether its local socket is a protected
// process's all the same: the capture keeps the live state of the most recently active protected flows
// only (StartConfig.MaxFlows), and this one, with nothing in the log, sent nothing while more than that many others did.
// A restore of its peer needs that state as much as an unprotected process's bytes; only the reason told
// differs, and what fixes it (the connection's next segment, or fewer active connections on this host).
func (n *Node) LostState(conn tcpflow.Tuple) bool {
	logs, err := n.src.LogsSocket(conn)
	return logs && err == nil
}

// logHolds reports whether the log has a store of conn (what sentNothingSince and Knows first ask).
func (n *Node) logHolds(conn tcpflow.Tuple) bool {
	_, err := n.Log().Bounds(conn)
	return !errors.Is(err, netlog.ErrUnknownConn)
}

// Protect logs what the processes of cgroup dir send.
func (n *Node) Protect(dir string) error { return n.src.ProtectCgroup(dir) }

// Unprotect stops logging cgroup dir.
func (n *Node) Unprotect(dir string) error { return n.src.UnprotectCgroup(dir) }

// ParkCapBytes is the park's cap, 0 without a park.
func (n *Node) ParkCapBytes() int64 {
	if c, ok := n.src.(interface{ ParkCap() int64 }); ok {
		return c.ParkCap()
	}
	return 0
}

// CapBytes is the log's memory cap.
func (n *Node) CapBytes() int64 { return n.ctl.Config().Cap }

// Counters are the capture's counters.
func (n *Node) Counters() (capture.Counters, error) { return n.src.Counters() }

// ReleasedSoFar counts the finished connections' logs freed so far.
func (n *Node) ReleasedSoFar() Released {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.released
}

func (n *Node) addEvents(events []controller.Event) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.ev = append(n.ev, events...)
	if len(n.ev) > maxEvents {
		n.ev = n.ev[len(n.ev)-maxEvents:]
	}
}
