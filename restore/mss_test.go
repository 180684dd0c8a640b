//go:build linux

package restore

import (
	"encoding/json"
	"net"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/lab/labtest"
)

// TestLowerPathMTU checks the route edits around a restore: every unicast
// route of eth0 loses one byte of MTU with its advmss pinned, the initial
// window SetInitCwnd set is kept, the put-back returns each route's own MTU
// (none, or an explicit one) even after another change to the routes, an
// overlapping call does not lower twice and either put-back restores the
// routes, and a route changed since the lowering is left as it is.
func TestLowerPathMTU(t *testing.T) {
	l := labtest.New(t, 1, 0)
	if err := l.Do("node1", func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		// A route with an MTU of its own, as a site may have for a tunnel.
		_, dst, _ := net.ParseCIDR("10.99.0.0/24")
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK, MTU: 1400}); err != nil {
			return err
		}
		if _, err := SetInitCwnd("eth0", 30); err != nil {
			return err
		}
		type want struct{ mtu, advMSS, initCwnd int }
		check := func(when string, wants map[string]want) {
			t.Helper()
			routes, err := netlink.RouteList(eth0, netlink.FAMILY_V4)
			if err != nil {
				t.Fatal(err)
			}
			seen := 0
			for _, r := range routes {
				w, ok := wants[r.Dst.String()]
				if !ok || r.Type != unix.RTN_UNICAST {
					continue
				}
				seen++
				if r.MTU != w.mtu || r.AdvMSS != w.advMSS || r.InitCwnd != w.initCwnd {
					t.Errorf("%s: route %v has mtu %d advmss %d initcwnd %d, want %d %d %d", when, r.Dst, r.MTU, r.AdvMSS, r.InitCwnd, w.mtu, w.advMSS, w.initCwnd)
				}
			}
			if seen != len(wants) {
				t.Errorf("%s: found %d of the routes %v", when, seen, wants)
			}
		}
		h, err := l.Host("node1")
		if err != nil {
			return err
		}
		subnet := h.Addr.Masked().String()

		lowered, err := LowerPathMTU("eth0")
		if err != nil {
			return err
		}
		check("lowered", map[string]want{subnet: {1499, 1460, 30}, "10.99.0.0/24": {1399, 1360, 30}})
		// An overlapping restore (or one after an agent died before its put-back) does not lower them
		// again, and whichever put-back runs first restores them.
		lowered2, err := LowerPathMTU("eth0")
		if err != nil {
			return err
		}
		check("lowered twice", map[string]want{subnet: {1499, 1460, 30}, "10.99.0.0/24": {1399, 1360, 30}})
		// The second put-back as an agent restarted after a crash runs it, from what its predecessor kept.
		if err := kept(t, lowered2).PutBack(); err != nil {
			return err
		}
		check("second put-back", map[string]want{subnet: {0, 0, 30}, "10.99.0.0/24": {1400, 0, 30}})
		// The agent raises the window again while the routes are lowered.
		if _, err := SetInitCwnd("eth0", 40); err != nil {
			return err
		}
		for range 2 { // idempotent
			if err := lowered.PutBack(); err != nil {
				return err
			}
			check("put back", map[string]want{subnet: {0, 0, 40}, "10.99.0.0/24": {1400, 0, 40}})
		}
		// A route changed since is left as it is now.
		again, err := LowerPathMTU("eth0")
		if err != nil {
			return err
		}
		if err := netlink.RouteReplace(&netlink.Route{LinkIndex: eth0.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK, MTU: 1300}); err != nil {
			return err
		}
		if err := again.PutBack(); err != nil {
			return err
		}
		check("changed since", map[string]want{subnet: {0, 0, 40}, "10.99.0.0/24": {1300, 0, 0}})
		if _, err := LowerPathMTU("nonexistent0"); err == nil {
			t.Error("LowerPathMTU accepted a missing interface")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// kept is e as a daemon restarted after a crash reads it back from what its predecessor kept on disk.
func kept(t *testing.T, e RouteEdit) RouteEdit {
	t.Helper()
	b, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	var k RouteEdit
	if err := json.Unmarshal(b, &k); err != nil {
		t.Fatal(err)
	}
	return k
}
