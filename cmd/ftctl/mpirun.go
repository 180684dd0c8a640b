package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/shim"
)

// Environment that mpirun passes down to its launcher (`ftctl mpirun launch-daemon`), which MPI runs once per
// remote host in place of ssh.
const (
	envMPILab       = "FTKIT_MPI_LAB"       // lab id ("" outside a lab)
	envMPISocket    = "FTKIT_MPI_SOCKET"    // outside a lab: the local agent's socket, which forwards to the others
	envMPIRun       = "FTKIT_MPI_RUN"       // run name: job names are RUN-HOST
	envMPIDir       = "FTKIT_MPI_DIR"       // run directory: hostfile, per-host TMPDIRs
	envMPIInterval  = "FTKIT_MPI_INTERVAL"  // the jobs' checkpoint interval ("" = the agents')
	envMPIPlacement = "FTKIT_MPI_PLACEMENT" // the run's hosts and spares, JSON ("" = the cluster ring's)
	envMPIJobAddrs  = "FTKIT_MPI_JOB_ADDRS" // "1": every host's job runs on a job address of its own
	envMPIRecovery  = "FTKIT_MPI_RECOVERY"  // the jobs' recovery mode ("" = message logging)
)

// envAgentSocket names the local agent's socket (as for ftwrap); a Slurm TaskProlog may set it.
const envAgentSocket = "FTKIT_AGENT_SOCKET"

// mpiIface is the interface MPI's TCP traffic uses where it has one name on every host: a lab host's only
// interface (lab.createHost) and a job network's (package jobnet: the job's only one besides loopback).
const mpiIface = "eth0"

// eagerLimit is the largest MPI message Open MPI sends without a rendezvous (see launcherArgv).
const eagerLimit = "67108864"

type mpiRunFlags struct {
	labID, impl, name, interval, mpirun string
	recovery                            string
	hostfile, socket, dir, net          string
	np, spares                          int
	eagerOnly, jobAddrs                 bool
}

