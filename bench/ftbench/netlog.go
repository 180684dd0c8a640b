package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/prometheus/procfs"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/internal/coldcopy"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/internal/threadcpu"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/capture"
	"github.com/ftkit/ftkit/tcpflow"
)

// A re-executed ftbench runs one side of benchNetlog's traffic instead of the
// benchmarks (streamtest.Start, streamtest.ChildMain): the sender must be a
// process of its own so that it can be born in the protected cgroup, as a job
// is. No watchdog: a bulk run may take minutes.
func init() {
	streamtest.ChildMain(map[string]func() error{"bulkrecv": bulkRecv, "bulksend": bulkSend, "msgrecv": msgRecv,
		"bursttimer": burstTimer, "burstjob": burstJob, "benchdump": benchDump, "benchrestore": benchRestore,
		"ppserve": ppServe, "ppclient": ppClient}, 0)
}

// acceptOne is how a role that serves one connection starts: listen on addr, print "ready" (its starter
// waits for that line), accept one connection and close the listener (no listening socket is left for a
// snapshot to take).
func acceptOne(addr string) (net.Conn, error) {
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	fmt.Println("ready")
	return ln.Accept()
}

// bulkRecv is the bulkrecv role: listen on FTBENCH_ADDR, print "ready"; for
// each connection in turn read to EOF and print "<bytes> <ns from first byte
// to EOF>". It hashes nothing, unlike streamtest's recv, to cost the job
// only what receiving costs.
func bulkRecv() error {
	addr := os.Getenv("FTBENCH_ADDR")
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		return err
	}
	fmt.Println("ready")
	buf := make([]byte, 1<<20)
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		n, err := c.Read(buf)
		start := time.Now()
		total := int64(n)
		for err == nil {
			n, err = c.Read(buf)
			total += int64(n)
		}
		elapsed := time.Since(start)
		c.Close()
		if !errors.Is(err, io.EOF) {
			return err
		}
		fmt.Printf("%d %d\n", total, elapsed.Nanoseconds())
	}
}

// bulkSend is the bulksend role: connect to FTBENCH_ADDR and send
// FTBENCH_BYTES bytes of pseudo-random data in writes of FTBENCH_WRITE bytes
// (TCP_NODELAY on, Go's default), then close.
func bulkSend() error {
	addr := os.Getenv("FTBENCH_ADDR")
	total, err := strconv.ParseInt(os.Getenv("FTBENCH_BYTES"), 10, 64)
	if err != nil {
		return fmt.Errorf("FTBENCH_BYTES: %w", err)
	}
	wsize, err := strconv.Atoi(os.Getenv("FTBENCH_WRITE"))
	if err != nil || wsize <= 0 {
		return fmt.Errorf("FTBENCH_WRITE %q: must be a positive number of bytes", os.Getenv("FTBENCH_WRITE"))
	}
	data := make([]byte, max(wsize, 1<<20))
	_, _ = rand.NewChaCha8([32]byte{1}).Read(data)
	shadow, err := newShadowCopy(os.Getenv("FTBENCH_COPY"), data)
	if err != nil {
		return err
	}
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		return err
	}
	if err := c.(*net.TCPConn).SetNoDelay(true); err != nil {
		return err
	}
	for sent, off := int64(0), 0; sent < total; {
		n := int(min(int64(wsize), total-sent))
		if off+n > len(data) {
			off = 0
		}
		if _, err := c.Write(data[off : off+n]); err != nil {
			return err
		}
		shadow.sent(off, n)
		sent += int64(n)
		off += n
	}
	if err := c.Close(); err != nil {
		return err
	}
	copied, cpu, err := shadow.finish()
	if err != nil {
		return err
	}
	fmt.Printf("copied %d %d\n", copied, cpu.Nanoseconds())
	return nil
}

// netlogWarmup is what a capture logs before each measured transfer, not measured.
const netlogWarmup = 256 << 20

// netlogLink is one link setting of the bulk benchmark.
type netlogLink struct {
	Name  string `json:"name"`
	Rate  uint64 `json:"rate_bit_s,omitempty"` // tbf rate on the sender's eth0; 0: unshaped veth
	Bytes int64  `json:"bytes_per_run"`
	Bound bool   `json:"copy_bound,omitempty"` // also run the copy modes (netlogbound.go)
	// ParkTake also times, after each parked run, the take of parkTakeBytes parked clones into the log.
	ParkTake bool `json:"park_take,omitempty"`
}

// netlogRun is what one transfer measured.
type netlogRun struct {
	bytes      int64
	ns         int64   // receiver: first byte to EOF
	jobCPU     float64 // seconds: cgroup v2 cpu.stat of sender + receiver
	captureCPU float64 // seconds: getrusage(RUSAGE_SELF) of ftbench: the consumer, the trimmer, the runtime, the harness
	threadCPU  float64 // seconds: the consumer thread's own (capture.Counters.ConsumerCPU)
	systemCPU  float64 // seconds: busy time of all CPUs from /proc/stat
	probeCPU   float64 // seconds: the TCX program's run time (modeProbe only)
	copied     int64   // bytes the sender copied (the copy modes)
	copyCPU    float64 // seconds: the beside copier's thread CPU time (modeCopyBeside), the freeing thread's (modePark)
	logged     uint64  // payload bytes the probe logged or parked (retransmissions included)
	drops      uint64  // backpressure drops
	parked     uint64  // payload bytes parked (modeParked)
	freed      uint64  // parked bytes freed unread: trimmed while parked
	taken      uint64  // parked bytes a timed take copied into the log (netlogLink.ParkTake)
	takeNs     int64   // how long that take took
}

