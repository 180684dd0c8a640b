package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/shim"
)

// Environment that mpirun passes down to its launcher (`ftctl mpirun launch-daemon`), which MPI runs once per
// remote host in place of ssh.
const (
	envMPILab      = "FTKIT_MPI_LAB"      // lab id
	envMPIRun      = "FTKIT_MPI_RUN"      // run name: job names are RUN-HOST
	envMPIDir      = "FTKIT_MPI_DIR"      // run directory: hostfile, per-host TMPDIRs
	envMPIInterval = "FTKIT_MPI_INTERVAL" // the jobs' checkpoint interval ("" = the agents')
)

// eagerLimit is the largest MPI message Open MPI sends without a rendezvous (see launcherArgv).
const eagerLimit = "67108864"

type mpiRunFlags struct {
	labID, impl, name, interval, mpirun string
	np                                  int
	eagerOnly                           bool
}

func newMPIRunCmd(logs *cli.LogFlags) *cobra.Command {
	f := &mpiRunFlags{}
	cmd := &cobra.Command{
		Use:   "mpirun [flags] -- PROG [ARGS...]",
		Short: "Run an unmodified MPI program over TCP on a lab, one protected job per host",
		Long: `Run PROG with Open MPI (or MPICH), one rank per lab node, over TCP only, with every host's part of the
MPI runtime under ftkit's protection:

  node1: ONE job = mpirun (Open MPI's HNP, which is also node1's daemon) + rank 0
  nodeK: ONE job = orted (or hydra_pmi_proxy) + rank K-1, started through nodeK's agent

mpirun runs in node1 under ftwrap, so its TCP connections to the other hosts' daemons are logged like the
ranks' and node1 can fail over too. MPI launches the remote daemons through ` + "`ftctl mpirun launch-daemon`" + `
(Open MPI's plm_rsh_agent, MPICH's -launcher-exec) instead of ssh. Open MPI is restricted to pml ob1,
btl tcp,self and oob tcp on the lab subnet: no shared memory, no RDMA. See docs/mpi.md.

Output and exit status are mpirun's, as with ftwrap.`,
		Args: cli.Args(cobra.MinimumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := requireRoot(); err != nil {
				return err
			}
			return f.run(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), args)
		},
	}
	cmd.Flags().StringVar(&f.labID, "lab", lab.DefaultID, "lab id")
	cmd.Flags().IntVar(&f.np, "np", 0, "number of ranks, one per node from node1 on (default: every node)")
	cmd.Flags().StringVar(&f.impl, "impl", "openmpi", "MPI implementation: openmpi or mpich")
	cmd.Flags().StringVar(&f.name, "name", "", "run name; the jobs are NAME-HOST (default: mpi-RANDOM)")
	cmd.Flags().StringVar(&f.interval, "interval", "", "the jobs' checkpoint interval: a duration or auto (default: the agents')")
	cmd.Flags().BoolVar(&f.eagerOnly, "eager-only", true, "Open MPI: send messages up to 64 MiB eagerly, without rendezvous (see docs/mpi.md)")
	cmd.Flags().StringVar(&f.mpirun, "mpirun", "", "the MPI launcher (default: mpirun.openmpi or mpiexec.mpich)")
	cmd.Flags().SetInterspersed(false) // flags after PROG belong to PROG
	cmd.AddCommand(newMPILaunchDaemonCmd(logs), newMPIFollowCmd())
	return cmd
}

