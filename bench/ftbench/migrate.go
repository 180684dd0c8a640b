package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// migrateBench measures a planned migration (`ftctl migrate`, issue 13's target: frozen-to-running
// <= 0.5 s for 100 MiB): rank 1 of a two-rank ringstencil, on a job address of its own and holding
// 100 MiB or 1 GiB, is moved from node2 to node3 while rank 0 on node1 keeps exchanging with it. Reported
// per size, with the target restoring eagerly and with lazy pages (failover.lazy_restore): the job's stop
// (freeze to the restored process running on node3), the time to its replay done, each stage, and whether
// the run's result is the failure-free one.
type migrateBench struct {
	sizes   string // MiB, comma-separated
	modes   string // eager, lazy or both
	logs    string // where to copy the agents' logs (info level) before the lab goes; "" = warnings only, dropped
	repeats int    // runs of each size and mode (each reported; the metric is the median)
}

func (b *migrateBench) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	fs.StringVar(&b.sizes, "sizes", "100,1024", "ballast sizes to move, MiB, comma-separated")
	fs.StringVar(&b.modes, "modes", "both", "the target's restore: eager, lazy or both")
	fs.StringVar(&b.logs, "logs", "", "copy the agents' logs (info level) of each run into this directory")
	fs.IntVar(&b.repeats, "repeats", 1, "runs of each size and mode; the metrics are their medians, every run is in settings")
	return fs
}

func (b *migrateBench) run(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	var sizes []int
	for _, s := range strings.Split(b.sizes, ",") {
		mib, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || mib <= 0 {
			return nil, nil, fmt.Errorf("migrate: --sizes %q: want MiB like 100,1024", b.sizes)
		}
		sizes = append(sizes, mib)
	}
	modes := map[string][]bool{"both": {false, true}, "eager": {false}, "lazy": {true}}[b.modes]
	if modes == nil {
		return nil, nil, fmt.Errorf("migrate: --modes %q: want eager, lazy or both", b.modes)
	}
	var metrics []Metric
	runs := map[string]any{}
	identical, total := 0, 0
	if b.repeats < 1 {
		return nil, nil, fmt.Errorf("migrate: --repeats %d must be positive", b.repeats)
	}
	for _, mib := range sizes {
		for _, lazy := range modes {
			p := fmt.Sprintf("%dMiB_", mib)
			if lazy {
				p = fmt.Sprintf("%dMiB_lazy_", mib)
			}
			var rs []*migrateResult
			for range b.repeats {
				r, err := migrateRun(ctx, log, binDir, mib, lazy, b.logs)
				if err != nil {
					return nil, nil, fmt.Errorf("%d MiB (lazy %v): %w", mib, lazy, err)
				}
				total++
				if r.Identical {
					identical++
				}
				rs = append(rs, r)
			}
			runs[p[:len(p)-1]] = rs
			field := func(f func(*migrateResult) float64) float64 {
				var v []float64
				for _, r := range rs {
					v = append(v, f(r))
				}
				return median(v)
			}
			metrics = append(metrics, Metric{Name: p + "frozen_to_running", Value: field(func(r *migrateResult) float64 { return r.FrozenMs }), Unit: "ms"},
				Metric{Name: p + "frozen_to_replay_done", Value: field(func(r *migrateResult) float64 { return r.ReplayedMs }), Unit: "ms"})
			for i, st := range rs[0].Stages {
				ms := field(func(r *migrateResult) float64 {
					if i < len(r.Stages) && r.Stages[i].Name == st.Name {
						return r.Stages[i].Ms
					}
					return 0
				})
				metrics = append(metrics, Metric{Name: p + strings.ReplaceAll(st.Name, " ", "_"), Value: ms, Unit: "ms"})
			}
		}
	}
	metrics = append(metrics, Metric{Name: "runs_identical", Value: float64(identical), Unit: fmt.Sprintf("of %d", total)})
	return metrics, map[string]any{"program": "ringstencil, 2 ranks, 64 KiB halos, 20 ms per iteration", "repeats": b.repeats,
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
	// LoadAvg is /proc/loadavg as the migration began: on a shared 2-vCPU machine the stop doubles when
	// other tests keep both CPUs busy, and this says whether they did.
	LoadAvg string `json:"loadavg"`
}

func migrateRun(ctx context.Context, log *slog.Logger, binDir string, mib int, lazy bool, logs string) (*migrateResult, error) {
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
	level := "warn"
	if logs != "" {
		level = "info"
	}
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: level, JobAddresses: true, LazyRestore: lazy})
	if err != nil {
		return nil, err
	}
	if logs != "" {
		// Deferred after the lab's Down: runs before it, while the logs are still there.
		defer copyAgentLogs(c, filepath.Join(logs, fmt.Sprintf("%dMiB-lazy%v-%s", mib, lazy, time.Now().UTC().Format("150405"))), log)
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
	load, _ := os.ReadFile("/proc/loadavg")
	m, err := c.Client("node2").Migrate(ctx, agent.MigrateRequest{Job: jobs[1].ID, To: "node3"})
	if err != nil {
		return nil, err
	}
	if m.Error != "" {
		return nil, fmt.Errorf("migration not done as asked: %s", m.Error)
	}
	res := &migrateResult{MiB: mib, Lazy: lazy, Snapshot: m.Snapshot, FrozenMs: float64(m.Frozen) / 1e6, ReplayedMs: float64(m.Replayed) / 1e6, Reference: ref,
		LoadAvg: strings.TrimSpace(string(load))}
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
	log.Info("migration", "mib", mib, "lazy", lazy, "loadavg", res.LoadAvg, "frozen_ms", res.FrozenMs, "replayed_ms", res.ReplayedMs, "stages", res.Stages, "identical", res.Identical)
	return res, nil
}

