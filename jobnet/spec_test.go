package jobnet

import (
	"net/netip"
	"strings"
	"testing"
)

func TestSpecValidate(t *testing.T) {
	ok := Spec{Name: "job-1", Parent: "eth0", Kind: IPVlan, Addr: netip.MustParsePrefix("10.1.2.3/24")}
	tests := []struct {
		name    string
		edit    func(*Spec)
		wantErr string
	}{
		{"minimal", func(*Spec) {}, ""},
		{"macvlan with gateway", func(s *Spec) { s.Kind = MACVlan; s.Gateway = netip.MustParseAddr("10.1.2.1") }, ""},
		{"slash in name", func(s *Spec) { s.Name = "../etc" }, "only letters"},
		{"dot-dot name", func(s *Spec) { s.Name = ".." }, "not a name"},
		{"empty name", func(s *Spec) { s.Name = "" }, "want 1 to 64"},
		{"long name", func(s *Spec) { s.Name = strings.Repeat("a", 65) }, "want 1 to 64"},
		{"no parent", func(s *Spec) { s.Parent = "" }, "parent"},
		{"long parent", func(s *Spec) { s.Parent = "abcdefghijklmnop" }, "parent"},
		{"bad ifname", func(s *Spec) { s.IfName = "a/b" }, "job interface"},
		{"unknown kind", func(s *Spec) { s.Kind = "veth" }, "kind"},
		{"no address", func(s *Spec) { s.Addr = netip.Prefix{} }, "IPv4"},
		{"ipv6", func(s *Spec) { s.Addr = netip.MustParsePrefix("fd00::1/64") }, "IPv4"},
		{"loopback", func(s *Spec) { s.Addr = netip.MustParsePrefix("127.0.0.2/8") }, "unicast"},
		{"network address", func(s *Spec) { s.Addr = netip.MustParsePrefix("10.1.2.0/24") }, "network or broadcast"},
		{"broadcast address", func(s *Spec) { s.Addr = netip.MustParsePrefix("10.1.2.255/24") }, "network or broadcast"},
		{"/32 is fine", func(s *Spec) { s.Addr = netip.MustParsePrefix("10.1.2.0/32") }, ""},
		{"gateway outside", func(s *Spec) { s.Gateway = netip.MustParseAddr("10.9.9.1") }, "gateway"},
		{"gateway is self", func(s *Spec) { s.Gateway = netip.MustParseAddr("10.1.2.3") }, "gateway"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := ok
			tt.edit(&s)
			got, err := s.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				if got.IfName == "" {
					t.Fatalf("IfName not defaulted")
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Validate error %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestTempLinkName(t *testing.T) {
	for _, name := range []string{"a", "job-1", strings.Repeat("x", maxNameLen)} {
		n := tempLinkName(name)
		if err := validIfName(n); err != nil {
			t.Errorf("tempLinkName(%q) = %q: %v", name, n, err)
		}
		if n != tempLinkName(name) {
			t.Errorf("tempLinkName(%q) not stable", name)
		}
	}
	if tempLinkName("job-1") == tempLinkName("job-2") {
		t.Errorf("different jobs share a temporary interface name")
	}
}

func TestBroadcast(t *testing.T) {
	for _, tt := range []struct{ p, want string }{
		{"10.1.2.3/24", "10.1.2.255"}, {"10.1.2.3/16", "10.1.255.255"}, {"10.1.2.3/30", "10.1.2.3"}, {"10.1.2.3/32", "10.1.2.3"},
	} {
		if got := broadcast(netip.MustParsePrefix(tt.p)); got.String() != tt.want {
			t.Errorf("broadcast(%s) = %s, want %s", tt.p, got, tt.want)
		}
	}
}