// benchNetlog measures what the sender-side TCP log costs a bulk transfer and a
// stream of small messages between two lab hosts: runs with the Capture on the
// sender interleaved with runs without it, medians over the pairs.
func benchNetlog(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	const pairs = 5
	links := []netlogLink{
		{Name: "unshaped", Bytes: 8 << 30, Bound: true, ParkTake: true},
		// Issue 13's cluster rate: on a machine whose veth carries less, this is the unshaped link again.
		{Name: "tbf_25gbit", Rate: 25e9, Bytes: 4 << 30, Bound: true},
		{Name: "tbf_10gbit", Rate: 10e9, Bytes: 2 << 30},
		{Name: "tbf_1gbit", Rate: 1e9, Bytes: 256 << 20},
	}
	const msgSize, msgCount = 64, 300_000

	b, err := newNetlogBench(ctx, log)
	if err != nil {
		return nil, nil, err
	}
	defer b.close()

	// FTBENCH_NETLOG_LINKS=tbf_1gbit,msg64,cycle (link names, msg64 for the messages, cycle for logCycle) runs
	// only those; the copy floors always run.
	only := variantFilter(os.Getenv("FTBENCH_NETLOG_LINKS"))
	var metrics []Metric
	for _, lk := range links {
		if !only.has(lk.Name) {
			continue
		}
		m, err := b.linkSetting(ctx, lk, pairs)
		if err != nil {
			return nil, nil, fmt.Errorf("netlog bench, %s link: %w", lk.Name, err)
		}
		metrics = append(metrics, m...)
	}

	if only.has("msg64") {
		m, err := b.messages(ctx, pairs, msgSize, msgCount)
		if err != nil {
			return nil, nil, err
		}
		metrics = append(metrics, m...)
	}
	for _, f := range []struct {
		name string
		copy func(dst, src []byte) int
		fed  bool
	}{{"copy_floor_cpu_s_per_GB", func(dst, src []byte) int { return copy(dst, src) }, false},
		{"copy_floor_cold_cpu_s_per_GB", coldcopy.Copy, false}, {"copy_floor_cold_fed_cpu_s_per_GB", coldcopy.Copy, true}} {
		floor, err := copyFloor(pairs, f.copy, f.fed)
		if err != nil {
			return nil, nil, fmt.Errorf("netlog bench, %s: %w", f.name, err)
		}
		metrics = append(metrics, Metric{Name: f.name, Value: floor, Unit: "s/GB"})
	}
	if only.has("cycle") {
		first, steady, err := logCycle(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("netlog bench: %w", err)
		}
		metrics = append(metrics,
			Metric{Name: "log_cycle_first_fill_cpu_s_per_GB", Value: first.cpuPerGB, Unit: "s/GB"},
			Metric{Name: "log_cycle_first_fill_faults_per_GB", Value: first.faultsPerGB, Unit: "faults/GB"},
			Metric{Name: "log_cycle_cpu_s_per_GB", Value: steady.cpuPerGB, Unit: "s/GB"},
			Metric{Name: "log_cycle_faults_per_GB", Value: steady.faultsPerGB, Unit: "faults/GB"},
		)
		b.log.Info("netlog log cycle", "first_fill_cpu_s_per_gb", round2(first.cpuPerGB), "first_fill_faults_per_gb", int(first.faultsPerGB),
			"cpu_s_per_gb", round2(steady.cpuPerGB), "faults_per_gb", int(steady.faultsPerGB))
	}
	settings := map[string]any{
		"pairs":               pairs,
		"order":               "each round of a link runs without logging, with the logger's program alone, with the capture, with the parked capture (and, for copy_bound links, with each of the two copies alone and with the parked clones), rotating which goes first; the messages alternate without and with; metrics are medians over rounds, ratios are medians of per-round ratios",
		"program_alone":       "the TCX program protecting the sender's cgroup, its ring drained by a goroutine that keeps nothing, BPF run time statistics on: program_cpu_s_per_GB is the program's own run time (copies into the ring included) per GB, program_alone_throughput_ratio the throughput without the log's consumer",
		"copy_bound":          "links with copy_bound also run the transfer without any log but with the one copy of every sent byte that any sender-side log makes, at its two best places: in the sending thread after each write (copy_in_sender) and on a thread of the sender's own woken every 8 MiB (copy_beside, whose thread CPU per GB is copy_beside_cpu_s_per_GB); both copy from the sender's own buffer with the log's non-temporal copy into 256 MiB faulted in beforehand. copy_bound_throughput_ratio, the better of the two, bounds what any design that copies reaches on this machine. park: the ceiling of one that does not, each segment of the sender cloned to a tap device's queue by a TCX program (the clone shares the segment's pages) and freed every 40 ms by a read of its headers (which tell its flow and place; their TCP payload is checked against the bytes sent); park_program_cpu_s_per_GB is the program's run time, park_free_cpu_s_per_GB the freeing thread's (bench/ftbench/netlogbound.go)",
		"links":               links,
		"messages":            map[string]any{"size": msgSize, "count": msgCount, "nodelay": true, "link": "unshaped"},
		"topology":            "two lab hosts (network namespaces) on a bridge via veth pairs; sender in node1, receiver in node2, each a process of its own in a cgroup v2 child",
		"park_cap_bytes":      capture.DefaultParkCap,
		"parked":              "the same capture with capture.ParkOptions{} (defaults: segments of 4 KiB to 256 KiB cloned into a tap device with a queue per CPU and bucket of destinations, at most park_cap_bytes waiting, freed unread once trimmed, taken into the log past three quarters of that): parked_throughput_ratio against the run without logging, the consumer thread's CPU per GB logged or parked, and the fraction of the bytes freed unread (never copied); on links with park_take, after each parked run, half the default cap more is sent with nothing trimmed and the take a recovery's read starts with (capture.TakeParked) is timed: parked_take_ms_per_100MB",
		"capture":             "capture.New on node1 eth0, 64 MiB ring, sender's cgroup protected; log trimmed to the end of what it has seen every 50 ms (receiver checkpoints; to its contiguous end until 2026-12-05), no compression or spill; before each measured transfer the capture logs a 256 MiB one, not measured, so that the log's pool holds the slab buffers its trims freed, as a running agent's log does (since 2026-12-01; before, the measured transfer paid for faulting in its log's memory)",
		"cpu_job":             "cgroup v2 cpu.stat usage_usec of the sender and receiver cgroups: includes the probe's in-kernel work and the softirq work run in their context (no IRQ time accounting)",
		"cpu_consumer":        "getrusage(RUSAGE_SELF) of ftbench during a run: the Capture's consumer, the trimmer, the Go runtime and the harness's own goroutines",
		"cpu_consumer_thread": "the consumer thread's CLOCK_THREAD_CPUTIME_ID (capture.Counters.ConsumerCPU): what logging costs in user space, without the harness",
		"cpu_system":          "busy time of all CPUs from /proc/stat: includes other tenants of the machine, noisy",
		"copy_floor":          "one copy of each byte, in 64 KiB pieces, from a 64 MiB mapping (the ring's size) into 256 MiB of heap, on one locked thread (CLOCK_THREAD_CPUTIME_ID), median of `pairs` runs of 4 GiB: the least CPU per GB any consumer that copies the ring into user memory spends on this machine, with the built-in copy; copy_floor_cold: the same with coldcopy.Copy, the non-temporal copy the log uses; copy_floor_cold_fed: the same while another locked thread writes the ring at 10 Gbit/s (as the probe does on the sending CPU), the copy taking what was written each time 8 MiB more are (an eighth of the ring, when the probe wakes the consumer), only the copies timed",
		"gb":                  "1e9 bytes received",
		"log_cycle":           fmt.Sprintf("no network: one thread appends 64 KiB records to a netlog.Log at %.0f MB/s, a drain every %s, for a first fill and %d cycles of %s, each ended by a trim of everything (a receiver's snapshot); Age every %s as netlog/node runs it; CPU (RUSAGE_THREAD) and minor faults of that thread per GB appended, the first fill apart, the cycles' median", cycleRate/1e6, cyclePoll, cycleCount, cycleLen, cycleAge),
		"targets":             "issue 13: throughput ratio >= 0.80 unshaped and >= 0.97 at 25 Gbit/s; consumer <= 0.1 CPU-s per GB logged at every rate",
		"shaping_qdisc":       "tbf root qdisc on node1 eth0 (burst max(2 ms at rate, 128 KiB), queue 10 ms at rate plus burst)",
	}
	if only != nil {
		settings["only"] = "FTBENCH_NETLOG_LINKS=" + os.Getenv("FTBENCH_NETLOG_LINKS")
	}
	return metrics, settings, nil
}

