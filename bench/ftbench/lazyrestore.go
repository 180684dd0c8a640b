package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// benchLazyRestore measures issue 13's MTTR targets (crash to the restored rank running: <= 1.0 s for a
// 100 MiB rank, <= 1.5 s for 1 GiB, detection included), eager and lazy restore (failover.lazy_restore)
// side by side: node2 of a 3-node ring holding a ringstencil rank with its ballast crashes 1.5 s after its
// snapshot reached its protector, which restores it itself (no spare: RADIC's basic mode, the replica is
// local); the lab's fast detection preset, and a fence command that confirms the crashed host is off.
func benchLazyRestore(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	var metrics []Metric
	runs := map[string]any{}
	identical, total := 0, 0
	for _, mib := range []int{100, 1024} {
		for _, lazy := range []bool{false, true} {
			mode := "eager"
			if lazy {
				mode = "lazy"
			}
			r, err := lazyRestoreRun(ctx, log, binDir, mib, lazy)
			if err != nil {
				return nil, nil, fmt.Errorf("%d MiB %s: %w", mib, mode, err)
			}
			total++
			if r.Identical {
				identical++
			}
			p := fmt.Sprintf("%dMiB_%s_", mib, mode)
			runs[p[:len(p)-1]] = r
			metrics = append(metrics, Metric{Name: p + "crash_to_running", Value: r.RunningMs, Unit: "ms"},
				Metric{Name: p + "crash_to_replay_done", Value: r.ReplayedMs, Unit: "ms"},
				Metric{Name: p + "restored_stage", Value: r.RestoreMs, Unit: "ms"})
		}
	}
	metrics = append(metrics, Metric{Name: "runs_identical", Value: float64(identical), Unit: fmt.Sprintf("of %d", total)})
	fills := map[string][]float64{}
	for _, mib := range []int{100, 1024} {
		ms, err := memoryFill(mib)
		if err != nil {
			return nil, nil, fmt.Errorf("memory fill of %d MiB: %w", mib, err)
		}
		fills[fmt.Sprintf("%dMiB", mib)] = ms
		metrics = append(metrics, Metric{Name: fmt.Sprintf("%dMiB_memory_fill_floor", mib), Value: median(ms), Unit: "ms"})
	}
	return metrics, map[string]any{"program": "ringstencil, 3 ranks, 64 KiB halos, 20 ms per iteration; rank 1 holds the ballast and checks it at its end",
		"crash":     "node2 crashed 1.5 s after its snapshot; restored by its protector node3 (no spare)",
		"detection": "labcluster.FastDetection: 75 ms beats, 300 ms timeout, 200 ms probes", "fence": "lab fence command (confirms at once)",
		"memory_fill_floor": "what an eager restore cannot go below: fresh anonymous memory of the rank's size, populated, then filled by one read " +
			"from a file in the page cache (CRIU's restorer reads a snapshot's pages so), once the labs are down; median of " +
			fmt.Sprint(fillRuns) + " runs",
		"memory_fill_ms": fills,
		"runs":           runs}, nil
}

// fillRuns is how often memoryFill measures.
const fillRuns = 5

// memoryFill measures, fillRuns times, how long it takes to fill mib MiB of fresh anonymous memory with
// one read from a file in the page cache, its pages populated first: the floor under an eager restore of
// a rank of that size, which CRIU's restorer fills so (MADV_POPULATE_WRITE, criu/patches/0005, then a
// preadv of its pages image into the mapped memory). On a VM the host may have taken freed memory back,
// and faulting it in again is most of that time.
func memoryFill(mib int) ([]float64, error) {
	size := mib << 20
	f, err := os.CreateTemp("", "ftbench-fill-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	block := make([]byte, 1<<20)
	for i := range block {
		block[i] = byte(i*7 + i>>8)
	}
	for range mib {
		if _, err := f.Write(block); err != nil {
			return nil, err
		}
	}
	var ms []float64
	for range fillRuns {
		mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return nil, err
		}
		start := time.Now()
		if err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE); err != nil {
			unix.Munmap(mem)
			return nil, fmt.Errorf("populate %d MiB: %w", mib, err)
		}
		for off := 0; off < size; {
			n, err := unix.Pread(int(f.Fd()), mem[off:], int64(off))
			if err == nil && n == 0 {
				err = io.ErrUnexpectedEOF
			}
			if err != nil {
				unix.Munmap(mem)
				return nil, err
			}
			off += n
		}
		ms = append(ms, float64(time.Since(start))/1e6)
		if err := unix.Munmap(mem); err != nil {
			return nil, err
		}
	}
	return ms, nil
}

