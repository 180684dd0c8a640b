package liveness

import (
	"slices"
	"testing"
	"time"
)

func TestStale(t *testing.T) {
	t0 := time.Now()
	for _, tt := range []struct {
		name  string
		marks map[string]time.Duration // loop: when it last turned, after t0
		at    time.Duration
		want  []string
	}{
		{"none turned yet, within the limit", nil, 9 * time.Second, nil},
		{"none turned, past the limit", nil, 11 * time.Second, []string{"beats", "fence"}},
		{"one turned", map[string]time.Duration{"beats": 5 * time.Second}, 12 * time.Second, []string{"fence"}},
		{"both turned", map[string]time.Duration{"beats": 5 * time.Second, "fence": 3 * time.Second}, 12 * time.Second, nil},
		{"a mark of no watched loop", map[string]time.Duration{"other": 11 * time.Second}, 12 * time.Second, []string{"beats", "fence"}},
		{"exactly at the limit", map[string]time.Duration{"beats": 2 * time.Second, "fence": 2 * time.Second}, 12 * time.Second, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l := New(t0, "fence", "beats")
			for n, d := range tt.marks {
				l.Mark(n, t0.Add(d))
			}
			if got := l.Stale(t0.Add(tt.at), 10*time.Second); !slices.Equal(got, tt.want) {
				t.Errorf("Stale = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestMarkNeverGoesBack(t *testing.T) {
	t0 := time.Now()
	l := New(t0, "beats")
	l.Mark("beats", t0.Add(10*time.Second))
	l.Mark("beats", t0.Add(time.Second))
	if got := l.Stale(t0.Add(15*time.Second), 10*time.Second); got != nil {
		t.Errorf("an older mark moved the loop back: stale %v", got)
	}
}

func TestNil(t *testing.T) {
	var l *Loops
	l.Mark("beats", time.Now())
	if got := l.Stale(time.Now(), time.Second); got != nil {
		t.Errorf("nil Loops: stale %v", got)
	}
}
