package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// The large-messages benchmark's ping-pong: HPCC's LatencyBandwidth exchanges 2 MB messages, and its run
// under ftkit took 19 s against 1 s without (docs/mpi.md, "Large messages between protected ranks").
const (
	lmMsgSize  = 2 << 20
	lmRounds   = 300
	lmLabs     = 3
	lmWarmRuns = 3 // protected runs after the first in each lab
	// lmStall is the round trip counted as a stall: above any the unprotected ping-pong showed (37 ms at
	// most), below TCP's shortest timer (200 ms), which is what a stalled round trip waits for.
	lmStall = 100 * time.Millisecond
)

// The kinds of run: both ends plain processes; both ends agent jobs, the first traffic of their agents
// (the log's memory is new to them); the same again once the agents have run one.
const (
	lmPlain = "unprotected"
	lmFirst = "protected_first"
	lmWarmK = "protected_warm"
)

// lmRun is one ping-pong of lmRounds round trips in one lab.
type lmRun struct {
	Lab    int     `json:"lab"`
	Kind   string  `json:"kind"`
	MeanMS float64 `json:"mean_ms"`
	P50MS  float64 `json:"p50_ms"`
	P90MS  float64 `json:"p90_ms"`
	P99MS  float64 `json:"p99_ms"`
	MaxMS  float64 `json:"max_ms"`
	Stalls int     `json:"stalls"` // round trips above lmStall
	// The agents' drops over the run, summed over both hosts: segments the sender-side log's ring had no
	// room for (the sender's TCP sends them again) and segments the receive tap's ring had no room for (the
	// receiver never saw them: the sender retransmits on its timer).
	LogDrops uint64 `json:"log_backpressure_drops"`
	TapDrops uint64 `json:"tap_backpressure_drops"`
}

// benchLargeMessages measures 2 MB ping-pongs between two lab hosts, in each of lmLabs fresh labs: both
// ends plain processes in the hosts' namespaces, then both ends agent jobs (interval 1h: the sender-side
// log and the receive tap, no snapshot during the run) 1 + lmWarmRuns times. The first protected run is the
// first traffic of its agents, so the log's memory is new to them, as it is for a job's first large
// messages; the later ones reuse the log's freed buffers once the logs of earlier runs' connections are
// released (the third protected run of a lab usually finds them, the second is too early).
func benchLargeMessages(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, nil, err
	}
	var runs []lmRun
	for i := range lmLabs {
		labRuns, err := largeMessagesLab(ctx, log, binDir, self, i)
		if err != nil {
			return nil, nil, fmt.Errorf("large-messages bench, lab %d: %w", i, err)
		}
		for _, r := range labRuns {
			log.Info("large-messages bench", "lab", i, "kind", r.Kind, "mean_ms", round2(r.MeanMS), "p99_ms", round2(r.P99MS),
				"max_ms", round2(r.MaxMS), "stalls", r.Stalls, "log_drops", r.LogDrops, "tap_drops", r.TapDrops)
		}
		runs = append(runs, labRuns...)
	}
	var metrics []Metric
	for _, name := range []string{lmPlain, lmFirst, lmWarmK} {
		var mean, p50, p99, maxv, stalls, logDrops, tapDrops []float64
		for _, r := range runs {
			if r.Kind == name {
				mean, p50, p99, maxv = append(mean, r.MeanMS), append(p50, r.P50MS), append(p99, r.P99MS), append(maxv, r.MaxMS)
				stalls, logDrops, tapDrops = append(stalls, float64(r.Stalls)), append(logDrops, float64(r.LogDrops)), append(tapDrops, float64(r.TapDrops))
			}
		}
		m := func(metric string, v float64, unit string) {
			metrics = append(metrics, Metric{Name: "pingpong_2MB_" + metric + "_" + name, Value: v, Unit: unit})
		}
		m("mean", median(mean), "ms")
		m("p50", median(p50), "ms")
		m("p99", median(p99), "ms")
		m("max", median(maxv), "ms")
		m("stalls", median(stalls), "round trips")
		if name != lmPlain {
			m("log_drops", median(logDrops), "segments")
			m("tap_drops", median(tapDrops), "segments")
		}
	}
	// Per lab, each protected run's mean against the lab's unprotected one.
	ratios := map[string][]float64{}
	plain := map[int]float64{}
	for _, r := range runs {
		if r.Kind == lmPlain {
			plain[r.Lab] = r.MeanMS
		} else {
			ratios[r.Kind] = append(ratios[r.Kind], r.MeanMS/plain[r.Lab])
		}
	}
	for _, name := range []string{lmFirst, lmWarmK} {
		metrics = append(metrics, Metric{Name: "pingpong_2MB_mean_ratio_" + name, Value: median(ratios[name]), Unit: "x"})
	}
	settings := map[string]any{
		"message_bytes": lmMsgSize, "round_trips": lmRounds, "labs": lmLabs, "warm_runs_per_lab": lmWarmRuns, "stall_ms": lmStall.Milliseconds(),
		"order": "in each fresh 2-host lab (agents running, interval 1h): the unprotected ping-pong, then the protected one 1 + warm_runs_per_lab times, the first being the first traffic of its agents; metrics are medians over the runs of a kind, the ratios medians of each run's mean over its lab's unprotected mean",
		lmPlain: "server on node2 and client on node1, processes started in the hosts' namespaces",
		lmFirst: "the same two programs as agent jobs (sender-side log and receive tap on both hosts), the first run on fresh agents: the log's memory is touched for the first time",
		lmWarmK: "the same, later runs on the same agents: they write into pooled buffers once the earlier runs' logs are released (the third run usually, the second rarely)",
		"runs":  runs,
	}
	return metrics, settings, nil
}

