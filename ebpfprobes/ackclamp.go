package ebpfprobes

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

//go:generate go tool bpf2go -tags linux -target bpfel -type clamp_key -type clamp_state ackclamp ../bpf/ackclamp.c -- -Wall -Werror

// AckClamp lets restored sockets re-send bytes their peers already have: for each registered flow it lowers
// the ACK number of the peer's segments to what the restored socket has sent so far, so that the socket's
// ACK clock works instead of dropping every segment as an "ACK of unsent data" (bpf/ackclamp.c says why).
type AckClamp struct {
	objs  ackclampObjects
	mu    sync.Mutex
	links []link.Link
}

// LoadAckClamp loads the programs; Attach puts them on an interface.
func LoadAckClamp() (*AckClamp, error) {
	var c AckClamp
	if err := loadAckclampObjects(&c.objs, nil); err != nil {
		return nil, fmt.Errorf("ackclamp: load eBPF programs: %w", err)
	}
	return &c, nil
}

// Attach attaches the egress and ingress programs to the interface with this index in the calling thread's
// network namespace.
func (c *AckClamp) Attach(ifindex int) error {
	nl, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return fmt.Errorf("ackclamp: look up interface %d: %w", ifindex, err)
	}
	// Loopback frames carry a (zeroed) Ethernet header too: a job restored next to its peer talks to it
	// through lo.
	if t := nl.Attrs().EncapType; t != "ether" && t != "loopback" {
		return fmt.Errorf("ackclamp: interface %s has link type %q: only Ethernet and loopback devices are supported", nl.Attrs().Name, t)
	}
	var links []link.Link
	for _, a := range []struct {
		prog *ebpf.Program
		at   ebpf.AttachType
	}{{c.objs.AckclampEgress, ebpf.AttachTCXEgress}, {c.objs.AckclampIngress, ebpf.AttachTCXIngress}} {
		lk, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: a.prog, Attach: a.at, Anchor: link.Head()})
		if err != nil {
			for _, l := range links {
				l.Close()
			}
			return fmt.Errorf("ackclamp: attach TCX %v to %s (needs Linux 6.6+): %w", a.at, nl.Attrs().Name, err)
		}
		links = append(links, lk)
	}
	c.mu.Lock()
	c.links = append(c.links, links...)
	c.mu.Unlock()
	return nil
}

func clampKey(f Flow) (ackclampClampKey, error) {
	k, err := flowKey(f)
	if err != nil {
		return ackclampClampKey{}, err
	}
	return ackclampClampKey{Saddr: k.Saddr, Daddr: k.Daddr, Sport: k.Sport, Dport: k.Dport}, nil
}

// Clamp registers a restored socket's flow (Src is the restored end) with the sequence number it has sent
// up to at the restore (the snapshot's snd_una is always safe: the peer has everything below it).
func (c *AckClamp) Clamp(f Flow, sndNxt uint32) error {
	k, err := clampKey(f)
	if err != nil {
		return err
	}
	if err := c.objs.Clamps.Put(k, ackclampClampState{SndNxt: sndNxt}); err != nil {
		return fmt.Errorf("ackclamp: register flow %v->%v: %w", f.Src, f.Dst, err)
	}
	return nil
}

// ClampState is what the clamp saw of one flow.
type ClampState struct {
	SndNxt  uint32 // the restored socket's highest sequence number sent
	Clamped uint64 // peer segments whose ACK was lowered
}

// State reads a registered flow's state.
func (c *AckClamp) State(f Flow) (ClampState, error) {
	k, err := clampKey(f)
	if err != nil {
		return ClampState{}, err
	}
	var v ackclampClampState
	if err := c.objs.Clamps.Lookup(k, &v); err != nil {
		return ClampState{}, fmt.Errorf("ackclamp: flow %v->%v: %w", f.Src, f.Dst, err)
	}
	return ClampState{SndNxt: v.SndNxt, Clamped: v.Clamped}, nil
}

// Release stops clamping a flow and returns its last state.
func (c *AckClamp) Release(f Flow) (ClampState, error) {
	st, err := c.State(f)
	if err != nil {
		return st, err
	}
	k, _ := clampKey(f)
	if err := c.objs.Clamps.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return st, fmt.Errorf("ackclamp: release flow %v->%v: %w", f.Src, f.Dst, err)
	}
	return st, nil
}

// Close detaches the programs and frees the maps.
func (c *AckClamp) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for _, l := range c.links {
		errs = append(errs, l.Close())
	}
	c.links = nil
	errs = append(errs, c.objs.Close())
	return errors.Join(errs...)
}
