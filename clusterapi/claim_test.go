package clusterapi

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/spare"
)

// TestLargestHonestClaimFits: a claim for a failed node with as many jobs as a recovery request may name
// (spare.MaxPrefetch) lists one snapshot per job to prefetch, next to the spares of the run. MaxClaim counted
// the run's spares only: with long job and member names every spare refused such a claim as too long, and
// the failed node's jobs went to basic mode on the protector though spares were free.
func TestLargestHonestClaimFits(t *testing.T) {
	// A member name of 64 bytes (DNS labels of at most 63), a job name of ckpt.MaxNameLen.
	member := func(prefix string, i int) string {
		s := fmt.Sprintf("%s%d.", prefix, i)
		return s + strings.Repeat("x", 64-len(s))
	}
	job := func(i int) string {
		s := fmt.Sprintf("job%d-", i)
		return s + strings.Repeat("x", ckpt.MaxNameLen-len(s))
	}
	failed := member("failed", 0)
	cl := spare.Claim{Failure: failed + "-20260501T000000.000", By: "n1", Failed: failed,
		Need: spare.Need{Jobs: spare.MaxPrefetch, MemoryBytes: 1 << 40}, At: time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)}
	for i := range spare.MaxRunSpares {
		cl.Spares = append(cl.Spares, member("spare", i))
	}
	for i := range spare.MaxPrefetch {
		id := ckpt.SnapshotID{Time: cl.At, Node: failed, Seq: uint64(i)}
		cl.Prefetch = append(cl.Prefetch, spare.Prefetch{Job: job(i), Snapshot: id.String(), Source: member("holder", i)})
	}
	if err := cl.Validate(); err != nil {
		t.Fatal(err)
	}
	c, logs := serve(t, &fakeService{})
	ctx, cancel := context.WithTimeout(t.Context(), failAfter)
	defer cancel()
	if err := c.Claim(ctx, "n2", cl); err != nil {
		t.Fatalf("%v; server log:\n%s", err, logs.String())
	}
}
