package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/ring"
)

// target says which agents a command talks to: one socket, every live host of a lab, or every alive
// member of a cluster (cluster.go).
type target struct {
	socket  string
	labID   string
	host    string
	cluster string
}

func (t *target) register(cmd *cobra.Command) {
	cmd.PersistentFlags().StringVar(&t.socket, "socket", "", "agent socket (default $FTKIT_AGENT_SOCKET, else "+agentapi.DefaultSocket+")")
	cmd.PersistentFlags().StringVar(&t.labID, "lab", "", "talk to the agents of this local lab (default: the lab "+lab.DefaultID+" if it is up)")
	cmd.PersistentFlags().StringVar(&t.host, "host", "", "with a lab: only this host's agent")
	cmd.PersistentFlags().StringVar(&t.host, "node", "", "same as --host")
}

// agentClient is what the commands ask of one agent: its local API (*agentapi.Client), or its cluster
// listener as an operator (*clusterHost).
type agentClient interface {
	Socket() string
	Status(ctx context.Context) (agent.Status, error)
	Jobs(ctx context.Context) ([]agent.Job, error)
	Job(ctx context.Context, id string) (agent.Job, error)
	Snapshots(ctx context.Context, job string) ([]*ckpt.Manifest, error)
	Events(ctx context.Context) ([]*agent.Failure, error)
	Checkpoint(ctx context.Context, jobs ...string) (agentapi.CheckpointReply, error)
	Restore(ctx context.Context, req agent.RestoreRequest) (agent.Job, error)
	Migrate(ctx context.Context, req agent.MigrateRequest) (agent.Migration, error)
	Drain(ctx context.Context, req agent.DrainRequest) (agent.DrainResult, error)
	Cut(ctx context.Context, req coordinated.RunRequest) (coordinated.Cut, error)
	Rollback(ctx context.Context, req coordinated.RunRequest) (coordinated.Rollback, error)
	Output(ctx context.Context, id, stream string, follow bool, w io.Writer) error
	Signal(ctx context.Context, id string, sig syscall.Signal) error
	AddSpare(ctx context.Context, req agent.SpareRequest) (ring.View, error)
}

var _ agentClient = (*agentapi.Client)(nil)

type hostClient struct {
	host   string
	client agentClient
}

// clients resolves the target to agent clients.
func (t *target) clients() ([]hostClient, error) {
	cluster := t.cluster
	if cluster == "" && t.socket == "" && t.labID == "" {
		cluster = os.Getenv(clusterEnv)
	}
	if cluster != "" {
		if t.socket != "" || t.labID != "" {
			return nil, cli.Usagef("--cluster (or $%s) and --socket or --lab pick different agents: give one", clusterEnv)
		}
		return t.clusterClients(cluster)
	}
	// One socket is one agent, which acts on its own host: a --lab or --host beside it was dropped, and drain,
	// restore or checkpoint acted on the socket's host instead of the one named.
	if t.socket != "" && t.labID != "" {
		return nil, cli.Usagef("--socket and --lab pick different agents: give one")
	}
	if t.socket != "" && t.host != "" {
		return nil, cli.Usagef("--socket names one agent, which acts on its own host: --host %s picks a host of a lab (--lab) or of a cluster (--cluster); give one of them", t.host)
	}
	sock := t.socket
	if sock == "" && t.labID == "" && t.host == "" {
		sock = os.Getenv("FTKIT_AGENT_SOCKET")
	}
	if sock != "" {
		return []hostClient{{host: "", client: agentapi.NewClient(sock)}}, nil
	}
	id := t.labID
	if id == "" {
		id = lab.DefaultID
	}
	l, err := lab.Open(id, lab.Options{})
	if err != nil {
		if t.labID == "" && t.host == "" {
			return []hostClient{{host: "", client: agentapi.NewClient(agentapi.DefaultSocket)}}, nil
		}
		return nil, cli.WithCode(cli.ExitNotFound, err)
	}
	var out []hostClient
	for _, h := range l.State().Hosts {
		if h.Crashed || (t.host != "" && h.Name != t.host) {
			continue
		}
		out = append(out, hostClient{host: h.Name, client: agentapi.NewClient(labcluster.Socket(id, h.Name))})
	}
	if len(out) == 0 {
		return nil, cli.WithCode(cli.ExitNotFound, fmt.Errorf("lab %s has no live host %q", id, t.host))
	}
	return out, nil
}

