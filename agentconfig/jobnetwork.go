package agentconfig

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/ftkit/ftkit/internal/hostnet"
	"github.com/ftkit/ftkit/jobnet"
)

// JobNetworkConfig is the [job_network] section: the job addresses this agent hands out.
type JobNetworkConfig struct {
	// Pool is the prefix of job addresses this agent may hand out, inside the cluster network of its
	// interface (e.g. 10.1.0.200/29); zero (absent): jobs cannot ask for an address here. Pools are per
	// host and must not overlap: nothing coordinates them across hosts yet.
	Pool netip.Prefix `toml:"pool"`
	// Parent is the interface the job interfaces sit on; "": the one holding cluster.listen's address.
	Parent string `toml:"parent"`
	// Kind is the job interface's type: macvlan (default, measured) or ipvlan (needs CONFIG_IPVLAN).
	Kind jobnet.Kind `toml:"kind"`
	// Gateway, if set, is the default route of every job network: a router on the cluster network, for
	// jobs that talk to hosts beyond it (a file server, a licence server). Unset: the cluster network only.
	Gateway netip.Addr `toml:"gateway"`
	// Linger bounds how long an ended job's network outlives it while connections the job closed still
	// send their last bytes and FIN (jobnet.Closing); 0: deleted at once.
	Linger Duration `toml:"linger"`
}

// maxLinger bounds job_network.linger: the address of an ended job stays on the wire that long at most.
const maxLinger = 10 * time.Minute

// minPoolBits bounds a pool to 4096 addresses: allocation walks it.
const minPoolBits = 20

// validate checks what can be checked without the host (CheckJobNetwork checks the rest).
func (c JobNetworkConfig) validate() error {
	switch c.Kind {
	case jobnet.MACVlan, jobnet.IPVlan:
	default:
		return fmt.Errorf("job_network.kind %q: use %s or %s", c.Kind, jobnet.MACVlan, jobnet.IPVlan)
	}
	if c.Parent != "" && !validIfName(c.Parent) {
		return fmt.Errorf("job_network.parent %q: not an interface name (1 to 15 bytes, no spaces, '/' or ':')", c.Parent)
	}
	if c.Linger.Duration < 0 || c.Linger.Duration > maxLinger {
		return fmt.Errorf("job_network.linger %s: use 0 to %s", c.Linger, maxLinger)
	}
	if c.Gateway.IsValid() && !c.Gateway.Is4() {
		return fmt.Errorf("job_network.gateway %s: only IPv4 is supported", c.Gateway)
	}
	if !c.Pool.IsValid() {
		return nil
	}
	switch {
	case c.Gateway.IsValid() && c.Pool.Contains(c.Gateway):
		return fmt.Errorf("job_network.gateway %s is inside job_network.pool %s: the gateway must be a router, not a job address", c.Gateway, c.Pool)
	case !c.Pool.Addr().Is4():
		return fmt.Errorf("job_network.pool %s: only IPv4 job addresses are supported", c.Pool)
	case c.Pool != c.Pool.Masked():
		return fmt.Errorf("job_network.pool %s: write the prefix's first address (%s)", c.Pool, c.Pool.Masked())
	case c.Pool.Bits() < minPoolBits:
		return fmt.Errorf("job_network.pool %s: at most /%d (4096 addresses)", c.Pool, minPoolBits)
	}
	return nil
}

func validIfName(s string) bool {
	if s == "" || len(s) > 15 || s == "." || s == ".." {
		return false
	}
	for _, c := range []byte(s) {
		if c <= ' ' || c == '/' || c == ':' || c >= 0x7f {
			return false
		}
	}
	return true
}

// ClusterNetwork is this host's cluster interface and its address with the cluster network's length.
func (c Config) ClusterNetwork() (iface string, own netip.Prefix, err error) {
	iface, own, err = hostnet.Interface(c.Cluster.Listen.Addr())
	if err != nil {
		return "", netip.Prefix{}, fmt.Errorf("find the cluster interface (the one holding cluster.listen's address %s): %w", c.Cluster.Listen.Addr(), err)
	}
	return iface, own, nil
}