// largeMessagesLab runs the unprotected ping-pong and then the protected ones in one fresh lab.
func largeMessagesLab(ctx context.Context, log *slog.Logger, binDir, self string, i int) (runs []lmRun, err error) {
	l, err := lab.Up(ctx, lab.Config{ID: "fblarge", Nodes: 2, Subnet: netip.MustParsePrefix("10.241.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, fmt.Errorf("lab up (if a previous run left it, `ftctl lab down --lab fblarge`): %w", err)
	}
	defer func() {
		if derr := l.Down(context.WithoutCancel(ctx)); derr != nil {
			err = errors.Join(err, fmt.Errorf("lab down: %w", derr))
		}
	}()
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: "warn"})
	if err != nil {
		return nil, err
	}
	h2, err := l.Host("node2")
	if err != nil {
		return nil, err
	}
	addr := func(port int) string { return netip.AddrPortFrom(h2.Addr.Addr(), uint16(port)).String() }
	out, err := plainPingPong(ctx, l, self, addr(7800))
	if err != nil {
		return nil, fmt.Errorf("unprotected: %w", err)
	}
	r, err := lmParse(out)
	if err != nil {
		return nil, fmt.Errorf("unprotected: %w", err)
	}
	r.Lab, r.Kind = i, lmPlain
	runs = append(runs, r)
	for k := range 1 + lmWarmRuns {
		kind := map[bool]string{true: lmFirst, false: lmWarmK}[k == 0]
		before, err := lmDrops(ctx, c)
		if err != nil {
			return nil, err
		}
		out, err := jobPingPong(ctx, c, self, addr(7801+k))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", kind, err)
		}
		after, err := lmDrops(ctx, c)
		if err != nil {
			return nil, err
		}
		r, err := lmParse(out)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", kind, err)
		}
		r.Lab, r.Kind = i, kind
		r.LogDrops, r.TapDrops = after[0]-before[0], after[1]-before[1]
		runs = append(runs, r)
	}
	return runs, nil
}

func ppEnv(role, addr string) []string {
	return []string{streamtest.RoleEnv + "=" + role, "FTBENCH_ADDR=" + addr, "FTBENCH_MSG=" + strconv.Itoa(lmMsgSize),
		"FTBENCH_ROUNDS=" + strconv.Itoa(lmRounds)}
}

// plainPingPong runs the server and the client as processes in the lab hosts' namespaces and returns
// the client's output.
func plainPingPong(ctx context.Context, l *lab.Lab, self, addr string) ([]byte, error) {
	srv := exec.CommandContext(ctx, self)
	srv.Env = append(os.Environ(), ppEnv("ppserve", addr)...)
	ready, err := srv.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var srvErr bytes.Buffer
	srv.Stderr = &srvErr
	if err := l.Start("node2", srv); err != nil {
		return nil, fmt.Errorf("start the server: %w", err)
	}
	defer srv.Process.Kill()
	line := make([]byte, len("ready\n"))
	if _, err := io.ReadFull(ready, line); err != nil {
		srv.Wait()
		return nil, fmt.Errorf("server: %w: %s", err, srvErr.Bytes())
	}
	cli := exec.CommandContext(ctx, self)
	cli.Env = append(os.Environ(), ppEnv("ppclient", addr)...)
	var out, cliErr bytes.Buffer
	cli.Stdout, cli.Stderr = &out, &cliErr
	if err := l.Start("node1", cli); err != nil {
		return nil, fmt.Errorf("start the client: %w", err)
	}
	if err := cli.Wait(); err != nil {
		return nil, fmt.Errorf("client: %w: %s", err, cliErr.Bytes())
	}
	if err := srv.Wait(); err != nil {
		return nil, fmt.Errorf("server: %w: %s", err, srvErr.Bytes())
	}
	return out.Bytes(), nil
}

