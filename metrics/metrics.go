// Package metrics holds the Prometheus metrics of an ftkit agent: their definitions, a collector that reads
// the agent's state when /metrics is scraped, the counters and histograms of events that leave no state
// behind (a snapshot taken, a heartbeat sent), and the HTTP server of the endpoint.
//
// Every metric has the ftkit_ prefix and base units (seconds, bytes). Labels are bounded: a job id, a job
// state, a member name, a stage or a reason from a fixed set; never a connection.
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Source gives the collector the agent's state at scrape time.
type Source interface {
	MetricsState() State
}

// State is what the agent knows at one moment; the collector turns it into metrics.
type State struct {
	Jobs []Job
	// Log is the sender-side log's counters; nil when the log is disabled or closed.
	Log *Log
	// Predecessor is the ring predecessor whose heartbeats this agent watches; nil when it watches none.
	Predecessor *Predecessor
	// Failures are the recoveries in this agent's failure log (the newest ones, copied to every member).
	Failures []Failure
}

// Job is one job record of this host.
type Job struct {
	ID    string
	State string // running, exited, lost
	// ReplicaAge is how long ago the job's newest replica reached its protector; valid if Replicated.
	ReplicaAge time.Duration
	Replicated bool
	// Uncovered: the replica lacks connections the job opened since (a new snapshot comes soon).
	Uncovered bool
	// Unrecoverable: the replica holds connections no restore could rebuild (`ftctl status`: UNRECOVERABLE).
	Unrecoverable bool
}

// Log holds the sender-side log's numbers (netlog/capture's counters and the agent's release counters).
type Log struct {
	MemoryBytes, CapBytes, RetainedBytes, SpilledBytes int64
	PooledBytes                                        int64 // freed slab buffers kept for reuse, part of MemoryBytes, not counted against the cap
	Conns                                              int
	ConsumerPaused                                     bool
	ConsumerCPU                                        time.Duration // the log consumer thread's CPU time
	BytesLogged, PacketsLogged                         uint64
	// Drops by reason: segments the probe dropped (TCP retransmits them), fragments passed unlogged,
	// segments passed unlogged while the consumer was gone, and records the consumer could not append.
	DropsBackpressure, DropsOversize, DropsError, FragmentsPassed, UnloggedPassed, AppendErrors uint64
	// The park (log.park): its cap, the payload waiting in clones, bytes parked so far, and what became of
	// them: freed unread (trimmed while parked) or taken into the log; clones lost count as drops.
	ParkCapBytes, ParkWaitingBytes              int64
	BytesParked, ParkFreed, ParkTaken, ParkLost uint64
	// What keeps a backpressure drop cheap for the sender: sockets pushed once the ring had room again, and
	// retransmissions passed unlogged while it was full (their bytes had a record already); and what keeps a
	// connection alive while the log is paused at its cap: segments of flows held back 2 s or more, logged
	// into the ring's reserve.
	Kicks, LoggedPassed, ReserveLogged uint64
	// Logs of finished connections freed.
	ReleasedConns, ReleasedBytes int64
	// The receive tap (what this host's protected sockets received, to check a restored peer's re-sent bytes).
	ReceivedBytes                                                     uint64
	ReceiveDropsBackpressure, ReceiveDropsOversize, ReceiveDropsError uint64
	ReceiveUnrecordedPassed                                           uint64 // passed unrecorded: the tap's consumer gone
}

// Predecessor is the member this agent's watchdog watches.
type Predecessor struct {
	Node string
	// BeatAge is how long ago its last heartbeat arrived; valid if Beaten.
	BeatAge time.Duration
	Beaten  bool
	// Busy: that heartbeat said it was checkpointing or restoring.
	Busy bool
}

// Failure is one recovery of the failure log.
type Failure struct {
	// ID names the failure: the histograms count each of its stages, and its whole duration, once.
	ID     string
	Done   bool
	Failed bool // it ended, or stopped, with an error
	// Fence: a node's record of fencing itself, no recovery (its protector's recovery restores the jobs):
	// its stages count, but not in ftkit_recoveries, unless it failed (a job it could not kill may run
	// twice), nor ever in ftkit_recovery_seconds.
	Fence bool
	// Duration is from detection to the end of the last stage; valid when Done.
	Duration time.Duration
	Stages   []Stage
}

// Stage is one finished stage of a recovery. Name must come from a fixed set (the caller maps the rest
// to "other"): it is a label.
type Stage struct {
	Name     string
	Duration time.Duration
	// Seq is the stage's place in its failure's timeline, counting the stages the bounded log dropped:
	// it stays the same from scrape to scrape, and a stage whose Seq was counted is not counted again.
	Seq int
}

// Buckets of the duration histograms, in seconds: a freeze or a stage takes milliseconds to minutes.
var (
	shortBuckets = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}
	stageBuckets = []float64{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}
	// Snapshot sizes: 64 KiB to 64 GiB.
	sizeBuckets = prometheus.ExponentialBuckets(64<<10, 4, 11)
)

