package recvdigest

import (
	"fmt"
	"testing"

	"github.com/ftkit/ftkit/netlog"
)

// BenchmarkBookAdd measures digesting in-order records, as the Recorder does for every received segment.
func BenchmarkBookAdd(b *testing.B) {
	for _, size := range []int{1448, 64 << 10} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			book := NewBook(BookOptions{})
			payload := randomBytes(1, size)
			b.SetBytes(int64(size))
			seq := uint32(0)
			for b.Loop() {
				book.Add(netlog.Record{Conn: testConn, Seq: seq, Payload: payload})
				seq += uint32(size)
			}
		})
	}
}

// BenchmarkVerify measures checking 16 MiB of re-sent bytes.
func BenchmarkVerify(b *testing.B) {
	stream := randomBytes(2, 16<<20)
	rec := Received{Conn: testConn, Pieces: piecesOf(0, stream)}
	rs := resentOf(0, stream)
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		if _, err := Verify(rec, 0, uint32(len(stream)), Prefix{}, rs); err != nil {
			b.Fatal(err)
		}
	}
}
