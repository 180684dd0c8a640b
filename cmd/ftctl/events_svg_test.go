package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/timelinesvg"
)

func TestTimelineOf(t *testing.T) {
	t0 := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	base := agent.Failure{ID: "node2-1", Node: "node2", Protector: "node3", Target: "spare1", LastBeat: t0.Add(-time.Second), Detected: t0,
		Updated: t0.Add(5 * time.Second), Jobs: []string{"j1"}, StagesDropped: 2,
		Stages: []agent.Stage{{Name: agent.StageDetected, Host: "node3", Start: t0.Add(-time.Second), End: t0, Detail: "d"}}}
	tests := []struct {
		name  string
		done  bool
		err   string
		basic bool
		want  timelinesvg.Outcome
	}{
		{"under way", false, "", false, timelinesvg.Recovering},
		{"recovered", true, "", false, timelinesvg.Recovered},
		{"recovered in basic mode", true, "", true, timelinesvg.Recovered},
		{"failed", true, "job j1: diverged", false, timelinesvg.NotRecovered},
		{"an error while still under way", false, "job j1: diverged", false, timelinesvg.Recovering},
	}
	for _, tt := range tests {
		f := base
		f.Done, f.Error, f.Basic = tt.done, tt.err, tt.basic
		got := timelineOf(&f)
		if got.Outcome != tt.want {
			t.Errorf("%s: outcome %v, want %v", tt.name, got.Outcome, tt.want)
		}
		if got.ID != f.ID || got.Node != "node2" || got.Detector != "node3" || got.Target != "spare1" || got.Basic != tt.basic ||
			!got.Origin.Equal(t0) || !got.Now.Equal(f.Updated) || got.StagesDropped != 2 || got.Error != tt.err || len(got.Jobs) != 1 {
			t.Errorf("%s: %+v does not carry the failure %+v", tt.name, got, f)
		}
		if len(got.Stages) != 1 || got.Stages[0].Name != agent.StageDetected || !got.Stages[0].Start.Equal(f.Stages[0].Start) ||
			!got.Stages[0].End.Equal(t0) || got.Stages[0].Host != "node3" || got.Stages[0].Detail != "d" {
			t.Errorf("%s: stages %+v, want %+v", tt.name, got.Stages, f.Stages)
		}
	}
}

func TestCheckSVGPath(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		path string
		ok   bool
	}{
		{"", true},
		{"-", true},
		{filepath.Join(dir, "r.svg"), true},
		{filepath.Join(dir, "missing", "r.svg"), false},
		{dir, false},
	}
	for _, tt := range tests {
		err := checkSVGPath(tt.path)
		if (err == nil) != tt.ok {
			t.Errorf("checkSVGPath(%q) = %v, want ok=%v", tt.path, err, tt.ok)
		}
		var ee *cli.ExitError
		if err != nil && (!errors.As(err, &ee) || ee.Code != cli.ExitUsage) {
			t.Errorf("checkSVGPath(%q) = %v: not a usage error", tt.path, err)
		}
	}
}

func TestWriteSVG(t *testing.T) {
	t0 := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	fs := []*agent.Failure{{ID: "node2-<1>", Node: "node2", Protector: "node3", Target: "spare1", Detected: t0, Done: true,
		Stages: []agent.Stage{{Name: agent.StageRestored, Job: "j1", Host: "spare1", Start: t0, End: t0.Add(1500 * time.Millisecond)}}}}
	path := filepath.Join(t.TempDir(), "r.svg")
	var stdout bytes.Buffer
	if err := writeSVG(&stdout, path, fs); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if stdout.Len() != 0 {
		t.Errorf("writing to a file printed %q", stdout.String())
	}
	for _, want := range []string{"<svg ", "failure node2-&lt;1&gt;", "recovered", "restored · j1", "1.500 s"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("the file does not hold %q:\n%s", want, b)
		}
	}
	if err := writeSVG(&stdout, "-", fs); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(stdout.Bytes(), b) {
		t.Error(`--svg - wrote something else than --svg FILE`)
	}
}
