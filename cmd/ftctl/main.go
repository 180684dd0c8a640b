// Command ftctl is the operator's CLI for ftkit: cluster status, snapshots, checkpoints, fail-over, and the
// local lab of network-namespace hosts.
package main

import (
	"fmt"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/version"
)

func main() { os.Exit(cli.Main(newRoot())) }

func newRoot() *cobra.Command {
	var logs cli.LogFlags
	root := &cobra.Command{
		Use:   "ftctl",
		Short: "Operate ftkit: transparent fault tolerance for socket-based parallel programs",
		Long: `ftctl is the operator's CLI for ftkit.

ftkit protects unmodified socket-based parallel programs (MPI over TCP, pipelines of TCP services):
when a node dies, only its processes roll back, restored from their last snapshot on a spare host,
and the bytes their peers had sent them since are replayed from the peers' sender-side logs.

Which agents: by default the local agent on its socket (--socket, $FTKIT_AGENT_SOCKET, else
/run/ftkit/agent.sock); --lab ID the hosts of a local lab. --cluster FILE (or $FTKIT_CLUSTER) reaches
every agent of a cluster from any host, over mutual TLS with an operator certificate (ftctl pki issue
--operator NAME): status, jobs, snapshots, events, checkpoint and restore ask the first agent of FILE that
answers for the membership view, then every alive member (--host H: only H). FILE is TOML:

  ca   = "/etc/ftkit/pki/cluster_ca.crt"     # relative paths: from FILE's directory
  cert = "operator-alice/operator-alice.crt"
  key  = "operator-alice/operator-alice.key" # must be yours and mode 0600, or ftctl refuses it
  # crl = "/etc/ftkit/pki/cluster_ca.crl"    # the CA's revocation list (ftctl pki revoke), if any
  # timeout = "10s"                          # per question (not checkpoint or restore)
  [[agent]]
  name    = "node1"                          # its member name, which its certificate carries
  address = "10.0.0.1:7420"                  # its [cluster] listen

An operator certificate acts as root on every agent: it is a cluster-admin credential.

Exit codes:
  0  success
  1  failure: the operation was tried and failed (the message says why)
  2  bad command line: an unknown command or flag, a bad flag value (checked before anything is done)
  3  not found: no such lab, host, job or snapshot (or one you may not see)
  4  unavailable: an agent is not reachable on its socket or cluster address (the message names it;
     with several agents the others' results are still shown), or a precondition is missing (not
     root, CRIU too old, lab already up, an operator key others can read)`,
		Version: version.Ftkit(),
	}
	logs.Register(root)
	t := &target{}
	// On the root, so that `ftctl --cluster FILE status` reads as it is documented; only the commands that
	// talk to agents use it.
	root.PersistentFlags().StringVar(&t.cluster, "cluster", "", "talk to every agent of a cluster over mutual TLS with the operator certificate this `FILE` names (default $"+clusterEnv+"; see ftctl --help)")
	for _, c := range []*cobra.Command{newStatusCmd(t), newSnapshotsCmd(t), newCheckpointCmd(t), newRestoreCmd(t), newMigrateCmd(t), newRollbackCmd(t), newDrainCmd(t), newEventsCmd(t), newSpareCmd(t),
		newJobsCmd(t), newLogsCmd(t), newKillCmd(t)} {
		t.register(c)
		root.AddCommand(c)
	}
	root.AddCommand(newVersionCmd(), newLabCmd(&logs), newPKICmd())
	root.AddCommand(newMPIRunCmd(&logs))
	return root
}

func newVersionCmd() *cobra.Command {
	var asJSON bool
	var criuPath string
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print the versions of ftkit, Go, CRIU and the kernel",
		Long: `Print the versions of ftkit, the Go toolchain it was built with, the CRIU binary it would use
(asked over CRIU's RPC, so this needs root) and the running kernel. A missing or too old CRIU is reported,
not treated as a failure.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			info := version.Collect(criuPath)
			if asJSON {
				return cli.PrintJSON(cmd.OutOrStdout(), info)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintf(w, "ftkit\t%s\n", info.Ftkit)
			fmt.Fprintf(w, "go\t%s\n", info.Go)
			switch {
			case info.CRIUError != "" && info.CRIU != "":
				fmt.Fprintf(w, "criu\t%s (%s) UNUSABLE: %s\n", info.CRIU, info.CRIUPath, info.CRIUError)
			case info.CRIUError != "":
				fmt.Fprintf(w, "criu\tUNUSABLE: %s\n", info.CRIUError)
			case info.CRIUPatchLevel != criu.PatchLevel():
				fmt.Fprintf(w, "criu\t%s (%s) WITHOUT ftkit's patches (level %d): run `make setup`\n", info.CRIU, info.CRIUPath, criu.PatchLevel())
			default:
				fmt.Fprintf(w, "criu\t%s.%d (%s, with ftkit's patches)\n", info.CRIU, info.CRIUPatchLevel, info.CRIUPath)
			}
			fmt.Fprintf(w, "kernel\t%s\n", info.Kernel)
			return w.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().StringVar(&criuPath, "criu", "", "CRIU binary (default /usr/local/sbin/criu, then PATH)")
	return cmd
}
