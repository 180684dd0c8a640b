package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// detectBench measures failure detection in the lab: crash -> failure confirmed by the protector over
// --crashes crashes (median, p95, max), what an idle agent (heartbeats and the watchdog) costs in CPU and
// bytes per node, and, with --soak, the false suspicions raised during a soak under load.
type detectBench struct {
	crashes int
	soak    time.Duration
	// Overrides of labcluster.FastDetection (0: its values), to try other timings.
	interval, timeout, probe time.Duration
	nice                     int
}

// options is the lab's agent options with the bench's detection timing.
func (d *detectBench) options(o labcluster.Options) labcluster.Options {
	o = labcluster.FastDetection(o)
	if d.interval > 0 {
		o.Heartbeat = d.interval
	}
	if d.timeout > 0 {
		o.HeartbeatTimeout = d.timeout
	}
	if d.probe > 0 {
		o.ProbeTimeout = d.probe
	}
	if d.nice != 0 {
		o.Nice = d.nice
	}
	return o
}

func (d *detectBench) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("detect", flag.ContinueOnError)
	fs.IntVar(&d.crashes, "crashes", 20, "node crashes to time")
	fs.DurationVar(&d.soak, "soak", 0, "also run a soak of this length under load and count false suspicions (0: none)")
	fs.DurationVar(&d.interval, "interval", 0, "heartbeat interval (0: labcluster.FastDetection's)")
	fs.DurationVar(&d.timeout, "timeout", 0, "heartbeat timeout (0: labcluster.FastDetection's)")
	fs.DurationVar(&d.probe, "probe", 0, "probe timeout (0: labcluster.FastDetection's)")
	fs.IntVar(&d.nice, "nice", 0, "the agents' heartbeat.nice (0: labcluster.FastDetection's)")
	return fs
}

// The lab's ring for the crash runs: 6 nodes, of which every other one is crashed (each crash leaves its
// protector and its other neighbour alive, as a single failure does).
var detectCrashOrder = []string{"node2", "node4", "node6"}

func (d *detectBench) run(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	if d.crashes <= 0 {
		return nil, nil, fmt.Errorf("detect: --crashes %d must be positive", d.crashes)
	}
	var lat []float64
	var idle *idleCost
	var hb agent.Config
	for len(lat) < d.crashes {
		got, cost, cfg, err := d.crashLab(ctx, log, binDir, min(len(detectCrashOrder), d.crashes-len(lat)), idle == nil)
		if err != nil {
			return nil, nil, err
		}
		lat = append(lat, got...)
		if cost != nil {
			idle, hb = cost, cfg
		}
	}
	slices.Sort(lat)
	metrics := append(detectionMetrics(lat),
		Metric{Name: "idle_agent_cpu", Value: idle.CPUPercent, Unit: "% of a core per node"},
		Metric{Name: "idle_agent_tx", Value: idle.TxBytesPerSec, Unit: "bytes/s per node"})
	settings := map[string]any{
		"crashes":         len(lat),
		"detection_ms":    lat,
		"lab":             "6 nodes, no jobs; node2, node4, node6 crashed in turn (lab.Crash: veth cut, processes killed)",
		"measured":        "lab.Crash called -> the protector's failure record says detected (crash and record on one clock)",
		"heartbeat":       map[string]any{"interval": hb.Heartbeat.Interval.String(), "timeout": hb.Heartbeat.Timeout.String(), "probe_timeout": hb.ProbeTimeout().String(), "nice": hb.Heartbeat.Nice},
		"idle_cost":       idle,
		"idle_cost_scope": "every agent's CPU (utime+stime) and its host's eth0 tx bytes over an idle period with no job: heartbeats, the watchdog, and whatever else an idle agent does (an upper bound of the heartbeat's cost)",
	}
	if d.soak > 0 {
		s, err := d.soakRun(ctx, log, binDir)
		if err != nil {
			return nil, nil, fmt.Errorf("soak: %w", err)
		}
		metrics = append(metrics, Metric{Name: "soak_false_suspicions", Value: float64(s.Suspicions), Unit: "count"},
			Metric{Name: "soak_false_failures", Value: float64(s.Failures), Unit: "count"},
			Metric{Name: "soak_heartbeat_gaps_over_half_timeout", Value: float64(s.Gaps.Count), Unit: "count"},
			Metric{Name: "soak_longest_heartbeat_gap", Value: s.Gaps.Longest, Unit: "ms"})
		settings["soak"] = s
	}
	return metrics, settings, nil
}

// detectionMetrics are the detection latencies' figures, from lat sorted.
func detectionMetrics(lat []float64) []Metric {
	return []Metric{
		{Name: "detection_median", Value: median(lat), Unit: "ms"}, // quantile's nearest rank is the upper middle of an even count
		{Name: "detection_p95", Value: quantile(lat, 0.95), Unit: "ms"},
		{Name: "detection_max", Value: lat[len(lat)-1], Unit: "ms"},
	}
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted)-1) + 0.5)
	return sorted[i]
}

