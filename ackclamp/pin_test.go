package ackclamp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/tcpframe"
	"github.com/ftkit/ftkit/tcpflow"
)

// pinFixture mounts a private BPF file system (a mount is an instance of its own, so nothing is shared
// with other tests or agents) and creates a dummy Ethernet interface to attach to; both go at cleanup.
func pinFixture(t *testing.T) (dir string, ifindex int) {
	t.Helper()
	requirePrivileges(t)
	fsdir := t.TempDir()
	if err := MountBPFFS(fsdir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(fsdir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", fsdir, err)
		}
	})
	name := fmt.Sprintf("ftkcl%d", os.Getpid()%100000)
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}); err != nil {
		t.Fatalf("create veth pair: %v", err)
	}
	l, err := netlink.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := netlink.LinkDel(l); err != nil {
			t.Errorf("delete %s: %v", name, err)
		}
	})
	return filepath.Join(fsdir, "node1", "ackclamp"), l.Attrs().Index
}

// tcxPrograms is the ids of the programs attached to ifindex in direction at.
func tcxPrograms(t *testing.T, ifindex int, at ebpf.AttachType) []ebpf.ProgramID {
	t.Helper()
	r, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: at})
	if err != nil {
		t.Fatalf("query TCX %v programs: %v", at, err)
	}
	var ids []ebpf.ProgramID
	for _, p := range r.Programs {
		ids = append(ids, p.ID)
	}
	return ids
}

// TestAckClampPinnedSurvivesClose is the ACK clamp of a killed agent: the process closes its file
// descriptors (as a SIGKILL does), yet the programs stay attached with the flows and their snd_nxt; the
// next process re-opens the same map and links instead of attaching a second copy; Unpin then removes
// everything. An empty pinned map left by a crash is started afresh.
func TestAckClampPinnedSurvivesClose(t *testing.T) {
	dir, ifindex := pinFixture(t)
	restored := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.12:7300"), Remote: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := tcpflow.Tuple{Local: restored.Remote, Remote: restored.Local}
	const base uint32 = 1000

	c1, err := OpenPinned(dir)
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load TCX programs: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := c1.Attach(ifindex); err != nil {
		c1.Close()
		t.Fatal(err)
	}
	egress := tcxPrograms(t, ifindex, ebpf.AttachTCXEgress)
	ingress := tcxPrograms(t, ifindex, ebpf.AttachTCXIngress)
	if len(egress) != 1 || len(ingress) != 1 {
		t.Fatalf("after the first attach: egress %v, ingress %v; want one program each", egress, ingress)
	}
	if err := c1.Clamp(restored, base); err != nil {
		t.Fatal(err)
	}
	if _, err := c1.objs.AckclampEgress.Run(&ebpf.RunOptions{Data: tcpframe.Segment{Seq: base, Ack: 1, Flags: 0x18, Payload: 500}.Frame(restored)}); err != nil {
		t.Fatal(err)
	}
	if err := c1.Close(); err != nil {
		t.Fatal(err)
	}

	// The process is gone: the programs must still be attached.
	if got := tcxPrograms(t, ifindex, ebpf.AttachTCXEgress); len(got) != 1 || got[0] != egress[0] {
		t.Fatalf("after the process closed the clamp: egress programs %v, want %v still attached", got, egress)
	}
	if got := tcxPrograms(t, ifindex, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != ingress[0] {
		t.Fatalf("after the process closed the clamp: ingress programs %v, want %v still attached", got, ingress)
	}

	c2, err := OpenPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	flows, err := c2.Flows()
	if err != nil {
		t.Fatal(err)
	}
	if want := (ClampedFlow{Flow: restored, State: ClampState{SndNxt: base + 500}}); len(flows) != 1 || flows[0] != want {
		t.Fatalf("re-opened flows %+v, want [%+v]", flows, want)
	}
	if err := c2.Attach(ifindex); err != nil {
		t.Fatal(err)
	}
	if got := tcxPrograms(t, ifindex, ebpf.AttachTCXEgress); len(got) != 1 || got[0] != egress[0] {
		t.Errorf("after re-opening: egress programs %v, want the pinned %v only", got, egress)
	}
	if got := tcxPrograms(t, ifindex, ebpf.AttachTCXIngress); len(got) != 1 || got[0] != ingress[0] {
		t.Errorf("after re-opening: ingress programs %v, want the pinned %v only", got, ingress)
	}
	// The re-opened map is the one the attached programs use: an ACK beyond snd_nxt is lowered.
	fr := tcpframe.Segment{Seq: 7, Ack: base + 90000, Flags: 0x10, Window: 100, Payload: 10}.Frame(peer)
	tcpframe.Checksum(fr, true)
	out := make([]byte, len(fr))
	if _, err := c2.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr, DataOut: out}); err != nil {
		t.Fatal(err)
	}
	if got := binary.BigEndian.Uint32(out[14+20+8:]); got != base+500 {
		t.Errorf("ACK after re-opening: %d, want the snd_nxt %d recorded before the close", got, base+500)
	}

	// Release the flow and unpin: nothing is left attached or pinned once the process closes.
	if _, err := c2.Release(restored); err != nil {
		t.Fatal(err)
	}
	if err := c2.Unpin(); err != nil {
		t.Fatal(err)
	}
	if err := c2.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin directory after Unpin: %v; want it removed", err)
	}
	for _, at := range []ebpf.AttachType{ebpf.AttachTCXEgress, ebpf.AttachTCXIngress} {
		if got := tcxPrograms(t, ifindex, at); len(got) != 0 {
			t.Errorf("after Unpin and Close: %v programs %v still attached", at, got)
		}
	}

	// A crash with no flow registered leaves an empty map: the next open drops the stale links.
	c3, err := OpenPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := c3.Attach(ifindex); err != nil {
		t.Fatal(err)
	}
	stale := tcxPrograms(t, ifindex, ebpf.AttachTCXEgress)
	c3.Close()
	c4, err := OpenPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { c4.Unpin(); c4.Close() }()
	if got := tcxPrograms(t, ifindex, ebpf.AttachTCXEgress); len(got) != 0 {
		t.Errorf("opening an empty pinned clamp left the stale egress programs %v (was %v) attached", got, stale)
	}
	if err := c4.Attach(ifindex); err != nil {
		t.Fatal(err)
	}
	if got := tcxPrograms(t, ifindex, ebpf.AttachTCXEgress); len(got) != 1 {
		t.Errorf("after a fresh attach: egress programs %v, want one", got)
	}
}

