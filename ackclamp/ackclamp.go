// Package ackclamp is an eBPF actuator: it rewrites the ACK numbers of the peers' segments of restored
// sockets that re-send bytes their peers already have (bpf/ackclamp.c). It changes packets, which is why
// it is not among the probes of ebpfprobes, which only observe them.
//
// It needs root (CAP_BPF, CAP_NET_ADMIN) and Linux 6.6+ (TCX).
package ackclamp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/internal/rootpath"
	"github.com/ftkit/ftkit/tcpflow"
)

//go:generate go tool bpf2go -tags linux -target bpfel -type clamp_key -type clamp_state -type hold_args ackclamp ../bpf/ackclamp.c -- -Wall -Werror

// Clamp lets restored sockets re-send bytes their peers already have: for each registered flow it lowers
// the ACK number of the peer's segments to what the restored socket has sent so far, so that the socket's
// ACK clock works instead of dropping every segment as an "ACK of unsent data" (bpf/ackclamp.c says why).
//
// A clamp opened with OpenPinned keeps its map and TCX links pinned in a bpffs directory, so that
// it outlives the process: a restored socket whose agent dies mid-replay keeps its ACK clock, and the next
// agent re-opens the same map (with its flows) and links instead of attaching a second copy.
type Clamp struct {
	objs   ackclampObjects
	pinDir string // "" for a clamp that lives only as long as its file descriptors
	mu     sync.Mutex
	links  []link.Link
}

// Load loads the programs; Attach puts them on an interface.
func Load() (*Clamp, error) {
	var c Clamp
	if err := loadAckclampObjects(&c.objs, nil); err != nil {
		return nil, fmt.Errorf("ackclamp: load eBPF programs: %w", err)
	}
	return &c, nil
}

// OpenPinned loads the programs with their map pinned in dir (on a bpffs, created 0700 if
// missing; it and every directory above it must be root's alone, checkPinDir), re-using the map a
// previous process pinned there together with the flows it holds. Attach then re-uses the links
// pinned there. A pinned map without flows is stale: it and its links are unpinned
// and the clamp starts afresh.
func OpenPinned(dir string) (*Clamp, error) {
	// The part that exists is checked before root makes anything in it (MkdirAll would follow a user's
	// link there), and the whole once made.
	if err := checkPinDir(rootpath.ExistingPart(dir), false); err != nil {
		return nil, fmt.Errorf("ackclamp: pin directory %s is not root's alone: %w", dir, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("ackclamp: create pin directory: %w", err)
	}
	if err := checkPinDir(dir, true); err != nil {
		return nil, fmt.Errorf("ackclamp: pin directory %s is not root's alone: %w", dir, err)
	}
	if ok, err := IsBPFFS(dir); err != nil || !ok {
		return nil, fmt.Errorf("ackclamp: pin directory %s is not on a BPF file system (mount one with `mount -t bpf bpf %s`): %v", dir, DefaultBPFFS, err)
	}
	spec, err := loadAckclamp()
	if err != nil {
		return nil, fmt.Errorf("ackclamp: %w", err)
	}
	spec.Maps[ackclampMapClamps].Pinning = ebpf.PinByName
	c := Clamp{pinDir: dir}
	err = spec.LoadAndAssign(&c.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}})
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		// Pinned by an agent of another version (the flows' layout changed). With no flow in it, nothing
		// needs it: its pins go and the clamp starts afresh.
		if rerr := c.removeStale(); rerr != nil {
			return nil, fmt.Errorf("ackclamp: the map pinned in %s is from an incompatible version (%v); once no restored job re-sends bytes, remove that directory: %w", dir, err, rerr)
		}
		err = spec.LoadAndAssign(&c.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}})
	}
	if err != nil {
		return nil, fmt.Errorf("ackclamp: load eBPF programs: %w", err)
	}
	flows, err := c.Flows()
	if err == nil && len(flows) == 0 {
		err = c.unpinLinks()
	}
	if err != nil {
		c.objs.Close()
		return nil, err
	}
	return &c, nil
}

// PinDir is where the clamp's objects are pinned ("" if they are not).
func (c *Clamp) PinDir() string { return c.pinDir }

func (c *Clamp) linkPin(ifname string, at ebpf.AttachType) string {
	dir := "ingress"
	if at == ebpf.AttachTCXEgress {
		dir = "egress"
	}
	return filepath.Join(c.pinDir, "link_"+ifname+"_"+dir)
}

