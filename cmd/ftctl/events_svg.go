package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/timelinesvg"
)

// checkSVGPath refuses an --svg destination that cannot be written, before any agent is asked.
func checkSVGPath(path string) error {
	if path == "" || path == "-" {
		return nil
	}
	dir := filepath.Dir(path)
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return cli.Usagef("--svg %s: the directory %s does not exist; create it or name a file in an existing one", path, dir)
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return cli.Usagef("--svg %s is a directory; name a file, e.g. %s", path, filepath.Join(path, "recovery.svg"))
	}
	return nil
}

// writeSVG draws the failures' timelines into path ("-": standard output).
func writeSVG(stdout io.Writer, path string, fs []*agent.Failure) error {
	in := make([]timelinesvg.Failure, len(fs))
	for i, f := range fs {
		in[i] = timelineOf(f)
	}
	svg := timelinesvg.Render(in)
	if path == "-" {
		_, err := stdout.Write(svg)
		return err
	}
	// Readable by others like any picture; replaced whole, so a viewer never sees half a file.
	if err := atomicfile.WriteFile(path, svg, 0o644); err != nil {
		return fmt.Errorf("write the timeline: %w", err)
	}
	return nil
}

// timelineOf is the picture's view of a failure from the failure log.
func timelineOf(f *agent.Failure) timelinesvg.Failure {
	out := timelinesvg.Failure{
		ID: f.ID, Node: f.Node, Detector: f.Protector, Target: f.Target, Basic: f.Basic,
		Jobs: f.Jobs, Origin: f.Detected, StagesDropped: f.StagesDropped, Error: f.Error,
		// A stage still under way is drawn up to the failure's last update: the picture of the same log is
		// the same whenever it is drawn.
		Now: f.Updated,
	}
	switch {
	case !f.Done:
		out.Outcome = timelinesvg.Recovering
	case f.Error != "":
		out.Outcome = timelinesvg.NotRecovered
	default:
		out.Outcome = timelinesvg.Recovered
	}
	for _, s := range f.Stages {
		out.Stages = append(out.Stages, timelinesvg.Stage{Name: s.Name, Job: s.Job, Host: s.Host, Start: s.Start, End: s.End, Detail: s.Detail, Error: s.Error})
	}
	return out
}
