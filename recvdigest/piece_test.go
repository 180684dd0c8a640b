package recvdigest

import (
	"encoding/json"
	"io"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/tcpflow"
)

func TestBlockStart(t *testing.T) {
	tests := []struct{ seq, want uint32 }{
		{0, 0}, {B - 1, 0}, {B, B}, {5*B + 17, 5 * B}, {1<<32 - 1, 1<<32 - B},
	}
	for _, tt := range tests {
		if got := BlockStart(tt.seq); got != tt.want {
			t.Errorf("BlockStart(%d) = %d, want %d", tt.seq, got, tt.want)
		}
	}
}

func TestReceivedValidate(t *testing.T) {
	ok := func(ps ...Piece) Received { return Received{Conn: testConn, Pieces: ps} }
	many := make([]Piece, MaxPieces+1)
	for i := range many {
		many[i] = Piece{Seq: uint32(i) * B, Len: B}
	}
	tests := []struct {
		name string
		r    Received
		err  string // "" for valid
	}{
		{"empty", ok(), ""},
		{"whole blocks", ok(Piece{B, B, 1}, Piece{2 * B, B, 2}), ""},
		{"run starts mid-block", ok(Piece{B + 10, B - 10, 1}, Piece{2 * B, 5, 2}), ""},
		{"hole", ok(Piece{B, 100, 1}, Piece{B + 200, B - 200, 2}), ""},
		{"across the wrap", ok(Piece{1<<32 - B, B, 1}, Piece{0, B, 2}), ""},
		{"the most pieces", ok(many[:MaxPieces]...), ""},
		{"too many pieces", ok(many...), "more than the 16384"},
		{"empty piece", ok(Piece{B, 0, 1}), "length 0"},
		{"piece longer than a block", ok(Piece{B, B + 1, 1}), "length 65537"},
		{"piece crossing a block boundary", ok(Piece{B + 1, B, 1}), "crosses"},
		{"piece crossing the wrap", ok(Piece{1<<32 - 10, 20, 1}), "crosses"},
		{"overlap", ok(Piece{B, 100, 1}, Piece{B + 50, 100, 2}), "overlaps"},
		{"out of order", ok(Piece{2 * B, 100, 1}, Piece{B, 100, 2}), "overlaps or precedes"},
		{"duplicate", ok(Piece{B, 100, 1}, Piece{B, 100, 1}), "overlaps"},
		{"span too wide", ok(Piece{0, 1, 1}, Piece{MaxSpan, 1, 2}), "span more than"},
		{"widest span", ok(Piece{0, 1, 1}, Piece{MaxSpan - 1, 1, 2}), ""},
		{"no sender", Received{Conn: tcpflow.Tuple{Remote: testConn.Remote}}, "local address"},
		{"unspecified receiver", Received{Conn: tcpflow.Tuple{Local: testConn.Local, Remote: netip.MustParseAddrPort("0.0.0.0:5000")}}, "remote address"},
		{"port 0", Received{Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.2:0"), Remote: testConn.Remote}}, "local address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.r.Validate()
			switch {
			case tt.err == "" && err != nil:
				t.Fatalf("Validate = %v, want nil", err)
			case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
				t.Fatalf("Validate = %v, want an error saying %q", err, tt.err)
			}
		})
	}
}

func TestReceivedJSON(t *testing.T) {
	r := Received{Conn: testConn, Pieces: piecesOf(3*B+5, randomBytes(1, 3*B))}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var back Received
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Conn != r.Conn || !slices.Equal(back.Pieces, r.Pieces) {
		t.Fatalf("round trip: %+v, want %+v", back, r)
	}
	// Inside a message, as a recovery request carries it.
	msg, err := json.Marshal(struct{ Received []Received }{[]Received{r, {Conn: testConn}}})
	if err != nil {
		t.Fatal(err)
	}
	var m struct{ Received []Received }
	if err := json.Unmarshal(msg, &m); err != nil || len(m.Received) != 2 || len(m.Received[1].Pieces) != 0 {
		t.Fatalf("in a message: %+v, %v", m, err)
	}

	// The most a Book keeps of a flow fits well under 1 MiB.
	full := Received{Conn: tcpflow.Tuple{Local: netip.MustParseAddrPort("[2001:db8::1234:5678]:65535"), Remote: netip.MustParseAddrPort("[2001:db8::8765:4321]:65535")}}
	for i := range MaxPieces {
		full.Pieces = append(full.Pieces, Piece{Seq: 1<<32 - B*MaxPieces/2 + uint32(i)*B, Len: B, CRC: 0xffffffff - uint32(i)})
	}
	b, err = json.Marshal(full)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d pieces: %d bytes of JSON", MaxPieces, len(b))
	if len(b) > 300<<10 {
		t.Errorf("%d pieces take %d bytes of JSON, want under 300 KiB", MaxPieces, len(b))
	}
	if err := json.Unmarshal(b, &back); err != nil || len(back.Pieces) != MaxPieces {
		t.Fatalf("the largest record does not decode: %d pieces, %v", len(back.Pieces), err)
	}
}