// runOrder rotates the order of the modes in round i, so that drift in the machine's load does not
// favour one of them.
func runOrder(i int, modes ...netlogMode) []netlogMode {
	k := i % len(modes)
	return append(modes[k:len(modes):len(modes)], modes[:k]...)
}

func msgRate(r netlogRun, size int) float64 {
	return float64(r.bytes) / float64(size) / (float64(r.ns) / 1e9)
}

func (b *netlogBench) linkSetting(ctx context.Context, lk netlogLink, pairs int) ([]Metric, error) {
	undo, err := b.shape(lk.Rate)
	if err != nil {
		return nil, err
	}
	defer undo()
	var gbWith, gbWithout, ratios, probeRatios, probeCPU, cpuWith, cpuWithout, consumer, thread, sysWith, sysWithout []float64
	var senderRatios, besideRatios, besideCPU, parkRatios, parkProg, parkFree []float64
	var parkedRatios, parkedThread, parkedFreed, parkedTake []float64
	var drops uint64
	b.parkTake = lk.ParkTake
	modes := []netlogMode{modePlain, modeProbe, modeCapture, modeParked}
	if lk.Bound {
		modes = append(modes, modeCopySender, modeCopyBeside, modePark)
	}
	for i := range pairs {
		var set [numModes]netlogRun
		for _, mode := range runOrder(i, modes...) {
			r, err := b.run(ctx, mode, lk.Bytes, 256<<10)
			if err != nil {
				return nil, err
			}
			set[mode] = r
		}
		w, wo, po := set[modeCapture], set[modePlain], set[modeProbe]
		gbps := func(r netlogRun) float64 { return float64(r.bytes) * 8 / float64(r.ns) }
		perGB := func(cpu float64, r netlogRun) float64 { return cpu / (float64(r.bytes) / 1e9) }
		gbWith, gbWithout = append(gbWith, gbps(w)), append(gbWithout, gbps(wo))
		ratios = append(ratios, gbps(w)/gbps(wo))
		probeRatios = append(probeRatios, gbps(po)/gbps(wo))
		probeCPU = append(probeCPU, perGB(po.probeCPU, po))
		cpuWith = append(cpuWith, perGB(w.jobCPU+w.captureCPU, w))
		cpuWithout = append(cpuWithout, perGB(wo.jobCPU, wo))
		consumer = append(consumer, w.captureCPU/(float64(w.logged)/1e9))
		thread = append(thread, w.threadCPU/(float64(w.logged)/1e9))
		sysWith, sysWithout = append(sysWith, perGB(w.systemCPU, w)), append(sysWithout, perGB(wo.systemCPU, wo))
		drops += w.drops
		pd := set[modeParked]
		parkedRatios = append(parkedRatios, gbps(pd)/gbps(wo))
		parkedThread = append(parkedThread, pd.threadCPU/(float64(pd.logged)/1e9))
		parkedFreed = append(parkedFreed, float64(pd.freed)/float64(max(pd.logged, 1)))
		attrs := []any{"link", lk.Name, "pair", i, "gbit_s_without", round2(gbps(wo)), "gbit_s_parked", round2(gbps(pd)),
			"thread_cpu_s_per_gb", round2(pd.threadCPU / (float64(pd.logged) / 1e9)), "parked_mb", pd.parked >> 20, "freed_unread_mb", pd.freed >> 20, "drops", pd.drops}
		if lk.ParkTake { // only these runs timed a take: the others have none to divide by
			takeMs := float64(pd.takeNs) / 1e6 / (float64(pd.taken) / 1e8)
			parkedTake = append(parkedTake, takeMs)
			attrs = append(attrs, "taken_mb", pd.taken>>20, "take_ms_per_100mb", round2(takeMs))
		}
		b.log.Info("netlog parked", attrs...)
		if lk.Bound {
			cs, cb, pk := set[modeCopySender], set[modeCopyBeside], set[modePark]
			senderRatios, besideRatios = append(senderRatios, gbps(cs)/gbps(wo)), append(besideRatios, gbps(cb)/gbps(wo))
			besideCPU = append(besideCPU, perGB(cb.copyCPU, cb))
			parkRatios, parkProg, parkFree = append(parkRatios, gbps(pk)/gbps(wo)), append(parkProg, perGB(pk.probeCPU, pk)), append(parkFree, perGB(pk.copyCPU, pk))
			b.log.Info("netlog copy bound", "link", lk.Name, "pair", i, "gbit_s_without", round2(gbps(wo)),
				"gbit_s_copy_in_sender", round2(gbps(cs)), "gbit_s_copy_beside", round2(gbps(cb)), "beside_cpu_s_per_gb", round2(perGB(cb.copyCPU, cb)),
				"gbit_s_park", round2(gbps(pk)), "park_program_cpu_s_per_gb", round2(perGB(pk.probeCPU, pk)), "park_free_cpu_s_per_gb", round2(perGB(pk.copyCPU, pk)))
		}
		b.log.Info("netlog bulk", "link", lk.Name, "pair", i, "gbit_s_without", round2(gbps(wo)), "gbit_s_with", round2(gbps(w)),
			"cpu_s_per_gb_without", round2(perGB(wo.jobCPU, wo)), "cpu_s_per_gb_with", round2(perGB(w.jobCPU+w.captureCPU, w)), "drops", w.drops,
			"gbit_s_program_alone", round2(gbps(po)), "program_cpu_s_per_gb", round2(perGB(po.probeCPU, po)))
	}
	p := lk.Name + "_"
	var bound []Metric
	if lk.ParkTake {
		bound = append(bound, Metric{Name: p + "parked_take_ms_per_100MB", Value: median(parkedTake), Unit: "ms"})
	}
	if lk.Bound {
		bound = append(bound, []Metric{
			{Name: p + "copy_in_sender_throughput_ratio", Value: median(senderRatios), Unit: "x"},
			{Name: p + "copy_beside_throughput_ratio", Value: median(besideRatios), Unit: "x"},
			{Name: p + "copy_bound_throughput_ratio", Value: max(median(senderRatios), median(besideRatios)), Unit: "x"},
			{Name: p + "copy_beside_cpu_s_per_GB", Value: median(besideCPU), Unit: "s/GB"},
			{Name: p + "park_throughput_ratio", Value: median(parkRatios), Unit: "x"},
			{Name: p + "park_program_cpu_s_per_GB", Value: median(parkProg), Unit: "s/GB"},
			{Name: p + "park_free_cpu_s_per_GB", Value: median(parkFree), Unit: "s/GB"},
		}...)
	}
	return append([]Metric{
		{Name: p + "gbit_s_without", Value: median(gbWithout), Unit: "Gbit/s"},
		{Name: p + "gbit_s_with", Value: median(gbWith), Unit: "Gbit/s"},
		{Name: p + "throughput_ratio", Value: median(ratios), Unit: "x"},
		{Name: p + "program_alone_throughput_ratio", Value: median(probeRatios), Unit: "x"},
		{Name: p + "program_cpu_s_per_GB", Value: median(probeCPU), Unit: "s/GB"},
		{Name: p + "cpu_s_per_GB_without", Value: median(cpuWithout), Unit: "s/GB"},
		{Name: p + "cpu_s_per_GB_with", Value: median(cpuWith), Unit: "s/GB"},
		{Name: p + "consumer_cpu_s_per_GB_logged", Value: median(consumer), Unit: "s/GB"},
		{Name: p + "consumer_thread_cpu_s_per_GB_logged", Value: median(thread), Unit: "s/GB"},
		{Name: p + "system_cpu_s_per_GB_without", Value: median(sysWithout), Unit: "s/GB"},
		{Name: p + "system_cpu_s_per_GB_with", Value: median(sysWith), Unit: "s/GB"},
		{Name: p + "drops_backpressure", Value: float64(drops), Unit: "segments"},
		{Name: p + "parked_throughput_ratio", Value: median(parkedRatios), Unit: "x"},
		{Name: p + "parked_consumer_thread_cpu_s_per_GB_logged", Value: median(parkedThread), Unit: "s/GB"},
		{Name: p + "parked_freed_unread_fraction", Value: median(parkedFreed), Unit: "x"},
	}, bound...), nil
}