type lazyRestoreResult struct {
	MiB        int             `json:"mib"`
	Lazy       bool            `json:"lazy"`
	RunningMs  float64         `json:"crash_to_running_ms"`
	ReplayedMs float64         `json:"crash_to_replay_done_ms"`
	RestoreMs  float64         `json:"restored_stage_ms"`
	Stages     []recoveryStage `json:"stages"`
	Identical  bool            `json:"identical"`
	Checksums  []string        `json:"checksums"`
	Reference  string          `json:"reference"`
}

func lazyRestoreRun(ctx context.Context, log *slog.Logger, binDir string, mib int, lazy bool) (_ *lazyRestoreResult, err error) {
	stencil := filepath.Join(binDir, "ringstencil")
	args := []string{"--iters", "700", "--block", "65536", "--delay", "20ms", "--progress", "10"}
	ref, err := loopbackChecksum(ctx, stencil, 3, args)
	if err != nil {
		return nil, err
	}
	l, err := lab.Up(ctx, lab.Config{ID: "fblazy", Nodes: 3, Subnet: netip.MustParsePrefix("10.246.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	dir, err := os.MkdirTemp("", "ftbench-fence-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	fence := filepath.Join(dir, "fence")
	if err := labcluster.WriteFenceScript(l.State(), fence, filepath.Join(dir, "fenced")); err != nil {
		return nil, err
	}
	opts := labcluster.FastDetection(labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: "info",
		FenceCommand: []string{fence, "{host}", "{address}"}, LazyRestore: lazy})
	c, err := labcluster.Start(ctx, l, opts)
	if err != nil {
		return nil, err
	}
	defer keepLogsOnError(c, fmt.Sprintf("lazy-restore-%dMiB-lazy%v", mib, lazy), &err, log)
	var peers []string
	for r := range 3 {
		h, _ := l.Host(fmt.Sprintf("node%d", r+1))
		peers = append(peers, netip.AddrPortFrom(h.Addr.Addr(), 7500).String())
	}
	var jobs []agent.Job
	for r := range 3 {
		argv := append([]string{stencil, "--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ",")}, args...)
		if r == 1 {
			argv = append(argv, "--ballast", fmt.Sprint(mib))
		}
		j, err := c.Client(fmt.Sprintf("node%d", r+1)).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("rank%d", r), Argv: argv})
		if err != nil {
			return nil, err
		}
		jobs = append(jobs, j)
	}
	// Exchanging (its connections are up), then snapshotted, and covered: the replica holds every
	// connection the rank has (else the crash would rightly be refused).
	if err := waitFor(ctx, 2*time.Minute, "rank 1 to exchange", func() bool {
		b, _ := os.ReadFile(jobs[1].StdoutPath())
		return strings.Contains(string(b), " iteration ")
	}); err != nil {
		return nil, err
	}
	reply, err := c.Client("node2").Checkpoint(ctx)
	if err != nil || reply.Error != "" || len(reply.Results) == 0 || !reply.Results[0].Shipped {
		return nil, fmt.Errorf("checkpoint of node2: %+v %v", reply, err)
	}
	snap := reply.Results[0].Manifest.ID
	if err := waitFor(ctx, 2*time.Minute, "rank 1's replica to hold its connections", func() bool {
		j, err := c.Client("node2").Job(ctx, jobs[1].ID)
		return err == nil && j.Covered() && j.Replica.Snapshot >= snap && j.ConnsChecked.After(reply.Results[0].Manifest.Created)
	}); err != nil {
		return nil, err
	}
	time.Sleep(1500 * time.Millisecond)
	crash := time.Now()
	if err := l.Crash(ctx, "node2"); err != nil {
		return nil, err
	}
	f, err := waitRecovered(ctx, c, "node2", 3*time.Minute)
	if err != nil {
		return nil, err
	}
	t, err := timelineOf(f, crash)
	if err != nil {
		return nil, err
	}
	res := &lazyRestoreResult{MiB: mib, Lazy: lazy, Reference: ref, Stages: t.stages, RunningMs: t.runningMs, ReplayedMs: t.replayedMs, RestoreMs: t.restoreMs}
	if res.Checksums, res.Identical, err = finalChecksums(ctx, jobs, ref); err != nil {
		return nil, err
	}
	log.Info("lazy restore", "mib", mib, "lazy", lazy, "crash_to_running_ms", res.RunningMs, "stages", res.Stages, "identical", res.Identical)
	return res, nil
}

// waitFor polls cond every 20 ms until it holds, ctx ends or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("waited %s for %s", timeout, what)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}
