package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// The receive-order benchmark's 64-byte message stream: one receive call per message on the receiver, the
// worst case for a recorder that costs per call (an MPI rank polling for small messages). The sender writes
// roMsgsPerWrite messages at a time so that the receiver always finds the next one waiting: the rate is
// then the receiver's, calls per second, not the sender's or the moments the receiver sleeps in between
// (with one write per message the stream flipped between about 90,000 and 320,000 messages a second).
const (
	roMsgSize      = 64
	roMsgCount     = 1_000_000
	roMsgsPerWrite = 64
)

// roConfig is one agent configuration the benchmark compares: recording off, on with the default
// shipping interval, on with a shorter one, on with receive positions.
type roConfig struct {
	Name      string        `json:"name"`
	Order     bool          `json:"receive_order"`
	ShipEvery time.Duration `json:"ship_every_ns"` // 0: the default (record.DefaultShipEvery)
	Positions bool          `json:"receive_positions,omitempty"`
}

var roConfigs = []roConfig{{Name: "off"}, {Name: "on", Order: true}, {Name: "on_ship_2ms", Order: true, ShipEvery: 2 * time.Millisecond},
	{Name: "positions", Order: true, Positions: true}}

// roRun is one lab's measurements in one configuration: the stencil, then two message streams one after
// the other. The first is the agents' first, which also pays for their memory's first growth (on a
// hypervisor that backs a guest's memory on first touch, a good part of it: docs/mpi.md); the second
// shows what the same stream costs agents that run already.
type roRun struct {
	Config    string   `json:"config"`
	Order     bool     `json:"receive_order"`
	Round     int      `json:"round"`
	StencilS  float64  `json:"stencil_seconds"`   // stencil2d, every rank an agent job, interval 1h (compare's b)
	StencilOK bool     `json:"stencil_identical"` // every rank's checksum is the unprotected run's
	roStream           // the first message stream
	Second    roStream `json:"second_stream"`
}

// roStream is one message stream's measurements.
type roStream struct {
	MsgRate       float64 `json:"msg_rate"`             // messages/s, receiver's first byte to EOF
	MsgCalls      int64   `json:"msg_receive_calls"`    // receive calls that returned bytes
	RecvCPUS      float64 `json:"receiver_cpu_s"`       // the receiving job's own CPU time (the recorder runs in its calls)
	AgentCPUS     float64 `json:"agents_cpu_s"`         // every agent's CPU time during the message run
	ReceiverAgent float64 `json:"receiver_agent_cpu_s"` // the receiving host's agent alone
}

// benchReceiveOrder measures what recording receive-order determinants costs a job that never fails
// (docs/receive-order.md): in rounds, a lab per configuration (roConfigs: log.receive_order off, on, on
// with a shorter log.receive_order_ship_every, on with log.receive_positions), each running stencil2d at compare's size as agent jobs
// (compare's variant b: logging, the start snapshot only) and then a stream of 64-byte messages between two
// agent jobs whose receiver reads each message with a call of its own. Ratios are medians of per-round
// ratios.
func benchReceiveOrder(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	sz, err := compareSizeFromEnv()
	if err != nil {
		return nil, nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, nil, err
	}
	rounds := max(sz.Rounds, 3)
	metrics, runs, err := runReceiveOrder(ctx, log, binDir, self, sz, rounds)
	if err != nil {
		return nil, nil, err
	}
	settings := map[string]any{
		"size":     sz,
		"rounds":   rounds,
		"configs":  roConfigs,
		"order":    "the configurations take turns going first in successive rounds, a fresh lab each; ratios are medians of per-round ratios against off",
		"stencil":  "stencil2d, one rank per lab node, agent jobs with interval 1h: compare's variant b (sender-side log, the start snapshot)",
		"messages": map[string]any{"size": roMsgSize, "count": roMsgCount, "nodelay": true, "sender": fmt.Sprintf("agent job on node1, %d messages per write", roMsgsPerWrite), "receiver": "agent job on node2, one read of at most 64 bytes per call"},
		"cpu":      "receiver: the receiving job's getrusage (the recorder's in-kernel work runs in its receive calls); agents: utime+stime of every lab agent over the message run (recording, numbering, shipping to the protector, keeping there)",
		"runs":     runs,
	}
	return metrics, settings, nil
}

