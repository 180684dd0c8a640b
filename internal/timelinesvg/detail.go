package timelinesvg

import (
	"math"
	"regexp"
	"strconv"
)

// Bytes is what a stage's detail says about the bytes a recovery moved. The agent's failure log carries
// them only inside the stages' detail text, so they are read back from the phrases the agent writes:
//
//	images rewritten: "2 connection(s): 1234 bytes injected, 567 bytes to re-send, initcwnd 10"
//	replay done:      "567 bytes re-sent and discarded by the peers; ...; re-sent bytes verified: all 567 on 2 connection(s)"
//
// A detail comes from another node: unknown or malformed text yields nothing, and numbers are bounded.
type Bytes struct {
	Injected    int64 // bytes the peers had sent since the snapshot, replayed from their logs into the restored sockets
	Resent      int64 // bytes the restored job sent again, which the peers' TCP discarded as duplicates
	Verified    int64 // re-sent bytes checked against the digests of what the peers received
	Conns       int64 // connections whose re-sent bytes were verified
	HasInjected bool
	HasResent   bool
	HasVerified bool
}

// maxCount bounds any number read from a detail: a hostile peer cannot make a sum overflow.
const maxCount = 1 << 50

var (
	injectedRE = regexp.MustCompile(`\b([0-9]{1,19}) bytes injected\b`)
	resentRE   = regexp.MustCompile(`\b([0-9]{1,19}) bytes re-sent and discarded\b`)
	verifiedRE = regexp.MustCompile(`re-sent bytes verified: all ([0-9]{1,19}) on ([0-9]{1,19}) connection`)
)

// ParseDetail reads the byte counts a stage's detail states.
func ParseDetail(detail string) Bytes {
	var b Bytes
	if m := injectedRE.FindStringSubmatch(detail); m != nil {
		b.Injected, b.HasInjected = count(m[1])
	}
	if m := resentRE.FindStringSubmatch(detail); m != nil {
		b.Resent, b.HasResent = count(m[1])
	}
	if m := verifiedRE.FindStringSubmatch(detail); m != nil {
		n, ok1 := count(m[1])
		c, ok2 := count(m[2])
		if ok1 && ok2 {
			b.Verified, b.Conns, b.HasVerified = n, c, true
		}
	}
	return b
}

func count(s string) (int64, bool) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > maxCount {
		return 0, false
	}
	return n, true
}

// Add sums two stages' counts (each at most maxCount, so the sum of the bounded number of stages a
// failure holds cannot overflow; it saturates anyway).
func (b Bytes) Add(o Bytes) Bytes {
	add := func(x, y int64) int64 {
		if x > math.MaxInt64-y {
			return math.MaxInt64
		}
		return x + y
	}
	return Bytes{
		Injected: add(b.Injected, o.Injected), Resent: add(b.Resent, o.Resent),
		Verified: add(b.Verified, o.Verified), Conns: add(b.Conns, o.Conns),
		HasInjected: b.HasInjected || o.HasInjected, HasResent: b.HasResent || o.HasResent,
		HasVerified: b.HasVerified || o.HasVerified,
	}
}
