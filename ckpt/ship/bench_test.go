package ship

import (
	"context"
	"io"
	"net"
	"os"
	"testing"

	"github.com/pierrec/lz4/v4"
)

// BenchmarkShip sends a 100 MB memory-like snapshot (see memoryPages) over
// loopback TCP into a protector store on disk, fsyncs included. MB/s is
// snapshot bytes per second; ratio is snapshot bytes / wire bytes.
func BenchmarkShip(b *testing.B) {
	for _, bc := range []struct {
		name string
		conc int
	}{{"1goroutine", 1}, {"2goroutines", 2}} {
		b.Run(bc.name, func(b *testing.B) {
			origin := openStore(b, "node1")
			prot := openStore(b, "prot")
			m := makeSnapshot(b, origin, "bench", map[string][]byte{
				"pages-1.img":   memoryPages(100<<20, 42),
				"pagemap-1.img": memoryPages(64<<10, 43),
				"core-1.img":    memoryPages(8<<10, 44),
				"files.img":     memoryPages(4<<10, 45),
				"inventory.img": memoryPages(100, 46),
			})
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				for {
					if _, err := Receive(context.Background(), c, prot, ReceiveOptions{}); err != nil {
						return
					}
				}
			}()
			conn, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			b.SetBytes(m.TotalSize())
			var wire int64
			b.ResetTimer()
			for range b.N {
				s, err := Send(context.Background(), conn, origin, "bench", m.ID, SendOptions{Peer: "prot", CompressConcurrency: bc.conc})
				if err != nil || s.AlreadyPresent {
					b.Fatalf("%+v %v", s, err)
				}
				wire += s.WireBytes
				b.StopTimer()
				if err := prot.Delete("bench", m.ID); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(m.TotalSize())*float64(b.N)/float64(wire), "ratio")
		})
	}
}

// BenchmarkCompressOnly isolates the compressors on the same payload: S2, which protocol 3 sends,
// and LZ4, which protocols 1 and 2 sent.
func BenchmarkCompressOnly(b *testing.B) {
	data := memoryPages(100<<20, 42)
	for _, bc := range []struct {
		name string
		new  func(io.Writer) io.WriteCloser
	}{
		{"s2", func(w io.Writer) io.WriteCloser {
			zw := newCompressor(1)
			zw.Reset(w)
			return zw
		}},
		{"lz4", func(w io.Writer) io.WriteCloser {
			zw := lz4.NewWriter(w)
			zw.Apply(lz4.ConcurrencyOption(1), lz4.ChecksumOption(false))
			return zw
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			var out countWriter
			for range b.N {
				zw := bc.new(&out)
				zw.Write(data)
				zw.Close()
			}
			b.ReportMetric(float64(len(data))*float64(b.N)/float64(out.n), "ratio")
		})
	}
}

// BenchmarkCommit measures hashing plus fsync of a 100 MB dump by the store.
func BenchmarkCommit(b *testing.B) {
	s := openStore(b, "node1")
	data := memoryPages(100<<20, 42)
	b.SetBytes(int64(len(data)))
	for range b.N {
		b.StopTimer()
		p, err := s.Begin("bench")
		if err != nil {
			b.Fatal(err)
		}
		writeFileB(b, p.Dir()+"/pages-1.img", data)
		b.StartTimer()
		if _, err := p.Commit(context.Background(), testInfo()); err != nil {
			b.Fatal(err)
		}
	}
}

type countWriter struct{ n int64 }

func (c *countWriter) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }

func writeFileB(b *testing.B, path string, data []byte) {
	b.Helper()
	if err := os.WriteFile(path, data, 0o644); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkShipDelta sends a 100 MiB pages file that differs from the protector's base in one page of 256
// (a migration's final dump against the replica taken shortly before), the base indexed ahead as a
// migration does, fsyncs included. MB/s is snapshot bytes per second.
func BenchmarkShipDelta(b *testing.B) {
	origin := openStore(b, "node1")
	prot := openStore(b, "prot")
	p1 := memoryPages(100<<20, 42)
	m1 := makeSnapshot(b, origin, "job", map[string][]byte{"pages-1.img": p1, "core-1.img": memoryPages(8<<10, 44)})
	shipPipe(b, origin, prot, m1.ID, SendOptions{})
	idx, err := IndexBase(context.Background(), origin, "job", m1.ID, 0)
	if err != nil {
		b.Fatal(err)
	}
	m2 := makeSnapshot(b, origin, "job", map[string][]byte{"pages-1.img": rewritePages(p1, 256, 1), "core-1.img": memoryPages(8<<10, 45)})
	b.SetBytes(m2.TotalSize())
	b.ResetTimer()
	for range b.N {
		sent, _ := shipPipe(b, origin, prot, m2.ID, SendOptions{Base: idx, JustCommitted: true})
		if sent.BaseID != m1.ID {
			b.Fatalf("sent against %q, want a diff against %s", sent.BaseID, m1.ID)
		}
		b.StopTimer()
		if err := prot.Delete("job", m2.ID); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
