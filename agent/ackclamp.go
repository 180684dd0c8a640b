package agent

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/ftkit/ftkit/ackclamp"
	"github.com/vishvananda/netlink"
)

// pinDir is where this agent pins the eBPF objects that must outlive it. The node name is in the default:
// the hosts of a lab share one bpffs.
func pinDir(c Config) string {
	if c.BPFPinDir != "" {
		return c.BPFPinDir
	}
	return filepath.Join(ackclamp.DefaultBPFFS, "ftkit", c.Name)
}

// openAckClamp opens the ACK clamp pinned in the agent's pin directory, so that the flows of restored
// sockets keep their ACK clock when this process dies and the next agent finds them. Without a bpffs it
// falls back to a clamp that lives as long as the process.
func (a *Agent) openAckClamp() (*ackclamp.Clamp, error) {
	dir := filepath.Join(pinDir(a.cfg), "ackclamp")
	var err error
	if root := ackclamp.DefaultBPFFS; strings.HasPrefix(dir, root+"/") {
		err = ackclamp.MountBPFFS(root)
	}
	var c *ackclamp.Clamp
	if err == nil {
		c, err = ackclamp.OpenPinned(dir)
	}
	if err == nil {
		return c, nil
	}
	a.log.Warn("ACK clamp not pinned: restored sockets lose it if this agent dies during their replay", "dir", dir, "err", err)
	c, lerr := ackclamp.Load()
	if lerr != nil {
		return nil, fmt.Errorf("%w (pinned: %v)", lerr, err)
	}
	return c, nil
}

// closeAckClamp closes the clamp when the agent stops. Pinned objects stay while a restored flow is still
// registered (its replay goes on without the agent); with none left they are unpinned, so nothing stays
// attached to the host's interfaces.
func (a *Agent) closeAckClamp() {
	flows, err := a.clamp.Flows()
	if err == nil && len(flows) == 0 {
		err = a.clamp.Unpin()
	} else if err == nil {
		a.log.Info("ACK clamp stays attached for restored sockets still re-sending", "flows", len(flows), "dir", a.clamp.PinDir())
	}
	if err != nil {
		a.log.Warn("ACK clamp", "err", err)
	}
	if err := a.clamp.Close(); err != nil {
		a.log.Warn("close ACK clamp", "err", err)
	}
}

// startAckClamp loads the ACK clamp and attaches it to the cluster interface, and to loopback for jobs
// restored on the host of their peer (basic mode).
func (a *Agent) startAckClamp() error {
	c, err := a.openAckClamp()
	if err != nil {
		return err
	}
	iface, _, err := hostInterface(a.cfg.Cluster.Listen.Addr())
	for _, name := range []string{iface, "lo"} {
		if err != nil {
			break
		}
		var l netlink.Link
		if l, err = netlink.LinkByName(name); err == nil {
			err = c.Attach(l.Attrs().Index)
		}
	}
	if err != nil {
		c.Close()
		return err
	}
	a.clamp = c
	return nil
}
