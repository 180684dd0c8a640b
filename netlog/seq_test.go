package netlog

import (
	"math"
	"testing"
)

func TestUnwrapNear(t *testing.T) {
	const e1 = AnchorEpoch // epoch 1
	const e2 = 2 * AnchorEpoch
	tests := []struct {
		name string
		ref  uint64
		seq  uint32
		want uint64
	}{
		{"same", e1 | 1000, 1000, e1 | 1000},
		{"ahead", e1 | 1000, 5000, e1 | 5000},
		{"behind (retransmission)", e1 | 5000, 1000, e1 | 1000},
		{"ahead across the wrap", e1 | (math.MaxUint32 - 10), 20, e2 | 20},
		{"ref at last value, seq 0", e1 | math.MaxUint32, 0, e2},
		{"behind across the wrap", e2 | 20, math.MaxUint32 - 10, e1 | (math.MaxUint32 - 10)},
		{"behind across the wrap to the last value", e2, math.MaxUint32, e1 | math.MaxUint32},
		{"just under half ahead", e1, 1<<31 - 1, e1 | (1<<31 - 1)},
		{"exactly half away counts as behind", e1, 1 << 31, e1 - 1<<31},
		{"exactly half away from a high ref", e1 | 0xF000_0000, 0x7000_0000, e1 | 0x7000_0000},
		{"half minus one ahead across the wrap", e1 | 0xF000_0000, 0x6FFF_FFFF, e2 | 0x6FFF_FFFF},
		{"epoch 0 below the anchor", e1 | 5, math.MaxUint32 - 4, math.MaxUint32 - 4},
		{"far epochs", 7*AnchorEpoch | 3, math.MaxUint32, 6*AnchorEpoch | math.MaxUint32},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := UnwrapNear(tt.ref, tt.seq)
			if got != tt.want {
				t.Fatalf("UnwrapNear(%#x, %#x) = %#x, want %#x", tt.ref, tt.seq, got, tt.want)
			}
			if Wire(got) != tt.seq {
				t.Fatalf("Wire(%#x) = %#x, want %#x", got, Wire(got), tt.seq)
			}
		})
	}
}

// TestUnwrapperStream follows a sender across several wraps, with retransmissions of older
// data interleaved, and checks every unwrap against the true position.
func TestUnwrapperStream(t *testing.T) {
	tests := []struct {
		name string
		isn  uint32
	}{
		{"start at 0", 0},
		{"start just before the wrap", math.MaxUint32 - 100},
		{"start mid-range", 1 << 31},
		{"start at the top", math.MaxUint32},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var u Unwrapper
			if u.Anchored() {
				t.Fatal("zero Unwrapper is anchored")
			}
			if got := u.Peek(tt.isn); got != AnchorEpoch|uint64(tt.isn) {
				t.Fatalf("Peek on unanchored = %#x", got)
			}
			if u.Anchored() {
				t.Fatal("Peek anchored the unwrapper")
			}
			base := u.Unwrap(tt.isn)
			if base != AnchorEpoch|uint64(tt.isn) || !u.Anchored() {
				t.Fatalf("first Unwrap = %#x, anchored %v", base, u.Anchored())
			}
			// 3.5 wraps in 1 GiB steps (the largest TCP window), retransmitting a full
			// window behind every time.
			const step = 1 << 30
			for off := uint64(0); off < 7*(1<<31); off += step {
				abs := base + off
				if got := u.Unwrap(uint32(abs)); got != abs {
					t.Fatalf("offset %d: Unwrap(%#x) = %#x, want %#x", off, uint32(abs), got, abs)
				}
				u.Observe(abs + step)
				if off >= step {
					old := abs - step + 17
					if got := u.Unwrap(uint32(old)); got != old {
						t.Fatalf("retransmission at offset %d: Unwrap(%#x) = %#x, want %#x", off-step+17, uint32(old), got, old)
					}
				}
			}
			// Observe never moves backwards.
			ref := u.Ref()
			u.Observe(ref - 1000)
			if u.Ref() != ref {
				t.Fatalf("Observe moved the reference back from %#x to %#x", ref, u.Ref())
			}
		})
	}
}

func TestUnwrapperAnchorBeforeData(t *testing.T) {
	var u Unwrapper
	inq := uint32(math.MaxUint32 - 3)
	base := u.Anchor(inq)
	// Data sent before the snapshot (retransmitted) lands in epoch 0 or just below base.
	if got := u.Unwrap(inq - 100); got != base-100 {
		t.Fatalf("older data: got %#x, want %#x", got, base-100)
	}
	// Data after the snapshot crosses the wrap into epoch 2.
	if got := u.Unwrap(10); got != base+14 {
		t.Fatalf("newer data across the wrap: got %#x, want %#x", got, base+14)
	}
}
