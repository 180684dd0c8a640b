package recvdigest

import (
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
)

func TestVerify(t *testing.T) {
	const (
		base = 3*B + 1000 // the flow's first byte lies inside block 3
		size = 5 * B      // the stream ends at 8B+1000
	)
	const wrapBase = uint32(1<<32 - 2*B - 300)
	noPrefix := func(uint32, []byte) Prefix { return Prefix{} }
	// prefixFrom is what a sender that began at seq had sent of from's block before from.
	prefixFrom := func(start uint32, from uint32) func(uint32, []byte) Prefix {
		return func(b uint32, s []byte) Prefix {
			return Prefix{Known: true, Len: from - start, CRC: crcOf(b, s, start, from)}
		}
	}
	dropPiece := func(seq uint32) func([]Piece) []Piece {
		return func(ps []Piece) []Piece {
			return slices.DeleteFunc(ps, func(p Piece) bool { return p.Seq == seq })
		}
	}
	type want struct {
		verified uint64
		err      string // "", "mismatch", "unverified"
		from, to uint32 // the error's range
		reason   string // a part of an UnverifiedError's reason
	}
	tests := []struct {
		name     string
		base     uint32
		from, to uint32
		prefix   func(base uint32, stream []byte) Prefix
		edit     func([]Piece) []Piece                                                  // of the receiver's record
		flip     []uint32                                                               // sequence numbers whose re-sent byte differs
		resent   func(base uint32, stream []byte) func(io.Writer, uint32, uint32) error // default resentOf
		want     want
	}{
		{name: "aligned from", from: 4 * B, to: 7*B + 500, prefix: noPrefix, want: want{verified: 3*B + 500}},
		{name: "unaligned from with prefix", from: 4*B + 777, to: 7 * B, prefix: prefixFrom(4*B, 4*B+777), want: want{verified: 3*B - 777}},
		{name: "unaligned from without prefix", from: 4*B + 777, to: 7 * B, prefix: noPrefix,
			want: want{verified: 2 * B, err: "unverified", from: 4*B + 777, to: 5 * B, reason: "could not tell what it had sent"}},
		{name: "inside one block", from: 5*B + 100, to: 5*B + 200, prefix: prefixFrom(5*B, 5*B+100), want: want{verified: 100}},
		{name: "several whole blocks", from: 4 * B, to: 8 * B, prefix: noPrefix, want: want{verified: 4 * B}},
		{name: "mismatch in a middle block", from: 4 * B, to: 8 * B, prefix: noPrefix, flip: []uint32{6*B + 12345},
			want: want{verified: 2 * B, err: "mismatch", from: 6 * B, to: 7 * B}},
		{name: "mismatch in the last byte before to", from: 4 * B, to: 7*B + 10, prefix: noPrefix, flip: []uint32{7*B + 9},
			want: want{verified: 3 * B, err: "mismatch", from: 7 * B, to: 8 * B}},
		{name: "hole in the record", from: 4 * B, to: 8 * B, prefix: noPrefix, edit: dropPiece(6 * B),
			want: want{verified: 3 * B, err: "unverified", from: 6 * B, to: 7 * B, reason: "hole [393216, 458752)"}},
		{name: "record starts after from", from: 3*B + 500, to: 5 * B, prefix: func(uint32, []byte) Prefix { return Prefix{Known: true, Len: 500, CRC: 1234} },
			want: want{verified: 2*B - 1000, err: "unverified", from: 3*B + 500, to: base, reason: "starts at 197608"}},
		{name: "nothing re-sent", from: 5*B + 3, to: 5*B + 3, prefix: noPrefix, want: want{}},
		{name: "to before from", from: 5*B + 3, to: 5 * B, prefix: noPrefix, want: want{}},
		{name: "piece straddling to, bytes available", from: 4 * B, to: 6*B + 10, prefix: noPrefix, want: want{verified: 2*B + 10}},
		{name: "piece straddling to, bytes past to missing", from: 4 * B, to: 6*B + 10, prefix: noPrefix,
			resent: func(b uint32, s []byte) func(io.Writer, uint32, uint32) error { return resentOf(b, s[:6*B+10-b]) },
			want:   want{verified: 2 * B, err: "unverified", from: 6 * B, to: 6*B + 10, reason: "past what it acknowledged"}},
		{name: "resent failing", from: 4 * B, to: 6 * B, prefix: noPrefix,
			resent: func(uint32, []byte) func(io.Writer, uint32, uint32) error {
				return func(io.Writer, uint32, uint32) error { return errors.New("trimmed") }
			},
			want: want{err: "unverified", from: 4 * B, to: 5 * B, reason: "trimmed"}},
		{name: "resent short", from: 4 * B, to: 5 * B, prefix: noPrefix,
			resent: func(b uint32, s []byte) func(io.Writer, uint32, uint32) error {
				return func(w io.Writer, seq, n uint32) error { return resentOf(b, s)(w, seq, n-1) }
			},
			want: want{err: "unverified", from: 4 * B, to: 5 * B, reason: "supplied 65535 of the 65536"}},
		{name: "wrap around 2^32", base: wrapBase, from: 1<<32 - B + 40, to: 2*B + 5, prefix: prefixFrom(1<<32-B, 1<<32-B+40),
			want: want{verified: 3*B + 5 - 40}},
		{name: "mismatch after the wrap", base: wrapBase, from: 1<<32 - B, to: 2*B + 5, prefix: noPrefix, flip: []uint32{B + 1},
			want: want{verified: 2 * B, err: "mismatch", from: B, to: 2 * B}},
		{name: "flow's first byte inside from's block", from: base + 4000, to: 6 * B, prefix: prefixFrom(base, base+4000), want: want{verified: 6*B - base - 4000}},
		{name: "prefix and record disagree on the flow's start", from: base + 4000, to: 6 * B, prefix: func(uint32, []byte) Prefix { return Prefix{Known: true, Len: base + 4000 - 3*B, CRC: 1234} },
			want: want{verified: 2 * B, err: "unverified", from: base + 4000, to: 4 * B, reason: "disagree"}},
		{name: "wrong prefix", from: 4*B + 777, to: 7 * B, flip: []uint32{4*B + 5}, prefix: prefixFrom(4*B, 4*B+777),
			want: want{err: "mismatch", from: 4 * B, to: 5 * B}},
		{name: "hole then mismatch", from: 4 * B, to: 8 * B, prefix: noPrefix, edit: dropPiece(5 * B), flip: []uint32{6*B + 5},
			want: want{verified: B, err: "mismatch", from: 6 * B, to: 7 * B}},
		{name: "record ends before to", from: 4 * B, to: base + size + 100, prefix: noPrefix,
			want: want{verified: base + size - 4*B, err: "unverified", from: base + size, to: base + size + 100, reason: "ends at"}},
		{name: "empty record", from: 4 * B, to: 5 * B, prefix: noPrefix, edit: func([]Piece) []Piece { return nil },
			want: want{err: "unverified", from: 4 * B, to: 5 * B, reason: "none"}},
		{name: "malformed record", from: 4 * B, to: 5 * B, prefix: noPrefix,
			edit: func(ps []Piece) []Piece { return append(ps, ps[0]) },
			want: want{err: "unverified", from: 4 * B, to: 5 * B, reason: "malformed"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := tt.base
			if b == 0 {
				b = base
			}
			stream := randomBytes(uint64(b), size)
			rec := Received{Conn: testConn, Pieces: piecesOf(b, stream)}
			if tt.edit != nil {
				rec.Pieces = tt.edit(rec.Pieces)
			}
			sent := slices.Clone(stream)
			for _, seq := range tt.flip {
				sent[seq-b] ^= 0x20
			}
			rs := resentOf(b, sent)
			if tt.resent != nil {
				rs = tt.resent(b, sent)
			}
			got, err := Verify(rec, tt.from, tt.to, tt.prefix(b, sent), rs)
			if got != tt.want.verified {
				t.Errorf("verified %d bytes, want %d (err %v)", got, tt.want.verified, err)
			}
			var mm *MismatchError
			var uv *UnverifiedError
			switch tt.want.err {
			case "":
				if err != nil {
					t.Fatalf("err = %v, want nil", err)
				}
			case "mismatch":
				if !errors.As(err, &mm) || !errors.Is(err, ErrNondeterministic) {
					t.Fatalf("err = %v, want a *MismatchError", err)
				}
				if mm.From != tt.want.from || mm.To != tt.want.to || mm.Conn != testConn || mm.Got == mm.Want {
					t.Errorf("mismatch %+v, want [%d, %d) of %v", mm, tt.want.from, tt.want.to, testConn)
				}
			case "unverified":
				if !errors.As(err, &uv) || !errors.Is(err, ErrUnverified) || errors.Is(err, ErrNondeterministic) {
					t.Fatalf("err = %v, want an *UnverifiedError", err)
				}
				if uv.From != tt.want.from || uv.To != tt.want.to || uv.Conn != testConn {
					t.Errorf("unverified [%d, %d) of %v, want [%d, %d)", uv.From, uv.To, uv.Conn, tt.want.from, tt.want.to)
				}
				if !strings.Contains(uv.Reason, tt.want.reason) {
					t.Errorf("reason %q does not say %q", uv.Reason, tt.want.reason)
				}
			}
			if err != nil && !strings.Contains(err.Error(), testConn.String()) {
				t.Errorf("error %q does not name the connection", err)
			}
		})
	}
}

// TestVerifyAsksOnlyForTheNeededBytes checks that resent is asked exactly for the re-sent bytes each
// piece needs: from the first re-sent byte (not before: the prefix covers those), up to the piece's end.
func TestVerifyAsksOnlyForTheNeededBytes(t *testing.T) {
	const base = 2 * B
	stream := randomBytes(7, 3*B)
	rec := Received{Conn: testConn, Pieces: piecesOf(base, stream)}
	from, to := uint32(2*B+100), uint32(4*B+50)
	var asked [][2]uint32
	rs := func(w io.Writer, seq, n uint32) error {
		asked = append(asked, [2]uint32{seq, seq + n})
		return resentOf(base, stream)(w, seq, n)
	}
	n, err := Verify(rec, from, to, Prefix{Known: true, Len: 100, CRC: crcOf(base, stream, base, from)}, rs)
	if err != nil || n != uint64(to-from) {
		t.Fatalf("Verify = %d, %v; want %d, nil", n, err, to-from)
	}
	want := [][2]uint32{{from, 3 * B}, {3 * B, 4 * B}, {4 * B, 5 * B}}
	if !slices.Equal(asked, want) {
		t.Errorf("asked for %v, want %v", asked, want)
	}
}
