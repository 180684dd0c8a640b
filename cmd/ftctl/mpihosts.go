package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"strings"

	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// Where an MPI run's hosts come from: a lab, a hostfile, or the Slurm allocation the command runs in.

// maxHostfile bounds a hostfile: a line per host, thousands of hosts.
const maxHostfile = 1 << 20

// parseHostfile reads member names, one per line. Open MPI's form is accepted ("NAME slots=N
// max_slots=M", "# comments"): ftkit runs one rank per host, so slots only need to be valid.
func parseHostfile(r io.Reader) ([]string, error) {
	b, err := io.ReadAll(io.LimitReader(r, maxHostfile+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxHostfile {
		return nil, fmt.Errorf("longer than %d bytes", maxHostfile)
	}
	var hosts []string
	seen := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	for n := 1; sc.Scan(); n++ {
		line, _, _ := strings.Cut(sc.Text(), "#")
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if err := clustertls.ValidateMemberName(f[0]); err != nil {
			return nil, fmt.Errorf("line %d: %w (a hostfile names the agents' members)", n, err)
		}
		for _, opt := range f[1:] {
			k, v, _ := strings.Cut(opt, "=")
			if k != "slots" && k != "max_slots" && k != "max-slots" {
				return nil, fmt.Errorf("line %d: %q: only slots=N and max_slots=N may follow a host name", n, opt)
			}
			if s, err := strconv.Atoi(v); err != nil || s < 1 {
				return nil, fmt.Errorf("line %d: %q: want a positive number of slots", n, opt)
			}
		}
		if seen[f[0]] {
			return nil, fmt.Errorf("line %d: %s is listed twice (one rank runs per host)", n, f[0])
		}
		seen[f[0]] = true
		hosts = append(hosts, f[0])
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(hosts) == 0 {
		return nil, errors.New("no hosts")
	}
	return hosts, nil
}

// slurmHosts is the allocation of the Slurm job this command runs in: SLURM_JOB_NODELIST expanded by
// expand (scontrol show hostnames), checked against SLURM_JOB_NUM_NODES (or SLURM_NNODES).
func slurmHosts(ctx context.Context, getenv func(string) string, expand func(context.Context, string) ([]string, error)) ([]string, error) {
	list := getenv("SLURM_JOB_NODELIST")
	if list == "" {
		return nil, errors.New("SLURM_JOB_NODELIST is not set: not inside a Slurm job")
	}
	hosts, err := expand(ctx, list)
	if err != nil {
		return nil, fmt.Errorf("expand SLURM_JOB_NODELIST %q: %w", list, err)
	}
	seen := map[string]bool{}
	for _, h := range hosts {
		if err := clustertls.ValidateMemberName(h); err != nil {
			return nil, fmt.Errorf("allocation: Slurm node %w: Slurm's node names must be the agents' member names", err)
		}
		if seen[h] {
			return nil, fmt.Errorf("allocation: Slurm node %s appears twice", h)
		}
		seen[h] = true
	}
	nn := getenv("SLURM_JOB_NUM_NODES")
	if nn == "" {
		nn = getenv("SLURM_NNODES")
	}
	if nn != "" {
		n, err := strconv.Atoi(nn)
		if err != nil || n != len(hosts) {
			return nil, fmt.Errorf("the allocation has %d nodes (%q), but SLURM_JOB_NUM_NODES says %q", len(hosts), list, nn)
		}
	}
	if len(hosts) == 0 {
		return nil, fmt.Errorf("SLURM_JOB_NODELIST %q names no node", list)
	}
	return hosts, nil
}

// scontrolHostnames expands a Slurm host list with `scontrol show hostnames`, the one expander every
// Slurm version has.
func scontrolHostnames(ctx context.Context, list string) ([]string, error) {
	out, err := exec.CommandContext(ctx, "scontrol", "show", "hostnames", list).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("scontrol show hostnames: %w: %s", err, strings.TrimSpace(string(ee.Stderr)))
		}
		return nil, fmt.Errorf("scontrol show hostnames (is Slurm's client installed?): %w", err)
	}
	if len(out) > maxHostfile {
		return nil, fmt.Errorf("scontrol show hostnames: more than %d bytes", maxHostfile)
	}
	return strings.Fields(string(out)), nil
}

// splitHosts divides a run's hosts: the last spares hosts are its spares, the first np of the others
// run one rank each (np 0: all of them).
func splitHosts(hosts []string, np, spares int) (ranks, spareHosts []string, err error) {
	if spares < 0 {
		return nil, nil, cli.Usagef("--spares %d: want 0 or more", spares)
	}
	avail := len(hosts) - spares
	if avail < 1 {
		return nil, nil, cli.Usagef("--spares %d: the run has %d hosts, and at least one must run a rank", spares, len(hosts))
	}
	if np == 0 {
		np = avail
	}
	if np < 1 || np > avail {
		return nil, nil, cli.Usagef("--np %d: the run has %d hosts besides its %d spares, and ftkit runs one rank per host", np, avail, spares)
	}
	return slices.Clone(hosts[:np]), slices.Clone(hosts[avail:]), nil
}

// coveringPrefix is the longest prefix holding every address: the network MPI's TCP traffic is limited to.
// Open MPI wants one entry that each host matches with its own interface (every entry of a list of /32s
// that names no interface of a host makes that host's daemon warn, and Open MPI 4.1's forwarding of that
// warning breaks the run). A prefix that also holds loopback would let MPI use it: refused.
func coveringPrefix(addrs []netip.Addr) (netip.Prefix, error) {
	if len(addrs) == 0 {
		return netip.Prefix{}, errors.New("no addresses")
	}
	// A member's cluster address may be IPv4-mapped (the ring takes ::ffff:a.b.c.d for a.b.c.d), but the
	// hosts' interfaces hold the IPv4 address: an IPv6 prefix of mapped addresses matches none of them, and
	// escapes the loopback check below (::ffff:127.0.0.1 is not 127.0.0.1).
	unmapped := make([]netip.Addr, len(addrs))
	for i, a := range addrs {
		unmapped[i] = a.Unmap()
	}
	addrs = unmapped
	bits := addrs[0].BitLen()
	for _, a := range addrs[1:] {
		if a.BitLen() != addrs[0].BitLen() {
			return netip.Prefix{}, fmt.Errorf("%v and %v are of different families", addrs[0], a)
		}
		for bits > 0 {
			p, _ := addrs[0].Prefix(bits)
			if p.Contains(a) {
				break
			}
			bits--
		}
	}
	p, err := addrs[0].Prefix(bits)
	if err != nil {
		return netip.Prefix{}, err
	}
	if p.Contains(netip.MustParseAddr("127.0.0.1")) || p.Contains(netip.IPv6Loopback()) {
		return netip.Prefix{}, fmt.Errorf("the only network holding %v, %v, holds loopback too", addrs, p)
	}
	return p, nil
}