func round2(v float64) float64 { return float64(int64(v*100+0.5)) / 100 }

// netlogBench is the lab, cgroups and receiver the runs share.
type netlogBench struct {
	log      *slog.Logger
	lab      *lab.Lab
	dst      netip.AddrPort
	sendCg   *streamtest.Cgroup
	recvCg   *streamtest.Cgroup
	recv     *streamtest.Child
	cleanups []func()
	parkTake bool // the link's ParkTake
}

func newNetlogBench(ctx context.Context, log *slog.Logger) (b *netlogBench, err error) {
	// Fail before building the lab: the capture filters by cgroup v2.
	if _, err := streamtest.Cgroup2Mount(); err != nil {
		return nil, fmt.Errorf("netlog bench: %w", err)
	}
	l, err := lab.Up(ctx, lab.Config{ID: "fbnetlog", Nodes: 2, Subnet: netip.MustParsePrefix("10.247.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	b = &netlogBench{log: log, lab: l}
	b.cleanups = append(b.cleanups, func() {
		if err := l.Down(context.WithoutCancel(ctx)); err != nil {
			log.Error("netlog bench: lab down", "err", err)
		}
	})
	defer func() {
		if err != nil {
			b.close()
		}
	}()
	h2, err := l.Host("node2")
	if err != nil {
		return nil, err
	}
	b.dst = netip.AddrPortFrom(h2.Addr.Addr(), 5201)
	for _, cg := range []struct {
		cg  **streamtest.Cgroup
		suf string
	}{{&b.sendCg, "send"}, {&b.recvCg, "recv"}} {
		c, err := streamtest.NewCgroup(fmt.Sprintf("ftbench-netlog-%d-%s", os.Getpid(), cg.suf))
		if err != nil {
			return nil, err
		}
		// Lab down removes it too (after killing the lab's processes) should this process die first.
		if err := l.AddCleanup(c.Dir); err != nil {
			return nil, errors.Join(err, c.Close())
		}
		*cg.cg = c
		b.cleanups = append(b.cleanups, func() {
			if err := c.Close(); err != nil {
				log.Error("netlog bench: cgroup cleanup (lab down removes it too)", "err", err)
			}
		})
	}

	b.recv, err = streamtest.Start(l, "node2", b.recvCg, "bulkrecv", "FTBENCH_ADDR="+b.dst.String())
	if err != nil {
		return nil, err
	}
	// Runs before the cgroups and the lab go (LIFO), so the cgroup is empty when removed.
	b.cleanups = append(b.cleanups, b.recv.Stop)
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if line, err := b.recv.Line(lctx); err != nil || line != "ready" {
		return nil, fmt.Errorf("receiver on node2 said %q: %w", line, err)
	}
	return b, nil
}

// close frees everything in reverse order of creation: receiver, cgroups,
// then the lab.
func (b *netlogBench) close() {
	for i := len(b.cleanups) - 1; i >= 0; i-- {
		b.cleanups[i]()
	}
	b.cleanups = nil
}

// shape puts a tbf qdisc of rate bit/s on node1's eth0 (nothing for 0) and
// returns the function that removes it.
func (b *netlogBench) shape(rate uint64) (func(), error) { return b.shapeHost("node1", rate) }

// shapeHost is shape on host's eth0.
func (b *netlogBench) shapeHost(host string, rate uint64) (func(), error) {
	if rate == 0 {
		return func() {}, nil
	}
	path, err := b.lab.NetnsPath(host)
	if err != nil {
		return nil, err
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open %s's network namespace: %w", host, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("netlink in %s: %w", host, err)
	}
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("%s eth0: %w", host, err)
	}
	bytesPerSec := rate / 8
	burst := max(bytesPerSec/500, 128<<10) // 2 ms at rate: a whole GSO packet always fits
	qd := &netlink.Tbf{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: eth0.Attrs().Index, Handle: netlink.MakeHandle(1, 0), Parent: netlink.HANDLE_ROOT},
		Rate:       bytesPerSec,
		Limit:      uint32(bytesPerSec/100 + burst),
		// tbf takes the burst as the time to send it at rate, in 64 ns ticks.
		Buffer: uint32(burst * 1e9 / bytesPerSec >> 6),
	}
	if err := h.QdiscAdd(qd); err != nil {
		h.Close()
		return nil, fmt.Errorf("add tbf qdisc at %d bit/s on %s eth0: %w", rate, host, err)
	}
	b.log.Info("bench: shaped eth0", "host", host, "rate_bit_s", rate, "burst", burst)
	return func() {
		if err := h.QdiscDel(qd); err != nil {
			b.log.Error("bench: remove tbf qdisc from eth0 (lab down removes it too)", "host", host, "err", err)
		}
		h.Close()
	}, nil
}

// netlogMode is what runs on the sender's host during a transfer.
type netlogMode int

const (
	modePlain      netlogMode = iota // nothing
	modeProbe                        // the TCX program alone, its ring drained and discarded, BPF run time statistics on
	modeCapture                      // a Capture: the program and the log's consumer
	modeCopySender                   // no log: the sender copies what it sent after each write (netlogbound.go)
	modeCopyBeside                   // no log: a thread of the sender's copies what it sent, 8 MiB at a time
	modePark                         // no log: the segments' clones wait in a tap's queue, freed every poll
	modeParked                       // a Capture that parks segments (capture.ParkOptions): the parked log
	numModes
)

// copyEnv is the sender's FTBENCH_COPY for a copy mode.
var copyEnv = map[netlogMode]string{modeCopySender: "sender", modeCopyBeside: "beside"}

// run sends total bytes in writes of wsize from node1 to node2 with mode's logging of the sender's cgroup.
func (b *netlogBench) run(ctx context.Context, mode netlogMode, total int64, wsize int) (r netlogRun, err error) {
	if err := ctx.Err(); err != nil {
		return r, err
	}
	// The deferred closes below report into the function's err: nothing in their blocks may declare another.
	if mode == modeProbe {
		probe, perr := b.probeOnly()
		if perr != nil {
			return r, perr
		}
		defer func() {
			if cerr := probe.close(total); cerr != nil && err == nil {
				err = cerr
			}
		}()
		if r, err = b.transfer(ctx, nil, total, wsize); err != nil {
			return r, err
		}
		var rt time.Duration
		rt, _, err = probe.l.RunTime()
		r.probeCPU = rt.Seconds()
		return r, err
	}
	if env, ok := copyEnv[mode]; ok {
		return b.transfer(ctx, nil, total, wsize, "FTBENCH_COPY="+env)
	}
	if mode == modePark {
		p, err := b.parkClones()
		if err != nil {
			return r, err
		}
		r, err = b.transfer(ctx, nil, total, wsize)
		prog, freeing, cerr := p.close(b, total)
		r.probeCPU, r.copyCPU = prog.Seconds(), freeing.Seconds()
		return r, errors.Join(err, cerr)
	}
	var c *capture.Capture
	stopTrim := func() {}
	if mode == modeCapture || mode == modeParked {
		opts := capture.Options{Interface: "eth0", Logger: b.log}
		if mode == modeParked {
			opts.Park = &capture.ParkOptions{}
		}
		err = b.lab.Do("node1", func() error {
			var err error
			c, err = capture.New(opts)
			return err
		})
		if err != nil {
			return r, err
		}
		defer func() {
			if cerr := c.Close(); cerr != nil && err == nil {
				err = cerr
			}
		}()
		if err := c.ProtectCgroup(b.sendCg.Dir); err != nil {
			return r, err
		}
		stopTrim = sync.OnceFunc(trimLoop(c.Log(), 50*time.Millisecond))
	}
	defer stopTrim()
	if c != nil {
		// An agent's log lives as long as the agent, and its pool holds the slab buffers its trims
		// freed (netlog.Options.PoolKeep): the measured transfer logs into such a log, not into
		// fresh memory, which costs the consumer a page fault per 4 KiB.
		if _, err := b.transfer(ctx, c, netlogWarmup, 256<<10); err != nil {
			return r, fmt.Errorf("warm-up transfer: %w", err)
		}
	}
	if r, err = b.transfer(ctx, c, total, wsize); err != nil || mode != modeParked || !b.parkTake {
		return r, err
	}
	stopTrim()
	r.taken, r.takeNs, err = b.timeParkTake(ctx, c)
	return r, err
}

// parkTakeBytes is what timeParkTake leaves parked: less than three quarters of the park's default cap,
// past which the consumer would take clones into the log by itself.
const parkTakeBytes = capture.DefaultParkCap / 2

// timeParkTake sends parkTakeBytes more, nothing trimmed, so that their clones stay parked, and times
// the take that a recovery's read of a survivor's log starts with (capture.TakeParked): what the
// survivor does before it can send the restored job its bytes. It returns the bytes taken and the time.
func (b *netlogBench) timeParkTake(ctx context.Context, c *capture.Capture) (uint64, int64, error) {
	if _, err := b.transfer(ctx, c, parkTakeBytes, 256<<10); err != nil {
		return 0, 0, fmt.Errorf("transfer to park: %w", err)
	}
	var conn tcpflow.Tuple
	for _, cn := range c.Log().Conns() {
		if cn.Remote == b.dst {
			conn = cn
		}
	}
	before, err := c.Counters()
	if err != nil {
		return 0, 0, err
	}
	begin := time.Now()
	if err := c.TakeParked(ctx, conn); err != nil {
		return 0, 0, err
	}
	took := time.Since(begin)
	after, err := c.Counters()
	if err != nil {
		return 0, 0, err
	}
	if after.ParkWaitingBytes != 0 || after.ParkTakenBytes-before.ParkTakenBytes < uint64(parkTakeBytes)/2 {
		return 0, 0, fmt.Errorf("the take left %d bytes parked and took %d of the %d parked", after.ParkWaitingBytes,
			after.ParkTakenBytes-before.ParkTakenBytes, before.ParkWaitingBytes)
	}
	return after.ParkTakenBytes - before.ParkTakenBytes, took.Nanoseconds(), nil
}

// transfer runs one transfer of total bytes in writes of wsize, with c, if not nil, logging it, and
// measures it.
func (b *netlogBench) transfer(ctx context.Context, c *capture.Capture, total int64, wsize int, env ...string) (r netlogRun, err error) {
	before, err := b.cpuSnapshot()
	if err != nil {
		return r, err
	}
	var cntBefore capture.Counters
	if c != nil {
		if cntBefore, err = c.Counters(); err != nil {
			return r, err
		}
	}
	send, err := streamtest.Start(b.lab, "node1", b.sendCg, "bulksend", append([]string{"FTBENCH_ADDR=" + b.dst.String(),
		fmt.Sprintf("FTBENCH_BYTES=%d", total), fmt.Sprintf("FTBENCH_WRITE=%d", wsize)}, env...)...)
	if err != nil {
		return r, err
	}
	defer send.Stop()
	lctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	line, lerr := b.recv.Line(lctx)
	cancel()
	if lerr != nil {
		send.Stop() // a sender stuck without a receiver would never exit
	}
	werr := send.Wait()
	if lerr != nil || werr != nil {
		return r, fmt.Errorf("transfer of %d bytes: receiver: %v, sender: %v (stderr: %q)", total, lerr, werr, send.Stderr.String())
	}
	if _, err := fmt.Sscanf(line, "%d %d", &r.bytes, &r.ns); err != nil || r.bytes != total || r.ns <= 0 {
		return r, fmt.Errorf("receiver reported %q after %d bytes were sent", line, total)
	}
	if len(env) > 0 { // a copy mode: the sender says what it copied
		lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		line, err := send.Line(lctx)
		cancel()
		var ns int64
		if _, serr := fmt.Sscanf(line, "copied %d %d", &r.copied, &ns); err != nil || serr != nil || r.copied != total {
			return r, fmt.Errorf("sender reported %q (%v) after sending %d bytes with %v", line, err, total, env)
		}
		r.copyCPU = float64(ns) / 1e9
	}
	if c != nil {
		// Count the consumer's work on the tail of the transfer too: the ring drained, the clones freed.
		for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			if cnt, err := c.Counters(); err != nil || cnt.RingPendingBytes == 0 && cnt.ParkWaitingBytes == 0 {
				break
			}
		}
	}
	after, err := b.cpuSnapshot()
	if err != nil {
		return r, err
	}
	r.jobCPU = after.job - before.job
	r.captureCPU = after.self - before.self
	r.systemCPU = after.system - before.system
	if c != nil {
		cnt, err := c.Counters()
		if err != nil {
			return r, err
		}
		r.logged, r.drops = cnt.BytesLogged+cnt.BytesParked-cntBefore.BytesLogged-cntBefore.BytesParked, cnt.DropsBackpressure-cntBefore.DropsBackpressure
		r.parked, r.freed = cnt.BytesParked-cntBefore.BytesParked, cnt.ParkFreedBytes-cntBefore.ParkFreedBytes
		if r.logged < uint64(total) || cnt.AppendErrors+cnt.BadRecords+uint64(cnt.Conflicts)+cnt.ParkLost != 0 {
			return r, fmt.Errorf("capture logged or parked %d of %d bytes, %d append errors, %d bad records, %d conflicts, %d parked clones lost",
				r.logged, total, cnt.AppendErrors, cnt.BadRecords, cnt.Conflicts, cnt.ParkLost)
		}
		r.threadCPU = (cnt.ConsumerCPU - cntBefore.ConsumerCPU).Seconds()
	}
	return r, nil
}

