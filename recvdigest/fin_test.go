package recvdigest

import (
	"errors"
	"io"
	"strings"
	"testing"
)

// TestVerifyFin: a sender whose FIN its receiver had taken in re-sends its bytes and its FIN; the
// receiver's rcv_nxt (to) counts the FIN, which its tap never records. The FIN passes only where the
// receiver had it and where the restored sender put its own, right after the same bytes; a record without
// a FIN is checked as before (the last sequence number unverified).
func TestVerifyFin(t *testing.T) {
	const (
		base = 4*B + 100 // the stream's first byte; the check starts at from
		from = 5 * B
		end  = 6*B + 700 // the stream's last byte is end-1, its FIN at end
	)
	stream := randomBytes(7, end-base)
	at := func(v uint32) *uint32 { return &v }
	tests := []struct {
		name     string
		fin      *uint32 // the receiver's record of the FIN
		to       uint32  // the receiver's rcv_nxt
		ownFin   uint32
		ownFinOK bool
		flip     uint32 // a sequence number whose re-sent byte differs (0: none)
		want     string // "" (verified), "nondeterministic", "mismatch", "unverified"
		reason   string // a part of the error
	}{
		{name: "the FIN at to-1, re-sent there after the same bytes: passes", fin: at(end), to: end + 1, ownFin: end, ownFinOK: true},
		{name: "no FIN in the record: refused as before", to: end + 1, ownFin: end, ownFinOK: true, want: "unverified", reason: "ends at 393916, before what it acknowledged (393917)"},
		{name: "the restored sender sent no FIN", fin: at(end), to: end + 1, want: "nondeterministic", reason: "sent no FIN"},
		{name: "the restored sender's FIN one earlier", fin: at(end), to: end + 1, ownFin: end - 1, ownFinOK: true, want: "nondeterministic", reason: "sent its FIN at 393915"},
		{name: "bytes differ before the FIN", fin: at(end), to: end + 1, ownFin: end, ownFinOK: true, flip: end - 5, want: "mismatch"},
		{name: "the FIN at to: a normal check of the bytes before it", fin: at(end), to: end, want: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := Received{Conn: testConn, Pieces: piecesOf(base, stream), Fin: tt.fin}
			resent := stream
			if tt.flip != 0 {
				resent = append([]byte(nil), stream...)
				resent[tt.flip-base] ^= 0x40
			}
			prefix := Prefix{Known: true, Len: from - 4*B - 100, CRC: crcOf(base, stream, base, from)}
			n, err := VerifyFin(rec, from, tt.to, tt.ownFin, tt.ownFinOK, prefix, resentOf(base, resent))
			var mm *MismatchError
			switch tt.want {
			case "":
				if err != nil || n != end-from {
					t.Fatalf("VerifyFin = %d, %v; want all %d bytes verified", n, err, end-from)
				}
				return
			case "nondeterministic":
				if !errors.Is(err, ErrNondeterministic) || errors.As(err, &mm) {
					t.Fatalf("VerifyFin = %d, %v; want a FIN difference (%v)", n, err, ErrNondeterministic)
				}
			case "mismatch":
				if !errors.As(err, &mm) || mm.To != end {
					t.Fatalf("VerifyFin = %d, %v; want a mismatch of the last piece", n, err)
				}
			case "unverified":
				if !errors.Is(err, ErrUnverified) {
					t.Fatalf("VerifyFin = %d, %v; want %v", n, err, ErrUnverified)
				}
			}
			if !strings.Contains(err.Error(), tt.reason) {
				t.Errorf("error %q does not say %q", err, tt.reason)
			}
		})
	}
}

// TestReceivedFin: a record's FIN must be at the end of its last piece, in Go and in JSON (which another
// node sends), and survives a round trip; a record from a receiver that does not report FINs has none.
func TestReceivedFin(t *testing.T) {
	ps := piecesOf(B+10, randomBytes(3, B))
	at := func(v uint32) *uint32 { return &v }
	for _, tt := range []struct {
		name string
		fin  *uint32
		err  string
	}{
		{"none", nil, ""},
		{"at the end of the last piece", at(2*B + 10), ""},
		{"before the last piece's end", at(2*B + 9), "not at the end of the last piece (131082)"},
		{"past the last piece's end", at(2*B + 11), "not at the end"},
		{"inside an earlier piece", at(B + 20), "not at the end"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := Received{Conn: testConn, Pieces: ps, Fin: tt.fin}
			err := r.Validate()
			if tt.err == "" && err != nil || tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)) {
				t.Fatalf("Validate = %v, want %q", err, tt.err)
			}
			b, merr := r.MarshalJSON()
			if merr != nil {
				t.Fatal(merr)
			}
			if (tt.fin == nil) == strings.Contains(string(b), `"fin"`) {
				t.Errorf("JSON %s: fin present %v, want %v", b, !(tt.fin == nil), tt.fin != nil)
			}
			var back Received
			uerr := back.UnmarshalJSON(b)
			if (uerr == nil) != (err == nil) {
				t.Fatalf("decoding %s: %v, want it refused as Validate does (%v)", b, uerr, err)
			}
			if uerr == nil && (back.Fin == nil) != (tt.fin == nil) || back.Fin != nil && *back.Fin != *tt.fin {
				t.Errorf("round trip: FIN %v, want %v", back.Fin, tt.fin)
			}
		})
	}
	// A record of no piece: the sender sent nothing after where it was asked for but its FIN.
	empty := Received{Conn: testConn, Fin: at(5)}
	if err := empty.Validate(); err != nil {
		t.Errorf("a FIN with no piece: %v, want it valid (VerifyFin places it)", err)
	}
}

// TestVerifyFinAlone: a sender that sent nothing after its snapshot but its FIN, which the receiver took
// in: the receiver's record from the snapshot on has no piece, and the FIN right where the check begins.
// The restored sender must send its FIN there and nothing before it.
func TestVerifyFinAlone(t *testing.T) {
	const from = 4000
	at := func(v uint32) *uint32 { return &v }
	none := func(io.Writer, uint32, uint32) error { return errors.New("no byte was re-sent") }
	for _, tt := range []struct {
		name     string
		fin      *uint32
		ownFin   uint32
		ownFinOK bool
		want     error
	}{
		{"the FIN re-sent where the receiver took it", at(from), from, true, nil},
		{"the receiver says nothing of a FIN", nil, from, true, ErrUnverified},
		{"the receiver's FIN elsewhere", at(from + 7), from, true, ErrUnverified},
		{"the restored sender sent no FIN", at(from), 0, false, ErrNondeterministic},
		{"the restored sender sent a byte first", at(from), from + 1, true, ErrNondeterministic},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rec := Received{Conn: testConn, Fin: tt.fin}
			n, err := VerifyFin(rec, from, from+1, tt.ownFin, tt.ownFinOK, Prefix{}, none)
			if n != 0 || tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Fatalf("VerifyFin = %d, %v; want %v", n, err, tt.want)
			}
		})
	}
}
