package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// benchNodeRecovery measures the recovery of a node that ran several jobs: four two-rank ringstencils,
// rank 1 of each on node2 holding 100 MiB, node2 crashed 1.5 s after its snapshot. Once with the jobs
// restored one after another (failover.parallel_restores = 1), once at once (4), in the same run; every
// job's result is checked against the failure-free one.
func benchNodeRecovery(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	const jobs, ballastMiB = 4, 100
	// The machine's load: on 2 vCPUs the replays (ranks re-executing) compete with everything else.
	load, _ := os.ReadFile("/proc/loadavg")
	runs := map[string]*nodeRecoveryResult{}
	var metrics []Metric
	for _, parallel := range []int{1, jobs} {
		r, err := nodeRecoveryRun(ctx, log, binDir, jobs, parallel, ballastMiB)
		if err != nil {
			return nil, nil, fmt.Errorf("parallel_restores %d: %w", parallel, err)
		}
		name := fmt.Sprintf("parallel_restores_%d", parallel)
		runs[name] = r
		metrics = append(metrics,
			Metric{Name: name + "_total", Value: r.TotalMs, Unit: "ms"},
			Metric{Name: name + "_after_detection", Value: r.AfterDetectionMs, Unit: "ms"})
	}
	seq, par := runs["parallel_restores_1"], runs[fmt.Sprintf("parallel_restores_%d", jobs)]
	identical := 0
	for _, r := range runs {
		if r.Identical {
			identical++
		}
	}
	metrics = append(metrics,
		Metric{Name: "after_detection_parallel_vs_sequential", Value: par.AfterDetectionMs / seq.AfterDetectionMs, Unit: "ratio"},
		Metric{Name: "runs_identical", Value: float64(identical), Unit: fmt.Sprintf("of %d", len(runs))})
	return metrics, map[string]any{"jobs_on_failed_node": jobs, "ballast_mib_per_job": ballastMiB,
		"program": "2-rank ringstencils, 64 KiB halos, 20 ms per iteration", "crash": "node2 crashed 1.5 s after its snapshot",
		"after_detection": "from the failure's confirmation to the last job's replay done", "loadavg_at_start": strings.TrimSpace(string(load)),
		"runs": runs}, nil
}

type nodeRecoveryResult struct {
	Parallel         int                  `json:"parallel_restores"`
	TotalMs          float64              `json:"total_ms"` // crash to the last job's replay done
	AfterDetectionMs float64              `json:"after_detection_ms"`
	Stages           map[string][]float64 `json:"stage_ms"` // per stage, one value per job
	Identical        bool                 `json:"identical"`
}

func nodeRecoveryRun(ctx context.Context, log *slog.Logger, binDir string, jobs, parallel, ballastMiB int) (*nodeRecoveryResult, error) {
	stencil := filepath.Join(binDir, "ringstencil")
	args := []string{"--iters", "600", "--block", "65536", "--delay", "20ms"}
	ref, err := loopbackChecksum(ctx, stencil, 2, args)
	if err != nil {
		return nil, err
	}
	l, err := lab.Up(ctx, lab.Config{ID: "fbnoder", Nodes: 2, Spares: 1, Subnet: netip.MustParsePrefix("10.245.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: "warn",
		ParallelRestores: parallel})
	if err != nil {
		return nil, err
	}
	var started []agent.Job
	for k := range jobs {
		var peers string
		for r := range 2 {
			h, _ := l.Host(fmt.Sprintf("node%d", r+1))
			if r > 0 {
				peers += ","
			}
			peers += netip.AddrPortFrom(h.Addr.Addr(), uint16(7500+k)).String()
		}
		for r := range 2 {
			argv := append([]string{stencil, "--rank", fmt.Sprint(r), "--peers", peers}, args...)
			if r == 1 {
				argv = append(argv, "--ballast", fmt.Sprint(ballastMiB))
			}
			j, err := c.Client(fmt.Sprintf("node%d", r+1)).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("job%d-rank%d", k, r), Argv: argv})
			if err != nil {
				return nil, err
			}
			started = append(started, j)
		}
	}
	time.Sleep(3 * time.Second)
	reply, err := c.Client("node2").Checkpoint(ctx)
	if err != nil || reply.Error != "" || len(reply.Results) != jobs {
		return nil, fmt.Errorf("checkpoint of node2: %+v %v", reply, err)
	}
	for _, r := range reply.Results {
		if !r.Shipped {
			return nil, fmt.Errorf("checkpoint of node2: a snapshot was not shipped: %+v", r)
		}
	}
	time.Sleep(1500 * time.Millisecond)
	crash := time.Now()
	if err := l.Crash(ctx, "node2"); err != nil {
		return nil, err
	}
	f, err := waitRecovered(ctx, c, "node2", 5*time.Minute)
	if err != nil {
		return nil, err
	}
	res := &nodeRecoveryResult{Parallel: parallel, Stages: map[string][]float64{}}
	var detected, last time.Time
	for _, s := range f.Stages {
		if s.Error != "" {
			return nil, fmt.Errorf("stage %s: %s", s.Name, s.Error)
		}
		switch s.Name {
		case agent.StageDetected:
			detected = s.End
		case agent.StageReplayed:
			if s.End.After(last) {
				last = s.End
			}
		}
		res.Stages[s.Name] = append(res.Stages[s.Name], float64(s.Duration())/1e6)
	}
	if n := len(res.Stages[agent.StageReplayed]); n != jobs {
		return nil, fmt.Errorf("%d of %d jobs replayed", n, jobs)
	}
	res.TotalMs = float64(last.Sub(crash)) / 1e6
	res.AfterDetectionMs = float64(last.Sub(detected)) / 1e6
	res.Identical = true
	for _, j := range started {
		if err := waitExit(ctx, j, 3*time.Minute); err != nil {
			return nil, err
		}
		b, _ := os.ReadFile(j.StdoutPath())
		res.Identical = res.Identical && checksumLine(string(b)) == ref
	}
	log.Info("node recovery", "parallel_restores", parallel, "total_ms", res.TotalMs, "after_detection_ms", res.AfterDetectionMs, "identical", res.Identical)
	return res, nil
}