// probeRun is the TCX program alone on node1's eth0, logging the sender's cgroup into its ring, which a
// goroutine drains and discards, with BPF run time statistics enabled until close: what the program costs
// the sender's path, without the log's consumer.
type probeRun struct {
	l      *ebpfprobes.TCPLogger
	stats  io.Closer
	cancel context.CancelFunc
	done   chan error
}

func (b *netlogBench) probeOnly() (*probeRun, error) {
	var l *ebpfprobes.TCPLogger
	err := b.lab.Do("node1", func() error {
		lk, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		if l, err = ebpfprobes.NewTCPLogger(ebpfprobes.TCPLoggerOptions{PollInterval: capture.DefaultPollInterval, Logger: b.log}); err != nil {
			return err
		}
		if err := l.Attach(lk.Attrs().Index); err != nil {
			l.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("the logger's program alone on node1: %w", err)
	}
	if err := l.Protect(b.sendCg.ID); err != nil {
		l.Close()
		return nil, err
	}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("enable BPF run time statistics: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &probeRun{l: l, stats: stats, cancel: cancel, done: make(chan error, 1)}
	go func() {
		for {
			if _, err := l.ReadBatch(ctx, 0, func([]byte) error { return nil }); err != nil {
				if ctx.Err() != nil {
					err = nil
				}
				p.done <- err
				return
			}
		}
	}()
	return p, nil
}

// close stops the drain, checks that the program logged every byte of a transfer of total bytes
// without drops that would have slowed it, and frees everything.
func (p *probeRun) close(total int64) error {
	p.cancel()
	err := <-p.done
	if cnt, cerr := p.l.Counters(); cerr != nil {
		err = errors.Join(err, cerr)
	} else if cnt.BytesLogged < uint64(total) || cnt.DropsOversize+cnt.DropsError != 0 {
		err = errors.Join(err, fmt.Errorf("the program alone logged %d of %d bytes (counters %+v)", cnt.BytesLogged, total, cnt))
	}
	return errors.Join(err, p.stats.Close(), p.l.Close())
}

// trimLoop trims every connection of lg to the end of what it has seen every period (netlog.Bounds.Seen:
// logged, parked or trimmed), as the receivers' checkpoints would, until the returned function is called.
// (Until 2026-12-05 it trimmed to the contiguous end; parked bytes are not in it until taken.)
func trimLoop(lg *netlog.Log, period time.Duration) func() {
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			for _, conn := range lg.Conns() {
				if bd, err := lg.Bounds(conn); err == nil {
					_, _ = lg.Trim(conn, netlog.Wire(bd.Seen))
				}
			}
		}
	}()
	return func() { close(stop); <-done }
}

type cpuSnap struct{ job, self, system float64 } // seconds

func (b *netlogBench) cpuSnapshot() (cpuSnap, error) {
	var s cpuSnap
	for _, dir := range []string{b.sendCg.Dir, b.recvCg.Dir} {
		v, err := cgroupUsage(dir)
		if err != nil {
			return s, err
		}
		s.job += v
	}
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return s, fmt.Errorf("getrusage: %w", err)
	}
	s.self = float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
	var err error
	s.system, err = procStatBusy()
	return s, err
}

