// Package tickgrid puts periodic wakeups on a grid of wall-clock instants, multiples of their period since
// the Unix epoch, so that loops whose periods divide each other wake a process together.
//
// A wakeup of a Go daemon costs more than the work it does: the runtime's sysmon thread, woken by the first
// system call after the process was idle, polls at 20 us intervals while the process stays busy. An agent's
// loops ticking at separate instants paid that once each (docs/design.md, "What an agent costs its host").
package tickgrid

import (
	"context"
	"time"
)

// Until is how long from now to the next multiple of period since the Unix epoch: period, not 0, when now
// is one. A period of 0 or less returns 0.
func Until(now time.Time, period time.Duration) time.Duration {
	if period <= 0 {
		return 0
	}
	return period - time.Duration(now.UnixNano()%int64(period))
}

// Within is a wait of about d that ends on the grid: how long from now to the last multiple of period at
// most d away (so more than d-period), or to the next multiple when d is shorter than period.
func Within(now time.Time, d, period time.Duration) time.Duration {
	lead := max(d-period, 0)
	return lead + Until(now.Add(lead), period)
}

// Slot is the number of the period-long interval of the grid that t falls in: two instants with the same
// slot lie between the same two multiples of period. A period of 0 or less makes every instant its own slot.
func Slot(t time.Time, period time.Duration) int64 {
	if period <= 0 {
		return t.UnixNano()
	}
	return t.UnixNano() / int64(period)
}

// Every runs fn each period until ctx ends, at multiples of period, so that loops whose periods divide each
// other wake the process together; a tick that finds fn still running is skipped, as a ticker drops it.
func Every(ctx context.Context, period time.Duration, fn func()) {
	EveryOrAt(ctx, period, func() time.Time { fn(); return time.Time{} })
}

// EveryOrAt is Every for an fn that may want its next run sooner than the next tick: at the instant it
// returns (the zero time: none).
func EveryOrAt(ctx context.Context, period time.Duration, fn func() time.Time) {
	t := time.NewTimer(Until(time.Now(), period))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		at := fn()
		now := time.Now()
		wait := Until(now, period)
		if !at.IsZero() {
			wait = min(wait, max(at.Sub(now), 0))
		}
		t.Reset(wait)
	}
}
