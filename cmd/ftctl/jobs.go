package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/cli"
)

// jobRow is one line of `ftctl jobs`.
type jobRow struct {
	ID           string         `json:"id"`
	State        agent.JobState `json:"state"`
	Host         string         `json:"host"`
	UID          uint32         `json:"uid"`
	PID          int            `json:"pid"`
	Address      string         `json:"address,omitempty"` // the job's own address (job_network), "" for its host's
	Fenced       bool           `json:"fenced,omitempty"`  // this host's copy was killed because the job goes on elsewhere
	LastSnapshot string         `json:"last_snapshot,omitempty"`
	SnapshotTime *time.Time     `json:"snapshot_time,omitempty"`
}

func newJobsCmd(t *target) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "jobs",
		Short: "List the jobs: id, state, host, uid and last snapshot",
		Long: `List the jobs each agent runs or ran, with their state, host, owner's uid and newest snapshot. A user
sees their own jobs, root every job. With a local lab up, every live host is asked.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			cs, err := t.clients()
			if err != nil {
				return err
			}
			rows := []jobRow{}
			var errs []error
			for _, c := range cs {
				js, err := c.client.Jobs(cmd.Context())
				if err != nil {
					errs = append(errs, onHost(c.host, err))
					continue
				}
				ms, _ := c.client.Snapshots(cmd.Context(), "") // newest first; a job without one shows "-"
				for _, j := range js {
					r := jobRow{ID: j.ID, State: j.State, Host: j.Node, UID: j.UID, PID: j.PID, Fenced: j.Fenced}
					if j.Net != nil {
						r.Address = j.Net.Addr.Addr().String()
					}
					if m := newestOf(ms, j.ID); m != nil {
						r.LastSnapshot, r.SnapshotTime = m.ID, &m.Created
					}
					rows = append(rows, r)
				}
			}
			if len(errs) == len(cs) {
				return agentErr(errs[0])
			}
			// The hosts that did not answer are named (one line each) and set the exit status, as in status:
			// their jobs are missing from the list, not gone.
			down := agentErr(errors.Join(errs...))
			if asJSON {
				return errors.Join(cli.PrintJSON(cmd.OutOrStdout(), rows), down)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "JOB\tSTATE\tHOST\tADDRESS\tUID\tPID\tLAST SNAPSHOT\tAGE")
			for _, r := range rows {
				age := "-"
				if r.SnapshotTime != nil {
					age = time.Since(*r.SnapshotTime).Round(time.Second).String()
				}
				addr := r.Address
				if addr == "" {
					addr = "(host)"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t%s\n", r.ID, r.stateText(), r.Host, addr, r.UID, r.PID, dash(r.LastSnapshot), age)
			}
			return errors.Join(w.Flush(), down)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// stateText is the row's state as the table shows it: a copy this host killed because the job goes on
// elsewhere (self-fenced, or a copy of the host's failed incarnation) is not a job that was lost.
func (r jobRow) stateText() string {
	if r.Fenced && r.State == agent.JobLost {
		return "lost here (runs elsewhere)"
	}
	return string(r.State)
}

// newestOf is the newest of ms (newest first) that is job's.
func newestOf(ms []*ckpt.Manifest, job string) *ckpt.Manifest {
	for _, m := range ms {
		if m.Job == job {
			return m
		}
	}
	return nil
}

func newLogsCmd(t *target) *cobra.Command {
	var follow, stderr bool
	cmd := &cobra.Command{
		Use:   "logs JOB",
		Short: "Print a job's standard output (or error)",
		Long: `Print what the job wrote to its standard output, or with --stderr its standard error, as its agent
serves it to the job's owner or root. With --follow, keep printing what it writes until it ends.`,
		Args: cli.Args(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := ckpt.ValidName(args[0]); err != nil {
				return cli.Usagef("job %q: %v", args[0], err)
			}
			c, err := t.jobHost(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			stream := "stdout"
			if stderr {
				stream = "stderr"
			}
			return agentErr(onHost(c.host, c.client.Output(cmd.Context(), args[0], stream, follow, cmd.OutOrStdout())))
		},
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing until the job ends")
	cmd.Flags().BoolVar(&stderr, "stderr", false, "the job's standard error instead of its output")
	return cmd
}

func newKillCmd(t *target) *cobra.Command {
	var sigName string
	cmd := &cobra.Command{
		Use:   "kill JOB [--signal SIG]",
		Short: "Send a signal to a job's root process (default SIGTERM)",
		Long: `Send a signal to the job's root process, as its owner or root. SIG is a name (TERM, SIGKILL) or a
number from 1 to 64.`,
		Args: cli.Args(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			sig, err := parseSignal(sigName)
			if err != nil {
				return cli.Usagef("--signal %q: %v", sigName, err)
			}
			if err := ckpt.ValidName(args[0]); err != nil {
				return cli.Usagef("job %q: %v", args[0], err)
			}
			c, err := t.jobHost(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if err := c.client.Signal(cmd.Context(), args[0], sig); err != nil {
				return agentErr(onHost(c.host, err))
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "sent %s to job %s\n", unix.SignalName(sig), args[0])
			return nil
		},
	}
	cmd.Flags().StringVarP(&sigName, "signal", "s", "TERM", "signal name or number")
	return cmd
}

// parseSignal reads a signal name (TERM, SIGTERM, any case) or number (1 to 64).
func parseSignal(s string) (unix.Signal, error) {
	if n, err := strconv.Atoi(s); err == nil {
		if n < 1 || n > 64 {
			return 0, fmt.Errorf("signal numbers go from 1 to 64")
		}
		return unix.Signal(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if sig := unix.SignalNum(name); sig != 0 {
		return sig, nil
	}
	return 0, fmt.Errorf("unknown signal: use a name such as TERM or KILL, or a number")
}

// jobHost is the agent of the host that runs the job (or last ran it): the only agent, or in a lab the
// one whose record of the job says it is on its host.
func (t *target) jobHost(ctx context.Context, id string) (hostClient, error) {
	cs, err := t.clients()
	if err != nil {
		return hostClient{}, err
	}
	if len(cs) == 1 {
		return cs[0], nil
	}
	var found []hostClient
	var errs []error
	for _, c := range cs {
		j, err := c.client.Job(ctx, id)
		if err != nil {
			errs = append(errs, onHost(c.host, err))
			continue
		}
		if j.Node == c.host {
			return c, nil
		}
		found = append(found, c)
	}
	if len(found) > 0 {
		return found[0], nil
	}
	return hostClient{}, agentErr(fmt.Errorf("job %s: no agent of the lab knows it: %w", id, errors.Join(errs...)))
}
