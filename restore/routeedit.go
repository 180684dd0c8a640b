//go:build linux

package restore

import (
	"errors"
	"fmt"
	"slices"

	"github.com/vishvananda/netlink"
)

// RouteEdit is what SetInitCwnd or LowerPathMTU changed on the routes of an interface, with what each
// route had: enough to put it back, in a form a daemon keeps on disk, so that one restarted after a crash
// between the change and its put-back still puts it back.
type RouteEdit struct {
	Iface string `json:"iface"`
	// InitCwnd are the routes whose initial windows SetInitCwnd raised.
	InitCwnd []RaisedRoute `json:"initcwnd,omitempty"`
	// MTU are the routes whose MTU LowerPathMTU lowered (or found lowered by another).
	MTU []LoweredRoute `json:"mtu,omitempty"`
}

// RaisedRoute is a route whose initial windows were raised: its own (0: the kernel's) and those set.
type RaisedRoute struct {
	Route   string `json:"route"` // routeKey
	Cwnd    int    `json:"cwnd"`
	Rwnd    int    `json:"rwnd"`
	SetCwnd int    `json:"set_cwnd"`
	SetRwnd int    `json:"set_rwnd"`
}

// LoweredRoute is a route whose MTU was lowered with its advmss pinned: its own metrics (0: none) and
// those set.
type LoweredRoute struct {
	Route     string `json:"route"` // routeKey
	MTU       int    `json:"mtu"`
	AdvMSS    int    `json:"advmss"`
	SetMTU    int    `json:"set_mtu"`
	SetAdvMSS int    `json:"set_advmss"`
}

// Empty says nothing was changed.
func (e RouteEdit) Empty() bool { return len(e.InitCwnd) == 0 && len(e.MTU) == 0 }

// Apply sets on each route of the edit what the edit sets (PlanInitCwnd, PlanLowerPathMTU), in the
// calling thread's network namespace; a route that has it already is left alone. With an error, the
// routes that could be set are; PutBack puts back those, and leaves the others as they are.
func (e RouteEdit) Apply() error {
	if e.Empty() {
		return nil
	}
	link, err := netlink.LinkByName(e.Iface)
	if err != nil {
		return fmt.Errorf("edit route metrics: find interface %s in this network namespace: %w", e.Iface, err)
	}
	return editRoutes(link, "set route metrics", func(r *netlink.Route) bool {
		changed := false
		if i := slices.IndexFunc(e.InitCwnd, func(w RaisedRoute) bool { return w.Route == routeKey(*r) }); i >= 0 {
			w := e.InitCwnd[i]
			changed = r.InitCwnd != w.SetCwnd || r.InitRwnd != w.SetRwnd
			r.InitCwnd, r.InitRwnd = w.SetCwnd, w.SetRwnd
		}
		if i := slices.IndexFunc(e.MTU, func(m LoweredRoute) bool { return m.Route == routeKey(*r) }); i >= 0 {
			m := e.MTU[i]
			changed = changed || r.MTU != m.SetMTU || r.AdvMSS != m.SetAdvMSS
			r.MTU, r.AdvMSS = m.SetMTU, m.SetAdvMSS
		}
		return changed
	})
}

// PutBack returns each changed route to what it had, unless it changed since (put back already, or by an
// operator). It is idempotent, and acts on the calling thread's network namespace.
func (e RouteEdit) PutBack() error {
	if e.Empty() {
		return nil
	}
	link, err := netlink.LinkByName(e.Iface)
	if err != nil {
		return fmt.Errorf("put back route metrics: find interface %s in this network namespace: %w", e.Iface, err)
	}
	var errs []error
	if len(e.InitCwnd) > 0 {
		errs = append(errs, editRoutes(link, "put back initcwnd", func(r *netlink.Route) bool {
			i := slices.IndexFunc(e.InitCwnd, func(w RaisedRoute) bool { return w.Route == routeKey(*r) })
			if i < 0 || r.InitCwnd != e.InitCwnd[i].SetCwnd || r.InitRwnd != e.InitCwnd[i].SetRwnd {
				return false // put back already, or changed since
			}
			r.InitCwnd, r.InitRwnd = e.InitCwnd[i].Cwnd, e.InitCwnd[i].Rwnd
			return true
		}))
	}
	if len(e.MTU) > 0 {
		err := editRoutes(link, "put back path MTU", func(r *netlink.Route) bool {
			i := slices.IndexFunc(e.MTU, func(m LoweredRoute) bool { return m.Route == routeKey(*r) })
			if i < 0 || r.MTU != e.MTU[i].SetMTU || r.AdvMSS != e.MTU[i].SetAdvMSS {
				return false // put back already, or changed since
			}
			r.MTU, r.AdvMSS = e.MTU[i].MTU, e.MTU[i].AdvMSS
			return true
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("put back path MTU (restored sockets may keep sending 524-byte segments): %w", err))
		}
	}
	return errors.Join(errs...)
}
