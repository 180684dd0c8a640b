package ackclamp

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"os"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ftkit/ftkit/internal/tcpframe"
	"github.com/ftkit/ftkit/tcpflow"
)

// requirePrivileges skips a test that loads BPF programs or creates interfaces when not root.
func requirePrivileges(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root for BPF and network interfaces")
	}
}

// loadT loads the clamp's programs for a test, closed at its end; it skips where the kernel cannot.
func loadT(t *testing.T) *Clamp {
	t.Helper()
	requirePrivileges(t)
	c, err := Load()
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load TCX programs: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// injectedMark is restore.InjectedMark (not imported: restore's tests import this package's clamp).
const injectedMark = 0x66746b69

// skbContext is the head of struct __sk_buff up to its mark, what BPF_PROG_TEST_RUN takes as a segment's
// context (the fields before the mark must be 0).
type skbContext struct {
	Len, PktType, Mark uint32
}

// TestAckClamp runs the real programs (BPF_PROG_TEST_RUN) on crafted segments: the restored end's
// segments raise its snd_nxt, the peer's ACKs beyond it are lowered to it with a valid checksum, and
// other flows and ACKs below snd_nxt are left alone.
func TestAckClamp(t *testing.T) {
	c := loadT(t)
	restored := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.12:7300"), Remote: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := tcpflow.Tuple{Local: restored.Remote, Remote: restored.Local}
	other := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.13:1"), Remote: restored.Local}
	var base uint32 = 0xfffffc00 // the sequence space wraps during the test
	if err := c.Clamp(restored, base); err != nil {
		t.Fatal(err)
	}
	egress := func(seg tcpframe.Segment) {
		t.Helper()
		if _, err := c.objs.AckclampEgress.Run(&ebpf.RunOptions{Data: seg.Frame(restored)}); err != nil {
			t.Fatal(err)
		}
	}
	// ingress returns the ACK number the restored socket would see.
	ingress := func(f tcpflow.Tuple, ack uint32) uint32 {
		t.Helper()
		fr := tcpframe.Segment{Seq: 7, Ack: ack, Flags: 0x10, Window: 100, Payload: 10}.Frame(f)
		tcpframe.Checksum(fr, true)
		out := make([]byte, len(fr))
		if _, err := c.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr, DataOut: out}); err != nil {
			t.Fatal(err)
		}
		if !tcpframe.Checksum(out, false) {
			t.Fatalf("TCP checksum wrong after the program (ack %d)", ack)
		}
		return binary.BigEndian.Uint32(out[14+20+8:])
	}
	tests := []struct {
		name      string
		send      *tcpframe.Segment // the restored end sends this first
		flow      tcpflow.Tuple
		ack, want uint32
	}{
		{name: "peer ahead: lowered to snd_nxt", flow: peer, ack: base + 50000, want: base},
		{name: "after 1000 bytes sent", send: &tcpframe.Segment{Seq: base, Ack: 1, Flags: 0x18, Payload: 1000}, flow: peer, ack: base + 50000, want: base + 1000},
		{name: "across the wrap", send: &tcpframe.Segment{Seq: base + 1000, Ack: 1, Flags: 0x18, Payload: 1200}, flow: peer, ack: base + 50000, want: base + 2200},
		{name: "a retransmission does not lower snd_nxt", send: &tcpframe.Segment{Seq: base, Ack: 1, Flags: 0x18, Payload: 100}, flow: peer, ack: base + 50000, want: base + 2200},
		{name: "FIN counts", send: &tcpframe.Segment{Seq: base + 2200, Ack: 1, Flags: 0x11}, flow: peer, ack: base + 50000, want: base + 2201},
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

// TestAckClampHold runs the ingress program on the peer's segments of a held flow: those with payload are
// dropped, pure ACKs pass (and are still clamped), segments marked as injected (the skb mark
// restore.InjectFromPeer gives them) pass, the peer's own with the TOS injected ones carry do not; released
// from the hold, everything passes again.
func TestAckClampHold(t *testing.T) {
	c := loadT(t)
	restored := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.12:7300"), Remote: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := tcpflow.Tuple{Local: restored.Remote, Remote: restored.Local}
	if err := c.Hold(restored, true); err == nil {
		t.Fatal("an unregistered flow was held")
	}
	if err := c.Clamp(restored, 1000); err != nil {
		t.Fatal(err)
	}
	if err := c.Hold(restored, true); err != nil {
		t.Fatal(err)
	}
	const tcxDrop = 2
	run := func(payload int, tos byte, mark uint32, ack uint32) (ret uint32, gotAck uint32) {
		t.Helper()
		fr := tcpframe.Segment{Seq: 7, Ack: ack, Flags: 0x10, Window: 100, Payload: payload}.Frame(peer)
		fr[15] = tos
		tcpframe.Checksum(fr, true)
		out := make([]byte, len(fr))
		ret, err := c.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr, DataOut: out, Context: skbContext{Mark: mark}})
		if err != nil {
			t.Fatal(err)
		}
		return ret, binary.BigEndian.Uint32(out[14+20+8:])
	}
	if ret, _ := run(100, 0, 0, 900); ret != tcxDrop {
		t.Errorf("held flow: a peer segment with payload returned %d, want drop (%d)", ret, tcxDrop)
	}
	if ret, ack := run(0, 0, 0, 5000); ret == tcxDrop || ack != 1000 {
		t.Errorf("held flow: a pure ACK returned %d with ack %d, want it passed and clamped to 1000", ret, ack)
	}
	if ret, _ := run(100, 0x04, injectedMark, 900); ret == tcxDrop {
		t.Errorf("held flow: an injected segment (marked) was dropped")
	}
	// The peer's own IP_TOS, an ECN retransmission or a DSCP re-mark may give its segments the TOS
	// injected ones carry.
	if ret, _ := run(100, 0x04, 0, 900); ret != tcxDrop {
		t.Errorf("held flow: a peer segment with payload and TOS 0x04 returned %d, want drop (%d)", ret, tcxDrop)
	}
	if ret, ack := run(0, 0x04, 0, 5000); ret == tcxDrop || ack != 1000 {
		t.Errorf("held flow: a pure ACK with TOS 0x04 returned %d with ack %d, want it passed and clamped to 1000", ret, ack)
	}
	if st, err := c.State(restored); err != nil || st.SndNxt != 1000 {
		t.Errorf("hold changed the flow's state: %+v %v", st, err)
	}
	if err := c.Hold(restored, false); err != nil {
		t.Fatal(err)
	}
	if ret, _ := run(100, 0, 0, 900); ret == tcxDrop {
		t.Errorf("released flow: a peer segment with payload was dropped")
	}
}

