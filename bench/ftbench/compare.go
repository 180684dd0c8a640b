package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/shim"
)

// benchCompare compares ftkit with application-level checkpointing (testdata/stencil2d, FT-SPMD style) on
// one 2-D Jacobi stencil, one rank per lab host plus a spare (4 ranks at the large size, 3 at the small):
//
//	a  plain: ranks started directly in the lab hosts' namespaces (lab.Start), no agent on the lab
//	b  ftkit logging only: agent jobs, snapshot interval 1h (each job gets only the snapshot the agent
//	   takes as it starts: every job is protected from its start)
//	c  ftkit logging + periodic snapshots: agent jobs, interval = the app's checkpoint interval in seconds
//	d  application-level checkpoints: plain launch with --ckpt-every K (files on the lab's shared disk)
//
// and then the same with node2 crashed at the same wall-clock offset: a restarts every rank from scratch,
// c recovers automatically (survivors keep running), d kills every rank and restarts all of them with
// --restart, the crashed rank on the spare. b is not run with a failure (its only snapshot is the one
// from the start). For a and d the crash is "detected" after cmpDetect (what ftkit's suspect-then-confirm
// watchdog takes), so that every variant pays the same detection delay. The crash comes at the same
// offset for every variant, but never before what the variant recovers from exists: c's crashed rank has
// a replicated snapshot holding its connections, d's ranks have all written their first checkpoint. Failure-free runs are repeated
// size.Rounds times (median reported). Every run's checksum is compared with an unprotected loopback run.
//
// FTBENCH_SIZE=small (CI, under a minute) or large (default). FTBENCH_COMPARE_VARIANTS=b,c (a list) runs
// only those variants and a, without failures: a quick measurement of a change's failure-free cost, each
// round's runs against that round's a.
func benchCompare(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	sz, err := compareSizeFromEnv()
	if err != nil {
		return nil, nil, err
	}
	out, err := runCompare(ctx, log, binDir, sz)
	if err != nil {
		return nil, nil, err
	}
	// The plot goes next to the JSON results (ftbench's --out).
	svgDir := "bench/results"
	if f := flag.Lookup("out"); f != nil {
		svgDir = f.Value.String()
	}
	if err := os.MkdirAll(svgDir, 0o755); err != nil {
		return nil, nil, err
	}
	svgPath := filepath.Join(svgDir, "compare.svg")
	if err := atomicfile.WriteFile(svgPath, []byte(out.svg()), 0o644); err != nil {
		return nil, nil, fmt.Errorf("write the plot: %w", err)
	}
	out.Plot = svgPath
	return out.metrics(), out, nil
}

// compareSize is the problem and the fault-tolerance settings of one comparison.
type compareSize struct {
	Name      string        `json:"name"`
	Ranks     int           `json:"ranks"`
	Grid      int           `json:"grid"`
	Iters     int           `json:"iters"`
	Delay     time.Duration `json:"delay_ns"` // extra compute per iteration (sleep): keeps the shared CPUs usable
	CkptEvery int           `json:"ckpt_every"`
	// CrashAt is the crash's offset from the start, as a fraction of the plain run's wall time: midway
	// between two checkpoints, so that neither c nor d is lucky with the phase.
	CrashAt float64 `json:"crash_at_fraction"`
	Rounds  int     `json:"rounds"` // failure-free runs of each variant (the median counts)
	// AgentNice is the agents' heartbeat.nice. The small size runs inside `make test`, next to other
	// packages' labs: agents at 19 there waited behind the whole suite's work (23 s without a beat in
	// ci225) and self-fenced, killing the ranks, as a starved host must; so they run at 0 there.
	AgentNice int `json:"agent_nice"`
}

// warmIters is the iteration every rank of a failure-free run has done before its steady state is timed:
// past the launch, the connections and, in b and c, the snapshot the agents take as the jobs start, costs
// a job pays once whatever its length.
func (s compareSize) warmIters() int { return max(s.Iters/20, 1) }

// warmArgs makes the ranks say when they have done warmIters (stencil2d's "reached" line).
func (s compareSize) warmArgs() []string { return []string{"--report-at", fmt.Sprint(s.warmIters())} }

var compareSizes = map[string]compareSize{
	"small": {Name: "small", Ranks: 3, Grid: 256, Iters: 400, Delay: 5 * time.Millisecond, CkptEvery: 150, CrashAt: 0.56, Rounds: 1},
	"large": {Name: "large", Ranks: 4, Grid: 2048, Iters: 2000, Delay: 8 * time.Millisecond, CkptEvery: 400, CrashAt: 0.5, Rounds: 3, AgentNice: cmpAgentNice},
}

func compareSizeFromEnv() (compareSize, error) {
	name := os.Getenv("FTBENCH_SIZE")
	if name == "" {
		name = "large"
	}
	sz, ok := compareSizes[name]
	if !ok {
		return compareSize{}, fmt.Errorf("FTBENCH_SIZE=%q: use small or large", name)
	}
	return sz, nil
}

// Failure detection of every variant: the agents' heartbeat, and for a and d the same timeout.
const (
	cmpHeartbeat = 200 * time.Millisecond
	cmpTimeout   = time.Second
	// cmpDetect is when a and d learn of the crash: ftkit's watchdog suspects after one timeout and
	// confirms with a probe that must time out too, so a and d get the same two timeouts.
	cmpDetect = 2 * cmpTimeout
	// cmpAgentNice is the agents' heartbeat.nice: the jobs first. The agents' steady work (the log,
	// the determinants, shipping and receiving snapshots) takes the CPU the ranks leave, while CRIU dumps
	// at checkpoint.dump_nice. In four alternating pairs of b and c runs against 0 (docs/design.md), c's
	// overhead was lower in each pair (by 0.4 to 4.1 points), b's moved within its spread.
	cmpAgentNice = 19
	// cmpKeep is the agents' checkpoint.keep: every snapshot of a run stays listed, since c's snapshot count,
	// mean size and frozen median and its crashed rank's redone iterations are read from the manifests the
	// agents hold after the run (at the default 3, c_snapshots_taken was 3 per rank whatever the run took).
	cmpKeep    = 100
	cmpLabID   = "fbcmp"
	cmpCrashed = "node2" // rank 1
)