func newMPIRunCmd(logs *cli.LogFlags) *cobra.Command {
	f := &mpiRunFlags{}
	cmd := &cobra.Command{
		Use:   "mpirun [flags] -- PROG [ARGS...]",
		Short: "Run an unmodified MPI program over TCP, one protected job per host",
		Long: `Run PROG with Open MPI (or MPICH), one rank per host, over TCP only, with every host's part of the
MPI runtime under ftkit's protection:

  host 1: ONE job = mpirun (Open MPI's HNP, which is also host 1's daemon) + rank 0
  host K: ONE job = orted (or hydra_pmi_proxy) + rank K-1, started through host K's agent

The hosts are, in this order of precedence: --hostfile FILE (member names, one per line; Open MPI's
"NAME slots=N" lines and # comments are accepted); the lab given with --lab; the allocation of the Slurm
job this runs in (SLURM_JOB_NODELIST); the default lab. The last --spares hosts are the run's spares: its
jobs are restored there when a rank's host fails. The ranks run on the first --np of the others.

mpirun runs on the first host (this one) under ftwrap, so its TCP connections to the other hosts' daemons
are logged like the ranks' and host 1 can fail over too. MPI launches the remote daemons through
` + "`ftctl mpirun launch-daemon`" + ` (Open MPI's plm_rsh_agent, MPICH's -launcher-exec) instead of ssh; it asks
the local agent (--socket, else $FTKIT_AGENT_SOCKET, else ` + agentapi.DefaultSocket + `) to start each
daemon's job on its host. Open MPI is restricted to pml ob1, btl tcp,self and oob tcp on the run's hosts'
cluster addresses (or --net): no shared memory, no RDMA. MPICH's ranks are each a node of their own
(MPIR_CVAR_NOLOCAL=1), UCX uses TCP only (UCX_TLS=tcp,self), and libftkit-mpich.so (next to ftctl, else in
/usr/lib/ftkit) is preloaded so that MPI_Finalize cannot hang. Outside a lab the run directory (--dir, default
./.ftkit-mpi/NAME) and the agents' jobs_dir must be on a file system every host shares. See docs/mpi.md.

Output and exit status are mpirun's, as with ftwrap.`,
		Args: cli.Args(cobra.MinimumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			return f.run(cmd.Context(), cmd.Flags().Changed("lab"), args)
		},
	}
	cmd.Flags().StringVar(&f.labID, "lab", lab.DefaultID, "lab id (the default lab only without --hostfile and outside Slurm)")
	cmd.Flags().StringVar(&f.hostfile, "hostfile", "", "the run's hosts: member names, one per line")
	cmd.Flags().IntVar(&f.spares, "spares", 0, "the last N hosts are the run's spares")
	cmd.Flags().IntVar(&f.np, "np", 0, "number of ranks, one per host from the first on (default: every host but the spares)")
	cmd.Flags().StringVar(&f.socket, "socket", "", "outside a lab: the local agent's socket (default: $FTKIT_AGENT_SOCKET, else "+agentapi.DefaultSocket+")")
	cmd.Flags().StringVar(&f.dir, "dir", "", "outside a lab: the run directory, on a file system all hosts share (default: ./.ftkit-mpi/NAME)")
	cmd.Flags().StringVar(&f.net, "net", "", "outside a lab: the CIDR MPI's TCP traffic uses (default: the run's hosts' cluster addresses)")
	cmd.Flags().StringVar(&f.impl, "impl", "openmpi", "MPI implementation: openmpi or mpich")
	cmd.Flags().StringVar(&f.name, "name", "", "run name; the jobs are NAME-HOST (default: mpi-RANDOM)")
	cmd.Flags().StringVar(&f.interval, "interval", "", "the jobs' checkpoint interval: a duration or auto (default: the agents')")
	cmd.Flags().StringVar(&f.recovery, "recovery", "", "after a host failure: message-logging (default), coordinated (the whole run rolls back to its coordinated snapshot, taken at --interval) or auto (message logging, and the whole run's rollback if a restored rank diverges); the last two need --job-addresses")
	cmd.Flags().BoolVar(&f.jobAddrs, "job-addresses", false, "run every host's part of the run (MPI daemon, ranks, PMIx) on a job address of its own, which moves with it when the host fails (docs/job-addresses.md)")
	cmd.Flags().BoolVar(&f.eagerOnly, "eager-only", true, "send messages eagerly, without rendezvous (Open MPI: up to 64 MiB; MPICH: UCX_RNDV_THRESH=inf; see docs/mpi.md)")
	cmd.Flags().StringVar(&f.mpirun, "mpirun", "", "the MPI launcher (default: mpirun.openmpi or mpiexec.mpich)")
	cmd.Flags().SetInterspersed(false) // flags after PROG belong to PROG
	cmd.AddCommand(newMPILaunchDaemonCmd(logs), newMPIFollowCmd())
	return cmd
}

// mpiPlan is where a run goes: its hosts, how its jobs reach their agents, its directory and network.
type mpiPlan struct {
	ranks, spares []string
	placement     *agent.Placement // nil: the cluster ring decides (a lab run without --spares)
	labID         string           // "" outside a lab
	socket        string           // the first host's agent
	dir           string
	cidrs         string // comma-separated: Open MPI's and PMIx's TCP interfaces
}