// cgroupUsage reads usage_usec from a cgroup v2 cpu.stat (present without the
// cpu controller), in seconds.
func cgroupUsage(dir string) (float64, error) {
	raw, err := os.ReadFile(filepath.Join(dir, "cpu.stat"))
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(raw)) {
		if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
			us, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return float64(us) / 1e6, err
		}
	}
	return 0, fmt.Errorf("%s/cpu.stat has no usage_usec", dir)
}

// procStatBusy returns the busy time of all CPUs (user, nice, system, irq,
// softirq, steal) in seconds.
func procStatBusy() (float64, error) {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return 0, err
	}
	st, err := fs.Stat()
	if err != nil {
		return 0, err
	}
	c := st.CPUTotal
	return c.User + c.Nice + c.System + c.IRQ + c.SoftIRQ + c.Steal, nil
}

// copyFloor measures, runs times, the thread CPU seconds one copy of a GB costs on this machine the way the
// log's consumer copies (segments out of a 64 MiB ring mapping into log memory larger than any cache), and
// returns the median: the consumer's per-GB figure cannot go below it without a design that does not copy.
// copyFn is the copy measured: the built-in one, or the log's. fed: another thread writes each piece of the
// ring shortly before it is copied, as the probe does on the sending CPU, and competes for the memory; the
// copy then takes a batch of pieces at a time, and only the batches' copies are timed.
func copyFloor(runs int, copyFn func(dst, src []byte) int, fed bool) (float64, error) {
	const ring, dst, piece, total = 64 << 20, 256 << 20, 64 << 10, 4 << 30
	src, err := unix.Mmap(-1, 0, ring, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, fmt.Errorf("map a ring-sized source: %w", err)
	}
	defer unix.Munmap(src)
	_, _ = rand.NewChaCha8([32]byte{2}).Read(src)
	out := make([]byte, dst)
	_, _ = rand.NewChaCha8([32]byte{3}).Read(out) // fault every page in before the clock starts
	per := make([]float64, runs)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // the thread clock must be this goroutine's thread's alone
		defer runtime.UnlockOSThread()
		for i := range per {
			var feed *ringFeeder
			if fed {
				feed = newRingFeeder(src, piece, total)
			}
			spent, err := func() (float64, error) {
				defer feed.stop()
				var spent float64
				for n, at := 0, 0; n < total; {
					batch := total - n
					if feed != nil {
						batch = feed.await(n, feedBatch) // the wait for the writer is not timed
					}
					start, err := threadCPUSeconds()
					if err != nil {
						return 0, err
					}
					for end := n + batch; n < end; n += piece {
						off := n % ring
						copyFn(out[at:at+piece], src[off:off+piece])
						at = (at + piece) % dst
					}
					end, err := threadCPUSeconds()
					if err != nil {
						return 0, err
					}
					spent += end - start
					feed.copied(n)
				}
				return spent, nil
			}()
			if err != nil {
				errc <- err
				return
			}
			per[i] = spent / (float64(total) / 1e9)
		}
		errc <- nil
	}()
	if err := <-errc; err != nil {
		return 0, err
	}
	return median(per), nil
}