var cmpSubnet = netip.MustParsePrefix("10.246.0.0/24")

// variantRun is one measured run.
type variantRun struct {
	Variant   string  `json:"variant"`
	Round     int     `json:"round"`
	Failure   bool    `json:"failure"`
	Seconds   float64 `json:"seconds"`
	SteadyS   float64 `json:"steady_s,omitempty"` // failure-free: from the last rank's iteration warmIters to the end
	Identical bool    `json:"identical"`          // every rank's checksum is the failure-free one
	// With a failure:
	CrashOffsetS     float64  `json:"crash_offset_s,omitempty"`
	RestartMs        float64  `json:"restart_ms,omitempty"`         // crash to every rank computing again
	CaughtUpMs       float64  `json:"caught_up_ms,omitempty"`       // crash to the job back where it was at the crash
	ItersAtCrash     int      `json:"iters_at_crash,omitempty"`     // how far the survivors had got
	ResumedFrom      int      `json:"resumed_from,omitempty"`       // the recovery line (d), or 0 (a)
	SurvivorRedone   int      `json:"survivor_iters_redone"`        // iterations recomputed by survivors, summed
	CrashedRedoneEst float64  `json:"crashed_iters_redone_est"`     // iterations the crashed rank recomputed
	SurvivorsKept    bool     `json:"survivors_kept,omitempty"`     // c: survivors' PIDs unchanged, never restored
	Stages           any      `json:"stages,omitempty"`             // c: ftkit's recovery timeline
	Snapshots        int      `json:"snapshots,omitempty"`          // c: snapshots taken of all ranks
	SnapshotMB       float64  `json:"snapshot_mean_mb,omitempty"`   // c: mean CRIU image size per rank
	SnapshotFrozenMs float64  `json:"snapshot_frozen_ms,omitempty"` // c: median time a rank was frozen
	AppCkptMB        float64  `json:"app_ckpt_mb,omitempty"`        // d: one rank's checkpoint file
	AgentsCPUS       float64  `json:"agents_cpu_s,omitempty"`       // b, c without a failure: every agent's CPU time during the run
	Checksums        []string `json:"checksums,omitempty"`
}

type compareOutcome struct {
	Size      compareSize   `json:"size"`
	Reference string        `json:"reference_checksum"`
	Interval  time.Duration `json:"ftkit_interval_ns"` // c's snapshot interval, = K iterations of run a
	Runs      []variantRun  `json:"runs"`
	Notes     []string      `json:"notes"`
	Plot      string        `json:"plot"`
}

// run is the variant's median run (by wall time) over the rounds, or nil.
func (o *compareOutcome) run(variant string, failure bool) *variantRun {
	var rs []*variantRun
	for i := range o.Runs {
		if o.Runs[i].Variant == variant && o.Runs[i].Failure == failure {
			rs = append(rs, &o.Runs[i])
		}
	}
	if len(rs) == 0 {
		return nil
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].Seconds < rs[j].Seconds })
	return rs[len(rs)/2]
}

// stencilRun is stencil2d at size sz: the program next to ftbench, its arguments, and the checksum every
// rank of a correct run prints (from an unprotected run on loopback).
func stencilRun(ctx context.Context, binDir string, sz compareSize) (prog string, args []string, ref string, err error) {
	prog = filepath.Join(binDir, "stencil2d")
	if _, err := os.Stat(prog); err != nil {
		return "", nil, "", fmt.Errorf("stencil2d is not next to ftbench (run make build): %w", err)
	}
	args = []string{"--grid", fmt.Sprint(sz.Grid), "--iters", fmt.Sprint(sz.Iters)}
	if ref, err = loopbackChecksum(ctx, prog, sz.Ranks, args); err != nil {
		return "", nil, "", err
	}
	return prog, append(args, "--delay", sz.Delay.String()), ref, nil
}