// plan decides where the run goes.
func (f *mpiRunFlags) plan(ctx context.Context, labChosen bool) (*mpiPlan, error) {
	if f.name == "" {
		b := make([]byte, 3)
		rand.Read(b)
		f.name = "mpi-" + hex.EncodeToString(b)
	}
	// The name becomes a path component of the run directory and the run of every job: check it before
	// anything is looked up, created or launched, so that ../x cannot put the directory elsewhere.
	if err := clusterapi.ValidRunName(f.name); err != nil {
		return nil, cli.Usagef("--name: %v", err)
	}
	var hosts []string
	switch {
	case f.hostfile != "":
		fh, err := os.Open(f.hostfile)
		if err != nil {
			return nil, cli.Usagef("--hostfile: %v", err)
		}
		hosts, err = parseHostfile(fh)
		fh.Close()
		if err != nil {
			return nil, cli.Usagef("--hostfile %s: %v", f.hostfile, err)
		}
	case !labChosen && os.Getenv("SLURM_JOB_NODELIST") != "":
		var err error
		if hosts, err = slurmHosts(ctx, os.Getenv, scontrolHostnames); err != nil {
			return nil, cli.WithCode(cli.ExitUnavailable, err)
		}
	default:
		return f.labPlan()
	}
	ranks, spares, err := splitHosts(hosts, f.np, f.spares)
	if err != nil {
		return nil, err
	}
	p := &mpiPlan{ranks: ranks, spares: spares, placement: &agent.Placement{Hosts: ranks, Spares: spares}, socket: f.socket}
	if p.socket == "" {
		p.socket = os.Getenv(envAgentSocket)
	}
	if p.socket == "" {
		p.socket = agentapi.DefaultSocket
	}
	st, err := agentapi.NewClient(p.socket).Status(ctx)
	if errors.Is(err, agentapi.ErrAgentUnavailable) {
		return nil, cli.WithCode(cli.ExitUnavailable, err)
	}
	if err != nil {
		return nil, fmt.Errorf("ask the local agent for the cluster's members: %w", err)
	}
	if err := p.startHere(st.Node); err != nil {
		return nil, err
	}
	var addrs []netip.Addr
	for _, h := range append(slices.Clone(p.ranks), p.spares...) {
		i := slices.IndexFunc(st.Members, func(m ring.Member) bool { return m.Name == h })
		if i < 0 || st.Members[i].State != ring.StateAlive {
			return nil, cli.WithCode(cli.ExitUnavailable, fmt.Errorf("host %s of the run is not an alive member of the cluster of the agent at %s (see ftctl status)", h, p.socket))
		}
		addrs = append(addrs, st.Members[i].Address.Addr())
	}
	switch {
	case f.jobAddrs && f.net != "":
		return nil, cli.Usagef("--net with --job-addresses: MPI uses the job networks' interface, there is no other")
	case f.jobAddrs:
		p.cidrs = mpiIface
	case f.net != "":
		pfx, err := netip.ParsePrefix(f.net)
		if err != nil {
			return nil, cli.Usagef("--net %q: want a CIDR such as 10.1.0.0/16: %v", f.net, err)
		}
		p.cidrs = pfx.Masked().String()
	default:
		pfx, err := coveringPrefix(addrs)
		if err != nil {
			return nil, cli.Usagef("the run's hosts' cluster addresses: %v; name the network MPI is to use with --net", err)
		}
		p.cidrs = pfx.String()
	}
	p.dir = f.dir
	if p.dir == "" {
		p.dir = filepath.Join(".ftkit-mpi", f.name)
	}
	if p.dir, err = filepath.Abs(p.dir); err != nil {
		return nil, err
	}
	return p, nil
}

// startHere puts this host first among the ranks: mpirun runs here, under the local agent. A batch
// script runs on the first node of its allocation, so this is usually already so.
func (p *mpiPlan) startHere(self string) error {
	i := slices.Index(p.ranks, self)
	if i < 0 {
		return cli.Usagef("this host (%s) runs none of the run's ranks %v: run ftctl mpirun on the first of them", self, p.ranks)
	}
	p.ranks[0], p.ranks[i] = p.ranks[i], p.ranks[0]
	return nil
}

// checkJobNames refuses a run whose jobs, NAME-HOST, the agents would refuse (too long), before its
// directory is made: else the run fails after it, and a retry under the same name finds the name taken.
func checkJobNames(run string, ranks []string) error {
	for _, h := range ranks {
		// A job's name follows the rule of a run's (clusterapi.ValidRunName).
		if err := clusterapi.ValidRunName(run + "-" + h); err != nil {
			return cli.Usagef("--name %s: job name %s-%s on host %s: use a shorter --name (up to 48 bytes with -HOST)", run, run, h, h)
		}
	}
	return nil
}

// labPlan is a run on a lab's live nodes, each reached through its own agent socket.
func (f *mpiRunFlags) labPlan() (*mpiPlan, error) {
	if err := requireRoot(); err != nil {
		return nil, err
	}
	l, err := lab.Open(f.labID, lab.Options{})
	if err != nil {
		return nil, cli.WithCode(cli.ExitNotFound, fmt.Errorf("open lab %s: %w; start one with `ftctl lab up`", f.labID, err))
	}
	st := l.State()
	var nodes []string
	for _, h := range st.Hosts {
		if h.Role == lab.RoleNode && !h.Crashed {
			nodes = append(nodes, h.Name)
		}
	}
	ranks, spares, err := splitHosts(nodes, f.np, f.spares)
	if err != nil {
		return nil, fmt.Errorf("lab %s's live nodes: %w", st.ID, err)
	}
	p := &mpiPlan{ranks: ranks, spares: spares, labID: st.ID, socket: labcluster.Socket(st.ID, ranks[0]), cidrs: st.Subnet.Masked().String()}
	if f.jobAddrs {
		p.cidrs = mpiIface
	}
	if f.spares > 0 {
		p.placement = &agent.Placement{Hosts: ranks, Spares: spares}
	}
	// The run directory is inside the lab's data directory, on the file system every lab host shares.
	p.dir = filepath.Join(filepath.Dir(labcluster.JobsDir(st.ID)), "mpi", f.name)
	return p, nil
}

