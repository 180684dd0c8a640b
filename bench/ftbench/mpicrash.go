package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/internal/lammps"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// benchMPICrash is issue 13's LAMMPS case: LAMMPS's melt (Debian's lmp, Open MPI over TCP) under
// `ftctl mpirun`, one rank per lab node, failure-free and with node1 or node2 crashed mid-run. node1's job
// holds mpirun and rank 0, whose connections to every other rank are restored; node2's only rank 1's. The
// target: the run with node1 crashed within 10% of the run with node2 crashed, which it was not while
// restored sockets sent 524-byte segments (32 s, against 13 s failure-free). Each round crashes each host once, in a lab of
// its own that first runs the failure-free reference; every crashed run's thermodynamic table must equal
// its reference's.
func benchMPICrash(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	for _, p := range []string{"mpirun.openmpi", "lmp"} {
		if _, err := exec.LookPath(p); err != nil {
			return nil, nil, fmt.Errorf("%s is not installed (scripts/setup.sh installs openmpi-bin lammps lammps-examples): %w", p, err)
		}
	}
	input, err := lammps.MeltInput()
	if err != nil {
		return nil, nil, err
	}
	load, _ := os.ReadFile("/proc/loadavg")
	const rounds = 3
	hosts := []string{"node1", "node2"}
	var runs []*mpiCrashResult
	for round := range rounds {
		for _, host := range hosts {
			r, err := mpiCrashRun(ctx, log, binDir, input, host)
			if err != nil {
				return nil, nil, fmt.Errorf("round %d, %s crashed: %w", round+1, host, err)
			}
			runs = append(runs, r)
		}
	}
	medianOf := func(host string, v func(*mpiCrashResult) float64) float64 {
		var xs []float64
		for _, r := range runs {
			if r.Crashed == host {
				xs = append(xs, v(r))
			}
		}
		return median(xs)
	}
	var all []float64
	identical := 0
	for _, r := range runs {
		all = append(all, r.FailureFreeS)
		if r.Identical {
			identical++
		}
	}
	free := median(all)
	metrics := []Metric{{Name: "failure_free_s", Value: free, Unit: "s"}}
	crashed := map[string]float64{}
	for _, h := range hosts {
		crashed[h] = medianOf(h, func(r *mpiCrashResult) float64 { return r.CrashedS })
		metrics = append(metrics,
			Metric{Name: h + "_crashed_s", Value: crashed[h], Unit: "s"},
			Metric{Name: h + "_crashed_vs_failure_free", Value: medianOf(h, func(r *mpiCrashResult) float64 { return r.CrashedS / r.FailureFreeS }), Unit: "x"},
			Metric{Name: h + "_crash_to_running_ms", Value: medianOf(h, func(r *mpiCrashResult) float64 { return r.RunningMs }), Unit: "ms"},
			Metric{Name: h + "_crash_to_replay_done_ms", Value: medianOf(h, func(r *mpiCrashResult) float64 { return r.ReplayedMs }), Unit: "ms"},
			Metric{Name: h + "_crash_to_end_s", Value: medianOf(h, func(r *mpiCrashResult) float64 { return r.CrashToEndS }), Unit: "s"})
	}
	metrics = append(metrics,
		Metric{Name: "node1_vs_node2_crashed", Value: crashed["node1"] / crashed["node2"], Unit: "x"},
		Metric{Name: "runs_identical", Value: float64(identical), Unit: fmt.Sprintf("of %d", len(runs))})
	return metrics, map[string]any{
		"program":          "LAMMPS melt (4000 atoms, run 3000, thermo 500), ftctl mpirun --np 3, one rank per lab node, a spare, OMPI_MCA_mpi_yield_when_idle=1",
		"crash":            "the host's jobs snapshotted once the first thermo row is out, the host crashed at the next row",
		"detection":        "labcluster.FastDetection, fence script",
		"target":           "node1_vs_node2_crashed <= 1.10 (issue 13)",
		"rounds":           rounds,
		"loadavg_at_start": strings.TrimSpace(string(load)),
		"runs":             runs,
	}, nil
}