// Metrics is one agent's registry: the collector over its Source, the event metrics, and the Go runtime's
// and process's collectors. The methods that record events may be called on a nil *Metrics (an agent built
// without metrics): they do nothing.
type Metrics struct {
	reg *prometheus.Registry
	own []prometheus.Collector // the ftkit_ metrics, all registered in reg

	snapshots      prometheus.Counter
	dumpSeconds    prometheus.Histogram
	frozenSeconds  prometheus.Histogram
	snapshotBytes  prometheus.Histogram
	shipped        prometheus.Counter
	shipFailures   prometheus.Counter
	shipBytes      prometheus.Counter
	shipWireBytes  prometheus.Counter
	shipSeconds    prometheus.Histogram
	shipThroughput prometheus.Gauge
	heartbeats     *prometheus.CounterVec
	suspicions     *prometheus.CounterVec
	busySilences   prometheus.Counter
	vouches        *prometheus.CounterVec
	beatGaps       *prometheus.HistogramVec
	controller     *prometheus.CounterVec
	detShipped     prometheus.Counter
	detLag         prometheus.Histogram
	detHoles       prometheus.Counter
}

// New builds the registry of an agent whose state src gives.
func New(src Source) *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		snapshots: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_snapshots_total",
			Help: "Snapshots of this host's jobs taken (committed to the local store)."}),
		dumpSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ftkit_snapshot_dump_seconds",
			Help: "Wall time of a snapshot's CRIU dump.", Buckets: shortBuckets}),
		frozenSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ftkit_snapshot_frozen_seconds",
			Help: "Time a job stood frozen for its snapshot (CRIU's frozen time).", Buckets: shortBuckets}),
		snapshotBytes: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ftkit_snapshot_size_bytes",
			Help: "Size of a snapshot in the local store.", Buckets: sizeBuckets}),
		shipped: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_snapshot_ships_total",
			Help: "Snapshots shipped to a protector, which verified and holds them."}),
		shipFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_snapshot_ship_failures_total",
			Help: "Snapshots that reached no protector (the job stays protected by its previous replica, if any)."}),
		shipBytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_snapshot_ship_bytes_total",
			Help: "Snapshot bytes shipped to protectors."}),
		shipWireBytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_snapshot_ship_wire_bytes_total",
			Help: "Bytes on the wire (compressed) of the snapshots shipped to protectors."}),
		shipSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ftkit_snapshot_ship_seconds",
			Help: "Wall time of shipping one snapshot to a protector.", Buckets: stageBuckets}),
		shipThroughput: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ftkit_snapshot_ship_throughput_bytes_per_second",
			Help: "Snapshot bytes per second of the last shipment (rate(ftkit_snapshot_ship_bytes_total) / rate(ftkit_snapshot_ship_seconds_sum) over a window)."}),
		heartbeats: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftkit_heartbeats_sent_total",
			Help: "Heartbeats to this node's protector, by result: sent, or failed (protector unreachable or the write failed)."},
			[]string{"result"}),
		suspicions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftkit_suspicions_total",
			Help: "Suspicions of the ring predecessor after heartbeat silence, by outcome: cleared (it was reachable), agent_unresponsive (its agent did not answer but its host did, and no fence command is configured: not failed over, since its jobs may still run there) or confirmed (declared failed)."},
			[]string{"outcome"}),
		busySilences: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_busy_silences_total",
			Help: "Times the ring predecessor was silent for heartbeat.timeout while its last beat said it was checkpointing or restoring, and its host still answered a TCP handshake: left alone, up to heartbeat.busy_grace (not a suspicion)."}),
		vouches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftkit_stall_vouches_total",
			Help: "Times this agent heard from neither ring neighbour for fence_timeout after a stall of its own and asked its protector to vouch for it before killing its jobs, by outcome: vouched (jobs kept), refused (the protector declared it failed) or unanswered."},
			[]string{"outcome"}),
		beatGaps: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "ftkit_predecessor_heartbeat_gap_seconds",
			Help:    "Time between two consecutive heartbeats of a member as they arrived here, by where most of it went: sender (between its two writes, its interval included, on its own clock) or delivery (the network, or this agent late to read it). How close beats come to heartbeat.timeout.",
			Buckets: []float64{0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 3, 5, 10}},
			[]string{"late"}),
		controller: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftkit_log_controller_events_total",
			Help: "Decisions of the sender-side log's resource controller, by kind (snapshot-requested, spill, pause-consumer, ...)."},
			[]string{"kind"}),
		detShipped: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_determinants_shipped_total",
			Help: "Receive-order determinants of this host's jobs sent to their protectors."}),
		detLag: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ftkit_determinants_ship_lag_seconds",
			Help:    "Time from reading a batch of determinants off the recorder to sending it to its protector: the window in which a crash leaves orphans.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 14)}),
		detHoles: prometheus.NewCounter(prometheus.CounterOpts{Name: "ftkit_determinants_holes_total",
			Help: "Holes in a job's determinants (the recorder lost calls, or too many waited for a protector): a replay from the snapshot before a hole is refused."}),
	}
	// Series that exist from the start, so that rate() and alerts see the zeros.
	for _, r := range []string{"sent", "failed"} {
		m.heartbeats.WithLabelValues(r)
	}
	for _, o := range []string{"cleared", "agent_unresponsive", "confirmed"} {
		m.suspicions.WithLabelValues(o)
	}
	m.own = []prometheus.Collector{m.snapshots, m.dumpSeconds, m.frozenSeconds, m.snapshotBytes, m.shipped, m.shipFailures,
		m.shipBytes, m.shipWireBytes, m.shipSeconds, m.shipThroughput, m.heartbeats, m.suspicions, m.busySilences, m.vouches, m.beatGaps, m.controller,
		m.detShipped, m.detLag, m.detHoles,
		newCollector(src)}
	m.reg.MustRegister(append(m.own, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))...)
	return m
}