// run starts mpirun under ftwrap on the first host: this process becomes that ftwrap (exec), so it returns
// only if the run could not start, and leaves nothing of it behind then.
func (f *mpiRunFlags) run(ctx context.Context, labChosen bool, prog []string) (err error) {
	if prog[0] == "--" {
		prog = prog[1:]
	}
	if len(prog) == 0 {
		return cli.Usagef("no program given after --")
	}
	p, err := f.plan(ctx, labChosen)
	if err != nil {
		return err
	}
	if err := checkJobNames(f.name, p.ranks); err != nil {
		return err
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
	// The run directory is on a file system every host shares, so a host's MPI session directory is still
	// there when its job is restored on a spare. Each host gets its own TMPDIR: MPI's session directories
	// are named after hostname and PID, every job's root is PID 1 in its PID namespace, and all lab hosts
	// share one hostname.
	dir := p.dir
	if err := makeRunDirParent(dir, os.Geteuid(), os.MkdirAll); err != nil {
		return err
	}
	// Made here, not found: everything in it is this run's.
	if err := os.Mkdir(dir, 0o755); errors.Is(err, fs.ErrExist) {
		return cli.Usagef("--name %s: a run of that name exists (%s): give another --name, or remove that directory if its run is over", f.name, dir)
	} else if err != nil {
		return fmt.Errorf("create the run directory: %w", err)
	}
	// A return from here on is a run that never started (no MPI launcher, no libftkit-mpich.so, exec
	// failed): its directory goes, else the retry once the cause is fixed finds the name taken.
	defer func() {
		if rmErr := os.RemoveAll(dir); rmErr != nil {
			err = errors.Join(err, fmt.Errorf("remove the directory %s of the run that did not start: %w; remove it before reusing --name %s", dir, rmErr, f.name))
		}
	}()
	for _, h := range p.ranks {
		if err := os.MkdirAll(filepath.Join(dir, "tmp", h), 0o755); err != nil {
			return fmt.Errorf("create the run directory: %w", err)
		}
	}
	argv, err := f.launcherArgv(p, self, prog)
	if err != nil {
		return err
	}
	wrap := []string{"--socket", p.socket, "--name", f.name + "-" + p.ranks[0], "--run", f.name}
	if f.jobAddrs {
		wrap = append(wrap, "--job-address")
	}
	if f.interval != "" {
		wrap = append(wrap, "--interval", f.interval)
	}
	if f.recovery != "" {
		wrap = append(wrap, "--recovery", f.recovery)
	}
	var placement []byte
	if p.placement != nil {
		wrap = append(wrap, "--placement-hosts", strings.Join(p.placement.Hosts, ","))
		if len(p.placement.Spares) > 0 {
			wrap = append(wrap, "--placement-spares", strings.Join(p.placement.Spares, ","))
		}
		if placement, err = json.Marshal(p.placement); err != nil {
			return err
		}
	}
	env := append(withoutEnv(os.Environ(), "TMPDIR", envMPILab, envMPISocket, envMPIRun, envMPIDir, envMPIInterval, envMPIPlacement, envMPIJobAddrs, envMPIRecovery),
		"TMPDIR="+filepath.Join(dir, "tmp", p.ranks[0]), envMPIRun+"="+f.name,
		envMPIDir+"="+dir, envMPIInterval+"="+f.interval, envMPIPlacement+"="+string(placement), envMPIRecovery+"="+f.recovery)
	if f.impl == "mpich" {
		// The whole run, not only the ranks (-genv): the hydra proxies need it (scripts/mpi/ftkit-mpich-finalize.c,
		// 2). Node1's proxy inherits mpiexec's environment, the others launch-daemon's, which is mpiexec's.
		env = withPreload(env, filepath.Join(dir, mpichLibName))
	}
	if f.jobAddrs {
		env = append(env, envMPIJobAddrs+"=1")
	}
	if p.labID != "" {
		env = append(env, envMPILab+"="+p.labID)
	} else {
		env = append(env, envMPISocket+"="+p.socket)
	}
	if os.Geteuid() == 0 { // the lab needs root, and so the ranks run as root
		env = append(env, "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
	}
	if f.impl == "openmpi" && p.labID != "" {
		env = labYield(env)
	}
	if f.impl == "openmpi" {
		// PMIx (rank <-> its host's daemon) listens on loopback TCP by default. A loopback connection's peer
		// address names no host, so a restorer cannot tell it stays inside the job; on the host's cluster
		// address it is plainly a connection whose both ends are on the failed host, restored together.
		env = append(env, "PMIX_MCA_ptl_tcp_if_include="+p.cidrs)
	}
	// This process becomes ftwrap, which follows mpirun's job and exits with its status: a Ctrl-C or a kill of
	// ftctl reaches ftwrap, once, which passes it to the job (a second one kills the job), and a shell sees
	// 128+N if ftwrap itself is killed by signal N. Run as a child, ftwrap got a Ctrl-C together with ftctl,
	// which died of it at once while the job ran on, its output and status no one's; a kill of ftctl alone
	// never reached the job at all.
	args := append(append([]string{ftwrap}, wrap...), "--")
	if err := syscall.Exec(ftwrap, append(args, argv...), env); err != nil {
		return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("run %s, which follows mpirun: %w", ftwrap, err))
	}
	return nil
}

// launcherArgv is the MPI launcher's command line: ranks one per host in order, TCP only on the lab subnet,
// remote daemons started by `ftctl mpirun launch-daemon`.
func (f *mpiRunFlags) launcherArgv(p *mpiPlan, self string, prog []string) ([]string, error) {
	hosts, dir := p.ranks, p.dir
	// MPICH's -launcher-exec takes one executable, not a command line: a one-line script in the run
	// directory (same as scripts/mpi/ftkit-rsh, with this ftctl's path).
	agentCmd := filepath.Join(dir, "rsh")
	// Quoted for the shell whatever ftctl's path holds: a quote in it ended the string early.
	script := fmt.Sprintf("#!/bin/sh\nexec %s mpirun launch-daemon \"$@\"\n", shellQuote(self))
	if err := writeNewFile(agentCmd, []byte(script), 0o755); err != nil {
		return nil, fmt.Errorf("write the MPI launcher script: %w", err)
	}
	subnet := p.cidrs
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
		if err := writeNewFile(hostfile, []byte(hf.String()), 0o644); err != nil {
			return nil, fmt.Errorf("write the hostfile: %w", err)
		}
		argv := []string{bin, "--hostfile", hostfile, "--np", fmt.Sprint(len(hosts)), "--map-by", "node",
			// orted must not daemonize: it is its job's root, and a PID namespace dies with its init.
			"--leave-session-attached",
			"--mca", "plm", "rsh", "--mca", "plm_rsh_agent", agentCmd,
			// Inside a Slurm job Open MPI would read the allocation itself and filter the hostfile by it
			// ("localhost" is no node of it): the hostfile alone says where the ranks go.
			"--mca", "ras", "^slurm",
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
		argv := []string{bin, "-launcher", "ssh", "-launcher-exec", agentCmd, "-hosts", strings.Join(list, ","),
			"-ppn", "1", "-np", fmt.Sprint(len(hosts)), "-iface", mpiIface}
		preload, err := mpichFinalizeLib(self, dir)
		if err != nil {
			return nil, err
		}
		for _, kv := range mpichEnv(f.eagerOnly, preload) {
			argv = append(argv, "-genv", kv[0], kv[1])
		}
		return append(argv, prog...), nil
	default:
		return nil, cli.Usagef("--impl %q: want openmpi or mpich", f.impl)
	}
}

// shellQuote is s as one word of a POSIX shell command line: single-quoted, each quote in it closed, escaped
// and reopened.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// mpichEnv is the environment every MPICH rank gets (hydra's -genv), name and value. Debian's MPICH 4.0 is
// built with ch4:ucx: ranks on one node talk through MPICH's own shared memory (ch4 posix), and UCX picks
// its shared-memory and cross-memory transports (posix, sysv, cma) for peers it finds on the same machine.
// Lab hosts share one kernel, hostname and /dev/shm, so both would take ranks of different lab hosts for
// neighbours, and their bytes would never cross the logged interface.
//
// preload is the copy of libftkit-mpich.so the ranks load (mpichFinalizeLib): MPICH 4.0's MPI_Finalize
// over UCX's TCP transport otherwise hangs in about half of the runs, without ftkit too. (The rest of the
// run gets it through mpiexec's environment, see run.)
func mpichEnv(eagerOnly bool, preload string) [][2]string {
	env := [][2]string{
		// Every rank is a node of its own: no ch4 shared memory between ranks, whatever their hostnames.
		{"MPIR_CVAR_NOLOCAL", "1"},
		// UCX over TCP sockets only ("self" is a rank's messages to itself, in its own memory).
		{"UCX_TLS", "tcp,self"},
		{"UCX_NET_DEVICES", mpiIface},
		// UCX's keepalive messages depend on the clock, so a rank re-executed from its snapshot would
		// send other bytes than its first execution.
		{"UCX_KEEPALIVE_INTERVAL", "inf"},
		{"UCX_WARN_UNUSED_ENV_VARS", "n"},
		// ucp_disconnect_nb without the flush that waits for a peer already in the PMI barrier
		// (scripts/mpi/ftkit-mpich-finalize.c says why); the user's own preloads stay.
		{"LD_PRELOAD", preloadValue(preload, os.Getenv("LD_PRELOAD"))},
	}
	if eagerOnly {
		// As for Open MPI (launcherArgv): UCX's rendezvous sends the sender's buffer address, remote key and
		// request id, which a rank re-executing from its snapshot does not reproduce for its peers' answers.
		env = append(env, [2]string{"UCX_RNDV_THRESH", "inf"})
	}
	return env
}

// preloadValue is LD_PRELOAD with lib first and the user's own preloads after it.
func preloadValue(lib, user string) string {
	return strings.TrimSpace(lib + " " + user)
}

// withPreload is env with lib preloaded before the preloads env already has.
func withPreload(env []string, lib string) []string {
	user := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "LD_PRELOAD="); ok {
			user = v
		}
	}
	return append(withoutEnv(env, "LD_PRELOAD"), "LD_PRELOAD="+preloadValue(lib, user))
}

