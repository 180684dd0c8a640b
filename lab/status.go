package lab

import (
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// HostStatus is what a host looks like right now, read from the kernel rather than from the state file.
type HostStatus struct {
	Host
	Exists    bool           `json:"exists"`
	LinkUp    bool           `json:"link_up"`
	Addrs     []netip.Prefix `json:"addrs"` // every IPv4 address on eth0: more than one after an IP takeover
	Processes int            `json:"processes"`
}

// Status is a lab with the live state of each host.
type Status struct {
	ID     string       `json:"id"`
	Subnet netip.Prefix `json:"subnet"`
	Bridge string       `json:"bridge"`
	Phase  Phase        `json:"phase"`
	Hosts  []HostStatus `json:"hosts"`
	// Router is the lab's router (Plan.Router); nil for a lab started before routers existed.
	Router *HostStatus `json:"router,omitempty"`
	// SlurmConf is the lab's slurm.conf when it runs Slurm (clients need SLURM_CONF set to it).
	SlurmConf string `json:"slurm_conf,omitempty"`
}

// Status reads the live state of every host of the lab.
func (l *Lab) Status() Status {
	s := Status{ID: l.st.ID, Subnet: l.st.Subnet, Bridge: l.st.Bridge, Phase: l.st.Phase, SlurmConf: l.SlurmConf()}
	for _, h := range l.st.Hosts {
		s.Hosts = append(s.Hosts, hostStatus(h))
	}
	if l.st.Router.Namespace != "" {
		r := hostStatus(l.st.Router)
		s.Router = &r
	}
	return s
}

func hostStatus(h Host) HostStatus {
	hs := HostStatus{Host: h}
	p := NetnsPath(h.Namespace)
	if _, err := os.Stat(p); err != nil {
		return hs
	}
	hs.Exists = true
	if pids, err := PIDsInNetns(p); err == nil {
		hs.Processes = len(pids)
	}
	ns, err := netns.GetFromPath(p)
	if err != nil {
		return hs
	}
	defer ns.Close()
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		return hs
	}
	defer nh.Close()
	link, err := nh.LinkByName("eth0")
	if err != nil {
		return hs
	}
	hs.LinkUp = link.Attrs().OperState == netlink.OperUp
	addrs, err := nh.AddrList(link, netlink.FAMILY_V4)
	if err != nil {
		return hs
	}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP.To4())
		ones, _ := a.Mask.Size()
		hs.Addrs = append(hs.Addrs, netip.PrefixFrom(ip, ones))
	}
	return hs
}
