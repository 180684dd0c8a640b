// Package recvdigest records, on the receiving host, a CRC-32C of every byte its protected sockets
// received, and checks at a recovery that every byte a restored sender re-sends equals what the surviving
// receiver already got.
//
// A restored job re-executes from its snapshot and re-sends the bytes [write_seq, rcv_nxt) of each
// connection: bytes its peer already received, which the peer's TCP discards as duplicates without
// looking at them. A program whose output depends on something other than its inputs re-sends different
// bytes and silently diverges from what its peers saw. The receiver is the one host that knows exactly
// what it got, so its eBPF ingress tap feeds a Book (Recorder), which keeps, per flow, CRC-32C pieces
// aligned on 64 KiB blocks of the TCP wire sequence space; at recovery the restorer fetches them
// (Received, whose JSON form is compact) and Verify compares the re-sent bytes with them. Verify succeeds
// only if every re-sent byte was compared; whatever it could not compare is an *UnverifiedError, never a
// silent success.
package recvdigest

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"net/netip"

	"github.com/ftkit/ftkit/tcpflow"
)

// BlockSize is the size of the blocks pieces are aligned on: [k*BlockSize, (k+1)*BlockSize) of the 32-bit
// wire sequence space. 2^32 is a multiple of it, so blocks are the same across a wrap.
const BlockSize = 64 << 10

// MaxPieces bounds the pieces of one flow a Book keeps and a Received may carry: 1 GiB of stream when every
// piece is a whole block.
const MaxPieces = 1 << 14

// MaxSpan bounds the sequence range a Received covers, from its first piece's first byte to its last
// piece's end, holes included. TCP windows are at most 2^30 bytes, and staying well inside half the 32-bit
// space keeps serial comparisons between any two of its sequence numbers unambiguous.
const MaxSpan = 1 << 30

// pieceWireLen is one piece in the binary encoding: Seq, Len, CRC, big-endian.
const pieceWireLen = 12

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// BlockStart returns the first sequence number of the block holding seq.
func BlockStart(seq uint32) uint32 { return seq &^ (BlockSize - 1) }

// Piece is the CRC-32C (Castagnoli) of the received bytes [Seq, Seq+Len) of one flow. A piece never crosses
// a block boundary; it starts at a block boundary unless it is the first of a run (the flow's first byte
// seen, or right after a hole); it ends at a block boundary unless it is the last of a run. Len is
// 1..BlockSize.
type Piece struct {
	Seq, Len, CRC uint32
}

// End returns the sequence number just past the piece.
func (p Piece) End() uint32 { return p.Seq + p.Len }

// Received is what a host's receiver recorded of one flow, named as its sender names it (as netlog does):
// Conn.Local is the remote sender, Conn.Remote the local receiver. Pieces are in ascending serial order and do not
// overlap; a gap between two pieces is a hole: bytes the receiver got but did not record.
//
// In JSON it is {"src": "ip:port", "dst": "ip:port", "pieces": "<base64>", "fin": seq}, where pieces holds
// 12 bytes per piece (Seq, Len, CRC, each a big-endian uint32): MaxPieces pieces take 256 KiB of base64;
// fin is omitted when Fin is nil (as a receiver from before Fin sends every record).
// UnmarshalJSON refuses what Validate refuses; a Received absent from a message is the zero value, which
// Validate also refuses, so validate data from another node before use (Verify does it itself).
type Received struct {
	Conn   tcpflow.Tuple
	Pieces []Piece
	// Fin, if set, is the sequence number of the sender's FIN, which the receiver took in: its receive tap
	// records no FIN, so its host reads it from the socket's state and its own ACK. It is the end of the
	// last piece (a FIN follows the last byte), so a record with a FIN ends where the stream ends; of a
	// record of no piece, where it was asked for from.
	Fin *uint32
}