// runReceiveOrder runs the benchmark's rounds with the agents and stencil2d of binDir and self (a binary
// with ftbench's child roles) as the message jobs.
func runReceiveOrder(ctx context.Context, log *slog.Logger, binDir, self string, sz compareSize, rounds int) ([]Metric, []roRun, error) {
	prog, args, ref, err := stencilRun(ctx, binDir, sz)
	if err != nil {
		return nil, nil, err
	}
	jobs := &jobLauncher{prog: prog, sz: sz, args: args, ref: ref, log: log}
	var runs []roRun
	// Per configuration, per round: stencil seconds, and per stream the message rate and CPU per call.
	stencil, stencilRatio := map[string][]float64{}, map[string][]float64{}
	first, second := roStreamStats{}, roStreamStats{}
	for round := range rounds {
		byName := map[string]roRun{}
		for k := range roConfigs {
			cfg := roConfigs[(k+round)%len(roConfigs)] // the configurations take turns going first
			opts := cmpAgents(binDir, sz)
			opts.NoReceiveOrder, opts.ShipEvery, opts.ReceivePositions = !cfg.Order, cfg.ShipEvery, cfg.Positions
			var r roRun
			err := withLab(ctx, log, sz, opts, func(l *lab.Lab, c *labcluster.Cluster) error {
				st, err := jobs.run(ctx, c, "b", "1h", 0, 7700+10*round)
				if err != nil {
					return fmt.Errorf("stencil2d: %w", err)
				}
				if !st.Identical {
					return fmt.Errorf("stencil2d: checksums %v, want %s on every rank", st.Checksums, ref)
				}
				r.StencilS, r.StencilOK = st.Seconds, st.Identical
				if r.roStream, err = msgStream(ctx, c, self, 7705+10*round); err != nil {
					return err
				}
				r.Second, err = msgStream(ctx, c, self, 7706+10*round)
				return err
			})
			if err != nil {
				return nil, nil, fmt.Errorf("receive-order bench, round %d, %s: %w", round, cfg.Name, err)
			}
			r.Config, r.Order, r.Round = cfg.Name, cfg.Order, round
			byName[cfg.Name] = r
			runs = append(runs, r)
			log.Info("receive-order bench", "round", round, "config", cfg.Name, "stencil_s", round2(r.StencilS),
				"msgs_s", int(r.MsgRate), "second_msgs_s", int(r.Second.MsgRate), "receive_calls", r.MsgCalls,
				"agents_cpu_s", round2(r.AgentCPUS), "second_agents_cpu_s", round2(r.Second.AgentCPUS))
		}
		off := byName[roConfigs[0].Name]
		for name, r := range byName {
			stencil[name] = append(stencil[name], r.StencilS)
			stencilRatio[name] = append(stencilRatio[name], r.StencilS/off.StencilS)
			first.add(name, r.roStream, off.roStream)
			second.add(name, r.Second, off.Second)
		}
	}
	var metrics []Metric
	for i, cfg := range roConfigs {
		m := func(name string, v float64, unit string) {
			metrics = append(metrics, Metric{Name: name + "_" + cfg.Name, Value: v, Unit: unit})
		}
		m("stencil_seconds", median(stencil[cfg.Name]), "s")
		for _, st := range []struct {
			suffix string
			stats  roStreamStats
		}{{"", first}, {"_second", second}} {
			m("msg64_rate"+st.suffix, median(st.stats.rate[cfg.Name]), "msgs/s")
			m("msg64_receiver_cpu_per_call"+st.suffix, median(st.stats.recvCPU[cfg.Name]), "ns")
			m("msg64_agents_cpu_per_call"+st.suffix, median(st.stats.agentCPU[cfg.Name]), "ns")
			if i > 0 {
				m("msg64_rate_ratio"+st.suffix, median(st.stats.rateRatio[cfg.Name]), "x")
			}
		}
		if i > 0 {
			m("stencil_overhead", (median(stencilRatio[cfg.Name])-1)*100, "%")
		}
	}
	return metrics, runs, nil
}

// roStreamStats gathers one of the labs' message streams (the first or the second) per configuration, a
// value per round: the rate, the CPU per call, the rate against recording off's stream of the same round.
type roStreamStats struct {
	rate, recvCPU, agentCPU, rateRatio map[string][]float64
}

func (s *roStreamStats) add(config string, r, off roStream) {
	if s.rate == nil {
		s.rate, s.recvCPU, s.agentCPU, s.rateRatio = map[string][]float64{}, map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	}
	s.rate[config] = append(s.rate[config], r.MsgRate)
	s.recvCPU[config] = append(s.recvCPU[config], r.RecvCPUS/float64(r.MsgCalls)*1e9)
	s.agentCPU[config] = append(s.agentCPU[config], r.AgentCPUS/float64(r.MsgCalls)*1e9)
	s.rateRatio[config] = append(s.rateRatio[config], r.MsgRate/off.MsgRate)
}