func runCompare(ctx context.Context, log *slog.Logger, binDir string, sz compareSize) (*compareOutcome, error) {
	prog, args, ref, err := stencilRun(ctx, binDir, sz)
	if err != nil {
		return nil, err
	}
	agents := cmpAgents(binDir, sz)
	o := &compareOutcome{Size: sz, Reference: ref, Notes: []string{
		"a and d: ranks exec'd in the lab hosts' network namespaces, no agent running on the lab",
		"b and c: agent jobs (PID namespace, cgroup, eBPF sender-side log); b's only snapshots are those the agent takes as the jobs start (interval 1h)",
		"d: checkpoint files on the lab's shared disk (ext4, fsync), like FT-SPMD on NFS or a local disk that survives",
		fmt.Sprintf("failure detection: heartbeat %s, timeout %s (+ confirmation); a and d are killed and restarted %s after the crash", cmpHeartbeat, cmpTimeout, cmpDetect),
		fmt.Sprintf("b and c: the agents at heartbeat.nice %d (19: the jobs first), CRIU's dumps at checkpoint.dump_nice %d", sz.AgentNice, agentconfig.Defaults().Checkpoint.DumpNice),
		"restart_ms: crash to every rank computing again (c: restored; d: every rank loaded its checkpoint)",
		"caught_up_ms: crash to the job back at the crash point (c: replay done, the restored rank re-sent what its peers had; a, d: every rank reached the iteration the survivors had reached)",
		"delay: failure run minus the same variant's failure-free run",
		"b with a failure: not run; its crashed rank would be restored from its start snapshot and recompute everything",
		"the crash waits, if need be, until c's crashed rank has a replicated snapshot holding its connections and d's ranks have all written a checkpoint: crash_offset_s is when it came",
		"failure-free: median of size.rounds runs per variant; overhead: median over the rounds of each round's ratio to a; with a failure: one run each; a shared 2-core machine",
		"steady_overhead: the same ratio of the runs' steady states, from the moment the last rank has done iteration size.iters/20 to the end: without the launch, the connections and, in b and c, the snapshot the agents take as the jobs start (start_seconds, the median run's), costs a job pays once however long it runs",
	}}
	only := variantFilter(os.Getenv("FTBENCH_COMPARE_VARIANTS"))
	if only != nil {
		o.Notes = append(o.Notes, fmt.Sprintf("FTBENCH_COMPARE_VARIANTS=%s: only these variants, without failures", os.Getenv("FTBENCH_COMPARE_VARIANTS")))
	}
	plain := &plainLauncher{prog: prog, sz: sz, args: args, ref: ref, log: log}
	jobs := &jobLauncher{prog: prog, sz: sz, args: args, ref: ref, log: log}

	// Failure-free runs, in rounds (a fresh pair of labs each) so that the machine's other load spreads
	// over all variants; the median round counts. a and d run in a lab without agents, b and c with. Odd
	// rounds run every variant in the reverse order (round 0's a comes first: it sets c's interval): in a
	// fixed order, a drift of the shared machine within a round lands on the later variants every time (the
	// 2026-12-02 compare had c over a +11%, +27% and +2% in its three rounds, b -2% to +10%).
	for round := range sz.Rounds {
		reversed := round%2 == 1
		order := func(vs ...string) []string {
			if reversed {
				slices.Reverse(vs)
			}
			return vs
		}
		plainRuns := func() error {
			return withLab(ctx, log, sz, nil, func(l *lab.Lab, _ *labcluster.Cluster) error {
				for _, v := range order("a", "d") {
					if !only.has(v) && v != "a" { // a in every round: c's interval comes from its first run, and overheads pair rounds
						continue
					}
					r, err := plain.run(ctx, l, v, nil, 7600+10*round)
					if err != nil {
						return err
					}
					r.Round = round
					o.Runs = append(o.Runs, *r)
					if v == "a" && round == 0 {
						// c's snapshot interval is K iterations of the plain run, in seconds.
						jobs.perIter = time.Duration(r.Seconds / float64(sz.Iters) * float64(time.Second))
						// Never below the agents' floor (checkpoint.min_interval, 1 s by default), which refuses
						// faster job intervals: the small size's K iterations take about that long.
						o.Interval = max((jobs.perIter * time.Duration(sz.CkptEvery)).Round(10*time.Millisecond), minJobInterval)
					}
				}
				return nil
			})
		}
		agentRuns := func() error {
			return withLab(ctx, log, sz, agents, func(l *lab.Lab, c *labcluster.Cluster) error {
				for _, v := range order("b", "c") {
					if !only.has(v) {
						continue
					}
					interval := "1h"
					if v == "c" {
						interval = o.Interval.String()
					}
					before, err := agentsCPU(c)
					if err != nil {
						return err
					}
					r, err := jobs.run(ctx, c, v, interval, 0, 7605+10*round)
					if err != nil {
						return err
					}
					after, err := agentsCPU(c)
					if err != nil {
						return err
					}
					for h, s := range after {
						r.AgentsCPUS += s - before[h]
					}
					r.Round = round
					o.Runs = append(o.Runs, *r)
				}
				return nil
			})
		}
		labs := []func() error{plainRuns, agentRuns}
		if reversed {
			slices.Reverse(labs)
		}
		for _, run := range labs {
			if err := run(); err != nil {
				return nil, err
			}
		}
	}
	if only != nil {
		return o, nil
	}
	crashAt := time.Duration(sz.CrashAt * o.run("a", false).Seconds * float64(time.Second))
	log.Info("compare: plain run measured", "seconds", o.run("a", false).Seconds, "ftkit_interval", o.Interval, "crash_at", crashAt)

	// Each failure run gets a fresh lab: the crash destroys node2 and uses up the spare.
	for _, v := range []string{"a", "d"} {
		err = withLab(ctx, log, sz, nil, func(l *lab.Lab, _ *labcluster.Cluster) error {
			r, err := plain.run(ctx, l, v, &crashPlan{at: crashAt}, 7640)
			if err != nil {
				return err
			}
			o.Runs = append(o.Runs, *r)
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	err = withLab(ctx, log, sz, agents, func(l *lab.Lab, c *labcluster.Cluster) error {
		r, err := jobs.run(ctx, c, "c", o.Interval.String(), crashAt, 7650)
		if err != nil {
			return err
		}
		o.Runs = append(o.Runs, *r)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return o, nil
}

// variantSet is the variants FTBENCH_COMPARE_VARIANTS names (a comma-separated list, for a quick
// failure-free measurement of some of them), or nil for all of them with their failure runs.
type variantSet map[string]bool

func variantFilter(env string) variantSet {
	if env == "" {
		return nil
	}
	set := variantSet{}
	for _, v := range strings.Split(env, ",") {
		set[strings.TrimSpace(v)] = true
	}
	return set
}

func (s variantSet) has(v string) bool { return s == nil || s[v] }

// cmpAgents is the comparison's agents: every job protected from its start (interval 1h), the heartbeat
// every variant's detection is matched to, at size sz's heartbeat.nice.
func cmpAgents(binDir string, sz compareSize) *labcluster.Options {
	return &labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", Keep: cmpKeep,
		LogLevel: "warn", Heartbeat: cmpHeartbeat, HeartbeatTimeout: cmpTimeout, Nice: sz.AgentNice}
}

// withLab builds the comparison's lab (the ranks' hosts and one spare), with agents configured by agents
// unless it is nil, runs fn, and removes the lab whatever happened.
func withLab(ctx context.Context, log *slog.Logger, sz compareSize, agents *labcluster.Options, fn func(*lab.Lab, *labcluster.Cluster) error) (err error) {
	l, err := lab.Up(ctx, lab.Config{ID: cmpLabID, Nodes: sz.Ranks, Spares: 1, Subnet: cmpSubnet}, lab.Options{Logger: log})
	if err != nil {
		return fmt.Errorf("lab up (if a previous run left it, `ftctl lab down --lab %s`): %w", cmpLabID, err)
	}
	defer func() {
		if derr := l.Down(context.WithoutCancel(ctx)); derr != nil {
			err = errors.Join(err, fmt.Errorf("lab down: %w", derr))
		}
	}()
	var c *labcluster.Cluster
	if agents != nil {
		c, err = labcluster.Start(ctx, l, *agents)
		if err != nil {
			return err
		}
	}
	err = fn(l, c)
	if err != nil && c != nil {
		// The agents' logs go with the lab; keep them for the post-mortem.
		keep, kerr := os.MkdirTemp("", "ftbench-compare-logs-")
		if kerr == nil {
			for _, h := range l.State().Hosts {
				if b, rerr := os.ReadFile(c.LogPath(h.Name)); rerr == nil {
					os.WriteFile(filepath.Join(keep, h.Name+".log"), b, 0o644)
				}
			}
			err = fmt.Errorf("%w (agent logs kept in %s)", err, keep)
		}
	}
	return err
}

// hostOf is the lab host of rank r before any failure.
func hostOf(r int) string { return fmt.Sprintf("node%d", r+1) }

func peersOf(l *lab.Lab, hosts []string, port int) (string, error) {
	var peers []string
	for _, name := range hosts {
		h, err := l.Host(name)
		if err != nil {
			return "", err
		}
		peers = append(peers, netip.AddrPortFrom(h.Addr.Addr(), uint16(port)).String())
	}
	return strings.Join(peers, ","), nil
}

type crashPlan struct{ at time.Duration }

// plainLauncher runs variants a and d: processes exec'd straight into the lab hosts' namespaces.
type plainLauncher struct {
	prog string
	sz   compareSize
	args []string
	ref  string
	log  *slog.Logger
}

type plainRank struct {
	cmd  *exec.Cmd
	out  string
	done chan struct{} // closed once the process is reaped; err is then set
	err  error
}

func (p *plainLauncher) start(l *lab.Lab, dir string, hosts []string, port int, extra []string, tag string) ([]*plainRank, error) {
	peers, err := peersOf(l, hosts, port)
	if err != nil {
		return nil, err
	}
	var ranks []*plainRank
	for r, host := range hosts {
		out := filepath.Join(dir, fmt.Sprintf("%s-rank%d.out", tag, r))
		f, err := os.Create(out)
		if err != nil {
			return ranks, err
		}
		a := append([]string{"--rank", fmt.Sprint(r), "--peers", peers}, p.args...)
		cmd := exec.Command(p.prog, append(a, extra...)...)
		cmd.Stdout, cmd.Stderr = f, f
		err = l.Start(host, cmd)
		f.Close()
		if err != nil {
			return ranks, fmt.Errorf("start rank %d on %s: %w", r, host, err)
		}
		pr := &plainRank{cmd: cmd, out: out, done: make(chan struct{})}
		go func() { pr.err = cmd.Wait(); close(pr.done) }()
		ranks = append(ranks, pr)
	}
	return ranks, nil
}

// kill stops whatever of ranks is still running (by its own PID) and reaps it.
func kill(ranks []*plainRank, sig syscall.Signal) {
	for _, r := range ranks {
		select {
		case <-r.done: // reaped: its PID may belong to another process by now
		default:
			r.cmd.Process.Signal(sig)
		}
	}
	for _, r := range ranks {
		select {
		case <-r.done:
		case <-time.After(10 * time.Second):
			r.cmd.Process.Kill()
			<-r.done
		}
	}
}

func waitPlain(ctx context.Context, ranks []*plainRank, timeout time.Duration) error {
	var errs []error
	deadline := time.After(timeout)
	for r, pr := range ranks {
		select {
		case <-pr.done:
			if pr.err != nil {
				b, _ := os.ReadFile(pr.out)
				errs = append(errs, fmt.Errorf("rank %d: %w: %s", r, pr.err, tailOf(string(b))))
			}
		case <-deadline:
			return fmt.Errorf("rank %d did not finish within %s", r, timeout)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return errors.Join(errs...)
}

// compareDataRoot holds the plain variants' run directories (their application checkpoints): on disk, where
// the agents of the other variants keep their snapshots, not on a tmpfs /tmp.
const compareDataRoot = "/var/lib/ftkit"

// runDir makes a fresh run directory under root, creating root first: a fresh machine has no
// /var/lib/ftkit before its first lab.
func runDir(root string) (string, error) {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return "", fmt.Errorf("compare: create %s: %w", root, err)
	}
	return os.MkdirTemp(root, "ftbench-compare-")
}

func (p *plainLauncher) run(ctx context.Context, l *lab.Lab, variant string, crash *crashPlan, port int) (*variantRun, error) {
	dir, err := runDir(compareDataRoot)
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	ckptDir := filepath.Join(dir, "ckpt")
	if err := os.Mkdir(ckptDir, 0o755); err != nil {
		return nil, err
	}
	var extra []string
	if variant == "d" {
		extra = []string{"--ckpt-dir", ckptDir, "--ckpt-every", fmt.Sprint(p.sz.CkptEvery)}
	}
	hosts := make([]string, p.sz.Ranks)
	for r := range hosts {
		hosts[r] = hostOf(r)
	}
	res := &variantRun{Variant: variant, Failure: crash != nil}
	first := extra
	if crash == nil {
		first = append(append([]string(nil), extra...), p.sz.warmArgs()...)
	}
	start := time.Now()
	ranks, err := p.start(l, dir, hosts, port, first, "first")
	defer func() { kill(ranks, syscall.SIGKILL) }()
	if err != nil {
		return nil, err
	}
	final := ranks
	var end time.Time // failure-free: when the last rank ended
	if crash != nil {
		if err := sleepCtx(ctx, crash.at-time.Since(start)); err != nil {
			return nil, err
		}
		if variant == "d" {
			// The crash tests a restart from checkpoints: it must not come before every rank has one.
			if err := waitAppCheckpoints(ctx, ckptDir, p.sz.Ranks, ranks, 5*time.Minute); err != nil {
				return nil, err
			}
		}
		crashed := time.Now()
		res.CrashOffsetS = crashed.Sub(start).Seconds()
		if err := l.Crash(ctx, cmpCrashed); err != nil {
			return nil, err
		}
		// The survivors block on the dead rank's halo forever; after the detection timeout they are
		// stopped (SIGTERM makes them say how far they got) and everything restarts.
		if err := sleepCtx(ctx, cmpDetect); err != nil {
			return nil, err
		}
		kill(ranks, syscall.SIGTERM)
		for r, pr := range ranks {
			if r == 1 {
				continue
			}
			b, _ := os.ReadFile(pr.out)
			if it, ok := stoppedAt(string(b)); ok && it > res.ItersAtCrash {
				res.ItersAtCrash = it
			}
		}
		hosts[1] = "spare1"
		again := append(append([]string(nil), extra...), "--report-at", fmt.Sprint(res.ItersAtCrash))
		if variant == "d" {
			again = append(again, "--restart")
		}
		final, err = p.start(l, dir, hosts, port+1, again, "restart")
		defer func() { kill(final, syscall.SIGKILL) }()
		if err != nil {
			return nil, err
		}
		if err := waitPlain(ctx, final, 10*time.Minute); err != nil {
			return nil, err
		}
		res.Seconds = time.Since(start).Seconds()
		var back, caughtUp time.Time
		for r, pr := range final {
			b, _ := os.ReadFile(pr.out)
			from, resumed, ok := stampedLine(string(b), "resumed")
			if variant == "d" && !ok {
				return nil, fmt.Errorf("rank %d did not report where it resumed: %s", r, tailOf(string(b)))
			}
			res.ResumedFrom = from
			back = latest(back, resumed)
			if _, reached, ok := stampedLine(string(b), "reached"); ok {
				caughtUp = latest(caughtUp, reached)
			} else {
				caughtUp = latest(caughtUp, resumed) // resumed exactly at the crash point
			}
		}
		if variant == "d" {
			res.RestartMs = float64(back.Sub(crashed)) / 1e6
		}
		if !caughtUp.IsZero() {
			res.CaughtUpMs = float64(caughtUp.Sub(crashed)) / 1e6
		}
		redone := max(res.ItersAtCrash-res.ResumedFrom, 0)
		res.SurvivorRedone = redone * (p.sz.Ranks - 1)
		res.CrashedRedoneEst = float64(redone)
	} else {
		if err := waitPlain(ctx, final, 10*time.Minute); err != nil {
			return nil, err
		}
		end = time.Now()
		res.Seconds = end.Sub(start).Seconds()
	}
	if variant == "d" {
		its, _ := os.ReadDir(ckptDir)
		for _, e := range its {
			if fi, err := e.Info(); err == nil && strings.HasSuffix(e.Name(), ".ckpt") {
				res.AppCkptMB = float64(fi.Size()) / 1e6
			}
		}
	}
	res.Identical = true
	var outs []string
	for _, pr := range final {
		b, _ := os.ReadFile(pr.out)
		outs = append(outs, string(b))
		sum := checksumLine(string(b))
		res.Checksums = append(res.Checksums, sum)
		res.Identical = res.Identical && sum == p.ref
	}
	if crash == nil {
		if res.SteadyS, err = steadySeconds(outs, end); err != nil {
			return nil, err
		}
	}
	p.log.Info("compare run", "variant", variant, "failure", crash != nil, "seconds", res.Seconds, "restart_ms", res.RestartMs, "caught_up_ms", res.CaughtUpMs,
		"iters_at_crash", res.ItersAtCrash, "resumed_from", res.ResumedFrom, "identical", res.Identical)
	if !res.Identical {
		return nil, fmt.Errorf("variant %s (failure %v): checksums %v differ from the reference %s", variant, crash != nil, res.Checksums, p.ref)
	}
	return res, nil
}

// jobLauncher runs variants b and c: ranks as jobs of the lab's agents.
type jobLauncher struct {
	perIter time.Duration // an iteration's time in the plain run, to convert lost time to iterations
	prog    string
	sz      compareSize
	args    []string
	ref     string
	log     *slog.Logger
}

// minJobInterval is the agents' default checkpoint.min_interval (the lab's agents use the default).
const minJobInterval = time.Second

func (p *jobLauncher) run(ctx context.Context, c *labcluster.Cluster, variant, interval string, crashAt time.Duration, port int) (*variantRun, error) {
	hosts := make([]string, p.sz.Ranks)
	for r := range hosts {
		hosts[r] = hostOf(r)
	}
	peers, err := peersOf(c.Lab, hosts, port)
	if err != nil {
		return nil, err
	}
	res := &variantRun{Variant: variant, Failure: crashAt > 0}
	// The crashed rank must not end before a replica holds its connections, however slow the host: it
	// waits for this file after its last iteration, which the crash creates once it has seen one.
	var covered string
	if crashAt > 0 {
		dir, err := os.MkdirTemp("", "ftbench-covered-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		covered = filepath.Join(dir, "covered")
	}
	var jobs []agent.Job
	start := time.Now()
	for r, host := range hosts {
		argv := append([]string{p.prog, "--rank", fmt.Sprint(r), "--peers", peers}, p.args...)
		if crashAt == 0 {
			argv = append(argv, p.sz.warmArgs()...)
		}
		if r == 1 && covered != "" {
			argv = append(argv, "--end-after", covered)
		}
		// One run, as ftctl mpirun makes it: its ranks' snapshots share a grid (docs/design.md).
		j, err := c.Client(host).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("%s%d", variant, r), Argv: argv, Interval: interval, Run: "stencil2d-" + variant})
		if err != nil {
			return nil, fmt.Errorf("start rank %d on %s: %w", r, host, err)
		}
		jobs = append(jobs, j)
	}
	// Stop the jobs if anything below fails; the lab teardown would kill them too.
	defer func() {
		for r, j := range jobs {
			if _, err := shim.ReadExit(j.ExitPath()); err != nil {
				for _, h := range []string{hosts[r], "spare1"} {
					c.Client(h).Signal(context.WithoutCancel(ctx), j.ID, syscall.SIGKILL)
				}
			}
		}
	}()
	var before []agent.Job
	var crashed time.Time
	if crashAt > 0 {
		if err := sleepCtx(ctx, crashAt-time.Since(start)); err != nil {
			return nil, err
		}
		// Recovery needs a replica of the crashed rank holding its connections (opened after the snapshot
		// taken as it started): the crash waits for one if it is not there yet.
		if err := waitCovered(ctx, c, cmpCrashed, jobs[1].ID, 5*time.Minute); err != nil {
			return nil, err
		}
		if err := os.WriteFile(covered, nil, 0o644); err != nil {
			return nil, err
		}
		for r, j := range jobs {
			jj, err := c.Client(hosts[r]).Job(ctx, j.ID)
			if err != nil {
				return nil, err
			}
			before = append(before, jj)
		}
		crashed = time.Now()
		res.CrashOffsetS = crashed.Sub(start).Seconds()
		if err := c.Lab.Crash(ctx, cmpCrashed); err != nil {
			return nil, err
		}
		f, err := waitRecovered(ctx, c, cmpCrashed, 3*time.Minute)
		if err != nil {
			return nil, err
		}
		var restored, replayed time.Time
		var stages []recoveryStage
		for _, s := range f.Stages {
			d := s.Duration()
			if s.Name == agent.StageDetected {
				d = s.End.Sub(crashed)
			}
			stages = append(stages, recoveryStage{Name: s.Name, Ms: float64(d) / 1e6})
			switch s.Name {
			case agent.StageRestored:
				restored = latest(restored, s.End)
			case agent.StageReplayed:
				replayed = latest(replayed, s.End)
			}
		}
		res.Stages = stages
		res.RestartMs, res.CaughtUpMs = float64(restored.Sub(crashed))/1e6, float64(replayed.Sub(crashed))/1e6
	}
	var end time.Time
	for _, j := range jobs {
		if err := waitExit(ctx, j, 10*time.Minute); err != nil {
			return nil, err
		}
		st, err := shim.ReadExit(j.ExitPath())
		if err != nil {
			return nil, err
		}
		if st.Time.After(end) {
			end = st.Time
		}
	}
	res.Seconds = end.Sub(start).Seconds()
	res.Identical = true
	var outs []string
	for _, j := range jobs {
		b, _ := os.ReadFile(j.StdoutPath())
		outs = append(outs, string(b))
		sum := checksumLine(string(b))
		res.Checksums = append(res.Checksums, sum)
		res.Identical = res.Identical && sum == p.ref
	}
	if crashAt == 0 {
		if res.SteadyS, err = steadySeconds(outs, end); err != nil {
			return nil, err
		}
	}
	// Snapshots of every rank, from whichever live hosts hold them (own node, protector, restore target).
	manifests := map[string]*ckpt.Manifest{}
	rankOf := map[string]int{}
	for _, h := range c.Lab.State().Hosts {
		if h.Crashed {
			continue
		}
		for r, j := range jobs {
			ms, err := c.Client(h.Name).Snapshots(ctx, j.ID)
			if err != nil {
				continue
			}
			for _, m := range ms {
				manifests[m.ID], rankOf[m.ID] = m, r
			}
		}
	}
	if crashed.IsZero() {
		var sum float64
		var frozen []float64
		for _, m := range manifests {
			sum += float64(m.TotalSize()) / 1e6
			frozen = append(frozen, float64(m.Stats.FrozenTime)/1e6)
		}
		res.Snapshots = len(manifests)
		if len(manifests) > 0 {
			res.SnapshotMB, res.SnapshotFrozenMs = sum/float64(len(manifests)), median(frozen)
		}
	} else {
		// The crashed rank recomputed what it had done since its newest snapshot before the crash.
		var restoredFrom time.Time
		for id, m := range manifests {
			if rankOf[id] == 1 && m.Created.Before(crashed) && m.Created.After(restoredFrom) {
				restoredFrom = m.Created
			}
		}
		if !restoredFrom.IsZero() {
			res.CrashedRedoneEst = crashed.Sub(restoredFrom).Seconds() / p.perIter.Seconds()
		}
		// Survivors lost nothing if they are the same processes, never restored.
		res.SurvivorsKept = true
		for r, b := range before {
			if r == 1 {
				continue
			}
			after, err := c.Client(hosts[r]).Job(ctx, b.ID)
			if err != nil || after.PID != b.PID || after.Restored != "" {
				res.SurvivorsKept = false
			}
		}
	}
	p.log.Info("compare run", "variant", variant, "failure", res.Failure, "seconds", res.Seconds, "restart_ms", res.RestartMs, "caught_up_ms", res.CaughtUpMs,
		"snapshots", res.Snapshots, "snapshot_mb", res.SnapshotMB, "identical", res.Identical, "survivors_kept", res.SurvivorsKept)
	if !res.Identical {
		return nil, fmt.Errorf("variant %s (failure %v): checksums %v differ from the reference %s", variant, res.Failure, res.Checksums, p.ref)
	}
	return res, nil
}

// waitCovered waits until host's agent reports the job covered (a snapshot of it holding every connection
// it has now reached a protector) by a check of its connections that began after the call. timeout is a
// failure bound only.
func waitCovered(ctx context.Context, c *labcluster.Cluster, host, id string, timeout time.Duration) error {
	since := time.Now()
	deadline := since.Add(timeout)
	for {
		j, err := c.Client(host).Job(ctx, id)
		if err == nil && j.ConnsChecked.After(since) && j.Covered() {
			return nil
		}
		if err == nil && j.State != agent.JobRunning {
			return fmt.Errorf("job %s on %s ended (%s) before it was seen covered: a crash now has nothing to recover (last state %+v)", id, host, j.State, j)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("job %s on %s has no replicated snapshot holding its connections after %s (last state %+v, %v)", id, host, timeout, j, err)
		}
		if serr := sleepCtx(ctx, 50*time.Millisecond); serr != nil {
			return fmt.Errorf("waiting for job %s on %s to be covered (last state %+v, %v): %w", id, host, j, err, serr)
		}
	}
}

// waitAppCheckpoints waits until each of the ranks has a complete application checkpoint in dir
// (stencil2d renames a checkpoint into place once it is written and synced). timeout is a failure bound
// only; a rank that exits first fails the wait.
func waitAppCheckpoints(ctx context.Context, dir string, ranks int, procs []*plainRank, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		have := 0
		for r := range ranks {
			if m, _ := filepath.Glob(filepath.Join(dir, fmt.Sprintf("rank-%d-iter-*.ckpt", r))); len(m) > 0 {
				have++
			}
		}
		if have == ranks {
			return nil
		}
		for r, pr := range procs {
			select {
			case <-pr.done:
				b, _ := os.ReadFile(pr.out)
				return fmt.Errorf("rank %d ended before every rank had a checkpoint (%v): %s", r, pr.err, tailOf(string(b)))
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d ranks have a checkpoint in %s after %s", have, ranks, dir, timeout)
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// checksumLine is the checksum of the last "rank R checksum HEX" line that stencil2d and ringstencil print
// ("" if none).
func checksumLine(out string) string {
	var sum string
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[2] == "checksum" {
			sum = f[3]
		}
	}
	return sum
}

// stoppedAt parses "rank R stopped at iteration I".
func stoppedAt(out string) (int, bool) {
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 6 && f[2] == "stopped" {
			it, err := strconv.Atoi(f[5])
			return it, err == nil
		}
	}
	return 0, false
}

// stampedLine parses "rank R resumed from iteration I at UNIXNANO" (what "resumed") or
// "rank R reached iteration I at UNIXNANO" (what "reached").
func stampedLine(out, what string) (int, time.Time, bool) {
	n := map[string]int{"resumed": 8, "reached": 7}[what]
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == n && f[2] == what {
			it, err1 := strconv.Atoi(f[n-3])
			ns, err2 := strconv.ParseInt(f[n-1], 10, 64)
			if err1 == nil && err2 == nil {
				return it, time.Unix(0, ns), true
			}
		}
	}
	return 0, time.Time{}, false
}

// steadySeconds is a failure-free run's steady state, from the moment the last rank reached warmIters (the
// ranks' outputs say when) to end.
func steadySeconds(outs []string, end time.Time) (float64, error) {
	var t time.Time
	for r, out := range outs {
		_, reached, ok := stampedLine(out, "reached")
		if !ok {
			return 0, fmt.Errorf("rank %d did not say when it reached the steady state's first iteration: %s", r, tailOf(out))
		}
		t = latest(t, reached)
	}
	return end.Sub(t).Seconds(), nil
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func tailOf(s string) string {
	if len(s) > 400 {
		return "..." + s[len(s)-400:]
	}
	return s
}

var variantLabels = []struct{ key, label string }{
	{"a", "a: plain"}, {"b", "b: ftkit log"}, {"c", "c: ftkit log+snap"}, {"d", "d: app checkpoints"},
}

func (o *compareOutcome) metrics() []Metric {
	var ms []Metric
	add := func(name string, v float64, unit string) { ms = append(ms, Metric{Name: name, Value: v, Unit: unit}) }
	base := o.run("a", false)
	identical := 0
	for _, r := range o.Runs {
		if r.Identical {
			identical++
		}
	}
	for _, v := range variantLabels {
		if r := o.run(v.key, false); r != nil {
			add(v.key+"_seconds", r.Seconds, "s")
			if v.key != "a" && base != nil {
				add(v.key+"_overhead", (o.ratioToPlain(v.key, runTime)-1)*100, "%")
				if r.SteadyS > 0 && base.SteadyS > 0 {
					add(v.key+"_steady_overhead", (o.ratioToPlain(v.key, steadyTime)-1)*100, "%")
				}
			}
			if r.SteadyS > 0 {
				add(v.key+"_start_seconds", r.Seconds-r.SteadyS, "s")
			}
			if r.AgentsCPUS > 0 {
				add(v.key+"_agents_cpu", r.AgentsCPUS, "s")
			}
		}
	}
	for _, v := range variantLabels {
		r := o.run(v.key, true)
		if r == nil {
			continue
		}
		add(v.key+"_failure_seconds", r.Seconds, "s")
		if base != nil {
			add(v.key+"_failure_vs_a", r.Seconds/base.Seconds, "x")
		}
		if ok := o.run(v.key, false); ok != nil {
			add(v.key+"_failure_delay", r.Seconds-ok.Seconds, "s")
		}
		if r.RestartMs > 0 {
			add(v.key+"_mttr_restart", r.RestartMs, "ms")
		}
		if r.CaughtUpMs > 0 {
			add(v.key+"_mttr_caught_up", r.CaughtUpMs, "ms")
		}
		add(v.key+"_survivor_iters_redone", float64(r.SurvivorRedone), "iterations")
		add(v.key+"_crashed_rank_iters_redone", r.CrashedRedoneEst, "iterations")
	}
	if c := o.run("c", false); c != nil {
		add("c_snapshots_taken", float64(c.Snapshots), "snapshots")
		add("c_snapshot_size_mean", c.SnapshotMB, "MB")
		add("c_snapshot_frozen_median", c.SnapshotFrozenMs, "ms")
		if d := o.run("d", false); d != nil && d.AppCkptMB > 0 {
			add("d_app_checkpoint_size", d.AppCkptMB, "MB")
			add("snapshot_vs_app_checkpoint", c.SnapshotMB/d.AppCkptMB, "x")
		}
	}
	add("runs_identical", float64(identical), fmt.Sprintf("of %d", len(o.Runs)))
	return ms
}

func runTime(r *variantRun) float64    { return r.Seconds }
func steadyTime(r *variantRun) float64 { return r.SteadyS }

// ratioToPlain is variant v's failure-free time (of: the whole run's, or its steady state's) over a's: the
// median over the rounds that ran both of each round's ratio, as the receive-order benchmark pairs its runs
// (the machine's load drifts between rounds, minutes apart, more than within one), or the ratio of the
// medians when fewer than two rounds ran both.
func (o *compareOutcome) ratioToPlain(v string, of func(*variantRun) float64) float64 {
	plain := map[int]float64{}
	for i := range o.Runs {
		if r := &o.Runs[i]; r.Variant == "a" && !r.Failure {
			plain[r.Round] = of(r)
		}
	}
	var ratios []float64
	for i := range o.Runs {
		if r := &o.Runs[i]; r.Variant == v && !r.Failure && plain[r.Round] > 0 && of(r) > 0 {
			ratios = append(ratios, of(r)/plain[r.Round])
		}
	}
	if len(ratios) < 2 {
		return of(o.run(v, false)) / of(o.run("a", false))
	}
	return median(ratios)
}

// svg draws grouped bars of run time per variant, without and with the failure, as plain SVG text.
func (o *compareOutcome) svg() string {
	const w, h, left, right, top, bottom = 760.0, 440.0, 70.0, 20.0, 70.0, 70.0
	maxV := 0.0
	for _, r := range o.Runs {
		maxV = max(maxV, r.Seconds)
	}
	step := niceStep(maxV / 5)
	yMax := step * float64(int(maxV/step)+1)
	y := func(v float64) float64 { return top + (h-top-bottom)*(1-v/yMax) }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="13">`+"\n", w, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%.0f" y="24" font-size="16" font-weight="bold">Run time: ftkit vs application-level checkpointing</text>`+"\n", left)
	fmt.Fprintf(&b, `<text x="%.0f" y="44" fill="#444">stencil2d %dx%d, %d ranks, %d iterations; checkpoint every %d iterations (%s); crash of rank 1 at %.0f%% of a</text>`+"\n",
		left, o.Size.Grid, o.Size.Grid, o.Size.Ranks, o.Size.Iters, o.Size.CkptEvery, o.Interval, o.Size.CrashAt*100)
	for v := 0.0; v <= yMax+step/2; v += step {
		fmt.Fprintf(&b, `<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, w-right, y(v), y(v))
		fmt.Fprintf(&b, `<text x="%.0f" y="%.1f" text-anchor="end" fill="#444">%g s</text>`+"\n", left-6, y(v)+4, v)
	}
	groupW := (w - left - right) / float64(len(variantLabels))
	barW := groupW * 0.32
	colors := map[bool]string{false: "#4878d0", true: "#ee854a"}
	for i, v := range variantLabels {
		x0 := left + groupW*float64(i) + groupW*0.16
		for k, failure := range []bool{false, true} {
			x := x0 + float64(k)*barW
			r := o.run(v.key, failure)
			if r == nil {
				fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#888" font-size="11">n/a</text>`+"\n", x+barW/2, y(0)-20)
				fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#888" font-size="10">not run</text>`+"\n", x+barW/2, y(0)-6)
				continue
			}
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`+"\n", x, y(r.Seconds), barW-2, y(0)-y(r.Seconds), colors[failure])
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="12">%.1f</text>`+"\n", x+barW/2, y(r.Seconds)-4, r.Seconds)
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", x0+barW, h-bottom+20, v.label)
		// The metrics' overhead (rounds paired), not the median run's over a's, which may be another round's.
		if base, r := o.run("a", false), o.run(v.key, false); v.key != "a" && base != nil && r != nil {
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#444" font-size="11">%+.1f%% vs a</text>`+"\n", x0+barW, h-bottom+36, (o.ratioToPlain(v.key, runTime)-1)*100)
		}
	}
	if base := o.run("a", false); base != nil {
		fmt.Fprintf(&b, `<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#333" stroke-dasharray="4 3"/>`+"\n", left, w-right, y(base.Seconds), y(base.Seconds))
	}
	lx := w - right - 250
	for k, failure := range []bool{false, true} {
		label := "no failure"
		if failure {
			label = "one node crash"
		}
		fmt.Fprintf(&b, `<rect x="%.0f" y="%.0f" width="12" height="12" fill="%s"/><text x="%.0f" y="%.0f">%s</text>`+"\n",
			lx+float64(k)*125, h-22.0, colors[failure], lx+float64(k)*125+16, h-12.0, label)
	}
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" fill="#444" font-size="11">dashed: a without failure</text>`+"\n", left, h-12.0)
	b.WriteString("</svg>\n")
	return b.String()
}

// niceStep rounds a raw tick step up to 1, 2 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if raw <= 0 {
		return 1
	}
	p := 1.0
	for p*10 <= raw {
		p *= 10
	}
	for p > raw {
		p /= 10
	}
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}
