//go:build linux

package restore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/ftkit/ftkit/ckpt"
)

// soccrMark is SOCCR_MARK (criu/soccr/soccr.h): packets CRIU itself sends
// while a connection is locked carry it, and its lock rules accept them.
const soccrMark = 0xC114

// runIDTableLen is how much of the run id CRIU's table name keeps: it
// formats "inet CRIU-%s" into a 32-byte buffer (criu/netfilter.c,
// nftables_get_table), so 31 characters survive, 21 of them the run id's.
const runIDTableLen = 21

// GuardTable is the nftables table (family inet) that CRIU's restore of the
// dump with this run id deletes when it unlocks the network.
func GuardTable(runID string) string {
	if len(runID) > runIDTableLen {
		runID = runID[:runIDTableLen]
	}
	return "CRIU-" + runID
}

// Guard creates, in the calling thread's network namespace, the nftables
// table CRIU's restore of dump runID will delete (GuardTable), dropping
// every packet of conns in both directions on input and output, except
// packets marked like CRIU's own (0xC114). It replaces a table of that name
// in one transaction, so calling it again is harmless. Built as CRIU's own
// per-connection lock (criu/netfilter.c): sets conns4/conns6 of
// saddr . sport . daddr . dport.
func Guard(ctx context.Context, runID string, conns []ckpt.Conn) error {
	if !runIDRE.MatchString(runID) {
		return fmt.Errorf("guard: run id %q is not a CRIU run id (a UUID); get it with RunID", runID)
	}
	t := GuardTable(runID)
	script, err := guardScript(t, conns)
	if err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	// Usually the table does not exist, and "create" fails if it does. The
	// replacement ("add" then "delete" in the same transaction, atomic
	// whether or not the table exists) is only run then: the deletion makes
	// nft's exit wait for the kernel to destroy the table, an RCU grace
	// period (about 15 ms of every restore here).
	if err := nft(ctx, "create table inet "+t+"\n"+script); err == nil {
		return nil
	}
	if err := nft(ctx, fmt.Sprintf("add table inet %s\ndelete table inet %s\n%s", t, t, script)); err != nil {
		return fmt.Errorf("guard: create table inet %s: %w", t, err)
	}
	return nil
}

// guardScript is the table Guard creates, as an nft script.
func guardScript(table string, conns []ckpt.Conn) (string, error) {
	var v4, v6 []string
	for _, c := range conns {
		l, r := c.Local.Addr().Unmap(), c.Remote.Addr().Unmap()
		if !c.Local.IsValid() || !c.Remote.IsValid() || l.Is4() != r.Is4() {
			return "", fmt.Errorf("connection %v (inode %d) has invalid or mixed-family addresses", c.Tuple, c.Inode)
		}
		lp, rp := c.Local.Port(), c.Remote.Port()
		out := fmt.Sprintf("%s . %d . %s . %d", l, lp, r, rp)
		in := fmt.Sprintf("%s . %d . %s . %d", r, rp, l, lp)
		if l.Is4() {
			v4 = append(v4, out, in)
		} else {
			v6 = append(v6, out, in)
		}
	}
	set := func(name, typ string, elems []string) string {
		s := fmt.Sprintf("\tset %s {\n\t\ttype %s_addr . inet_service . %s_addr . inet_service\n", name, typ, typ)
		if len(elems) > 0 {
			s += "\t\telements = { " + strings.Join(elems, ", ") + " }\n"
		}
		return s + "\t}\n"
	}
	chain := func(name string) string {
		return fmt.Sprintf("\tchain %s {\n\t\ttype filter hook %s priority 0;\n"+
			"\t\tmeta mark %#x accept\n"+
			"\t\tip saddr . tcp sport . ip daddr . tcp dport @conns4 drop\n"+
			"\t\tip6 saddr . tcp sport . ip6 daddr . tcp dport @conns6 drop\n\t}\n", name, name, soccrMark)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "table inet %s {\n", table)
	b.WriteString(set("conns4", "ipv4", v4))
	b.WriteString(set("conns6", "ipv6", v6))
	b.WriteString(chain("output"))
	b.WriteString(chain("input"))
	b.WriteString("}\n")
	return b.String(), nil
}

// Unguard deletes the guard table of runID in the calling thread's network
// namespace if it still exists (the restore failed before CRIU deleted it).
// A missing table is not an error.
func Unguard(ctx context.Context, runID string) error {
	if !runIDRE.MatchString(runID) {
		return fmt.Errorf("unguard: run id %q is not a CRIU run id (a UUID)", runID)
	}
	t := GuardTable(runID)
	if err := nft(ctx, fmt.Sprintf("add table inet %s\ndelete table inet %s\n", t, t)); err != nil {
		return fmt.Errorf("unguard: delete table inet %s: %w", t, err)
	}
	return nil
}

// GuardExists reports whether the guard table of runID exists in the
// calling thread's network namespace.
func GuardExists(ctx context.Context, runID string) (bool, error) {
	bin, err := nftBinary()
	if err != nil {
		return false, err
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "list", "tables", "inet")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return false, fmt.Errorf("nft list tables: %w: %s", err, bytes.TrimSpace(out.Bytes()))
	}
	want := "table inet " + GuardTable(runID)
	for line := range strings.Lines(out.String()) {
		if strings.TrimSpace(line) == want {
			return true, nil
		}
	}
	return false, nil
}

// nft runs an nft script (one transaction) in the calling thread's network
// namespace: exec forks from the calling thread.
func nft(ctx context.Context, script string) error {
	bin, err := nftBinary()
	if err != nil {
		return err
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %w: %s", err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// nftBinary finds nft, also in the sbin directories a service's PATH may lack.
func nftBinary() (string, error) {
	if p, err := exec.LookPath("nft"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/nft", "/sbin/nft"} {
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", errors.New("the nft binary is not installed (install the nftables package)")
}
