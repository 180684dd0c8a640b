package metrics

import (
	"maps"
	"sort"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// JobStates are the job states always reported by ftkit_jobs (0 when no job is in one); a record in
// another state is counted under its own.
var JobStates = []string{"running", "exited", "lost"}

// collector reads the agent's state at scrape time: what the agent keeps anyway is never counted twice.
type collector struct {
	src Source

	jobs, replicaAge, unreplicated, uncovered, unrecoverable                          *prometheus.Desc
	logMemory, logCap, logPooled, logRetained, logSpilled                             *prometheus.Desc
	logConns, paused                                                                  *prometheus.Desc
	consumerCPU                                                                       *prometheus.Desc
	logBytes, logPackets, logDrops, logKicks, logPassed, releasedConns, releasedBytes *prometheus.Desc
	logReserve                                                                        *prometheus.Desc
	parkWaiting, parkCap, parkedBytes, parkBytes                                      *prometheus.Desc
	receivedBytes, receiveDrops                                                       *prometheus.Desc
	beatAge, busy                                                                     *prometheus.Desc
	recoveries, stageSeconds, recoverySeconds                                         *prometheus.Desc

	// The recovery histograms accumulate here, each failure's stages and duration counted once: they are
	// built from the failure log, which is bounded (old failures, and the middle stages of a long one,
	// leave it), and a histogram rebuilt from what it holds at each scrape would go down, which Prometheus
	// reads as a reset. mu also orders the scrapes, so that an older state read by one never undoes what
	// a newer one counted.
	mu              sync.Mutex
	recoveryTotal   *hist
	stageTotals     map[string]*hist
	countedFailures map[string]*countedFailure // by failure id: those the log holds now
	// forgotten are the counts of failures the log dropped, oldest drop first, at most maxForgotten: a
	// dropped failure may come back (a newer copy from its protector, ordered by its update when it has no
	// detection time), and what was counted of it must not be counted again.
	forgotten []forgottenFailure
}

// maxForgotten bounds what the collector keeps of failures the log dropped: ids come from other members.
const maxForgotten = 1024

type forgottenFailure struct {
	id string
	cf *countedFailure
}

// countedFailure is what the histograms have counted of one failure.
type countedFailure struct {
	nextStage int  // the stages with a smaller Seq are counted
	done      bool // its end is counted (its duration, if it succeeded)
}

func newCollector(src Source) *collector {
	d := prometheus.NewDesc
	return &collector{
		src:           src,
		jobs:          d("ftkit_jobs", "Job records of this host, by state.", []string{"state"}, nil),
		replicaAge:    d("ftkit_job_replica_age_seconds", "Age of a running job's newest replica (since its protector had it): the work a failure of this host would lose is at most this old.", []string{"job"}, nil),
		unreplicated:  d("ftkit_jobs_unreplicated", "Running jobs with no replica on a protector yet: a failure of this host loses them.", nil, nil),
		unrecoverable: d("ftkit_jobs_unrecoverable", "Running jobs whose replica holds connections no restore could rebuild (a peer whose sends nobody logs, or one on this host dumped apart from the job; ftctl status: UNRECOVERABLE): a failure of this host now is refused for them, and a new snapshot does not change that.", nil, nil),
		uncovered:     d("ftkit_jobs_uncovered", "Running jobs whose replica lacks connections they opened since (the agent snapshots them again soon): a failure of this host now is refused for them.", nil, nil),

		logMemory:     d("ftkit_log_memory_bytes", "Memory of the sender-side log (RAM, pooled and compressed); less ftkit_log_pooled_bytes, compare with ftkit_log_memory_cap_bytes.", nil, nil),
		logCap:        d("ftkit_log_memory_cap_bytes", "Cap on the sender-side log's memory (log.memory_mib).", nil, nil),
		logPooled:     d("ftkit_log_pooled_bytes", "Part of ftkit_log_memory_bytes holding no logged bytes: buffers freed by trims, kept for reuse up to 10 minutes; not counted against the cap.", nil, nil),
		logRetained:   d("ftkit_log_retained_bytes", "Logged bytes retained for possible replay.", nil, nil),
		logSpilled:    d("ftkit_log_spilled_bytes", "Log bytes spilled to log.spill_dir.", nil, nil),
		logConns:      d("ftkit_log_connections", "Connections in the sender-side log.", nil, nil),
		paused:        d("ftkit_log_consumer_paused", "1 while the log is at its cap and stops draining the ring buffer (TCP backpressure on the jobs).", nil, nil),
		consumerCPU:   d("ftkit_log_consumer_cpu_seconds_total", "CPU time of the log consumer's thread: what logging costs in user space (the probe's copy into the ring runs in the senders' context).", nil, nil),
		logBytes:      d("ftkit_log_logged_bytes_total", "Payload bytes the egress probe wrote to the log, retransmissions included.", nil, nil),
		logPackets:    d("ftkit_log_logged_packets_total", "Segments the egress probe wrote to the log.", nil, nil),
		logDrops:      d("ftkit_log_drops_total", "Segments the log did not take, by reason: backpressure, oversize, error (dropped; TCP retransmits them), fragment (passed unlogged: must stay 0), consumer_gone (passed unlogged: the agent took nothing from the full ring for 4 s; the receivers are not recoverable until their next snapshot), append_error (a record the consumer could not append), park_lost (a parked clone missing or not the one expected: must stay 0).", []string{"reason"}, nil),
		logKicks:      d("ftkit_log_kicks_total", "Sockets the log pushed once its ring had room again after dropping their segments for backpressure, instead of leaving them to TCP's window probe timer (200 ms or more).", nil, nil),
		logPassed:     d("ftkit_log_logged_passed_total", "Segments passed unlogged while the log's ring was full because every byte of them had a record already (retransmissions).", nil, nil),
		logReserve:    d("ftkit_log_reserve_logged_total", "Segments of connections held back 2 s or more while the log was paused at its cap, let through its ring's reserve so that TCP does not give up on them.", nil, nil),
		parkWaiting:   d("ftkit_log_park_bytes", "Payload bytes waiting in parked clones of sent segments (log.park): kernel memory, outside ftkit_log_memory_bytes.", nil, nil),
		parkCap:       d("ftkit_log_park_cap_bytes", "Cap on ftkit_log_park_bytes (log.park_mib); past three quarters of it the oldest clones are taken into the log.", nil, nil),
		parkedBytes:   d("ftkit_log_parked_bytes_total", "Payload bytes the egress probe parked as clones instead of copying them into the log.", nil, nil),
		parkBytes:     d("ftkit_log_park_left_bytes_total", "Parked payload bytes that left the park, by fate: freed (unread: a receiver's snapshot covered them, nothing was copied) or taken (copied into the log: a recovery needed them, or the park was three quarters full).", []string{"fate"}, nil),
		releasedConns: d("ftkit_log_released_connections_total", "Logs of finished connections freed.", nil, nil),
		releasedBytes: d("ftkit_log_released_bytes_total", "Logged bytes the freed logs of finished connections still retained.", nil, nil),
		receivedBytes: d("ftkit_receive_recorded_bytes_total", "Payload bytes the receive tap recorded (digests of what protected sockets received).", nil, nil),
		receiveDrops:  d("ftkit_receive_drops_total", "Segments the receive tap did not record, by reason: backpressure, oversize, error (dropped; the sender retransmits them), consumer_gone (passed unrecorded: the agent took nothing from the full ring for 4 s; the senders' recoveries are refused until their next snapshots).", []string{"reason"}, nil),

		beatAge: d("ftkit_predecessor_heartbeat_age_seconds", "Time since the last heartbeat of the ring predecessor this agent watches (absent before the first).", []string{"node"}, nil),
		busy:    d("ftkit_predecessor_busy", "1 if the last heartbeat of the ring predecessor this agent watches said it was checkpointing or restoring (absent before the first).", []string{"node"}, nil),

		recoveries:      d("ftkit_recoveries", "Recoveries in the failure log, by state: running, done, failed. The log holds the newest failures and every member holds the same one: aggregate across agents with max, not sum.", []string{"state"}, nil),
		stageSeconds:    d("ftkit_recovery_stage_seconds", "Durations of the finished stages of the recoveries in the failure log (the same on every member), by stage; each counted once, kept when the bounded log drops it.", []string{"stage"}, nil),
		recoverySeconds: d("ftkit_recovery_seconds", "Durations of the finished recoveries in the failure log, from detection to the end of the last stage; each counted once, kept when the bounded log drops it.", nil, nil),

		recoveryTotal:   newHist(stageBuckets),
		stageTotals:     map[string]*hist{},
		countedFailures: map[string]*countedFailure{},
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.jobs, c.replicaAge, c.unreplicated, c.uncovered, c.unrecoverable, c.logMemory, c.logCap, c.logPooled, c.logRetained,
		c.logSpilled, c.logConns, c.paused, c.consumerCPU, c.logBytes, c.logPackets, c.logDrops, c.logKicks, c.logPassed, c.logReserve, c.parkWaiting, c.parkCap, c.parkedBytes, c.parkBytes, c.releasedConns, c.releasedBytes,
		c.receivedBytes, c.receiveDrops, c.beatAge, c.busy, c.recoveries, c.stageSeconds, c.recoverySeconds} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.src.MetricsState()
	c.collectJobs(ch, s.Jobs)
	if l := s.Log; l != nil {
		c.collectLog(ch, l)
	}
	if p := s.Predecessor; p != nil && p.Beaten {
		ch <- prometheus.MustNewConstMetric(c.beatAge, prometheus.GaugeValue, p.BeatAge.Seconds(), p.Node)
		busy := 0.0
		if p.Busy {
			busy = 1
		}
		ch <- prometheus.MustNewConstMetric(c.busy, prometheus.GaugeValue, busy, p.Node)
	}
	c.collectRecoveries(ch, s.Failures)
}

func (c *collector) collectJobs(ch chan<- prometheus.Metric, jobs []Job) {
	byState := map[string]int{}
	for _, s := range JobStates {
		byState[s] = 0
	}
	unreplicated, uncovered, unrecoverable := 0, 0, 0
	for _, j := range jobs {
		byState[j.State]++
		if j.State != "running" {
			continue
		}
		if !j.Replicated {
			unreplicated++
			continue
		}
		if j.Uncovered {
			uncovered++
		}
		if j.Unrecoverable {
			unrecoverable++
		}
		ch <- prometheus.MustNewConstMetric(c.replicaAge, prometheus.GaugeValue, j.ReplicaAge.Seconds(), j.ID)
	}
	for state, n := range byState {
		ch <- prometheus.MustNewConstMetric(c.jobs, prometheus.GaugeValue, float64(n), state)
	}
	ch <- prometheus.MustNewConstMetric(c.unreplicated, prometheus.GaugeValue, float64(unreplicated))
	ch <- prometheus.MustNewConstMetric(c.uncovered, prometheus.GaugeValue, float64(uncovered))
	ch <- prometheus.MustNewConstMetric(c.unrecoverable, prometheus.GaugeValue, float64(unrecoverable))
}

func (c *collector) collectLog(ch chan<- prometheus.Metric, l *Log) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(c.logMemory, float64(l.MemoryBytes))
	gauge(c.logCap, float64(l.CapBytes))
	gauge(c.logPooled, float64(l.PooledBytes))
	gauge(c.logRetained, float64(l.RetainedBytes))
	gauge(c.logSpilled, float64(l.SpilledBytes))
	gauge(c.logConns, float64(l.Conns))
	gauge(c.paused, b2f(l.ConsumerPaused))
	counter(c.consumerCPU, l.ConsumerCPU.Seconds())
	counter(c.logBytes, float64(l.BytesLogged))
	counter(c.logPackets, float64(l.PacketsLogged))
	counter(c.logDrops, float64(l.DropsBackpressure), "backpressure")
	counter(c.logDrops, float64(l.DropsOversize), "oversize")
	counter(c.logDrops, float64(l.DropsError), "error")
	counter(c.logDrops, float64(l.FragmentsPassed), "fragment")
	counter(c.logDrops, float64(l.UnloggedPassed), "consumer_gone")
	counter(c.logDrops, float64(l.AppendErrors), "append_error")
	counter(c.logDrops, float64(l.ParkLost), "park_lost")
	gauge(c.parkWaiting, float64(l.ParkWaitingBytes))
	gauge(c.parkCap, float64(l.ParkCapBytes))
	counter(c.parkedBytes, float64(l.BytesParked))
	counter(c.parkBytes, float64(l.ParkFreed), "freed")
	counter(c.parkBytes, float64(l.ParkTaken), "taken")
	counter(c.logKicks, float64(l.Kicks))
	counter(c.logPassed, float64(l.LoggedPassed))
	counter(c.logReserve, float64(l.ReserveLogged))
	counter(c.releasedConns, float64(l.ReleasedConns))
	counter(c.releasedBytes, float64(l.ReleasedBytes))
	counter(c.receivedBytes, float64(l.ReceivedBytes))
	counter(c.receiveDrops, float64(l.ReceiveDropsBackpressure), "backpressure")
	counter(c.receiveDrops, float64(l.ReceiveDropsOversize), "oversize")
	counter(c.receiveDrops, float64(l.ReceiveDropsError), "error")
	counter(c.receiveDrops, float64(l.ReceiveUnrecordedPassed), "consumer_gone")
}

