package main

import (
	"fmt"
	"net/netip"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/ring"
)

func newSpareCmd(t *target) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "spare",
		Short: "The spare pool: hosts that take over a failed node's jobs",
	}
	var name, addr string
	add := &cobra.Command{
		Use:   "add --name NAME --address IP:PORT",
		Short: "Register a spare host while jobs run",
		Long: `Register an idle host as a spare. Its ftagent must already run (role spare, a certificate of the
cluster CA for NAME, a configuration listing the cluster's members). The agent this command talks to
checks that the spare answers, adds it at the end of the first-come-first-served spare order and sends
the new membership view to every member.`,
		Args: cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			ap, err := netip.ParseAddrPort(addr)
			if err != nil {
				return cli.Usagef("--address %q: use ip:port", addr)
			}
			c, err := t.first()
			if err != nil {
				return err
			}
			v, err := c.client.AddSpare(cmd.Context(), agent.SpareRequest{Name: name, Address: ap})
			if err != nil {
				return agentErr(err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "spare %s registered (membership view epoch %d)\n", name, v.Epoch)
			return printPool(cmd, v)
		},
	}
	add.Flags().StringVar(&name, "name", "", "the spare's member name (its certificate's common name)")
	add.Flags().StringVar(&addr, "address", "", "the spare agent's cluster address, ip:port")
	add.MarkFlagRequired("name")
	add.MarkFlagRequired("address")
	var listJSON bool
	list := &cobra.Command{
		Use:   "list",
		Short: "Show the members and the spare pool in first-come-first-served order",
		Args:  cli.Args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := t.first()
			if err != nil {
				return err
			}
			st, err := c.client.Status(cmd.Context())
			if err != nil {
				return agentErr(err)
			}
			v := ring.View{Epoch: st.Epoch, Members: st.Members}
			if listJSON {
				return cli.PrintJSON(cmd.OutOrStdout(), v)
			}
			return printPool(cmd, v)
		},
	}
	list.Flags().BoolVar(&listJSON, "json", false, "print JSON (the membership view: epoch and members)")
	cmd.AddCommand(add, list)
	return cmd
}

func printPool(cmd *cobra.Command, v ring.View) error {
	w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "MEMBER\tROLE\tSTATE\tADDRESS\tHOLDS\tREPLACES")
	for _, m := range v.Members {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%v\t%s\n", m.Name, m.Role, m.State, m.Address, m.Addrs, dash(m.Replaces))
	}
	return w.Flush()
}