// first resolves the target to one agent: the only one, or the first live host of a lab (any agent holds
// the cluster-wide view).
func (t *target) first() (hostClient, error) {
	cs, err := t.clients()
	if err != nil {
		return hostClient{}, err
	}
	return cs[0], nil
}

// one resolves the target to exactly one agent.
func (t *target) one() (hostClient, error) {
	cs, err := t.clients()
	if err != nil {
		return hostClient{}, err
	}
	if len(cs) > 1 {
		return hostClient{}, cli.Usagef("several agents answer (a lab's or a cluster's): pick one with --host")
	}
	return cs[0], nil
}

// hostName is how progress lines name an agent: its lab host or member name, else its socket.
func hostName(c hostClient) string {
	if c.host != "" {
		return c.host
	}
	return c.client.Socket()
}

// jobsNamed says which jobs a checkpoint asks for.
func jobsNamed(jobs []string) string {
	if len(jobs) == 0 {
		return "every running job"
	}
	return "job(s) " + strings.Join(jobs, ", ")
}

// onHost names the lab host or member an error came from (nothing when the target is one socket: its client's
// errors name the socket).
func onHost(host string, err error) error {
	if host == "" {
		return err
	}
	return fmt.Errorf("%s: %w", host, err)
}

func agentErr(err error) error {
	switch {
	case errors.Is(err, agentapi.ErrAgentUnavailable):
		return cli.WithCode(cli.ExitUnavailable, err)
	case errors.Is(err, agent.ErrNoJob):
		return cli.WithCode(cli.ExitNotFound, err)
	}
	return err
}

