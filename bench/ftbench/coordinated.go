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
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// benchCoordinated measures what coordinated snapshots cost a run (issue 11): a four-rank ringstencil, one
// rank per lab node on job addresses, each rank holding 100 MiB, is one run. Reported: how long one rank
// is frozen by its own (uncoordinated) snapshot, how long the run is frozen by a coordinated snapshot
// across its 4 nodes (the longest any host held its rank), their ratio, the whole cut (freeze to the
// replicas recorded), a whole-run rollback to that cut, and whether the run then ends with the failure-free
// result.
func benchCoordinated(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	const ranks, mib = 4, 100
	stencil := filepath.Join(binDir, "ringstencil")
	args := []string{"--iters", "1500", "--block", "65536", "--delay", "10ms"}
	ref, err := loopbackChecksum(ctx, stencil, ranks, args)
	if err != nil {
		return nil, nil, err
	}
	l, err := lab.Up(ctx, lab.Config{ID: "fbcoord", Nodes: ranks, Subnet: netip.MustParsePrefix("10.246.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: "warn", JobAddresses: true})
	if err != nil {
		return nil, nil, err
	}
	st := l.State()
	var peers []string
	for r := range ranks {
		peers = append(peers, netip.AddrPortFrom(labcluster.JobPool(st, fmt.Sprintf("node%d", r+1)).Addr(), 7510).String())
	}
	var jobs []agent.Job
	for r := range ranks {
		argv := append([]string{stencil, "--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ","), "--ballast", fmt.Sprint(mib)}, args...)
		j, err := c.Client(fmt.Sprintf("node%d", r+1)).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("rank%d", r), Argv: argv, JobAddress: true, Run: "bench"})
		if err != nil {
			return nil, nil, err
		}
		defer labcluster.RemoveJobNets(j.ID) // a job network outlives the lab's hosts
		jobs = append(jobs, j)
	}
	time.Sleep(3 * time.Second) // the ranks exchanging, their ballast in

	// One rank's own snapshot, as message logging takes them.
	reply, err := c.Client("node1").Checkpoint(ctx, jobs[0].ID)
	if err != nil || reply.Error != "" || len(reply.Results) != 1 {
		return nil, nil, fmt.Errorf("snapshot of rank 0: %+v %w", reply, err)
	}
	own := float64(reply.Results[0].Manifest.Stats.FrozenTime) / 1e6
	ownDump := float64(reply.Results[0].Manifest.DumpDuration) / 1e6
	var cuts []float64
	var cutTotal []float64
	for range 3 {
		start := time.Now()
		cut, err := c.Client("node1").Cut(ctx, coordinated.RunRequest{Run: "bench"})
		if err != nil {
			return nil, nil, err
		}
		cutTotal = append(cutTotal, float64(time.Since(start))/1e6)
		cuts = append(cuts, float64(cut.Frozen)/1e6)
		time.Sleep(time.Second)
	}
	time.Sleep(2 * time.Second) // past the last cut, for the rollback to take back
	start := time.Now()
	rb, err := c.Client("node1").Rollback(ctx, coordinated.RunRequest{Run: "bench"})
	if err != nil {
		return nil, nil, err
	}
	rollback := float64(time.Since(start)) / 1e6
	sums, identical, err := finalChecksums(ctx, jobs, ref)
	if err != nil {
		return nil, nil, err
	}
	frozen := median(cuts)
	log.Info("coordinated snapshots", "own_frozen_ms", own, "cut_frozen_ms", cuts, "cut_ms", cutTotal, "rollback_ms", rollback, "identical", identical)
	one := 0.0
	if identical {
		one = 1
	}
	return []Metric{
			{Name: "one_rank_snapshot_frozen", Value: own, Unit: "ms"},
			{Name: "one_rank_snapshot_dump", Value: ownDump, Unit: "ms"},
			{Name: "coordinated_4_nodes_frozen_median", Value: frozen, Unit: "ms"},
			{Name: "coordinated_vs_one_rank_frozen", Value: frozen / own, Unit: "ratio"},
			{Name: "coordinated_snapshot_total_median", Value: median(cutTotal), Unit: "ms"},
			{Name: "rollback_4_ranks", Value: rollback, Unit: "ms"},
			{Name: "identical_after_rollback", Value: one, Unit: "of 1"},
		}, map[string]any{"program": fmt.Sprintf("ringstencil, %d ranks on job addresses, one per node, %d MiB each, 64 KiB halos, 10 ms per iteration", ranks, mib),
			"cuts": cuts, "cut_totals_ms": cutTotal, "rollback": rb, "checksums": sums, "reference": ref}, nil
}
