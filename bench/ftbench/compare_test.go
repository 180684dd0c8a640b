package main

import (
	"context"
	"log/slog"
	"os/exec"
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
