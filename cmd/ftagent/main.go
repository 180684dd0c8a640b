// Command ftagent is ftkit's privileged node daemon: it runs the jobs of its host under protection, snapshots
// them with CRIU, ships the snapshots to its protector, and restores jobs after a failure.
package main

import (
	"context"
	"errors"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/shim"
)

func main() { os.Exit(cli.Main(newRoot())) }

func newRoot() *cobra.Command {
	var logs cli.LogFlags
	var configPath string
	var checkOnly bool
	root := &cobra.Command{
		Use:   "ftagent --config FILE",
		Short: "ftkit's node daemon",
		Long: `ftagent protects the jobs of one host: it starts them under a shim (so they survive an agent restart),
snapshots them with CRIU, ships the snapshots to its protector (the next node of the ring), and serves the
local API that ftctl and ftwrap use on a unix socket.

It must run as root, in the network namespace of the host it protects, with CRIU 4.2 or newer.
The configuration file is documented in docs/agent.example.toml. SIGINT or SIGTERM stop the agent;
its jobs keep running and the next agent adopts them.

--check-config checks the configuration and this host without starting the agent or changing anything
(no directory created, no eBPF loaded, no socket bound): the file is valid, the certificate, key and CA
load, the certificate names this member, is valid now and is signed by the CA, the key, the CA file and the CRL are root's alone,
cluster.listen is an address of this host, CRIU is root's alone and new enough, the kernel answers for nftables, is new enough
and has BTF, cgroup_parent is on cgroup v2, bpffs is there, and no other user can swap the state directories. One
line per check: "ok" or "FAIL" with what to do.

Exit codes:
  0  success (with --check-config: every check passed)
  1  failure (with --check-config: a check failed; the FAIL lines say what to do)
  2  bad command line, or the configuration file cannot be read or is invalid
  4  a precondition is missing: CRIU too old`,
		Version: version.Ftkit(),
		Args:    cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := logs.Logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if configPath == "" {
				return cli.Usagef("--config is required")
			}
			if checkOnly {
				return checkConfig(cmd.OutOrStdout(), configPath, resolvConf, time.Now())
			}
			cfg, err := agentconfig.LoadConfig(configPath)
			if err != nil {
				return cli.WithCode(cli.ExitUsage, err)
			}
			a, err := agent.New(cfg, log)
			if errors.Is(err, criu.ErrTooOld) {
				return cli.WithCode(cli.ExitUnavailable, err)
			}
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			go notifySystemd(ctx, a, log)
			return a.Run(ctx, func(ctx context.Context, a *agent.Agent) (io.Closer, error) {
				return agentapi.Listen(ctx, cfg.Socket, a, log.With("node", cfg.Name))
			})
		},
	}
	logs.Register(root)
	root.Flags().StringVarP(&configPath, "config", "c", "/etc/ftkit/agent.toml", "configuration file")
	root.Flags().BoolVar(&checkOnly, "check-config", false, "check the configuration, certificates and host, change nothing, and exit")
	root.AddCommand(&cobra.Command{
		Use:    "shim",
		Short:  "Internal: the parent process of one job (started by the agent)",
		Hidden: true,
		Args:   cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			// The shim outlives the agent, so it ignores the signals aimed at the agent's terminal.
			signal.Ignore(syscall.SIGHUP, syscall.SIGINT)
			if code := shim.Run(context.Background(), os.Stdin, os.Stdout); code != 0 {
				return cli.WithCode(code, errors.New("shim failed"))
			}
			return nil
		},
	})
	return root
}
