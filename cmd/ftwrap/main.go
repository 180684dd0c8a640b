// Command ftwrap puts an existing program under ftkit's protection and runs it:
//
//	ftwrap [--name JOB] [--interval D|auto] [--job-address] [--placement-hosts H,... [--placement-spares S,...]] [--] PROG [ARGS...]
//
// The local agent starts PROG (own PID namespace, own cgroup, stdin from /dev/null, output to files in the
// job directory); ftwrap copies that output to its own stdout and stderr and exits with PROG's status, also
// when PROG was restored on another host in the meantime.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/shim"
)

func main() { os.Exit(cli.Main(newRoot())) }

func newRoot() *cobra.Command {
	var logs cli.LogFlags
	var name, interval, socket, run, recovery string
	var jobAddress bool
	var placeHosts, placeSpares []string
	root := &cobra.Command{
		Use:   "ftwrap [flags] [--] PROG [ARGS...]",
		Short: "Run a program under ftkit's protection",
		Long: `ftwrap asks the local ftkit agent to run PROG under protection, then follows it: PROG's output is
copied to ftwrap's stdout and stderr, and ftwrap exits with PROG's exit status (128+N if a signal N
killed it). PROG runs in its own PID namespace and cgroup with stdin from /dev/null; it needs no
relinking and no LD_PRELOAD. If PROG's node fails, PROG is restored elsewhere from its last snapshot
and ftwrap keeps following it through the job directory.

The agent is found at --socket, else $FTKIT_AGENT_SOCKET, else ` + agentapi.DefaultSocket + `.
Exit codes other than PROG's: 2 bad command line, 4 agent unreachable, 125 the job could not be
started, 255 the job was lost without an exit status.`,
		Version: version.Ftkit(),
		Args:    cli.Args(cobra.MinimumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := logs.Logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if socket == "" {
				socket = os.Getenv("FTKIT_AGENT_SOCKET")
			}
			if socket == "" {
				socket = agentapi.DefaultSocket
			}
			cwd, err := os.Getwd()
			if err != nil {
				return err
			}
			spec := agent.JobSpec{Name: name, Argv: args, Env: os.Environ(), Dir: cwd, Interval: interval, JobAddress: jobAddress, Run: run, Recovery: recovery}
			if len(placeHosts) > 0 || len(placeSpares) > 0 {
				spec.Placement = &agent.Placement{Hosts: placeHosts, Spares: placeSpares}
				if err := spec.Placement.Validate(); err != nil {
					return cli.Usagef("--placement-hosts, --placement-spares: %v", err)
				}
			}
			return wrap(cmd.Context(), log, agentapi.NewClient(socket), spec)
		},
	}
	logs.Register(root)
	root.Flags().StringVar(&name, "name", "", "job name (default: the program's base name)")
	root.Flags().BoolVar(&jobAddress, "job-address", false, "run the job on an address of its own from the agent's job_network.pool, which moves with the job when its host fails")
	root.Flags().StringVar(&interval, "interval", "", "checkpoint interval: a duration such as 30s, or auto (default: the agent's)")
	root.Flags().StringVar(&socket, "socket", "", "the local agent's socket")
	root.Flags().StringVar(&recovery, "recovery", "", "after a failure of the job's host: message-logging (default: only that host's jobs roll back), coordinated (the whole --run rolls back to its coordinated snapshot), or auto (message logging, and the coordinated rollback if a restored job diverges)")
	root.Flags().StringVar(&run, "run", "", "the run (MPI job, pipeline) this job is a part of: `ftctl checkpoint --run` snapshots all its jobs together and `ftctl rollback` rolls them back together")
	// A run of several jobs (ftctl mpirun) names its own hosts and spares; alone, a job has the ring's.
	root.Flags().StringSliceVar(&placeHosts, "placement-hosts", nil, "the hosts of the run this job is part of, in order (comma-separated member names)")
	root.Flags().StringSliceVar(&placeSpares, "placement-spares", nil, "the run's spare hosts (with --placement-hosts)")
	root.Flags().SetInterspersed(false) // flags after PROG belong to PROG
	return root
}

