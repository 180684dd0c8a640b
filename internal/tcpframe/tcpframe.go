// Package tcpframe builds Ethernet/IPv4/TCP frames for tests that run eBPF programs on crafted
// segments (BPF_PROG_TEST_RUN): the logger's flow state and the ACK clamp's rewriting.
package tcpframe

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/ftkit/ftkit/tcpflow"
)

// Segment is one TCP segment.
type Segment struct {
	Seq, Ack uint32
	Flags    uint8
	Window   uint16
	Opts     []byte // a multiple of 4 bytes, at most 40
	Payload  int    // bytes of payload
}

// Frame builds the Ethernet frame of s sent by f.Local to f.Remote (IPv4 addresses), with a valid IP
// header checksum and a zero TCP checksum (Checksum fills it in).
func (s Segment) Frame(f tcpflow.Tuple) []byte {
	if len(s.Opts)%4 != 0 || len(s.Opts) > 40 {
		panic(fmt.Sprintf("bad TCP options length %d", len(s.Opts)))
	}
	tcpLen := 20 + len(s.Opts)
	ipLen := 20 + tcpLen + s.Payload
	b := make([]byte, 14+ipLen)
	copy(b[0:6], []byte{2, 0, 0, 0, 0, 2})
	copy(b[6:12], []byte{2, 0, 0, 0, 0, 1})
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(ipLen))
	binary.BigEndian.PutUint16(ip[6:], 0x4000) // DF
	ip[8] = 64
	ip[9] = 6
	src, dst := f.Local.Addr().As4(), f.Remote.Addr().As4()
	copy(ip[12:16], src[:])
	copy(ip[16:20], dst[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	tcp := ip[20:]
	binary.BigEndian.PutUint16(tcp[0:], f.Local.Port())
	binary.BigEndian.PutUint16(tcp[2:], f.Remote.Port())
	binary.BigEndian.PutUint32(tcp[4:], s.Seq)
	binary.BigEndian.PutUint32(tcp[8:], s.Ack)
	tcp[12] = byte(tcpLen/4) << 4
	tcp[13] = s.Flags
	binary.BigEndian.PutUint16(tcp[14:], s.Window)
	copy(tcp[20:], s.Opts)
	for i := range s.Payload {
		tcp[tcpLen+i] = byte(i)
	}
	return b
}

// Checksum fills in (fill) or verifies the TCP checksum of a frame built by Frame.
func Checksum(frame []byte, fill bool) bool {
	ip := frame[14:]
	tcp := ip[20:binary.BigEndian.Uint16(ip[2:])]
	src, _ := netip.AddrFromSlice(ip[12:16])
	dst, _ := netip.AddrFromSlice(ip[16:20])
	f := tcpflow.Tuple{Local: netip.AddrPortFrom(src, 0), Remote: netip.AddrPortFrom(dst, 0)}
	if fill {
		binary.BigEndian.PutUint16(tcp[16:], 0)
		binary.BigEndian.PutUint16(tcp[16:], f.Checksum(tcp))
		return true
	}
	return f.Checksum(tcp) == 0
}
