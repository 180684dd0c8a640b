package lab

import (
	"net/netip"
	"strings"
	"testing"
)

func TestNewPlan(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
		check   func(t *testing.T, p Plan)
	}{
		{
			name: "defaults",
			cfg:  Config{Nodes: 3, Spares: 1},
			check: func(t *testing.T, p Plan) {
				want := []struct{ name, addr, ns, veth string }{
					{"node1", "10.201.0.11/24", "node1", "ftlab-n1"},
					{"node2", "10.201.0.12/24", "node2", "ftlab-n2"},
					{"node3", "10.201.0.13/24", "node3", "ftlab-n3"},
					{"spare1", "10.201.0.101/24", "spare1", "ftlab-s1"},
				}
				if len(p.Hosts) != len(want) {
					t.Fatalf("got %d hosts, want %d", len(p.Hosts), len(want))
				}
				for i, w := range want {
					h := p.Hosts[i]
					if h.Name != w.name || h.Addr.String() != w.addr || h.Namespace != w.ns || h.Veth != w.veth {
						t.Errorf("host %d = %+v, want %+v", i, h, w)
					}
				}
				if p.Bridge != "ftlab-br" || p.ID != DefaultID {
					t.Errorf("bridge %q id %q", p.Bridge, p.ID)
				}
			},
		},
		{
			name: "other id prefixes namespaces, subnet is masked",
			cfg:  Config{ID: "t1", Nodes: 1, Spares: 2, Subnet: netip.MustParsePrefix("10.9.8.7/16")},
			check: func(t *testing.T, p Plan) {
				if p.Subnet.String() != "10.9.0.0/16" {
					t.Errorf("subnet %s", p.Subnet)
				}
				if h := p.Hosts[0]; h.Namespace != "t1-node1" || h.Addr.String() != "10.9.0.11/16" {
					t.Errorf("node1 = %+v", h)
				}
				if h := p.Hosts[2]; h.Name != "spare2" || h.Addr.String() != "10.9.0.102/16" || h.Role != RoleSpare {
					t.Errorf("spare2 = %+v", h)
				}
			},
		},
		{
			name: "largest lab fits in a /24",
			cfg:  Config{Nodes: maxNodes, Spares: maxSpares},
			check: func(t *testing.T, p Plan) {
				seen := map[netip.Addr]bool{}
				for _, h := range p.Hosts {
					if seen[h.Addr.Addr()] {
						t.Fatalf("address %s planned twice", h.Addr)
					}
					seen[h.Addr.Addr()] = true
					if !p.Subnet.Contains(h.Addr.Addr()) || h.Addr.Addr() == netip.MustParseAddr("10.201.0.255") {
						t.Fatalf("address %s outside usable subnet", h.Addr)
					}
					if len(h.Veth) > 15 {
						t.Fatalf("veth name %q longer than IFNAMSIZ-1", h.Veth)
					}
				}
			},
		},
		{name: "no nodes", cfg: Config{Nodes: 0}, wantErr: "lab nodes 0"},
		{name: "too many nodes", cfg: Config{Nodes: maxNodes + 1}, wantErr: "use 1 to 89"},
		{name: "negative spares", cfg: Config{Nodes: 1, Spares: -1}, wantErr: "lab spares"},
		{name: "too many spares", cfg: Config{Nodes: 1, Spares: maxSpares + 1}, wantErr: "lab spares"},
		{name: "bad id", cfg: Config{ID: "Lab-1", Nodes: 1}, wantErr: "lab id"},
		{name: "long id", cfg: Config{ID: "abcdefghi", Nodes: 1}, wantErr: "lab id"},
		{name: "ipv6", cfg: Config{Nodes: 1, Subnet: netip.MustParsePrefix("fd00::/64")}, wantErr: "only IPv4"},
		{name: "too small", cfg: Config{Nodes: 1, Subnet: netip.MustParsePrefix("10.1.1.0/25")}, wantErr: "/8 and /24"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := NewPlan(tt.cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to mention %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, p)
		})
	}
}

func TestPlanHost(t *testing.T) {
	p, err := NewPlan(Config{Nodes: 2, Spares: 1})
	if err != nil {
		t.Fatal(err)
	}
	if h, err := p.Host("spare1"); err != nil || h.Role != RoleSpare {
		t.Fatalf("Host(spare1) = %+v, %v", h, err)
	}
	_, err = p.Host("node9")
	if err == nil || !strings.Contains(err.Error(), "node1, node2, spare1") {
		t.Fatalf("Host(node9) error %v should list the hosts", err)
	}
}

func TestStateStore(t *testing.T) {
	s := stateStore{dir: t.TempDir()}
	if _, err := s.load("x"); err == nil {
		t.Fatal("load of a missing lab succeeded")
	}
	for _, id := range []string{"b", "a"} {
		p, err := NewPlan(Config{ID: id, Nodes: 1})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.locked(func() error { return s.save(State{Plan: p, Phase: PhaseCreating}) }); err != nil {
			t.Fatal(err)
		}
	}
	all, err := s.all()
	if err != nil || len(all) != 2 || all[0].ID != "a" || all[1].Hosts[0].Namespace != "b-node1" {
		t.Fatalf("all() = %+v, %v", all, err)
	}
	if err := s.remove("a"); err != nil {
		t.Fatal(err)
	}
	if err := s.remove("a"); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if all, _ := s.all(); len(all) != 1 {
		t.Fatalf("after remove: %d labs", len(all))
	}
}