type idleCost struct {
	Seconds       float64 `json:"seconds"`
	CPUPercent    float64 `json:"cpu_percent_per_node"`
	TxBytesPerSec float64 `json:"tx_bytes_per_s_per_node"`
	Nodes         int     `json:"nodes"`
}

// crashLab brings up a lab of 6 nodes, measures the idle cost if asked, then crashes n nodes one after
// the other and returns each crash's detection latency in ms.
func (d *detectBench) crashLab(ctx context.Context, log *slog.Logger, binDir string, n int, measureIdle bool) ([]float64, *idleCost, agent.Config, error) {
	l, err := lab.Up(ctx, lab.Config{ID: "fbdetect", Nodes: 6, Subnet: netip.MustParsePrefix("10.245.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, nil, agent.Config{}, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	c, err := labcluster.Start(ctx, l, d.options(labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: "warn"}))
	if err != nil {
		return nil, nil, agent.Config{}, err
	}
	cfg, err := agentconfig.LoadConfig(c.ConfigPath("node1"))
	if err != nil {
		return nil, nil, agent.Config{}, err
	}
	if err := waitEpochs(ctx, c, time.Minute); err != nil {
		return nil, nil, cfg, err
	}
	var cost *idleCost
	if measureIdle {
		if cost, err = measureIdleCost(ctx, l, 10*time.Second); err != nil {
			return nil, nil, cfg, err
		}
		log.Info("detect: idle cost", "cost", cost)
	}
	var lat []float64
	for _, node := range detectCrashOrder[:n] {
		crash := time.Now()
		if err := l.Crash(ctx, node); err != nil {
			return nil, nil, cfg, err
		}
		f, err := waitDetected(ctx, c, node, time.Minute)
		if err != nil {
			return nil, nil, cfg, err
		}
		ms := float64(f.Detected.Sub(crash)) / 1e6
		lat = append(lat, ms)
		log.Info("detect: crash", "node", node, "detected_ms", ms, "protector", f.Protector)
		// The next crash starts from a settled ring: every alive agent holds the view without node.
		if err := waitEpochs(ctx, c, time.Minute); err != nil {
			return nil, nil, cfg, err
		}
	}
	return lat, cost, cfg, nil
}

// waitEpochs waits until every alive agent answers with the same view epoch.
func waitEpochs(ctx context.Context, c *labcluster.Cluster, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		epochs := map[uint64]bool{}
		answered := true
		for _, h := range c.Lab.State().Hosts {
			if h.Crashed {
				continue
			}
			st, err := c.Client(h.Name).Status(ctx)
			if err != nil {
				answered = false
				break
			}
			epochs[st.Epoch] = true
		}
		if answered && len(epochs) == 1 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the agents' views did not settle within %s (epochs %v)", timeout, epochs)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// waitDetected returns the failure record of node once some alive agent has one.
func waitDetected(ctx context.Context, c *labcluster.Cluster, node string, timeout time.Duration) (*agent.Failure, error) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		for _, h := range c.Lab.State().Hosts {
			if h.Crashed {
				continue
			}
			fs, _ := c.Client(h.Name).Events(ctx)
			for _, f := range fs {
				if f.Node == node && f.Done {
					return f, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil, fmt.Errorf("no failure of %s detected within %s", node, timeout)
}

// measureIdleCost samples every agent's CPU time and its host's eth0 tx bytes over period.
func measureIdleCost(ctx context.Context, l *lab.Lab, period time.Duration) (*idleCost, error) {
	type sample struct{ cpuTicks, tx uint64 }
	take := func() (map[string]sample, error) {
		out := map[string]sample{}
		for _, h := range l.State().Hosts {
			if h.Crashed {
				continue
			}
			path, err := l.NetnsPath(h.Name)
			if err != nil {
				return nil, err
			}
			var s sample
			if s.cpuTicks, err = agentCPUTicks(l, h.Name); err != nil {
				return nil, err
			}
			if s.tx, err = ethTxBytes(path); err != nil {
				return nil, err
			}
			out[h.Name] = s
		}
		return out, nil
	}
	before, err := take()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(period):
	}
	after, err := take()
	if err != nil {
		return nil, err
	}
	secs := time.Since(start).Seconds()
	var ticks, tx uint64
	for name, a := range after {
		b := before[name]
		ticks += a.cpuTicks - b.cpuTicks
		tx += a.tx - b.tx
	}
	n := float64(len(after))
	// USER_HZ is 100 on Linux.
	return &idleCost{Seconds: secs, Nodes: len(after), CPUPercent: float64(ticks) / 100 / secs / n * 100, TxBytesPerSec: float64(tx) / secs / n}, nil
}

// agentCPUTicks is the utime+stime, in clock ticks (USER_HZ, 100 on Linux), of the agent in lab host
// host's network namespace.
func agentCPUTicks(l *lab.Lab, host string) (uint64, error) {
	path, err := l.NetnsPath(host)
	if err != nil {
		return 0, err
	}
	pids, err := lab.PIDsInNetns(path)
	if err != nil {
		return 0, err
	}
	var ticks uint64
	for _, pid := range pids {
		if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); strings.TrimSpace(string(comm)) == "ftagent" {
			t, err := procCPUTicks(pid)
			if err != nil {
				return 0, err
			}
			ticks += t
		}
	}
	return ticks, nil
}

// procCPUTicks is a process's utime+stime in clock ticks.
func procCPUTicks(pid int) (uint64, error) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return 0, err
	}
	s, err := p.Stat()
	return uint64(s.UTime + s.STime), err
}

func ethTxBytes(nsPath string) (uint64, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return 0, err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return 0, err
	}
	defer h.Close()
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		return 0, err
	}
	return eth0.Attrs().Statistics.TxBytes, nil
}

