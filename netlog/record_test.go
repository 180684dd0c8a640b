package netlog

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

// rawRecord lays a record out byte by byte, independently of AppendRecord.
func rawRecord(saddr, daddr [4]byte, sport, dport uint16, seq, n uint32, cg, kt uint64, payload []byte) []byte {
	b := []byte{}
	b = append(b, saddr[:]...)
	b = append(b, daddr[:]...)
	b = append(b, byte(sport>>8), byte(sport), byte(dport>>8), byte(dport))
	b = append(b, byte(seq), byte(seq>>8), byte(seq>>16), byte(seq>>24))
	b = append(b, byte(n), byte(n>>8), byte(n>>16), byte(n>>24))
	for i := 0; i < 8; i++ {
		b = append(b, byte(cg>>(8*i)))
	}
	for i := 0; i < 8; i++ {
		b = append(b, byte(kt>>(8*i)))
	}
	return append(b, payload...)
}

func TestDecodeRecord(t *testing.T) {
	src, dst := [4]byte{10, 0, 0, 1}, [4]byte{192, 168, 7, 254}
	payload := []byte("hello, log")
	tests := []struct {
		name    string
		buf     []byte
		wantErr bool
		want    Record
	}{
		{
			name: "normal",
			buf:  rawRecord(src, dst, 40000, 5201, 0xDEADBEEF, uint32(len(payload)), 0x0102030405060708, 123456789, payload),
			want: Record{
				Conn:     tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.MustParseAddrPort("192.168.7.254:5201")},
				Seq:      0xDEADBEEF,
				CgroupID: 0x0102030405060708,
				KtimeNs:  123456789,
				Payload:  payload,
			},
		},
		{
			name: "empty payload",
			buf:  rawRecord(src, dst, 1, 65535, 0, 0, 0, 0, nil),
			want: Record{Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:1"), Remote: netip.MustParseAddrPort("192.168.7.254:65535")}, Payload: []byte{}},
		},
		{
			name: "parked",
			buf:  binary.LittleEndian.AppendUint32(rawRecord(src, dst, 40000, 5201, 7, 65160|ParkedFlag, 9, 10, nil), 3),
			want: Record{
				Conn:     tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.MustParseAddrPort("192.168.7.254:5201")},
				Seq:      7,
				CgroupID: 9,
				KtimeNs:  10,
				Payload:  []byte{},
				Parked:   65160,
				Queue:    3,
			},
		},
		{name: "parked without its queue", buf: rawRecord(src, dst, 1, 2, 3, 100|ParkedFlag, 0, 0, nil), wantErr: true},
		{name: "parked with a payload", buf: rawRecord(src, dst, 1, 2, 3, 8|ParkedFlag, 0, 0, []byte("abcdefgh")), wantErr: true},
		{name: "parked, no length", buf: binary.LittleEndian.AppendUint32(rawRecord(src, dst, 1, 2, 3, ParkedFlag, 0, 0, nil), 0), wantErr: true},
		{name: "parked beyond MaxPayload", buf: binary.LittleEndian.AppendUint32(rawRecord(src, dst, 1, 2, 3, (MaxPayload+1)|ParkedFlag, 0, 0, nil), 0), wantErr: true},
		{name: "empty buffer", buf: nil, wantErr: true},
		{name: "header cut short", buf: rawRecord(src, dst, 1, 2, 3, 0, 0, 0, nil)[:RecordHeaderLen-1], wantErr: true},
		{name: "len larger than buffer", buf: rawRecord(src, dst, 1, 2, 3, 11, 0, 0, payload), wantErr: true},
		{name: "len smaller than buffer", buf: rawRecord(src, dst, 1, 2, 3, 9, 0, 0, payload), wantErr: true},
		{name: "padded C struct layout (40-byte header)", buf: append(rawRecord(src, dst, 1, 2, 3, 4, 0, 0, nil)[:20], make([]byte, 24)...), wantErr: true},
		{name: "len beyond MaxPayload", buf: rawRecord(src, dst, 1, 2, 3, MaxPayload+1, 0, 0, nil), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := DecodeRecord(tt.buf)
			if tt.wantErr {
				if !errors.Is(err, ErrBadRecord) {
					t.Fatalf("err = %v, want ErrBadRecord", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Conn != tt.want.Conn || got.Seq != tt.want.Seq || got.CgroupID != tt.want.CgroupID ||
				got.KtimeNs != tt.want.KtimeNs || !bytes.Equal(got.Payload, tt.want.Payload) ||
				got.Parked != tt.want.Parked || got.Queue != tt.want.Queue {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
			enc, err := AppendRecord(nil, got)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(enc, tt.buf) {
				t.Fatalf("AppendRecord does not reproduce the input:\n got %x\nwant %x", enc, tt.buf)
			}
		})
	}
}

func TestAppendRecordRejectsIPv6(t *testing.T) {
	r := Record{Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort("[2001:db8::1]:80"), Remote: netip.MustParseAddrPort("10.0.0.1:80")}}
	if _, err := AppendRecord(nil, r); err == nil {
		t.Fatal("IPv6 source encoded without error")
	}
	r.Conn.Local = netip.MustParseAddrPort("[::ffff:10.0.0.2]:80") // mapped IPv4 is fine
	b, err := AppendRecord(nil, r)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeRecord(b)
	if err != nil || got.Conn.Local != netip.MustParseAddrPort("10.0.0.2:80") {
		t.Fatalf("decoded %v, %v", got.Conn, err)
	}
}

func FuzzDecodeRecord(f *testing.F) {
	f.Add(rawRecord([4]byte{1, 2, 3, 4}, [4]byte{5, 6, 7, 8}, 1, 2, 3, 3, 4, 5, []byte("abc")))
	f.Add(rawRecord([4]byte{}, [4]byte{}, 0, 0, 0, 0, 0, 0, nil))
	f.Add([]byte{1, 2, 3})
	f.Add(binary.LittleEndian.AppendUint32(rawRecord([4]byte{1, 2, 3, 4}, [4]byte{5, 6, 7, 8}, 1, 2, 3, 1000|ParkedFlag, 4, 5, nil), 1))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRecord(b)
		if err != nil {
			if !errors.Is(err, ErrBadRecord) {
				t.Fatalf("error %v does not wrap ErrBadRecord", err)
			}
			return
		}
		switch {
		case r.Parked > 0 && (len(b) != RecordHeaderLen+4 || len(r.Payload) != 0):
			t.Fatalf("accepted a parked record of %d bytes with a %d-byte payload", len(b), len(r.Payload))
		case r.Parked == 0 && len(b) != RecordHeaderLen+len(r.Payload):
			t.Fatalf("accepted %d bytes with a %d-byte payload", len(b), len(r.Payload))
		}
		enc, err := AppendRecord(nil, r)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(enc, b) {
			t.Fatalf("round trip changed the record:\n got %x\nwant %x", enc, b)
		}
	})
}
