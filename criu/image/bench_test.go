package image

import (
	"bytes"
	"os"
	"testing"
)

// BenchmarkApplyInject measures one Apply that injects 6 MiB (the largest
// replay in the relocation notes) into a stream already holding 1 MiB, plus a
// timestamp and window edit; the cost is mostly the fsync of the rewrite.
func BenchmarkApplyInject(b *testing.B) {
	queued := bytes.Repeat([]byte{1}, 1<<20)
	inject := bytes.Repeat([]byte{2}, 6<<20)
	e := baseStream(1<<20, uint32(len(queued)), 0)
	dir := synthDump(b, e, tcpEstablish, queued, nil)
	img, err := os.ReadFile(tcpStreamPath(dir, 0x2a))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(img) + len(inject)))
	for b.Loop() {
		b.StopTimer()
		writeImage(b, dir, tcpStreamName(0x2a), img)
		b.StartTimer()
		if err := Apply(dir, 0x2a, InjectReceive(inject), Timestamp(10), Windows(8<<20, 8<<20)); err != nil {
			b.Fatal(err)
		}
	}
}