type soakResult struct {
	Seconds    float64 `json:"seconds"`
	Suspicions int     `json:"false_suspicions"` // "predecessor suspected" in any agent's log: every node is alive
	Cleared    int     `json:"cleared"`          // suspicions that confirmation refuted
	// BusySilences are silences of a node that said it was checkpointing (the 1 GiB job's dumps) while its
	// host answered: left alone within heartbeat.busy_grace, not suspicions.
	BusySilences int `json:"busy_silences"`
	LateChecks   int `json:"late_checks"`    // times a watchdog ran late and held suspicion back
	Failures     int `json:"false_failures"` // failure records: a live node declared failed
	// Gaps are the beats that arrived more than half a timeout after their sender's previous one (the
	// agents' "heartbeat gap" lines): the near misses, the suspicions among them, and which side spent
	// the time.
	Gaps        gapStats `json:"gaps"`
	Checkpoints int      `json:"checkpoints_1gib"`
	BulkBytes   int64    `json:"bulk_bytes"`
	Load        []string `json:"load"`
}

// soakRun runs a 4-node lab for d.soak with a CPU hog on every core in node1, a 1 GiB job on node2
// dumped every 20 s, and node3's eth0 shaped to 1 Gbit/s and saturated by a bulk flow to node4; every
// suspicion raised is false, since no node fails.
func (d *detectBench) soakRun(ctx context.Context, log *slog.Logger, binDir string) (*soakResult, error) {
	l, err := lab.Up(ctx, lab.Config{ID: "fbdsoak", Nodes: 4, Subnet: netip.MustParsePrefix("10.245.1.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	c, err := labcluster.Start(ctx, l, d.options(labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", Keep: 1, LogLevel: "info"})) // info: suspicions cleared and busy silences are counted from it
	if err != nil {
		return nil, err
	}
	res := &soakResult{Load: []string{
		fmt.Sprintf("node1: %d busy loops (one per core)", runtime.NumCPU()),
		"node2: memcounter --mb 1024 dumped and shipped every 20 s",
		"node3 eth0: tbf 1 Gbit/s, saturated by a TCP bulk flow to node4",
	}}
	// The hog: plain busy loops in node1's namespace; the lab's Down kills them with the namespace.
	for range runtime.NumCPU() {
		cmd := exec.Command("sh", "-c", "while :; do :; done")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := l.Start("node1", cmd); err != nil {
			return nil, err
		}
		defer func() { cmd.Process.Kill(); cmd.Wait() }()
	}
	job, err := c.Client("node2").StartJob(ctx, agent.JobSpec{Name: "big",
		Argv: []string{filepath.Join(binDir, "memcounter"), "--mb", "1024", "--steps", "100000000", "--delay", "100ms"}})
	if err != nil {
		return nil, err
	}
	nb := &netlogBench{lab: l, log: log}
	undo, err := nb.shapeHost("node3", 1e9)
	if err != nil {
		return nil, err
	}
	defer undo()
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	bulk, err := bulkFlow(sctx, l, "node3", "node4")
	if err != nil {
		return nil, err
	}
	// Only what the agents log during the soak counts (a ring that starts up has members not beating yet).
	logStart := map[string]int64{}
	for _, h := range l.State().Hosts {
		if fi, err := os.Stat(c.LogPath(h.Name)); err == nil {
			logStart[h.Name] = fi.Size()
		}
	}
	start := time.Now()
	// Dumps run beside the soak's clock: one 20 s after the previous one ended (a 1 GiB dump on a loaded
	// host takes a while), none once the soak is over.
	dumps := make(chan int, 1)
	go func() {
		n := 0
		defer func() { dumps <- n }()
		for {
			select {
			case <-sctx.Done():
				return
			case <-time.After(20 * time.Second):
			}
			reply, err := c.Client("node2").Checkpoint(sctx, job.ID)
			if err != nil || reply.Error != "" {
				if sctx.Err() == nil {
					log.Warn("detect soak: checkpoint failed", "err", err, "reply", reply.Error)
				}
				continue
			}
			n++
		}
	}()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(d.soak):
	}
	res.Seconds = time.Since(start).Seconds()
	stop()
	res.BulkBytes = <-bulk
	res.Checkpoints = <-dumps
	logs := map[string][]byte{}
	for _, h := range l.State().Hosts {
		b, err := os.ReadFile(c.LogPath(h.Name))
		if err != nil {
			return nil, err
		}
		b = b[min(logStart[h.Name], int64(len(b))):]
		logs[h.Name] = b
		res.Suspicions += strings.Count(string(b), "predecessor suspected")
		res.Cleared += strings.Count(string(b), "suspicion cleared")
		res.BusySilences += strings.Count(string(b), "predecessor silent while busy")
		res.LateChecks += strings.Count(string(b), "watchdog ran late")
		res.Gaps.add(string(b))
		fs, _ := c.Client(h.Name).Events(ctx)
		res.Failures += len(fs)
	}
	// A copy outlives the lab, for reading what was suspected and why.
	if kept, err := keepSoakLogs(logs); err != nil {
		log.Warn("detect soak: keep a copy of the agent log", "err", err)
	} else {
		log.Info("detect soak: agent logs kept", "files", kept)
	}
	log.Info("detect soak", "result", res)
	return res, nil
}

