// Command memcounter is a memory-heavy test job: it fills --mb MiB with deterministic content shaped like
// real process memory (per 4 KiB page: 40% zero, 30% pseudo-random, 30% text), then
// prints one line per step with the step number and a checksum over the whole buffer, which it updates in
// place. Restoring it from a snapshot must reproduce exactly the lines a failure-free run prints, so a
// snapshot that lost or corrupted a page shows up as a wrong checksum.
package main

import (
	"flag"
	"fmt"
	"hash/crc32"
	"time"
)

func main() {
	mb := flag.Int("mb", 64, "MiB of memory to fill and keep touching")
	steps := flag.Int("steps", 100, "lines to print")
	delay := flag.Duration("delay", 50*time.Millisecond, "sleep between steps")
	flag.Parse()
	const page = 4096
	buf := make([]byte, *mb<<20)
	text := []byte("the quick brown fox jumps over the lazy dog; ")
	for p := 0; p*page < len(buf); p++ {
		pg := buf[p*page : (p+1)*page]
		switch p % 10 {
		case 0, 1, 2, 3: // zero pages (already zero)
		case 4, 5, 6: // xorshift, seeded by the page number
			x := uint64(p)*0x9e3779b97f4a7c15 | 1
			for i := range pg {
				x ^= x << 13
				x ^= x >> 7
				x ^= x << 17
				pg[i] = byte(x)
			}
		default:
			for i := range pg {
				pg[i] = text[(i+p)%len(text)]
			}
		}
	}
	for s := 0; s < *steps; s++ {
		// Touch one byte of every 16th page so that every snapshot has fresh dirty pages.
		for off := (s % 16) * page; off < len(buf); off += 16 * page {
			buf[off] += byte(s)
		}
		fmt.Printf("step %d crc %08x\n", s, crc32.ChecksumIEEE(buf))
		time.Sleep(*delay)
	}
}