type mpiCrashResult struct {
	Crashed      string          `json:"crashed"`
	FailureFreeS float64         `json:"failure_free_s"`
	CrashedS     float64         `json:"crashed_s"`
	CrashToEndS  float64         `json:"crash_to_end_s"`
	RunningMs    float64         `json:"crash_to_running_ms"`
	ReplayedMs   float64         `json:"crash_to_replay_done_ms"`
	SnapshotMB   float64         `json:"snapshot_mb"` // the crashed host's job's snapshot, as stored
	Stages       []recoveryStage `json:"stages"`
	Identical    bool            `json:"identical"`
}

// mpiCrashRun runs LAMMPS failure-free, then with host crashed, in a lab of its own.
func mpiCrashRun(ctx context.Context, log *slog.Logger, binDir string, input []byte, host string) (_ *mpiCrashResult, err error) {
	l, err := lab.Up(ctx, lab.Config{ID: "fbmpi", Nodes: 3, Spares: 1, Subnet: netip.MustParsePrefix("10.242.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, fmt.Errorf("lab up (if a previous run left it, `ftctl lab down --lab fbmpi`): %w", err)
	}
	defer l.Down(context.WithoutCancel(ctx))
	dir, err := os.MkdirTemp("", "ftbench-mpi-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	// The jobs run as root, as ftctl does; their directory is the input's.
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "in.melt"), input, 0o644); err != nil {
		return nil, err
	}
	fence := filepath.Join(dir, "fence")
	if err := labcluster.WriteFenceScript(l.State(), fence, filepath.Join(dir, "fenced")); err != nil {
		return nil, err
	}
	c, err := labcluster.Start(ctx, l, labcluster.FastDetection(labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"),
		Interval: "1h", LogLevel: "info", FenceCommand: []string{fence, "{host}", "{address}"}}))
	if err != nil {
		return nil, err
	}
	defer keepLogsOnError(c, "mpi-crash-"+host, &err, log)
	ftctl := filepath.Join(binDir, "ftctl")

	ref := startLAMMPS(ctx, ftctl, l.State().ID, dir, "ref")
	if err := ref.wait(); err != nil {
		return nil, fmt.Errorf("failure-free run: %w", err)
	}
	want, err := ref.thermo()
	if err != nil {
		return nil, fmt.Errorf("failure-free run: %w", err)
	}
	res := &mpiCrashResult{Crashed: host, FailureFreeS: ref.took.Seconds()}

	r := startLAMMPS(ctx, ftctl, l.State().ID, dir, "ft")
	defer r.stop()
	if err := waitFor(ctx, 2*time.Minute, "the first thermo row", func() bool { return r.rows() >= 1 }); err != nil {
		return nil, r.with(err)
	}
	// Snapshotted with every MPI connection up (the first row is out) and replicated, then crashed a row
	// later, so that the restored rank has bytes to be replayed.
	id, err := jobOn(ctx, c, host, "ft-"+host)
	if err != nil {
		return nil, r.with(err)
	}
	if err := waitFor(ctx, time.Minute, "the first replica of "+host+"'s job", func() bool {
		j, err := c.Client(host).Job(ctx, id)
		return err == nil && j.Protected()
	}); err != nil {
		return nil, r.with(err)
	}
	reply, err := c.Client(host).Checkpoint(ctx, id)
	if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
		return nil, r.with(fmt.Errorf("checkpoint of %s: %+v %v", host, reply, err))
	}
	res.SnapshotMB = float64(reply.Results[0].Manifest.TotalSize()) / 1e6
	rows := r.rows()
	if err := waitFor(ctx, time.Minute, "the next thermo row", func() bool { return r.rows() > rows }); err != nil {
		return nil, r.with(err)
	}
	crash := time.Now()
	if err := l.Crash(ctx, host); err != nil {
		return nil, err
	}
	f, err := waitRecovered(ctx, c, host, 3*time.Minute)
	if err != nil {
		return nil, r.with(err)
	}
	t, err := timelineOf(f, crash)
	if err != nil {
		return nil, r.with(err)
	}
	res.Stages, res.RunningMs, res.ReplayedMs = t.stages, t.runningMs, t.replayedMs
	if err := r.wait(); err != nil {
		return nil, err
	}
	res.CrashedS, res.CrashToEndS = r.took.Seconds(), time.Since(crash).Seconds()
	got, err := r.thermo()
	if err != nil {
		return nil, err
	}
	res.Identical = got == want
	log.Info("mpi crash", "crashed", host, "failure_free_s", res.FailureFreeS, "crashed_s", res.CrashedS, "stages", res.Stages, "identical", res.Identical)
	return res, nil
}