// reopenLink returns the link pinned at path if it is still attached to ifindex in direction at; a pin
// that is not (its interface was deleted, or the index now names another one) is removed.
func reopenLink(path string, ifindex int, at ebpf.AttachType) (link.Link, error) {
	lk, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		// Not a link we can use: unpin it so that a fresh one can take its place.
		if rerr := os.Remove(path); rerr != nil {
			return nil, fmt.Errorf("ackclamp: pinned link %s: %w (and removing it: %v)", path, err, rerr)
		}
		return nil, nil
	}
	if info, err := lk.Info(); err == nil {
		if t := info.TCX(); t != nil && int(t.Ifindex) == ifindex && uint32(t.AttachType) == uint32(at) {
			return lk, nil
		}
	}
	err = lk.Unpin()
	lk.Close()
	if err != nil {
		return nil, fmt.Errorf("ackclamp: unpin stale link %s: %w", path, err)
	}
	return nil, nil
}

// Attach attaches the egress and ingress programs to the interface with this index in the calling thread's
// network namespace. A pinned clamp re-uses the links already pinned for the interface, and pins new ones.
func (c *Clamp) Attach(ifindex int) error {
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
		lk, err := c.attachOne(ifindex, nl.Attrs().Name, a.prog, a.at)
		if err != nil {
			for _, l := range links {
				l.Close() // a pinned one stays, for the next Attach to re-use
			}
			return err
		}
		links = append(links, lk)
	}
	c.mu.Lock()
	c.links = append(c.links, links...)
	c.mu.Unlock()
	return nil
}

func (c *Clamp) attachOne(ifindex int, ifname string, prog *ebpf.Program, at ebpf.AttachType) (link.Link, error) {
	var pin string
	if c.pinDir != "" {
		pin = c.linkPin(ifname, at)
		lk, err := reopenLink(pin, ifindex, at)
		if err != nil || lk != nil {
			return lk, err
		}
	}
	lk, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: at, Anchor: link.Head()})
	if err != nil {
		return nil, fmt.Errorf("ackclamp: attach TCX %v to %s (needs Linux 6.6+): %w", at, ifname, err)
	}
	if pin != "" {
		if err := lk.Pin(pin); err != nil {
			lk.Close()
			return nil, fmt.Errorf("ackclamp: pin TCX link %v of %s in %s: %w", at, ifname, c.pinDir, err)
		}
	}
	return lk, nil
}

// clampKey is the map key of a flow: the IPv4 addresses and ports as the program reads them from the
// headers (network byte order, loaded as native little-endian integers). f.Local is the restored end.
func clampKey(f tcpflow.Tuple) (ackclampClampKey, error) {
	src, dst := f.Local.Addr().Unmap(), f.Remote.Addr().Unmap()
	if !src.Is4() || !dst.Is4() {
		return ackclampClampKey{}, fmt.Errorf("ackclamp: flow %v: only IPv4 flows are clamped", f)
	}
	s, d := src.As4(), dst.As4()
	return ackclampClampKey{
		Saddr: binary.NativeEndian.Uint32(s[:]),
		Daddr: binary.NativeEndian.Uint32(d[:]),
		Sport: htons(f.Local.Port()),
		Dport: htons(f.Remote.Port()),
	}, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// Clamp registers a restored socket's flow (Local is the restored end) with the sequence number it has sent
// up to at the restore (the snapshot's snd_una is always safe: the peer has everything below it).
func (c *Clamp) Clamp(f tcpflow.Tuple, sndNxt uint32) error {
	k, err := clampKey(f)
	if err != nil {
		return err
	}
	if err := c.objs.Clamps.Put(k, ackclampClampState{SndNxt: sndNxt}); err != nil {
		return fmt.Errorf("ackclamp: register flow %v->%v: %w", f.Local, f.Remote, err)
	}
	return nil
}

// Hold makes the clamp drop (on) or pass (off) the payload segments the peer sends on a registered flow,
// all but those marked as injected (restore.InjectedMark): while a replay delivers the peer's logged bytes
// itself, the peer's retransmissions of them must not overtake it. The peer's ACKs always pass. The flag is
// set in the kernel (ackclamp_hold), leaving what the TCX programs update meanwhile as they made it.
func (c *Clamp) Hold(f tcpflow.Tuple, on bool) error {
	k, err := clampKey(f)
	if err != nil {
		return err
	}
	args := ackclampHoldArgs{Key: k}
	if on {
		args.On = 1
	}
	ret, err := c.objs.AckclampHold.Run(&ebpf.RunOptions{Context: args})
	if err == nil && ret != 0 {
		err = ebpf.ErrKeyNotExist
	}
	if err != nil {
		return fmt.Errorf("ackclamp: hold flow %v->%v: %w", f.Local, f.Remote, err)
	}
	return nil
}

// ClampState is what the clamp saw of one flow.
type ClampState struct {
	SndNxt  uint32 // the restored socket's highest sequence number sent
	Clamped uint64 // peer segments whose ACK was lowered
	Quieted uint64 // the restored socket's pure ACKs held back: below what the peer acknowledged, and nothing new
	Lifted  uint64 // the restored socket's pure ACKs below what the peer acknowledged, lifted to it: each acknowledged more
	// PeerTSval is the highest TSval of the peer's own segments (0: none seen, or the peer uses no
	// timestamps, or puts another option first): its TCP timestamp clock as last seen on the wire.
	PeerTSval uint32
}

func stateOf(v ackclampClampState) ClampState {
	return ClampState{SndNxt: v.SndNxt, Clamped: v.Clamped, Quieted: v.Quieted, Lifted: v.Lifted, PeerTSval: v.PeerTsval}
}

// State reads a registered flow's state.
func (c *Clamp) State(f tcpflow.Tuple) (ClampState, error) {
	k, err := clampKey(f)
	if err != nil {
		return ClampState{}, err
	}
	var v ackclampClampState
	if err := c.objs.Clamps.Lookup(k, &v); err != nil {
		return ClampState{}, fmt.Errorf("ackclamp: flow %v->%v: %w", f.Local, f.Remote, err)
	}
	return stateOf(v), nil
}

// Release stops clamping a flow and returns its last state.
func (c *Clamp) Release(f tcpflow.Tuple) (ClampState, error) {
	st, err := c.State(f)
	if err != nil {
		return st, err
	}
	k, _ := clampKey(f)
	if err := c.objs.Clamps.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return st, fmt.Errorf("ackclamp: release flow %v->%v: %w", f.Local, f.Remote, err)
	}
	return st, nil
}