// TestAckClampHoldKeepsTheProgramsCounts toggles a flow's hold while the ingress program clamps the peer's
// ACKs: every clamp is counted. A hold written as the whole state read a moment before put back the
// counters (and snd_nxt, the peer's ACK) the programs had raised in between.
func TestAckClampHoldKeepsTheProgramsCounts(t *testing.T) {
	c := loadT(t)
	restored := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.12:7300"), Remote: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := tcpflow.Tuple{Local: restored.Remote, Remote: restored.Local}
	if err := c.Clamp(restored, 1000); err != nil {
		t.Fatal(err)
	}
	fr := tcpframe.Segment{Seq: 7, Ack: 5000, Flags: 0x10, Window: 100}.Frame(peer)
	tcpframe.Checksum(fr, true)
	const acks = 20000
	done := make(chan struct{})
	holdErr := make(chan error, 1)
	go func() {
		var err error
		for on := true; err == nil; on = !on {
			select {
			case <-done:
				holdErr <- c.Hold(restored, false)
				return
			default:
			}
			err = c.Hold(restored, on)
		}
		holdErr <- err
	}()
	for range acks {
		if _, err := c.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr}); err != nil {
			close(done)
			t.Fatal(err)
		}
	}
	close(done)
	if err := <-holdErr; err != nil {
		t.Fatal(err)
	}
	if st, err := c.State(restored); err != nil || st.Clamped != acks || st.SndNxt != 1000 {
		t.Errorf("after %d clamped ACKs with the hold toggled meanwhile: %+v %v, want %d clamped, snd_nxt 1000", acks, st, err, acks)
	}
}

