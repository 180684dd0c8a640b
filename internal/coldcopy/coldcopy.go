// Package coldcopy copies bytes that nobody reads again soon, such as a segment moved from the sender-side
// log's ring buffer into the log, with stores that bypass the CPU's caches where the CPU has them.
//
// An ordinary copy first reads every destination line into the cache and then leaves the destination
// there, evicting what the host's other work was using. The log's consumer copies every byte a protected
// job sends: with non-temporal stores, which read no destination line and keep none, that copy costs about
// half the CPU, and the job's own transfer runs faster beside it (ftbench netlog, docs/design.md).
package coldcopy

// minCold is the shortest copy worth non-temporal stores: below it, the partly written lines that the
// ends of the copy leave cost more than the cache they spare.
const minCold = 1024

// Copy copies min(len(dst), len(src)) bytes from src to dst, like the built-in copy, and returns how
// many. The slices must not overlap. Copies of at least minCold bytes go past the caches where the
// architecture allows it; the stores are complete when Copy returns, as for the built-in copy.
func Copy(dst, src []byte) int {
	n := min(len(dst), len(src))
	if n < minCold || !haveCold {
		return copy(dst, src)
	}
	// The body in whole 64-byte lines of dst, aligned; the head and tail with the built-in copy.
	head := int(-uintptrOf(dst) & 63)
	body := (n - head) &^ 63
	copy(dst[:head], src[:head])
	coldBody(dst[head:head+body], src[head:head+body])
	copy(dst[head+body:n], src[head+body:n])
	return n
}