// run starts mpirun under ftwrap on the first node and waits for it.
func (f *mpiRunFlags) run(ctx context.Context, stdout, stderr io.Writer, prog []string) error {
	if prog[0] == "--" {
		prog = prog[1:]
	}
	if len(prog) == 0 {
		return cli.Usagef("no program given after --")
	}
	l, err := lab.Open(f.labID, lab.Options{})
	if err != nil {
		return cli.WithCode(cli.ExitNotFound, fmt.Errorf("open lab %s: %w; start one with `ftctl lab up`", f.labID, err))
	}
	st := l.State()
	var nodes []string
	for _, h := range st.Hosts {
		if h.Role == lab.RoleNode && !h.Crashed {
			nodes = append(nodes, h.Name)
		}
	}
	if f.np == 0 {
		f.np = len(nodes)
	}
	if f.np < 1 || f.np > len(nodes) {
		return cli.Usagef("--np %d: the lab has %d live nodes and ftkit runs one rank per node", f.np, len(nodes))
	}
	hosts := nodes[:f.np]
	if f.name == "" {
		b := make([]byte, 3)
		rand.Read(b)
		f.name = "mpi-" + hex.EncodeToString(b)
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find ftctl's own path (MPI runs it as its launcher): %w", err)
	}
	ftwrap := filepath.Join(filepath.Dir(self), "ftwrap")
	if !fileExists(ftwrap) {
		if ftwrap, err = exec.LookPath("ftwrap"); err != nil {
			return cli.WithCode(cli.ExitUnavailable, errors.New("no ftwrap next to ftctl or on PATH: run `make build`"))
		}
	}
	// The run directory is inside the lab's data directory, on the file system every lab host shares, so a
	// host's MPI session directory is still there when its job is restored on a spare. Each host gets its
	// own TMPDIR: all lab hosts share one hostname and every job's root is PID 1 in its PID namespace, so
	// MPI's session directories (named after hostname and PID) would collide.
	dir := filepath.Join(filepath.Dir(labcluster.JobsDir(st.ID)), "mpi", f.name)
	if _, err := os.Stat(dir); err == nil {
		return cli.Usagef("--name %s: a run of that name exists in lab %s (%s)", f.name, st.ID, dir)
	}
	for _, h := range hosts {
		if err := os.MkdirAll(filepath.Join(dir, "tmp", h), 0o755); err != nil {
			return fmt.Errorf("create the run directory: %w", err)
		}
	}
	argv, err := f.launcherArgv(st, hosts, dir, self, prog)
	if err != nil {
		return err
	}
	wrap := []string{"--socket", labcluster.Socket(st.ID, hosts[0]), "--name", f.name + "-" + hosts[0]}
	if f.interval != "" {
		wrap = append(wrap, "--interval", f.interval)
	}
	cmd := exec.CommandContext(ctx, ftwrap, append(append(wrap, "--"), argv...)...)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.Env = append(withoutEnv(os.Environ(), "TMPDIR", envMPILab, envMPIRun, envMPIDir, envMPIInterval),
		"TMPDIR="+filepath.Join(dir, "tmp", hosts[0]), envMPILab+"="+st.ID, envMPIRun+"="+f.name,
		envMPIDir+"="+dir, envMPIInterval+"="+f.interval)
	if os.Geteuid() == 0 { // the lab needs root, and so the ranks run as root
		cmd.Env = append(cmd.Env, "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
	}
	if f.impl == "openmpi" {
		// PMIx (rank <-> its host's daemon) listens on loopback TCP by default. A loopback connection's peer
		// address names no host, so a restorer cannot tell it stays inside the job; on the host's lab
		// address it is plainly a connection whose both ends are on the failed host, restored together.
		cmd.Env = append(cmd.Env, "PMIX_MCA_ptl_tcp_if_include="+st.Subnet.Masked().String())
	}
	// The signal goes to the job through ftwrap (same process group), not by killing ftwrap.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	err = cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return cli.WithCode(ee.ExitCode(), fmt.Errorf("MPI run %s: mpirun exited with status %d", f.name, ee.ExitCode()))
	}
	return err
}