func newStatusCmd(t *target) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Hosts, roles, protectors, jobs and their last snapshots",
		Long: `Show each agent's host (role, protector) and jobs: state, PID, whether the job is protected, and the
last snapshot of each job with its age, size and where its replicas live. A running job is UNPROTECTED
until a snapshot of it has reached a protector (the agent takes the first one as the job starts), or when
every node holding its newest replica has failed: a failure of its host then loses it. A job of a run in
coordinated recovery is also UNPROTECTED while its run's newest coordinated snapshot lacks a running job
of the run (one started after it): a rollback of the run refuses until the next snapshot, which its
coordinator takes within seconds. With a local lab up, every live host is shown.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			cs, err := t.clients()
			if err != nil {
				return err
			}
			type hostStatus struct {
				agent.Status
				Snapshots []*ckpt.Manifest `json:"snapshots"`
				Error     string           `json:"error,omitempty"`
			}
			var all []hostStatus
			var snaps []*ckpt.Manifest
			var unreachable []error
			for _, c := range cs {
				st, err := c.client.Status(cmd.Context())
				if err != nil {
					all = append(all, hostStatus{Status: agent.Status{Node: c.host}, Error: err.Error()})
					unreachable = append(unreachable, onHost(c.host, err))
					continue
				}
				ms, _ := c.client.Snapshots(cmd.Context(), "")
				snaps = append(snaps, ms...)
				all = append(all, hostStatus{Status: st, Snapshots: ms})
			}
			// An unreachable agent is shown, and is a failure: a script must not take it for a healthy host.
			down := cli.WithCode(cli.ExitUnavailable, errors.Join(unreachable...))
			if len(unreachable) == len(cs) && !asJSON {
				return down // nothing to show but the error
			}
			if asJSON {
				return errors.Join(cli.PrintJSON(cmd.OutOrStdout(), all), down)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "HOST\tROLE\tPROTECTOR\tMODE\tINTERVAL\tJOBS\tAGENT")
			for _, h := range all {
				if h.Error != "" {
					fmt.Fprintf(w, "%s\t-\t-\t-\t-\t-\tunreachable: %s\n", h.Node, h.Error)
					continue
				}
				running := 0
				for _, j := range h.Jobs {
					if j.State == agent.JobRunning {
						running++
					}
				}
				health := "ok"
				if h.FailurePredicted {
					health = "ok, FAILURE PREDICTED (health command): drained"
				}
				iv := h.Interval
				if iv == "auto" && h.AutoMTBF != "" {
					iv += " (mtbf " + h.AutoMTBF + ")"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d running\t%s\n", h.Node, h.Role, dash(h.Protector), h.Mode, iv, running, health)
			}
			w.Flush()
			fmt.Fprintln(cmd.OutOrStdout())
			w = tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "HOST\tLOG MEMORY\tCAP\tPOOLED\tPARKED\tCONNS\tLOGGED\tBACKPRESSURE DROPS\tSPILLED\tCONSUMER")
			var events []string
			for _, h := range all {
				if h.Log == nil {
					continue
				}
				lc := h.Log.Counters
				consumer := "running"
				if !lc.ConsumerRunning {
					consumer = "STOPPED " + lc.ConsumerError
				}
				// LOG MEMORY is what the cap bounds: the pooled buffers hold no logged bytes. PARKED is the payload
				// waiting in clones in the kernel (log.park), outside it; LOGGED counts parked bytes too.
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s\t%s\n", h.Node, humanBytes(lc.MemoryBytes-lc.PooledBytes), humanBytes(h.Log.CapBytes),
					humanBytes(lc.PooledBytes), humanBytes(lc.ParkWaitingBytes), lc.Conns, humanBytes(int64(lc.BytesLogged+lc.BytesParked)), lc.DropsBackpressure,
					humanBytes(lc.SpilledBytes), consumer)
				for _, e := range h.Log.Events {
					events = append(events, fmt.Sprintf("%s  %s  %s %s memory %s", e.Time.Format("15:04:05.000"), h.Node, e.Kind, e.Node, humanBytes(e.Memory)))
				}
			}
			w.Flush()
			fmt.Fprintln(cmd.OutOrStdout())
			w = tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "HOST\tRECEIVED FLOWS\tDIGESTED\tHOLES\tOUT OF ORDER\tTAP DROPS\tRECORDER")
			for _, h := range all {
				if h.Log == nil {
					continue
				}
				rs := h.Log.Received
				recorder := "running"
				if rs.Error != "" {
					recorder = "STOPPED " + rs.Error
				}
				// Holes are bytes a receiver took that were never recorded: a restore re-sending them is refused.
				fmt.Fprintf(w, "%s\t%d\t%s\t%d\t%d\t%d\t%s\n", h.Node, rs.Book.Flows, humanBytes(int64(rs.Book.Bytes)), rs.Book.Holes,
					rs.Tap.OutOfOrder, rs.Tap.DropsBackpressure+rs.Tap.DropsOversize+rs.Tap.DropsError, recorder)
			}
			w.Flush()
			if len(events) > 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "\nlog controller events:")
				for _, e := range events {
					fmt.Fprintln(cmd.OutOrStdout(), "  "+e)
				}
			}
			var reached []agent.Status
			for _, h := range all {
				if h.Error == "" {
					reached = append(reached, h.Status)
				}
			}
			newest := newestCuts(reached)
			gaps := cutGaps(reached, newest)
			if rows := runRows(reached, newest, gaps, time.Now()); len(rows) > 0 {
				fmt.Fprintln(cmd.OutOrStdout())
				w = tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
				fmt.Fprintln(w, "RUN\tUID\tRUNNING JOBS\tNEWEST CUT\tAGE\tJOBS IN NO CUT")
				for _, r := range rows {
					fmt.Fprintln(w, r)
				}
				w.Flush()
			}
			fmt.Fprintln(cmd.OutOrStdout())
			w = tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "JOB\tHOST\tSTATE\tPID\tPROTECTION\tPROTECTOR\tLAST SNAPSHOT\tAGE\tSIZE\tREPLICAS")
			for _, h := range all {
				for _, j := range h.Jobs {
					state := string(j.State)
					if j.Exit != nil {
						state = fmt.Sprintf("exited(%d)", j.Exit.Code)
					}
					prot := protection(j, h.Members, gaps, time.Now())
					// A job of a run (a placement) is protected by its run's next host, not the ring's.
					protector := dash(h.JobProtectors[j.ID])
					last := latestOf(snaps, j.ID, h.Node)
					if last == nil {
						fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\t-\t-\t-\t-\n", j.ID, h.Node, state, j.PID, prot, protector)
						continue
					}
					fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", j.ID, h.Node, state, j.PID, prot, protector, last.ID,
						time.Since(last.Created).Round(time.Second), humanBytes(last.TotalSize()), dash(strings.Join(last.Replicas, ",")))
				}
			}
			if err := w.Flush(); err != nil {
				return err
			}
			return down
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// protection says whether a failure of the job's host could be recovered: "protected (AGE)" with the age
// of its newest replica, or UNPROTECTED and why. members is the host's membership view; gaps are the
// runs whose newest cut lacks running jobs (cutGaps).
func protection(j agent.Job, members []ring.Member, gaps map[coordinated.Run]cutGap, now time.Time) string {
	if j.State != agent.JobRunning {
		return "-"
	}
	gap, inGap := gaps[coordinated.Run{Name: j.Spec.Run, UID: j.UID}]
	inGap = inGap && j.Spec.RollsBackRun()
	if inGap && j.Spec.Recovery == agent.RecoveryCoordinated {
		return fmt.Sprintf("UNPROTECTED (run %s's newest cut %s lacks %s, started after it: a rollback refuses until the next)",
			j.Spec.Run, gap.cut, gap.jobs())
	}
	if !j.Protected() {
		if j.Restored != "" {
			return "UNPROTECTED (restored; awaiting its first snapshot here)"
		}
		return "UNPROTECTED (no replica yet)"
	}
	if bad := j.Replica.Unrecoverable; len(bad) > 0 {
		return fmt.Sprintf("UNRECOVERABLE (%d connection(s); first: %s)", len(bad), bad[0])
	}
	if fresh := j.NewConns; len(fresh) > 0 {
		return fmt.Sprintf("UNPROTECTED (connections newer than its replica, which is being renewed: %s)", strings.Join(fresh, "; "))
	}
	alive := false
	for _, h := range j.Replica.Holders {
		for _, m := range members {
			if m.Name == h && m.State == ring.StateAlive {
				alive = true
			}
		}
	}
	if !alive {
		return fmt.Sprintf("UNPROTECTED (replica holders %s failed)", strings.Join(j.Replica.Holders, ","))
	}
	age := now.Sub(j.Replica.Time).Round(time.Second)
	if inGap {
		// Auto recovery: message logging recovers the job; the rollback it falls back to would refuse.
		return fmt.Sprintf("protected (%s; a rollback of run %s refuses until a coordinated snapshot holds %s)", age, j.Spec.Run, gap.jobs())
	}
	return fmt.Sprintf("protected (%s)", age)
}

// cutGap is what the newest coordinated snapshot of a run lacks: running jobs of the run that started
// after it, which a rollback of the run refuses (coordinated.Place).
type cutGap struct {
	cut   string
	lacks []string
}

// jobs names the jobs the cut lacks, the first three of them.
func (g cutGap) jobs() string {
	if len(g.lacks) <= 3 {
		return strings.Join(g.lacks, ",")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(g.lacks[:3], ","), len(g.lacks)-3)
}

// newestCuts are the newest cut of each run that any of the hosts records.
func newestCuts(hosts []agent.Status) map[coordinated.Run]*coordinated.Cut {
	newest := map[coordinated.Run]*coordinated.Cut{}
	for _, h := range hosts {
		for _, c := range h.Cuts {
			k := coordinated.Run{Name: c.Run, UID: c.UID}
			if o := newest[k]; o == nil || c.ID > o.ID { // cut ids begin with their time
				newest[k] = c
			}
		}
	}
	return newest
}

// runRows are the rows of status's table of runs that roll back as a whole (coordinated and auto
// recovery): each with its running jobs, its newest cut (newestCuts), and the jobs that cut lacks (gaps).
func runRows(hosts []agent.Status, newest map[coordinated.Run]*coordinated.Cut, gaps map[coordinated.Run]cutGap, now time.Time) []string {
	running := map[coordinated.Run]int{}
	for _, h := range hosts {
		for _, j := range h.Jobs {
			if j.State == agent.JobRunning && j.Spec.RollsBackRun() {
				running[coordinated.Run{Name: j.Spec.Run, UID: j.UID}]++
			}
		}
	}
	var rows []string
	for _, k := range slices.SortedFunc(maps.Keys(running), func(a, b coordinated.Run) int {
		return cmp.Or(strings.Compare(a.Name, b.Name), cmp.Compare(a.UID, b.UID))
	}) {
		c := newest[k]
		if c == nil {
			rows = append(rows, fmt.Sprintf("%s\t%d\t%d\tnone yet\t-\t-", k.Name, k.UID, running[k]))
			continue
		}
		lacks := "-"
		if g, ok := gaps[k]; ok {
			lacks = g.jobs()
		}
		rows = append(rows, fmt.Sprintf("%s\t%d\t%d\t%s\t%s\t%s", k.Name, k.UID, running[k], c.ID, now.Sub(c.Taken).Round(time.Second), lacks))
	}
	return rows
}

// cutGaps are the runs, over the hosts' statuses, whose newest cut any host records (newestCuts) lacks
// running jobs of the run that roll it back.
func cutGaps(hosts []agent.Status, newest map[coordinated.Run]*coordinated.Cut) map[coordinated.Run]cutGap {
	gaps := map[coordinated.Run]cutGap{}
	for _, h := range hosts {
		for _, j := range h.Jobs {
			k := coordinated.Run{Name: j.Spec.Run, UID: j.UID}
			c := newest[k]
			if j.State != agent.JobRunning || !j.Spec.RollsBackRun() || c == nil || c.Holds(j.ID) {
				continue
			}
			g := gaps[k]
			g.cut, g.lacks = c.ID, append(g.lacks, j.ID)
			gaps[k] = g
		}
	}
	for k, g := range gaps {
		slices.Sort(g.lacks)
		g.lacks = slices.Compact(g.lacks)
		gaps[k] = g
	}
	return gaps
}

// latestOf is the newest snapshot of job taken on node.
func latestOf(ms []*ckpt.Manifest, job, node string) *ckpt.Manifest {
	var best *ckpt.Manifest
	for _, m := range ms {
		if m.Job == job && m.Node == node && (best == nil || m.Created.After(best.Created)) {
			best = m
		}
	}
	return best
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func newSnapshotsCmd(t *target) *cobra.Command {
	var asJSON bool
	var job string
	cmd := &cobra.Command{
		Use:   "snapshots",
		Short: "List the snapshots each host holds (its own and the replicas it keeps)",
		Args:  cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			cs, err := t.clients()
			if err != nil {
				return err
			}
			type held struct {
				Host string `json:"host"`
				*ckpt.Manifest
			}
			var all []held
			var errs []error
			for _, c := range cs {
				ms, err := c.client.Snapshots(cmd.Context(), job)
				if err != nil {
					// The other hosts' snapshots are still shown; the error (one line per host) and the exit
					// status say what is missing.
					errs = append(errs, onHost(c.host, err))
					continue
				}
				for _, m := range ms {
					all = append(all, held{Host: c.host, Manifest: m})
				}
			}
			if len(errs) == len(cs) {
				return agentErr(errors.Join(errs...))
			}
			down := agentErr(errors.Join(errs...))
			sort.SliceStable(all, func(i, j int) bool { return all[i].Created.After(all[j].Created) })
			if asJSON {
				return errors.Join(cli.PrintJSON(cmd.OutOrStdout(), all), down)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "SNAPSHOT\tJOB\tTAKEN ON\tHELD BY\tAGE\tSIZE\tFROZEN\tDUMP\tTCP\tREPLICAS")
			for _, h := range all {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", h.ID, h.Job, h.Node, dash(h.Host),
					time.Since(h.Created).Round(time.Second), humanBytes(h.TotalSize()),
					h.Stats.FrozenTime.Round(time.Millisecond), h.DumpDuration.Round(time.Millisecond), len(h.Conns),
					dash(strings.Join(h.Replicas, ",")))
			}
			return errors.Join(w.Flush(), down)
		},
	}
	cmd.Flags().StringVar(&job, "job", "", "only this job")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newCheckpointCmd(t *target) *cobra.Command {
	var asJSON bool
	var jobs []string
	var run string
	var runUID optUID
	cmd := &cobra.Command{
		Use:   "checkpoint",
		Short: "Snapshot jobs now and ship the snapshots to the protector",
		Long: `Snapshot running jobs now (every job of the chosen hosts, or --job), ship each snapshot to its
