package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/shim"
)

// benchRecovery measures the mean time to recover from a node crash, broken down by stage (detection,
// the wait for the failed node's fence, transfer of the snapshot (prefetched by the claimed spare during
// that wait: what remains is its verification), image rewriting, CRIU restore, replay of what the peers
// already had), for a ringstencil rank holding 100 MiB, and the total with 2, 4 and 8 lab nodes. Every run also checks that
// the job's result is the failure-free one.
func benchRecovery(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	binDir, err := ownDir()
	if err != nil {
		return nil, nil, err
	}
	const ballastMiB = 100
	var metrics []Metric
	runs := map[string]any{}
	identical, total := 0, 0
	for _, nodes := range []int{2, 4, 8} {
		r, err := recoveryRun(ctx, log, binDir, nodes, ballastMiB)
		if err != nil {
			return nil, nil, fmt.Errorf("%d nodes: %w", nodes, err)
		}
		total++
		if r.Identical {
			identical++
		}
		runs[fmt.Sprintf("%d_nodes", nodes)] = r
		p := fmt.Sprintf("%dnodes_", nodes)
		metrics = append(metrics, Metric{Name: p + "recovery_total", Value: r.TotalMs, Unit: "ms"})
		if nodes == 4 {
			for _, st := range r.Stages {
				metrics = append(metrics, Metric{Name: "100MiB_" + strings.ReplaceAll(st.Name, " ", "_"), Value: st.Ms, Unit: "ms"})
			}
		}
	}
	metrics = append(metrics, Metric{Name: "runs_identical", Value: float64(identical), Unit: fmt.Sprintf("of %d", total)})
	return metrics, map[string]any{"ballast_mib": ballastMiB, "program": "ringstencil, 64 KiB halos, 20 ms per iteration",
		"crash": "node2 crashed 1.5 s after its snapshot", "heartbeat": "250ms, timeout 1.5s", "runs": runs}, nil
}

type recoveryStage struct {
	Name string  `json:"name"`
	Ms   float64 `json:"ms"`
}

// crashTimeline is a one-job recovery as the crash benches report it: its stages, detection counted from
// the crash, and the milliseconds from the crash to the job running again and to its replay done, and of
// the restore stage alone.
type crashTimeline struct {
	stages                           []recoveryStage
	runningMs, replayedMs, restoreMs float64
}

// timelineOf is f's crashTimeline for a crash at crash; a stage that failed is an error.
func timelineOf(f *agent.Failure, crash time.Time) (crashTimeline, error) {
	var t crashTimeline
	for _, s := range f.Stages {
		if s.Error != "" {
			return t, fmt.Errorf("stage %s: %s", s.Name, s.Error)
		}
		d := s.Duration()
		if s.Name == agent.StageDetected {
			d = s.End.Sub(crash)
		}
		t.stages = append(t.stages, recoveryStage{Name: s.Name, Ms: float64(d) / 1e6})
		switch s.Name {
		case agent.StageRestored:
			t.runningMs, t.restoreMs = float64(s.End.Sub(crash))/1e6, float64(d)/1e6
		case agent.StageReplayed:
			t.replayedMs = float64(s.End.Sub(crash)) / 1e6
		}
	}
	return t, nil
}

type recoveryResult struct {
	Nodes     int             `json:"nodes"`
	Stages    []recoveryStage `json:"stages"`
	TotalMs   float64         `json:"total_ms"` // crash to replay done
	Identical bool            `json:"identical"`
	Checksums []string        `json:"checksums"`
	Reference string          `json:"reference"`
}

