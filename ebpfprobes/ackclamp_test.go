package ebpfprobes

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
)

// tcpChecksum fills in (fill) or verifies the TCP checksum of an IPv4 frame built by segment.frame.
func tcpChecksum(frame []byte, fill bool) bool {
	ip := frame[14:]
	tcp := ip[20:binary.BigEndian.Uint16(ip[2:])]
	if fill {
		binary.BigEndian.PutUint16(tcp[16:], 0)
	}
	var sum uint32
	add := func(b []byte) {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	add(ip[12:20])
	sum += 6 + uint32(len(tcp))
	add(tcp)
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	if fill {
		binary.BigEndian.PutUint16(tcp[16:], ^uint16(sum))
		return true
	}
	return uint16(sum) == 0xffff
}

// TestAckClamp runs the real programs (BPF_PROG_TEST_RUN) on crafted segments: the restored end's
// segments raise its snd_nxt, the peer's ACKs beyond it are lowered to it with a valid checksum, and
// other flows and ACKs below snd_nxt are left alone.
func TestAckClamp(t *testing.T) {
	requirePrivileges(t)
	c, err := LoadAckClamp()
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load TCX programs: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	restored := Flow{Src: netip.MustParseAddrPort("10.9.0.12:7300"), Dst: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := Flow{Src: restored.Dst, Dst: restored.Src}
	other := Flow{Src: netip.MustParseAddrPort("10.9.0.13:1"), Dst: restored.Src}
	var base uint32 = 0xfffffc00 // the sequence space wraps during the test
	if err := c.Clamp(restored, base); err != nil {
		t.Fatal(err)
	}
	egress := func(seg segment) {
		t.Helper()
		if _, err := c.objs.AckclampEgress.Run(&ebpf.RunOptions{Data: seg.frame(restored)}); err != nil {
			t.Fatal(err)
		}
	}
	// ingress returns the ACK number the restored socket would see.
	ingress := func(f Flow, ack uint32) uint32 {
		t.Helper()
		fr := segment{seq: 7, ack: ack, flags: 0x10, window: 100, payload: 10}.frame(f)
		tcpChecksum(fr, true)
		out := make([]byte, len(fr))
		if _, err := c.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr, DataOut: out}); err != nil {
			t.Fatal(err)
		}
		if !tcpChecksum(out, false) {
			t.Fatalf("TCP checksum wrong after the program (ack %d)", ack)
		}
		return binary.BigEndian.Uint32(out[14+20+8:])
	}
	tests := []struct {
		name      string
		send      *segment // the restored end sends this first
		flow      Flow
		ack, want uint32
	}{
		{name: "peer ahead: lowered to snd_nxt", flow: peer, ack: base + 50000, want: base},
		{name: "after 1000 bytes sent", send: &segment{seq: base, ack: 1, flags: 0x18, payload: 1000}, flow: peer, ack: base + 50000, want: base + 1000},
		{name: "across the wrap", send: &segment{seq: base + 1000, ack: 1, flags: 0x18, payload: 1200}, flow: peer, ack: base + 50000, want: base + 2200},
		{name: "a retransmission does not lower snd_nxt", send: &segment{seq: base, ack: 1, flags: 0x18, payload: 100}, flow: peer, ack: base + 50000, want: base + 2200},
		{name: "FIN counts", send: &segment{seq: base + 2200, ack: 1, flags: 0x11}, flow: peer, ack: base + 50000, want: base + 2201},
		{name: "ACK below snd_nxt untouched", flow: peer, ack: base + 10, want: base + 10},
		{name: "other flow untouched", flow: other, ack: base + 50000, want: base + 50000},
	}
	for _, tt := range tests {
		if tt.send != nil {
			egress(*tt.send)
		}
		if got := ingress(tt.flow, tt.ack); got != tt.want {
			t.Errorf("%s: ack %#x, want %#x", tt.name, got, tt.want)
		}
	}
	st, err := c.Release(restored)
	if err != nil || st.SndNxt != base+2201 || st.Clamped != 5 {
		t.Errorf("Release = %+v, %v; want snd_nxt %#x, 5 clamped", st, err, base+2201)
	}
	if got := ingress(peer, base+50000); got != base+50000 {
		t.Errorf("after Release: ack %#x changed", got)
	}
}