// CheckJobNetwork checks [job_network] against this host (ftagent --check-config, and the agent at start):
// the pool inside the cluster network of the cluster interface, holding no member's address, the gateway
// inside that network, and the parent interface present. Nil when no pool is configured.
func (c Config) CheckJobNetwork() error {
	if !c.JobNetwork.Pool.IsValid() {
		return nil
	}
	iface, own, err := c.ClusterNetwork()
	if err != nil {
		return fmt.Errorf("job_network: %w", err)
	}
	pool := c.JobNetwork.Pool
	if pool.Bits() < own.Bits() || !own.Masked().Contains(pool.Addr()) {
		return fmt.Errorf("job_network.pool %s is not inside the cluster network %s of %s", pool, own.Masked(), iface)
	}
	for _, m := range c.Cluster.Members {
		if pool.Contains(m.Address.Addr().Unmap()) {
			return fmt.Errorf("job_network.pool %s holds member %s's address %s: use a range no host has", pool, m.Name, m.Address.Addr())
		}
	}
	if gw := c.JobNetwork.Gateway; gw.IsValid() && (!own.Masked().Contains(gw) || gw == own.Addr()) {
		return fmt.Errorf("job_network.gateway %s: want a router inside the cluster network %s of %s, not this host", gw, own.Masked(), iface)
	}
	if c.JobNetwork.Parent != "" {
		if _, err := net.InterfaceByName(c.JobNetwork.Parent); err != nil {
			return fmt.Errorf("job_network.parent %s: %w", c.JobNetwork.Parent, err)
		}
	}
	return nil
}

// CheckJobNameservers says which nameservers of resolvConf (the host's /etc/resolv.conf, which a job on a
// job address shares with the host while its network namespace is its own) a job network cannot reach,
// and why. Nil when every one is reachable, or when no pool is configured. A job that cannot reach one
// waits for the resolver's timeouts on every lookup, or fails it (mpirun resolves every host name: in the
// lab, through a gateway that dropped everything, a 3-host start took 50 s instead of 0.7 s).
func (c Config) CheckJobNameservers(resolvConf []byte) error {
	if !c.JobNetwork.Pool.IsValid() {
		return nil
	}
	_, own, err := c.ClusterNetwork()
	if err != nil {
		return fmt.Errorf("job_network: %w", err)
	}
	return unreachableNameservers(resolvConf, own.Masked(), c.JobNetwork.Gateway)
}

// unreachableNameservers checks each nameserver line of resolvConf against what a job network reaches:
// the cluster network on-link, and anything else only through gateway (if valid).
func unreachableNameservers(resolvConf []byte, cluster netip.Prefix, gateway netip.Addr) error {
	var errs []error
	for line := range strings.Lines(string(resolvConf)) {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "nameserver" {
			continue
		}
		a, err := netip.ParseAddr(f[1])
		if err != nil {
			errs = append(errs, fmt.Errorf("nameserver %s: not an address a job network can reach", f[1]))
			continue
		}
		a = a.Unmap()
		switch {
		case a.IsLoopback():
			errs = append(errs, fmt.Errorf("nameserver %s is on loopback (a local stub resolver such as systemd-resolved's): a job network has its own loopback, where nothing answers; list the upstream servers in /etc/resolv.conf", a))
		case !a.Is4():
			errs = append(errs, fmt.Errorf("nameserver %s: job networks have IPv4 only", a))
		case cluster.Contains(a):
		case !gateway.IsValid():
			errs = append(errs, fmt.Errorf("nameserver %s is outside the cluster network %s and job_network.gateway is unset: set it to the router that reaches it", a, cluster))
		}
	}
	return errors.Join(errs...)
}
