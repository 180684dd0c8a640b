package ackclamp

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ftkit/ftkit/internal/tcpframe"
	"github.com/ftkit/ftkit/tcpflow"
)

// testSkbChecksumComplete is BPF_F_TEST_SKB_CHECKSUM_COMPLETE (Linux 6.11+): the test run gives the skb
// CHECKSUM_COMPLETE with skb->csum over the packet, and fails with EBADMSG when the program leaves
// skb->csum disagreeing with the packet's bytes (a NIC that delivers CHECKSUM_COMPLETE: mlx5, bnxt, ...).
const testSkbChecksumComplete = 1 << 2

// TestAckClampChecksumComplete: the peer's ACK clamped on a CHECKSUM_COMPLETE skb must leave skb->csum
// matching the packet, else tcp_v4_rcv's validation fails, reports "hw csum failure" and sums it in software.
func TestAckClampChecksumComplete(t *testing.T) {
	c := loadT(t)
	restored := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.12:7300"), Remote: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := tcpflow.Tuple{Local: restored.Remote, Remote: restored.Local}
	if err := c.Clamp(restored, 1000); err != nil {
		t.Fatal(err)
	}
	fr := tcpframe.Segment{Seq: 7, Ack: 50000, Flags: 0x10, Window: 100}.Frame(peer)
	tcpframe.Checksum(fr, true)
	out := make([]byte, len(fr))
	_, err := c.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr, DataOut: out, Flags: testSkbChecksumComplete})
	if err != nil {
		t.Fatalf("ingress clamp on a CHECKSUM_COMPLETE skb: %v (skb->csum left wrong)", err)
	}
	if got := binary.BigEndian.Uint32(out[14+20+8:]); got != 1000 || !tcpframe.Checksum(out, false) {
		t.Fatalf("ack %d, checksum ok %v", got, tcpframe.Checksum(out, false))
	}

	// Egress: a lifted pure ACK (seq rewritten) on a CHECKSUM_COMPLETE skb (a forwarded one).
	fr = tcpframe.Segment{Seq: 1000, Ack: 1, Flags: 0x10, Window: 100}.Frame(restored)
	binary.BigEndian.PutUint32(fr[14+20+4:], 900)
	tcpframe.Checksum(fr, true)
	if _, err := c.objs.AckclampEgress.Run(&ebpf.RunOptions{Data: fr, DataOut: out, Flags: testSkbChecksumComplete}); err != nil {
		t.Fatalf("egress lift on a CHECKSUM_COMPLETE skb: %v (skb->csum left wrong)", err)
	}
}
