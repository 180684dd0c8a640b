package netlog

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// BenchmarkAppend measures the ring-buffer consumer's hot path: decode a record and append
// it to a Log. trim is how often the GC trims: every 2 MiB the slab pool recycles buffers,
// every 64 MiB most slabs are freshly allocated (and zeroed) by the Go runtime.
// MB/s is payload bytes; divide by 1000 for GB/s.
func BenchmarkAppend(b *testing.B) {
	for _, seg := range []int{1448, 65536} {
		for _, trimEvery := range []int{2 << 20, 64 << 20} {
			b.Run(fmt.Sprintf("seg=%d/trim=%dMiB", seg, trimEvery>>20), func(b *testing.B) {
				l, err := NewLog(Options{})
				if err != nil {
					b.Fatal(err)
				}
				defer l.Close()
				c := testConn(1)
				raw, _ := AppendRecord(nil, Record{Conn: c, Payload: textStream(seg)})
				seq := uint32(0xFFFF0000)
				var sinceTrim int
				b.SetBytes(int64(seg))
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					// The probe writes seq into the ring buffer; here the header is patched in place.
					raw[12], raw[13], raw[14], raw[15] = byte(seq), byte(seq>>8), byte(seq>>16), byte(seq>>24)
					rec, err := DecodeRecord(raw)
					if err != nil {
						b.Fatal(err)
					}
					if err := l.Append(rec); err != nil {
						b.Fatal(err)
					}
					seq += uint32(seg)
					if sinceTrim += seg; sinceTrim >= trimEvery {
						if _, err := l.Trim(c, seq); err != nil {
							b.Fatal(err)
						}
						sinceTrim = 0
					}
				}
			})
		}
	}
}

// BenchmarkAppendRetransmit appends every segment twice (a retransmission storm): the second
// copy is compared, not stored.
func BenchmarkAppendRetransmit(b *testing.B) {
	s, err := NewStore(Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	payload := textStream(1448)
	seq := uint32(1)
	b.SetBytes(2 * 1448)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if err := s.Append(seq, payload); err != nil {
			b.Fatal(err)
		}
		if err := s.Append(seq, payload); err != nil {
			b.Fatal(err)
		}
		seq += 1448
		if i%(64<<20/1448) == 0 {
			s.Trim(seq)
		}
	}
}

// BenchmarkAge measures lz4 aging of 1 MiB slabs: MB/s is raw bytes processed per second of
// the aging goroutine's time. "ratio" is compressed/raw.
func BenchmarkAge(b *testing.B) {
	const slabs = 32
	for _, kind := range []string{"text", "random"} {
		b.Run(kind, func(b *testing.B) {
			var data []byte
			if kind == "text" {
				data = textStream(slabs << 20)
			} else {
				data = testStream(1, slabs<<20)
			}
			b.SetBytes(int64(len(data)))
			var comp, raw int64
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				s, err := NewStore(Options{CompressAfter: time.Nanosecond})
				if err != nil {
					b.Fatal(err)
				}
				appendAll(b, s, 0, data, 65536)
				b.StartTimer()
				r, err := s.Age(context.Background(), time.Now().Add(time.Second))
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				comp += r.CompressedTo
				raw += r.CompressedFrom
				s.Close()
				b.StartTimer()
			}
			if raw > 0 {
				b.ReportMetric(float64(comp)/float64(raw), "ratio")
			}
		})
	}
}

// BenchmarkRange measures reading back 32 MiB (the replay path) from raw and compressed slabs.
func BenchmarkRange(b *testing.B) {
	for _, compressed := range []bool{false, true} {
		b.Run(fmt.Sprintf("compressed=%v", compressed), func(b *testing.B) {
			s, err := NewStore(Options{CompressAfter: time.Nanosecond})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			data := textStream(32 << 20)
			appendAll(b, s, 0, data, 65536)
			if compressed {
				if _, err := s.Age(context.Background(), time.Now().Add(time.Second)); err != nil {
					b.Fatal(err)
				}
			}
			b.SetBytes(int64(len(data)))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := s.WriteRange(context.Background(), discard{}, AnchorEpoch, AnchorEpoch+uint64(len(data))); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
