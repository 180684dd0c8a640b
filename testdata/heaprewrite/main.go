// Command heaprewrite is the job of the incremental-snapshot benchmark: it fills --mb MiB with content
// shaped like process memory (per 4 KiB page: 40% zero, 30% pseudo-random, 30% text, as testdata/memcounter),
// prints "ready", and then, each time it gets SIGUSR1, rewrites --pct percent of its heap (pages chosen at
// random among the non-zero ones, scattered over the heap, each given new content of its kind: new
// pseudo-random bytes or shifted text, so the changes compress as the heap does) and prints "rewrite N".
// Between signals it only sleeps, so what changes between two snapshots is exactly one rewrite.
package main

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"syscall"
)

const page = 4096

func main() {
	mb := flag.Int("mb", 256, "MiB of memory to fill")
	pct := flag.Float64("pct", 10, "percent of the pages rewritten per SIGUSR1")
	flag.Parse()
	buf := make([]byte, *mb<<20)
	text := []byte("the quick brown fox jumps over the lazy dog; ")
	pages := len(buf) / page
	for p := range pages {
		pg := buf[p*page : (p+1)*page]
		switch p % 10 {
		case 0, 1, 2, 3: // zero pages (already zero)
		case 4, 5, 6:
			fill(pg, uint64(p)*0x9e3779b97f4a7c15|1)
		default:
			for i := range pg {
				pg[i] = text[(i+p)%len(text)]
			}
		}
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	fmt.Println("ready")
	rng := rand.New(rand.NewPCG(1, 2))
	var nonzero []int
	for p := range pages {
		if p%10 >= 4 {
			nonzero = append(nonzero, p)
		}
	}
	n := min(int(float64(pages)**pct/100), len(nonzero))
	for round := 1; ; round++ {
		<-sig
		// A random selection of n distinct non-zero pages.
		for _, k := range rng.Perm(len(nonzero))[:n] {
			p := nonzero[k]
			pg := buf[p*page : (p+1)*page]
			if p%10 <= 6 {
				fill(pg, rng.Uint64()|1)
				continue
			}
			shift := rng.IntN(len(text))
			for i := range pg {
				pg[i] = text[(i+p+shift)%len(text)]
			}
		}
		fmt.Printf("rewrite %d pages %d\n", round, n)
	}
}

// fill writes xorshift bytes seeded by x.
func fill(pg []byte, x uint64) {
	for i := range pg {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		pg[i] = byte(x)
	}
}
