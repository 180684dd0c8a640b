//go:build linux

package labtest

import (
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/lab"
)

// InjectLoss drops permille/1000 of the packets longer than 200 bytes that arrive on host's eth0: random
// loss on the link into host, so that TCP recovers with real retransmissions. Handshakes and pure ACKs are
// spared to keep tests' timing predictable. This kernel is built without sch_netem, so the loss is a TCX
// ingress program instead of a netem qdisc; it is detached when the test ends.
func InjectLoss(t testing.TB, l *lab.Lab, host string, permille int32) {
	t.Helper()
	InjectLossOn(t, l, host, "eth0", permille)
}

// InjectLossOn is InjectLoss on host's interface dev ("lo": between the host's own processes); detach ends
// the loss before the test does.
func InjectLossOn(t testing.TB, l *lab.Lab, host, dev string, permille int32) (detach func()) {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:    "ftkit_test_loss",
		Type:    ebpf.SchedCLS,
		License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R6, asm.R1, 0, asm.Word), // skb->len
			asm.JLT.Imm(asm.R6, 200, "pass"),
			asm.FnGetPrandomU32.Call(),
			asm.Mod.Imm(asm.R0, 1000),
			asm.JLT.Imm(asm.R0, permille, "drop"),
			asm.Mov.Imm(asm.R0, -1).WithSymbol("pass"), // TCX_NEXT
			asm.Return(),
			asm.Mov.Imm(asm.R0, 2).WithSymbol("drop"), // TCX_DROP
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("load loss injector: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	var lk link.Link
	err = l.Do(host, func() error {
		nl, err := netlink.LinkByName(dev)
		if err != nil {
			return err
		}
		lk, err = link.AttachTCX(link.TCXOptions{Interface: nl.Attrs().Index, Program: prog, Attach: ebpf.AttachTCXIngress})
		return err
	})
	if err != nil {
		t.Fatalf("attach loss injector to %s %s ingress: %v", host, dev, err)
	}
	var once sync.Once
	detach = func() {
		once.Do(func() {
			if err := lk.Close(); err != nil {
				t.Errorf("detach loss injector: %v", err)
			}
		})
	}
	t.Cleanup(detach)
	return detach
}
