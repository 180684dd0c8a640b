package park

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

// frame builds an Ethernet frame with an IPv4 TCP segment from src to dst; total overrides the IP
// length when not 0, vlan adds an 802.1Q tag, opts is the TCP options' length.
func frame(src, dst netip.AddrPort, seq uint32, payload []byte, vlan bool, opts, total int) []byte {
	b := make([]byte, 12, 128+len(payload))
	if vlan {
		b = append(b, 0x81, 0x00, 0, 7)
	}
	b = append(b, 0x08, 0x00)
	ip := make([]byte, 20)
	ip[0] = 0x45
	if total == 0 {
		total = 20 + 20 + opts + len(payload)
	}
	binary.BigEndian.PutUint16(ip[2:], uint16(total))
	ip[6] = 0x40 // DF
	ip[9] = 6
	s4, d4 := src.Addr().As4(), dst.Addr().As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	tcp := make([]byte, 20+opts)
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], dst.Port())
	binary.BigEndian.PutUint32(tcp[4:], seq)
	tcp[12] = byte((20+opts)/4) << 4
	b = append(append(append(b, ip...), tcp...), payload...)
	return b
}

func TestParseFrame(t *testing.T) {
	src, dst := netip.MustParseAddrPort("10.0.0.1:40000"), netip.MustParseAddrPort("10.0.0.2:5201")
	conn := tcpflow.Tuple{Local: src, Remote: dst}
	payload := bytes.Repeat([]byte("parked "), 300)
	padded := append(frame(src, dst, 1, []byte("ab"), false, 0, 0), make([]byte, 10)...) // Ethernet padding
	for _, tc := range []struct {
		name    string
		b       []byte
		whole   bool
		want    []byte // the payload, nil for an error
		wantSeq uint32
	}{
		{"whole", frame(src, dst, 7, payload, false, 12, 0), true, payload, 7},
		{"vlan tag", frame(src, dst, 8, payload, true, 0, 0), true, payload, 8},
		{"headers only", frame(src, dst, 9, payload, false, 12, 0)[:14+20+32+5], false, payload[:5], 9},
		{"headers only, no payload bytes", frame(src, dst, 9, payload, false, 12, 0)[:14+20+32], false, []byte{}, 9},
		{"padding after the payload", padded, true, []byte("ab"), 1},
		{"BIG TCP: IP length 0", frame(src, dst, 10, payload, false, 0, 0x10000), true, payload, 10},
		{"SYN with data (Fast Open): the payload after the SYN's number", frame(src, dst, 0xffffffff, payload, false, 12, 0), true, payload, 0},
		{"cut short", frame(src, dst, 11, payload, false, 0, 0)[:100], true, nil, 0},
		{"IP length below the headers", frame(src, dst, 12, payload, false, 0, 30), true, nil, 0},
		{"TCP header cut", frame(src, dst, 13, nil, false, 0, 0)[:14+20+10], false, nil, 0},
		{"options cut", frame(src, dst, 13, nil, false, 20, 0)[:14+20+30], false, nil, 0},
		{"empty", nil, false, nil, 0},
		{"IPv6", append([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x86, 0xdd}, make([]byte, 60)...), false, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "BIG TCP: IP length 0" {
				binary.BigEndian.PutUint16(tc.b[14+2:], 0)
			}
			if tc.name == "SYN with data (Fast Open): the payload after the SYN's number" {
				tc.b[14+20+13] |= 0x02
			}
			f, err := ParseFrame(tc.b, tc.whole)
			if tc.want == nil {
				if err == nil {
					t.Fatalf("parsed %+v, want an error", f)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if f.Conn != conn || f.Seq != tc.wantSeq || !bytes.Equal(f.Payload, tc.want) {
				t.Fatalf("got %v seq %d, %d payload bytes; want %v seq %d, %d bytes", f.Conn, f.Seq, len(f.Payload), conn, tc.wantSeq, len(tc.want))
			}
		})
	}
	// Not TCP, and fragments.
	udp := frame(src, dst, 1, payload, false, 0, 0)
	udp[14+9] = 17
	frag := frame(src, dst, 1, payload, false, 0, 0)
	frag[14+6] = 0x20 // more fragments
	for _, b := range [][]byte{udp, frag} {
		if _, err := ParseFrame(b, true); !errors.Is(err, ErrNotTCP) {
			t.Errorf("ParseFrame: %v, want ErrNotTCP", err)
		}
	}
}

func FuzzParseFrame(f *testing.F) {
	src, dst := netip.MustParseAddrPort("10.0.0.1:1"), netip.MustParseAddrPort("10.0.0.2:2")
	f.Add(frame(src, dst, 1, []byte("hello"), false, 0, 0), true)
	f.Add(frame(src, dst, 1, []byte("hello"), true, 12, 0), false)
	f.Add([]byte{}, false)
	f.Fuzz(func(t *testing.T, b []byte, whole bool) {
		fr, err := ParseFrame(b, whole)
		if err != nil {
			return
		}
		// The payload lies inside the frame, at its end or before padding.
		if len(fr.Payload) > len(b) || (len(fr.Payload) > 0 && !bytes.Contains(b, fr.Payload)) {
			t.Fatalf("payload of %d bytes not within the %d-byte frame", len(fr.Payload), len(b))
		}
	})
}
