package recvdigest

import (
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net/netip"

	"github.com/ftkit/ftkit/tcpflow"
)

const B = BlockSize

var testConn = tcpflow.Tuple{
	Local:  netip.MustParseAddrPort("10.0.0.2:40000"),
	Remote: netip.MustParseAddrPort("10.0.0.3:5000"),
}

// randomBytes returns n reproducible pseudo-random bytes.
func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// piecesOf computes, directly on the stream, the pieces of one run of bytes starting at start: split at
// every block boundary, each with its CRC-32C.
func piecesOf(start uint32, data []byte) []Piece {
	var out []Piece
	seq := start
	for len(data) > 0 {
		n := min(int(BlockStart(seq)+B-seq), len(data)) // uint32: right across the wrap too
		out = append(out, Piece{Seq: seq, Len: uint32(n), CRC: crc32.Checksum(data[:n], castagnoli)})
		seq += uint32(n)
		data = data[n:]
	}
	return out
}

// resentOf serves the re-sent bytes from stream, whose first byte has sequence number base; bytes outside
// it are an error, like a restorer's log that does not hold them.
func resentOf(base uint32, stream []byte) func(w io.Writer, seq, n uint32) error {
	return func(w io.Writer, seq, n uint32) error {
		off := int64(int32(seq - base))
		if off < 0 || off+int64(n) > int64(len(stream)) {
			return fmt.Errorf("bytes [%d, %d) not in the log", seq, seq+n)
		}
		_, err := w.Write(stream[off : off+int64(n)])
		return err
	}
}

// crcOf is the CRC-32C of stream's bytes [a, b) (sequence numbers, stream starting at base).
func crcOf(base uint32, stream []byte, a, b uint32) uint32 {
	return crc32.Checksum(stream[a-base:b-base], castagnoli)
}
