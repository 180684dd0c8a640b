package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// benchRestored measures whether a connection CRIU restored on a spare carries traffic at the rate the
// same connection did before the crash. A job on node1 and a timer on node2 exchange bursts of burstBytes
// over one connection; the timer times each (request to last byte, or first byte to acknowledgement).
// The job is dumped between two bursts (CRIU kills it; its connection waits under CRIU's network lock),
// node1 crashes, and the job is restored on spare1 with the fail-over's recipe (guard, address take-over,
// initial window, and restore.LowerPathMTU around CRIU's restore). The ratio is the median burst
// throughput after over before, with the job as the sender ("send_") and as the receiver ("recv_"). The
// same runs without LowerPathMTU ("criu_only") show what CRIU alone gives.
func benchRestored(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	criuBin, err := criu.FindBinary("")
	if err != nil {
		return nil, nil, err
	}
	const bursts = 15
	var metrics []Metric
	runs := map[string]any{}
	for _, v := range []struct {
		name   string
		push   bool
		mtuFix bool
		rate   uint64 // tbf bit/s on every host's eth0; 0: unshaped
	}{
		{"send_", false, true, 0}, {"send_criu_only_", false, false, 0},
		{"recv_", true, true, 0}, {"recv_criu_only_", true, false, 0},
		{"tbf_1gbit_send_", false, true, 1e9}, {"tbf_1gbit_send_criu_only_", false, false, 1e9},
		{"tbf_1gbit_recv_", true, true, 1e9}, {"tbf_1gbit_recv_criu_only_", true, false, 1e9},
	} {
		r, err := restoredRun(ctx, log, criuBin, bursts, v.push, v.mtuFix, v.rate)
		if err != nil {
			return nil, nil, fmt.Errorf("restored throughput %s(path MTU fix %v): %w", v.name, v.mtuFix, err)
		}
		runs[v.name+"run"] = r
		metrics = append(metrics,
			Metric{Name: v.name + "before_median", Value: r.BeforeMBps, Unit: "MB/s"},
			Metric{Name: v.name + "after_median", Value: r.AfterMBps, Unit: "MB/s"},
			Metric{Name: v.name + "ratio", Value: r.AfterMBps / r.BeforeMBps, Unit: "x"},
			Metric{Name: v.name + "restored_snd_mss", Value: float64(r.After.SndMSS), Unit: "bytes"},
		)
	}
	return metrics, map[string]any{"burst_bytes": burstBytes, "bursts_timed": bursts,
		"link": "veth + bridge between lab namespaces, unshaped, or (tbf_1gbit_) a tbf qdisc of 1 Gbit/s on every host's eth0, which charges each segment's headers", "target": "ratio >= 0.95 (issue 13)",
		"restore": "job dumped between bursts (CRIU kills it), node1 crashed, restored on spare1 with guard, address take-over, initcwnd 10 and, unless criu_only, restore.LowerPathMTU; image windows raised as restore.Rewrite does for a re-sent burst",
		"runs":    runs}, nil
}

// burstBytes is the size of one burst: long enough (tens of ms on the lab link) to be timed well.
const burstBytes = 32 << 20

type sockInfo struct {
	SndMSS uint32 `json:"snd_mss"`
	Advmss uint32 `json:"advmss"`
	Pmtu   uint32 `json:"pmtu"`
	Cwnd   uint32 `json:"cwnd"`
}

type restoredResult struct {
	RateBitS   uint64    `json:"rate_bit_s,omitempty"`
	JobSends   bool      `json:"job_sends"`
	MTUFix     bool      `json:"path_mtu_fix"`
	BeforeMBps float64   `json:"before_mb_s"`
	AfterMBps  float64   `json:"after_mb_s"`
	BeforeRuns []float64 `json:"before_runs_mb_s"`
	AfterRuns  []float64 `json:"after_runs_mb_s"`
	Before     sockInfo  `json:"before"`
	After      sockInfo  `json:"after"`
}