// mpichLibName is built by `make build` next to ftctl (scripts/mpi/ftkit-mpich-finalize.c); the .deb
// installs it in /usr/lib/ftkit.
const mpichLibName = "libftkit-mpich.so"

var mpichLibDirs = []string{"/usr/lib/ftkit"}

// mpichFinalizeLib copies libftkit-mpich.so (found next to ftctl, else in /usr/lib/ftkit) into the run
// directory, which every host shares, and returns the copy's path: every rank preloads it, whichever host
// (or spare) it runs on, even where ftkit is installed elsewhere.
func mpichFinalizeLib(self, dir string) (string, error) {
	for _, d := range append([]string{filepath.Dir(self)}, mpichLibDirs...) {
		b, err := os.ReadFile(filepath.Join(d, mpichLibName))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("read %s: %w", mpichLibName, err)
		}
		dst := filepath.Join(dir, mpichLibName)
		if err := writeNewFile(dst, b, 0o755); err != nil {
			return "", fmt.Errorf("copy %s into the run directory: %w", mpichLibName, err)
		}
		return dst, nil
	}
	return "", cli.WithCode(cli.ExitUnavailable, fmt.Errorf("no %s next to ftctl or in %s: run `make build` "+
		"(MPICH's MPI_Finalize over TCP hangs without it, docs/mpi.md)", mpichLibName, strings.Join(mpichLibDirs, ", ")))
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