// Registry is the agent's registry (for tests, and for a caller that serves it another way).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// SnapshotTaken records a snapshot committed to the local store.
func (m *Metrics) SnapshotTaken(dump, frozen time.Duration, bytes int64) {
	if m == nil {
		return
	}
	m.snapshots.Inc()
	m.dumpSeconds.Observe(dump.Seconds())
	m.frozenSeconds.Observe(frozen.Seconds())
	m.snapshotBytes.Observe(float64(bytes))
}

// DeterminantsShipped records a batch of n determinants sent to a protector, lag after the oldest was read.
func (m *Metrics) DeterminantsShipped(n int, lag time.Duration) {
	if m == nil {
		return
	}
	m.detShipped.Add(float64(n))
	m.detLag.Observe(lag.Seconds())
}

// DeterminantsHole records a hole in a job's determinants.
func (m *Metrics) DeterminantsHole() {
	if m == nil {
		return
	}
	m.detHoles.Inc()
}

// SnapshotShipped records a snapshot a protector verified and holds: its bytes, wire bytes and wall time.
func (m *Metrics) SnapshotShipped(bytes, wire int64, took time.Duration) {
	if m == nil {
		return
	}
	m.shipped.Inc()
	m.shipBytes.Add(float64(max(bytes, 0)))
	m.shipWireBytes.Add(float64(max(wire, 0)))
	m.shipSeconds.Observe(took.Seconds())
	if took > 0 {
		m.shipThroughput.Set(float64(bytes) / took.Seconds())
	}
}

// ShipFailed records a snapshot that no protector took.
func (m *Metrics) ShipFailed() {
	if m == nil {
		return
	}
	m.shipFailures.Inc()
}

// Heartbeat records one heartbeat to the protector: sent, or not.
func (m *Metrics) Heartbeat(sent bool) {
	if m == nil {
		return
	}
	if sent {
		m.heartbeats.WithLabelValues("sent").Inc()
	} else {
		m.heartbeats.WithLabelValues("failed").Inc()
	}
}

// Suspicion records a suspicion of the predecessor and whether confirmation found it alive.
func (m *Metrics) Suspicion(alive bool) {
	if m == nil {
		return
	}
	if alive {
		m.suspicions.WithLabelValues("cleared").Inc()
	} else {
		m.suspicions.WithLabelValues("confirmed").Inc()
	}
}

// UnresponsiveAgent records a suspicion of the predecessor whose agent did not answer while its host did,
// not failed over for want of a fence command.
func (m *Metrics) UnresponsiveAgent() {
	if m == nil {
		return
	}
	m.suspicions.WithLabelValues("agent_unresponsive").Inc()
}

// BusySilence records a silence of a busy predecessor whose host still answers.
func (m *Metrics) BusySilence() {
	if m == nil {
		return
	}
	m.busySilences.Inc()
}

// Vouch records the outcome of a vouch this agent asked for after a stall (vouched, refused, unanswered).
func (m *Metrics) Vouch(outcome string) {
	if m == nil {
		return
	}
	m.vouches.WithLabelValues(outcome).Inc()
}

// HeartbeatGap records the time between two consecutive heartbeats of a member as they arrived, and
// whether the sender (rather than the delivery) spent most of it.
func (m *Metrics) HeartbeatGap(gap time.Duration, sender bool) {
	if m == nil {
		return
	}
	late := "delivery"
	if sender {
		late = "sender"
	}
	m.beatGaps.WithLabelValues(late).Observe(gap.Seconds())
}

// ControllerEvent records one decision of the log's controller. kind comes from the agent's own fixed set
// of event kinds (netlog/controller), never from the wire.
func (m *Metrics) ControllerEvent(kind string) {
	if m == nil {
		return
	}
	m.controller.WithLabelValues(kind).Inc()
}