// Validate checks a Received that came from another node: valid endpoints, at most MaxPieces pieces,
// each of 1..BlockSize bytes inside one block, in ascending order without overlap, spanning at most
// MaxSpan; a Fin right at the last piece's end.
func (r Received) Validate() error {
	if err := r.Conn.Validate(); err != nil {
		return fmt.Errorf("receive digests (local is the sender, remote the receiver): %w", err)
	}
	if len(r.Pieces) > MaxPieces {
		return fmt.Errorf("receive digests of %s: %d pieces, more than the %d a receiver keeps of one flow", r.Conn, len(r.Pieces), MaxPieces)
	}
	var span uint64
	for i, p := range r.Pieces {
		if p.Len == 0 || p.Len > BlockSize {
			return fmt.Errorf("receive digests of %s: piece %d at %d has length %d, not 1 to %d", r.Conn, i, p.Seq, p.Len, BlockSize)
		}
		if BlockStart(p.Seq) != BlockStart(p.Seq+p.Len-1) {
			return fmt.Errorf("receive digests of %s: piece %d [%d, %d) crosses a %d-byte block boundary", r.Conn, i, p.Seq, p.End(), BlockSize)
		}
		if i > 0 {
			prev := r.Pieces[i-1]
			gap := p.Seq - prev.End()
			if int32(gap) < 0 {
				return fmt.Errorf("receive digests of %s: piece %d [%d, %d) overlaps or precedes piece %d [%d, %d)", r.Conn, i, p.Seq, p.End(), i-1, prev.Seq, prev.End())
			}
			span += uint64(gap)
		}
		if span += uint64(p.Len); span > MaxSpan {
			return fmt.Errorf("receive digests of %s: pieces span more than %d bytes of sequence space", r.Conn, MaxSpan)
		}
	}
	// A FIN elsewhere than right after the last piece would have bytes after it, or a part of the stream
	// the record does not cover. A record of no piece (nothing received from where it was asked for) can
	// have its FIN anywhere: VerifyFin takes it only right where the check begins.
	if n := len(r.Pieces); r.Fin != nil && n > 0 {
		if end := r.Pieces[n-1].End(); *r.Fin != end {
			return fmt.Errorf("receive digests of %s: a FIN at %d, not at the end of the last piece (%d)", r.Conn, *r.Fin, end)
		}
	}
	return nil
}

type receivedJSON struct {
	Src    netip.AddrPort `json:"src"`
	Dst    netip.AddrPort `json:"dst"`
	Pieces string         `json:"pieces"`
	Fin    *uint32        `json:"fin,omitempty"`
}

// MarshalJSON encodes r in the layout documented at Received.
func (r Received) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, len(r.Pieces)*pieceWireLen)
	for _, p := range r.Pieces {
		b = binary.BigEndian.AppendUint32(b, p.Seq)
		b = binary.BigEndian.AppendUint32(b, p.Len)
		b = binary.BigEndian.AppendUint32(b, p.CRC)
	}
	return json.Marshal(receivedJSON{Src: r.Conn.Local, Dst: r.Conn.Remote, Pieces: base64.StdEncoding.EncodeToString(b), Fin: r.Fin})
}

// maxPiecesBase64 bounds the pieces string before it is decoded.
var maxPiecesBase64 = base64.StdEncoding.EncodedLen(MaxPieces * pieceWireLen)

// UnmarshalJSON decodes the layout documented at Received and validates the result.
func (r *Received) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil // as encoding/json does for other types; the zero value fails Validate
	}
	var j receivedJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return fmt.Errorf("receive digests: %w", err)
	}
	if len(j.Pieces) > maxPiecesBase64 {
		return fmt.Errorf("receive digests of %s->%s: %d bytes of pieces, more than %d pieces", j.Src, j.Dst, len(j.Pieces), MaxPieces)
	}
	raw, err := base64.StdEncoding.DecodeString(j.Pieces)
	if err != nil {
		return fmt.Errorf("receive digests of %s->%s: pieces: %w", j.Src, j.Dst, err)
	}
	if len(raw)%pieceWireLen != 0 {
		return fmt.Errorf("receive digests of %s->%s: %d bytes of pieces, not a multiple of %d", j.Src, j.Dst, len(raw), pieceWireLen)
	}
	out := Received{Conn: tcpflow.Tuple{Local: j.Src, Remote: j.Dst}, Fin: j.Fin}
	if len(raw) > 0 {
		out.Pieces = make([]Piece, len(raw)/pieceWireLen)
	}
	for i := range out.Pieces {
		q := raw[i*pieceWireLen:]
		out.Pieces[i] = Piece{Seq: binary.BigEndian.Uint32(q), Len: binary.BigEndian.Uint32(q[4:]), CRC: binary.BigEndian.Uint32(q[8:])}
	}
	if err := out.Validate(); err != nil {
		return err
	}
	*r = out
	return nil
}