// jobPingPong runs the server and the client as agent jobs and returns the client's output.
func jobPingPong(ctx context.Context, c *labcluster.Cluster, self, addr string) ([]byte, error) {
	srv, err := c.Client("node2").StartJob(ctx, agent.JobSpec{Name: "ppserve", Argv: []string{self}, Interval: "1h", Env: ppEnv("ppserve", addr)})
	if err != nil {
		return nil, fmt.Errorf("start the server: %w", err)
	}
	defer c.Client("node2").Signal(context.WithoutCancel(ctx), srv.ID, syscall.SIGKILL)
	if err := waitOutput(ctx, srv.StdoutPath(), time.Minute); err != nil { // "ready": it listens
		return nil, fmt.Errorf("server: %w", err)
	}
	cli, err := c.Client("node1").StartJob(ctx, agent.JobSpec{Name: "ppclient", Argv: []string{self}, Interval: "1h", Env: ppEnv("ppclient", addr)})
	if err != nil {
		return nil, fmt.Errorf("start the client: %w", err)
	}
	defer c.Client("node1").Signal(context.WithoutCancel(ctx), cli.ID, syscall.SIGKILL)
	for _, j := range []agent.Job{cli, srv} {
		if err := waitExit(ctx, j, 5*time.Minute); err != nil {
			return nil, err
		}
	}
	return os.ReadFile(cli.StdoutPath())
}

// lmDrops sums the log's and the receive tap's backpressure drops over the lab's agents.
func lmDrops(ctx context.Context, c *labcluster.Cluster) ([2]uint64, error) {
	var d [2]uint64
	for _, h := range c.Lab.State().Hosts {
		st, err := c.Client(h.Name).Status(ctx)
		if err != nil {
			return d, fmt.Errorf("status of %s's agent: %w", h.Name, err)
		}
		if st.Log == nil {
			return d, fmt.Errorf("%s's agent runs no sender-side log", h.Name)
		}
		d[0] += st.Log.Counters.DropsBackpressure
		d[1] += st.Log.Received.Tap.DropsBackpressure
	}
	return d, nil
}

// lmParse reads the client's round trips (one per line, nanoseconds) into a run's figures.
func lmParse(out []byte) (lmRun, error) {
	fields := strings.Fields(string(out))
	if len(fields) != lmRounds {
		return lmRun{}, fmt.Errorf("client printed %d round trips, want %d", len(fields), lmRounds)
	}
	ms := make([]float64, len(fields))
	var sum float64
	r := lmRun{}
	for i, f := range fields {
		ns, err := strconv.ParseInt(f, 10, 64)
		if err != nil || ns <= 0 {
			return lmRun{}, fmt.Errorf("client printed round trip %q: want nanoseconds", f)
		}
		ms[i] = float64(ns) / 1e6
		sum += ms[i]
		if time.Duration(ns) > lmStall {
			r.Stalls++
		}
	}
	slices.Sort(ms)
	r.MeanMS, r.P50MS, r.P90MS, r.P99MS, r.MaxMS = sum/float64(len(ms)), median(ms), quantile(ms, 0.9), quantile(ms, 0.99), ms[len(ms)-1]
	return r, nil
}

// ppConfig reads a ping-pong role's environment: the address, the message size and the round trips.
func ppConfig() (addr string, size, rounds int, err error) {
	addr = os.Getenv("FTBENCH_ADDR")
	if size, err = strconv.Atoi(os.Getenv("FTBENCH_MSG")); err != nil || size <= 0 {
		return "", 0, 0, fmt.Errorf("FTBENCH_MSG %q: must be a positive number of bytes", os.Getenv("FTBENCH_MSG"))
	}
	if rounds, err = strconv.Atoi(os.Getenv("FTBENCH_ROUNDS")); err != nil || rounds <= 0 {
		return "", 0, 0, fmt.Errorf("FTBENCH_ROUNDS %q: must be a positive number", os.Getenv("FTBENCH_ROUNDS"))
	}
	return addr, size, rounds, nil
}

// ppServe is the ppserve role: listen on FTBENCH_ADDR, print "ready", accept one connection and send
// back each of FTBENCH_ROUNDS messages of FTBENCH_MSG bytes once it has all of it.
func ppServe() error {
	addr, size, rounds, err := ppConfig()
	if err != nil {
		return err
	}
	c, err := acceptOne(addr)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, size)
	for range rounds {
		if _, err := io.ReadFull(c, buf); err != nil {
			return fmt.Errorf("read a message: %w", err)
		}
		if _, err := c.Write(buf); err != nil {
			return fmt.Errorf("send it back: %w", err)
		}
	}
	return nil
}

// ppClient is the ppclient role: connect to FTBENCH_ADDR (retrying while the server starts), then
// FTBENCH_ROUNDS times send a message of FTBENCH_MSG bytes and read it back; print each round trip in
// nanoseconds, one per line.
func ppClient() error {
	addr, size, rounds, err := ppConfig()
	if err != nil {
		return err
	}
	var c net.Conn
	for try := 0; ; try++ {
		if c, err = net.Dial("tcp4", addr); err == nil || try == 100 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	defer c.Close()
	msg, back := make([]byte, size), make([]byte, size)
	rtt := make([]time.Duration, rounds)
	for i := range rtt {
		start := time.Now()
		if _, err := c.Write(msg); err != nil {
			return fmt.Errorf("send message %d: %w", i, err)
		}
		if _, err := io.ReadFull(c, back); err != nil {
			return fmt.Errorf("read message %d back: %w", i, err)
		}
		rtt[i] = time.Since(start)
	}
	var out strings.Builder
	for _, d := range rtt {
		fmt.Fprintln(&out, d.Nanoseconds())
	}
	_, err = os.Stdout.WriteString(out.String())
	return err
}
