package coldcopy

import (
	"bytes"
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// TestCopy compares Copy with the built-in copy for every alignment of both ends, lengths around the
// threshold and the 64-byte lines, and a destination or source shorter than the other; bytes past the
// copied part must stay untouched.
func TestCopy(t *testing.T) {
	const guard = 128
	src := make([]byte, 8192+guard+64)
	for i := range src {
		src[i] = byte(i*131 + i>>8)
	}
	lengths := []int{0, 1, 63, 64, minCold - 1, minCold, minCold + 1, minCold + 63, 4096, 4096 + 17, 8191}
	for _, n := range lengths {
		for _, dOff := range []int{0, 1, 7, 16, 31, 63} {
			for _, sOff := range []int{0, 3, 32} {
				for _, shorter := range []string{"none", "dst", "src"} {
					dn, sn := n, n
					switch shorter {
					case "dst":
						sn = n + 100
					case "src":
						dn = n + 100
					}
					buf := bytes.Repeat([]byte{0xee}, dOff+dn+guard)
					want := bytes.Clone(buf)
					copy(want[dOff:dOff+dn], src[sOff:sOff+sn])
					got := Copy(buf[dOff:dOff+dn], src[sOff:sOff+sn])
					name := fmt.Sprintf("n=%d dst+%d src+%d shorter=%s", n, dOff, sOff, shorter)
					if got != n {
						t.Fatalf("%s: Copy returned %d, want %d", name, got, n)
					}
					if !bytes.Equal(buf, want) {
						i := 0
						for buf[i] == want[i] {
							i++
						}
						t.Fatalf("%s: first difference at byte %d of the buffer: %#x, want %#x", name, i, buf[i], want[i])
					}
				}
			}
		}
	}
}

// BenchmarkCopy copies 64 KiB pieces, a GSO segment's size, from a 64 MiB source (the log's ring) into
// 256 MiB (the log), so that neither stays in the cache, with Copy and with the built-in copy.
func BenchmarkCopy(b *testing.B) {
	const ring, dst, piece = 64 << 20, 256 << 20, 64 << 10
	src, d := bytes.Repeat([]byte{1}, ring), bytes.Repeat([]byte{2}, dst)
	for _, bc := range []struct {
		name string
		copy func(dst, src []byte) int
	}{{"cold", Copy}, {"builtin", func(dst, src []byte) int { return copy(dst, src) }}} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(piece)
			so, do := 0, 0
			for b.Loop() {
				bc.copy(d[do:do+piece], src[so:so+piece])
				so, do = (so+piece)%ring, (do+piece)%dst
			}
		})
	}
}

// TestCopyBeforeUnmappedPage copies the last bytes of a mapping whose next page is not readable: the
// copy's prefetches reach past the source's end and must not fault.
func TestCopyBeforeUnmappedPage(t *testing.T) {
	page := unix.Getpagesize()
	m, err := unix.Mmap(-1, 0, 3*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatalf("map three pages: %v", err)
	}
	defer unix.Munmap(m)
	if err := unix.Mprotect(m[2*page:], unix.PROT_NONE); err != nil {
		t.Fatalf("make the third page unreadable: %v", err)
	}
	src := m[:2*page]
	for i := range src {
		src[i] = byte(i * 7)
	}
	for _, n := range []int{minCold, page, 2 * page} {
		dst := make([]byte, n)
		if got := Copy(dst, src[len(src)-n:]); got != n || !bytes.Equal(dst, src[len(src)-n:]) {
			t.Fatalf("copy of the last %d bytes before an unreadable page: returned %d, bytes equal %v", n, got, bytes.Equal(dst, src[len(src)-n:]))
		}
	}
}