// jobOn is the ID of the job named name on host.
func jobOn(ctx context.Context, c *labcluster.Cluster, host, name string) (string, error) {
	jobs, err := c.Client(host).Jobs(ctx)
	if err != nil {
		return "", fmt.Errorf("jobs of %s: %w", host, err)
	}
	for _, j := range jobs {
		if j.Spec.Name == name {
			return j.ID, nil
		}
	}
	return "", fmt.Errorf("no job %s on %s", name, host)
}

// lammpsRun is one `ftctl mpirun --np 3` of LAMMPS on a lab.
type lammpsRun struct {
	cmd   *exec.Cmd
	out   string // the file that takes its output, read as it is written
	start time.Time
	took  time.Duration
	done  chan error
}

func startLAMMPS(ctx context.Context, ftctl, labID, dir, name string) *lammpsRun {
	r := &lammpsRun{out: filepath.Join(dir, name+".out"), done: make(chan error, 1)}
	out, err := os.Create(r.out)
	if err != nil {
		r.done <- err
		return r
	}
	defer out.Close() // the command has its own descriptor once started
	r.cmd = exec.CommandContext(ctx, ftctl, "mpirun", "--lab", labID, "--np", "3", "--name", name, "--", "lmp", "-in", "in.melt")
	r.cmd.Dir = dir // ftctl mpirun --lab tells the ranks to yield when idle (docs/mpi.md)
	r.cmd.Stdout, r.cmd.Stderr = out, out
	// ftctl runs ftwrap: a group of their own, killed together.
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	r.cmd.Cancel = func() error { return syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL) }
	r.start = time.Now()
	if err := r.cmd.Start(); err != nil {
		r.done <- err
		return r
	}
	go func() {
		err := r.cmd.Wait()
		r.took = time.Since(r.start)
		r.done <- err
	}()
	return r
}

// wait waits for the run's end, at most 5 minutes.
func (r *lammpsRun) wait() error {
	select {
	case err := <-r.done:
		r.done <- err
		return r.with(err)
	case <-time.After(5 * time.Minute):
		r.stop()
		return r.with(errors.New("did not end within 5 minutes"))
	}
}

func (r *lammpsRun) stop() {
	if r.cmd != nil && r.cmd.Process != nil {
		syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
	}
}

// output is what the run printed so far.
func (r *lammpsRun) output() string {
	b, _ := os.ReadFile(r.out)
	return string(b)
}

// with adds the run's last output to err.
func (r *lammpsRun) with(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("ftctl mpirun: %w; its output ends:\n%s", err, tailOf(r.output()))
}

func (r *lammpsRun) rows() int { return len(lammps.ThermoTable(r.output())) }

// thermo is LAMMPS's thermodynamic table (steps 0 to 3000 by 500): every value depends on every atom's
// trajectory, so on every byte the ranks exchanged.
func (r *lammpsRun) thermo() (string, error) {
	rows := lammps.ThermoTable(r.output())
	if len(rows) != 7 {
		return "", r.with(fmt.Errorf("%d thermo rows, want 7", len(rows)))
	}
	return strings.Join(rows, "\n"), nil
}
