package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// benchMigrate measures a planned migration (`ftctl migrate`, issue 13's target: frozen-to-running
// <= 0.5 s for 100 MiB): rank 1 of a two-rank ringstencil, on a job address of its own and holding
// 100 MiB or 1 GiB, is moved from node2 to node3 while rank 0 on node1 keeps exchanging with it. Reported
// per size, with the target restoring eagerly and with lazy pages (failover.lazy_restore): the job's stop
// (freeze to the restored process running on node3), the time to its replay done, each stage, and whether
// the run's result is the failure-free one.
func benchMigrate(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	var metrics []Metric
	runs := map[string]any{}
	identical, total := 0, 0
	for _, mib := range []int{100, 1024} {
		for _, lazy := range []bool{false, true} {
			r, err := migrateRun(ctx, log, binDir, mib, lazy)
			if err != nil {
				return nil, nil, fmt.Errorf("%d MiB (lazy %v): %w", mib, lazy, err)
			}
			total++
			if r.Identical {
				identical++
			}
			p := fmt.Sprintf("%dMiB_", mib)
			if lazy {
				p = fmt.Sprintf("%dMiB_lazy_", mib)
			}
			runs[p[:len(p)-1]] = r
			metrics = append(metrics, Metric{Name: p + "frozen_to_running", Value: r.FrozenMs, Unit: "ms"},
				Metric{Name: p + "frozen_to_replay_done", Value: r.ReplayedMs, Unit: "ms"})
			for _, st := range r.Stages {
				metrics = append(metrics, Metric{Name: p + strings.ReplaceAll(st.Name, " ", "_"), Value: st.Ms, Unit: "ms"})
			}
		}
	}
	metrics = append(metrics, Metric{Name: "runs_identical", Value: float64(identical), Unit: fmt.Sprintf("of %d", total)})
	return metrics, map[string]any{"program": "ringstencil, 2 ranks, 64 KiB halos, 20 ms per iteration",
		"move": "rank 1 (the ballast) from node2 to node3 after 3 s; rank 0 on node1 runs on", "runs": runs}, nil
}

type migrateResult struct {
	MiB        int             `json:"mib"`
	Lazy       bool            `json:"lazy"`
	Snapshot   string          `json:"snapshot"`
	FrozenMs   float64         `json:"frozen_to_running_ms"`
	ReplayedMs float64         `json:"frozen_to_replay_done_ms"`
	Stages     []recoveryStage `json:"stages"`
	Identical  bool            `json:"identical"`
	Checksums  []string        `json:"checksums"`
	Reference  string          `json:"reference"`
}

func migrateRun(ctx context.Context, log *slog.Logger, binDir string, mib int, lazy bool) (*migrateResult, error) {
	stencil := filepath.Join(binDir, "ringstencil")
	args := []string{"--iters", "600", "--block", "65536", "--delay", "20ms"}
	ref, err := loopbackChecksum(ctx, stencil, 2, args)
	if err != nil {
		return nil, err
	}
	l, err := lab.Up(ctx, lab.Config{ID: "fbmigr", Nodes: 3, Subnet: netip.MustParsePrefix("10.245.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: "warn", JobAddresses: true, LazyRestore: lazy})
	if err != nil {
		return nil, err
	}
	st := l.State()
	peers := netip.AddrPortFrom(labcluster.JobPool(st, "node1").Addr(), 7500).String() + "," +
		netip.AddrPortFrom(labcluster.JobPool(st, "node2").Addr(), 7500).String()
	var jobs []agent.Job
	for r := range 2 {
		argv := append([]string{stencil, "--rank", fmt.Sprint(r), "--peers", peers}, args...)
		if r == 1 {
			argv = append(argv, "--ballast", fmt.Sprint(mib))
		}
		j, err := c.Client(fmt.Sprintf("node%d", r+1)).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("rank%d", r), Argv: argv, JobAddress: true})
		if err != nil {
			return nil, err
		}
		defer labcluster.RemoveJobNets(j.ID) // a job network outlives the lab's hosts
		jobs = append(jobs, j)
	}
	time.Sleep(3 * time.Second)
	m, err := c.Client("node2").Migrate(ctx, agent.MigrateRequest{Job: jobs[1].ID, To: "node3"})
	if err != nil {
		return nil, err
	}
	if m.Error != "" {
		return nil, fmt.Errorf("migration not done as asked: %s", m.Error)
	}
	res := &migrateResult{MiB: mib, Lazy: lazy, Snapshot: m.Snapshot, FrozenMs: float64(m.Frozen) / 1e6, ReplayedMs: float64(m.Replayed) / 1e6, Reference: ref}
	evs, err := c.Client("node2").Events(ctx)
	if err != nil {
		return nil, err
	}
	for _, f := range evs {
		if f.ID != m.Event {
			continue
		}
		for _, s := range f.Stages {
			if s.Error != "" {
				return nil, fmt.Errorf("stage %s: %s", s.Name, s.Error)
			}
			res.Stages = append(res.Stages, recoveryStage{Name: s.Name, Ms: float64(s.Duration()) / 1e6})
		}
	}
	if res.Checksums, res.Identical, err = finalChecksums(ctx, jobs, ref); err != nil {
		return nil, err
	}
	log.Info("migration", "mib", mib, "lazy", lazy, "frozen_ms", res.FrozenMs, "replayed_ms", res.ReplayedMs, "stages", res.Stages, "identical", res.Identical)
	return res, nil
}