// TestAckClampQuiet runs the egress program on the restored end's segments once the peer has acknowledged
// beyond them: a pure ACK below the peer's (unclamped) ACK number that acknowledges more than any before it
// is lifted to that number (the peer takes it, and learns what the replay delivered of its bytes); one that
// does not is held back, since the peer would discard it and answer with a duplicate ACK (an ACK loop on
// hosts with net.ipv4.tcp_invalid_ratelimit = 0). Data, FIN and RST segments, and pure ACKs at or beyond
// that number, pass unchanged. Nothing is touched before the peer's first ACK.
func TestAckClampQuiet(t *testing.T) {
	c := loadT(t)
	restored := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.12:7300"), Remote: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := tcpflow.Tuple{Local: restored.Remote, Remote: restored.Local}
	var base uint32 = 0xffffff00 // the peer's ACK wraps past the restored end's sequence numbers
	if err := c.Clamp(restored, base); err != nil {
		t.Fatal(err)
	}
	const tcxDrop = 2
	// egress returns whether the program dropped seg, and the sequence number it left in it.
	egress := func(seg tcpframe.Segment) (bool, uint32) {
		t.Helper()
		fr := seg.Frame(restored)
		tcpframe.Checksum(fr, true)
		out := make([]byte, len(fr))
		ret, err := c.objs.AckclampEgress.Run(&ebpf.RunOptions{Data: fr, DataOut: out})
		if err != nil {
			t.Fatal(err)
		}
		if ret != tcxDrop && !tcpframe.Checksum(out, false) {
			t.Fatalf("TCP checksum wrong after the program (seq %#x)", seg.Seq)
		}
		return ret == tcxDrop, binary.BigEndian.Uint32(out[14+20+4:])
	}
	pureACK := tcpframe.Segment{Seq: base, Ack: 1, Flags: 0x10, Window: 100}
	if drop, seq := egress(pureACK); drop || seq != base {
		t.Fatalf("a pure ACK before the peer acknowledged anything: dropped %v, seq %#x", drop, seq)
	}
	// The peer has every byte up to base+5000: its ACK says so (and is clamped on its way in).
	peerAck := base + 5000
	fr := tcpframe.Segment{Seq: 1, Ack: peerAck, Flags: 0x10, Window: 100}.Frame(peer)
	tcpframe.Checksum(fr, true)
	if _, err := c.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr, DataOut: make([]byte, len(fr))}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		seg     tcpframe.Segment
		drop    bool
		wantSeq uint32
	}{
		{"pure ACK below the peer's ACK: lifted", pureACK, false, peerAck},
		{"the same ACK again: held back", pureACK, true, 0},
		{"its window update: held back", tcpframe.Segment{Seq: base, Ack: 1, Flags: 0x10, Window: 200}, true, 0},
		{"a later ACK, across the wrap: lifted", tcpframe.Segment{Seq: base + 4999, Ack: 1000, Flags: 0x10}, false, peerAck},
		{"an older ACK: held back", tcpframe.Segment{Seq: base + 4999, Ack: 999, Flags: 0x10}, true, 0},
		{"pure ACK at the peer's ACK", tcpframe.Segment{Seq: peerAck, Ack: 1000, Flags: 0x10}, false, peerAck},
		{"pure ACK beyond it", tcpframe.Segment{Seq: base + 6000, Ack: 1000, Flags: 0x10}, false, base + 6000},
		{"re-sent data below it", tcpframe.Segment{Seq: base, Ack: 1000, Flags: 0x18, Payload: 100}, false, base},
		{"FIN below it", tcpframe.Segment{Seq: base + 100, Ack: 1000, Flags: 0x11}, false, base + 100},
		{"RST below it", tcpframe.Segment{Seq: base + 100, Ack: 1000, Flags: 0x14}, false, base + 100},
	} {
		drop, seq := egress(tc.seg)
		if drop != tc.drop || !drop && seq != tc.wantSeq {
			t.Errorf("%s: dropped %v, seq %#x; want dropped %v, seq %#x", tc.name, drop, seq, tc.drop, tc.wantSeq)
		}
	}
	st, err := c.State(restored)
	if err != nil || st.Quieted != 3 || st.Lifted != 2 {
		t.Errorf("State = %+v, %v; want 3 ACKs held back, 2 lifted", st, err)
	}
}

// TestAckClampPeerTimestamp runs the ingress program on the peer's segments: the highest TSval of those
// that carry the timestamp option first (as Linux sends it) is kept, across the wrap; segments the agent
// injects as the peer's (marked), segments without the option, or with another option first, do not
// count.
func TestAckClampPeerTimestamp(t *testing.T) {
	c := loadT(t)
	restored := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.12:7300"), Remote: netip.MustParseAddrPort("10.9.0.11:40000")}
	peer := tcpflow.Tuple{Local: restored.Remote, Remote: restored.Local}
	if err := c.Clamp(restored, 1000); err != nil {
		t.Fatal(err)
	}
	ts := func(tsval uint32) []byte {
		o := []byte{1, 1, 8, 10, 0, 0, 0, 0, 0, 0, 0, 7}
		binary.BigEndian.PutUint32(o[4:], tsval)
		return o
	}
	sackFirst := append([]byte{1, 1, 5, 10, 0, 0, 0, 1, 0, 0, 0, 2}, ts(0x7000000)...)
	steps := []struct {
		name string
		opts []byte
		tos  byte
		mark uint32
		want uint32
	}{
		{name: "no option yet", want: 0},
		{name: "first", opts: ts(0xfffffff0), want: 0xfffffff0},
		{name: "older: kept", opts: ts(0xffffff00), want: 0xfffffff0},
		{name: "across the wrap", opts: ts(0x20), want: 0x20},
		{name: "injected: not the peer's", opts: ts(0x1000), tos: 0x04, mark: injectedMark, want: 0x20},
		{name: "the peer's with TOS 0x04", opts: ts(0x28), tos: 0x04, want: 0x28},
		{name: "another option first", opts: sackFirst, want: 0x28},
		{name: "later", opts: ts(0x30), want: 0x30},
	}
	for _, s := range steps {
		fr := tcpframe.Segment{Seq: 7, Ack: 900, Flags: 0x10, Window: 100, Opts: s.opts, Payload: 10}.Frame(peer)
		fr[15] = s.tos
		tcpframe.Checksum(fr, true)
		if _, err := c.objs.AckclampIngress.Run(&ebpf.RunOptions{Data: fr, Context: skbContext{Mark: s.mark}}); err != nil {
			t.Fatal(err)
		}
		st, err := c.State(restored)
		if err != nil {
			t.Fatal(err)
		}
		if st.PeerTSval != s.want {
			t.Errorf("%s: peer TSval %#x, want %#x", s.name, st.PeerTSval, s.want)
		}
	}
}