func wrap(ctx context.Context, log *slog.Logger, c *agentapi.Client, spec agent.JobSpec) error {
	// Ctrl-C, SIGTERM and a hangup go to the job; a second Ctrl-C or SIGTERM kills it. Caught before the job
	// is asked for: one that came while the agent started it killed ftwrap, and the job ran on unfollowed.
	sigs := make(chan os.Signal, 2)
	if fwd := forwarded(); len(fwd) > 0 { // Notify without signals would catch them all
		signal.Notify(sigs, fwd...)
	}
	defer signal.Stop(sigs)
	// A write of the job's output to a pipe whose reader has gone (ftwrap -- PROG | head) raises SIGPIPE,
	// which killed ftwrap while the job ran on, unfollowed, to its end. Caught (and dropped), it leaves the
	// write's EPIPE to follow, which passes SIGPIPE to the job: PROG alone would die of it at its next write.
	// Not if ignored when ftwrap started: PROG alone would have ignored it too.
	brokenPipe := func() {}
	if !signal.Ignored(syscall.SIGPIPE) {
		pipe := make(chan os.Signal, 1)
		signal.Notify(pipe, syscall.SIGPIPE)
		defer signal.Stop(pipe)
		brokenPipe = func() {
			select {
			case sigs <- syscall.SIGPIPE:
			default: // two signals wait already: the job is being stopped
			}
		}
	}

	job, err := c.StartJob(ctx, spec)
	if errors.Is(err, agentapi.ErrAgentUnavailable) {
		return cli.WithCode(cli.ExitUnavailable, err)
	}
	if err != nil {
		return cli.WithCode(125, err)
	}
	log.Debug("job started", "job", job.ID, "node", job.Node, "pid", job.PID)
	// One line, on stderr and before the job's own output, so that its stdout stays the program's alone.
	fmt.Fprintf(os.Stderr, "ftwrap: job %s on %s\n", job.ID, job.Node)

	ctx, stop := context.WithCancel(ctx)
	defer stop()
	outDone := follow(ctx, job.StdoutPath(), os.Stdout, brokenPipe)
	errDone := follow(ctx, job.StderrPath(), os.Stderr, brokenPipe)
	st, err := waitExit(ctx, log, c, job, sigs)
	// Let the followers copy what the job wrote before it exited, then stop them.
	stop()
	outErr, errErr := <-outDone, <-errDone
	if err != nil {
		return err
	}
	if lost := errors.Join(outErr, errErr); lost != nil {
		// Output that could not be written (a full disk, a quota) is not the job's output: a script must not
		// take ftwrap's success for it. The job's status, if it failed, still says so first.
		code := st.Code
		if code == 0 {
			code = cli.ExitFailure
		}
		return cli.WithCode(code, fmt.Errorf("job %s exited with status %d%s, but its output was not all copied: %w; the whole output is in %s and %s",
			job.ID, st.Code, sigSuffix(st), lost, job.StdoutPath(), job.StderrPath()))
	}
	if st.Reason != "" { // ftkit killed it, and says why
		return cli.WithCode(st.Code, fmt.Errorf("job %s exited with status %d%s: %s", job.ID, st.Code, sigSuffix(st), st.Reason))
	}
	if st.Code != 0 {
		return cli.WithCode(st.Code, fmt.Errorf("job %s exited with status %d%s", job.ID, st.Code, sigSuffix(st)))
	}
	return nil
}

// forwarded are the signals ftwrap passes to its job: those that stop a program run from a terminal, a
// script or a batch system, less any ignored when ftwrap started (a script's background job, nohup), which
// PROG run alone would not see either; catching one would undo that.
func forwarded() []os.Signal {
	var sigs []os.Signal
	for _, s := range []os.Signal{os.Interrupt, syscall.SIGTERM, syscall.SIGHUP} {
		if !signal.Ignored(s) {
			sigs = append(sigs, s)
		}
	}
	return sigs
}

func sigSuffix(st *shim.ExitStatus) string {
	if st.Signal == "" {
		return ""
	}
	return " (" + st.Signal + ")"
}