// copyAgentLogs copies every lab agent's log into dir, for a look at where a run's time went.
func copyAgentLogs(c *labcluster.Cluster, dir string, log *slog.Logger) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		log.Warn("agent logs not kept", "err", err)
		return
	}
	for _, host := range c.Lab.State().Hosts {
		h := host.Name
		b, err := os.ReadFile(c.LogPath(h))
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, h+".log"), b, 0o644)
		}
		if err != nil {
			log.Warn("agent log not kept", "host", h, "err", err)
		}
	}
	// And CRIU's log of each dump (its timestamps say where a dump's time went).
	for _, host := range c.Lab.State().Hosts {
		h := host.Name
		logs, _ := filepath.Glob(filepath.Join(labcluster.StateDir(c.Lab.State().ID, h), "snapshots", "*", "*", "images", "dump.log"))
		for _, l := range logs {
			if b, err := os.ReadFile(l); err == nil {
				os.WriteFile(filepath.Join(dir, h+"-"+filepath.Base(filepath.Dir(filepath.Dir(l)))+"-dump.log"), b, 0o644)
			}
		}
	}
	log.Info("agent logs kept", "dir", dir)
}

// keepLogsOnError copies the agents' logs of a run that failed with *err (copyAgentLogs) into a new
// directory under os.TempDir() named after run, and says where in *err: a run that failed once in many
// is then read, not guessed at. Deferred after the lab's Down, so that it runs before it. The directory is
// made by MkdirTemp (a fresh name, 0700): ftbench runs as root, and a name guessed ahead in the shared
// /tmp could be a user's link.
func keepLogsOnError(c *labcluster.Cluster, run string, err *error, log *slog.Logger) {
	if *err == nil {
		return
	}
	dir, mkErr := os.MkdirTemp("", "ftbench-"+run+"-")
	if mkErr != nil {
		log.Warn("agent logs of the failed run not kept", "err", mkErr)
		return
	}
	copyAgentLogs(c, dir, log)
	*err = fmt.Errorf("%w (the agents' logs are in %s)", *err, dir)
}
