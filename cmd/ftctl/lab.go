package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// labFlags are shared by every `ftctl lab` subcommand.
type labFlags struct {
	id       string
	stateDir string
	logs     *cli.LogFlags
}

func (f *labFlags) options(stderr io.Writer) (lab.Options, error) {
	log, err := f.logs.Logger(stderr)
	if err != nil {
		return lab.Options{}, err
	}
	return lab.Options{StateDir: f.stateDir, Logger: log}, nil
}

func (f *labFlags) open(stderr io.Writer) (*lab.Lab, error) {
	opts, err := f.options(stderr)
	if err != nil {
		return nil, err
	}
	l, err := lab.Open(f.id, opts)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, cli.WithCode(cli.ExitNotFound, fmt.Errorf("%w; start one with `ftctl lab up`", err))
	}
	return l, err
}

func requireRoot() error {
	if os.Geteuid() != 0 {
		return cli.WithCode(cli.ExitUnavailable, errors.New("the lab needs root (network namespaces, veth, bridge): run with sudo"))
	}
	return nil
}

func newLabCmd(logs *cli.LogFlags) *cobra.Command {
	f := &labFlags{logs: logs}
	cmd := &cobra.Command{
		Use:   "lab",
		Short: "A local cluster of network-namespace hosts for demos and tests",
		Long: `The lab builds a small cluster on this machine: a bridge, and one network namespace per host
(node1..nodeN, spare1..spareS), each with a veth on the bridge and an address in a private subnet
that exists only inside the lab. Processes run in a host with ` + "`ftctl lab exec`" + ` (network
namespace only, like nsenter --net: CRIU needs the real mount tree). ` + "`ftctl lab crash`" + ` is a
power cut of one host. Everything needs root.`,
		PersistentPreRunE: func(*cobra.Command, []string) error { return requireRoot() },
		Args:              cli.Args(cobra.NoArgs), // so that `ftctl lab bogus` is an unknown command
		RunE:              func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	cmd.PersistentFlags().StringVar(&f.id, "lab", lab.DefaultID, "lab id; labs other than the default prefix their namespaces with it")
	// --id was this flag's name before every command took --lab.
	cmd.PersistentFlags().StringVar(&f.id, "id", lab.DefaultID, "lab id (deprecated: use --lab)")
	cmd.PersistentFlags().MarkDeprecated("id", "use --lab")
	cmd.PersistentFlags().StringVar(&f.stateDir, "state-dir", lab.DefaultStateDir, "where lab state files live")
	cmd.AddCommand(newLabUpCmd(f), newLabExecCmd(f), newLabCrashCmd(f), newLabReviveCmd(f), newLabStatusCmd(f), newLabDownCmd(f))
	return cmd
}

func newLabUpCmd(f *labFlags) *cobra.Command {
	var nodes, spares int
	var subnet, agentBin, interval, mode string
	var noAgents, asJSON, withSlurm bool
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Create the lab's bridge and hosts",
		Long: `Create the bridge and one network namespace per host, with addresses in --subnet (nodes from .11,
spares from .101). Refuses if a lab with this id exists or the subnet is in use on this machine.
With --slurm it also starts a real Slurm (Debian's slurmctld, slurmd, munge; scripts/setup.sh installs
them): munged in this machine's namespace (reused if one runs), slurmctld in node1 and one slurmd per
host, all hosts in one partition; Slurm's commands then run in a host with ` + "`ftctl lab exec node1 -- sbatch ...`" + `.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Every flag is checked before anything is created.
			prefix, err := netip.ParsePrefix(subnet)
			if err != nil {
				return cli.Usagef("--subnet %q: %v", subnet, err)
			}
			if err := checkLabUpFlags(interval, mode, nodes, spares); err != nil {
				return err
			}
			opts, err := f.options(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			progress := cli.NewProgress(cmd.ErrOrStderr(), asJSON)
			progress.Stage("lab %s: creating the bridge and %d host namespaces", f.id, nodes+spares)
			if withSlurm {
				progress.Stage("lab %s: then munged, slurmctld in node1 and a slurmd in each host, until every node is idle", f.id)
			}
			l, err := lab.Up(cmd.Context(), lab.Config{ID: f.id, Nodes: nodes, Spares: spares, Subnet: prefix, Slurm: withSlurm}, opts)
			if errors.Is(err, lab.ErrExists) || errors.Is(err, lab.ErrSubnetInUse) {
				return cli.WithCode(cli.ExitUnavailable, err)
			}
			if err != nil {
				return err
			}
			if !noAgents {
				progress.Stage("lab %s: starting an agent in each host and waiting for all to answer", f.id)
				if err := startAgents(cmd.Context(), l, agentBin, interval, mode); err != nil {
					if derr := l.Down(context.WithoutCancel(cmd.Context())); derr != nil {
						err = errors.Join(err, derr)
					}
					return err
				}
			}
			progress.Stage("lab %s: up", f.id)
			return printStatus(cmd.OutOrStdout(), l.Status(), asJSON)
		},
	}
	cmd.Flags().BoolVar(&noAgents, "no-agents", false, "do not start an ftagent in each host")
	cmd.Flags().BoolVar(&withSlurm, "slurm", false, "also run Slurm: munged, a slurmctld in node1 and a slurmd in every host (nodes and spares)")
	cmd.Flags().StringVar(&agentBin, "agent-bin", "", "ftagent binary (default: next to ftctl, then PATH)")
	cmd.Flags().StringVar(&interval, "interval", "60s", "the agents' checkpoint interval: a duration, or auto")
	cmd.Flags().StringVar(&mode, "mode", string(agent.Uncoordinated), "the agents' checkpoint mode: uncoordinated or semi-coordinated")
	cmd.Flags().IntVar(&nodes, "nodes", 3, "number of compute hosts")
	cmd.Flags().IntVar(&spares, "spares", 1, "number of spare hosts")
	cmd.Flags().StringVar(&subnet, "subnet", lab.DefaultSubnet.String(), "private IPv4 subnet (/8 to /24) that exists only inside the lab")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newLabExecCmd(f *labFlags) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "exec HOST -- CMD [ARGS...]",
		Short: "Run a command inside a host's network namespace",
		Long: `Run CMD inside HOST's network namespace with this process's mount namespace, stdio and environment
(nsenter --net semantics). ftctl replaces itself with CMD, so CMD's exit status is ftctl's. In a lab
with Slurm, SLURM_CONF is set to the lab's slurm.conf unless already set.`,
		Args: cli.Args(cobra.MinimumNArgs(2)),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := f.open(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			path, err := l.NetnsPath(args[0])
			if err != nil {
				return cli.WithCode(cli.ExitNotFound, err)
			}
			argv := args[1:]
			if argv[0] == "--" { // flag parsing stopped at HOST, so cobra left the separator in place
				argv = argv[1:]
			}
			if len(argv) == 0 {
				return cli.Usagef("no command given after %s --", args[0])
			}
			// Slurm's clients find the lab's controller.
			if conf := l.SlurmConf(); conf != "" && os.Getenv("SLURM_CONF") == "" {
				os.Setenv("SLURM_CONF", conf)
			}
			// Programs in a host (ftwrap, ftctl) find that host's agent.
			if os.Getenv("FTKIT_AGENT_SOCKET") == "" {
				sock := labcluster.Socket(l.State().ID, args[0])
				if _, err := os.Stat(sock); err == nil {
					os.Setenv("FTKIT_AGENT_SOCKET", sock)
				}
			}
			return execInNetns(path, argv)
		},
	}
	cmd.Flags().SetInterspersed(false) // everything after HOST belongs to CMD
	return cmd
}