// waitExit waits for the job's exit record. The record is written by whichever shim runs the job, on
// whichever host, so ftwrap keeps waiting when its agent goes away with a failed node; the agent, while
// reachable, tells us if the job was lost.
func waitExit(ctx context.Context, log *slog.Logger, c *agentapi.Client, job agent.Job, sigs <-chan os.Signal) (*shim.ExitStatus, error) {
	exitPath := job.ExitPath()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	agentDown, elsewhere := false, false
	lastPoll := time.Time{}
	signals := 0
	var superseded *shim.ExitStatus // the last record found to be a superseded copy's, not asked about again
	for {
		if st, err := shim.ReadExit(exitPath); err == nil && !sameRecord(st, superseded) {
			var local agent.Job
			var localErr error
			if st.Node == job.Node || st.Incarnation != nil {
				local, localErr = askJob(ctx, c, job.ID)
			}
			switch recordIs(st, job, local, localErr) {
			case recordEnd:
				if st.Node != job.Node {
					log.Info("job ended on another host", "job", job.ID, "node", st.Node)
				}
				return st, nil
			case recordSuperseded:
				superseded = st
				if st.Older(local.Incarnation) {
					log.Warn("the job's directory holds the exit record of an older copy of the job than this host's, superseded (its shim recorded its kill): following the job on",
						"job", job.ID, "node", st.Node, "code", st.Code, "signal", st.Signal, "record_incarnation", *st.Incarnation, "incarnation", local.Incarnation)
					break
				}
				log.Warn("the job's directory holds the exit record of this host's copy, which was killed because the job goes on elsewhere (its shim recorded the kill): following the job on",
					"job", job.ID, "node", st.Node, "code", st.Code, "signal", st.Signal, "state", local.State, "fenced", local.Fenced)
			}
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case s := <-sigs:
			sig := s.(syscall.Signal)
			// A hangup or a broken pipe passes as it is, also twice (the terminal's and its shell's; stdout's
			// and stderr's), as PROG would get it; a second Ctrl-C or SIGTERM is a user's who wants the job gone.
			if sig != syscall.SIGHUP && sig != syscall.SIGPIPE {
				signals++
				if signals > 1 {
					sig = syscall.SIGKILL
				}
			}
			actx, cancel := context.WithTimeout(ctx, signalTimeout)
			err := c.Signal(actx, job.ID, sig)
			cancel()
			if err != nil {
				log.Warn("could not signal the job", "job", job.ID, "err", err)
			}
		case <-tick.C:
		}
		if time.Since(lastPoll) < 2*time.Second {
			continue
		}
		lastPoll = time.Now()
		j, err := askJob(ctx, c, job.ID)
		switch {
		case err != nil && !agentDown:
			agentDown = true
			log.Warn("the job's agent is unreachable; following the job through its directory until it ends, wherever it is restored",
				"job", job.ID, "dir", job.Dir, "err", err)
		case err == nil && j.State == agent.JobLost && j.Fenced:
			// This host's copy was killed because the cluster restores the job elsewhere: follow it on.
			if !elsewhere {
				elsewhere = true
				log.Warn("the job's copy on this host was stopped (this host was cut off or declared failed) and the job is restored elsewhere; following it through its directory until it ends",
					"job", job.ID, "dir", job.Dir)
			}
		case err == nil && j.State == agent.JobLost:
			return nil, cli.WithCode(255, fmt.Errorf("job %s was lost on %s without an exit status", job.ID, j.Node))
		case err == nil:
			agentDown = false
		}
	}
}

// agentTimeout bounds each request of waitExit to the local agent but a signal (signalTimeout). An agent
// that takes the request and never answers (stopped, deadlocked, its host failing while the job is
// restored elsewhere) must not hold ftwrap away from the job's exit record, which the job's copy writes
// wherever it runs, nor from the Ctrl-C the user sends next: unanswered, the agent counts as unreachable.
const agentTimeout = 5 * time.Second

// signalTimeout bounds a signal request to the local agent. For a job that moved or was restored
// elsewhere, the agent passes the signal on to the job's new host, which may take the cluster protocol's
// message timeout (a loaded host): cut off at agentTimeout, a pass that would have succeeded was cancelled
// (the agent stops when its caller goes) and a failed one came back without its error.
const signalTimeout = clusterapi.DefaultMessageTimeout + agentTimeout