// feedBatch is how much a fed copy floor copies at a time: an eighth of the 64 MiB ring, when the logger's
// program wakes its consumer.
const feedBatch = 8 << 20

// feedRate is the rate at which a fed copy floor's ring is written: 10 Gbit/s, about what the unshaped veth
// carries here with the log.
const feedRate = 1.25e9

// ringFeeder is a thread that writes a ring piece by piece at feedRate bytes per second (never more than
// its reader freed), up to total bytes: the logger's program, which writes each segment into the ring on
// the sending CPU.
type ringFeeder struct {
	written, freed atomic.Int64
	quit, done     chan struct{}
}

func newRingFeeder(ring []byte, piece, total int) *ringFeeder {
	f := &ringFeeder{quit: make(chan struct{}), done: make(chan struct{})}
	data := make([]byte, piece)
	_, _ = rand.NewChaCha8([32]byte{4}).Read(data)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(f.done)
		began := time.Now()
		for n := 0; n < total; n += piece {
			// Ahead of the rate, or the ring is full (the reader is behind): wait.
			for float64(n) > feedRate*time.Since(began).Seconds() || int64(n+piece)-f.freed.Load() > int64(len(ring)) {
				select {
				case <-f.quit:
					return
				case <-time.After(100 * time.Microsecond):
				}
			}
			off := n % len(ring)
			copy(ring[off:off+piece], data)
			f.written.Store(int64(n + piece))
		}
	}()
	return f
}