host's protector, and prune old snapshots. In semi-coordinated mode a host's jobs are frozen together.
It fails if a snapshot could not be taken or did not reach the protector.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if run != "" {
				if len(jobs) > 0 {
					return cli.Usagef("--run takes every job of the run: leave out --job")
				}
				return cutCmd(cmd, t, coordinated.RunRequest{Run: run, UID: runUID.ptr()}, asJSON)
			}
			if runUID.set { // it picks whose run: alone it was dropped, and every job snapshotted
				return cli.Usagef("--uid picks whose run --run names: give --run, or leave out --uid")
			}
			cs, err := t.clients()
			if err != nil {
				return err
			}
			progress := cli.NewProgress(cmd.ErrOrStderr(), asJSON)
			var all []agent.SnapshotResult
			var errs []error
			running := map[string]bool{} // the named jobs found running on a host
			for _, c := range cs {
				mine := jobs
				if len(jobs) > 0 && len(cs) > 1 {
					// With several hosts, ask each only for the named jobs it runs.
					mine = nil
					js, err := c.client.Jobs(cmd.Context())
					if err != nil {
						errs = append(errs, onHost(c.host, err))
						continue
					}
					for _, j := range js {
						for _, want := range jobs {
							if j.ID == want && j.State == agent.JobRunning {
								mine = append(mine, want)
								running[want] = true
							}
						}
					}
					if len(mine) == 0 {
						continue
					}
				}
				progress.Stage("%s: snapshotting %s and shipping to the protector", hostName(c), jobsNamed(mine))
				reply, err := c.client.Checkpoint(cmd.Context(), mine...)
				if err != nil {
					errs = append(errs, onHost(c.host, err))
					continue
				}
				if reply.Error != "" {
					errs = append(errs, fmt.Errorf("%s: %s", c.host, reply.Error))
				}
				all = append(all, reply.Results...)
			}
			// A named job no host runs was asked of none: a single agent refuses it (not found), and so must
			// several, else a typo or an ended job passed for snapshotted.
			if len(jobs) > 0 && len(cs) > 1 {
				for _, want := range jobs {
					if !running[want] {
						errs = append(errs, fmt.Errorf("%w: job %s runs on none of the hosts that answered (see ftctl jobs)", agent.ErrNoJob, want))
					}
				}
			}
			// A snapshot that did not reach the protector protects nothing: say so in the exit status.
			for _, r := range all {
				if !r.Shipped {
					errs = append(errs, fmt.Errorf("snapshot %s of job %s is not replicated: %s", r.Manifest.ID, r.Manifest.Job, r.ShipErr))
				}
			}
			if asJSON {
				if err := cli.PrintJSON(cmd.OutOrStdout(), all); err != nil {
					return err
				}
			} else {
				for _, r := range all {
					where := "replicated on " + strings.Join(r.Manifest.Replicas, ",")
					if !r.Shipped {
						where = "NOT replicated: " + r.ShipErr
					}
					fmt.Fprintf(cmd.OutOrStdout(), "%s  job %s  %s  frozen %s  %s\n", r.Manifest.ID, r.Manifest.Job,
						humanBytes(r.Manifest.TotalSize()), r.Manifest.Stats.FrozenTime.Round(time.Millisecond), where)
				}
			}
			if len(all) == 0 && len(errs) == 0 {
				return cli.WithCode(cli.ExitNotFound, errors.New("no running job to snapshot"))
			}
			return agentErr(errors.Join(errs...))
		},
	}
	cmd.Flags().StringSliceVar(&jobs, "job", nil, "job id (repeatable; default: every running job)")
	cmd.Flags().StringVar(&run, "run", "", "take a coordinated snapshot of every job of this run, on every host, instead (root)")
	cmd.Flags().Var(&runUID, "uid", "with --run: the run's user, when several users have runs of that name")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// cutCmd is `ftctl checkpoint --run RUN`: a coordinated snapshot of a run, coordinated by the agent asked.