// askJob asks the local agent about job id, waiting at most agentTimeout.
func askJob(ctx context.Context, c *agentapi.Client, id string) (agent.Job, error) {
	ctx, cancel := context.WithTimeout(ctx, agentTimeout)
	defer cancel()
	return c.Job(ctx, id)
}

// Verdicts on an exit record found in the job's directory (recordIs).
type recordVerdict int

const (
	recordEnd        recordVerdict = iota // the job's end
	recordSuperseded                      // a killed copy's, not the job's: the job goes on elsewhere
	recordUnsettled                       // the agent has not read it yet: ask again
)

// recordIs says what exit record st is for job, started on job.Node, given what the agent of that host
// says of the job (local, or localErr if it could not be asked; asked for a record of its host, and for
// one that names its copy's incarnation). A record of an incarnation older than the copy that host has
// run last is a superseded copy's (the job came back to the host after a copy elsewhere was fenced,
// moved or failed, and that copy's shim recorded its kill). Otherwise a record of another host is the end
// of the job's restored copy. One of job.Node may be that of a copy its agent killed because the job goes
// on elsewhere (fenced, or migrated away): the agent marks such a copy superseded before the kill, but a
// shim of an older agent, or one whose mark could not be written, records the kill anyway. The agent
// takes only its own host's records, and not that one (the job is fenced or moved there), so it decides;
// if it cannot be asked, the record is the job's end.
func recordIs(st *shim.ExitStatus, job, local agent.Job, localErr error) recordVerdict {
	switch {
	case localErr == nil && st.Older(local.Incarnation):
		return recordSuperseded
	case st.Node != job.Node || localErr != nil:
		return recordEnd
	case local.Fenced || local.State == agent.JobMoved:
		return recordSuperseded
	case local.State == agent.JobRunning:
		return recordUnsettled
	default:
		return recordEnd
	}
}

// sameRecord reports whether a and b are the same exit record (b may be nil).
func sameRecord(a, b *shim.ExitStatus) bool {
	return b != nil && a.Node == b.Node && a.Code == b.Code && a.Signal == b.Signal && a.Time.Equal(b.Time) && a.Reason == b.Reason &&
		(a.Incarnation == nil) == (b.Incarnation == nil) && (a.Incarnation == nil || *a.Incarnation == *b.Incarnation)
}

// follow copies a growing file to w until ctx ends and the file has been read to its end. A restore
// truncates the file back to its size at the snapshot and the job writes those bytes again; they were
// printed already, so follow resumes at the first byte it has not printed. The channel gives the error of
// a write to w that failed (nil if none) once follow is done: it stops at that write, as what it would
// print after it would lack the bytes lost in it. A write to a pipe whose reader has gone calls broken.
func follow(ctx context.Context, path string, w io.Writer, broken func()) <-chan error {
	done := make(chan error, 1)
	go func() {
		var printed int64
		buf := make([]byte, 64<<10)
		for {
			n, err := copyFrom(path, printed, buf, w)
			printed += n
			if errors.Is(err, syscall.EPIPE) {
				broken()
			}
			if err != nil {
				done <- err
				return
			}
			if n > 0 {
				continue
			}
			select {
			case <-ctx.Done():
				_, err := copyFrom(path, printed, buf, w) // what was written just before the end
				done <- err
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	return done
}

// copyFrom copies path's bytes from offset on to w and returns how many it copied, and the error of a
// write to w that failed (a file that cannot be read yet is not one: it is read again later).
func copyFrom(path string, offset int64, buf []byte, w io.Writer) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil
	}
	defer f.Close()
	var total int64
	for {
		n, err := f.ReadAt(buf, offset+total)
		if n > 0 {
			m, werr := w.Write(buf[:n])
			total += int64(m)
			if werr != nil {
				return total, fmt.Errorf("copy %s: %w", path, werr)
			}
		}
		if err != nil {
			return total, nil
		}
	}
}
