// Package lab builds a small cluster of "hosts" on one machine: one network namespace per host, each with a
// veth on a shared bridge and an address in a private subnet that exists only inside the lab. ftctl's `lab`
// commands and the end-to-end tests use it; nothing here is needed on a real cluster.
package lab

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"regexp"
	"strconv"
	"strings"

	"github.com/ftkit/ftkit/lab/slurm"
)

// DefaultID names the operator's lab. Its namespaces carry the bare host names (node1, spare1); any other
// lab prefixes them with its ID so that tests can run beside it.
const DefaultID = "ftlab"

// DefaultSubnet is a 10.x /24 picked to be unlikely on real hosts; Up refuses it if it is in use anyway.
var DefaultSubnet = netip.MustParsePrefix("10.201.0.0/24")

// RandomTestSubnet draws a /24 for a test's lab from 10.210-239.y.0/24, a range that holds no fixed subnet:
// the demo's are 10.201 and 10.202, and the benchmarks' labs (bench/ftbench), run by tests beside the
// others, have theirs in 10.240-249. Up refuses one in use (ErrSubnetInUse): draw again.
func RandomTestSubnet() netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(210 + rand.IntN(30)), byte(rand.IntN(256)), 0}), 24)
}

// Role says what a host is for.
type Role string

const (
	RoleNode   Role = "node"
	RoleSpare  Role = "spare"
	RoleRouter Role = "router"
)

// Config describes a lab to build.
type Config struct {
	ID     string       // [a-z0-9]{1,8}; DefaultID when empty
	Nodes  int          // compute hosts node1..nodeN
	Spares int          // spare hosts spare1..spareS
	Subnet netip.Prefix // an IPv4 prefix of /24 or wider
	// Slurm starts munged (unless one runs), a slurmctld in the first node and a slurmd in every host.
	Slurm bool
	// Owner, when set, is the process the lab belongs to: SweepOrphans takes the lab down once it exits.
	Owner *slurm.Proc
}

// Host is one planned host of a lab.
type Host struct {
	Name      string       `json:"name"`
	Role      Role         `json:"role"`
	Addr      netip.Prefix `json:"addr"`      // address with the lab's prefix length
	Namespace string       `json:"namespace"` // name under /var/run/netns
	Veth      string       `json:"veth"`      // root-namespace end of the host's veth pair
	Crashed   bool         `json:"crashed,omitempty"`
}

// Plan is everything Up creates, computed up front so that Down can remove it even after a half-done Up.
type Plan struct {
	ID     string       `json:"id"`
	Subnet netip.Prefix `json:"subnet"`
	Bridge string       `json:"bridge"`
	Hosts  []Host       `json:"hosts"`
	// Router holds the subnet's .1, the gateway of job networks (labcluster.JobGateway). It runs nothing
	// and every address outside the subnet is local to it, so whatever a job sends beyond the lab stays in
	// the lab and is refused at once (TCP reset, ICMP port unreachable) instead of waiting for an answer
	// that never comes: a DNS lookup through an unreachable gateway took 18 s. Zero in labs started
	// before it existed.
	Router Host `json:"router,omitzero"`
}

// namespaces is every planned host, the router included when the plan has one.
func (p Plan) namespaces() []Host {
	all := append([]Host(nil), p.Hosts...)
	if p.Router.Namespace != "" {
		all = append(all, p.Router)
	}
	return all
}

// Addresses inside the subnet: nodes from .11, spares from .101, so that a host's role shows in its address.
const (
	nodeBase  = 10
	spareBase = 100
	maxNodes  = spareBase - nodeBase - 1 // 89
	maxSpares = 254 - spareBase          // 154
)

var idRE = regexp.MustCompile(`^[a-z0-9]{1,8}$`)

// NewPlan validates cfg and computes names and addresses.
func NewPlan(cfg Config) (Plan, error) {
	if cfg.ID == "" {
		cfg.ID = DefaultID
	}
	if !idRE.MatchString(cfg.ID) {
		return Plan{}, fmt.Errorf("lab id %q: use 1 to 8 lowercase letters or digits", cfg.ID)
	}
	if !cfg.Subnet.IsValid() {
		cfg.Subnet = DefaultSubnet
	}
	if !cfg.Subnet.Addr().Is4() {
		return Plan{}, fmt.Errorf("lab subnet %s: only IPv4 subnets are supported", cfg.Subnet)
	}
	if cfg.Subnet.Bits() > 24 || cfg.Subnet.Bits() < 8 {
		return Plan{}, fmt.Errorf("lab subnet %s: use a prefix between /8 and /24", cfg.Subnet)
	}
	if cfg.Nodes < 1 || cfg.Nodes > maxNodes {
		return Plan{}, fmt.Errorf("lab nodes %d: use 1 to %d", cfg.Nodes, maxNodes)
	}
	if cfg.Spares < 0 || cfg.Spares > maxSpares {
		return Plan{}, fmt.Errorf("lab spares %d: use 0 to %d", cfg.Spares, maxSpares)
	}
	subnet := cfg.Subnet.Masked()
	p := Plan{ID: cfg.ID, Subnet: subnet, Bridge: cfg.ID + "-br"}
	nsName := func(name string) string {
		if cfg.ID != DefaultID {
			return cfg.ID + "-" + name
		}
		return name
	}
	p.Router = Host{Name: "gw", Role: RoleRouter, Addr: netip.PrefixFrom(nthAddr(subnet, 1), subnet.Bits()),
		Namespace: nsName("gw"), Veth: cfg.ID + "-gw"}
	add := func(role Role, short string, i, base int) {
		name := string(role) + strconv.Itoa(i)
		ns := nsName(name)
		p.Hosts = append(p.Hosts, Host{
			Name:      name,
			Role:      role,
			Addr:      netip.PrefixFrom(nthAddr(subnet, base+i), subnet.Bits()),
			Namespace: ns,
			Veth:      cfg.ID + "-" + short + strconv.Itoa(i),
		})
	}
	for i := 1; i <= cfg.Nodes; i++ {
		add(RoleNode, "n", i, nodeBase)
	}
	for i := 1; i <= cfg.Spares; i++ {
		add(RoleSpare, "s", i, spareBase)
	}
	return p, nil
}

// nthAddr is the n-th address of a masked IPv4 prefix (n < 256, checked by NewPlan's bounds).
func nthAddr(p netip.Prefix, n int) netip.Addr {
	b := p.Addr().As4()
	b[3] += byte(n)
	return netip.AddrFrom4(b)
}

// Host returns the planned host by name.
func (p Plan) Host(name string) (Host, error) {
	for _, h := range p.Hosts {
		if h.Name == name {
			return h, nil
		}
	}
	names := make([]string, len(p.Hosts))
	for i, h := range p.Hosts {
		names[i] = h.Name
	}
	return Host{}, fmt.Errorf("lab %s has no host %q (hosts: %s)", p.ID, name, strings.Join(names, ", "))
}
