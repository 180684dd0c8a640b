package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// benchSnapshot measures what a snapshot costs a job (frozen time, dump wall time) for 100 MB and 1 GB of
// resident memory, the compression ratio on the wire, and shipping throughput to the protector.
func benchSnapshot(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	l, err := lab.Up(ctx, lab.Config{ID: "fbsnap", Nodes: 2, Subnet: netip.MustParsePrefix("10.248.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", Keep: 1, LogLevel: "warn"})
	if err != nil {
		return nil, nil, err
	}
	const rounds = 3
	sizes := []int{100, 1024}
	var metrics []Metric
	for _, mb := range sizes {
		job, err := c.Client("node1").StartJob(ctx, agent.JobSpec{
			Name: fmt.Sprintf("mem%d", mb),
			Argv: []string{filepath.Join(binDir, "memcounter"), "--mb", fmt.Sprint(mb), "--steps", "1000000", "--delay", "100ms"},
		})
		if err != nil {
			return nil, nil, err
		}
		// Wait until the job has filled its memory (it prints its first step after the fill).
		if err := waitOutput(ctx, job.StdoutPath(), 2*time.Minute); err != nil {
			return nil, nil, err
		}
		var frozen, dump, ship []float64
		var bytes, shipNs float64
		var results []agent.SnapshotResult
		for r := 0; r < rounds; r++ {
			reply, err := c.Client("node1").Checkpoint(ctx, job.ID)
			if err != nil || len(reply.Results) != 1 || !reply.Results[0].Shipped {
				return nil, nil, fmt.Errorf("checkpoint of the %d MB job: %+v, %v", mb, reply, err)
			}
			res := reply.Results[0]
			results = append(results, res)
			frozen = append(frozen, res.Manifest.Stats.FrozenTime.Seconds()*1000)
			dump = append(dump, res.Manifest.DumpDuration.Seconds()*1000)
			ship = append(ship, float64(res.ShipBytes)/1e6/res.ShipDuration.Seconds())
			bytes += float64(res.ShipBytes)
			shipNs += float64(res.ShipDuration)
			log.Info("snapshot", "mb", mb, "round", r, "frozen_ms", frozen[r], "dump_ms", dump[r], "ship_mb_s", ship[r])
		}
		c.Client("node1").Signal(ctx, job.ID, 9)
		p := fmt.Sprintf("%dMB_", mb)
		metrics = append(metrics,
			Metric{Name: p + "frozen_median", Value: median(frozen), Unit: "ms"},
			Metric{Name: p + "dump_wall_median", Value: median(dump), Unit: "ms"},
			Metric{Name: p + "frozen_per_100MB", Value: median(frozen) * 100 / float64(mb), Unit: "ms"},
			Metric{Name: p + "dump_wall_per_100MB", Value: median(dump) * 100 / float64(mb), Unit: "ms"},
			Metric{Name: p + "snapshot_size", Value: bytes / rounds / 1e6, Unit: "MB"},
			Metric{Name: p + "compression_ratio", Value: shipCompressionRatio(results), Unit: "x"},
			Metric{Name: p + "ship_throughput_median", Value: median(ship), Unit: "MB/s"},
		)
	}
	dm, err := benchSnapshotDelta(ctx, c, binDir, deltaMB, log)
	if err != nil {
		return nil, nil, err
	}
	metrics = append(metrics, dm...)
	return metrics, map[string]any{"rounds": rounds, "sizes_mb": sizes, "content": "per page 40% zero, 30% random, 30% text (testdata/memcounter)",
		"link": "veth + bridge between two lab namespaces, mutual TLS, s2",
		"note": "from the second round on, snapshots go as diffs against the protector's previous replica (ckpt/ship)",
		"delta": map[string]any{"mb": deltaMB, "rewritten_pct": 10, "rounds": deltaRounds, "block": ship.DefaultDeltaBlock,
			"job": "testdata/heaprewrite: random scattered pages rewritten with new random content on SIGUSR1"}}, nil
}

// shipCompressionRatio is the compression ratio on the wire of results' transfers: the snapshot bytes that
// were sent over the bytes on the wire. A diff's blocks the protector copied from its base were not sent:
// counted in, the diffs of a job that changes little (every round, the first against the job's start
// snapshot) made it 9x on memory three tenths of which is random.
func shipCompressionRatio(results []agent.SnapshotResult) float64 {
	var sent, wire float64
	for _, r := range results {
		sent += float64(r.ShipBytes - r.ShipCopied)
		wire += float64(r.ShipWire)
	}
	return sent / wire
}

const (
	deltaMB     = 1024
	deltaRounds = 3
)

// benchSnapshotDelta measures incremental snapshots: a job with mb MiB of heap rewrites 10% of its pages
// between snapshots; the first snapshot goes whole, the next ones as diffs against the protector's replica.
// It reports the bytes on the wire per snapshot against the whole one and the ship times.
func benchSnapshotDelta(ctx context.Context, c *labcluster.Cluster, binDir string, mb int, log *slog.Logger) ([]Metric, error) {
	cl := c.Client("node1")
	job, err := cl.StartJob(ctx, agent.JobSpec{
		Name: fmt.Sprintf("rewrite%d", mb),
		Argv: []string{filepath.Join(binDir, "heaprewrite"), "--mb", fmt.Sprint(mb), "--pct", "10"},
	})
	if err != nil {
		return nil, err
	}
	defer cl.Signal(context.WithoutCancel(ctx), job.ID, syscall.SIGKILL)
	if err := waitOutput(ctx, job.StdoutPath(), 2*time.Minute); err != nil {
		return nil, err
	}
	snap := func() (agent.SnapshotResult, error) {
		reply, err := cl.Checkpoint(ctx, job.ID)
		if err != nil || len(reply.Results) != 1 || !reply.Results[0].Shipped {
			return agent.SnapshotResult{}, fmt.Errorf("checkpoint of the %d MB rewriting job: %+v, %v", mb, reply, err)
		}
		return reply.Results[0], nil
	}
	first, err := snap()
	if err != nil {
		return nil, err
	}
	fullWire := float64(first.ShipWire)
	size := float64(first.Manifest.TotalSize())
	log.Info("whole snapshot", "mb", mb, "size", size, "wire", fullWire, "ship_ms", first.ShipDuration.Milliseconds())
	var toFull, toSize, shipMs []float64
	var wire float64
	for r := 1; r <= deltaRounds; r++ {
		if err := cl.Signal(ctx, job.ID, syscall.SIGUSR1); err != nil {
			return nil, err
		}
		if err := waitContains(ctx, job.StdoutPath(), fmt.Sprintf("rewrite %d ", r), 2*time.Minute); err != nil {
			return nil, err
		}
		res, err := snap()
		if err != nil {
			return nil, err
		}
		w := float64(res.ShipWire)
		wire += w
		toFull = append(toFull, w/fullWire)
		toSize = append(toSize, w/float64(res.Manifest.TotalSize()))
		shipMs = append(shipMs, res.ShipDuration.Seconds()*1000)
		log.Info("incremental snapshot", "mb", mb, "round", r, "wire", w, "of_whole", w/fullWire, "ship_ms", shipMs[r-1])
	}
	p := fmt.Sprintf("delta_%dMB_", mb)
	return []Metric{
		{Name: p + "snapshot_size", Value: size / 1e6, Unit: "MB"},
		{Name: p + "whole_wire", Value: fullWire / 1e6, Unit: "MB"},
		{Name: p + "whole_ship", Value: first.ShipDuration.Seconds() * 1000, Unit: "ms"},
		{Name: p + "incremental_wire_mean", Value: wire / deltaRounds / 1e6, Unit: "MB"},
		{Name: p + "incremental_of_whole_wire_median", Value: median(toFull), Unit: "ratio"},
		{Name: p + "incremental_of_snapshot_size_median", Value: median(toSize), Unit: "ratio"},
		{Name: p + "incremental_ship_median", Value: median(shipMs), Unit: "ms"},
	}, nil
}

// waitContains waits until the file at path contains s.
func waitContains(ctx context.Context, path, s string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if b, err := os.ReadFile(path); err == nil && strings.Contains(string(b), s) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("%q not in %s after %s", s, path, timeout)
}

func ownDir() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.Dir(self), nil
}

func waitOutput(ctx context.Context, path string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if st, err := os.Stat(path); err == nil && st.Size() > 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("no output in %s after %s", path, timeout)
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
