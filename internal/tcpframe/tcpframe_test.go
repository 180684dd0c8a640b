package tcpframe

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

// TestFrame checks the header fields a BPF program reads and that Checksum's fill and verify agree.
func TestFrame(t *testing.T) {
	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.9.0.1:40000"), Remote: netip.MustParseAddrPort("10.9.0.2:5001")}
	fr := Segment{Seq: 0xfffffff0, Ack: 7, Flags: 0x18, Window: 100, Opts: []byte{1, 1, 1, 1}, Payload: 11}.Frame(f)
	if got, want := len(fr), 14+20+24+11; got != want {
		t.Fatalf("frame of %d bytes, want %d", got, want)
	}
	tcp := fr[14+20:]
	if binary.BigEndian.Uint16(tcp) != 40000 || binary.BigEndian.Uint16(tcp[2:]) != 5001 ||
		binary.BigEndian.Uint32(tcp[4:]) != 0xfffffff0 || binary.BigEndian.Uint32(tcp[8:]) != 7 || tcp[12]>>4 != 6 || tcp[13] != 0x18 {
		t.Errorf("TCP header % x", tcp[:20])
	}
	if netip.AddrFrom4([4]byte(fr[26:30])) != f.Local.Addr() || netip.AddrFrom4([4]byte(fr[30:34])) != f.Remote.Addr() {
		t.Errorf("IP addresses % x", fr[26:34])
	}
	if Checksum(fr, false) {
		t.Error("a zero TCP checksum verified")
	}
	Checksum(fr, true)
	if !Checksum(fr, false) {
		t.Error("a filled-in checksum does not verify")
	}
	fr[len(fr)-1] ^= 1
	if Checksum(fr, false) {
		t.Error("a corrupted payload verified")
	}
}