// TestAckClampPinnedOtherLayout is an agent upgraded across a change of the flows' layout (16-byte states
// before 2026-11-29): an empty map pinned by the old version is replaced, one that still holds a flow is
// left alone with an error that says what to do.
func TestAckClampPinnedOtherLayout(t *testing.T) {
	dir, _ := pinFixture(t)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	old, err := ebpf.NewMap(&ebpf.MapSpec{Name: "clamps", Type: ebpf.Hash, KeySize: 12, ValueSize: 16, MaxEntries: 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	if err := old.Pin(filepath.Join(dir, "clamps")); err != nil {
		t.Fatal(err)
	}
	if err := old.Put(make([]byte, 12), make([]byte, 16)); err != nil {
		t.Fatal(err)
	}
	if c, err := OpenPinned(dir); err == nil {
		c.Close()
		t.Fatal("opened over an old map that still holds a flow")
	} else if !strings.Contains(err.Error(), "incompatible version") || !strings.Contains(err.Error(), "still holds flows") {
		t.Errorf("error %q does not say the old map is in use", err)
	}
	if err := old.Delete(make([]byte, 12)); err != nil {
		t.Fatal(err)
	}
	c, err := OpenPinned(dir)
	if err != nil {
		t.Fatalf("over an empty old map: %v", err)
	}
	defer func() { c.Unpin(); c.Close() }()
	if c.objs.Clamps.ValueSize() == 16 {
		t.Errorf("the clamp's map has the old layout (value size %d)", c.objs.Clamps.ValueSize())
	}
	if _, err := os.Stat(filepath.Join(dir, "clamps")); err != nil {
		t.Errorf("the new map is not pinned: %v", err)
	}
}