func TestReceivedUnmarshalRefuses(t *testing.T) {
	valid := `{"src":"10.0.0.2:40000","dst":"10.0.0.3:5000","pieces":""}`
	tests := []struct{ name, in, err string }{
		{"not base64", strings.Replace(valid, `""`, `"!!!!"`, 1), "illegal base64"},
		{"not whole pieces", strings.Replace(valid, `""`, `"AAAAAAAAAAA="`, 1), "not a multiple of 12"},
		{"empty piece", strings.Replace(valid, `""`, `"AAEAAAAAAAAAAAAB"`, 1), "length 0"},
		{"too long", strings.Replace(valid, `""`, `"`+strings.Repeat("A", maxPiecesBase64+4)+`"`, 1), "more than 16384 pieces"},
		{"no addresses", `{"pieces":""}`, "not a TCP endpoint"},
		{"bad address", `{"src":"10.0.0.2","dst":"10.0.0.3:5000"}`, "not an ip:port"},
		{"not an object", `[1]`, "cannot unmarshal"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r Received
			err := json.Unmarshal([]byte(tt.in), &r)
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Fatalf("Unmarshal = %v, want an error saying %q", err, tt.err)
			}
			if r.Conn != (tcpflow.Tuple{}) || r.Pieces != nil {
				t.Errorf("a refused record left %+v", r)
			}
		})
	}
	var r Received
	if err := json.Unmarshal([]byte(valid), &r); err != nil || r.Conn != testConn {
		t.Fatalf("valid empty record: %+v, %v", r, err)
	}
}

// FuzzReceivedDecode decodes receive digests as another node sends them: never a panic, never more than
// MaxPieces pieces, what is accepted is valid, survives a round trip (its FIN too), and Verify and
// VerifyFin can run on it.
func FuzzReceivedDecode(f *testing.F) {
	good, _ := json.Marshal(Received{Conn: testConn, Pieces: piecesOf(3*B+5, randomBytes(2, 2*B))})
	f.Add(good, uint32(4*B), uint32(5*B))
	f.Add([]byte(`{"src":"10.0.0.2:1","dst":"10.0.0.3:2","pieces":""}`), uint32(0), uint32(10))
	f.Add([]byte(`{"src":"10.0.0.2:1","dst":"10.0.0.3:2","pieces":"//8AAAAAAAoAAAAB"}`), uint32(1<<32-10), uint32(5))
	f.Add([]byte(`{"src":"[::1]:1","dst":"10.0.0.3:2","pieces":"AAEAAAABAAAAAAAB"}`), uint32(1), uint32(2))
	f.Add([]byte(`{"src":"10.0.0.2:1","dst":"10.0.0.3:2","pieces":"AAAAAAAAAAA="}`), uint32(0), uint32(0))
	f.Add([]byte(`null`), uint32(0), uint32(1))
	fin := uint32(5*B + 5)
	withFin, _ := json.Marshal(Received{Conn: testConn, Pieces: piecesOf(3*B+5, randomBytes(2, 2*B)), Fin: &fin})
	f.Add(withFin, uint32(4*B), fin+1)
	f.Add([]byte(`{"src":"10.0.0.2:1","dst":"10.0.0.3:2","pieces":"//8AAAAAAAoAAAAB","fin":4}`), uint32(1<<32-10), uint32(5))
	f.Add([]byte(`{"src":"10.0.0.2:1","dst":"10.0.0.3:2","pieces":"","fin":4294967295}`), uint32(0), uint32(0))
	f.Fuzz(func(t *testing.T, b []byte, from, to uint32) {
		var r Received
		if json.Unmarshal(b, &r) != nil {
			return
		}
		if len(r.Pieces) > MaxPieces {
			t.Fatalf("%d pieces accepted", len(r.Pieces))
		}
		if r.Conn == (tcpflow.Tuple{}) {
			if r.Validate() == nil {
				t.Fatal("the zero record validates")
			}
			return // null
		}
		if err := r.Validate(); err != nil {
			t.Fatalf("decoded record does not validate: %v", err)
		}
		again, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		var back Received
		if err := json.Unmarshal(again, &back); err != nil || back.Conn != r.Conn || !slices.Equal(back.Pieces, r.Pieces) ||
			(back.Fin == nil) != (r.Fin == nil) || r.Fin != nil && *back.Fin != *r.Fin {
			t.Fatalf("round trip: %+v, %v; want %+v", back, err, r)
		}
		if r.Fin != nil && len(r.Pieces) > 0 && *r.Fin != r.Pieces[len(r.Pieces)-1].End() {
			t.Fatalf("a FIN at %d accepted, not at the record's end", *r.Fin)
		}
		zeros := func(w io.Writer, _, n uint32) error {
			_, err := w.Write(make([]byte, min(n, 1<<17)))
			return err
		}
		n, err := Verify(r, from, to, Prefix{Known: true, Len: from - BlockStart(from)}, zeros)
		if length := int64(int32(to - from)); err == nil && int64(n) != max(length, 0) {
			t.Fatalf("Verify succeeded with %d of %d bytes verified", n, length)
		}
		// The restored sender's FIN where the record has it, to cover the FIN's path.
		n, err = VerifyFin(r, from, to, to-1, true, Prefix{Known: true, Len: from - BlockStart(from)}, zeros)
		if length := int64(int32(to - from)); err == nil && int64(n) != max(length, 0) && (r.Fin == nil || *r.Fin != to-1 || int64(n) != length-1) {
			t.Fatalf("VerifyFin succeeded with %d of %d sequence numbers verified (FIN %v)", n, length, r.Fin)
		}
	})
}