// yieldWhenIdle is the Open MPI parameter that makes a rank waiting for a message yield its CPU instead of
// busy-polling (mpirun forwards it to every rank).
const yieldWhenIdle = "OMPI_MCA_mpi_yield_when_idle"

// labYield is env with yieldWhenIdle set to 1 unless the user set it. A lab's hosts share the machine's
// cores while Open MPI sees one slot per host, so its ranks would busy-poll while they wait and take the
// CPU from the rank that would send (docs/mpi.md: LAMMPS's melt took 47-50 s in a lab instead of 9-15 s).
func labYield(env []string) []string {
	for _, kv := range env {
		if k, _, _ := strings.Cut(kv, "="); k == yieldWhenIdle {
			return env
		}
	}
	return append(env, yieldWhenIdle+"=1")
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
		Short:  "MPI's remote shell: run an MPI daemon as a protected job on a host of the run",
		Hidden: true,
		// Everything is MPI's: the host, maybe ssh options before it, and the daemon's command line.
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := logs.Logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			id, socket, run, dir := os.Getenv(envMPILab), os.Getenv(envMPISocket), os.Getenv(envMPIRun), os.Getenv(envMPIDir)
			if (id == "" && socket == "") || run == "" || dir == "" {
				return cli.Usagef("launch-daemon is run by mpirun under `ftctl mpirun` (%s or %s, %s, %s unset)", envMPILab, envMPISocket, envMPIRun, envMPIDir)
			}
			var placement *agent.Placement
			if pj := os.Getenv(envMPIPlacement); pj != "" {
				placement = &agent.Placement{}
				if err := json.Unmarshal([]byte(pj), placement); err != nil {
					return cli.Usagef("%s: %v", envMPIPlacement, err)
				}
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
				Name:       run + "-" + host,
				Argv:       []string{"/bin/sh", "-c", strings.Join(words, " ")},
				Env:        append(withoutEnv(os.Environ(), "TMPDIR"), "TMPDIR="+tmp),
				Dir:        cwd,
				Interval:   os.Getenv(envMPIInterval),
				Placement:  placement,
				JobAddress: os.Getenv(envMPIJobAddrs) == "1",
				Run:        run,
				Recovery:   os.Getenv(envMPIRecovery),
			}
			var job agent.Job
			if id != "" {
				// In a lab every host's agent has a socket this process reaches.
				job, err = agentapi.NewClient(labcluster.Socket(id, host)).StartJob(cmd.Context(), spec)
			} else {
				// Elsewhere the local agent forwards to HOST's agent over the cluster protocol.
				job, err = agentapi.NewClient(socket).StartJobOn(cmd.Context(), host, spec)
			}
			if errors.Is(err, agentapi.ErrAgentUnavailable) {
				return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("start the MPI daemon on %s: %w", host, err))
			}
			if err != nil {
				return cli.WithCode(125, fmt.Errorf("start the MPI daemon on %s: %w", host, err))
			}
			log.Debug("MPI daemon started", "host", host, "job", job.ID, "pid", job.PID)
			return followDaemon(cmd.Context(), log, job.Dir, cmd.OutOrStdout(), cmd.ErrOrStderr(), syscall.Exec)
		},
	}
	return cmd
}

