package tickgrid

import (
	"testing"
	"time"
)

func TestUntil(t *testing.T) {
	base := time.Unix(1_800_000_000, 0) // a multiple of every period below
	for _, c := range []struct {
		now    time.Time
		period time.Duration
		want   time.Duration
	}{
		{base, 100 * time.Millisecond, 100 * time.Millisecond},
		{base.Add(30 * time.Millisecond), 100 * time.Millisecond, 70 * time.Millisecond},
		{base.Add(130 * time.Millisecond), 200 * time.Millisecond, 70 * time.Millisecond},
		{base.Add(999 * time.Millisecond), time.Second, time.Millisecond},
		{base.Add(10 * time.Millisecond), 50 * time.Millisecond, 40 * time.Millisecond},
		{base.Add(3 * time.Millisecond), 25 * time.Millisecond, 22 * time.Millisecond},
	} {
		got := Until(c.now, c.period)
		if got != c.want {
			t.Errorf("Until(base+%s, %s) = %s, want %s", c.now.Sub(base), c.period, got, c.want)
		}
		// Loops with periods that divide each other wake at the same instants.
		if at := c.now.Add(got); at.UnixNano()%int64(c.period) != 0 {
			t.Errorf("Until(base+%s, %s) lands at %s, not on a multiple of the period", c.now.Sub(base), c.period, at)
		}
	}
	if got := Until(base, 0); got != 0 {
		t.Errorf("Until(base, 0) = %s, want 0", got)
	}
}

func TestSlot(t *testing.T) {
	base := time.Unix(1_800_000_000, 0) // a multiple of 20 ms
	const p = 20 * time.Millisecond
	for _, c := range []struct {
		a, b time.Duration // offsets from base
		same bool
	}{
		{0, 19 * time.Millisecond, true},
		{time.Millisecond, 19*time.Millisecond + 999*time.Microsecond, true},
		{19 * time.Millisecond, 20 * time.Millisecond, false}, // a grid instant starts the next slot
		{-time.Millisecond, 0, false},
		{5 * time.Millisecond, 25 * time.Millisecond, false}, // a period apart is never the same slot
	} {
		if got := Slot(base.Add(c.a), p) == Slot(base.Add(c.b), p); got != c.same {
			t.Errorf("Slot(base+%s) == Slot(base+%s): %v, want %v", c.a, c.b, got, c.same)
		}
	}
	if Slot(base, 0) == Slot(base.Add(1), 0) {
		t.Error("with no period, two instants share a slot")
	}
}

func TestWithin(t *testing.T) {
	base := time.Unix(1_800_000_000, 0)
	const p = 100 * time.Millisecond
	for _, c := range []struct {
		now  time.Time
		d    time.Duration
		want time.Duration
	}{
		{base, p, p},
		{base.Add(30 * time.Millisecond), p, 70 * time.Millisecond},
		{base.Add(30 * time.Millisecond), 10 * time.Millisecond, 70 * time.Millisecond},
		{base.Add(30 * time.Millisecond), 0, 70 * time.Millisecond},
		{base.Add(30 * time.Millisecond), 2600 * time.Millisecond, 2570 * time.Millisecond},
		{base.Add(30 * time.Millisecond), 2570 * time.Millisecond, 2570 * time.Millisecond},
		{base.Add(30 * time.Millisecond), 2569 * time.Millisecond, 2470 * time.Millisecond},
	} {
		got := Within(c.now, c.d, p)
		if got != c.want {
			t.Errorf("Within(base+%v, %v, %v) = %v, want %v", c.now.Sub(base), c.d, p, got, c.want)
		}
		if end := c.now.Add(got); end.UnixNano()%int64(p) != 0 {
			t.Errorf("Within(base+%v, %v, %v) ends at %v, off the grid", c.now.Sub(base), c.d, p, end)
		}
	}
}