// startAgents runs an ftagent in every host of the lab.
func startAgents(ctx context.Context, l *lab.Lab, bin, interval, mode string) error {
	if bin == "" {
		var err error
		if bin, err = findAgentBin(); err != nil {
			return err
		}
	}
	_, err := labcluster.Start(ctx, l, labcluster.Options{AgentBin: bin, Interval: interval, Mode: agent.Mode(mode)})
	return err
}

// findAgentBin finds ftagent next to ftctl, then on PATH.
func findAgentBin() (string, error) {
	if self, err := os.Executable(); err == nil {
		if p := filepath.Join(filepath.Dir(self), "ftagent"); fileExists(p) {
			return p, nil
		}
	}
	p, err := exec.LookPath("ftagent")
	if err != nil {
		return "", cli.WithCode(cli.ExitUnavailable, errors.New("no ftagent binary next to ftctl or on PATH: run `make build`, or pass --agent-bin (or --no-agents)"))
	}
	return p, nil
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// execInNetns replaces this process with argv[0] running in the network namespace at path.
func execInNetns(path string, argv []string) error {
	bin, err := exec.LookPath(argv[0])
	if err != nil {
		return cli.WithCode(127, fmt.Errorf("command %q: %w", argv[0], err))
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	// execve keeps the calling thread's namespaces, so the thread that joins the namespace must exec.
	runtime.LockOSThread()
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("enter %s: %w", path, err)
	}
	unix.Close(fd)
	err = syscall.Exec(bin, argv, os.Environ())
	return cli.WithCode(126, fmt.Errorf("exec %s: %w", bin, err))
}

func newLabCrashCmd(f *labFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "crash HOST",
		Short: "Fail-stop a host: SIGKILL everything in it, then delete its namespace and veth",
		Long: `Power-cut HOST: every process in its network namespace (its agent included) is SIGKILLed, then the
namespace and its veth are deleted. Nothing on the host survives.`,
		Args: cli.Args(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := f.open(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if _, err := l.Host(args[0]); err != nil {
				return cli.WithCode(cli.ExitNotFound, err)
			}
			if err := l.Crash(cmd.Context(), args[0]); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s crashed\n", args[0])
			return nil
		},
	}
}

func newLabReviveCmd(f *labFlags) *cobra.Command {
	var noAgent bool
	var agentBin string
	cmd := &cobra.Command{
		Use:   "revive HOST",
		Short: "Bring a crashed host back with its original address (and its slurmd)",
		Long: `Bring a crashed HOST back as a repaired machine would come back: a new, empty network namespace
with its veth on the bridge and its original address, and its Slurm daemons if the lab runs Slurm
(waiting until slurmctld sees its node again), and its ftagent if the lab has agents, with its old
configuration and state (how a repaired host rejoins is the agents' business). Refused while another
host holds HOST's address (after an IP takeover).`,
		Args: cli.Args(cobra.ExactArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := f.open(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			h, err := l.Host(args[0])
			if err != nil {
				return cli.WithCode(cli.ExitNotFound, err)
			}
			if !h.Crashed {
				return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("%s is not crashed; only a crashed host can be revived", args[0]))
			}
			if _, hasAgents := labcluster.Open(l, labcluster.Options{}); !hasAgents || noAgent {
				if err := l.Revive(cmd.Context(), args[0]); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s revived at %s\n", args[0], h.Addr.Addr())
				return nil
			}
			bin := agentBin
			if bin == "" {
				if bin, err = findAgentBin(); err != nil {
					return err
				}
			}
			c, _ := labcluster.Open(l, labcluster.Options{AgentBin: bin})
			if err := c.Revive(cmd.Context(), args[0]); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s revived at %s, its agent answers\n", args[0], h.Addr.Addr())
			return nil
		},
	}
	cmd.Flags().BoolVar(&noAgent, "no-agent", false, "do not start the host's ftagent again")
	cmd.Flags().StringVar(&agentBin, "agent-bin", "", "ftagent binary (default: next to ftctl, then PATH)")
	return cmd
}

func newLabStatusCmd(f *labFlags) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the lab's hosts as the kernel sees them",
		Args:  cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := f.open(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			return printStatus(cmd.OutOrStdout(), l.Status(), asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newLabDownCmd(f *labFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "down",
		Short: "Remove everything the lab created (safe to run twice)",
		Args:  cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := f.open(cmd.ErrOrStderr())
			if errors.Is(err, fs.ErrNotExist) {
				fmt.Fprintf(cmd.OutOrStdout(), "lab %s is not up\n", f.id)
				return nil
			}
			if err != nil {
				return err
			}
			if err := l.Down(cmd.Context()); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "lab %s is down\n", f.id)
			return nil
		},
	}
}