func recoveryRun(ctx context.Context, log *slog.Logger, binDir string, nodes, ballastMiB int) (*recoveryResult, error) {
	stencil := filepath.Join(binDir, "ringstencil")
	args := []string{"--iters", "600", "--block", "65536", "--delay", "20ms"}
	ref, err := loopbackChecksum(ctx, stencil, nodes, args)
	if err != nil {
		return nil, err
	}
	l, err := lab.Up(ctx, lab.Config{ID: "fbrecov", Nodes: nodes, Spares: 1, Subnet: netip.MustParsePrefix("10.244.0.0/24")}, lab.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	defer l.Down(context.WithoutCancel(ctx))
	c, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: filepath.Join(binDir, "ftagent"), Interval: "1h", LogLevel: "warn"})
	if err != nil {
		return nil, err
	}
	var peers []string
	for r := range nodes {
		h, _ := l.Host(fmt.Sprintf("node%d", r+1))
		peers = append(peers, netip.AddrPortFrom(h.Addr.Addr(), 7500).String())
	}
	var jobs []agent.Job
	for r := range nodes {
		argv := append([]string{stencil, "--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ",")}, args...)
		if r == 1 {
			argv = append(argv, "--ballast", fmt.Sprint(ballastMiB))
		}
		j, err := c.Client(fmt.Sprintf("node%d", r+1)).StartJob(ctx, agent.JobSpec{Name: fmt.Sprintf("rank%d", r), Argv: argv})
		if err != nil {
			return nil, err
		}
		jobs = append(jobs, j)
	}
	time.Sleep(3 * time.Second)
	if reply, err := c.Client("node2").Checkpoint(ctx); err != nil || reply.Error != "" || len(reply.Results) == 0 || !reply.Results[0].Shipped {
		return nil, fmt.Errorf("checkpoint of node2: %+v %v", reply, err)
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
	res := &recoveryResult{Nodes: nodes, Reference: ref}
	stageMs := map[string]float64{}
	var last time.Time
	for _, s := range f.Stages {
		if s.Error != "" {
			return nil, fmt.Errorf("stage %s: %s", s.Name, s.Error)
		}
		d := s.Duration()
		if s.Name == agent.StageDetected {
			d = s.End.Sub(crash) // from the crash itself, not from the last heartbeat
		}
		stageMs[s.Name] += float64(d) / 1e6
		if s.Name != agent.StageProtected && s.End.After(last) {
			last = s.End
		}
	}
	for _, name := range []string{agent.StageDetected, agent.StageClaimed, agent.StageFenced, agent.StageFetched, agent.StageRewritten,
		agent.StageRestored, agent.StageReplayed, agent.StageProtected} {
		res.Stages = append(res.Stages, recoveryStage{Name: name, Ms: stageMs[name]})
	}
	res.TotalMs = float64(last.Sub(crash)) / 1e6
	if res.Checksums, res.Identical, err = finalChecksums(ctx, jobs, ref); err != nil {
		return nil, err
	}
	log.Info("recovery", "nodes", nodes, "total_ms", res.TotalMs, "stages", res.Stages, "identical", res.Identical)
	return res, nil
}

func waitRecovered(ctx context.Context, c *labcluster.Cluster, node string, timeout time.Duration) (*agent.Failure, error) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		for _, h := range c.Lab.State().Hosts {
			if h.Crashed {
				continue
			}
			fs, _ := c.Client(h.Name).Events(ctx)
			for _, f := range fs {
				if f.Node == node && f.Done {
					if f.Error != "" {
						return nil, fmt.Errorf("recovery of %s failed: %s", node, f.Error)
					}
					return f, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the recovery of %s: %w", node, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil, fmt.Errorf("no finished recovery of %s within %s", node, timeout)
}

func waitExit(ctx context.Context, j agent.Job, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if st, err := shim.ReadExit(j.ExitPath()); err == nil {
			if st.Code != 0 {
				b, _ := os.ReadFile(j.StderrPath())
				return fmt.Errorf("job %s exited %d: %s", j.ID, st.Code, b)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			b, _ := os.ReadFile(j.StderrPath())
			return fmt.Errorf("waiting for job %s to exit: %w (its stderr: %s)", j.ID, ctx.Err(), tailOf(string(b)))
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("job %s did not finish within %s", j.ID, timeout)
}

// finalChecksums waits for every job of a run to end and returns their checksums, and whether each equals
// the failure-free run's ref.
func finalChecksums(ctx context.Context, jobs []agent.Job, ref string) ([]string, bool, error) {
	var sums []string
	identical := true
	for _, j := range jobs {
		if err := waitExit(ctx, j, 3*time.Minute); err != nil {
			return nil, false, err
		}
		b, _ := os.ReadFile(j.StdoutPath())
		sum := checksumLine(string(b))
		sums = append(sums, sum)
		identical = identical && sum == ref
	}
	return sums, identical, nil
}

// loopbackChecksum runs the ranks on loopback, unprotected and without compute delay: the reference.
func loopbackChecksum(ctx context.Context, stencil string, ranks int, args []string) (string, error) {
	// Free ports, not fixed ones: the root network namespace is shared with whatever else runs (another
	// reference run on the same fixed ports connects ranks of two runs to each other).
	var peers []string
	var lns []net.Listener // held until all are chosen, so that they differ; closed before the ranks bind
	for range ranks {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		lns = append(lns, ln)
		peers = append(peers, ln.Addr().String())
	}
	for _, ln := range lns {
		ln.Close()
	}
	outs := make([]string, ranks)
	errs := make([]error, ranks)
	var wg sync.WaitGroup
	for r := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := append([]string{"--rank", fmt.Sprint(r), "--peers", strings.Join(peers, ",")}, args...)
			b, err := exec.CommandContext(ctx, stencil, append(a, "--delay", "0s")...).Output()
			outs[r], errs[r] = string(b), err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return "", fmt.Errorf("reference run: %w", err)
	}
	// "" would check nothing: a run's rank that printed no checksum line equals it too.
	ref := checksumLine(outs[0])
	if ref == "" {
		return "", fmt.Errorf("reference run: rank 0 of %s printed no \"rank R checksum HEX\" line, so no run could be checked (run make build): %s", stencil, tailOf(outs[0]))
	}
	return ref, nil
}