// launcherArgv is the MPI launcher's command line: ranks one per host in order, TCP only on the lab subnet,
// remote daemons started by `ftctl mpirun launch-daemon`.
func (f *mpiRunFlags) launcherArgv(st lab.State, hosts []string, dir, self string, prog []string) ([]string, error) {
	// MPICH's -launcher-exec takes one executable, not a command line: a one-line script in the run
	// directory (same as scripts/mpi/ftkit-rsh, with this ftctl's path).
	agentCmd := filepath.Join(dir, "rsh")
	script := fmt.Sprintf("#!/bin/sh\nexec '%s' mpirun launch-daemon \"$@\"\n", self)
	if err := os.WriteFile(agentCmd, []byte(script), 0o755); err != nil {
		return nil, fmt.Errorf("write the MPI launcher script: %w", err)
	}
	subnet := st.Subnet.Masked().String()
	switch f.impl {
	case "openmpi":
		bin, err := findMPI(f.mpirun, "mpirun.openmpi", "Open MPI (apt-get install openmpi-bin)")
		if err != nil {
			return nil, err
		}
		// "localhost" makes mpirun itself node1's daemon: rank 0 is its child, in the same job, so their
		// connection (loopback, never logged) is snapshotted and restored as one.
		var hf strings.Builder
		for i, h := range hosts {
			if i == 0 {
				h = "localhost"
			}
			fmt.Fprintf(&hf, "%s slots=1\n", h)
		}
		hostfile := filepath.Join(dir, "hostfile")
		if err := os.WriteFile(hostfile, []byte(hf.String()), 0o644); err != nil {
			return nil, fmt.Errorf("write the hostfile: %w", err)
		}
		argv := []string{bin, "--hostfile", hostfile, "--np", fmt.Sprint(len(hosts)), "--map-by", "node",
			// orted must not daemonize: it is its job's root, and a PID namespace dies with its init.
			"--leave-session-attached",
			"--mca", "plm", "rsh", "--mca", "plm_rsh_agent", agentCmd,
			// Every daemon is launched from node1; tree spawn would put a launcher of nodeK inside nodeJ's job.
			"--mca", "plm_rsh_no_tree_spawn", "1",
			"--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "oob", "tcp",
			// Shared-memory segments as files in the per-host session directory, not in /dev/shm, which
			// every lab host shares and where a restore would find another host's segment of the same name.
			"--mca", "shmem", "mmap",
			"--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
		}
		if f.eagerOnly {
			// Every message up to eagerLimit goes eagerly, and no RDMA-style put: ob1's rendezvous headers
			// carry the sender's request pointers, which a rank re-executing from its snapshot allocates
			// elsewhere, so its peers' replies to the first execution would point into nothing (measured:
			// rank 1 SIGSEGV in mca_pml_ob1_send_request_put after a restore).
			argv = append(argv, "--mca", "btl_tcp_eager_limit", eagerLimit, "--mca", "btl_tcp_rndv_eager_limit", eagerLimit,
				"--mca", "btl_tcp_max_send_size", eagerLimit, "--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum")
		}
		if os.Geteuid() == 0 {
			argv = append(argv, "--allow-run-as-root")
		}
		return append(argv, prog...), nil
	case "mpich":
		bin, err := findMPI(f.mpirun, "mpiexec.mpich", "MPICH (apt-get install mpich)")
		if err != nil {
			return nil, err
		}
		list := append([]string{"localhost"}, hosts[1:]...)
		return append([]string{bin, "-launcher", "ssh", "-launcher-exec", agentCmd, "-hosts", strings.Join(list, ","),
			"-ppn", "1", "-np", fmt.Sprint(len(hosts)), "-iface", "eth0"}, prog...), nil
	default:
		return nil, cli.Usagef("--impl %q: want openmpi or mpich", f.impl)
	}
}

func findMPI(override, name, pkg string) (string, error) {
	if override != "" {
		name = override
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", cli.WithCode(cli.ExitUnavailable, fmt.Errorf("%s not found: install %s", name, pkg))
	}
	return p, nil
}

func withoutEnv(env []string, names ...string) []string {
	out := env[:0:0]
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		drop := false
		for _, n := range names {
			drop = drop || k == n
		}
		if !drop {
			out = append(out, kv)
		}
	}
	return out
}