// followDaemon follows the started MPI daemon's job in dir: this process becomes `ftctl mpirun follow-job
// dir` through execve (syscall.Exec), else follows it itself.
func followDaemon(ctx context.Context, log *slog.Logger, dir string, stdout, stderr io.Writer, execve func(string, []string, []string) error) error {
	// This process lives inside node1's job (a child of mpirun) and is snapshotted with it. A unix
	// connection to an agent outside the job cannot be dumped by CRIU, so re-exec: the exec closes the
	// client's kept-alive connection, and the follower only reads files.
	self, err := os.Executable()
	if err == nil {
		err = execve(self, []string{self, "mpirun", "follow-job", dir}, os.Environ())
	}
	// The daemon's job runs already: returning the error would tell MPI that it never started, while it ran
	// on unfollowed, its output and status no one's. The client closes its idle connection within its idle
	// timeout (agentapi), after which node1's job can be snapshotted again.
	log.Warn("could not re-exec as the MPI daemon's follower; following its job in this process", "dir", dir, "err", err)
	return followJob(ctx, dir, stdout, stderr)
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
			return followJob(cmd.Context(), args[0], cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
}

// followJob copies the output of the job whose directory is dir to stdout and stderr until its exit record
// appears, and returns its status as an error.
func followJob(ctx context.Context, dir string, stdout, stderr io.Writer) error {
	j := agent.Job{Dir: dir}
	var outAt, errAt int64
	for {
		st, exitErr := shim.ReadExit(j.ExitPath())
		outAt += copyTail(j.StdoutPath(), outAt, stdout)
		errAt += copyTail(j.StderrPath(), errAt, stderr)
		if exitErr == nil {
			if st.Reason != "" {
				return cli.WithCode(st.Code, fmt.Errorf("MPI daemon job in %s exited with status %d: %s", dir, st.Code, st.Reason))
			}
			if st.Code != 0 {
				return cli.WithCode(st.Code, fmt.Errorf("MPI daemon job in %s exited with status %d", dir, st.Code))
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
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