// await waits until the writer is want bytes past n, or has written everything, and returns how far past n
// it is. The reader freed everything before n, so the writer can always get that far.
func (f *ringFeeder) await(n, want int) int {
	for {
		select {
		case <-f.done:
			return int(f.written.Load()) - n
		default:
		}
		if w := int(f.written.Load()); w-n >= want {
			return w - n
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// copied frees the ring up to n; nil does nothing (an unfed floor).
func (f *ringFeeder) copied(n int) {
	if f != nil {
		f.freed.Store(int64(n))
	}
}

// stop ends the writer, when the reader stopped early, and waits for it; nil does nothing.
func (f *ringFeeder) stop() {
	if f != nil {
		close(f.quit)
		<-f.done
	}
}

// threadCPUSeconds is threadcpu.Read in seconds.
func threadCPUSeconds() (float64, error) {
	d, err := threadcpu.Read()
	return d.Seconds(), err
}

// messages measures the stream of msgCount messages of msgSize bytes, with and without the capture.
func (b *netlogBench) messages(ctx context.Context, pairs, msgSize, msgCount int) ([]Metric, error) {
	var with, without, ratios, consumer, thread []float64
	for i := range pairs {
		var pair [numModes]netlogRun
		for _, mode := range runOrder(i, modePlain, modeCapture) {
			r, err := b.run(ctx, mode, int64(msgCount*msgSize), msgSize)
			if err != nil {
				return nil, fmt.Errorf("netlog bench, %d-byte messages: %w", msgSize, err)
			}
			pair[mode] = r
		}
		w, wo := msgRate(pair[modeCapture], msgSize), msgRate(pair[modePlain], msgSize)
		with, without, ratios = append(with, w), append(without, wo), append(ratios, w/wo)
		consumer = append(consumer, pair[modeCapture].captureCPU/float64(msgCount)*1e6)
		thread = append(thread, pair[modeCapture].threadCPU/float64(msgCount)*1e6)
		b.log.Info("netlog messages", "pair", i, "msgs_s_without", int(wo), "msgs_s_with", int(w))
	}
	return []Metric{
		{Name: "msg64_rate_without", Value: median(without), Unit: "msgs/s"},
		{Name: "msg64_rate_with", Value: median(with), Unit: "msgs/s"},
		{Name: "msg64_rate_ratio", Value: median(ratios), Unit: "x"},
		{Name: "msg64_consumer_cpu_per_million", Value: median(consumer), Unit: "s"},
		{Name: "msg64_consumer_thread_cpu_per_million", Value: median(thread), Unit: "s"},
	}, nil
}