// ClampedFlow is a registered flow and its state.
type ClampedFlow struct {
	Flow  tcpflow.Tuple
	State ClampState
}

// Flows lists the registered flows.
func (c *Clamp) Flows() ([]ClampedFlow, error) {
	var out []ClampedFlow
	var k ackclampClampKey
	var v ackclampClampState
	it := c.objs.Clamps.Iterate()
	for it.Next(&k, &v) {
		out = append(out, ClampedFlow{Flow: flowOfClampKey(k), State: stateOf(v)})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("ackclamp: list flows: %w", err)
	}
	return out, nil
}

// flowOfClampKey inverts clampKey: the key holds the addresses and ports in network byte order.
func flowOfClampKey(k ackclampClampKey) tcpflow.Tuple {
	addr := func(a uint32) netip.Addr {
		var b [4]byte
		binary.NativeEndian.PutUint32(b[:], a)
		return netip.AddrFrom4(b)
	}
	return tcpflow.Tuple{
		Local:  netip.AddrPortFrom(addr(k.Saddr), htons(k.Sport)),
		Remote: netip.AddrPortFrom(addr(k.Daddr), htons(k.Dport)),
	}
}

// removeStale removes the pins of a map of another layout, and of its links, if the map holds no flow.
func (c *Clamp) removeStale() error {
	path := filepath.Join(c.pinDir, ackclampMapClamps)
	m, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		return err
	}
	key := make([]byte, m.KeySize())
	err = m.NextKey(nil, &key)
	m.Close()
	if err == nil {
		return errors.New("it still holds flows")
	}
	if !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	if err := c.unpinLinks(); err != nil {
		return err
	}
	return os.Remove(path)
}

// unpinLinks removes every link pin of the directory; the links detach once no process holds them.
func (c *Clamp) unpinLinks() error {
	ents, err := os.ReadDir(c.pinDir)
	if err != nil {
		return fmt.Errorf("ackclamp: read pin directory: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if len(e.Name()) > 5 && e.Name()[:5] == "link_" {
			path := filepath.Join(c.pinDir, e.Name())
			// Detach at once: a link whose last reference goes with its pin is released later, by the
			// kernel's deferred work, and must not be found still attached by the next Attach.
			if lk, err := link.LoadPinnedLink(path, nil); err == nil {
				if err := lk.Detach(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
					errs = append(errs, fmt.Errorf("ackclamp: detach %s: %w", e.Name(), err))
				}
				lk.Close()
			}
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, fmt.Errorf("ackclamp: unpin %s: %w", e.Name(), err))
			}
		}
	}
	return errors.Join(errs...)
}

// Unpin removes the clamp's pins and its pin directory, so that the programs detach and the map is freed
// when this process closes them. Call it only when no flow is registered any more.
func (c *Clamp) Unpin() error {
	if c.pinDir == "" {
		return nil
	}
	errs := []error{c.unpinLinks()}
	if err := c.objs.Clamps.Unpin(); err != nil {
		errs = append(errs, fmt.Errorf("ackclamp: unpin map: %w", err))
	}
	if err := os.Remove(c.pinDir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("ackclamp: remove pin directory: %w", err))
	}
	return errors.Join(errs...)
}

// Close detaches the programs and frees the maps, unless they are pinned: then they stay, with their flows,
// for the next process to re-open.
func (c *Clamp) Close() error {
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