// msgStream runs one stream of roMsgCount 64-byte messages from a job on node1 to a job on node2.
func msgStream(ctx context.Context, c *labcluster.Cluster, self string, port int) (roStream, error) {
	h2, err := c.Lab.Host("node2")
	if err != nil {
		return roStream{}, err
	}
	addr := netip.AddrPortFrom(h2.Addr.Addr(), uint16(port)).String()
	recv, err := c.Client("node2").StartJob(ctx, agent.JobSpec{Name: "msgrecv", Argv: []string{self}, Interval: "1h",
		Env: []string{streamtest.RoleEnv + "=msgrecv", "FTBENCH_ADDR=" + addr, "FTBENCH_MSG=" + strconv.Itoa(roMsgSize)}})
	if err != nil {
		return roStream{}, fmt.Errorf("start the receiver: %w", err)
	}
	defer c.Client("node2").Signal(context.WithoutCancel(ctx), recv.ID, syscall.SIGKILL)
	if err := waitOutput(ctx, recv.StdoutPath(), time.Minute); err != nil { // "ready": it listens
		return roStream{}, fmt.Errorf("receiver: %w", err)
	}
	before, err := agentsCPU(c)
	if err != nil {
		return roStream{}, err
	}
	send, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: "msgsend", Argv: []string{self}, Interval: "1h",
		Env: []string{streamtest.RoleEnv + "=bulksend", "FTBENCH_ADDR=" + addr,
			"FTBENCH_BYTES=" + strconv.Itoa(roMsgSize*roMsgCount), "FTBENCH_WRITE=" + strconv.Itoa(roMsgSize*roMsgsPerWrite)}})
	if err != nil {
		return roStream{}, fmt.Errorf("start the sender: %w", err)
	}
	defer c.Client("node1").Signal(context.WithoutCancel(ctx), send.ID, syscall.SIGKILL)
	for _, j := range []agent.Job{send, recv} {
		if err := waitExit(ctx, j, 5*time.Minute); err != nil {
			return roStream{}, err
		}
	}
	after, err := agentsCPU(c)
	if err != nil {
		return roStream{}, err
	}
	out, err := os.ReadFile(recv.StdoutPath())
	if err != nil {
		return roStream{}, err
	}
	var bytes, ns, calls, cpuNs int64
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if _, err := fmt.Sscanf(lines[len(lines)-1], "%d %d %d %d", &bytes, &ns, &calls, &cpuNs); err != nil || bytes != roMsgSize*roMsgCount {
		return roStream{}, fmt.Errorf("receiver said %q, want %d bytes and its times (%v)", out, roMsgSize*roMsgCount, err)
	}
	r := roStream{MsgRate: float64(roMsgCount) / (float64(ns) / 1e9), MsgCalls: calls, RecvCPUS: float64(cpuNs) / 1e9,
		ReceiverAgent: after["node2"] - before["node2"]}
	for h, v := range after {
		r.AgentCPUS += v - before[h]
	}
	return r, nil
}

// agentsCPU is the CPU time (user + system, seconds) of every lab host's agent.
func agentsCPU(c *labcluster.Cluster) (map[string]float64, error) {
	out := map[string]float64{}
	for _, h := range c.Lab.State().Hosts {
		t, err := agentCPUTicks(c.Lab, h.Name)
		if err != nil {
			return nil, fmt.Errorf("CPU time of %s's agent: %w", h.Name, err)
		}
		out[h.Name] = float64(t) / 100 // USER_HZ
	}
	return out, nil
}

// msgRecv is the msgrecv role: listen on FTBENCH_ADDR, print "ready", accept one connection and read it
// to EOF with reads of at most FTBENCH_MSG bytes; print "<bytes> <ns from first byte to EOF> <calls that
// returned bytes> <its own CPU ns>".
func msgRecv() error {
	size, err := strconv.Atoi(os.Getenv("FTBENCH_MSG"))
	if err != nil || size <= 0 {
		return fmt.Errorf("FTBENCH_MSG %q: must be a positive number of bytes", os.Getenv("FTBENCH_MSG"))
	}
	c, err := acceptOne(os.Getenv("FTBENCH_ADDR"))
	if err != nil {
		return err
	}
	buf := make([]byte, size)
	n, err := c.Read(buf)
	start := time.Now()
	total, calls := int64(n), int64(1)
	for err == nil {
		if n, err = c.Read(buf); n > 0 {
			total, calls = total+int64(n), calls+1
		}
	}
	elapsed := time.Since(start)
	if !errors.Is(err, io.EOF) {
		return err
	}
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return err
	}
	fmt.Printf("%d %d %d %d\n", total, elapsed.Nanoseconds(), calls, ru.Utime.Nano()+ru.Stime.Nano())
	return nil
}
