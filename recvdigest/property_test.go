package recvdigest

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestBookVerifyProperty ties the Book and Verify together: whatever the record splits, duplicates and
// small reorders, a sender that re-sends the same stream verifies every byte of [from, to), and one
// flipped byte in [from, to) is reported as a mismatch of the block holding it.
func TestBookVerifyProperty(t *testing.T) {
	r := rand.New(rand.NewPCG(2026, 11))
	for iter := range 200 {
		base := r.Uint32()
		if iter%4 == 0 {
			base = -uint32(r.IntN(3 * B)) // close below the wrap
		}
		stream := randomBytes(uint64(iter), 1+r.IntN(5*B))
		var segs []segment
		for _, s := range splitStream(r, len(stream)) {
			segs = append(segs, s)
			if r.IntN(5) == 0 {
				back := min(s.off, r.IntN(4000))
				segs = append(segs, segment{s.off - back, back + s.n}) // a retransmission overlapping earlier bytes
			}
		}
		for j := 1; j+1 < len(segs); j++ {
			if r.IntN(6) == 0 {
				segs[j], segs[j+1] = segs[j+1], segs[j]
			}
		}
		b := NewBook(BookOptions{})
		addAll(b, testConn, base, stream, segs)
		if st := b.Stats(); st.Holes != 0 || st.HeldBytes != 0 {
			t.Fatalf("iteration %d: stats %+v", iter, st)
		}

		from := base + uint32(r.IntN(len(stream)+1))
		to := from + uint32(r.IntN(int(base+uint32(len(stream))-from)+1))
		rec, ok := b.Received(testConn, from)
		if !ok {
			t.Fatal("flow unknown")
		}
		// As another node sends it.
		wire, err := json.Marshal(rec)
		if err != nil {
			t.Fatal(err)
		}
		var got Received
		if err := json.Unmarshal(wire, &got); err != nil {
			t.Fatal(err)
		}
		start := BlockStart(from)
		if int32(start-base) < 0 {
			start = base // the connection's first byte lies inside from's block
		}
		prefix := Prefix{Known: true, Len: from - start, CRC: crcOf(base, stream, start, from)}

		n, err := Verify(got, from, to, prefix, resentOf(base, stream))
		if err != nil || n != uint64(to-from) {
			t.Fatalf("iteration %d: base %d, %d bytes, [%d, %d): Verify = %d, %v; want all verified", iter, base, len(stream), from, to, n, err)
		}
		if to == from {
			continue
		}
		flip := from + uint32(r.IntN(int(to-from)))
		sent := slices.Clone(stream)
		sent[flip-base] ^= 1 << r.IntN(8)
		_, err = Verify(got, from, to, prefix, resentOf(base, sent))
		var mm *MismatchError
		if !errors.As(err, &mm) {
			t.Fatalf("iteration %d: byte %d of [%d, %d) flipped: Verify = %v, want a mismatch", iter, flip, from, to, err)
		}
		if flip-mm.From >= mm.To-mm.From || BlockStart(mm.From) != BlockStart(flip) {
			t.Fatalf("iteration %d: byte %d flipped, mismatch names [%d, %d)", iter, flip, mm.From, mm.To)
		}
	}
}
