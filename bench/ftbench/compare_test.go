package main

import (
	"context"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/testenv"
)

// TestCompareSmall runs the comparison at its small size: every variant, with and without a node crash,
// must end with the failure-free checksum, ftkit's survivors must keep running, and the application-level
// restart must really resume from a checkpoint.
func TestCompareSmall(t *testing.T) {
	testenv.RequireKernel(t, "network namespaces, CRIU and eBPF")
	dir := t.TempDir()
	build := exec.Command("go", "build", "-o", dir+"/", "github.com/ftkit/ftkit/cmd/ftagent", "github.com/ftkit/ftkit/testdata/stencil2d")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	sz := compareSizes["small"]
	o, err := runCompare(ctx, log, dir, sz)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct {
		variant string
		failure bool
	}{{"a", false}, {"b", false}, {"c", false}, {"d", false}, {"a", true}, {"c", true}, {"d", true}} {
		r := o.run(want.variant, want.failure)
		if r == nil {
			t.Fatalf("no run of %s (failure %v)", want.variant, want.failure)
		}
		if !r.Identical || r.Seconds <= 0 {
			t.Errorf("%s (failure %v): identical %v, %.2fs", want.variant, want.failure, r.Identical, r.Seconds)
		}
		// A failure-free run's steady state starts once every rank has done warmIters, inside the run.
		if !want.failure && (r.SteadyS <= 0 || r.SteadyS >= r.Seconds) {
			t.Errorf("%s: steady state %.2fs of a %.2fs run", want.variant, r.SteadyS, r.Seconds)
		}
	}
	if c := o.run("c", true); !c.SurvivorsKept || c.RestartMs <= 0 || c.CaughtUpMs < c.RestartMs {
		t.Errorf("ftkit recovery: survivors kept %v, restart %.0f ms, caught up %.0f ms", c.SurvivorsKept, c.RestartMs, c.CaughtUpMs)
	}
	if c := o.run("c", false); c.Snapshots == 0 || c.SnapshotMB <= 0 {
		t.Errorf("variant c took %d snapshots of %.1f MB", c.Snapshots, c.SnapshotMB)
	}
	d := o.run("d", true)
	if d.ResumedFrom <= 0 || d.ResumedFrom%sz.CkptEvery != 0 || d.ItersAtCrash < d.ResumedFrom || d.RestartMs <= 0 || d.CaughtUpMs < d.RestartMs {
		t.Errorf("app-level restart: resumed from %d, at crash %d, restart %.0f ms, caught up %.0f ms", d.ResumedFrom, d.ItersAtCrash, d.RestartMs, d.CaughtUpMs)
	}
	svg := o.svg()
	for _, label := range []string{"<svg", "a: plain", "d: app checkpoints", "one node crash", "n/a"} {
		if !strings.Contains(svg, label) {
			t.Errorf("plot lacks %q", label)
		}
	}
	for _, m := range o.metrics() {
		t.Logf("%-32s %10.4g %s", m.Name, m.Value, m.Unit)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

// TestReceiveOrderSmall runs one round of the receive-order benchmark at compare's small size: every
// configuration's stencil must end with the failure-free checksum and its message stream must be received
// whole, one call per message, and every metric must be there.
func TestReceiveOrderSmall(t *testing.T) {
	testenv.RequireKernel(t, "network namespaces, CRIU and eBPF")
	dir := t.TempDir()
	build := exec.Command("go", "build", "-o", dir+"/", "github.com/ftkit/ftkit/cmd/ftagent", "github.com/ftkit/ftkit/testdata/stencil2d")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	metrics, runs, err := runReceiveOrder(ctx, log, dir, self, compareSizes["small"], 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != len(roConfigs) {
		t.Fatalf("%d runs, want one per configuration (%d)", len(runs), len(roConfigs))
	}
	for _, r := range runs {
		if !r.StencilOK || r.StencilS <= 0 {
			t.Errorf("%s: stencil identical %v in %.2fs", r.Config, r.StencilOK, r.StencilS)
		}
		for i, s := range []roStream{r.roStream, r.Second} {
			if s.MsgCalls < roMsgCount || s.MsgRate <= 0 || s.AgentCPUS <= 0 {
				t.Errorf("%s, stream %d: %d receive calls for %d messages at %.0f/s, agents' CPU %.2f s",
					r.Config, i+1, s.MsgCalls, roMsgCount, s.MsgRate, s.AgentCPUS)
			}
		}
	}
	got := map[string]bool{}
	for _, m := range metrics {
		got[m.Name] = true
	}
	for _, c := range roConfigs[1:] {
		for _, name := range []string{"stencil_overhead_" + c.Name, "msg64_rate_ratio_" + c.Name, "msg64_rate_ratio_second_" + c.Name} {
			if !got[name] {
				t.Errorf("metric %s missing from %v", name, metrics)
			}
		}
	}
}

// A fresh machine has no /var/lib/ftkit until a lab made it: the plain variants made their run
// directory there with os.MkdirTemp alone and `ftbench compare` failed at once.
func TestRunDirCreatesRoot(t *testing.T) {
	root := filepath.Join(t.TempDir(), "var", "lib", "ftkit")
	dir, err := runDir(root)
	if err != nil {
		t.Fatalf("runDir under a missing root: %v", err)
	}
	if filepath.Dir(dir) != root {
		t.Fatalf("run directory %s is not under %s", dir, root)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		t.Fatalf("run directory %s: %v", dir, err)
	}
}

func TestRunOrder(t *testing.T) {
	for _, tc := range []struct {
		round int
		modes []netlogMode
		want  []netlogMode
	}{
		{0, []netlogMode{modePlain, modeCapture}, []netlogMode{modePlain, modeCapture}},
		{1, []netlogMode{modePlain, modeCapture}, []netlogMode{modeCapture, modePlain}},
		{2, []netlogMode{modePlain, modeCapture}, []netlogMode{modePlain, modeCapture}},
		{1, []netlogMode{modePlain, modeProbe, modeCapture}, []netlogMode{modeProbe, modeCapture, modePlain}},
		{2, []netlogMode{modePlain, modeProbe, modeCapture}, []netlogMode{modeCapture, modePlain, modeProbe}},
		{4, []netlogMode{modePlain, modeProbe, modeCapture}, []netlogMode{modeProbe, modeCapture, modePlain}},
	} {
		in := slices.Clone(tc.modes)
		if got := runOrder(tc.round, tc.modes...); !slices.Equal(got, tc.want) {
			t.Errorf("runOrder(%d, %v) = %v, want %v", tc.round, in, got, tc.want)
		}
		if !slices.Equal(tc.modes, in) {
			t.Errorf("runOrder(%d, ...) changed its argument to %v", tc.round, tc.modes)
		}
	}
}

func TestRatioToPlain(t *testing.T) {
	run := func(v string, round int, s float64) variantRun {
		return variantRun{Variant: v, Round: round, Seconds: s}
	}
	for _, tc := range []struct {
		name string
		runs []variantRun
		want float64
	}{
		{"paired by round: the drift between rounds cancels", []variantRun{
			run("a", 0, 20), run("c", 0, 21), run("a", 1, 30), run("c", 1, 31.5), run("a", 2, 25), run("c", 2, 27.5),
		}, 1.05}, // ratios 1.05, 1.05, 1.10; median(c)/median(a) would be 27.5/25 = 1.10
		{"fewer than two rounds with both: the medians", []variantRun{
			run("a", 0, 20), run("c", 0, 22), run("c", 1, 24), run("c", 2, 23),
		}, 23.0 / 20},
		{"failure runs do not count", []variantRun{
			run("a", 0, 20), run("c", 0, 21), run("a", 1, 20), run("c", 1, 21),
			{Variant: "a", Failure: true, Seconds: 40}, {Variant: "c", Failure: true, Seconds: 25},
		}, 1.05},
	} {
		o := &compareOutcome{Runs: tc.runs}
		if got := o.ratioToPlain("c", runTime); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%s: ratio %.4f, want %.4f", tc.name, got, tc.want)
		}
	}
	// The steady state's ratio pairs the same rounds on SteadyS, and a run that did not time one (a
	// failure run) does not count.
	steady := func(v string, round int, s, steady float64) variantRun {
		return variantRun{Variant: v, Round: round, Seconds: s, SteadyS: steady}
	}
	o := &compareOutcome{Runs: []variantRun{
		steady("a", 0, 20, 19), steady("c", 0, 22, 19.95), steady("a", 1, 30, 28), steady("c", 1, 32, 29.4),
		{Variant: "c", Round: 1, Failure: true, Seconds: 40},
	}}
	if got := o.ratioToPlain("c", steadyTime); math.Abs(got-1.05) > 1e-9 {
		t.Errorf("steady ratio %.4f, want 1.05", got)
	}
}

func TestSteadySeconds(t *testing.T) {
	outs := []string{
		"rank 0 reached iteration 100 at 2000000000\nrank 0 checksum abc\n",
		"rank 1 reached iteration 100 at 3000000000\nrank 1 checksum abc\n",
	}
	got, err := steadySeconds(outs, time.Unix(5, 0))
	if err != nil || got != 2 {
		t.Fatalf("steadySeconds = %v, %v; want 2 (from the last rank's stamp, 3 s, to the end, 5 s)", got, err)
	}
	if _, err := steadySeconds(append(outs, "rank 2 checksum abc\n"), time.Unix(5, 0)); err == nil {
		t.Fatal("steadySeconds accepted a rank that never said it reached the iteration")
	}
}

// The plot's "vs a" label under each variant is the overhead the metrics report (ratioToPlain: the median
// of the rounds' paired ratios), not the median run's over a's median run, which may come from another
// round: bench/results/compare.svg said b +2.6% and c +1.5% where compare.json's b_overhead and c_overhead
// were 1.7% each.
func TestComparePlotOverheadIsTheMetric(t *testing.T) {
	run := func(v string, round int, s float64) variantRun {
		return variantRun{Variant: v, Round: round, Seconds: s, Identical: true}
	}
	o := &compareOutcome{Size: compareSizes["small"], Runs: []variantRun{
		run("a", 0, 20), run("c", 0, 21), run("a", 1, 30), run("c", 1, 31.5), run("a", 2, 25), run("c", 2, 27.5),
	}} // paired ratios 1.05, 1.05, 1.10: +5.0%; the median runs' 27.5/25: +10.0%
	var overhead float64
	for _, m := range o.metrics() {
		if m.Name == "c_overhead" {
			overhead = m.Value
		}
	}
	if math.Abs(overhead-5) > 1e-9 {
		t.Fatalf("c_overhead %.4f%%, want 5", overhead)
	}
	if svg := o.svg(); !strings.Contains(svg, ">+5.0% vs a<") {
		t.Errorf("the plot does not label c with its overhead +5.0%% vs a: %s", svgLabels(svg))
	}
}

// svgLabels is the plot's "vs a" labels, for a failure message.
func svgLabels(svg string) []string {
	var out []string
	for line := range strings.Lines(svg) {
		if strings.Contains(line, "vs a<") {
			out = append(out, strings.TrimSpace(line))
		}
	}
	return out
}

// The reference checksum is what every run's ranks are checked against: a reference run that printed none
// ("") made every run whose ranks printed none too "identical" (checksumLine's "" equals it), so a stencil
// that never reached its checksum line, or printed it in another form, passed every check unseen.
func TestLoopbackChecksumRefusesNoChecksum(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, script, want string
	}{
		{"prints its checksum", "#!/bin/sh\necho \"rank 0 checksum 00ff\"\n", "00ff"},
		{"prints none", "#!/bin/sh\necho \"rank 0 done\"\n", ""},
	} {
		prog := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "-"))
		if err := os.WriteFile(prog, []byte(tc.script), 0o755); err != nil {
			t.Fatal(err)
		}
		ref, err := loopbackChecksum(context.Background(), prog, 2, nil)
		switch {
		case tc.want != "" && (err != nil || ref != tc.want):
			t.Errorf("%s: reference %q, %v; want %q", tc.name, ref, err, tc.want)
		case tc.want == "" && err == nil:
			t.Errorf("%s: reference %q accepted, want an error (no checksum to check the runs against)", tc.name, ref)
		}
	}
}