// newMPILaunchDaemonCmd is what MPI runs instead of ssh: `launch-daemon HOST WORDS...` starts the shell
// command WORDS as a protected job on HOST's agent, then follows it like ftwrap.
func newMPILaunchDaemonCmd(logs *cli.LogFlags) *cobra.Command {
	cmd := &cobra.Command{
		Use:    "launch-daemon HOST COMMAND...",
		Short:  "MPI's remote shell: run an MPI daemon as a protected job on a lab host",
		Hidden: true,
		// Everything is MPI's: the host, maybe ssh options before it, and the daemon's command line.
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := logs.Logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			id, run, dir := os.Getenv(envMPILab), os.Getenv(envMPIRun), os.Getenv(envMPIDir)
			if id == "" || run == "" || dir == "" {
				return cli.Usagef("launch-daemon is run by mpirun under `ftctl mpirun` (%s, %s, %s unset)", envMPILab, envMPIRun, envMPIDir)
			}
			// ssh's options that MPI launchers add (hydra: -x) mean nothing here.
			for len(args) > 0 && strings.HasPrefix(args[0], "-") {
				args = args[1:]
			}
			if len(args) < 2 {
				return cli.Usagef("launch-daemon wants HOST COMMAND..., got %q", args)
			}
			host := args[0]
			var words []string
			for _, w := range args[1:] {
				// Like ssh, the remote side runs the words through a shell. orted must stay in the
				// foreground: it is the job's root.
				if strings.TrimSpace(w) != "--daemonize" {
					words = append(words, w)
				}
			}
			tmp := filepath.Join(dir, "tmp", host)
			if err := os.MkdirAll(tmp, 0o755); err != nil {
				return err
			}
			cwd, err := os.Getwd()
			if err != nil {
				return err
			}
			spec := agent.JobSpec{
				Name:     run + "-" + host,
				Argv:     []string{"/bin/sh", "-c", strings.Join(words, " ")},
				Env:      append(withoutEnv(os.Environ(), "TMPDIR"), "TMPDIR="+tmp),
				Dir:      cwd,
				Interval: os.Getenv(envMPIInterval),
			}
			job, err := agentapi.NewClient(labcluster.Socket(id, host)).StartJob(cmd.Context(), spec)
			if errors.Is(err, agentapi.ErrAgentUnavailable) {
				return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("start the MPI daemon on %s: %w", host, err))
			}
			if err != nil {
				return cli.WithCode(125, fmt.Errorf("start the MPI daemon on %s: %w", host, err))
			}
			log.Debug("MPI daemon started", "host", host, "job", job.ID, "pid", job.PID)
			// This process lives inside node1's job (a child of mpirun) and is snapshotted with it. A unix
			// connection to an agent outside the job cannot be dumped by CRIU, so re-exec: the exec closes the
			// client's kept-alive connection, and the follower only reads files.
			self, err := os.Executable()
			if err != nil {
				return err
			}
			return syscall.Exec(self, []string{self, "mpirun", "follow-job", job.Dir}, os.Environ())
		},
	}
	return cmd
}

// newMPIFollowCmd copies a job's output to stdout and stderr until the job's exit record appears, wherever
// the job runs by then, and exits with its status. It only reads files.
func newMPIFollowCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "follow-job JOBDIR",
		Short:  "Follow a protected job's output through its directory",
		Hidden: true,
		Args:   cli.Args(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			j := agent.Job{Dir: args[0]}
			var outAt, errAt int64
			for {
				st, exitErr := shim.ReadExit(j.ExitPath())
				outAt += copyTail(j.StdoutPath(), outAt, cmd.OutOrStdout())
				errAt += copyTail(j.StderrPath(), errAt, cmd.ErrOrStderr())
				if exitErr == nil {
					if st.Code != 0 {
						return cli.WithCode(st.Code, fmt.Errorf("MPI daemon job in %s exited with status %d", args[0], st.Code))
					}
					return nil
				}
				select {
				case <-cmd.Context().Done():
					return cmd.Context().Err()
				case <-time.After(200 * time.Millisecond):
				}
			}
		},
	}
}

// copyTail copies path's bytes from offset on to w and returns how many. A restore truncates the file
// back to its snapshot size and the job writes those bytes again; the offset skips them.
func copyTail(path string, offset int64, w io.Writer) int64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	n, _ := io.Copy(w, io.NewSectionReader(f, offset, 1<<62))
	return n
}