func printStatus(w io.Writer, s lab.Status, asJSON bool) error {
	if asJSON {
		return cli.PrintJSON(w, s)
	}
	fmt.Fprintf(w, "lab %s  subnet %s  bridge %s  %s\n", s.ID, s.Subnet, s.Bridge, s.Phase)
	if s.SlurmConf != "" {
		fmt.Fprintf(w, "slurm: SLURM_CONF=%s (run clients in a host: ftctl lab exec node1 -- sinfo)\n", s.SlurmConf)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "HOST\tROLE\tADDRESS\tNAMESPACE\tSTATE\tPROCESSES\tADDRESSES NOW")
	rows := s.Hosts
	if s.Router != nil {
		rows = append(rows[:len(rows):len(rows)], *s.Router)
	}
	for _, h := range rows {
		state := "up"
		switch {
		case h.Crashed:
			state = "crashed"
		case !h.Exists:
			state = "missing"
		case !h.LinkUp:
			state = "link-down"
		}
		now := make([]string, len(h.Addrs))
		for i, a := range h.Addrs {
			now[i] = a.Addr().String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\n", h.Name, h.Role, h.Addr.Addr(), h.Namespace, state, h.Processes, strings.Join(now, ","))
	}
	return tw.Flush()
}

// checkLabUpFlags validates what `lab up` hands the agents and the lab, so that a typo is refused before
// any namespace exists.
func checkLabUpFlags(interval, mode string, nodes, spares int) error {
	var iv agent.Interval
	if err := iv.UnmarshalText([]byte(interval)); err != nil {
		return cli.Usagef("--interval: %v", err)
	}
	if !iv.Auto && iv.Fixed <= 0 {
		return cli.Usagef("--interval %q: use a positive duration like 60s, or auto", interval)
	}
	switch agent.Mode(mode) {
	case agent.Uncoordinated, agent.SemiCoordinated:
	default:
		return cli.Usagef("--mode %q: use %s or %s", mode, agent.Uncoordinated, agent.SemiCoordinated)
	}
	if nodes < 1 {
		return cli.Usagef("--nodes %d: a lab needs at least one node", nodes)
	}
	if spares < 0 {
		return cli.Usagef("--spares %d: use 0 or more", spares)
	}
	return nil
}
