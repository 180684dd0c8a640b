//go:build linux

package jobnet

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
)

// TestCheckLink: an interface an earlier Create left in the job's namespace is taken only if it is what the
// spec asks for. One on another parent (job_network.parent changed between agent runs) was taken, and the
// job's address went on the old parent's network.
func TestCheckLink(t *testing.T) {
	s, err := Spec{Name: "ftj-test", Parent: "eth1", Kind: MACVlan, Addr: netip.MustParsePrefix("10.1.0.200/24")}.Validate()
	if err != nil {
		t.Fatal(err)
	}
	parent := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Name: "eth1", Index: 3}}
	for _, tt := range []struct {
		name string
		lk   netlink.Link
		want string // "" for taken
	}{
		{"the spec's", &netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: "eth0", ParentIndex: 3}}, ""},
		{"another kind", &netlink.IPVlan{LinkAttrs: netlink.LinkAttrs{Name: "eth0", ParentIndex: 3}}, "is a ipvlan"},
		{"another parent", &netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: "eth0", ParentIndex: 2}}, "index 2, want eth1"},
	} {
		err := checkLink(s, tt.lk, parent)
		if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("%s: checkLink = %v, want %q", tt.name, err, tt.want)
		}
	}
}