// collectRecoveries summarizes the failure log: the gauge counts the failures it holds now; the histograms
// add what is new since the last scrape (a stage, a recovery's end), so that they only grow while the
// bounded log drops old failures. Call with c.mu held.
func (c *collector) collectRecoveries(ch chan<- prometheus.Metric, fs []Failure) {
	states := map[string]int{"running": 0, "done": 0, "failed": 0}
	present := make(map[string]bool, len(fs))
	for _, f := range fs {
		switch {
		case f.Failed:
			states["failed"]++
		case f.Fence: // a self-fence that killed its jobs is no recovery
		case f.Done:
			states["done"]++
		default:
			states["running"]++
		}
		present[f.ID] = true
		cf := c.countedFailures[f.ID]
		if cf == nil {
			cf = c.remembered(f.ID)
			c.countedFailures[f.ID] = cf
		}
		next := cf.nextStage
		for _, st := range f.Stages {
			if st.Seq < cf.nextStage {
				continue
			}
			h := c.stageTotals[st.Name]
			if h == nil {
				h = newHist(stageBuckets)
				c.stageTotals[st.Name] = h
			}
			h.observe(st.Duration.Seconds())
			next = max(next, st.Seq+1)
		}
		cf.nextStage = next
		if f.Done && !cf.done {
			cf.done = true
			if !f.Failed && !f.Fence {
				c.recoveryTotal.observe(f.Duration.Seconds())
			}
		}
	}
	// What the log no longer holds is not counted again (its totals stay): the memory stays bounded by
	// the log's, plus maxForgotten.
	for id, cf := range c.countedFailures {
		if !present[id] {
			delete(c.countedFailures, id)
			c.forgotten = append(c.forgotten, forgottenFailure{id, cf})
		}
	}
	if n := len(c.forgotten) - maxForgotten; n > 0 {
		c.forgotten = append(c.forgotten[:0:0], c.forgotten[n:]...)
	}
	for state, n := range states {
		ch <- prometheus.MustNewConstMetric(c.recoveries, prometheus.GaugeValue, float64(n), state)
	}
	total := c.recoveryTotal
	ch <- prometheus.MustNewConstHistogram(c.recoverySeconds, total.count, total.sum, maps.Clone(total.buckets))
	names := make([]string, 0, len(c.stageTotals))
	for n := range c.stageTotals {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		h := c.stageTotals[n]
		// A copy: the metric reads its buckets after Collect returns, when the next scrape may add to them.
		ch <- prometheus.MustNewConstHistogram(c.stageSeconds, h.count, h.sum, maps.Clone(h.buckets), n)
	}
}

// remembered takes what was counted of failure id out of the forgotten ones (the log dropped it and it came
// back), or starts it anew. Call with c.mu held.
func (c *collector) remembered(id string) *countedFailure {
	for i, f := range c.forgotten {
		if f.id == id {
			c.forgotten = append(c.forgotten[:i], c.forgotten[i+1:]...)
			return f.cf
		}
	}
	return &countedFailure{}
}

// hist accumulates a constant histogram: cumulative counts per upper bound.
type hist struct {
	count   uint64
	sum     float64
	bounds  []float64
	buckets map[float64]uint64
}

func newHist(bounds []float64) *hist {
	h := &hist{bounds: bounds, buckets: make(map[float64]uint64, len(bounds))}
	for _, b := range bounds {
		h.buckets[b] = 0
	}
	return h
}

func (h *hist) observe(v float64) {
	h.count++
	h.sum += v
	for _, b := range h.bounds {
		if v <= b {
			h.buckets[b]++
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
