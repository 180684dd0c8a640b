package tcpflow

import "encoding/binary"

// Checksum is the TCP checksum of segment (header and payload, its checksum field as it is) sent from
// t.Local to t.Remote, over the IPv4 pseudo-header: fill a zeroed checksum field with it, or check a
// received segment, whose sum including its checksum field gives 0.
func (t Tuple) Checksum(segment []byte) uint16 {
	src, dst := t.Local.Addr().Unmap().As4(), t.Remote.Addr().Unmap().As4()
	var sum uint32
	add := func(b []byte) {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
		if len(b)%2 == 1 {
			sum += uint32(b[len(b)-1]) << 8
		}
	}
	add(src[:])
	add(dst[:])
	sum += 6 + uint32(len(segment)) // IPPROTO_TCP
	add(segment)
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
