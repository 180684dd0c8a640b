package main

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/internal/cli"
)

func newEventsCmd(t *target) *cobra.Command {
	var asJSON bool
	var svgPath, only string
	cmd := &cobra.Command{
		Use:   "events",
		Short: "The timeline of every node failure: detected, spare claimed, fetched, rewritten, restored, replayed, re-protected",
		Long: `Show each node failure the cluster has handled, with the duration of every recovery stage.
Every agent keeps a copy (the protector that handled a failure sends it to all members), so any live
host answers; with a lab, the copies of all live hosts are merged.

With --svg FILE it draws each failure as a timeline (every stage a bar on a time axis in seconds from the
declaration, the hosts involved, the bytes replayed and verified) into FILE ("-": standard output), a
standalone SVG that any browser shows. --failure ID keeps one failure.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if svgPath == "-" && asJSON {
				return cli.Usagef("--svg - and --json both write to standard output: pick one, or give --svg a file")
			}
			if err := checkSVGPath(svgPath); err != nil {
				return err
			}
			cs, err := t.clients()
			if err != nil {
				return err
			}
			byID := map[string]*agent.Failure{}
			var errs []error
			for _, c := range cs {
				fs, err := c.client.Events(cmd.Context())
				if err != nil {
					errs = append(errs, onHost(c.host, err))
					continue
				}
				for _, f := range fs {
					if cur, ok := byID[f.ID]; !ok || f.Updated.After(cur.Updated) {
						byID[f.ID] = f
					}
				}
			}
			if len(errs) == len(cs) { // each error names the socket it tried
				return agentErr(fmt.Errorf("no agent answered: %w", errors.Join(errs...)))
			}
			// The log is replicated, so the agents that answered give it whole unless a failure is still
			// being handled; the ones that did not are named (one line each) and set the exit status.
			down := agentErr(errors.Join(errs...))
			all := make([]*agent.Failure, 0, len(byID))
			for _, f := range byID {
				if only == "" || f.ID == only {
					all = append(all, f)
				}
			}
			if only != "" && len(all) == 0 {
				return cli.WithCode(cli.ExitNotFound, fmt.Errorf("no failure %q in the log; `ftctl events` lists them", only))
			}
			sort.Slice(all, func(i, j int) bool {
				if !all[i].Detected.Equal(all[j].Detected) {
					return all[i].Detected.Before(all[j].Detected)
				}
				return all[i].ID < all[j].ID // the same order, and so the same picture, on every run
			})
			if svgPath != "" {
				if err := writeSVG(cmd.OutOrStdout(), svgPath, all); err != nil {
					return err
				}
				if svgPath == "-" {
					return down
				}
				if !asJSON {
					fmt.Fprintf(cmd.OutOrStdout(), "timeline of %d failure(s) written to %s\n", len(all), svgPath)
					return down
				}
			}
			if asJSON {
				return errors.Join(cli.PrintJSON(cmd.OutOrStdout(), all), down)
			}
			if len(all) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "no failures")
				return down
			}
			for _, f := range all {
				printFailure(cmd.OutOrStdout(), f)
			}
			return down
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().StringVar(&svgPath, "svg", "", "draw the timelines as SVG into this file (\"-\": standard output)")
	cmd.Flags().StringVar(&only, "failure", "", "only the failure with this id")
	return cmd
}

// printFailure prints one failure's timeline, each stage with its offset from the last heartbeat and its
// duration.
func printFailure(w io.Writer, f *agent.Failure) {
	state := "recovered"
	switch {
	case !f.Done:
		state = "recovering"
	case f.Error != "":
		state = "NOT RECOVERED"
	}
	mode := "on spare " + f.Target
	if f.Basic {
		mode = "on protector " + f.Target + " (basic mode: no spare was free)"
	}
	total := "total from the last heartbeat"
	switch f.Kind {
	case agent.KindMigration:
		state = strings.NewReplacer("recovering", "moving", "NOT RECOVERED", "NOT MOVED", "recovered", "moved").Replace(state)
		fmt.Fprintf(w, "migration %s: jobs %v from %s to %s, %s\n", f.ID, f.Jobs, f.Node, f.Target, state)
		total = "total from the freeze"
	case coordinated.KindRollback:
		state = strings.NewReplacer("recovering", "rolling back", "NOT RECOVERED", "NOT ROLLED BACK", "recovered", "rolled back").Replace(state)
		fmt.Fprintf(w, "rollback %s: jobs %v to their coordinated snapshot, asked on %s, %s\n", f.ID, f.Jobs, f.Node, state)
		total = "total"
	case agent.KindDrain:
		state = strings.NewReplacer("recovering", "draining", "NOT RECOVERED", "NOT DRAINED", "recovered", "drained").Replace(state)
		fmt.Fprintf(w, "drain %s: node %s, jobs %v, %s\n", f.ID, f.Node, f.Jobs, state)
		total = "total"
	default:
		fmt.Fprintf(w, "failure %s: node %s, jobs %v, %s, %s\n", f.ID, f.Node, f.Jobs, mode, state)
	}
	t0 := f.LastBeat
	if t0.IsZero() && len(f.Stages) > 0 {
		t0 = f.Stages[0].Start // no beat was ever heard: the detection's silence began when watching did
	}
	for _, s := range f.Stages {
		line := fmt.Sprintf("  +%7.3fs  %-17s %8s", s.End.Sub(t0).Seconds(), s.Name, s.Duration().Round(time.Millisecond))
		if s.Job != "" {
			line += "  job " + s.Job
		}
		line += "  on " + s.Host
		if s.Detail != "" {
			line += "  (" + s.Detail + ")"
		}
		if s.Error != "" {
			line += "  ERROR: " + s.Error
		}
		fmt.Fprintln(w, line)
	}
	if f.Done && len(f.Stages) > 0 {
		fmt.Fprintf(w, "  %s: %s\n", total, f.Stages[len(f.Stages)-1].End.Sub(t0).Round(time.Millisecond))
	}
	if f.Error != "" {
		fmt.Fprintf(w, "  error: %s\n", f.Error)
	}
	if f.TakenOver != "" {
		fmt.Fprintf(w, "  its jobs were taken over by the recovery of failure %s\n", f.TakenOver)
	}
}
