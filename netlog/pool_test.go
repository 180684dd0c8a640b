package netlog

import (
	"testing"
	"time"
)

// TestSlabPoolShrink checks that shrink releases the buffers that sat unused for keep, oldest first,
// never below max, and that get reuses the most recently freed.
func TestSlabPoolShrink(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	const keep = time.Minute
	for _, tc := range []struct {
		name   string
		max    int
		keep   time.Duration
		freed  []time.Duration // when each buffer was put, after t0
		gets   int             // buffers taken back after the puts
		at     time.Duration   // when shrink runs
		pooled int             // buffers left
	}{
		{name: "all young", max: 1, keep: keep, freed: []time.Duration{0, time.Second, 2 * time.Second}, at: 30 * time.Second, pooled: 3},
		{name: "the old ones go", max: 1, keep: keep, freed: []time.Duration{0, time.Second, 50 * time.Second}, at: 61 * time.Second, pooled: 1},
		{name: "exactly keep is unused for keep", max: 0, keep: keep, freed: []time.Duration{0, 10 * time.Second}, at: keep, pooled: 1},
		{name: "never below max", max: 2, keep: keep, freed: []time.Duration{0, time.Second, 2 * time.Second}, at: time.Hour, pooled: 2},
		{name: "a reused buffer is young again", max: 0, keep: keep, freed: []time.Duration{0, 70 * time.Second}, gets: 1, at: 75 * time.Second, pooled: 1},
		{name: "no keep: only max pooled", max: 1, keep: 0, freed: []time.Duration{0, time.Second}, at: time.Second, pooled: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var m meter
			p := slabPool{max: tc.max, keep: tc.keep, m: &m}
			for i, d := range tc.freed {
				p.put(make([]byte, 8+i), t0.Add(d))
			}
			for range tc.gets {
				if b := p.get(8); len(b) != 8+len(tc.freed)-1 {
					t.Fatalf("get returned a buffer of %d bytes, want the most recently freed (%d)", len(b), 8+len(tc.freed)-1)
				}
				p.put(make([]byte, 8+len(tc.freed)-1), t0.Add(tc.at)) // freed again now
			}
			p.shrink(t0.Add(tc.at))
			if len(p.free) != tc.pooled {
				t.Fatalf("%d buffers pooled after shrink, want %d", len(p.free), tc.pooled)
			}
			var bytes int64
			for _, b := range p.free {
				bytes += int64(len(b.b))
			}
			if m.pooled.Load() != bytes {
				t.Fatalf("meter says %d pooled bytes, the pool holds %d", m.pooled.Load(), bytes)
			}
		})
	}
}