// keepSoakLogs writes each host's agent log of the soak to HOST.log in a new directory under os.TempDir()
// and returns their paths. The directory is made by MkdirTemp (a fresh name, 0700), as keepLogsOnError's:
// ftbench runs as root, and the fixed names in the shared /tmp these copies had could be a user's links.
func keepSoakLogs(logs map[string][]byte) (map[string]string, error) {
	dir, err := os.MkdirTemp("", "ftbench-detect-soak-")
	if err != nil {
		return nil, fmt.Errorf("create a directory for the soak's agent logs: %w", err)
	}
	kept := map[string]string{}
	var errs []error
	for host, b := range logs {
		path := filepath.Join(dir, host+".log")
		if err := os.WriteFile(path, b, 0o644); err != nil {
			errs = append(errs, err)
			continue
		}
		kept[host] = path
	}
	return kept, errors.Join(errs...)
}

// gapStats sums the "heartbeat gap" lines of agents' logs (agent/cluster.go).
type gapStats struct {
	Count    int     `json:"count"`
	OnSender int     `json:"on_sender"` // its beat was sent late; the rest arrived late (network, or the receiver stalled)
	Longest  float64 `json:"longest_ms"`
}

func (g *gapStats) add(log string) {
	for line := range strings.Lines(log) {
		if !strings.Contains(line, `msg="heartbeat gap"`) {
			continue
		}
		g.Count++
		if strings.Contains(line, `late="on the sender`) {
			g.OnSender++
		}
		for f := range strings.FieldsSeq(line) {
			if v, ok := strings.CutPrefix(f, "arrived_after="); ok {
				if d, err := time.ParseDuration(v); err == nil {
					g.Longest = max(g.Longest, float64(d)/float64(time.Millisecond))
				}
			}
		}
	}
}

// bulkFlow sends zeros from host from to host to over TCP until ctx ends; the channel gets the bytes sent.
func bulkFlow(ctx context.Context, l *lab.Lab, from, to string) (<-chan int64, error) {
	dst, err := l.Host(to)
	if err != nil {
		return nil, err
	}
	var ln net.Listener
	if err := l.Do(to, func() (err error) {
		ln, err = net.Listen("tcp4", net.JoinHostPort(dst.Addr.Addr().String(), "7690"))
		return err
	}); err != nil {
		return nil, err
	}
	go func() {
		c, err := ln.Accept()
		ln.Close()
		if err != nil {
			return
		}
		defer c.Close()
		go func() { <-ctx.Done(); c.Close() }()
		io.Copy(io.Discard, c)
	}()
	var conn net.Conn
	if err := l.Do(from, func() (err error) {
		conn, err = net.Dial("tcp4", net.JoinHostPort(dst.Addr.Addr().String(), "7690"))
		return err
	}); err != nil {
		ln.Close()
		return nil, err
	}
	done := make(chan int64, 1)
	go func() {
		go func() { <-ctx.Done(); conn.Close() }()
		buf := make([]byte, 256<<10)
		var n int64
		for {
			w, err := conn.Write(buf)
			n += int64(w)
			if err != nil {
				done <- n
				return
			}
		}
	}()
	return done, nil
}
