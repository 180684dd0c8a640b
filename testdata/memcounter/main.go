// Command memcounter is a memory-heavy test job: it fills --mb MiB with a deterministic pattern, then
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
	buf := make([]byte, *mb<<20)
	for i := range buf {
		buf[i] = byte(i*7 + i>>12)
	}
	const page = 4096
	for s := 0; s < *steps; s++ {
		// Touch one byte of every 16th page so that every snapshot has fresh dirty pages.
		for off := (s % 16) * page; off < len(buf); off += 16 * page {
			buf[off] += byte(s)
		}
		fmt.Printf("step %d crc %08x\n", s, crc32.ChecksumIEEE(buf))
		time.Sleep(*delay)
	}
}