func cutCmd(cmd *cobra.Command, t *target, req coordinated.RunRequest, asJSON bool) error {
	c, err := t.one()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Minute)
	defer cancel()
	cli.NewProgress(cmd.ErrOrStderr(), asJSON).Stage("%s: freezing every job of run %s on every host, dumping them, thawing them", hostName(c), req.Run)
	cut, err := c.client.Cut(ctx, req)
	if err != nil {
		return agentErr(err)
	}
	if asJSON {
		return cli.PrintJSON(cmd.OutOrStdout(), cut)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "run %s: coordinated snapshot %s of %d jobs, frozen %s\n", cut.Run, cut.ID, len(cut.Parts), cut.Frozen.Round(time.Millisecond))
	for _, p := range cut.Parts {
		fmt.Fprintf(cmd.OutOrStdout(), "  %s  job %s on %s\n", p.Snapshot, p.Job, p.Host)
	}
	return nil
}

func newRollbackCmd(t *target) *cobra.Command {
	var run string
	var runUID optUID
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "rollback --run RUN",
		Short: "Roll every job of a run back to its newest coordinated snapshot",
		Long: `Roll a whole run back to its newest coordinated snapshot (ftctl checkpoint --run): every job of the
run, on every host, is killed without a word on the wire, then restored from its part of the snapshot
on its host. For programs message logging cannot replay exactly (they decide from the clock, or from
which messages had arrived). The run's timeline is in ftctl events.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if run == "" {
				return cli.Usagef("--run is required")
			}
			c, err := t.one()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Minute)
			defer cancel()
			cli.NewProgress(cmd.ErrOrStderr(), asJSON).Stage("%s: stopping every job of run %s, then restoring each from the run's coordinated snapshot", hostName(c), run)
			r, err := c.client.Rollback(ctx, coordinated.RunRequest{Run: run, UID: runUID.ptr()})
			if err != nil {
				return agentErr(err)
			}
			if asJSON {
				return cli.PrintJSON(cmd.OutOrStdout(), r)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "run %s rolled back to %s: %d jobs restored, stopped %s (ftctl events --failure %s)\n",
				r.Run, r.Cut, len(r.Parts), r.Stopped.Round(time.Millisecond), r.Event)
			return nil
		},
	}
	cmd.Flags().StringVar(&run, "run", "", "the run")
	cmd.Flags().Var(&runUID, "uid", "the run's user, when several users have runs of that name")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newRestoreCmd(t *target) *cobra.Command {
	var req agent.RestoreRequest
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "restore --snapshot ID [--host HOST]",
		Short: "Restore a job from a snapshot on a host (manual fail-over)",
		Long: `Restore a job on the chosen host from a snapshot. The host's agent fetches the snapshot from a member
that holds it (the snapshot's node's protector first) if it lacks it, verifies every file's sha256
(a corrupt snapshot is refused and the next older verified one is named), puts the job's output files
back to their sizes at the snapshot, and restores the job with CRIU. It refuses if the job's node
still answers and runs the job, unless --force. Jobs with live TCP peers need the automatic
fail-over with log replay; this command restores the job's own state only.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if req.Snapshot == "" {
				return cli.Usagef("--snapshot is required (see `ftctl snapshots`)")
			}
			c, err := t.one()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Minute)
			defer cancel()
			progress := cli.NewProgress(cmd.ErrOrStderr(), asJSON)
			progress.Stage("%s: restoring from snapshot %s (fetched from a holder if this host lacks it, then verified)", hostName(c), req.Snapshot)
			j, err := c.client.Restore(ctx, req)
			if err != nil {
				return agentErr(err)
			}
			if asJSON {
				return cli.PrintJSON(cmd.OutOrStdout(), j)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "job %s restored on %s from %s (pid %d)\n", j.ID, j.Node, j.Restored, j.PID)
			return nil
		},
	}
	cmd.Flags().StringVar(&req.Snapshot, "snapshot", "", "snapshot id")
	cmd.Flags().StringVar(&req.Job, "job", "", "job id (found from the snapshot if omitted)")
	cmd.Flags().StringVar(&req.Source, "from", "", "member to fetch the snapshot from (default: the snapshot's protector, then any member)")
	cmd.Flags().BoolVar(&req.Force, "force", false, "restore even if the job's node answers and still runs it (root only)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newMigrateCmd(t *target) *cobra.Command {
	var req agent.MigrateRequest
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "migrate --job ID --to HOST",
		Short: "Move a running job to another node of the ring (planned migration)",
		Long: `Move a running job to another node of the ring, for maintenance or ahead of a predicted failure. The
job's host freezes and dumps it, takes its address off the wire and kills it; the target restores it
from that snapshot with what its peers sent meanwhile replayed from their logs, as after a failure,
and snapshots it again. Its peers keep running. Only a job with an address of its own can move. If the
target fails, the job is restored on its host again. The job's timeline is in ftctl events.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if req.Job == "" || req.To == "" {
				return cli.Usagef("--job and --to are required")
			}
			cs, err := t.clients()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Minute)
			defer cancel()
			// The job's own host moves it: with several hosts, the one that runs it.
			var from *hostClient
			var errs []error
			for i, c := range cs {
				j, err := c.client.Job(ctx, req.Job)
				if err == nil && j.State == agent.JobRunning {
					from = &cs[i]
					break
				}
				// A host that does not know the job says nothing; one that did not answer may be the job's.
				if err != nil && (len(cs) == 1 || !errors.Is(err, agent.ErrNoJob)) {
					errs = append(errs, onHost(c.host, err))
				}
			}
			if from == nil {
				return agentErr(errors.Join(append(errs, fmt.Errorf("job %s runs on none of the hosts asked", req.Job))...))
			}
			progress := cli.NewProgress(cmd.ErrOrStderr(), asJSON)
			progress.Stage("%s: freezing and dumping job %s, then restoring it on %s", hostName(*from), req.Job, req.To)
			m, err := from.client.Migrate(ctx, req)
			if err != nil {
				return agentErr(err)
			}
			// A job that came back to its host was not moved: a failure, in JSON too (a script reads the status).
			var failed error
			if m.Error != "" {
				failed = cli.WithCode(1, fmt.Errorf("migration of job %s to %s failed", m.Job, req.To))
			}
			if asJSON {
				return errors.Join(cli.PrintJSON(cmd.OutOrStdout(), m), failed)
			}
			if failed != nil {
				fmt.Fprintf(cmd.OutOrStdout(), "job %s NOT moved as asked: %s failed (%s); it runs on %s, restored from snapshot %s\n", m.Job, req.To, m.Error, m.To, m.Snapshot)
				return failed
			}
			fmt.Fprintf(cmd.OutOrStdout(), "job %s moved from %s to %s (snapshot %s): stopped %s, replay done after %s (ftctl events --failure %s)\n",
				m.Job, m.From, m.To, m.Snapshot, m.Frozen.Round(time.Millisecond), m.Replayed.Round(time.Millisecond), m.Event)
			return nil
		},
	}
	cmd.Flags().StringVar(&req.Job, "job", "", "job id")
	cmd.Flags().StringVar(&req.To, "to", "", "the node to move it to")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newDrainCmd(t *target) *cobra.Command {
	var req agent.DrainRequest
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "drain [--host HOST] [--to HOST,...]",
		Short: "Move every job off a host (before maintenance)",
		Long: `Move every running job off the chosen host, one after another, as ftctl migrate does: to the nodes
given with --to in turn, or to the ring's other alive nodes in ring order. A job without an address of
its own cannot move: it is snapshotted instead. It fails if a job is still on the host afterwards. The
agent does the same by itself when its [health] command predicts a failure of its host.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := t.one()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), time.Hour)
			defer cancel()
			progress := cli.NewProgress(cmd.ErrOrStderr(), asJSON)
			progress.Stage("%s: moving every job off the host", hostName(c))
			r, err := c.client.Drain(ctx, req)
			if err != nil {
				return agentErr(err)
			}
			if asJSON {
				if err := cli.PrintJSON(cmd.OutOrStdout(), r); err != nil {
					return err
				}
			} else {
				for _, m := range r.Moved {
					fmt.Fprintf(cmd.OutOrStdout(), "job %s moved to %s (stopped %s)\n", m.Job, m.To, m.Frozen.Round(time.Millisecond))
				}
				for _, id := range r.Snapshotted {
					fmt.Fprintf(cmd.OutOrStdout(), "job %s cannot move (no job address): snapshotted on %s\n", id, r.Node)
				}
				for _, f := range r.Failed {
					fmt.Fprintf(cmd.OutOrStdout(), "NOT moved: %s\n", f)
				}
			}
			if len(r.Failed) > 0 || len(r.Snapshotted) > 0 {
				return cli.WithCode(1, fmt.Errorf("%s still runs %d job(s) (ftctl events --failure %s)", r.Node, len(r.Failed)+len(r.Snapshotted), r.Event))
			}
			return nil
		},
	}
	cmd.Flags().StringSliceVar(&req.To, "to", nil, "the nodes to move the jobs to, in turn (default: the ring's other alive nodes)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// optUID is a flag holding a uid, or nothing.
type optUID struct {
	set bool
	uid uint32
}

func (o *optUID) String() string {
	if !o.set {
		return ""
	}
	return strconv.FormatUint(uint64(o.uid), 10)
}

func (o *optUID) Set(v string) error {
	n, err := strconv.ParseUint(v, 10, 32)
	if err != nil {
		return fmt.Errorf("a uid is a number: %w", err)
	}
	o.set, o.uid = true, uint32(n)
	return nil
}

func (o *optUID) Type() string { return "uid" }

func (o *optUID) ptr() *uint32 {
	if !o.set {
		return nil
	}
	return &o.uid
}
