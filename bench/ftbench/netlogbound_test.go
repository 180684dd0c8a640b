package main

import (
	"bytes"
	"math/rand/v2"
	"testing"
)

// TestShadowCopy checks that each copy mode copies exactly the bytes sent, the sender's own copy in the
// order they were sent, whatever the write size and however the sender wraps round its buffer.
func TestShadowCopy(t *testing.T) {
	data := make([]byte, 1<<20)
	_, _ = rand.NewChaCha8([32]byte{9}).Read(data)
	for _, tc := range []struct {
		mode         string
		wsize, total int
	}{
		{"", 256 << 10, 4 << 20},
		{"sender", 256 << 10, 20 << 20},
		{"sender", 100_000, 20<<20 + 12345},
		{"sender", 64, 1 << 20},
		{"beside", 256 << 10, 20 << 20},
		{"beside", 100_000, 3*copyBatch + 777},
	} {
		s, err := newShadowCopy(tc.mode, data)
		if err != nil {
			t.Fatalf("%q: %v", tc.mode, err)
		}
		var sent []byte
		for n, off := 0, 0; n < tc.total; {
			k := min(tc.wsize, tc.total-n)
			if off+k > len(data) { // as bulkSend wraps
				off = 0
			}
			sent = append(sent, data[off:off+k]...)
			s.sent(off, k)
			n += k
			off += k
		}
		copied, cpu, err := s.finish()
		want := int64(tc.total)
		if tc.mode == "" {
			want = 0
		}
		if err != nil || copied != want {
			t.Errorf("mode %q, writes of %d: copied %d bytes (%v), want %d", tc.mode, tc.wsize, copied, err, want)
		}
		if tc.mode == "sender" && !bytes.Equal(s.dst[:tc.total], sent) {
			t.Errorf("mode sender, writes of %d: the copy differs from the bytes sent", tc.wsize)
		}
		if tc.mode == "beside" && cpu <= 0 {
			t.Errorf("mode beside: copier CPU %v, want > 0", cpu)
		}
	}
	if _, err := newShadowCopy("elsewhere", data); err == nil {
		t.Error("newShadowCopy accepted an unknown mode")
	}
}

func TestTCPPayload(t *testing.T) {
	frame := func(ethType uint16, version, ihlWords, proto byte, total int, doffWords byte) []byte {
		f := make([]byte, 14+int(ihlWords)*4+20)
		f[12], f[13] = byte(ethType>>8), byte(ethType)
		f[14] = version<<4 | ihlWords
		f[16], f[17] = byte(total>>8), byte(total)
		f[14+9] = proto
		f[14+int(ihlWords)*4+12] = doffWords << 4
		return f
	}
	for _, tc := range []struct {
		name  string
		frame []byte
		want  int64
	}{
		{"segment with timestamps", frame(0x0800, 4, 5, 6, 1500, 8), 1448},
		{"GSO segment", frame(0x0800, 4, 5, 6, 65226, 8), 65174},
		{"IP options", frame(0x0800, 4, 6, 6, 1500, 5), 1456},
		{"pure ACK", frame(0x0800, 4, 5, 6, 52, 8), 0},
		{"UDP", frame(0x0800, 4, 5, 17, 1500, 8), 0},
		{"IPv6 frame", frame(0x86dd, 6, 5, 6, 1500, 8), 0},
		{"ARP", frame(0x0806, 4, 5, 6, 1500, 8), 0},
		{"bad IHL", frame(0x0800, 4, 2, 6, 1500, 8), 0},
		{"headers cut short", frame(0x0800, 4, 5, 6, 1500, 8)[:40], 0},
		{"empty", nil, 0},
	} {
		if got := tcpPayload(tc.frame); got != tc.want {
			t.Errorf("%s: tcpPayload = %d, want %d", tc.name, got, tc.want)
		}
	}
}
