// Package liveness tells whether a daemon's essential loops still turn, for a service manager's watchdog
// (systemd's WatchdogSec): a loop that deadlocked, or waits on a lock held by one that did, stops marking,
// while the goroutine that notifies the manager would go on.
package liveness

import (
	"slices"
	"sync"
	"time"
)

// Loops holds when each watched loop last turned.
type Loops struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// New watches the named loops, as if each had just turned at now: a loop that never turns is stale
// once the limit passes.
func New(now time.Time, names ...string) *Loops {
	l := &Loops{last: make(map[string]time.Time, len(names))}
	for _, n := range names {
		l.last[n] = now
	}
	return l
}

// Mark records that loop name turned at now. Names New was not given are ignored: the set is fixed, so a
// typo cannot hide a loop.
func (l *Loops) Mark(name string, now time.Time) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.last[name]; ok && now.After(l.last[name]) {
		l.last[name] = now
	}
}

// Stale lists, sorted, the loops that have not turned within limit before now.
func (l *Loops) Stale(now time.Time, limit time.Duration) []string {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var stale []string
	for n, t := range l.last {
		if now.Sub(t) > limit {
			stale = append(stale, n)
		}
	}
	slices.Sort(stale)
	return stale
}
