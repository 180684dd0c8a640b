//go:build linux

package jobnet

import (
	"context"
	"net/netip"
	"os"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/ftkit/ftkit/lab/labtest"
)

// labJobNet is the spec of a macvlan job network on node1 of a new one-host lab, named after the lab and
// suffix, with host number host of the lab's subnet; the network is deleted, pass or fail.
func labJobNet(t *testing.T, suffix string, host byte) Spec {
	t.Helper()
	l := labtest.New(t, 1, 0)
	parentPath, err := l.NetnsPath("node1")
	if err != nil {
		t.Fatal(err)
	}
	b := l.State().Subnet.Masked().Addr().As4()
	b[3] = host
	s := Spec{Name: l.State().ID + "-" + suffix, Parent: "eth0", Kind: MACVlan, ParentNetns: parentPath,
		Addr: netip.PrefixFrom(netip.AddrFrom4(b), l.State().Subnet.Bits())}
	b[3] = 1
	s.Gateway = netip.AddrFrom4(b) // no host there: the route is on-link, which is all Create sets up
	t.Cleanup(func() {
		if err := Delete(context.Background(), s.Name, s.ParentNetns); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return s
}

// TestCreateAfterCrash: what an agent crashing inside Create can leave behind (a plain file where the
// namespace's mount should be, the interface still under its temporary name on the parent, a stale address)
// does not stop the next Create, which leaves exactly the job's network (one address, one default route via
// the gateway); Delete then removes it all.
func TestCreateAfterCrash(t *testing.T) {
	ctx := context.Background()
	s := labJobNet(t, "crash", 201)
	pns, err := netns.GetFromPath(s.ParentNetns)
	if err != nil {
		t.Fatal(err)
	}
	defer pns.Close()
	ph, err := netlink.NewHandleAt(pns)
	if err != nil {
		t.Fatal(err)
	}
	defer ph.Close()
	parent, err := ph.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	// The leftovers.
	if err := os.WriteFile(Path(s.Name), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tmp := &netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: tempLinkName(s.Name), ParentIndex: parent.Attrs().Index}, Mode: netlink.MACVLAN_MODE_BRIDGE}
	if err := ph.LinkAdd(tmp); err != nil {
		t.Fatal(err)
	}

	if err := Create(ctx, s); err != nil {
		t.Fatalf("create over the leftovers: %v", err)
	}
	if _, err := ph.LinkByName(tempLinkName(s.Name)); err == nil {
		t.Errorf("the temporary interface %s is still on the parent", tempLinkName(s.Name))
	}
	// A stale address on the job's interface is replaced by the job's.
	job, err := netns.GetFromPath(Path(s.Name))
	if err != nil {
		t.Fatal(err)
	}
	defer job.Close()
	jh, err := netlink.NewHandleAt(job)
	if err != nil {
		t.Fatal(err)
	}
	defer jh.Close()
	lk, err := jh.LinkByName(DefaultIfName)
	if err != nil {
		t.Fatal(err)
	}
	stale, _ := netlink.ParseAddr("192.0.2.7/24")
	if err := jh.AddrAdd(lk, stale); err != nil {
		t.Fatal(err)
	}
	if err := Create(ctx, s); err != nil {
		t.Fatalf("create again: %v", err)
	}
	addrs, err := jh.AddrList(lk, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	if len(addrs) != 1 || addrs[0].IPNet.String() != s.Addr.String() {
		t.Errorf("addresses %v after Create, want only %v", addrs, s.Addr)
	}
	routes, err := jh.RouteList(lk, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	var gw []string
	for _, r := range routes {
		if r.Dst == nil || r.Dst.IP.IsUnspecified() {
			gw = append(gw, r.Gw.String())
		}
	}
	if len(gw) != 1 || gw[0] != s.Gateway.String() {
		t.Errorf("default routes via %v, want one via %v", gw, s.Gateway)
	}
	// A job network of another kind under the same name is refused, not silently reused.
	other := s
	other.Kind = IPVlan
	if err := Create(ctx, other); err == nil {
		t.Errorf("Create of an ipvlan job network over a macvlan one succeeded")
	}

	if err := Delete(ctx, s.Name, s.ParentNetns); err != nil {
		t.Fatal(err)
	}
	if ok, err := Exists(s.Name); err != nil || ok {
		t.Errorf("Exists = %v, %v after Delete", ok, err)
	}
}

// TestDeleteRacingAnotherDelete: a job network removed by another deleter after Delete found it (the agent
// removing a finished job's network while a cleanup of the same network runs) is deleted, not an error.
// Until 2026-12-01 Delete failed with "open namespace: no such file or directory" (ci181, a test's cleanup
// racing the agents after TestTaskFarmAutoRollback's run ended).
func TestDeleteRacingAnotherDelete(t *testing.T) {
	ctx := context.Background()
	s := labJobNet(t, "race", 202)
	if err := Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	other := func() {
		if err := Delete(ctx, s.Name, s.ParentNetns); err != nil {
			t.Errorf("the other deleter: %v", err)
		}
	}
	if err := deleteNet(ctx, s.Name, s.ParentNetns, other); err != nil {
		t.Errorf("Delete of a job network another deleter removed meanwhile: %v", err)
	}
	if ok, err := Exists(s.Name); err != nil || ok {
		t.Errorf("Exists = %v, %v after both deletes", ok, err)
	}
}
