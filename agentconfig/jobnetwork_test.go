package agentconfig

import (
	"net/netip"
	"strings"
	"testing"
	"time"
)

func TestJobNetworkConfig(t *testing.T) {
	base := "name = \"node1\"\n"
	tests := []struct {
		name, toml, wantErr string
		wantPool            string
		wantLinger          time.Duration
	}{
		{name: "absent: off, macvlan by default", toml: base},
		{name: "no linger", toml: base + "[job_network]\nlinger = \"0s\"\n"},
		{name: "linger", toml: base + "[job_network]\nlinger = \"2m\"\n", wantLinger: 2 * time.Minute},
		{name: "negative linger", toml: base + "[job_network]\nlinger = \"-1s\"\n", wantErr: "job_network.linger -1s: use 0 to 10m0s"},
		{name: "linger too long", toml: base + "[job_network]\nlinger = \"1h\"\n", wantErr: "job_network.linger 1h0m0s: use 0 to 10m0s"},
		{name: "a pool", toml: base + "[job_network]\npool = \"10.1.0.200/29\"\n", wantPool: "10.1.0.200/29"},
		{name: "ipvlan on a named parent", toml: base + "[job_network]\npool = \"10.1.0.200/29\"\nkind = \"ipvlan\"\nparent = \"bond0\"\n", wantPool: "10.1.0.200/29"},
		{name: "empty pool: off", toml: base + "[job_network]\npool = \"\"\n"},
		{name: "not the prefix's first address", toml: base + "[job_network]\npool = \"10.1.0.201/29\"\n", wantErr: "write the prefix's first address (10.1.0.200/29)"},
		{name: "IPv6", toml: base + "[job_network]\npool = \"fd00::/120\"\n", wantErr: "only IPv4"},
		{name: "too large", toml: base + "[job_network]\npool = \"10.0.0.0/16\"\n", wantErr: "at most /20"},
		{name: "unknown kind", toml: base + "[job_network]\nkind = \"veth\"\n", wantErr: `job_network.kind "veth"`},
		{name: "bad parent", toml: base + "[job_network]\nparent = \"a/b\"\n", wantErr: "job_network.parent"},
		{name: "not a prefix", toml: base + "[job_network]\npool = \"10.1.0.200\"\n", wantErr: "line"},
		{name: "unknown key", toml: base + "[job_network]\nrange = \"10.1.0.200/29\"\n", wantErr: "unknown key"},
		{name: "a gateway", toml: base + "[job_network]\npool = \"10.1.0.200/29\"\ngateway = \"10.1.0.1\"\n", wantPool: "10.1.0.200/29"},
		{name: "gateway in the pool", toml: base + "[job_network]\npool = \"10.1.0.200/29\"\ngateway = \"10.1.0.201\"\n", wantErr: "inside job_network.pool"},
		{name: "IPv6 gateway", toml: base + "[job_network]\ngateway = \"fd00::1\"\n", wantErr: "job_network.gateway fd00::1: only IPv4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig([]byte(tt.toml))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseConfig = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := c.JobNetwork.Pool; tt.wantPool == "" && got.IsValid() || tt.wantPool != "" && got.String() != tt.wantPool {
				t.Errorf("pool %v, want %q", got, tt.wantPool)
			}
			if c.JobNetwork.Kind == "" {
				t.Error("kind has no default")
			}
			want := tt.wantLinger
			if !strings.Contains(tt.toml, "linger") {
				want = 30 * time.Second // the default
			}
			if c.JobNetwork.Linger.Duration != want {
				t.Errorf("linger %v, want %v", c.JobNetwork.Linger, want)
			}
		})
	}
}

func TestUnreachableNameservers(t *testing.T) {
	cluster := netip.MustParsePrefix("10.1.0.0/24")
	gw := netip.MustParseAddr("10.1.0.1")
	for _, tc := range []struct {
		name, resolv string
		gateway      netip.Addr
		want         []string // in the error, in order; none: nil
	}{
		{"on the cluster network", "nameserver 10.1.0.53\n", netip.Addr{}, nil},
		{"beyond it through the gateway", "# comment\nsearch cluster\nnameserver 10.9.9.9\noptions ndots:1\n", gw, nil},
		{"beyond it without a gateway", "nameserver 10.9.9.9\n", netip.Addr{}, []string{"10.9.9.9 is outside the cluster network 10.1.0.0/24", "set it to the router"}},
		{"a local stub resolver", "nameserver 127.0.0.53\n", gw, []string{"127.0.0.53 is on loopback"}},
		{"IPv6 loopback", "nameserver ::1\n", gw, []string{"::1 is on loopback"}},
		{"IPv4-mapped", "nameserver ::ffff:10.1.0.53\n", netip.Addr{}, nil},
		{"IPv6", "nameserver 2001:db8::53\n", gw, []string{"2001:db8::53: job networks have IPv4 only"}},
		{"scoped IPv6", "nameserver fe80::1%eth0\n", gw, []string{"fe80::1%eth0", "IPv4 only"}},
		{"not an address", "nameserver resolver.example\n", gw, []string{"resolver.example: not an address"}},
		{"each one named", "nameserver 127.0.0.53\nnameserver 10.1.0.53\nnameserver 10.9.9.9\n", netip.Addr{}, []string{"127.0.0.53", "10.9.9.9"}},
		{"no nameserver", "search cluster\n", netip.Addr{}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := unreachableNameservers([]byte(tc.resolv), cluster, tc.gateway)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("unreachableNameservers: %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("unreachableNameservers: nil, want %q", tc.want)
			}
			msg := err.Error()
			for _, w := range tc.want {
				i := strings.Index(msg, w)
				if i < 0 {
					t.Fatalf("error %q does not say %q (in order: %q)", err, w, tc.want)
				}
				msg = msg[i+len(w):]
			}
		})
	}
}

// A lingering network is removed when its wait ends, unless a new copy of the job took its name over
// first: then the new copy's claim removes the old network, once, and the wait's end leaves the name alone.
