//go:build linux

package recovery

import (
	"encoding/json"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/restore"
)

// routeMetrics is what the route edits change on a route.
type routeMetrics struct{ initCwnd, initRwnd, mtu, advMSS int }

// routesOf returns the metrics of eth0's main-table unicast routes in the calling thread's namespace.
func routesOf(t *testing.T) map[string]routeMetrics {
	t.Helper()
	link, err := netlink.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	routes, err := netlink.RouteList(link, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]routeMetrics{}
	for _, r := range routes {
		if r.Type == unix.RTN_UNICAST && (r.Table == 0 || r.Table == unix.RT_TABLE_MAIN) {
			m[r.Dst.String()] = routeMetrics{r.InitCwnd, r.InitRwnd, r.MTU, r.AdvMSS}
		}
	}
	return m
}

// keeper is a RouteKeeper that notes the routes as they are when each edit is kept, and the edits as a
// restarted agent reads them back (JSON).
type keeper struct {
	t      *testing.T
	seen   []map[string]routeMetrics
	edits  []restore.RouteEdit
	undone int
}

func (k *keeper) Keep(netns string, edit restore.RouteEdit) func() {
	k.seen = append(k.seen, routesOf(k.t))
	b, err := json.Marshal(edit)
	if err != nil {
		k.t.Fatal(err)
	}
	var e restore.RouteEdit
	if err := json.Unmarshal(b, &e); err != nil {
		k.t.Fatal(err)
	}
	k.edits = append(k.edits, e)
	return func() { k.undone++ }
}

// TestRouteEditsKeptBeforeMade checks that HostNetwork keeps each route edit (the initial windows raised,
// the MTU lowered) before it changes any route: an agent killed between the change and its record left
// the routes changed for good, with nothing at its next start to put them back. The kept edits put the
// routes back as an agent restarted before the recovery's put-backs ran would, and the put-backs then
// find nothing to do and forget the edits.
func TestRouteEditsKeptBeforeMade(t *testing.T) {
	l := labtest.New(t, 1, 0)
	if err := l.Do("node1", func() error {
		before := routesOf(t)
		k := &keeper{t: t}
		n := HostNetwork{Iface: "eth0", Bits: 24, Routes: k}
		cwndPutBack, err := n.SetInitCwnd(64)
		if err != nil {
			return err
		}
		mtuPutBack, err := n.LowerPathMTU()
		if err != nil {
			return err
		}
		if len(k.seen) != 2 {
			t.Fatalf("%d edits kept, want 2", len(k.seen))
		}
		// The MTU's edit comes after the window's, made by then.
		for dst, m := range k.seen[0] {
			if m != before[dst] {
				t.Errorf("when the initial window's edit was kept, route %s had %+v, want its own %+v", dst, m, before[dst])
			}
		}
		for dst, m := range k.seen[1] {
			if m.mtu != before[dst].mtu || m.advMSS != before[dst].advMSS || m.initCwnd != 64 {
				t.Errorf("when the MTU's edit was kept, route %s had %+v, want its own MTU %d and the window 64", dst, m, before[dst].mtu)
			}
		}
		for dst, m := range routesOf(t) {
			if m.initCwnd != 64 || m.initRwnd != 64 || m.mtu != 1499 {
				t.Errorf("route %s has %+v after the edits, want initcwnd and initrwnd 64, MTU 1499", dst, m)
			}
		}

		// The agent's start-up put-back, in the order kept.
		for _, e := range k.edits {
			if err := PutBackEdit("", e); err != nil {
				return err
			}
		}
		for dst, m := range routesOf(t) {
			if m != before[dst] {
				t.Errorf("route %s has %+v after the kept edits were put back, want its own %+v", dst, m, before[dst])
			}
		}
		for _, putBack := range []func() error{mtuPutBack, cwndPutBack} {
			if err := putBack(); err != nil {
				return err
			}
		}
		if k.undone != 2 {
			t.Errorf("%d of the 2 kept edits forgotten after their put-backs", k.undone)
		}
		for dst, m := range routesOf(t) {
			if m != before[dst] {
				t.Errorf("route %s has %+v after the put-backs, want its own %+v", dst, m, before[dst])
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