func restoredRun(ctx context.Context, log *slog.Logger, criuBin string, bursts int, push, mtuFix bool, rate uint64) (*restoredResult, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	l, err := lab.Up(ctx, lab.Config{ID: "fbrestor", Nodes: 2, Spares: 1, Subnet: netip.MustParsePrefix("10.243.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	if rate > 0 {
		for _, h := range []string{"node1", "node2", "spare1"} {
			if err := l.Do(h, func() error { return shapeEth0(rate) }); err != nil {
				return nil, fmt.Errorf("shape %s: %w", h, err)
			}
		}
	}
	node1, _ := l.Host("node1")
	node2, _ := l.Host("node2")
	flow := tcpflow.Tuple{Local: netip.AddrPortFrom(node1.Addr.Addr(), 40300), Remote: netip.AddrPortFrom(node2.Addr.Addr(), 7300)}

	mode := "FTBENCH_MODE=pull"
	if push {
		mode = "FTBENCH_MODE=push"
	}
	sink, err := streamtest.Start(l, "node2", nil, "bursttimer", "FTBENCH_ADDR="+flow.Remote.String(), mode)
	if err != nil {
		return nil, err
	}
	defer sink.Stop()
	if line, err := sink.Line(ctx); err != nil || line != "ready" {
		return nil, fmt.Errorf("timer said %q: %w", line, err)
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	// The sender as the agent's shim starts jobs: PID-namespace init and session leader.
	job := exec.Command(self)
	job.Env = append(os.Environ(), streamtest.RoleEnv+"=burstjob", "FTBENCH_LOCAL="+flow.Local.String(), "FTBENCH_PEER="+flow.Remote.String(), mode)
	job.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID, Setsid: true}
	if err := l.Start("node1", job); err != nil {
		return nil, err
	}
	jobDone := make(chan struct{})
	go func() { job.Wait(); close(jobDone) }()
	defer func() {
		job.Process.Kill()
		<-jobDone
	}()

	res := &restoredResult{RateBitS: rate, JobSends: !push, MTUFix: mtuFix}
	if res.BeforeRuns, err = timeBursts(ctx, sink, bursts); err != nil {
		return nil, fmt.Errorf("before the crash: %w", err)
	}
	if res.Before, err = readSockInfo(l, "node1", flow); err != nil {
		return nil, err
	}

	images, err := os.MkdirTemp("", "ftbench-restored-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(images)
	dumper, err := streamtest.Start(l, "node1", nil, "benchdump", fmt.Sprintf("FTBENCH_PID=%d", job.Process.Pid), "FTBENCH_DIR="+images, "FTBENCH_CRIU="+criuBin)
	if err != nil {
		return nil, err
	}
	defer dumper.Stop()
	if line, err := dumper.Line(ctx); err != nil || line != "dumped" {
		return nil, fmt.Errorf("dump of the job said %q: %w", line, err)
	}
	<-jobDone
	if err := l.Crash(ctx, "node1"); err != nil {
		return nil, err
	}
	conns, err := image.TCPConnections(images)
	if err != nil {
		return nil, err
	}
	if len(conns) != 1 || conns[0].Tuple != flow {
		return nil, fmt.Errorf("snapshot connections %+v, want one %v", conns, flow)
	}
	ic := conns[0]
	// The windows a fail-over's restore.Rewrite leaves when the peer holds a whole burst past the snapshot
	// (the crash in mid-burst): above any window the sink advertises later. A restored socket whose
	// peer's window exceeds its max_window resyncs its segment size on that ACK (tcp_ack_update_window),
	// which would hide what this benchmark measures.
	if wnd := uint32(burstBytes + restore.WindowMargin); ic.MaxWindow < wnd {
		if err := image.Apply(images, ic.Inode, image.Windows(max(ic.SndWnd, wnd), wnd)); err != nil {
			return nil, err
		}
	}
	runID, err := restore.RunID(images)
	if err != nil {
		return nil, err
	}
	var lowered restore.RouteEdit // nothing to put back without mtuFix
	if err := l.Do("spare1", func() error {
		if err := restore.Guard(ctx, runID, []ckpt.Conn{{Tuple: ic.Tuple, Inode: uint64(ic.Inode), InqSeq: ic.InqSeq, InqLen: ic.InqLen,
			OutqSeq: ic.OutqSeq, OutqLen: ic.OutqLen, Timestamp: ic.Timestamp}}, []netip.Addr{node1.Addr.Addr()}); err != nil {
			return err
		}
		if err := restore.TakeOver("eth0", node1.Addr); err != nil {
			return err
		}
		if _, err := restore.SetInitCwnd("eth0", restore.MinInitCwnd); err != nil {
			return err
		}
		if mtuFix {
			lowered, err = restore.LowerPathMTU("eth0")
		}
		return err
	}); err != nil {
		return nil, err
	}
	restorer, err := streamtest.Start(l, "spare1", nil, "benchrestore", "FTBENCH_DIR="+images, "FTBENCH_CRIU="+criuBin)
	if err != nil {
		return nil, err
	}
	defer restorer.Stop()
	line, err := restorer.Line(ctx)
	if perr := l.Do("spare1", lowered.PutBack); perr != nil {
		return nil, perr
	}
	if err != nil {
		return nil, fmt.Errorf("restore on spare1: %w", err)
	}
	log.Info("restored the job", "restorer", line, "job_sends", !push, "path_mtu_fix", mtuFix)
	if err := l.Do("spare1", func() error { return restore.Announce(ctx, "eth0", node1.Addr.Addr()) }); err != nil {
		return nil, err
	}
	if _, err := timeBursts(ctx, sink, 1); err != nil { // neighbour entries move, slow start
		return nil, fmt.Errorf("first burst after the restore: %w", err)
	}
	if res.AfterRuns, err = timeBursts(ctx, sink, bursts); err != nil {
		return nil, fmt.Errorf("after the restore: %w", err)
	}
	if res.After, err = readSockInfo(l, "spare1", flow); err != nil {
		return nil, err
	}
	res.BeforeMBps, res.AfterMBps = median(res.BeforeRuns), median(res.AfterRuns)
	log.Info("restored throughput", "rate_bit_s", rate, "job_sends", !push, "path_mtu_fix", mtuFix, "before_mb_s", res.BeforeMBps, "after_mb_s", res.AfterMBps,
		"before", res.Before, "after", res.After)
	return res, nil
}

// shapeEth0 puts a tbf qdisc of rate bit/s on eth0 of the calling thread's network namespace, as the
// netlog benchmark shapes its link (the lab's teardown removes it with the namespace).
func shapeEth0(rate uint64) error {
	eth0, err := netlink.LinkByName("eth0")
	if err != nil {
		return err
	}
	bytesPerSec := rate / 8
	burst := max(bytesPerSec/500, 128<<10) // 2 ms at rate: a whole GSO packet always fits
	return netlink.QdiscAdd(&netlink.Tbf{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: eth0.Attrs().Index, Handle: netlink.MakeHandle(1, 0), Parent: netlink.HANDLE_ROOT},
		Rate:       bytesPerSec,
		Limit:      uint32(bytesPerSec/100 + burst),
		Buffer:     uint32(burst * 1e9 / bytesPerSec >> 6), // the burst as time at rate, in 64 ns ticks
	})
}

// timeBursts asks the timer for n bursts and returns each one's throughput in MB/s.
func timeBursts(ctx context.Context, sink *streamtest.Child, n int) ([]float64, error) {
	var out []float64
	for range n {
		if _, err := fmt.Fprintln(sink.Stdin, "burst"); err != nil {
			return nil, err
		}
		line, err := sink.Line(ctx)
		if err != nil {
			return nil, err
		}
		var bytes, ns int64
		if _, err := fmt.Sscanf(line, "%d %d", &bytes, &ns); err != nil || ns <= 0 {
			return nil, fmt.Errorf("timer said %q", line)
		}
		out = append(out, float64(bytes)/1e6/(float64(ns)/1e9))
	}
	return out, nil
}

// readSockInfo reads the TCP_INFO of socket f on host with sock_diag.
func readSockInfo(l *lab.Lab, host string, f tcpflow.Tuple) (sockInfo, error) {
	socks, err := l.TCPSockets(host)
	if err != nil {
		return sockInfo{}, err
	}
	i, ok := socks[f]
	if !ok {
		return sockInfo{}, fmt.Errorf("no socket %v on %s", f, host)
	}
	return sockInfo{SndMSS: i.Snd_mss, Advmss: i.Advmss, Pmtu: i.Pmtu, Cwnd: i.Snd_cwnd}, nil
}

// burstTimer is the bursttimer role, the end that is never restored: listen on FTBENCH_ADDR, print
// "ready", accept one connection; for each line on stdin time one burst of burstBytes and print "<bytes>
// <ns>". FTBENCH_MODE "pull": ask the job for a burst (a 4-byte big-endian count) and read it; "push":
// send a burst and wait for the job's 1-byte acknowledgement that it read all of it.
func burstTimer() error {
	push := os.Getenv("FTBENCH_MODE") == "push"
	c, err := acceptOne(os.Getenv("FTBENCH_ADDR"))
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	in := make([]byte, 1)
	for {
		if _, err := os.Stdin.Read(in); err != nil {
			return nil // the benchmark is done
		}
		if in[0] != '\n' {
			continue
		}
		start := time.Now()
		if push {
			if err := writeBurst(c, buf, burstBytes); err != nil {
				return err
			}
			if _, err := io.ReadFull(c, in); err != nil {
				return fmt.Errorf("acknowledgement of a burst: %w", err)
			}
		} else {
			if _, err := c.Write(binary.BigEndian.AppendUint32(nil, burstBytes)); err != nil {
				return err
			}
			if err := readBurst(c, buf, burstBytes); err != nil {
				return err
			}
		}
		fmt.Printf("%d %d\n", burstBytes, time.Since(start).Nanoseconds())
	}
}

// burstJob is the burstjob role, the end that is restored: connect from FTBENCH_LOCAL to FTBENCH_PEER.
// FTBENCH_MODE "pull": for each 4-byte count read, write that many bytes; "push": read bursts of
// burstBytes, acknowledging each with one byte.
func burstJob() error {
	push := os.Getenv("FTBENCH_MODE") == "push"
	local, err := netip.ParseAddrPort(os.Getenv("FTBENCH_LOCAL"))
	if err != nil {
		return err
	}
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(local)}
	c, err := d.Dial("tcp4", os.Getenv("FTBENCH_PEER"))
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	var req [4]byte
	for {
		if push {
			if err := readBurst(c, buf, burstBytes); err != nil {
				return err
			}
			if _, err := c.Write(req[:1]); err != nil {
				return err
			}
			continue
		}
		if _, err := io.ReadFull(c, req[:]); err != nil {
			return err
		}
		if err := writeBurst(c, buf, int(binary.BigEndian.Uint32(req[:]))); err != nil {
			return err
		}
	}
}

// writeBurst writes n bytes of buf's size at a time.
func writeBurst(c net.Conn, buf []byte, n int) error {
	for n > 0 {
		w, err := c.Write(buf[:min(n, len(buf))])
		if err != nil {
			return err
		}
		n -= w
	}
	return nil
}

// readBurst reads exactly n bytes into buf, over and over.
func readBurst(c net.Conn, buf []byte, n int) error {
	for n > 0 {
		r, err := c.Read(buf[:min(n, len(buf))])
		if err != nil {
			return fmt.Errorf("burst: %d bytes missing: %w", n, err)
		}
		n -= r
	}
	return nil
}

// benchDump is the benchdump role: CRIU dumps FTBENCH_PID into FTBENCH_DIR and kills it (the connection
// stays frozen under CRIU's network lock), then it prints "dumped". CRIU is forked from a process in the
// node's namespace, as the agent does.
func benchDump() error {
	pid, err := strconv.Atoi(os.Getenv("FTBENCH_PID"))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := (criu.Client{Binary: os.Getenv("FTBENCH_CRIU")}).Dump(ctx, criu.DumpOptions{PID: pid, ImagesDir: os.Getenv("FTBENCH_DIR")}); err != nil {
		return err
	}
	fmt.Println("dumped")
	return nil
}

// benchRestore is the benchrestore role: CRIU restores FTBENCH_DIR in this namespace as this process's
// child, it prints "pid <pid>" and stays the restored tree's parent (a subreaper, as the agent's shim),
// reaping it, until killed.
func benchRestore() error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pid, err := (criu.Client{Binary: os.Getenv("FTBENCH_CRIU")}).Restore(ctx, criu.RestoreOptions{ImagesDir: os.Getenv("FTBENCH_DIR")})
	if err != nil {
		return fmt.Errorf("%w (log in %s)", err, filepath.Join(os.Getenv("FTBENCH_DIR"), "restore.log"))
	}
	fmt.Printf("pid %d\n", pid)
	for {
		var ws unix.WaitStatus
		if _, err := unix.Wait4(-1, &ws, 0, nil); errors.Is(err, unix.ECHILD) {
			select {} // killed by the benchmark
		}
	}
}
